package api

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/router"
)

// What reaches a worker: the client's end-to-end headers (request id,
// trace context, custom ones) but never its credentials, idempotency keys,
// forwarding headers or a rank of its own choosing; the worker API key
// when one is set. The answer carries the request id.
func TestAPIHeadersToWorker(t *testing.T) {
	var mu sync.Mutex
	var got http.Header
	worker := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = r.Header.Clone()
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"choices":[{"text":"x"}]}`))
	}))
	defer worker.Close()
	rep := newFakeReplica("m", router.DefaultConfig())
	rep.addWorker("m", "w1", worker.URL)
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, WorkerAPIKey: "engine-key-123",
		APIKeys: []string{"client-key-456"}}, rep)

	send := func(h map[string]string) *httptest.ResponseRecorder {
		req := httptest.NewRequest("POST", "/v1/completions", strings.NewReader(`{"model":"m","prompt":"hello"}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer client-key-456")
		for k, v := range h {
			req.Header.Set(k, v)
		}
		rec := httptest.NewRecorder()
		s.Handler().ServeHTTP(rec, req)
		return rec
	}
	rec := send(map[string]string{"X-Request-Id": "req-abc", "Traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"Tracestate": "vendor=1", "X-Tenant": "t1", "Cookie": "s=1", "Idempotency-Key": "k", "X-Forwarded-For": "6.6.6.6",
		"X-Data-Parallel-Rank": "3"})
	if rec.Code != 200 {
		t.Fatalf("%d %s", rec.Code, rec.Body)
	}
	mu.Lock()
	seen := got.Clone()
	mu.Unlock()
	for k, want := range map[string]string{"X-Request-Id": "req-abc", "Traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"Tracestate": "vendor=1", "X-Tenant": "t1", "Authorization": "Bearer engine-key-123", "Content-Type": "application/json"} {
		if seen.Get(k) != want {
			t.Errorf("worker got %s=%q, want %q", k, seen.Get(k), want)
		}
	}
	for _, k := range []string{"Cookie", "Idempotency-Key", "X-Forwarded-For", "X-Data-Parallel-Rank"} {
		if seen.Get(k) != "" {
			t.Errorf("worker got %s=%q", k, seen.Get(k))
		}
	}
	if rec.Header().Get("X-Request-Id") != "req-abc" {
		t.Errorf("answer's request id %q", rec.Header().Get("X-Request-Id"))
	}
	// Without one (or with a bad one) the router makes an id.
	for _, bad := range []string{"", "has space", strings.Repeat("x", 200)} {
		rec := send(map[string]string{"X-Request-Id": bad})
		id := rec.Header().Get("X-Request-Id")
		if len(id) != 32 || id == bad {
			t.Errorf("client id %q: answered id %q", bad, id)
		}
	}
}

// TestAPIHeadersAPIKeysNotForwarded: the API-key headers gateways and
// OpenAI-style clients use (x-api-key, api-key) are credentials for this
// router, never sent on to a worker, whoever registered it: over a real
// connection (the server canonicalizes lower-case names) and through
// outboundHeader alone.
func TestAPIHeadersAPIKeysNotForwarded(t *testing.T) {
	got := make(chan http.Header, 1)
	worker := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- r.Header.Clone()
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"choices":[{"text":"x"}]}`))
	}))
	defer worker.Close()
	rep := newFakeReplica("m", router.DefaultConfig())
	rep.addWorker("m", "w1", worker.URL)
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true}, rep)
	front := httptest.NewServer(s.Handler())
	defer front.Close()
	req, _ := http.NewRequest("POST", front.URL+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"hello"}`))
	req.Header["x-api-key"] = []string{"client-secret-1"} // sent as written, lower case
	req.Header["api-key"] = []string{"client-secret-2"}
	req.Header.Set("X-Tenant", "t1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	seen := <-got
	for name, vs := range seen {
		for _, v := range vs {
			if strings.Contains(v, "client-secret") {
				t.Errorf("worker got the client's key in %s: %q", name, v)
			}
		}
	}
	if seen.Get("X-Tenant") != "t1" {
		t.Errorf("an ordinary header did not cross: %v", seen)
	}
	out := outboundHeader(http.Header{"X-Api-Key": {"a"}, "Api-Key": {"b"}, "Authorization": {"Bearer c"}, "X-Custom": {"d"}})
	for _, k := range []string{"X-Api-Key", "Api-Key", "Authorization"} {
		if out.Get(k) != "" {
			t.Errorf("outboundHeader kept %s", k)
		}
	}
	if out.Get("X-Custom") != "d" {
		t.Errorf("outboundHeader dropped X-Custom: %v", out)
	}
}

// Unknown paths and methods answer OpenAI-shaped JSON errors.
func TestAPIUnknownPathJSON(t *testing.T) {
	s, _, _ := newTestServer(t, router.DefaultConfig())
	for _, c := range []struct {
		method, path string
		status       int
	}{{"POST", "/v1/nope", 404}, {"GET", "/nope", 404}, {"GET", "/v1/chat/completions", 404}} {
		rec := do(s, c.method, c.path, "")
		if rec.Code != c.status || !strings.Contains(rec.Body.String(), `"error":{`) || !strings.Contains(rec.Header().Get("Content-Type"), "json") {
			t.Errorf("%s %s: %d %q %s", c.method, c.path, rec.Code, rec.Header().Get("Content-Type"), rec.Body)
		}
	}
}

// A worker running several data-parallel ranks behind one URL gets the
// rank the router booked, so the engine's own balancer keeps it there; a
// single-rank worker gets no rank header.
func TestAPIDataParallelRankHeader(t *testing.T) {
	var mu sync.Mutex
	ranks := map[string]string{} // X-Worker-Id the client saw → rank header the engine got
	var last string
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		last = r.Header.Get("X-Data-Parallel-Rank")
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"choices":[{"text":"x"}]}`))
	}))
	defer engine.Close()
	single := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		last = r.Header.Get("X-Data-Parallel-Rank")
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"choices":[{"text":"x"}]}`))
	}))
	defer single.Close()
	rep := newFakeReplica("m", router.Config{Mode: router.ModeRoundRobin, BlockSize: 16})
	rep.addWorker("m", "dp", engine.URL)
	rep.addWorker("m", "dp#1", engine.URL)
	rep.addWorker("m", "solo", single.URL)
	rep.ranks = map[router.WorkerID]int{"dp": 0, "dp#1": 1}
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true}, rep)
	for range 6 {
		rec := do(s, "POST", "/v1/completions", `{"model":"m","prompt":"hello"}`)
		if rec.Code != 200 {
			t.Fatalf("%d %s", rec.Code, rec.Body)
		}
		mu.Lock()
		ranks[rec.Header().Get("X-Worker-Id")] = last
		mu.Unlock()
	}
	if ranks["dp"] != "0" || ranks["dp#1"] != "1" || ranks["solo"] != "" {
		t.Errorf("rank headers by worker: %v", ranks)
	}
}

// TestAPIHeaderCopyAllocations: the headers to a worker and back to the
// client are copied into one backing array, so the allocations do not grow
// with the number of headers (issue 31: no allocation per header; at
// 097d470 the answer's 40 headers took 49 allocations, 2 took 8).
func TestAPIHeaderCopyAllocations(t *testing.T) {
	headers := func(n int) http.Header {
		h := http.Header{"Connection": {"keep-alive"}, "Content-Length": {"12"}, "Authorization": {"Bearer k"}}
		for i := range n {
			h[fmt.Sprintf("X-Custom-%d", i)] = []string{"v"}
		}
		return h
	}
	allocs := func(n int, copyOne func(http.Header)) float64 {
		h := headers(n)
		return testing.AllocsPerRun(50, func() { copyOne(h) })
	}
	out := func(h http.Header) { outboundHeader(h) }
	back := func(h http.Header) { copyEndToEnd(make(http.Header, 64), h) }
	for name, f := range map[string]func(http.Header){"to the worker": out, "to the client": back} {
		// The map's own storage may take a table or two more; 38 more
		// headers must not take 38 more allocations.
		if few, many := allocs(2, f), allocs(40, f); many > few+2 {
			t.Errorf("%s: %v allocations for 2 headers, %v for 40", name, few, many)
		}
	}
	// Values are copies: the client's slices are not shared.
	in := headers(1)
	o := outboundHeader(in)
	o["X-Custom-0"][0] = "changed"
	if in.Get("X-Custom-0") != "v" {
		t.Error("outboundHeader shares the client's value slices")
	}
	// An answer header the client side has already keeps its values first.
	dst := http.Header{"X-Request-Id": {"ours"}}
	copyEndToEnd(dst, http.Header{"X-Request-Id": {"theirs"}, "Content-Length": {"3"}, "Connection": {"X-Gone"}, "X-Gone": {"1"}})
	if got := dst["X-Request-Id"]; len(got) != 2 || got[0] != "ours" || got[1] != "theirs" || dst.Get("Content-Length") != "" || dst.Get("X-Gone") != "" {
		t.Errorf("copyEndToEnd: %v", dst)
	}
}
