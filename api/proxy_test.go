package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// behaviour is how a scripted worker treats a request it has read whole.
type behaviour string

const (
	answerOK       behaviour = "ok"             // a normal JSON answer
	answer500      behaviour = "500"            // an internal error answer
	answer503      behaviour = "503"            // unavailable, before any body byte
	answer529      behaviour = "529"            // overloaded, before any body byte
	dropAfterBody  behaviour = "drop"           // reads the body, closes the connection
	headersThenCut behaviour = "headers-cut"    // 200 and headers, then closes before the body
	streamThenCut  behaviour = "stream-cut"     // two SSE chunks, then closes mid-stream
	hopHeaders     behaviour = "hop-headers"    // an answer carrying hop-by-hop headers
	waitForCancel  behaviour = "wait-cancelled" // holds the request until the router gives up on it
)

// scriptedWorker is a worker over real TCP whose answers the test picks.
// received counts requests it read whole: the generations it would run.
type scriptedWorker struct {
	srv      *httptest.Server
	act      behaviour
	received atomic.Int64
	header   atomic.Pointer[http.Header] // the last request's header
}

func newScriptedWorker(t *testing.T, act behaviour) *scriptedWorker {
	t.Helper()
	w := &scriptedWorker{act: act}
	w.srv = httptest.NewServer(http.HandlerFunc(w.serve))
	t.Cleanup(w.srv.Close)
	return w
}

func (w *scriptedWorker) serve(rw http.ResponseWriter, r *http.Request) {
	if _, err := io.ReadAll(r.Body); err != nil {
		return
	}
	h := r.Header.Clone()
	w.header.Store(&h)
	w.received.Add(1)
	const okBody = `{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":40,"completion_tokens":1}}`
	switch w.act {
	case answerOK:
		rw.Header().Set("Content-Type", "application/json")
		fmt.Fprint(rw, okBody)
	case answer500, answer503, answer529:
		code := map[behaviour]int{answer500: 500, answer503: 503, answer529: 529}[w.act]
		rw.Header().Set("Content-Type", "application/json")
		rw.WriteHeader(code)
		fmt.Fprintf(rw, `{"error":{"message":"engine says %d","type":"x","code":%d}}`, code, code)
	case dropAfterBody:
		hijack(rw, "")
	case headersThenCut:
		hijack(rw, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
	case streamThenCut:
		hijack(rw, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"+
			chunk("data: {\"choices\":[{\"delta\":{\"content\":\"t0\"}}]}\n\n")+chunk("data: {\"choices\":[{\"delta\":{\"content\":\"t1\"}}]}\n\n"))
	case hopHeaders:
		hijack(rw, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: X-Worker-Private, keep-alive\r\n"+
			"X-Worker-Private: secret\r\nKeep-Alive: timeout=5\r\nProxy-Authenticate: Basic\r\nUpgrade: h2c\r\n"+
			"X-End-To-End: yes\r\n"+fmt.Sprintf("Content-Length: %d\r\n\r\n%s", len(okBody), okBody))
	case waitForCancel:
		<-r.Context().Done()
	}
}

// hijack writes raw bytes on the connection and closes it: the answers a
// Go handler cannot give (a cut, hop-by-hop headers).
func hijack(rw http.ResponseWriter, raw string) {
	conn, buf, err := rw.(http.Hijacker).Hijack()
	if err != nil {
		panic(err)
	}
	defer conn.Close()
	buf.WriteString(raw)
	buf.Flush()
}

func chunk(s string) string { return fmt.Sprintf("%x\r\n%s\r\n", len(s), s) }

// refusedURL is an address nothing listens on.
func refusedURL(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln.Close()
	return "http://" + ln.Addr().String()
}

// proxyPair is a server routing model "m" over two workers: "first",
// which the router picks first (the other carries a preloaded booking),
// and "second", a healthy one.
type proxyPair struct {
	s      *Server
	rep    *fakeReplica
	second *scriptedWorker
}

const preloadID = "preload"

func newProxyPair(t *testing.T, firstURL string) proxyPair {
	t.Helper()
	rep := newFakeReplica("m", router.DefaultConfig())
	second := newScriptedWorker(t, answerOK)
	rep.addWorker("m", "first", firstURL)
	rep.addWorker("m", "second", second.srv.URL)
	rt, _ := rep.Router("m")
	rt.Load().Add(router.Booking{ID: preloadID, Worker: "second", PrefillTokens: 5000, Added: time.Now()})
	s := New(Config{Registry: prometheus.NewRegistry(), Retries: 2, Logger: testLogger(t), AllowLoopbackWorkers: true}, rep)
	return proxyPair{s: s, rep: rep, second: second}
}

// cooling reports whether w is cooling down (tried last).
func (pp proxyPair) cooling(w router.WorkerID) bool {
	got := pp.s.cool.exclude([]router.WorkerID{w, "nobody"}, time.Now())
	return len(got) == 1
}

// checkFreed fails unless only the preloaded booking is left.
func (pp proxyPair) checkFreed(t *testing.T) {
	t.Helper()
	rt, _ := pp.rep.Router("m")
	if n := rt.Load().Len(); n != 1 {
		t.Fatalf("%d bookings left, want only the preload", n)
	}
	pp.rep.mu.Lock()
	defer pp.rep.mu.Unlock()
	var adds, frees int
	for _, e := range pp.rep.events {
		adds += b2i(strings.HasPrefix(e, "add "))
		frees += b2i(strings.HasPrefix(e, "free "))
	}
	if adds != frees {
		t.Fatalf("%d bookings published, %d freed: %v", adds, frees, pp.rep.events)
	}
}

// testLogger logs into t.Log: shown only when the test fails.
func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(tLogWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tLogWriter struct{ t *testing.T }

func (w tLogWriter) Write(b []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimSuffix(string(b), "\n"))
	return len(b), nil
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestProxyRetryOnlyBeforeWork: a request goes to a second worker only when
// the first cannot have started generating; otherwise the client gets the
// failure, and the generation runs at most once.
func TestProxyRetryOnlyBeforeWork(t *testing.T) {
	cases := []struct {
		name    string
		act     behaviour // the first worker's; "" = nothing listens
		stream  bool
		code    int
		errType string // the OpenAI error type, for a failure
		via     string // X-Worker-Id
		first   int64  // requests the first worker received whole
		second  int64
		cooled  bool   // the first worker cools down
		failure string // kvrouter_worker_failures_total label
	}{
		{name: "connection refused: retried", code: 200, via: "second", second: 1, cooled: true, failure: "connect"},
		{name: "503 before any byte: retried", act: answer503, code: 200, via: "second", first: 1, second: 1, failure: "unavailable"},
		{name: "529 before any byte: retried", act: answer529, code: 200, via: "second", first: 1, second: 1, failure: "unavailable"},
		{name: "body read then dropped: not repeated", act: dropAfterBody, code: 502, errType: "worker_connection_lost", first: 1, cooled: true, failure: "dropped"},
		{name: "headers then cut: not repeated", act: headersThenCut, code: 502, errType: "worker_connection_lost", first: 1, cooled: true, failure: "dropped"},
		{name: "stream cut mid-way: not repeated", act: streamThenCut, stream: true, code: 200, via: "first", first: 1},
		{name: "500 answer: relayed, not repeated", act: answer500, code: 500, via: "first", first: 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			url := refusedURL(t)
			var first *scriptedWorker
			if tc.act != "" {
				first = newScriptedWorker(t, tc.act)
				url = first.srv.URL
			}
			pp := newProxyPair(t, url)
			body := fmt.Sprintf(chatBody, fmt.Sprintf(`,"stream":%v`, tc.stream))
			rec := do(pp.s, http.MethodPost, "/v1/chat/completions", body)
			if rec.Code != tc.code || rec.Header().Get("X-Worker-Id") != tc.via {
				t.Fatalf("status %d via %q, want %d via %q: %s", rec.Code, rec.Header().Get("X-Worker-Id"), tc.code, tc.via, rec.Body)
			}
			if tc.errType != "" {
				checkOpenAIError(t, rec, tc.errType)
			}
			if first != nil && first.received.Load() != tc.first {
				t.Errorf("first worker received %d requests, want %d", first.received.Load(), tc.first)
			}
			if n := pp.second.received.Load(); n != tc.second {
				t.Errorf("second worker received %d requests, want %d", n, tc.second)
			}
			if got := pp.cooling("first"); got != tc.cooled {
				t.Errorf("first worker cooling %v, want %v", got, tc.cooled)
			}
			if tc.failure != "" {
				if n := counterValue(pp.s.metrics.workerFailures.WithLabelValues("first", tc.failure)); n != 1 {
					t.Errorf("failures{first,%s} = %v, want 1", tc.failure, n)
				}
			}
			pp.checkFreed(t)
		})
	}
}

// TestProxyStreamCutKeepsWhatWasSent: the client of a cut stream gets the
// chunks relayed before the cut, under the worker's status, and the cut
// is counted as upstream_error.
func TestProxyStreamCutKeepsWhatWasSent(t *testing.T) {
	first := newScriptedWorker(t, streamThenCut)
	pp := newProxyPair(t, first.srv.URL)
	rec := do(pp.s, http.MethodPost, "/v1/chat/completions", fmt.Sprintf(chatBody, `,"stream":true`))
	if got := strings.Count(rec.Body.String(), "data:"); rec.Code != 200 || got != 2 {
		t.Fatalf("status %d, %d chunks: %s", rec.Code, got, rec.Body)
	}
	if n := counterValue(pp.s.metrics.requests.WithLabelValues("m", "upstream_error")); n != 1 {
		t.Fatalf("upstream_error %v, want 1", n)
	}
}

// TestProxyRetriesExhausted: every worker refuses the work; the client
// hears the last worker's reason, not "all busy".
func TestProxyRetriesExhausted(t *testing.T) {
	first := newScriptedWorker(t, answer503)
	pp := newProxyPair(t, first.srv.URL)
	pp.second.act = answer503
	rec := do(pp.s, http.MethodPost, "/v1/chat/completions", fmt.Sprintf(chatBody, ""))
	if rec.Code != http.StatusServiceUnavailable || !strings.Contains(rec.Body.String(), "engine says 503") {
		t.Fatalf("status %d: %s", rec.Code, rec.Body)
	}
	checkOpenAIError(t, rec, "worker_unavailable")
	if first.received.Load() != 1 || pp.second.received.Load() != 1 {
		t.Fatalf("received %d and %d, want one each", first.received.Load(), pp.second.received.Load())
	}
	pp.checkFreed(t)
}

func checkOpenAIError(t *testing.T, rec *httptest.ResponseRecorder, typ string) {
	t.Helper()
	var doc struct {
		Error struct {
			Message string `json:"message"`
			Type    string `json:"type"`
			Code    int    `json:"code"`
		} `json:"error"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &doc); err != nil || doc.Error.Message == "" {
		t.Fatalf("not an OpenAI error body (%v): %s", err, rec.Body)
	}
	if doc.Error.Type != typ || doc.Error.Code != rec.Code {
		t.Fatalf("error type %q code %d, want %q %d", doc.Error.Type, doc.Error.Code, typ, rec.Code)
	}
}

// TestProxyClientCancel: a client that goes away is never retried, never
// cools a worker down, and is counted as client_gone.
func TestProxyClientCancel(t *testing.T) {
	cases := []struct {
		name       string
		whileFirst bool // cancel while the first worker holds the request, else before routing
		first      int64
	}{
		{name: "while the worker works", whileFirst: true, first: 1},
		{name: "before routing"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			first := newScriptedWorker(t, waitForCancel)
			pp := newProxyPair(t, first.srv.URL)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if !tc.whileFirst {
				cancel()
			}
			req := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/chat/completions", strings.NewReader(fmt.Sprintf(chatBody, "")))
			rec := httptest.NewRecorder()
			done := make(chan struct{})
			go func() {
				defer close(done)
				pp.s.Handler().ServeHTTP(rec, req)
			}()
			if tc.whileFirst {
				poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
					if n := first.received.Load(); n != 1 {
						return fmt.Errorf("first worker received %d requests, want 1", n)
					}
					return nil
				})
				cancel()
			}
			<-done
			if rec.Code != statusClientClosed {
				t.Errorf("status %d, want %d", rec.Code, statusClientClosed)
			}
			if first.received.Load() != tc.first || pp.second.received.Load() != 0 {
				t.Errorf("received %d and %d, want %d and 0", first.received.Load(), pp.second.received.Load(), tc.first)
			}
			if pp.cooling("first") {
				t.Error("a client's cancel cooled the worker down")
			}
			if n := counterValue(pp.s.metrics.requests.WithLabelValues("m", "client_gone")); n != 1 {
				t.Errorf("client_gone %v, want 1", n)
			}
			if n := counterValue(pp.s.metrics.retries.WithLabelValues("first")); n != 0 {
				t.Errorf("retries %v, want 0", n)
			}
			pp.checkFreed(t)
		})
	}
}

// TestProxyHopByHopHeaders: connection headers cross the proxy in neither
// direction; end-to-end ones do.
func TestProxyHopByHopHeaders(t *testing.T) {
	first := newScriptedWorker(t, hopHeaders)
	pp := newProxyPair(t, first.srv.URL)
	req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(fmt.Sprintf(chatBody, "")))
	for k, v := range map[string]string{
		"Connection": "X-Client-Private, keep-alive", "X-Client-Private": "secret", "Keep-Alive": "timeout=9",
		"Proxy-Authorization": "Basic eA==", "Te": "trailers", "Upgrade": "websocket", "Trailer": "X-T",
		"Accept": "application/json",
	} {
		req.Header.Set(k, v)
	}
	rec := httptest.NewRecorder()
	pp.s.Handler().ServeHTTP(rec, req)
	if rec.Code != 200 {
		t.Fatalf("status %d: %s", rec.Code, rec.Body)
	}
	got := *first.header.Load()
	for _, k := range []string{"X-Client-Private", "Keep-Alive", "Proxy-Authorization", "Te", "Upgrade", "Trailer"} {
		if v := got.Get(k); v != "" {
			t.Errorf("worker got %s: %s", k, v)
		}
	}
	if got.Get("Accept") != "application/json" || got.Get("Content-Type") != "application/json" {
		t.Errorf("worker lost end-to-end headers: %v", got)
	}
	for _, k := range []string{"Connection", "X-Worker-Private", "Keep-Alive", "Proxy-Authenticate", "Upgrade"} {
		if v := rec.Header().Get(k); v != "" {
			t.Errorf("client got %s: %s", k, v)
		}
	}
	if rec.Header().Get("X-End-To-End") != "yes" || rec.Header().Get("X-Worker-Id") != "first" {
		t.Errorf("client lost end-to-end headers: %v", rec.Header())
	}
}

func TestProxyRemoveHopByHop(t *testing.T) {
	cases := []struct {
		name      string
		in        http.Header
		kept      []string
		stripped  []string
		forwarded []string // outboundHeader's result
	}{
		{name: "fixed list", in: http.Header{"Connection": {"close"}, "Keep-Alive": {"5"}, "Te": {"trailers"},
			"Trailer": {"X"}, "Transfer-Encoding": {"chunked"}, "Upgrade": {"h2c"}, "Proxy-Connection": {"keep-alive"},
			"Proxy-Authorization": {"x"}, "Accept": {"*/*"}},
			kept: []string{"Accept"}, stripped: []string{"Connection", "Keep-Alive", "Te", "Trailer", "Transfer-Encoding", "Upgrade", "Proxy-Connection", "Proxy-Authorization"},
			forwarded: []string{"Accept", "Content-Type"}},
		{name: "named in Connection, over several lines", in: http.Header{"Connection": {"X-A , x-b", "Accept"},
			"X-A": {"1"}, "X-B": {"2"}, "X-C": {"3"}, "Accept": {"*/*"}},
			kept: []string{"X-C"}, stripped: []string{"X-A", "X-B", "Accept"}, forwarded: []string{"Content-Type", "X-C"}},
		{name: "nothing to strip", in: http.Header{"Content-Type": {"text/plain"}, "Authorization": {"Bearer k"}},
			kept: []string{"Content-Type", "Authorization"}, forwarded: []string{"Content-Type"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			out := outboundHeader(tc.in)
			h := http.Header{}
			copyEndToEnd(h, tc.in) // the answer's direction: the same rule
			for _, k := range tc.kept {
				if h.Get(k) == "" {
					t.Errorf("%s stripped", k)
				}
			}
			for _, k := range tc.stripped {
				if h.Get(k) != "" {
					t.Errorf("%s kept", k)
				}
			}
			if len(out) != len(tc.forwarded) {
				t.Errorf("forwarded %v, want %v", out, tc.forwarded)
			}
			for _, k := range tc.forwarded {
				if out.Get(k) == "" {
					t.Errorf("%s not forwarded: %v", k, out)
				}
			}
			if out.Get("Content-Type") != "application/json" {
				t.Errorf("Content-Type %q", out.Get("Content-Type"))
			}
		})
	}
}

func TestProxyRetryable(t *testing.T) {
	s := &Server{cfg: Config{Retries: 2}}
	we := func(k failureKind) error {
		return fmt.Errorf("wrapped: %w", &workerError{worker: "w", kind: k, err: errors.New("x")})
	}
	cases := []struct {
		name    string
		err     error
		attempt int
		want    bool
	}{
		{"connect, first attempt", we(failConnect), 0, true},
		{"connect, retries left", we(failConnect), 1, true},
		{"connect, retries spent", we(failConnect), 2, false},
		{"unavailable", we(failUnavailable), 0, true},
		{"unavailable, retries spent", we(failUnavailable), 2, false},
		{"no address, whatever the attempt", we(failNoAddress), 5, true},
		{"dropped after the request was sent", we(failDropped), 0, false},
		{"client gone", fmt.Errorf("%w: %w", errClientGone, context.Canceled), 0, false},
		{"routing", fmt.Errorf("routing: %w", router.ErrAllBusy), 0, false},
		{"internal", errors.New("boom"), 0, false},
	}
	for _, tc := range cases {
		if got := s.retryable(tc.err, tc.attempt); got != tc.want {
			t.Errorf("%s: retryable %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestProxyFailureReply(t *testing.T) {
	we := func(k failureKind, status int) error {
		return &workerError{worker: "w", kind: k, status: status, err: errors.New("x")}
	}
	cases := []struct {
		name   string
		err    error
		status int
		typ    string
	}{
		{"client gone", fmt.Errorf("%w: %w", errClientGone, context.Canceled), 499, "client_closed_request"},
		{"connect", we(failConnect, 0), 502, "worker_unavailable"},
		{"no address", we(failNoAddress, 0), 502, "worker_unavailable"},
		{"dropped", we(failDropped, 0), 502, "worker_connection_lost"},
		{"503", we(failUnavailable, 503), 503, "worker_unavailable"},
		{"529", we(failUnavailable, 529), 529, "service_overloaded"},
		{"all busy", fmt.Errorf("routing: %w", router.ErrAllBusy), 529, "service_overloaded"},
		{"no workers", fmt.Errorf("routing: %w", router.ErrNoWorkers), 503, "no_workers"},
		{"internal", errors.New("boom"), 500, "internal_error"},
	}
	for _, tc := range cases {
		status, typ, msg := failureReply(tc.err, "m", 529)
		if status != tc.status || typ != tc.typ || msg == "" {
			t.Errorf("%s: %d %q %q, want %d %q", tc.name, status, typ, msg, tc.status, tc.typ)
		}
	}
}

// TestProxyDisaggDecode: the decode stage follows the same retry rule. The
// first decoder "d" (the router's pick: "d2" carries a preloaded booking)
// behaves as the case says; "d2" is healthy.
func TestProxyDisaggDecode(t *testing.T) {
	cases := []struct {
		name            string
		act             behaviour
		code            int
		via             string
		d, d2, prefills int64
		cooled          bool
	}{
		{name: "decoder refuses: retried on the other", act: answer503, code: 200, via: "d2", d: 1, d2: 1, prefills: 2},
		{name: "decoder drops after the body: not repeated", act: dropAfterBody, code: 502, d: 1, prefills: 1, cooled: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, f, p, _, _ := newDisaggServer(t, router.DisaggAlways, true)
			d := newScriptedWorker(t, tc.act)
			d2 := newPDWorker(t, "d2")
			f.mu.Lock()
			f.urls["d"], f.urls["d2"] = d.srv.URL, d2.srv.URL
			f.mu.Unlock()
			f.dr.SetWorkers(append(f.dr.Workers(), router.RoleWorker{
				WorkerInfo: router.WorkerInfo{ID: "d2", TotalBlocks: 1000, MaxBatchedTokens: 8192}, Role: router.RoleDecode}))
			_, dec := f.dr.Routers()
			busy := make([]uint64, 500) // blocks held on d2
			for i := range busy {
				busy[i] = uint64(i + 1)
			}
			dec.Load().Add(router.Booking{ID: preloadID, Worker: "d2", Hashes: busy, PrefillTokens: 5000, Added: time.Now()})

			rec := do(s, http.MethodPost, "/v1/completions", disaggBody)
			if rec.Code != tc.code || rec.Header().Get("X-Worker-Id") != tc.via {
				t.Fatalf("status %d via %q, want %d via %q: %s", rec.Code, rec.Header().Get("X-Worker-Id"), tc.code, tc.via, rec.Body)
			}
			if tc.code != 200 {
				checkOpenAIError(t, rec, "worker_connection_lost")
			}
			if d.received.Load() != tc.d || int64(len(d2.bodies())) != tc.d2 || int64(len(p.bodies())) != tc.prefills {
				t.Fatalf("d received %d, d2 %d, prefill %d; want %d, %d, %d",
					d.received.Load(), len(d2.bodies()), len(p.bodies()), tc.d, tc.d2, tc.prefills)
			}
			if n := f.dr.InFlight(); n != 0 {
				t.Fatalf("%d requests still tracked", n)
			}
			if got := len(s.cool.exclude([]router.WorkerID{"d", "nobody"}, time.Now())) == 1; got != tc.cooled {
				t.Fatalf("d cooling %v, want %v", got, tc.cooled)
			}
		})
	}
}
