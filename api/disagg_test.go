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

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/api/decisionlog"
	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/router"
)

// disaggFake is the fake replica with a two-stage router for model "m".
type disaggFake struct {
	*fakeReplica
	dr *router.DisaggRouter
}

func (f *disaggFake) Disagg(model string) (*router.DisaggRouter, bool) {
	if model != "m" || f.dr == nil {
		return nil, false
	}
	return f.dr, true
}

// pdWorker plays a vLLM worker behind the NIXL proxy protocol: a prefill
// answers kv_transfer_params, a decode with params "pulls" (failing the
// first failPulls times with kv_transfer_failed).
type pdWorker struct {
	srv         *httptest.Server
	failPrefill bool
	failPulls   atomic.Int64
	mu          sync.Mutex
	got         []map[string]any // request bodies
}

func newPDWorker(t *testing.T, name string) *pdWorker {
	w := &pdWorker{}
	w.srv = httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		var body map[string]any
		_ = json.NewDecoder(r.Body).Decode(&body)
		w.mu.Lock()
		w.got = append(w.got, body)
		w.mu.Unlock()
		params, _ := body["kv_transfer_params"].(map[string]any)
		switch {
		case params != nil && params["do_remote_decode"] == true:
			if w.failPrefill {
				http.Error(rw, `{"error":{"message":"boom","type":"internal_error"}}`, http.StatusInternalServerError)
				return
			}
			rw.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(rw, `{"choices":[{"message":{"content":"x"}}],"usage":{"prompt_tokens":40,"completion_tokens":1},"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":%q,"remote_url":%q,"transfer_id":"t1","num_tokens":40}}`, name, w.srv.URL)
			return
		case params != nil && params["do_remote_prefill"] == true:
			if w.failPulls.Add(-1) >= 0 {
				rw.Header().Set("Content-Type", "application/json")
				rw.WriteHeader(http.StatusBadGateway)
				fmt.Fprint(rw, `{"error":{"message":"pull from prefill failed","type":"kv_transfer_failed","code":502}}`)
				return
			}
		}
		rw.Header().Set("Content-Type", "application/json")
		fmt.Fprint(rw, `{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":40}}}`)
	}))
	t.Cleanup(w.srv.Close)
	return w
}

func (w *pdWorker) bodies() []map[string]any {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]map[string]any(nil), w.got...)
}

func testDisaggConfig(mode router.DisaggMode) router.DisaggConfig {
	return router.DisaggConfig{
		Mode: mode, KV: router.KVQwen3_0_6B, TransferRetries: 1,
		Timing: router.StepTiming{
			PrefillMs: func(n int) float64 { return 0.1 * float64(n) },
			DecodeMs:  func(float64) float64 { return 5 },
		},
		Topology: router.SingleLink("link", router.Link{ThroughputBytesPerS: 104e6}),
	}
}

// newDisaggServer: model "m" with prefill worker "p" and decode worker "d"
// (no prefill worker when withPrefill is false).
func newDisaggServer(t *testing.T, mode router.DisaggMode, withPrefill bool, opts ...func(*Config)) (*Server, *disaggFake, *pdWorker, *pdWorker, *prometheus.Registry) {
	t.Helper()
	cfg := router.DefaultConfig()
	cfg.BlockSize = 4
	f := &disaggFake{fakeReplica: newFakeReplica("m", cfg)}
	dr, err := router.NewDisaggRouter(cfg, f.index, testDisaggConfig(mode), 1)
	if err != nil {
		t.Fatal(err)
	}
	f.dr = dr
	p, d := newPDWorker(t, "p"), newPDWorker(t, "d")
	f.urls["p"], f.urls["d"] = p.srv.URL, d.srv.URL
	ws := []router.RoleWorker{{WorkerInfo: router.WorkerInfo{ID: "d", TotalBlocks: 1000, MaxBatchedTokens: 8192}, Role: router.RoleDecode}}
	if withPrefill {
		ws = append(ws, router.RoleWorker{WorkerInfo: router.WorkerInfo{ID: "p", TotalBlocks: 1000, MaxBatchedTokens: 8192}, Role: router.RolePrefill})
	}
	dr.SetWorkers(ws)
	f.addWorker("m", "d", d.srv.URL)
	reg := prometheus.NewRegistry()
	cfg2 := Config{Registry: reg, Retries: 1, AllowLoopbackWorkers: true}
	for _, o := range opts {
		o(&cfg2)
	}
	return New(cfg2, f), f, p, d, reg
}

// TestDisaggDecisionLog: a two-stage request leaves a decision naming its
// plan (prefill and decode worker, the reason, both TTFT estimates), with
// the prefill router's table when it disaggregated, and its outcome.
func TestDisaggDecisionLog(t *testing.T) {
	cases := []struct {
		name          string
		mode          router.DisaggMode
		withPrefill   bool
		disaggregated bool
		prefill       string
	}{
		{"disaggregated", router.DisaggAlways, true, true, "p"},
		{"no prefill worker: fallback", router.DisaggAlways, false, false, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			log := decisionlog.New(8, nil)
			s, _, _, _, _ := newDisaggServer(t, tc.mode, tc.withPrefill, func(c *Config) { c.Decisions = log })
			if rec := do(s, http.MethodPost, "/v1/completions", disaggBody); rec.Code != http.StatusOK {
				t.Fatalf("status %d: %s", rec.Code, rec.Body)
			}
			ds := log.Query(decisionlog.Filter{Limit: 10})
			if len(ds) != 1 {
				t.Fatalf("%d decisions, want 1", len(ds))
			}
			d := ds[0]
			g := d.Disagg
			if g == nil || g.Disaggregated != tc.disaggregated || g.PrefillWorker != tc.prefill || g.DecodeWorker != "d" || d.Worker != "d" ||
				g.AggTTFTMs <= 0 || (tc.disaggregated && g.DisaggTTFTMs <= 0) || g.Reason == "" {
				t.Fatalf("decision %+v, plan %+v", d, g)
			}
			if tc.disaggregated && (len(d.Candidates) != 1 || d.Candidates[0].Worker != "p") {
				t.Fatalf("candidates %+v: want the prefill router's table", d.Candidates)
			}
			if o := d.Outcome; o == nil || o.Status != http.StatusOK {
				t.Fatalf("outcome %+v", d.Outcome)
			}
		})
	}
}

const disaggBody = `{"model":"m","max_tokens":20,"stream":false,"prompt":"the quick brown fox jumps over the lazy dog again and again"}`

func TestDisaggProxy(t *testing.T) {
	cases := []struct {
		name        string
		mode        router.DisaggMode
		withPrefill bool
		failPrefill bool
		failPulls   int64
		// what happened
		prefillCalls  int
		decodeBodies  int  // requests the decode worker saw
		lastHasParams bool // the decode worker's last request carried the prefill's params
		outcome       string
		recoveries    map[string]float64 // by action
	}{
		{name: "disaggregated", mode: router.DisaggAlways, withPrefill: true, prefillCalls: 1, decodeBodies: 1, lastHasParams: true, outcome: "disaggregated"},
		{name: "prefill fails: aggregated on the decode worker", mode: router.DisaggAlways, withPrefill: true, failPrefill: true, prefillCalls: 1, decodeBodies: 1, outcome: "disaggregated", recoveries: map[string]float64{"aggregate": 1}},
		{name: "transfer fails once: retried", mode: router.DisaggAlways, withPrefill: true, failPulls: 1, prefillCalls: 1, decodeBodies: 2, lastHasParams: true, outcome: "disaggregated", recoveries: map[string]float64{"retry-transfer": 1}},
		{name: "transfer fails twice: aggregated", mode: router.DisaggAlways, withPrefill: true, failPulls: 2, prefillCalls: 1, decodeBodies: 3, outcome: "disaggregated", recoveries: map[string]float64{"retry-transfer": 1, "aggregate": 1}},
		{name: "no prefill worker: fallback", mode: router.DisaggAlways, decodeBodies: 1, outcome: "fallback"},
		{name: "auto on a tiny prompt: aggregated", mode: router.DisaggAuto, withPrefill: true, decodeBodies: 1, outcome: "aggregated"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, f, p, d, reg := newDisaggServer(t, tc.mode, tc.withPrefill)
			p.failPrefill = tc.failPrefill
			d.failPulls.Store(tc.failPulls)
			rec := do(s, http.MethodPost, "/v1/completions", disaggBody)
			if rec.Code != http.StatusOK || rec.Header().Get("X-Worker-Id") != "d" {
				t.Fatalf("status %d worker %q: %s", rec.Code, rec.Header().Get("X-Worker-Id"), rec.Body)
			}
			if got := len(p.bodies()); got != tc.prefillCalls {
				t.Fatalf("prefill worker saw %d requests, want %d", got, tc.prefillCalls)
			}
			if tc.prefillCalls > 0 {
				pb := p.bodies()[0]
				if pb["stream"] != false || pb["max_tokens"] != float64(1) {
					t.Fatalf("prefill body %v: want stream false, max_tokens 1", pb)
				}
			}
			db := d.bodies()
			if len(db) != tc.decodeBodies {
				t.Fatalf("decode worker saw %d requests, want %d", len(db), tc.decodeBodies)
			}
			last := db[len(db)-1]
			params, _ := last["kv_transfer_params"].(map[string]any)
			if has := params != nil && params["transfer_id"] == "t1"; has != tc.lastHasParams {
				t.Fatalf("decode request params %v, want params=%v", last["kv_transfer_params"], tc.lastHasParams)
			}
			if last["max_tokens"] != float64(20) {
				t.Fatalf("decode request lost the client's max_tokens: %v", last)
			}
			if n := counterValue(s.metrics.disaggDecisions.WithLabelValues("m", string(tc.mode), tc.outcome)); n != 1 {
				t.Fatalf("decisions{outcome=%s} = %v", tc.outcome, n)
			}
			for _, action := range []string{"aggregate", "retry-transfer"} {
				want := tc.recoveries[action]
				if n := counterValue(s.metrics.disaggRecoveries.WithLabelValues("m", action)); n != want {
					t.Fatalf("recoveries{%s} = %v, want %v", action, n, want)
				}
			}
			// Both bookings freed, locally and for the other replicas.
			if n := f.dr.InFlight(); n != 0 {
				t.Fatalf("%d requests still tracked", n)
			}
			f.mu.Lock()
			events := strings.Join(f.events, "\n")
			f.mu.Unlock()
			for _, want := range []string{"|d\n", "free "} {
				if !strings.Contains(events+"\n", want) {
					t.Fatalf("replica-sync notes lack %q:\n%s", want, events)
				}
			}
			if tc.outcome == "disaggregated" && !strings.Contains(events, "|p") {
				t.Fatalf("no prefill booking published:\n%s", events)
			}
			for _, name := range []string{"kvrouter_disagg_estimated_ttft_seconds", "kvrouter_disagg_transfers_total"} {
				if !gathered(t, reg, name) {
					t.Fatalf("no %s", name)
				}
			}
			if tc.name == "disaggregated" && f.dr.Stats().Transfers != 1 {
				t.Fatalf("transfers %d, want 1", f.dr.Stats().Transfers)
			}
		})
	}
}

func TestDisaggDebugRoute(t *testing.T) {
	s, _, p, d, _ := newDisaggServer(t, router.DisaggAlways, true)
	rec := do(s, http.MethodPost, "/debug/route", disaggBody)
	if rec.Code != http.StatusOK {
		t.Fatalf("status %d: %s", rec.Code, rec.Body)
	}
	var out struct {
		Chosen        string `json:"chosen"`
		ChosenPrefill string `json:"chosen_prefill"`
		Disagg        struct {
			Disaggregated bool    `json:"disaggregated"`
			Estimated     float64 `json:"estimated_ttft_s"`
			Agg           struct {
				TTFT float64 `json:"ttft_s"`
			} `json:"aggregated"`
			Dis struct {
				TTFT          float64 `json:"ttft_s"`
				TransferBytes int64   `json:"transfer_bytes"`
			} `json:"disaggregated_estimate"`
		} `json:"disagg"`
		Prefill []map[string]any `json:"prefill_workers"`
		Explain string           `json:"explain"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil {
		t.Fatal(err)
	}
	if out.Chosen != "d" || out.ChosenPrefill != "p" || !out.Disagg.Disaggregated || len(out.Prefill) != 1 {
		t.Fatalf("plan %+v", out)
	}
	if out.Disagg.Dis.TransferBytes <= 0 || out.Disagg.Dis.TTFT <= 0 || out.Disagg.Agg.TTFT <= 0 || out.Disagg.Estimated != out.Disagg.Dis.TTFT {
		t.Fatalf("estimates %+v", out.Disagg)
	}
	if !strings.Contains(out.Explain, "prefill router") {
		t.Fatalf("explain: %s", out.Explain)
	}
	// Nothing was sent or booked.
	if len(p.bodies())+len(d.bodies()) != 0 {
		t.Fatal("debug route sent the request")
	}
}

func TestDisaggBodies(t *testing.T) {
	pb, err := prefillBody([]byte(`{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":50,"messages":[]}`))
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	_ = json.Unmarshal(pb, &m)
	if m["stream"] != false || m["max_tokens"] != float64(1) || m["max_completion_tokens"] != float64(1) || m["stream_options"] != nil {
		t.Fatalf("prefill body %s", pb)
	}
	if kv, _ := m["kv_transfer_params"].(map[string]any); kv["do_remote_decode"] != true {
		t.Fatalf("prefill body %s", pb)
	}
	db, err := withTransferParams([]byte(`{"model":"m","stream":true}`), json.RawMessage(`{"transfer_id":"x"}`))
	if err != nil || !strings.Contains(string(db), `"kv_transfer_params":{"transfer_id":"x"}`) || !strings.Contains(string(db), `"stream":true`) {
		t.Fatalf("decode body %s %v", db, err)
	}
	if _, err := prefillBody([]byte(`[1]`)); err == nil {
		t.Fatal("array body accepted")
	}
	resp := &http.Response{StatusCode: 502, Body: io.NopCloser(strings.NewReader(`{"error":{"type":"kv_transfer_failed"}}`))}
	if !transferFailed(resp) || !strings.Contains(readError(resp), "kv_transfer_failed") {
		t.Fatal("transfer failure not recognised, or its body lost")
	}
}

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return -1
	}
	return m.GetCounter().GetValue()
}

func gathered(t *testing.T, reg *prometheus.Registry, name string) bool {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() == name && len(f.GetMetric()) > 0 {
			return true
		}
	}
	return false
}

// TestDisaggDeadPrefillCoolsDown: after a failed prefill the prefill worker
// is skipped for a while; requests fall back to aggregated without trying
// it again.
func TestDisaggDeadPrefillCoolsDown(t *testing.T) {
	s, _, p, d, _ := newDisaggServer(t, router.DisaggAlways, true)
	p.failPrefill = true
	for i := range 3 {
		if rec := do(s, http.MethodPost, "/v1/completions", disaggBody); rec.Code != http.StatusOK {
			t.Fatalf("request %d: %d %s", i, rec.Code, rec.Body)
		}
	}
	if n := len(p.bodies()); n != 1 {
		t.Fatalf("prefill worker tried %d times, want once", n)
	}
	if n := len(d.bodies()); n != 3 {
		t.Fatalf("decode worker served %d, want 3", n)
	}
	if n := counterValue(s.metrics.disaggDecisions.WithLabelValues("m", "always", "fallback")); n != 2 {
		t.Fatalf("fallback decisions %v, want 2", n)
	}
}

// TestDisaggTenantCharges: a two-stage request charges its tenant what its
// stages compute — the prefill worker's uncached prompt when
// disaggregated, the decode worker's when aggregated, both when a failed
// prefill is recovered on the decode worker — and its output tokens, as
// an aggregated request is charged (it used to be the whole prompt, and no
// output).
func TestDisaggTenantCharges(t *testing.T) {
	prompt := "the quick brown fox jumps over the lazy dog again and again"
	body := fmt.Sprintf(`{"model":"m","max_tokens":20,"stream":false,"prompt":%q}`, prompt)
	tokens := tokenize.Builtin().EncodeSpecial(prompt)
	n := float64(len(tokens))
	for _, tc := range []struct {
		name        string
		withPrefill bool
		cachedOnP   bool // the prefill worker holds the prompt's blocks
		failPrefill bool
		check       func(prompt float64) bool
		want        string
	}{
		{"disaggregated, prefix cached on the prefill worker", true, true, false, func(x float64) bool { return x > 0 && x < n }, "the uncached part only"},
		{"no prefill worker: aggregated", false, false, false, func(x float64) bool { return x == n }, "the whole prompt"},
		{"prefill fails: both stages", true, false, true, func(x float64) bool { return x == 2*n }, "the prompt twice"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, _ := NewTenantLedger(TenantConfig{From: TenantHeader})
			s, f, p, _, reg := newDisaggServer(t, router.DisaggAlways, tc.withPrefill, func(c *Config) { c.Tenants = l })
			p.failPrefill = tc.failPrefill
			if tc.cachedOnP {
				f.index.AddWorker("p")
				storeBlocks(t, f.fakeReplica, "p", tokens, 4, "", "")
			}
			if rec := do(s, http.MethodPost, "/v1/completions", body); rec.Code != http.StatusOK {
				t.Fatalf("status %d: %s", rec.Code, rec.Body)
			}
			charged := func(kind string) float64 {
				fams, err := reg.Gather()
				if err != nil {
					t.Fatal(err)
				}
				for _, fam := range fams {
					if fam.GetName() != "kvrouter_tenant_tokens_total" {
						continue
					}
					for _, m := range fam.GetMetric() {
						for _, lp := range m.GetLabel() {
							if lp.GetName() == "kind" && lp.GetValue() == kind {
								return m.GetCounter().GetValue()
							}
						}
					}
				}
				return 0
			}
			if got := charged("prompt"); !tc.check(got) {
				t.Errorf("prompt tokens charged %v of a %v-token prompt, want %s", got, n, tc.want)
			}
			if got := charged("output"); got != 2 {
				t.Errorf("output tokens charged %v, want the usage's 2", got)
			}
			if got := l.Virtual("m", TenantAnonymous); got != charged("prompt")+2 {
				t.Errorf("counter %v, want the charges' sum", got)
			}
		})
	}
}
