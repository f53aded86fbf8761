package api

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
)

// connCounter counts the connections a test server accepted and closed.
type connCounter struct {
	opened, closed atomic.Int64
}

func (cc *connCounter) track(_ net.Conn, s http.ConnState) {
	switch s {
	case http.StateNew:
		cc.opened.Add(1)
	case http.StateClosed, http.StateHijacked:
		cc.closed.Add(1)
	}
}

func testWorkerTransport(idle time.Duration) *workerTransport {
	d := &net.Dialer{Timeout: time.Second}
	return newWorkerTransport(d.DialContext, nil, 0, idle, 4, workerWriteBuffer)
}

// post sends body through t.Post and reads the whole answer.
func post(t *testing.T, tr *workerTransport, base, path string, h http.Header, body string) (*http.Response, string) {
	t.Helper()
	sr, err := tr.Post(context.Background(), base, path, h, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := sr.Answer()
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	return resp, string(b)
}

// TestAPIWorkerTransportRequest: the hand-written request reaches a Go
// server as http.Request.Write's would (method, path under the base URL's,
// Host, length, headers, body), the answer's framings are read (length,
// chunked with a trailer, close-delimited), and requests in a row share
// one connection.
func TestAPIWorkerTransportRequest(t *testing.T) {
	var cc connCounter
	var got atomic.Pointer[string]
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		s := fmt.Sprintf("%s %s host=%s len=%d ua=%s x=%q body=%s", r.Method, r.URL.Path, r.Host, r.ContentLength,
			r.Header.Get("User-Agent"), r.Header.Values("X-Multi"), b)
		got.Store(&s)
		switch r.URL.Query().Get("frame") {
		case "chunked":
			w.Header().Set("Trailer", "X-Done")
			w.(http.Flusher).Flush()
			io.WriteString(w, "a")
			w.(http.Flusher).Flush()
			io.WriteString(w, "b")
			w.Header().Set("X-Done", "1")
		default:
			io.WriteString(w, "ok")
		}
	}))
	srv.Config.ConnState = cc.track
	srv.Start()
	defer srv.Close()
	tr := testWorkerTransport(time.Minute)
	defer tr.CloseIdleConnections()

	h := http.Header{"X-Multi": {"1", " 2 "}, "Content-Type": {"application/json"}}
	resp, body := post(t, tr, srv.URL+"/base/", "/v1/completions", h, `{"p":1}`)
	if resp.StatusCode != 200 || body != "ok" {
		t.Fatalf("%d %q", resp.StatusCode, body)
	}
	want := fmt.Sprintf(`POST /base/v1/completions host=%s len=7 ua=Go-http-client/1.1 x=["1" "2"] body={"p":1}`, srv.Listener.Addr())
	if *got.Load() != want {
		t.Fatalf("worker read\n%s\nwant\n%s", *got.Load(), want)
	}
	resp, body = post(t, tr, srv.URL, "/x?frame=chunked", http.Header{"User-Agent": {"kv"}}, "")
	if body != "ab" || resp.Trailer.Get("X-Done") != "1" {
		t.Fatalf("chunked: %q, trailer %v", body, resp.Trailer)
	}
	if !strings.Contains(*got.Load(), "ua=kv ") {
		t.Fatalf("the client's User-Agent was not kept: %s", *got.Load())
	}
	// RoundTrip (the replica's other callers) on the same pool.
	req, _ := http.NewRequest(http.MethodGet, srv.URL+"/v1/models", nil)
	rresp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, rresp.Body)
	rresp.Body.Close()
	if n := cc.opened.Load(); n != 1 {
		t.Fatalf("%d connections for three requests in a row, want 1", n)
	}
}

// TestAPIWorkerTransportBadHeader: a header that would split the request
// is refused before anything is written, as http.Transport refuses it.
func TestAPIWorkerTransportBadHeader(t *testing.T) {
	tr := testWorkerTransport(time.Minute)
	for _, h := range []http.Header{
		{"X-A": {"v\r\nX-Injected: 1"}},
		{"X-A\r\nB": {"v"}},
		{"Bad Name": {"v"}},
		{"Content-Length": {"1"}},
	} {
		_, err := tr.Post(context.Background(), "http://127.0.0.1:1", "/", h, nil)
		var we *errWrite
		if !errors.As(err, &we) || !strings.Contains(err.Error(), "invalid header") {
			t.Fatalf("%q: %v, want an invalid header refused", h, err)
		}
	}
}

// TestAPIWorkerTransportStaleIdle: a connection the worker closed while it
// was idle is not used for the next request (which would then fail after
// it was written, and never be retried).
func TestAPIWorkerTransportStaleIdle(t *testing.T) {
	var cc connCounter
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, "ok")
	}))
	srv.Config.ConnState = cc.track
	srv.Start()
	defer srv.Close()
	tr := testWorkerTransport(time.Minute)
	defer tr.CloseIdleConnections()
	post(t, tr, srv.URL, "/", nil, "1")
	srv.CloseClientConnections()
	poll.Until(t, 5*time.Second, time.Millisecond, func() error {
		if cc.closed.Load() != 1 {
			return errors.New("not closed yet")
		}
		return nil
	})
	if _, body := post(t, tr, srv.URL, "/", nil, "2"); body != "ok" {
		t.Fatalf("%q", body)
	}
	if n := cc.opened.Load(); n != 2 {
		t.Fatalf("%d connections, want 2 (the closed one replaced)", n)
	}
}

// TestAPIWorkerTransportEarlyClose: closing an answer before its end
// closes its connection at once (no reading the rest of a stream) and the
// next request takes a new one; an answer read to its end gives its
// connection back.
func TestAPIWorkerTransportEarlyClose(t *testing.T) {
	var cc connCounter
	release := make(chan struct{})
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, "first")
		w.(http.Flusher).Flush()
		if r.URL.Path == "/long" {
			select {
			case <-release:
			case <-r.Context().Done():
			}
		}
	}))
	srv.Config.ConnState = cc.track
	srv.Start()
	defer srv.Close()
	defer close(release)
	tr := testWorkerTransport(time.Minute)
	defer tr.CloseIdleConnections()

	sr, err := tr.Post(context.Background(), srv.URL, "/long", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := sr.Answer()
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(resp.Body)
	if s, _ := br.Peek(5); string(s) != "first" {
		t.Fatalf("%q", s)
	}
	closed := make(chan struct{})
	go func() { resp.Body.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("closing the body waited for the rest of the answer")
	}
	post(t, tr, srv.URL, "/short", nil, "")
	post(t, tr, srv.URL, "/short", nil, "")
	if n := cc.opened.Load(); n != 2 {
		t.Fatalf("%d connections, want 2 (the cut one, then one reused)", n)
	}
}

// TestAPIWorkerTransportCancel: the request's context cuts a connection
// blocked waiting for the answer.
func TestAPIWorkerTransportCancel(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
	}))
	defer srv.Close()
	tr := testWorkerTransport(time.Minute)
	ctx, cancel := context.WithCancel(context.Background())
	sr, err := tr.Post(ctx, srv.URL, "/", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, err = sr.Answer()
	}()
	cancel()
	wg.Wait()
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("%v, want the context's error", err)
	}
}

// TestAPIWorkerTransportIdleExpiry: an idle connection is closed after the
// idle time (before the engines' own keep-alive timeout closes it).
func TestAPIWorkerTransportIdleExpiry(t *testing.T) {
	var cc connCounter
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	srv.Config.ConnState = cc.track
	srv.Start()
	defer srv.Close()
	tr := testWorkerTransport(50 * time.Millisecond)
	post(t, tr, srv.URL, "/", nil, "")
	poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
		if cc.closed.Load() != 1 {
			return errors.New("idle connection still open")
		}
		return nil
	})
	tr.mu.Lock()
	n := len(tr.pools[srv.URL])
	tr.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d expired connections still pooled", n)
	}
}

// TestAPIWorkerTransportNoBodyReused: an answer without a body (204)
// closed unread gives its connection back.
func TestAPIWorkerTransportNoBodyReused(t *testing.T) {
	var cc connCounter
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusNoContent)
	}))
	srv.Config.ConnState = cc.track
	srv.Start()
	defer srv.Close()
	tr := testWorkerTransport(time.Minute)
	defer tr.CloseIdleConnections()
	for range 3 {
		sr, err := tr.Post(context.Background(), srv.URL, "/", nil, []byte("x"))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := sr.Answer()
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != http.StatusNoContent {
			t.Fatalf("status %d", resp.StatusCode)
		}
		resp.Body.Close()
	}
	if n := cc.opened.Load(); n != 1 {
		t.Fatalf("%d connections for three bodiless answers, want 1", n)
	}
}
