package api

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// TestAPIReadPriority: Dynamo's priority fields and headers, the headers
// winning, and a clear error for a value of the wrong type or range.
func TestAPIReadPriority(t *testing.T) {
	tests := []struct {
		name    string
		body    string // the agent_hints object
		headers map[string]string
		want    requestPriority
		err     string
	}{
		{"none", `{}`, nil, requestPriority{}, ""},
		{"nulls", `{"priority":null,"strict_priority":null}`, nil, requestPriority{}, ""},
		{"both", `{"priority":-3,"strict_priority":2}`, nil, requestPriority{Soft: -3, Strict: 2}, ""},
		{"integral float", `{"priority":5.0,"strict_priority":1e1}`, nil, requestPriority{Soft: 5, Strict: 10}, ""},
		{"u32 max", `{"strict_priority":4294967295}`, nil, requestPriority{Strict: 4294967295}, ""},
		{"headers override", `{"priority":1,"strict_priority":1}`,
			map[string]string{headerRequestPriority: "7", headerRequestStrictPriority: " 3 "}, requestPriority{Soft: 7, Strict: 3}, ""},
		{"empty header ignored", `{"priority":2}`, map[string]string{headerRequestPriority: ""}, requestPriority{Soft: 2}, ""},
		{"fraction", `{"priority":1.5}`, nil, requestPriority{}, "nvext.agent_hints.priority must be an integer"},
		{"string", `{"priority":"high"}`, nil, requestPriority{}, "nvext.agent_hints.priority must be an integer"},
		{"i32 overflow", `{"priority":2147483648}`, nil, requestPriority{}, "nvext.agent_hints.priority must be an integer"},
		{"negative strict", `{"strict_priority":-1}`, nil, requestPriority{}, "nvext.agent_hints.strict_priority must be an integer in [0, 4294967295]"},
		{"u32 overflow", `{"strict_priority":4294967296}`, nil, requestPriority{}, "strict_priority must be an integer"},
		{"huge", `{"priority":1e99}`, nil, requestPriority{}, "priority must be an integer"},
		{"malformed header", `{}`, map[string]string{headerRequestStrictPriority: "malformed"}, requestPriority{},
			"header X-Dynamo-Request-Strict-Priority must be an integer"},
		{"negative strict header", `{}`, map[string]string{headerRequestStrictPriority: "-2"}, requestPriority{}, "X-Dynamo-Request-Strict-Priority"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var hints agentHintPriorities
			if err := json.Unmarshal([]byte(tc.body), &hints); err != nil {
				t.Fatal(err)
			}
			h := http.Header{}
			for k, v := range tc.headers {
				h.Set(k, v)
			}
			got, err := readPriority(h, hints)
			switch {
			case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
				t.Fatalf("err %v, want one saying %q", err, tc.err)
			case tc.err == "" && err != nil:
				t.Fatal(err)
			case got != tc.want:
				t.Fatalf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}

// TestAPIPriorityBadInput: a bad priority is a 400 naming the field and
// reaches no worker.
func TestAPIPriorityBadInput(t *testing.T) {
	rep := newFakeReplica("m", router.DefaultConfig())
	var hits atomic.Int64
	rep.addWorker("m", "w1", fakeWorker(t, &hits).URL)
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true}, rep)
	for _, body := range []string{
		`{"model":"m","messages":[{"role":"user","content":"x"}],"nvext":{"agent_hints":{"strict_priority":-1}}}`,
		`{"model":"m","messages":[{"role":"user","content":"x"}],"nvext":{"agent_hints":{"priority":"urgent"}}}`,
	} {
		rec := do(s, "POST", "/v1/chat/completions", body)
		if rec.Code != http.StatusBadRequest || !strings.Contains(rec.Body.String(), "priority must be an integer") {
			t.Errorf("%s: %d %s", body, rec.Code, rec.Body)
		}
	}
	if hits.Load() != 0 {
		t.Fatalf("%d requests reached the worker", hits.Load())
	}
}

// TestAPITenantLedgerFairness: the counter is the fleet's usage plus the
// lift; an idle tenant starts one token below the smallest active counter
// (no banked credit) with Burst 1, at most Burst below it otherwise, and a
// tenant that fell further behind while active is raised when it queues; a
// tenant's usage on other replicas counts; a replica's silence drops it.
func TestAPITenantLedgerFairness(t *testing.T) {
	type step struct {
		do   func(l *TenantLedger)
		want map[string]float64 // virtual counters after the step
	}
	tests := []struct {
		name  string
		burst float64 // TenantConfig.Burst (0: 1, start-time fair queueing exactly)
		steps []step
	}{
		{"usage adds up", 0, []step{
			{func(l *TenantLedger) { l.Charge("m", "a", 100); l.Charge("m", "a", 50); l.Charge("m", "b", 10) }, map[string]float64{"a": 150, "b": 10}},
		}},
		{"idle tenant lifted to the active minimum", 0, []step{
			{func(l *TenantLedger) {
				l.Charge("m", "a", 1000)
				l.Charge("m", "b", 5000)
				l.Begin("m", "a") // a active at 1000
				l.Begin("m", "b") // b active at 5000
				l.Charge("m", "c", 10)
				l.Enqueue("m", "c", 0) // c was idle: starts just below 1000, not at 10
			}, map[string]float64{"a": 1000, "b": 5000, "c": 999}},
		}},
		{"active tenant keeps its own counter", 0, []step{
			{func(l *TenantLedger) {
				l.Charge("m", "a", 1000)
				l.Begin("m", "a")
				l.Begin("m", "c") // c idle → lifted to 999
				l.End("m", "a")
				l.Charge("m", "a", 500) // a idle now, c active
				l.Enqueue("m", "c", 0)  // c active: no second lift
			}, map[string]float64{"a": 1500, "c": 999}},
			{func(l *TenantLedger) { l.Charge("m", "c", 200) }, map[string]float64{"a": 1500, "c": 1199}}, // charges count on top of the lift
		}},
		{"no active tenant: no lift", 0, []step{
			{func(l *TenantLedger) { l.Charge("m", "a", 1000); l.Enqueue("m", "b", 0) }, map[string]float64{"a": 1000, "b": 0}},
		}},
		{"other replicas' usage and floors count", 0, []step{
			{func(l *TenantLedger) {
				l.Charge("m", "a", 100)
				l.Remote("r2", []TenantUsage{{Model: "m", Tenant: "a", Tokens: 400}, {Model: "m", Tenant: "b", Tokens: 10, Lift: 900}})
				l.Remote("r3", []TenantUsage{{Model: "m", Tenant: "a", Tokens: 500}, {Model: "other", Tenant: "a", Tokens: 1 << 20}})
			}, map[string]float64{"a": 1000, "b": 910}},
			{func(l *TenantLedger) { l.DropRemote("r3") }, map[string]float64{"a": 500, "b": 910}},
			{func(l *TenantLedger) { l.Remote("r2", nil) }, map[string]float64{"a": 100, "b": 0}},
		}},
		{"idle tenant lifted to a tenant active on another replica", 0, []step{
			{func(l *TenantLedger) {
				l.Remote("r2", []TenantUsage{{Model: "m", Tenant: "heavy", Tokens: 7000, Inflight: 3}})
				l.Enqueue("m", "light", 0)
			}, map[string]float64{"heavy": 7000, "light": 6999}},
		}},
		{"a tenant comes back at most the burst below", 500, []step{
			{func(l *TenantLedger) {
				l.Charge("m", "a", 10_000)
				l.Begin("m", "a")
				l.Enqueue("m", "c", 0)
			}, map[string]float64{"a": 10_000, "c": 9_500}},
		}},
		{"credit while active is bounded too", 500, []step{
			{func(l *TenantLedger) {
				l.Charge("m", "a", 10_000)
				l.Begin("m", "a")
				l.Begin("m", "c")         // c at 9,500
				l.Charge("m", "a", 5_000) // a served, c not
				l.Enqueue("m", "c", 0)    // c queues: at most 500 below a
			}, map[string]float64{"a": 15_000, "c": 14_500}},
			{func(l *TenantLedger) { l.Charge("m", "c", 100) }, map[string]float64{"a": 15_000, "c": 14_600}},
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			l, err := NewTenantLedger(TenantConfig{From: TenantHeader, Burst: max(tc.burst, 1)})
			if err != nil {
				t.Fatal(err)
			}
			for i, st := range tc.steps {
				st.do(l)
				for tenant, want := range st.want {
					if got := l.Virtual("m", tenant); got != want {
						t.Errorf("step %d: %s at %v, want %v", i, tenant, got, want)
					}
				}
			}
		})
	}
}

// TestAPITenantYield: a replica holds its next request back for a tenant
// waiting elsewhere in a higher class, or further below its share than the
// slack; not for one only slightly below, nor one not waiting.
func TestAPITenantYield(t *testing.T) {
	l, _ := NewTenantLedger(TenantConfig{From: TenantHeader, Slack: 100})
	l.Charge("m", "heavy", 10_000)
	tests := []struct {
		name   string
		remote []TenantUsage
		class  uint32
		yield  bool
	}{
		{"nobody waiting elsewhere", []TenantUsage{{Model: "m", Tenant: "light", Tokens: 10}}, 0, false},
		{"a lighter tenant waits", []TenantUsage{{Model: "m", Tenant: "light", Tokens: 10, Waiting: 1}}, 0, true},
		{"within the slack", []TenantUsage{{Model: "m", Tenant: "light", Tokens: 9_950, Waiting: 1}}, 0, false},
		{"a lower class waits", []TenantUsage{{Model: "m", Tenant: "light", Tokens: 10, Waiting: 1}}, 1, false},
		{"a higher class waits", []TenantUsage{{Model: "m", Tenant: "rich", Tokens: 1 << 30, Waiting: 1, Class: 2}}, 1, true},
		{"another model", []TenantUsage{{Model: "n", Tenant: "light", Tokens: 10, Waiting: 1}}, 0, false},
	}
	for _, tc := range tests {
		l.Remote("r2", tc.remote)
		if _, got := l.YieldTo("m", "heavy", tc.class); got != tc.yield {
			t.Errorf("%s: yield %v, want %v", tc.name, got, tc.yield)
		}
	}
}

// TestAPITenantIdentity: keys are hashed (never the key), header values kept
// when plain and hashed when long or odd, the rest anonymous; past
// MaxTenants every new tenant shares the overflow tenant.
func TestAPITenantIdentity(t *testing.T) {
	keys, _ := NewTenantLedger(TenantConfig{From: TenantAPIKey})
	id := keys.Identify("sk-secret-123", func(string) string { return "" })
	if !strings.HasPrefix(id, "key-") || strings.Contains(id, "secret") || len(id) != 16 {
		t.Fatalf("key tenant %q", id)
	}
	if keys.Identify("sk-secret-123", nil) != id || keys.Identify("other", nil) == id || keys.Identify("", nil) != TenantAnonymous {
		t.Fatal("key tenants not stable and distinct")
	}
	hdr, _ := NewTenantLedger(TenantConfig{From: TenantHeader, MaxTenants: 2})
	get := func(v string) func(string) string {
		return func(name string) string {
			if name != DefaultTenantHeader {
				t.Fatalf("read header %q", name)
			}
			return v
		}
	}
	for in, want := range map[string]string{"team-a": "team-a", "  team-b ": "team-b", "": TenantAnonymous, "_overflow": "h-"} {
		if got := hdr.Identify("", get(in)); !strings.HasPrefix(got, want) {
			t.Errorf("header %q: tenant %q, want %q…", in, got, want)
		}
	}
	if got := hdr.Identify("", get(strings.Repeat("x", 65))); !strings.HasPrefix(got, "h-") || len(got) != 18 {
		t.Errorf("long header: %q", got)
	}
	if a, b, c := hdr.Resolve("m", "a"), hdr.Resolve("m", "b"), hdr.Resolve("m", "c"); a != "a" || b != "b" || c != TenantOverflow {
		t.Errorf("resolve past the cap: %s %s %s", a, b, c)
	}
	if hdr.Resolve("m2", "c") != "c" {
		t.Error("the cap is per model")
	}
	if _, err := NewTenantLedger(TenantConfig{From: "cookie"}); err == nil {
		t.Error("unknown source accepted")
	}
	if l, err := NewTenantLedger(TenantConfig{From: TenantNone}); l != nil || err != nil {
		t.Error("none must turn fairness off")
	}
}

// TestAPITenantBudgets: past a tenant's tokens per minute or concurrent
// requests the answer is 429 with Retry-After, for that tenant only, and
// the budget comes back as the minute passes.
func TestAPITenantBudgets(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	clock := func() time.Time { return now }
	tests := []struct {
		name      string
		cfg       TenantConfig
		setup     func(l *TenantLedger)
		wantRetry string // "" = admitted
		later     time.Duration
		thenRetry string
	}{
		{"within budget", TenantConfig{TokensPerMinute: 1000}, func(l *TenantLedger) { l.Charge("m", "a", 999) }, "", 0, ""},
		{"tokens per minute spent", TenantConfig{TokensPerMinute: 1000},
			func(l *TenantLedger) { l.Charge("m", "a", 1000) }, "60", 61 * time.Second, ""},
		{"spent partly earlier", TenantConfig{TokensPerMinute: 1000}, func(l *TenantLedger) {
			l.Charge("m", "a", 600)
			now = now.Add(20 * time.Second)
			l.Charge("m", "a", 600)
		}, "40", 41 * time.Second, ""},
		{"other replicas' tokens count", TenantConfig{TokensPerMinute: 1000}, func(l *TenantLedger) {
			l.Charge("m", "a", 1)
			l.Remote("r2", []TenantUsage{{Model: "m", Tenant: "a", Tokens: 5}})
			l.Remote("r2", []TenantUsage{{Model: "m", Tenant: "a", Tokens: 2005}})
		}, "60", 0, "60"},
		{"concurrency", TenantConfig{MaxConcurrent: 2}, func(l *TenantLedger) { l.Begin("m", "a"); l.Begin("m", "a") }, "1", 0, "1"},
		{"concurrency fleet-wide", TenantConfig{MaxConcurrent: 2}, func(l *TenantLedger) {
			l.Begin("m", "a")
			l.Remote("r2", []TenantUsage{{Model: "m", Tenant: "a", Inflight: 1}})
		}, "1", 0, "1"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			now = time.Unix(1_000_000, 0)
			tc.cfg.From, tc.cfg.Now = TenantHeader, clock
			l, err := NewTenantLedger(tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			tc.setup(l)
			rep := newFakeReplica("m", router.DefaultConfig())
			var hits atomic.Int64
			rep.addWorker("m", "w1", fakeWorker(t, &hits).URL)
			s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, Tenants: l}, rep)
			send := func(tenant string) *httptest.ResponseRecorder {
				req := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(fmt.Sprintf(chatBody, "")))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set(DefaultTenantHeader, tenant)
				rec := httptest.NewRecorder()
				s.Handler().ServeHTTP(rec, req)
				return rec
			}
			check := func(when, want string) {
				rec := send("a")
				switch {
				case want == "" && rec.Code != 200:
					t.Fatalf("%s: %d %s", when, rec.Code, rec.Body)
				case want != "" && (rec.Code != 429 || rec.Header().Get("Retry-After") != want ||
					!strings.Contains(rec.Body.String(), "over its budget")):
					t.Fatalf("%s: %d Retry-After %q %s, want 429 after %s", when, rec.Code, rec.Header().Get("Retry-After"), rec.Body, want)
				}
			}
			check("first", tc.wantRetry)
			if rec := send("b"); rec.Code != 200 {
				t.Fatalf("another tenant: %d %s", rec.Code, rec.Body)
			}
			if tc.later > 0 {
				now = now.Add(tc.later)
				check("later", tc.thenRetry)
			}
		})
	}
}

// TestAPIQueueTenantsAndClasses: with fairness on, queued requests are
// admitted by strict class first (x-dynamo-request-strict-priority), then
// the tenant with the fewest tokens charged, then the policy; a heavy
// tenant's backlog does not hold a light tenant behind it.
func TestAPIQueueTenantsAndClasses(t *testing.T) {
	sent := []struct{ name, tenant, strict string }{
		{"h1", "heavy", ""}, {"h2", "heavy", ""}, {"h3", "heavy", ""}, {"l1", "light", ""}, {"v1", "heavy", "1"}, {"l2", "light", ""},
	}
	cfg := router.DefaultConfig()
	cfg.QueueThreshold = ptr(0.0)
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
		fmt.Fprint(w, `{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":40,"completion_tokens":0}}`)
	}))
	defer worker.Close()
	rep.addWorker("m", "w1", worker.URL)
	l, _ := NewTenantLedger(TenantConfig{From: TenantHeader})
	// heavy has used much more of the fleet already, and is active; light
	// was idle, so it starts Burst (4096) below heavy: no more credit than
	// that banked while idle.
	l.Charge("m", "heavy", 50_000)
	l.Begin("m", "heavy")
	l.Charge("m", "light", 100)
	l.Begin("m", "light")
	if v := l.Virtual("m", "light"); v != 50_000-4096 {
		t.Fatalf("light starts at %v, want 4096 below heavy's 50000", v)
	}
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, MaxPriority: 5, Tenants: l}, rep)
	rt, _ := rep.Router("m")
	rt.Load().Add(router.Booking{ID: "blocker", Worker: "w1", PrefillTokens: 100, Added: time.Now()})
	srv := httptest.NewServer(s.Handler())
	defer srv.Close()
	codes := make(chan int, len(sent))
	for i, r := range sent {
		body := fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":%q}]}`, r.name+strings.Repeat(" word", 20))
		req, _ := http.NewRequest("POST", srv.URL+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set(DefaultTenantHeader, r.tenant)
		if r.strict != "" {
			req.Header.Set(headerRequestStrictPriority, r.strict)
		}
		go func() {
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				codes <- 0
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			codes <- resp.StatusCode
		}()
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
	// v1 (class 1) first; then whoever has been charged less: light, until
	// it has nothing left (≈ 30 tokens a request against its 4,096 of
	// credit), then heavy. First come first served would have sent h1, h2,
	// h3 before l1.
	if got, want := strings.Join(order, ","), "v1,l1,l2,h1,h2,h3"; got != want {
		t.Errorf("the worker received %s, want %s", got, want)
	}
	if v := l.Virtual("m", "light"); v <= 50_000-4096 {
		t.Errorf("light was not charged: %v", v)
	}
}

// TestAPIQueuePushOut: a full queue makes room for a tenant below its
// share of the places by displacing the newest waiter of the tenant holding
// most (answered 529 like a full queue); a tenant at its share is refused.
func TestAPIQueuePushOut(t *testing.T) {
	cfg := router.DefaultConfig()
	cfg.QueueThreshold = ptr(0.0)
	rep := newFakeReplica("m", cfg)
	var hits atomic.Int64
	rep.addWorker("m", "w1", fakeWorker(t, &hits).URL)
	l, _ := NewTenantLedger(TenantConfig{From: TenantHeader})
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, MaxQueue: 2, Tenants: l}, rep)
	rt, _ := rep.Router("m")
	rt.Load().Add(router.Booking{ID: "blocker", Worker: "w1", PrefillTokens: 100, Added: time.Now()})
	srv := httptest.NewServer(s.Handler())
	defer srv.Close()
	type answer struct {
		code int
		body string
	}
	post := func(tenant string, queued float64) <-chan answer {
		ch := make(chan answer, 1)
		go func() {
			req, _ := http.NewRequest("POST", srv.URL+"/v1/chat/completions", strings.NewReader(fmt.Sprintf(chatBody, "")))
			req.Header.Set(DefaultTenantHeader, tenant)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				ch <- answer{}
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			ch <- answer{resp.StatusCode, string(b)}
		}()
		if queued > 0 {
			poll.Until(t, 5*time.Second, 2*time.Millisecond, func() error {
				if g := testutilGauge(s); g != queued {
					return fmt.Errorf("queued gauge %v, want %v", g, queued)
				}
				return nil
			})
		}
		return ch
	}
	h1 := post("heavy", 1)
	h2 := post("heavy", 2)
	l1 := post("light", 0)
	if a := <-h2; a.code != 529 || !strings.Contains(a.body, "tenant below its share") {
		t.Fatalf("heavy's newest waiter: %d %s", a.code, a.body)
	}
	poll.Until(t, 5*time.Second, 2*time.Millisecond, func() error {
		if g := testutilGauge(s); g != 2 {
			return fmt.Errorf("queued gauge %v, want 2", g)
		}
		return nil
	})
	// light holds one place, heavy one: at its share, light is refused.
	if a := <-post("light", 0); a.code != 529 || !strings.Contains(a.body, "the queue cap") {
		t.Fatalf("light at its share: %d %s", a.code, a.body)
	}
	rt.PrefillDone("blocker")
	rt.Free("blocker")
	s.gates.wake("m")
	for name, ch := range map[string]<-chan answer{"h1": h1, "l1": l1} {
		if a := <-ch; a.code != 200 {
			t.Errorf("%s: %d %s", name, a.code, a.body)
		}
	}
}

// TestAPITenantChanged: the ledger asks replica sync to publish when a
// tenant starts waiting here or waits in a higher class, not for every
// request it queues.
func TestAPITenantChanged(t *testing.T) {
	l, _ := NewTenantLedger(TenantConfig{From: TenantHeader})
	nudged := func() bool {
		select {
		case <-l.Changed():
			return true
		default:
			return false
		}
	}
	steps := []struct {
		do   func()
		want bool
	}{
		{func() { l.Enqueue("m", "a", 0) }, true},
		{func() { l.Enqueue("m", "a", 0) }, false},
		{func() { l.Enqueue("m", "a", 2) }, true},
		{func() { l.Enqueue("m", "a", 1) }, false},
		{func() { l.Enqueue("m", "b", 0) }, true},
		{func() { l.Dequeue("m", "b", 0); l.Enqueue("m", "b", 0) }, true},
	}
	for i, st := range steps {
		st.do()
		if got := nudged(); got != st.want {
			t.Errorf("step %d: nudged %v, want %v", i, got, st.want)
		}
	}
}

// TestAPIQueueYieldAndNoBypass: a replica holds its queue while another
// replica reports a request waiting in a higher class, even with capacity
// free; a new arrival then queues behind the backlog instead of passing
// it; when the other replica's waiter is gone, both go, in order.
func TestAPIQueueYieldAndNoBypass(t *testing.T) {
	cfg := router.DefaultConfig()
	cfg.QueueThreshold = ptr(0.0)
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
		fmt.Fprint(w, `{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":4,"completion_tokens":1}}`)
	}))
	defer worker.Close()
	rep.addWorker("m", "w1", worker.URL)
	l, _ := NewTenantLedger(TenantConfig{From: TenantHeader, MaxYield: time.Hour})
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, Tenants: l}, rep)
	rt, _ := rep.Router("m")
	rt.Load().Add(router.Booking{ID: "blocker", Worker: "w1", PrefillTokens: 100, Added: time.Now()})
	srv := httptest.NewServer(s.Handler())
	defer srv.Close()
	l.Remote("r2", []TenantUsage{{Model: "m", Tenant: "elsewhere", Waiting: 1, Class: 3}})
	send := func(name, tenant string, queued float64) <-chan int {
		ch := make(chan int, 1)
		go func() {
			body := fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":%q}]}`, name+" hello")
			req, _ := http.NewRequest("POST", srv.URL+"/v1/chat/completions", strings.NewReader(body))
			req.Header.Set(DefaultTenantHeader, tenant)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				ch <- 0
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			ch <- resp.StatusCode
		}()
		poll.Until(t, 5*time.Second, 2*time.Millisecond, func() error {
			if g := testutilGauge(s); g != queued {
				return fmt.Errorf("queued gauge %v, want %v", g, queued)
			}
			return nil
		})
		return ch
	}
	a := send("a", "t1", 1)
	rt.PrefillDone("blocker")
	rt.Free("blocker")
	s.gates.wake("m")
	if rt.ShouldQueue() {
		t.Fatal("capacity should be free")
	}
	b := send("b", "t2", 2) // capacity free, yet it queues behind a
	mu.Lock()
	if len(order) != 0 {
		t.Fatalf("served while another replica's higher class waits: %v", order)
	}
	mu.Unlock()
	l.Remote("r2", nil)
	for name, ch := range map[string]<-chan int{"a": a, "b": b} {
		if code := <-ch; code != 200 {
			t.Errorf("%s: %d", name, code)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if got := strings.Join(order, ","); got != "a,b" {
		t.Errorf("served %s, want a,b", got)
	}
}

// TestAPITenantForget: a tenant idle here and everywhere for ForgetAfter
// leaves the ledger (and the sync messages); one active elsewhere stays;
// a publication holds at most maxPublishedTenants, the active first.
func TestAPITenantForget(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	l, _ := NewTenantLedger(TenantConfig{From: TenantHeader, ForgetAfter: time.Minute, MaxTenants: 1 << 20, Now: func() time.Time { return now }})
	l.Charge("m", "idle", 100)
	l.Charge("m", "busy-elsewhere", 100)
	l.Begin("m", "running")
	now = now.Add(2 * time.Minute)
	l.Remote("r2", []TenantUsage{{Model: "m", Tenant: "busy-elsewhere", Inflight: 1}})
	var got []string
	for _, u := range l.Usage() {
		got = append(got, u.Tenant)
	}
	if strings.Join(got, ",") != "busy-elsewhere,running" {
		t.Fatalf("kept %v", got)
	}
	if l.Virtual("m", "idle") != 0 {
		t.Fatal("a forgotten tenant kept its count")
	}
	for i := range maxPublishedTenants + 10 {
		l.Charge("n", fmt.Sprintf("t%05d", i), 1+i)
	}
	u := l.Usage()
	if len(u) != maxPublishedTenants {
		t.Fatalf("published %d tenants", len(u))
	}
	has := map[string]bool{}
	for _, x := range u {
		has[x.Tenant] = true
	}
	if !has["running"] || !has["busy-elsewhere"] || has["t00000"] {
		t.Fatal("the active tenants must be published first, then the most charged")
	}
}

// TestAPIQueueYieldExpires: a head holds back for another replica's
// reported waiter at most MaxYield; then it goes, and that is counted.
func TestAPIQueueYieldExpires(t *testing.T) {
	cfg := router.DefaultConfig()
	cfg.QueueThreshold = ptr(0.0)
	rep := newFakeReplica("m", cfg)
	var hits atomic.Int64
	rep.addWorker("m", "w1", fakeWorker(t, &hits).URL)
	l, _ := NewTenantLedger(TenantConfig{From: TenantHeader, MaxYield: 20 * time.Millisecond})
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, Tenants: l}, rep)
	rt, _ := rep.Router("m")
	rt.Load().Add(router.Booking{ID: "blocker", Worker: "w1", PrefillTokens: 100, Added: time.Now()})
	srv := httptest.NewServer(s.Handler())
	defer srv.Close()
	// A peer reports a waiter it never admits (a stale report).
	l.Remote("r2", []TenantUsage{{Model: "m", Tenant: "elsewhere", Waiting: 1, Class: 3}})
	first := postQueued(t, s, srv.URL)
	rt.PrefillDone("blocker")
	rt.Free("blocker")
	s.gates.wake("m")
	if code := <-first; code != 200 {
		t.Fatalf("the held head: %d", code)
	}
	var m dto.Metric
	_ = s.tenantMetrics.yieldExpired.WithLabelValues("m").Write(&m)
	if n := m.GetCounter().GetValue(); n != 1 {
		t.Fatalf("yield expiries counted %v, want 1", n)
	}
}
