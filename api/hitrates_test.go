package api

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api/decisionlog"
	"github.com/kvrouter/kvrouter/api/hitrate"
	"github.com/kvrouter/kvrouter/router"
)

// cachingWorker answers like an engine reporting usage: the prompt tokens
// the router counted (read from the decision log's view, passed in) and
// cached tokens from cached.
func cachingWorker(t *testing.T, promptTokens, cached *atomic.Int64) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":%d,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":%d}}}`,
			promptTokens.Load(), cached.Load())
	}))
	t.Cleanup(srv.Close)
	return srv
}

// TestAPIHitRates drives one prompt three times through the proxy to a
// worker reporting cached tokens and reads the four numbers back from
// /cluster/status and /metrics: the first request finds nothing anywhere;
// the next two find the whole prompt (but its last block) in both
// reference caches and in the router's prediction (kv-approx: the router
// predicts what it routed); the engine delivers what it reports. Then an
// engine that reports no cached tokens while the router predicts many is
// named as engine flags.
func TestAPIHitRates(t *testing.T) {
	cfg := router.DefaultConfig()
	cfg.Mode = router.ModeKVApprox
	rep := newFakeReplica("m", cfg)
	var promptTokens, cached atomic.Int64
	rep.addWorker("m", "w1", cachingWorker(t, &promptTokens, &cached).URL)
	reg := prometheus.NewRegistry()
	s := New(Config{Registry: reg, AllowLoopbackWorkers: true, Decisions: decisionlog.New(16, nil)}, rep)

	body := fmt.Sprintf(`{"model":"m","prompt":%q}`, strings.Repeat("the quick brown fox jumps over the lazy dog ", 20))
	send := func() decisionlog.Decision {
		t.Helper()
		if rec := do(s, "POST", "/v1/completions", body); rec.Code != 200 {
			t.Fatalf("completion: %d %s", rec.Code, rec.Body)
		}
		ds := s.cfg.Decisions.Query(decisionlog.Filter{Limit: 1})
		if len(ds) != 1 {
			t.Fatal("no decision")
		}
		return ds[0]
	}
	// The first request tells the prompt's size; the engine then reports
	// the same prompt tokens and half of them cached.
	d := send()
	T, n, bs := int64(d.PromptTokens), d.PromptBlocks, cfg.BlockSize
	if n < 4 {
		t.Fatalf("prompt of %d blocks: too short for the test", n)
	}
	promptTokens.Store(T)
	cached.Store(T / 2)
	send()
	send()

	hit := int64(hitrate.Tokens(n, bs, int(T))) // requests 2 and 3, in every reference
	status := func() hitrate.Report {
		t.Helper()
		rec := do(s, "GET", "/cluster/status", "")
		var doc struct {
			HitRates hitrate.Report `json:"hit_rates"`
		}
		if rec.Code != 200 || json.Unmarshal(rec.Body.Bytes(), &doc) != nil {
			t.Fatalf("status: %d %s", rec.Code, rec.Body)
		}
		return doc.HitRates
	}
	rep1 := status()
	if len(rep1.Models) != 1 || rep1.Models[0].Model != "m" || rep1.Models[0].FleetBlocks != 1000 {
		t.Fatalf("hit_rates: %+v", rep1)
	}
	m := rep1.Models[0]
	want := float64(2*hit) / float64(3*T)
	// The first answer's usage named no prompt tokens (not counted as
	// reported); the next two reported T/2 of T cached.
	wantDelivered := float64(T/2) / float64(T)
	for _, r := range m.Windows {
		if r.Requests != 3 || r.PromptTokens != 3*T || !near(r.Available, want) || !near(r.Reachable, want) ||
			!near(r.Captured, want) || !near(r.Delivered, wantDelivered) || r.DeliveredRequests != 2 {
			t.Errorf("window %s: %s, want available = reachable = captured %.3f, delivered %.3f", r.Window, ratesText(r), want, wantDelivered)
		}
	}
	if len(m.Workers) != 1 || m.Workers[0].Worker != "w1" || m.Workers[0].Windows[0].Available != nil ||
		!near(m.Workers[0].Windows[0].Captured, want) {
		t.Errorf("workers: %+v", m.Workers)
	}

	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"kvrouter_hit_rate_available", map[string]string{"model": "m", "window": "1m"}, want},
		{"kvrouter_hit_rate_reachable", map[string]string{"model": "m", "window": "10m"}, want},
		{"kvrouter_hit_rate_captured", map[string]string{"model": "m", "worker": "w1", "window": "1m"}, want},
		{"kvrouter_hit_rate_delivered", map[string]string{"model": "m", "worker": "", "window": "10m"}, wantDelivered},
	} {
		if got := gatherGauge(t, reg, c.name, c.labels); got < c.want-1e-9 || got > c.want+1e-9 {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}

	// The engine stops reporting cached tokens (prefix caching off):
	// delivered falls toward 0 while captured stays high.
	cached.Store(0)
	for range 60 { // 2 requests of 62 with T/2 cached: delivered 1/62 < 0.02
		send()
	}
	r := status().Models[0].Windows[0]
	var causes []string
	for _, g := range r.Gaps {
		causes = append(causes, g.Cause)
	}
	if len(causes) != 1 || causes[0] != hitrate.CauseEngineFlags {
		t.Errorf("gaps %v (%s), want engine_flags", causes, ratesText(r))
	}
}

func near(p *float64, want float64) bool { return p != nil && *p > want-1e-9 && *p < want+1e-9 }

func ratesText(r hitrate.Rates) string {
	f := func(p *float64) string {
		if p == nil {
			return "null"
		}
		return fmt.Sprintf("%.3f", *p)
	}
	return fmt.Sprintf("requests %d prompt %d available %s reachable %s captured %s delivered %s (%d)",
		r.Requests, r.PromptTokens, f(r.Available), f(r.Reachable), f(r.Captured), f(r.Delivered), r.DeliveredRequests)
}

// gatherGauge reads the gauge name{labels} from reg.
func gatherGauge(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) != len(labels) {
				continue
			}
			for _, l := range m.GetLabel() {
				if v, ok := labels[l.GetName()]; !ok || v != l.GetValue() {
					continue next
				}
			}
			return m.GetGauge().GetValue()
		}
	}
	t.Fatalf("%s%v not exported", name, labels)
	return 0
}
