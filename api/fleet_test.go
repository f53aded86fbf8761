package api

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api/hitrate"
	"github.com/kvrouter/kvrouter/router"
)

// fleetReplica is the fake replica with the fleet's optional parts: it
// records the drains it is asked for and answers with err when set.
type fleetReplica struct {
	*fakeReplica
	mu      sync.Mutex
	calls   []string
	err     error
	workers []FleetWorker
}

func (f *fleetReplica) DrainWorker(_ context.Context, id string, deadline time.Time) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, fmt.Sprintf("drain %s %v", id, !deadline.IsZero()))
	return f.err
}

func (f *fleetReplica) UndrainWorker(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, "undrain "+id)
	return f.err
}

func (f *fleetReplica) FleetWorkers() []FleetWorker { return f.workers }

func (f *fleetReplica) called() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

func newFleetServer(t *testing.T, cfg Config) (*Server, *fleetReplica) {
	t.Helper()
	rep := &fleetReplica{fakeReplica: newFakeReplica("m", router.DefaultConfig())}
	if cfg.Registry == nil {
		cfg.Registry = prometheus.NewRegistry()
	}
	return New(cfg, rep), rep
}

// TestAPIWorkerDrainBadBodies: every malformed body is a 400 with a JSON
// error, and nothing reaches the replica (nothing is proposed).
func TestAPIWorkerDrainBadBodies(t *testing.T) {
	s, rep := newFleetServer(t, Config{})
	for _, tc := range []struct{ path, body string }{
		{"/workers/drain", ``},
		{"/workers/drain", `not json`},
		{"/workers/drain", `{}`},
		{"/workers/drain", `{"id": ""}`},
		{"/workers/drain", `{"id": 7}`},
		{"/workers/drain", `{"id": "w1#0"}`},
		{"/workers/drain", `{"id": "w1", "deadline_secs": -1}`},
		{"/workers/drain", `{"id": "w1", "deadline_secs": 86401}`},
		{"/workers/drain", `{"id": "w1", "deadline_secs": "soon"}`},
		{"/workers/undrain", `{}`},
		{"/workers/undrain", `{"id": "w1", "deadline_secs": 5}`},
		{"/workers/undrain", `[1]`},
	} {
		rec := do(s, "POST", tc.path, tc.body)
		var body map[string]any
		if rec.Code != http.StatusBadRequest || json.Unmarshal(rec.Body.Bytes(), &body) != nil || body["error"] == nil {
			t.Errorf("%s %q: %d %s, want 400 with an error", tc.path, tc.body, rec.Code, rec.Body)
		}
	}
	if calls := rep.called(); len(calls) != 0 {
		t.Fatalf("bad bodies reached the replica: %v", calls)
	}
}

// TestAPIWorkerDrainAnswers: a drain answers 202 (the worker leaves
// later), an undrain 200; the replica's errors map to 404 (unknown
// worker), 400 (invalid) and 503 (no leader); a replica that cannot
// drain answers 404.
func TestAPIWorkerDrainAnswers(t *testing.T) {
	s, rep := newFleetServer(t, Config{})
	rec := do(s, "POST", "/workers/drain", `{"id": "w1", "deadline_secs": 30}`)
	if rec.Code != http.StatusAccepted || !strings.Contains(rec.Body.String(), `"drained":true`) || strings.Contains(rec.Body.String(), `"deadline":null`) {
		t.Fatalf("drain: %d %s", rec.Code, rec.Body)
	}
	if rec := do(s, "POST", "/workers/drain", `{"id": "w1"}`); rec.Code != http.StatusAccepted || !strings.Contains(rec.Body.String(), `"deadline":null`) {
		t.Fatalf("drain without deadline: %d %s", rec.Code, rec.Body)
	}
	if rec := do(s, "POST", "/workers/undrain", `{"id": "w1"}`); rec.Code != http.StatusOK || !strings.Contains(rec.Body.String(), `"drained":false`) {
		t.Fatalf("undrain: %d %s", rec.Code, rec.Body)
	}
	if got, want := strings.Join(rep.called(), ","), "drain w1 true,drain w1 false,undrain w1"; got != want {
		t.Fatalf("calls %q, want %q", got, want)
	}
	for _, tc := range []struct {
		err  error
		want int
	}{
		{fmt.Errorf("%w: worker \"x\" is not registered", ErrUnknownWorker), http.StatusNotFound},
		{fmt.Errorf("%w: moving", ErrInvalid), http.StatusBadRequest},
		{fmt.Errorf("%w: no leader", ErrUnavailable), http.StatusServiceUnavailable},
	} {
		rep.err = tc.err
		for _, path := range []string{"/workers/drain", "/workers/undrain"} {
			if rec := do(s, "POST", path, `{"id": "x"}`); rec.Code != tc.want || !strings.Contains(rec.Body.String(), `"error"`) {
				t.Errorf("%s with %v: %d %s, want %d", path, tc.err, rec.Code, rec.Body, tc.want)
			}
		}
	}
	plain, _, _ := newTestServer(t, router.DefaultConfig())
	for _, path := range []string{"/workers/drain", "/workers/undrain", "/fleet/plan"} {
		method := "POST"
		if path == "/fleet/plan" {
			method = "GET"
		}
		if rec := do(plain, method, path, `{"id": "w1"}`); rec.Code != http.StatusNotFound {
			t.Errorf("%s on a replica without it: %d", path, rec.Code)
		}
	}
}

// TestAPIFleetAdminOnly: with an admin token the drain endpoints and the
// plan answer 401 without it (nothing reaches the replica), and serve
// with it.
func TestAPIFleetAdminOnly(t *testing.T) {
	s, rep := newFleetServer(t, Config{AdminToken: "sekret"})
	calls := []adminCall{
		{"POST", "/workers/drain", `{"id":"w1"}`},
		{"POST", "/workers/undrain", `{"id":"w1"}`},
		{"GET", "/fleet/plan", ""},
		{"GET", "/fleet/plan?format=pod-deletion-cost", ""},
	}
	for _, c := range calls {
		for _, auth := range []string{"", "Bearer wrong", "sekret"} {
			if rec := adminDo(s, c, "192.0.2.1:40000", auth); rec.Code != http.StatusUnauthorized {
				t.Errorf("%s %s, Authorization %q: %d, want 401", c.method, c.path, auth, rec.Code)
			}
		}
	}
	if n := len(rep.called()); n != 0 {
		t.Fatalf("unauthenticated calls reached the replica: %v", rep.called())
	}
	for _, c := range calls {
		if rec := adminDo(s, c, "192.0.2.1:40000", "Bearer sekret"); rec.Code >= 300 {
			t.Errorf("%s %s with the token: %d %s", c.method, c.path, rec.Code, rec.Body)
		}
	}
}

// hitReport is a hit-rate report of one model over the 10m window: the
// model's prompt tokens and, per rank, its captured fraction and prompt
// tokens.
func hitReport(modelPrompt int64, ranks map[string][2]float64) *hitrate.Report {
	mr := hitrate.ModelReport{Model: "m", Windows: []hitrate.Rates{{Window: "10m", PromptTokens: modelPrompt}}}
	for id, v := range ranks {
		captured := v[0]
		mr.Workers = append(mr.Workers, hitrate.WorkerReport{Worker: id, Windows: []hitrate.Rates{
			{Window: "1m", PromptTokens: 1 << 40, Captured: &captured}, // another window: ignored
			{Window: "10m", PromptTokens: int64(v[1]), Captured: &captured},
		}})
	}
	return &hitrate.Report{Windows: []string{"1m", "10m"}, Models: []hitrate.ModelReport{mr}}
}

// TestAPIFleetPlanRanks: the plan's figures and order. Hot unique blocks
// cost most; blocks every other worker also holds cost nothing however
// hot; without hits, unique cold tokens order the workers; ties go by id.
func TestAPIFleetPlanRanks(t *testing.T) {
	window := hitrate.Window{Name: "10m", Span: 10 * time.Minute}
	ws := []FleetWorker{
		// hot: 600 s × 0.5 × 2000 prompt tokens over two ranks = 600 000 cached tokens, half its blocks unique.
		{ID: "hot", Model: "m", Ranks: []router.WorkerID{"hot#0", "hot#1"}, BlockSize: 16, HeldBlocks: 100, UniqueBlocks: 50},
		// shared: as hot but nothing unique.
		{ID: "shared", Model: "m", Ranks: []router.WorkerID{"shared"}, BlockSize: 16, HeldBlocks: 100},
		// cold: unique blocks, no hits.
		{ID: "cold", Model: "m", Ranks: []router.WorkerID{"cold"}, BlockSize: 16, HeldBlocks: 40, UniqueBlocks: 40},
		{ID: "empty-b", Model: "m", Ranks: []router.WorkerID{"empty-b"}, BlockSize: 16},
		{ID: "empty-a", Model: "m", Ranks: []router.WorkerID{"empty-a"}, BlockSize: 16, Drained: true},
	}
	rep := hitReport(1_200_000, map[string][2]float64{"hot#0": {0.5, 300_000}, "hot#1": {0.5, 300_000}, "shared": {0.9, 600_000}})
	plan := buildPlan(ws, rep, window)
	var order []string
	byID := map[string]PlanWorker{}
	for _, p := range plan.Workers {
		order = append(order, p.Worker)
		byID[p.Worker] = p
	}
	if got := strings.Join(order, ","); got != "empty-a,empty-b,shared,cold,hot" {
		t.Fatalf("order %s", got)
	}
	hot := byID["hot"]
	// 300 000 cached tokens in 600 s = 500 tokens/s; half unique: 250/s.
	if hot.CachedTokensPerS != 500 || hot.RecomputeTokensPerS != 250 || hot.HitRateLoss == nil || *hot.HitRateLoss != 0.125 {
		t.Fatalf("hot: %+v", hot)
	}
	if want := 250*300 + 0.1*50*16; hot.RemovalCost != want || hot.PodDeletionCost != int(want) {
		t.Fatalf("hot cost %v (%d), want %v", hot.RemovalCost, hot.PodDeletionCost, want)
	}
	if s := byID["shared"]; s.RemovalCost != 0 || s.RecomputeTokensPerS != 0 || !strings.Contains(s.Reason, "also held by another worker") {
		t.Fatalf("shared: %+v", s)
	}
	if c := byID["cold"]; c.RemovalCost != 0.1*40*16 || !strings.Contains(c.Reason, "none was hit") || *c.UniqueTokenShare != 40.0/90 {
		t.Fatalf("cold: %+v", c)
	}
	if a := byID["empty-a"]; !a.Drained || !strings.HasPrefix(a.Reason, "drained") || a.CachedTokenShare == nil || *a.CachedTokenShare != 0 {
		t.Fatalf("empty-a: %+v", a)
	}
	// Without hit rates the plan still ranks by what the workers alone hold.
	plan = buildPlan(ws, nil, hitrate.Window{Name: "none"})
	if last := plan.Workers[len(plan.Workers)-1]; last.Worker != "hot" || last.HitRateLoss != nil {
		t.Fatalf("without hit rates: %+v", plan.Workers)
	}
}

// TestAPIFleetPlanEndpoint: GET /fleet/plan as JSON, as pod-deletion-cost
// commands (ids that are not pod names left as comments, a namespace
// checked), a bad format 400; the metrics carry the same costs and the
// drains.
func TestAPIFleetPlanEndpoint(t *testing.T) {
	reg := prometheus.NewRegistry()
	s, rep := newFleetServer(t, Config{Registry: reg})
	rep.workers = []FleetWorker{
		{ID: "vllm-1", Model: "m", Ranks: []router.WorkerID{"vllm-1"}, BlockSize: 16, HeldBlocks: 10, UniqueBlocks: 10, Drained: true,
			DrainDeadline: time.Unix(1_700_000_000, 0)},
		{ID: "vllm-0", Model: "m", Ranks: []router.WorkerID{"vllm-0"}, BlockSize: 16, HeldBlocks: 10, UniqueBlocks: 5},
		{ID: "Odd Name", Model: "m", Ranks: []router.WorkerID{"Odd Name"}, BlockSize: 16},
	}
	rec := do(s, "GET", "/fleet/plan", "")
	var plan FleetPlan
	if rec.Code != http.StatusOK || json.Unmarshal(rec.Body.Bytes(), &plan) != nil || len(plan.Workers) != 3 {
		t.Fatalf("plan: %d %s", rec.Code, rec.Body)
	}
	if plan.Workers[0].Worker != "Odd Name" || plan.Workers[1].Worker != "vllm-0" || plan.Workers[2].DrainDeadline == "" {
		t.Fatalf("plan order: %+v", plan.Workers)
	}
	rec = do(s, "GET", "/fleet/plan?format=pod-deletion-cost&namespace=llm", "")
	want := "kubectl annotate pod -n llm vllm-0 --overwrite controller.kubernetes.io/pod-deletion-cost=8\n" +
		"kubectl annotate pod -n llm vllm-1 --overwrite controller.kubernetes.io/pod-deletion-cost=16\n"
	if rec.Code != http.StatusOK || !strings.HasSuffix(rec.Body.String(), want) || !strings.Contains(rec.Body.String(), `# "Odd Name": not a pod name`) {
		t.Fatalf("pod-deletion-cost: %d %s", rec.Code, rec.Body)
	}
	for _, q := range []string{"format=yaml", "format=pod-deletion-cost&namespace=Bad%20rm"} {
		if rec := do(s, "GET", "/fleet/plan?"+q, ""); rec.Code != http.StatusBadRequest {
			t.Errorf("%s: %d", q, rec.Code)
		}
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		if n := mf.GetName(); n == "kvrouter_worker_removal_cost" || n == "kvrouter_worker_drained" {
			for _, m := range mf.GetMetric() {
				got[n+"/"+m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
			}
		}
	}
	if got["kvrouter_worker_removal_cost/vllm-1"] != 16 || got["kvrouter_worker_removal_cost/vllm-0"] != 8 ||
		got["kvrouter_worker_drained/vllm-1"] != 1 || got["kvrouter_worker_drained/vllm-0"] != 0 {
		t.Fatalf("metrics %v", got)
	}
}

// FuzzAPIWorkerDrain: any body to the drain endpoints answers 200/202 or
// a 400 with a JSON error; only a well-formed id (non-empty, no '#')
// reaches the replica, and only on success.
func FuzzAPIWorkerDrain(f *testing.F) {
	for _, s := range []string{`{"id":"w1"}`, `{"id":"w1","deadline_secs":30}`, `{"id":"w#1"}`, `{"id":""}`,
		`{"id":"w1","deadline_secs":1e300}`, `{"id":"w1","deadline_secs":-0}`, `null`, `{"id":"w1","id":"w2"}`} {
		f.Add(s, false)
		f.Add(s, true)
	}
	f.Fuzz(func(t *testing.T, body string, undrain bool) {
		s, rep := newFleetServer(t, Config{})
		path := "/workers/drain"
		if undrain {
			path = "/workers/undrain"
		}
		rec := do(s, "POST", path, body)
		calls := rep.called()
		switch rec.Code {
		case http.StatusOK, http.StatusAccepted:
			if len(calls) != 1 {
				t.Fatalf("%d with calls %v", rec.Code, calls)
			}
			id := strings.TrimPrefix(calls[0], "undrain ")
			if !undrain {
				id = strings.TrimSuffix(strings.TrimSuffix(strings.TrimPrefix(calls[0], "drain "), " true"), " false")
			}
			if id == "" || strings.Contains(id, "#") {
				t.Fatalf("id %q reached the replica", id)
			}
		case http.StatusBadRequest:
			var e map[string]any
			if json.Unmarshal(rec.Body.Bytes(), &e) != nil || e["error"] == nil || len(calls) != 0 {
				t.Fatalf("400 %s, calls %v", rec.Body, calls)
			}
		default:
			t.Fatalf("status %d %s", rec.Code, rec.Body)
		}
	})
}

// BenchmarkFleetPlan: building the plan of a 1024-worker fleet (what each
// scrape of kvrouter_worker_removal_cost and each /cluster/status pays on
// top of reading the inputs), from a hit-rate report with every worker.
func BenchmarkFleetPlan(b *testing.B) {
	const n = 1024
	ws := make([]FleetWorker, n)
	ranks := map[string][2]float64{}
	for i := range ws {
		id := fmt.Sprintf("w%04d", i)
		ws[i] = FleetWorker{ID: id, Model: "m", Ranks: []router.WorkerID{router.WorkerID(id)}, BlockSize: 16,
			HeldBlocks: 10000 + i, UniqueBlocks: i * 7 % 5000}
		ranks[id] = [2]float64{0.3 + float64(i%7)/10, 100000}
	}
	rep := hitReport(int64(n)*100000, ranks)
	window := hitrate.Window{Name: "10m", Span: 10 * time.Minute}
	b.ReportAllocs()
	for b.Loop() {
		_ = buildPlan(ws, rep, window)
	}
}
