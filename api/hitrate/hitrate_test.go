package hitrate

import (
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"
	"time"
)

var t0 = time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)

// chain makes a prompt's chained block hashes: prefix p, n blocks. Two
// prompts share a leading run exactly where their prefixes agree.
func chain(p uint64, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = p*1000 + uint64(i)
	}
	return out
}

// with is chain(p, n) followed by m blocks of tail t: chained, so they
// depend on the prefix they follow too.
func with(p uint64, n int, t uint64, m int) []uint64 {
	out := chain(p, n)
	for i := range m {
		out = append(out, (p+1)<<40|(t+1)<<20|uint64(n)<<10|uint64(i))
	}
	return out
}

const bs = 16

func TestHitRateArrive(t *testing.T) {
	type req struct {
		hashes  []uint64
		cap     int // the fleet's capacity at this request
		avail   int // expected leading blocks, available
		reach   int // and reachable
		prompts int // prompt tokens (0: full blocks + 2)
	}
	cases := []struct {
		name      string
		maxBlocks int
		reqs      []req
	}{
		{"a repeat is available and reachable", 0, []req{
			{hashes: chain(1, 3), cap: 100},
			{hashes: chain(1, 3), cap: 100, avail: 3, reach: 3},
		}},
		{"a shared prefix, then a new tail", 0, []req{
			{hashes: chain(1, 3), cap: 100},
			{hashes: with(1, 2, 9, 2), cap: 100, avail: 2, reach: 2},
			{hashes: with(1, 2, 9, 2), cap: 100, avail: 4, reach: 4},
		}},
		{"capacity: another prompt pushed the tail out of the fleet, the prefix stays (tail first)", 0, []req{
			{hashes: chain(1, 3), cap: 4},
			{hashes: chain(2, 3), cap: 4},
			{hashes: chain(1, 3), cap: 4, avail: 3, reach: 1},
		}},
		{"no capacity registered: nothing reachable", 0, []req{
			{hashes: chain(1, 3)},
			{hashes: chain(1, 3), avail: 3},
		}},
		{"the history bound: beyond it a block is not available", 4, []req{
			{hashes: chain(1, 3)},
			{hashes: chain(2, 3)},
			{hashes: chain(1, 3), avail: 1},
		}},
		{"the bound never falls below the fleet's capacity", 2, []req{
			{hashes: chain(1, 3), cap: 6},
			{hashes: chain(2, 3), cap: 6},
			{hashes: chain(1, 3), cap: 6, avail: 3, reach: 3},
		}},
		{"a grown fleet reaches what the history kept", 0, []req{
			{hashes: chain(1, 3), cap: 2},
			{hashes: chain(2, 3), cap: 2},
			{hashes: chain(1, 3), cap: 2, avail: 3},
			{hashes: chain(2, 3), cap: 9, avail: 3, reach: 3},
		}},
		{"a prompt cached whole still computes its last block", 0, []req{
			{hashes: chain(1, 3), cap: 100, prompts: 48},
			{hashes: chain(1, 3), cap: 100, prompts: 48, avail: 2, reach: 2},
		}},
		{"an empty prompt", 0, []req{{}, {}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			capNow := 0
			tr := New(Config{MaxBlocks: c.maxBlocks, CapacityEvery: time.Nanosecond}, func(string) int { return capNow })
			for i, r := range c.reqs {
				capNow = r.cap
				pt := r.prompts
				if pt == 0 {
					pt = len(r.hashes)*bs + 2
				}
				got := tr.Arrive(t0.Add(time.Duration(i)*time.Second), "m", r.hashes, pt, bs)
				want := Reuse{Available: Tokens(r.avail, bs, pt), Reachable: Tokens(r.reach, bs, pt)}
				if got != want {
					t.Errorf("request %d: got %+v, want %+v", i, got, want)
				}
			}
		})
	}
}

// naiveLRU is kvbench's pooled-LRU reference written plainly: a recency
// list (most recent first) of at most cap blocks.
type naiveLRU struct {
	cap   int
	order []uint64
}

func (l *naiveLRU) admit(hashes []uint64) int {
	m := 0
	for m < len(hashes) && slices.Contains(l.order, hashes[m]) {
		m++
	}
	rest := slices.DeleteFunc(slices.Clone(l.order), func(h uint64) bool { return slices.Contains(hashes, h) })
	l.order = append(slices.Clone(hashes), rest...)
	if len(l.order) > l.cap {
		l.order = l.order[:l.cap]
	}
	return m
}

// TestHitRateAgainstNaiveLRU: on random streams of prompts sharing
// prefixes, with the fleet's capacity changing, the two-segment cache
// answers exactly what two plain LRU caches (the history bound and the
// fleet's capacity) answer.
func TestHitRateAgainstNaiveLRU(t *testing.T) {
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 7))
		bound := 20 + rng.IntN(40)
		s := newStack(bound)
		hist := &naiveLRU{cap: bound}
		var pooled *naiveLRU
		capacity := -1
		for i := range 400 {
			if i%50 == 0 { // the fleet changes: a fresh LRU holding the top of the history
				capacity = rng.IntN(bound + 1)
				pooled = &naiveLRU{cap: capacity, order: slices.Clone(hist.order[:min(capacity, len(hist.order))])}
			}
			h := with(uint64(rng.IntN(6)), 1+rng.IntN(4), uint64(rng.IntN(8)), rng.IntN(4))
			a, r := s.admit(h, capacity)
			wa, wr := hist.admit(h), pooled.admit(h)
			if a != wa || r != wr {
				t.Fatalf("seed %d request %d %v (bound %d, capacity %d): got available %d reachable %d, want %d %d",
					seed, i, h, bound, capacity, a, r, wa, wr)
			}
			if s.size() > bound {
				t.Fatalf("seed %d: %d blocks tracked, bound %d", seed, s.size(), bound)
			}
		}
	}
}

func TestHitRateTokens(t *testing.T) {
	for _, c := range []struct{ blocks, prompt, want int }{
		{0, 100, 0}, {2, 100, 32}, {6, 100, 96}, {6, 96, 80}, {7, 96, 96}, {1, 16, 0},
	} {
		if got := Tokens(c.blocks, bs, c.prompt); got != c.want {
			t.Errorf("Tokens(%d, %d, %d) = %d, want %d", c.blocks, bs, c.prompt, got, c.want)
		}
	}
}

func rateOf(t *testing.T, rep Report, model, worker, window string) Rates {
	t.Helper()
	for _, m := range rep.Models {
		if m.Model != model {
			continue
		}
		ws := m.Windows
		if worker != "" {
			ws = nil
			for _, w := range m.Workers {
				if w.Worker == worker {
					ws = w.Windows
				}
			}
		}
		for _, r := range ws {
			if r.Window == window {
				return r
			}
		}
	}
	t.Fatalf("no rates for %s/%s/%s in %+v", model, worker, window, rep)
	return Rates{}
}

func near(p *float64, want float64) bool { return p != nil && *p > want-1e-9 && *p < want+1e-9 }

// TestHitRateWindows: each window sums the requests within it; a worker's
// series is dropped once it has nothing in the longest window.
func TestHitRateWindows(t *testing.T) {
	tr := New(Config{}, nil)
	full := Sample{PromptTokens: 100, Reuse: Reuse{Available: 100, Reachable: 80}, Captured: 60, Reported: true, EnginePrompt: 100, EngineCached: 40}
	none := Sample{PromptTokens: 100, Reported: true, EnginePrompt: 100}
	tr.Record(t0, "m", "w1", full)                                   // 10 min window only, at t0+5m
	tr.Record(t0.Add(4*time.Minute+50*time.Second), "m", "w2", none) // both
	now := t0.Add(5 * time.Minute)
	rep := tr.Snapshot(now)

	for _, c := range []struct {
		worker, window         string
		requests               int64
		avail, reach, captured float64
		delivered              float64
	}{
		{"", "1m", 1, 0, 0, 0, 0},
		{"", "10m", 2, 0.5, 0.4, 0.3, 0.2},
		{"w1", "10m", 1, -1, -1, 0.6, 0.4},
		{"w2", "1m", 1, -1, -1, 0, 0},
	} {
		r := rateOf(t, rep, "m", c.worker, c.window)
		if r.Requests != c.requests || !near(r.Captured, c.captured) || !near(r.Delivered, c.delivered) {
			t.Errorf("%q/%s: %+v", c.worker, c.window, r)
		}
		if c.avail >= 0 && (!near(r.Available, c.avail) || !near(r.Reachable, c.reach)) {
			t.Errorf("%q/%s: available/reachable %+v", c.worker, c.window, r)
		}
		if c.avail < 0 && (r.Available != nil || r.Reachable != nil) {
			t.Errorf("%q/%s: a worker has no available/reachable: %+v", c.worker, c.window, r)
		}
	}
	// w1 left the 1m window: no 1m figures to divide.
	if r := rateOf(t, rep, "m", "w1", "1m"); r.Requests != 0 || r.Captured != nil || r.Delivered != nil {
		t.Errorf("w1/1m: %+v", r)
	}

	// 11 minutes later nothing is in any window; a new series sweeps the old.
	later := t0.Add(16 * time.Minute)
	tr.Record(later, "m", "w3", none)
	rep = tr.Snapshot(later)
	if len(rep.Models) != 1 || len(rep.Models[0].Workers) != 1 || rep.Models[0].Workers[0].Worker != "w3" {
		t.Errorf("after the windows passed: %+v", rep.Models)
	}
	tr.smu.Lock()
	n := len(tr.series)
	tr.smu.Unlock()
	if n != 2 { // m's aggregate and w3
		t.Errorf("%d series kept, want 2", n)
	}
}

// TestHitRateDeliveredWithoutUsage: requests whose answer had no usage are
// out of delivered's denominator; none at all leaves delivered null.
func TestHitRateDeliveredWithoutUsage(t *testing.T) {
	tr := New(Config{}, nil)
	tr.Record(t0, "m", "w", Sample{PromptTokens: 100, Captured: 50})
	r := rateOf(t, tr.Snapshot(t0), "m", "", "1m")
	if r.Delivered != nil || r.DeliveredRequests != 0 || !near(r.Captured, 0.5) {
		t.Errorf("%+v", r)
	}
	tr.Record(t0, "m", "w", Sample{PromptTokens: 100, Captured: 50, Reported: true, EnginePrompt: 90, EngineCached: 45})
	r = rateOf(t, tr.Snapshot(t0), "m", "", "1m")
	if !near(r.Delivered, 0.5) || r.DeliveredRequests != 1 || !near(r.Captured, 0.5) {
		t.Errorf("%+v", r)
	}
}

func TestHitRateGaps(t *testing.T) {
	f := func(v float64) *float64 { return &v }
	cases := []struct {
		name string
		r    Rates
		want []string // causes, in order
	}{
		{"all equal", Rates{Available: f(.8), Reachable: f(.8), Captured: f(.8), Delivered: f(.8)}, nil},
		{"within 5 points", Rates{Available: f(.8), Reachable: f(.76), Captured: f(.72), Delivered: f(.68)}, nil},
		{"capacity", Rates{Available: f(.9), Reachable: f(.6), Captured: f(.6), Delivered: f(.6)}, []string{CauseCapacity}},
		{"placement", Rates{Available: f(.9), Reachable: f(.9), Captured: f(.5), Delivered: f(.5)}, []string{CausePlacement}},
		{"prediction drift", Rates{Available: f(.9), Reachable: f(.9), Captured: f(.9), Delivered: f(.6)}, []string{CausePredictionDrift}},
		{"engine flags: delivered ~0 while captured is high", Rates{Available: f(.9), Reachable: f(.9), Captured: f(.9), Delivered: f(.01)}, []string{CauseEngineFlags}},
		{"delivered 0 with little captured is drift, not flags", Rates{Captured: f(.08), Delivered: f(0)}, []string{CausePredictionDrift}},
		{"under-prediction", Rates{Captured: f(.3), Delivered: f(.6)}, []string{CauseUnderPrediction}},
		{"all three", Rates{Available: f(.95), Reachable: f(.7), Captured: f(.5), Delivered: f(.3)}, []string{CauseCapacity, CausePlacement, CausePredictionDrift}},
		{"routing beats one pooled LRU: nothing to name", Rates{Available: f(.9), Reachable: f(.7), Captured: f(.8), Delivered: f(.8)}, []string{CauseCapacity}},
		{"a worker: no available or reachable", Rates{Captured: f(.8), Delivered: f(.4)}, []string{CausePredictionDrift}},
		{"no usage reported: no delivered gap", Rates{Available: f(.9), Reachable: f(.9), Captured: f(.9)}, nil},
		{"no requests", Rates{}, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var got []string
			for _, g := range Gaps(c.r) {
				got = append(got, g.Cause)
				if g.Points < GapPoints && g.Cause != CauseEngineFlags {
					t.Errorf("%s named at %.1f points", g.Cause, g.Points)
				}
				if g.Why == "" {
					t.Errorf("%s: no explanation", g.Cause)
				}
			}
			if !slices.Equal(got, c.want) {
				t.Errorf("causes %v, want %v", got, c.want)
			}
		})
	}
}

// BenchmarkHitRate is the per-request cost on the proxy path: Arrive (both
// reference caches) and Record (the windows) for a 64-block prompt drawn
// from 1,024 prompts sharing 64 prefixes, a fleet of 64 × 2,048 blocks —
// the shape of router's BenchmarkRoute/workers=64/prompt=64.
func BenchmarkHitRate(b *testing.B) {
	tr := New(Config{}, func(string) int { return 64 * 2048 })
	prompts := make([][]uint64, 1024)
	for i := range prompts {
		prompts[i] = with(uint64(i%64), 48, uint64(i), 16)
	}
	workers := make([]string, 64)
	for i := range workers {
		workers[i] = "w" + string(rune('a'+i%26)) + string(rune('a'+i/26))
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		now := t0.Add(time.Duration(i) * time.Millisecond)
		h := prompts[(i*31)%len(prompts)]
		r := tr.Arrive(now, "m", h, 64*bs+5, bs)
		tr.Record(now, "m", workers[i%64], Sample{PromptTokens: 64*bs + 5, Reuse: r, Captured: r.Reachable, Reported: true, EnginePrompt: 64*bs + 5, EngineCached: r.Reachable})
	}
}

// BenchmarkHitRateMemory reports the heap bytes per tracked block with the
// history full at its default bound (the memory bound DESIGN.md states).
func BenchmarkHitRateMemory(b *testing.B) {
	for range b.N {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		tr := New(Config{}, nil)
		for i := range DefaultMaxBlocks / 64 {
			tr.Arrive(t0, "m", with(uint64(i), 0, uint64(i), 64), 64*bs, bs)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(DefaultMaxBlocks), "B/block")
		runtime.KeepAlive(tr)
	}
}
