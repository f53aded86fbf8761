package api

import (
	"bufio"
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

func TestAPIWorkerURL(t *testing.T) {
	for _, c := range []struct {
		url       string
		ok, local bool // ok without AllowLoopbackWorkers; local: ok with it
	}{
		{"http://10.0.0.7:8000", true, true},
		{"https://worker-3.example.com", true, true},
		{"http://worker:8000/prefix", true, true},
		{"http://[2001:db8::1]:8000", true, true},
		{"gopher://10.0.0.7:70", false, false},
		{"file:///etc/passwd", false, false},
		{"ftp://10.0.0.7", false, false},
		{"10.0.0.7:8000", false, false},
		{"http:opaque", false, false},
		{"http://", false, false},
		{"http://:8000", false, false},
		{"http://user:pw@10.0.0.7:8000", false, false},
		{"http://user@10.0.0.7", false, false},
		{"http://10.0.0.7:8000/?x=1", false, false},
		{"http://10.0.0.7:8000/#frag", false, false},
		{"http://10.0.0.7:0", false, false},
		{"http://10.0.0.7:99999", false, false},
		{"http://127.0.0.1:8000", false, true},
		{"http://127.1.2.3", false, true},
		{"http://localhost:8000", false, true},
		{"http://LOCALHOST.:8000", false, true},
		{"http://a.localhost", false, true},
		{"http://[::1]:8000", false, true},
		{"http://[::ffff:127.0.0.1]:8000", false, true},
		{"http://169.254.169.254/latest", false, true},
		{"http://[fe80::1%25eth0]:8000", false, true},
		{"http://0.0.0.0:8000", false, true},
		{"http://[::]:8000", false, true},
		{"http://224.0.0.1", false, true},
	} {
		t.Run(c.url, func(t *testing.T) {
			if err := checkWorkerURL(c.url, false); (err == nil) != c.ok {
				t.Errorf("strict: %v", err)
			}
			if err := checkWorkerURL(c.url, true); (err == nil) != c.local {
				t.Errorf("AllowLoopbackWorkers: %v", err)
			}
		})
	}
}

// registerStatus posts a registration and returns the status.
func registerStatus(t *testing.T, s *Server, id, model, url string) (int, string) {
	t.Helper()
	rec := do(s, "POST", "/workers/register", fmt.Sprintf(`{"id":%q,"url":%q,"model":%q,"block_size":16}`, id, url, model))
	return rec.Code, rec.Body.String()
}

func TestAPIRegisterBounds(t *testing.T) {
	rep := newFakeReplica("m", router.DefaultConfig())
	rep.addWorker("m", "w1", "http://10.0.0.1:8000")
	rep.addWorker("m", "w1#1", "http://10.0.0.1:8000") // a second rank: still one worker
	s := New(Config{Registry: prometheus.NewRegistry(), MaxWorkers: 2, MaxModels: 1}, rep)
	for _, c := range []struct {
		id, model, url string
		want           int
	}{
		{"w2", "m", "http://127.0.0.1:9000", http.StatusBadRequest}, // loopback without AllowLoopbackWorkers
		{"w2", "m", "gopher://10.0.0.2:70", http.StatusBadRequest},
		{"w2", "m", "http://u:p@10.0.0.2", http.StatusBadRequest},
		{"w2", "m", "http://10.0.0.2:8000", http.StatusOK},
		{"w3", "m", "http://10.0.0.3:8000", http.StatusTooManyRequests}, // third worker
		{"w1", "m", "http://10.0.0.1:8001", http.StatusOK},              // renewal of a registered worker
		{"w2", "other", "http://10.0.0.2:8000", http.StatusTooManyRequests},
	} {
		if got, body := registerStatus(t, s, c.id, c.model, c.url); got != c.want {
			t.Errorf("register %s %s %s: %d %s, want %d", c.id, c.model, c.url, got, body, c.want)
		}
	}
}

// TestAPIDialGuard: a worker whose registered address is loopback (say a
// hostname that resolved there) is not dialled without
// AllowLoopbackWorkers.
func TestAPIDialGuard(t *testing.T) {
	rep := newFakeReplica("m", router.DefaultConfig())
	var hits atomic.Int64
	w := fakeWorker(t, &hits)
	rep.addWorker("m", "w1", w.URL)
	s := New(Config{Registry: prometheus.NewRegistry(), Logger: testLogger(t)}, rep)
	rec := do(s, "POST", "/v1/chat/completions", fmt.Sprintf(chatBody, ""))
	if rec.Code != http.StatusBadGateway || hits.Load() != 0 {
		t.Fatalf("loopback worker: %d, %d hits: %s", rec.Code, hits.Load(), rec.Body)
	}
}

func TestAPIPriorityCap(t *testing.T) {
	s := New(Config{Registry: prometheus.NewRegistry(), MaxPriority: 1, MaxPriorityByKey: map[string]int{"gold-key": 10},
		APIKeys: []string{"gold-key", "other"}}, newFakeReplica("m", router.DefaultConfig()))
	for _, c := range []struct {
		key      string
		in, want int
	}{
		{"", 5, 1}, {"other", 5, 1}, {"gold-key", 5, 5}, {"gold-key", 50, 10}, {"", -3, -3}, {"", 1 << 40, 1},
	} {
		if got := s.capPriority(c.key, c.in); got != c.want {
			t.Errorf("key %q priority %d: %d, want %d", c.key, c.in, got, c.want)
		}
	}
	if s := New(Config{Registry: prometheus.NewRegistry()}, newFakeReplica("m", router.DefaultConfig())); s.capPriority("", 7) != 0 {
		t.Error("default cap is not 0")
	}
	open := New(Config{Registry: prometheus.NewRegistry(), MaxPriorityByKey: map[string]int{"gold-key": 10}}, newFakeReplica("m", router.DefaultConfig()))
	if open.capPriority("gold-key", 5) != 0 {
		t.Error("a per-key cap applied on an endpoint that checks no keys")
	}
}

func TestAPIQueueCap(t *testing.T) {
	cfg := router.DefaultConfig()
	cfg.QueueThreshold = ptr(0.0)
	rep := newFakeReplica("m", cfg)
	var hits atomic.Int64
	rep.addWorker("m", "w1", fakeWorker(t, &hits).URL)
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, MaxQueue: 1}, rep)
	rt, _ := rep.Router("m")
	rt.Load().Add(router.Booking{ID: "blocker", Worker: "w1", PrefillTokens: 100, Added: time.Now()})
	srv := httptest.NewServer(s.Handler())
	defer srv.Close()
	first := postQueued(t, s, srv.URL)
	rec := do(s, "POST", "/v1/chat/completions", fmt.Sprintf(chatBody, ""))
	var e struct {
		Error struct {
			Message, Type string
			Code          int
		}
	}
	// A full queue is overload, as Dynamo answers it: 529 (--busy-status).
	if rec.Code != 529 || json.Unmarshal(rec.Body.Bytes(), &e) != nil ||
		e.Error.Type != "service_overloaded" || e.Error.Code != 529 || rec.Header().Get("Retry-After") == "" {
		t.Fatalf("second request: %d %s", rec.Code, rec.Body)
	}
	rt.PrefillDone("blocker")
	rt.Free("blocker")
	s.gates.wake("m")
	if code := <-first; code != 200 {
		t.Fatalf("queued request: %d", code)
	}
	// The slot is free again.
	if rec := do(s, "POST", "/v1/chat/completions", fmt.Sprintf(chatBody, "")); rec.Code != 200 {
		t.Fatalf("after the queue drained: %d %s", rec.Code, rec.Body)
	}
}

// hungWorker sends a streamed answer's headers (and with chunk, one chunk),
// then nothing until the test ends.
func hungWorker(t *testing.T, headers, chunk bool) string {
	t.Helper()
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if headers {
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(200)
			if chunk {
				fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"t0\"}}]}\n\n")
			}
			w.(http.Flusher).Flush()
		}
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(func() { close(release); srv.Close() })
	return srv.URL
}

// TestAPIHungWorkerFreesBooking: a worker that stops sending is cut after
// the idle (or header) timeout, its booking is freed, and the client gets
// an answer: a 502 before any byte, the cut stream after.
func TestAPIHungWorkerFreesBooking(t *testing.T) {
	for _, c := range []struct {
		name            string
		headers, chunk  bool
		wantCode        int
		wantBodyContain string
	}{
		{"no headers", false, false, http.StatusBadGateway, "worker_connection_lost"},
		{"headers then nothing", true, false, http.StatusBadGateway, "worker_connection_lost"},
		{"one chunk then nothing", true, true, http.StatusOK, "t0"},
	} {
		t.Run(c.name, func(t *testing.T) {
			pp := newProxyPair(t, hungWorker(t, c.headers, c.chunk))
			pp.s = New(Config{Registry: prometheus.NewRegistry(), Retries: 2, Logger: testLogger(t), AllowLoopbackWorkers: true,
				WorkerHeaderTimeout: 300 * time.Millisecond, WorkerIdleTimeout: 300 * time.Millisecond}, pp.rep)
			srv := httptest.NewServer(pp.s.Handler())
			defer srv.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+"/v1/chat/completions", strings.NewReader(fmt.Sprintf(chatBody, `,"stream":true`)))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != c.wantCode || !strings.Contains(string(body), c.wantBodyContain) {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
			if resp.Header.Get("X-Worker-Id") == "second" || pp.second.received.Load() != 0 {
				t.Fatal("a request the hung worker had was sent to another worker")
			}
			poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
				rt, _ := pp.rep.Router("m")
				if n := rt.Load().Len(); n != 1 {
					return fmt.Errorf("%d bookings", n)
				}
				return nil
			})
			pp.checkFreed(t)
		})
	}
}

// startServer serves h with NewHTTPServer on a loopback port.
func startServer(t *testing.T, h http.Handler, o ServerOptions) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	o.Logger = testLogger(t)
	srv := NewHTTPServer(h, o)
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return ln.Addr().String()
}

// TestAPISlowlorisBody: a client sending its body a byte a second is cut
// once the body deadline passes (it would need 1000 s to finish).
func TestAPISlowlorisBody(t *testing.T) {
	s, _, hits := newTestServer(t, router.DefaultConfig())
	addr := startServer(t, s.Handler(), ServerOptions{BodyReadTimeout: time.Second})
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: r1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			if _, err := conn.Write([]byte("{")); err != nil {
				return
			}
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	// Only "it ended": an answer then the close, or the close alone.
	conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err == nil {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode < 400 {
			t.Fatalf("slow body answered %d", resp.StatusCode)
		}
	} else if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
		t.Fatal("the server still waits for the slow body")
	}
	if hits.Load() != 0 {
		t.Fatal("a partial body reached the worker")
	}
}

// TestAPIBodyDeadlineLiftedForStreams: the body deadline ends with the
// body; an answer streaming for longer than it is not cut.
func TestAPIBodyDeadlineLiftedForStreams(t *testing.T) {
	worker := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 4 {
			fmt.Fprintf(w, "data: {\"choices\":[{\"delta\":{\"content\":\"t%d\"}}]}\n\n", i)
			w.(http.Flusher).Flush()
			time.Sleep(150 * time.Millisecond) // the worker's pace, not synchronisation
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	defer worker.Close()
	rep := newFakeReplica("m", router.DefaultConfig())
	rep.addWorker("m", "w1", worker.URL)
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, Logger: testLogger(t)}, rep)
	addr := startServer(t, s.Handler(), ServerOptions{BodyReadTimeout: 200 * time.Millisecond})
	resp, err := http.Post("http://"+addr+"/v1/chat/completions", "application/json", strings.NewReader(fmt.Sprintf(chatBody, `,"stream":true`)))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), "[DONE]") {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
}

func TestAPIHTTPServerOptions(t *testing.T) {
	srv := NewHTTPServer(http.NotFoundHandler(), ServerOptions{})
	if srv.ReadHeaderTimeout != 10*time.Second || srv.IdleTimeout != 120*time.Second || srv.MaxHeaderBytes != 64<<10 || srv.WriteTimeout != 0 {
		t.Fatalf("defaults: %+v", srv)
	}
}

// statusReplica is a fake whose status names credentials.
type statusReplica struct {
	*fakeReplica
	status map[string]any
	err    error
}

func (r statusReplica) Status(bool) map[string]any { return r.status }
func (r statusReplica) RegisterWorker(context.Context, WorkerSpec) error {
	return r.err
}

func TestAPIStatusProtectionAndRedaction(t *testing.T) {
	rep := statusReplica{fakeReplica: newFakeReplica("m", router.DefaultConfig()),
		status: map[string]any{"node_id": "r1", "nats": "nats://kv:hunter22@10.0.0.1:4222",
			"bus": map[string]any{"token": "tok-123456", "peers": []string{"nats://a:b@r2:6222"}}, "applied_index": uint64(1) << 60},
		err: fmt.Errorf("%w: propose via http://admin:s3cret@r2:8001 with admin-token-xyz", ErrUnavailable)}
	for _, protect := range []bool{false, true} {
		s := New(Config{Registry: prometheus.NewRegistry(), AdminToken: "admin-token-xyz", ProtectStatus: protect}, rep)
		for _, path := range []string{"/cluster/status", "/metrics"} {
			open := do(s, "GET", path, "")
			if (open.Code == http.StatusUnauthorized) != protect {
				t.Errorf("protect %v: %s answered %d without the token", protect, path, open.Code)
			}
			req := httptest.NewRequest("GET", path, nil)
			req.Header.Set("Authorization", "Bearer admin-token-xyz")
			rec := httptest.NewRecorder()
			s.Handler().ServeHTTP(rec, req)
			if rec.Code != 200 {
				t.Errorf("%s with the token: %d", path, rec.Code)
			}
			if path == "/cluster/status" {
				b := rec.Body.String()
				if strings.Contains(b, "hunter22") || strings.Contains(b, "tok-123456") || strings.Contains(b, "a:b@") ||
					!strings.Contains(b, "1152921504606846976") || !strings.Contains(b, "10.0.0.1:4222") {
					t.Errorf("status not redacted (or damaged): %s", b)
				}
			}
		}
		req := httptest.NewRequest("POST", "/workers/register", strings.NewReader(`{"id":"w9","url":"http://10.0.0.9:8000","model":"m","block_size":16}`))
		req.Header.Set("Authorization", "Bearer admin-token-xyz")
		rec := httptest.NewRecorder()
		s.Handler().ServeHTTP(rec, req)
		if rec.Code != http.StatusServiceUnavailable || strings.Contains(rec.Body.String(), "s3cret") || strings.Contains(rec.Body.String(), "admin-token-xyz") {
			t.Errorf("register error not redacted: %d %s", rec.Code, rec.Body)
		}
	}
}

func TestAPIConfigLogValueRedacts(t *testing.T) {
	var b strings.Builder
	slog.New(slog.NewTextHandler(&b, nil)).Info("config", "api", Config{AdminToken: "admin-secret", APIKeys: []string{"key-secret"}})
	if strings.Contains(b.String(), "secret") || !strings.Contains(b.String(), redacted) {
		t.Fatalf("logged: %s", b.String())
	}
}

// TestAPIClientCertCheck: Config.ClientCert guards the inference endpoints
// (/v1/*, /tokenize, /detokenize) with an OpenAI-shaped 401 naming why,
// and nothing else (/health, /ready, admin and status keep their own
// rules).
func TestAPIClientCertCheck(t *testing.T) {
	rep := newFakeReplica("m", router.DefaultConfig())
	var hits atomic.Int64
	rep.addWorker("m", "w1", fakeWorker(t, &hits).URL)
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, ClientCert: func(r *http.Request) error {
		if r.Header.Get("X-Test-Cert") == "client" {
			return nil
		}
		return errors.New("no client certificate presented")
	}}, rep)
	for _, tc := range []struct {
		method, path, body string
		cert               bool
		want               int
	}{
		{"POST", "/v1/chat/completions", fmt.Sprintf(chatBody, ""), false, 401},
		{"POST", "/v1/chat/completions", fmt.Sprintf(chatBody, ""), true, 200},
		{"GET", "/v1/models", "", false, 401},
		{"POST", "/tokenize", `{"model":"m","prompt":"hi"}`, false, 401},
		{"POST", "/detokenize", `{"model":"m","tokens":[1]}`, false, 401},
		{"GET", "/health", "", false, 200},
		{"GET", "/ready", "", false, 200},
		{"GET", "/cluster/status", "", false, 200},
	} {
		req := httptest.NewRequest(tc.method, tc.path, strings.NewReader(tc.body))
		req.Header.Set("Content-Type", "application/json")
		if tc.cert {
			req.Header.Set("X-Test-Cert", "client")
		}
		rec := httptest.NewRecorder()
		s.Handler().ServeHTTP(rec, req)
		if rec.Code != tc.want && !(tc.want == 200 && tc.path == "/ready" && rec.Code == 503) {
			t.Errorf("%s %s (certificate %v): %d %s, want %d", tc.method, tc.path, tc.cert, rec.Code, rec.Body, tc.want)
		}
		if tc.want == 401 && !strings.Contains(rec.Body.String(), "client certificate required: no client certificate presented") {
			t.Errorf("%s %s: body %s does not say why", tc.method, tc.path, rec.Body)
		}
	}
	if hits.Load() != 1 {
		t.Errorf("the worker saw %d requests, want 1 (only the one with a certificate)", hits.Load())
	}
}
