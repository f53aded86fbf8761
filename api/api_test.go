package api

import (
	"encoding/json"
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

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// fakeWorker answers OpenAI requests like a worker: plain JSON with usage,
// or an SSE stream of three chunks.
func fakeWorker(t *testing.T, hits *atomic.Int64) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		var body struct {
			Stream bool `json:"stream"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		if body.Stream {
			w.Header().Set("Content-Type", "text/event-stream")
			for i := range 3 {
				fmt.Fprintf(w, "data: {\"choices\":[{\"delta\":{\"content\":\"t%d\"}}]}\n\n", i)
				w.(http.Flusher).Flush()
			}
			fmt.Fprint(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\ndata: [DONE]\n\n")
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":40,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}`)
	}))
	t.Cleanup(srv.Close)
	return srv
}

func newTestServer(t *testing.T, cfg router.Config) (*Server, *fakeReplica, *atomic.Int64) {
	t.Helper()
	rep := newFakeReplica("m", cfg)
	var hits atomic.Int64
	w := fakeWorker(t, &hits)
	rep.addWorker("m", "w1", w.URL)
	s := New(Config{Registry: prometheus.NewRegistry(), Retries: 2, AllowLoopbackWorkers: true}, rep)
	return s, rep, &hits
}

func do(s *Server, method, path, body string) *httptest.ResponseRecorder {
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(method, path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	s.Handler().ServeHTTP(rec, req)
	return rec
}

const chatBody = `{"model":"m","messages":[{"role":"user","content":"hello there, a prompt long enough to fill a couple of blocks of sixteen tokens each, yes"}]%s}`

func TestAPIChatPlainAndStream(t *testing.T) {
	s, rep, hits := newTestServer(t, router.DefaultConfig())
	rec := do(s, "POST", "/v1/chat/completions", fmt.Sprintf(chatBody, ""))
	if rec.Code != 200 || rec.Header().Get("X-Worker-Id") != "w1" || !strings.Contains(rec.Body.String(), `"hi"`) {
		t.Fatalf("plain: %d %q %s", rec.Code, rec.Header().Get("X-Worker-Id"), rec.Body)
	}
	rec = do(s, "POST", "/v1/chat/completions", fmt.Sprintf(chatBody, `,"stream":true`))
	if rec.Code != 200 || !strings.Contains(rec.Body.String(), "data: [DONE]") || strings.Count(rec.Body.String(), "data:") != 5 {
		t.Fatalf("stream: %d %s", rec.Code, rec.Body)
	}
	if hits.Load() != 2 {
		t.Errorf("worker hits %d", hits.Load())
	}
	rt, _ := rep.Router("m")
	if n := rt.Load().Len(); n != 0 {
		t.Errorf("%d requests still booked after completion", n)
	}
	// The router learns the output lengths the worker reported (1 and 3
	// completion tokens) for kv-pooled's decode reserve.
	if mean, n := rt.ObservedOutputTokens(); n != 2 || mean != 2 {
		t.Errorf("observed output tokens: mean %v over %d requests, want 2 over 2", mean, n)
	}
	// Each request: add, prefill done, the cache audit, free — in that order;
	// the streamed answer's usage chunk reports 16 cached tokens.
	kinds := []string{"add ", "prefill ", "audit w1 0/0", "free ", "add ", "prefill ", "audit w1 0/16", "free "}
	if len(rep.events) != len(kinds) {
		t.Fatalf("load notifications %v", rep.events)
	}
	for i, k := range kinds {
		if !strings.HasPrefix(rep.events[i], k) {
			t.Errorf("notification %d = %q, want %q…", i, rep.events[i], k)
		}
	}
	rec = do(s, "POST", "/v1/completions", `{"model":"m","prompt":"once upon a time"}`)
	if rec.Code != 200 {
		t.Errorf("completions: %d %s", rec.Code, rec.Body)
	}
	rec = do(s, "GET", "/v1/models", "")
	if rec.Code != 200 || !strings.Contains(rec.Body.String(), `"id":"m"`) {
		t.Errorf("models: %d %s", rec.Code, rec.Body)
	}
}

func TestAPIBadInput(t *testing.T) {
	s, _, hits := newTestServer(t, router.DefaultConfig())
	big := fmt.Sprintf(`{"model":"m","prompt":"%s"}`, strings.Repeat("x", 9<<20))
	tests := []struct {
		name, path, body string
		code             int
	}{
		{"invalid json", "/v1/chat/completions", `{"model":`, 400},
		{"no model", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]}`, 400},
		{"unknown model", "/v1/chat/completions", `{"model":"nope","messages":[{"role":"user","content":"x"}]}`, 404},
		{"no messages", "/v1/chat/completions", `{"model":"m","messages":[]}`, 400},
		{"image part", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]}`, 400},
		{"bad prompt", "/v1/completions", `{"model":"m","prompt":{"a":1}}`, 400},
		{"too large", "/v1/completions", big, 413},
		{"unknown path", "/v2/x", `{}`, 404},
	}
	for _, tc := range tests {
		rec := do(s, "POST", tc.path, tc.body)
		if rec.Code != tc.code {
			t.Errorf("%s: %d, want %d: %s", tc.name, rec.Code, tc.code, rec.Body.String()[:min(200, rec.Body.Len())])
		}
		var doc struct {
			Error struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if json.Unmarshal(rec.Body.Bytes(), &doc) != nil || doc.Error.Message == "" {
			t.Errorf("%s: not an OpenAI error body: %s", tc.name, rec.Body.String()[:min(200, rec.Body.Len())])
		}
	}
	if hits.Load() != 0 {
		t.Errorf("bad requests reached the worker %d times", hits.Load())
	}
}

func TestAPIAllBusyAndRetry(t *testing.T) {
	cfg := router.DefaultConfig()
	cfg.Thresholds.ActivePrefillTokens = ptr(int64(0))
	s, rep, _ := newTestServer(t, cfg)
	rt, _ := rep.Router("m")
	rt.Load().Add(router.Booking{ID: "x", Worker: "w1", PrefillTokens: 5, Added: time.Now()})
	rec := do(s, "POST", "/v1/chat/completions", fmt.Sprintf(chatBody, ""))
	if rec.Code != 529 || !strings.Contains(rec.Body.String(), "busy") {
		t.Errorf("all busy: %d %s", rec.Code, rec.Body)
	}

	// A dead worker: the request is retried on the live one.
	s, rep, hits := newTestServer(t, router.DefaultConfig())
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	dead := "http://" + ln.Addr().String()
	ln.Close()
	rep.addWorker("m", "w0-dead", dead)
	for range 4 {
		rec := do(s, "POST", "/v1/chat/completions", fmt.Sprintf(chatBody, ""))
		if rec.Code != 200 || rec.Header().Get("X-Worker-Id") != "w1" {
			t.Fatalf("retry: %d via %q", rec.Code, rec.Header().Get("X-Worker-Id"))
		}
	}
	if hits.Load() != 4 {
		t.Errorf("live worker hits %d", hits.Load())
	}
	// The dead worker cools down after its first failure: later requests
	// do not try it first, so at most one retry was needed.
	if n := counterValue(s.metrics.retries.WithLabelValues("w0-dead")); n > 1 {
		t.Errorf("dead worker tried %v times, want at most once", n)
	}
}

func TestAPIBusyThreshold(t *testing.T) {
	s, _, _ := newTestServer(t, router.DefaultConfig())
	tests := []struct {
		name, method, body string
		code               int
		want               string
	}{
		{"get empty", "GET", "", 200, `{"thresholds":[{"model":"m","active_decode_blocks_threshold":null,"active_prefill_tokens_threshold":null,"active_prefill_tokens_threshold_frac":null}]}`},
		{"set decode", "POST", `{"model":"m","active_decode_blocks_threshold":0.77}`, 200, `{"model":"m","active_decode_blocks_threshold":0.77,"active_prefill_tokens_threshold":null,"active_prefill_tokens_threshold_frac":null}`},
		{"read only", "POST", `{"model":"m"}`, 200, `"active_decode_blocks_threshold":0.77`},
		{"set prefill keeps decode", "POST", `{"model":"m","active_prefill_tokens_threshold":500}`, 200, `{"model":"m","active_decode_blocks_threshold":0.77,"active_prefill_tokens_threshold":500,"active_prefill_tokens_threshold_frac":null}`},
		{"null leaves as is (Dynamo)", "POST", `{"model":"m","active_decode_blocks_threshold":null}`, 200, `"active_decode_blocks_threshold":0.77`},
		{"clear (our extension)", "POST", `{"model":"m","clear":["active_decode_blocks_threshold"]}`, 200, `"active_decode_blocks_threshold":null,"active_prefill_tokens_threshold":500`},
		{"clear an unknown name", "POST", `{"model":"m","clear":["threshold"]}`, 400, `"error"`},
		{"decode above 1", "POST", `{"model":"m","active_decode_blocks_threshold":1.5}`, 400, `"error"`},
		{"negative", "POST", `{"model":"m","active_prefill_tokens_threshold":-3}`, 400, `"error"`},
		{"negative frac", "POST", `{"model":"m","active_prefill_tokens_threshold_frac":-0.1}`, 400, `"error"`},
		{"string value (422 as Dynamo)", "POST", `{"model":"m","active_decode_blocks_threshold":"high"}`, 422, `"error"`},
		{"unknown field ignored, reported", "POST", `{"model":"m","threshold":1}`, 200, `"ignored_fields":["threshold"]`},
		{"set for an unknown model", "POST", `{"model":"zz","active_decode_blocks_threshold":0.5}`, 404, `"error"`},
		{"read of an unknown model: nulls (Dynamo)", "POST", `{"model":"zz"}`, 200, `{"model":"zz","active_decode_blocks_threshold":null,"active_prefill_tokens_threshold":null,"active_prefill_tokens_threshold_frac":null}`},
		{"malformed", "POST", `{"model":`, 400, `"error"`},
	}
	for _, tc := range tests {
		rec := do(s, tc.method, "/busy_threshold", tc.body)
		if rec.Code != tc.code || !strings.Contains(rec.Body.String(), tc.want) {
			t.Errorf("%s: %d %s, want %d containing %s", tc.name, rec.Code, rec.Body, tc.code, tc.want)
		}
	}
}

func TestAPIReadyDebugAndMetrics(t *testing.T) {
	s, rep, _ := newTestServer(t, router.DefaultConfig())
	if rec := do(s, "GET", "/ready", ""); rec.Code != 200 {
		t.Errorf("ready: %d", rec.Code)
	}
	rep.ready = false
	if rec := do(s, "GET", "/ready", ""); rec.Code != 503 || !strings.Contains(rec.Body.String(), "no leader") {
		t.Errorf("not ready: %d %s", rec.Code, rec.Body)
	}
	// Not ready but not draining: 503 whatever the load balancer asks.
	if rec := do(s, "GET", "/ready?draining=404", ""); rec.Code != 503 {
		t.Errorf("not ready, not draining, asked for 404: %d", rec.Code)
	}
	// Draining: 503 by contract, 404 to a load balancer that asks for it.
	rep.drain = true
	if rec := do(s, "GET", "/ready", ""); rec.Code != 503 {
		t.Errorf("draining: %d", rec.Code)
	}
	if rec := do(s, "GET", "/ready?draining=404", ""); rec.Code != 404 || !strings.Contains(rec.Body.String(), `"ready":false`) {
		t.Errorf("draining, asked for 404: %d %s", rec.Code, rec.Body)
	}
	rep.drain = false
	rec := do(s, "POST", "/debug/route", fmt.Sprintf(chatBody, ""))
	if rec.Code != 200 || !strings.Contains(rec.Body.String(), `"chosen":"w1"`) || !strings.Contains(rec.Body.String(), "Formula for worker_id=w1") {
		t.Errorf("debug route: %d %s", rec.Code, rec.Body)
	}
	do(s, "POST", "/v1/chat/completions", fmt.Sprintf(chatBody, `,"stream":true`))
	rec = do(s, "GET", "/metrics", "")
	for _, name := range []string{"kvrouter_ttft_seconds", "kvrouter_requests_total", "kvrouter_worker_active_decode_blocks", "kvrouter_worker_cached_tokens_total"} {
		if !strings.Contains(rec.Body.String(), name) {
			t.Errorf("metrics lack %s", name)
		}
	}
	problems, err := promlint.New(strings.NewReader(rec.Body.String())).Lint()
	if err != nil || len(problems) > 0 {
		t.Errorf("promlint: %v %v", err, problems)
	}
}

func TestAPIAuth(t *testing.T) {
	rep := newFakeReplica("m", router.DefaultConfig())
	s := New(Config{Registry: prometheus.NewRegistry(), AdminToken: "sekret", APIKeys: []string{"k1"}, AllowLoopbackWorkers: true}, rep)
	if rec := do(s, "GET", "/busy_threshold", ""); rec.Code != 401 {
		t.Errorf("admin without token: %d", rec.Code)
	}
	if rec := do(s, "GET", "/v1/models", ""); rec.Code != 401 {
		t.Errorf("models without key: %d", rec.Code)
	}
	req := httptest.NewRequest("GET", "/v1/models", nil)
	req.Header.Set("Authorization", "Bearer k1")
	rec := httptest.NewRecorder()
	s.Handler().ServeHTTP(rec, req)
	if rec.Code != 200 {
		t.Errorf("models with key: %d", rec.Code)
	}
	if rec := do(s, "GET", "/health", ""); rec.Code != 200 {
		t.Errorf("health must stay open: %d", rec.Code)
	}
}

// TestAPIQueueAdmitsInPolicyOrder: requests queued while the only worker
// is busy reach it one at a time, in the order of the queue policy —
// priority first (nvext.agent_hints.priority; -1 lowers, +1 raises up to
// MaxPriority), then oldest (fcfs), newest (lcfs) or shortest prompt
// (wspt). Each admitted request books its prefill before the next waiter
// looks at the load, so exactly one passes per freed slot.
func TestAPIQueueAdmitsInPolicyOrder(t *testing.T) {
	// Sent in this order; prompt length in words.
	sent := []struct {
		name     string
		words    int
		priority int
	}{{"a", 30, 0}, {"d", 40, -1}, {"b", 10, 0}, {"c", 20, 0}, {"e", 50, 1}}
	for _, tc := range []struct {
		policy router.QueuePolicy
		want   string
	}{
		{router.QueueFCFS, "eabcd"},
		{router.QueueLCFS, "ecbad"},
		{router.QueueWSPT, "ebcad"},
	} {
		t.Run(string(tc.policy), func(t *testing.T) {
			cfg := router.DefaultConfig()
			cfg.QueueThreshold = ptr(0.0)
			cfg.QueuePolicy = tc.policy
			rep := newFakeReplica("m", cfg)
			var mu sync.Mutex
			var order []string
			worker := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				var body struct {
					Messages []struct{ Content string } `json:"messages"`
				}
				_ = json.NewDecoder(r.Body).Decode(&body)
				mu.Lock()
				order = append(order, strings.Fields(body.Messages[0].Content)[0])
				mu.Unlock()
				w.Header().Set("Content-Type", "application/json")
				fmt.Fprint(w, `{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":40,"completion_tokens":1}}`)
			}))
			defer worker.Close()
			rep.addWorker("m", "w1", worker.URL)
			s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, MaxPriority: 1}, rep)
			rt, _ := rep.Router("m")
			rt.Load().Add(router.Booking{ID: "blocker", Worker: "w1", PrefillTokens: 100, Added: time.Now()})
			srv := httptest.NewServer(s.Handler())
			defer srv.Close()

			codes := make(chan int, len(sent))
			for i, r := range sent {
				content := r.name + strings.Repeat(" word", r.words)
				body := fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":%q}],"nvext":{"agent_hints":{"priority":%d}}}`, content, r.priority)
				go func() {
					resp, err := http.Post(srv.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
					if err != nil {
						codes <- 0
						return
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					codes <- resp.StatusCode
				}()
				// One at a time into the queue, so "sent before" is well defined.
				poll.Until(t, 5*time.Second, 2*time.Millisecond, func() error {
					if g := testutilGauge(s); g != float64(i+1) {
						return fmt.Errorf("queued gauge %v, want %d", g, i+1)
					}
					return nil
				})
			}
			rt.PrefillDone("blocker")
			s.gates.wake("m")
			for range sent {
				if code := <-codes; code != 200 {
					t.Errorf("queued request answered %d", code)
				}
			}
			mu.Lock()
			defer mu.Unlock()
			if got := strings.Join(order, ""); got != tc.want {
				t.Errorf("the worker received %q, want %q", got, tc.want)
			}
		})
	}
}

func testutilGauge(s *Server) float64 { return readGauge(s.metrics.queued.WithLabelValues("m")) }

// postQueued sends a chat request to the server at url in the background
// and returns once the admission queue holds it; the channel gets the
// answer's status (0 if the request failed).
func postQueued(t *testing.T, s *Server, url string) <-chan int {
	t.Helper()
	status := make(chan int, 1)
	go func() {
		resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(fmt.Sprintf(chatBody, "")))
		if err != nil {
			status <- 0
			return
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		status <- resp.StatusCode
	}()
	poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
		if g := testutilGauge(s); g != 1 {
			return fmt.Errorf("queued gauge %v, want 1", g)
		}
		return nil
	})
	return status
}
