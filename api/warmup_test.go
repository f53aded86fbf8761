package api

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/router"
)

// TestAPIWarmUpSteersJoiner: with --router-warmup-share 1 a worker that
// joins the candidate set after the server first saw it takes every
// request whose prefix is new, and the steering is counted; the workers
// there at the start are never "joining"; off (share 0), nothing is
// steered.
func TestAPIWarmUpSteersJoiner(t *testing.T) {
	for _, share := range []float64{1, 0} {
		rep := newFakeReplica("m", router.DefaultConfig())
		var hits1, hits2 atomic.Int64
		rep.addWorker("m", "w1", fakeWorker(t, &hits1).URL)
		reg := prometheus.NewRegistry()
		s := New(Config{Registry: reg, AllowLoopbackWorkers: true, WarmUpShare: share}, rep)
		body := func(i int) string {
			return fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"prompt number %d, long enough to fill a couple of blocks of sixteen tokens each, surely"}]}`, i)
		}
		if rec := do(s, "POST", "/v1/chat/completions", body(0)); rec.Code != 200 {
			t.Fatalf("first request: %d %s", rec.Code, rec.Body)
		}
		rep.addWorker("m", "w2", fakeWorker(t, &hits2).URL)
		on := map[string]int{}
		for i := 1; i <= 12; i++ {
			rec := do(s, "POST", "/v1/chat/completions", body(i))
			if rec.Code != 200 {
				t.Fatalf("request %d: %d %s", i, rec.Code, rec.Body)
			}
			on[rec.Header().Get("X-Worker-Id")]++
		}
		steered := 0.0
		mfs, _ := reg.Gather()
		for _, mf := range mfs {
			if mf.GetName() == "kvrouter_warmup_steered_total" {
				for _, m := range mf.GetMetric() {
					steered += m.GetCounter().GetValue()
				}
			}
		}
		switch {
		case share == 1 && on["w2"] != 12:
			t.Fatalf("share 1: new prefixes went %v, want all on the joining w2", on)
		case share == 0 && (s.warm != nil || steered != 0):
			t.Fatalf("share 0: warm-up on (%v), steered %v", s.warm != nil, steered)
		}
		if share == 1 && steered == 0 {
			t.Fatal("nothing was steered: the router chose w2 each time by itself, the test proves nothing")
		}
		t.Logf("share %v: %v, steered %v", share, on, steered)
	}
}

// TestAPIWarmUpEnds: a joining worker stops warming after warmUpMax, its
// warm time exported; the warm-up then steers nothing.
func TestAPIWarmUpEnds(t *testing.T) {
	rep := newFakeReplica("m", router.DefaultConfig())
	var hits atomic.Int64
	rep.addWorker("m", "w1", fakeWorker(t, &hits).URL)
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, WarmUpShare: 1}, rep)
	now := time.Unix(1_700_000_000, 0)
	s.warm.clock = func() time.Time { return now }
	rt, _ := rep.Router("m")
	if _, ok := s.warm.target("m", rt.Workers(), now); ok {
		t.Fatal("a worker there from the start is warming")
	}
	rep.addWorker("m", "w2", "http://127.0.0.1:9")
	if w, ok := s.warm.target("m", rt.Workers(), now); !ok || w != "w2" {
		t.Fatalf("joining worker %q %v", w, ok)
	}
	if w, ok := s.warm.target("m", rt.Workers(), now.Add(warmUpMax)); ok {
		t.Fatalf("still warming %q after the limit", w)
	}
	if v := readGauge(s.warm.warmFor.WithLabelValues("w2")); v != warmUpMax.Seconds() {
		t.Fatalf("warm seconds %v", v)
	}
	if _, ok := s.warm.target("m", rt.Workers(), now.Add(2*warmUpMax)); ok {
		t.Fatal("warming again")
	}
	// w2 leaves and comes back (registered again: an empty cache): it
	// warms again.
	rt.SetWorkers(rt.Workers()[:1])
	if _, ok := s.warm.target("m", rt.Workers(), now.Add(3*warmUpMax)); ok {
		t.Fatal("warming with w2 gone")
	}
	rep.addWorker("m", "w2", "http://127.0.0.1:9")
	if w, ok := s.warm.target("m", rt.Workers(), now.Add(3*warmUpMax)); !ok || w != "w2" {
		t.Fatalf("w2 back: warming %q %v", w, ok)
	}
}
