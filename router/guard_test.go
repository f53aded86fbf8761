package router

import (
	"errors"
	"math"
	"slices"
	"testing"
	"time"
)

// hashesFrom returns n distinct block hashes starting at base.
func hashesFrom(base uint64, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = base + uint64(i)
	}
	return out
}

// TestRouterLatencyGuard: the workers a guarded request is kept off are
// those where a fresh request's predicted TTFT is over the factor × its
// idle value (the prefill queue it would wait behind, the cached prefix
// discounted; an unpriced KV wait counts as over); an idle fleet keeps
// nobody off; the request waits only when every worker it may use is over;
// a factor of 0 is off.
func TestRouterLatencyGuard(t *testing.T) {
	req := Request{ID: "x", Tokens: 160, Hashes: hashesFrom(1000, 10)} // 10 blocks, none cached
	for _, tc := range []struct {
		name     string
		factor   float64
		bookings []Booking
		exclude  []WorkerID
		wantOut  []WorkerID
		wantHold bool
	}{
		{name: "idle fleet", factor: 1, wantOut: nil},
		{name: "off", factor: 0, bookings: []Booking{
			{ID: "1", Worker: "a", PrefillTokens: 320}, {ID: "2", Worker: "b", PrefillTokens: 320},
		}, wantOut: nil},
		{name: "one worker's prefill queue over", factor: 1.5, bookings: []Booking{
			{ID: "1", Worker: "a", PrefillTokens: 320}, // (320 + 160) / 160 = 3
		}, wantOut: []WorkerID{"a"}},
		{name: "a queue within the factor", factor: 3, bookings: []Booking{
			{ID: "1", Worker: "a", PrefillTokens: 320},
		}, wantOut: nil},
		{name: "every worker over: the request waits", factor: 1.5, bookings: []Booking{
			{ID: "1", Worker: "a", PrefillTokens: 320}, {ID: "2", Worker: "b", PrefillTokens: 160}, // b: 2
		}, wantOut: []WorkerID{"a", "b"}, wantHold: true},
		{name: "excluded workers are not judged", factor: 1.5, bookings: []Booking{
			{ID: "1", Worker: "a", PrefillTokens: 320},
		}, exclude: []WorkerID{"b"}, wantOut: []WorkerID{"a"}, wantHold: true},
		{name: "a KV wait not priced yet counts as over", factor: 100, bookings: []Booking{
			{ID: "1", Worker: "a", Hashes: hashesFrom(1, 95)}, // 95 of 100 blocks held: the request's 10 do not fit
		}, wantOut: []WorkerID{"a"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			r := newTestRouter(t, cfg, NewIndex(cfg.BlockSize),
				WorkerInfo{ID: "a", TotalBlocks: 100, MaxBatchedTokens: 1000}, WorkerInfo{ID: "b", TotalBlocks: 100, MaxBatchedTokens: 1000})
			for _, b := range tc.bookings {
				b.Added = t0
				r.Load().Add(b)
			}
			q := req
			q.Exclude = tc.exclude
			out, hold := r.LatencyGuard(q, tc.factor, t0, nil)
			if !slices.Equal(out, tc.wantOut) || hold != tc.wantHold {
				t.Errorf("out %v hold %v, want %v %v (ratios %+v)", out, hold, tc.wantOut, tc.wantHold, r.GuardRatios(q, t0))
			}
		})
	}
}

// TestRouterLatencyGuardCache: what a fresh request waits behind is
// weighed against its own prefill, the prefix the worker caches
// discounted, as the SLO rule's TTFT is.
func TestRouterLatencyGuardCache(t *testing.T) {
	cfg := DefaultConfig()
	ix := NewIndex(cfg.BlockSize)
	r := newTestRouter(t, cfg, ix, WorkerInfo{ID: "a", TotalBlocks: 1000, MaxBatchedTokens: 1000})
	req := Request{ID: "x", Tokens: 160, Hashes: hashesFrom(1000, 10)}
	r.Load().Add(Booking{ID: "1", Worker: "a", PrefillTokens: 160, Added: t0})
	g := r.GuardRatios(req, t0)
	if len(g) != 1 || g[0].TTFT != 2 {
		t.Fatalf("nothing cached: %+v, want a TTFT ratio of (160 + 160) / 160 = 2", g)
	}
	blocks := make([]StoredBlock, 8)
	for i := range blocks {
		blocks[i] = StoredBlock{EngineHash: 1000 + uint64(i), ContentHash: 1000 + uint64(i)}
	}
	if err := ix.Apply("a", KVEvent{Kind: EventStored, Blocks: blocks}); err != nil {
		t.Fatal(err)
	}
	if g := r.GuardRatios(req, t0); len(g) != 1 || g[0].TTFT != 6 {
		t.Errorf("8 of 10 blocks cached: %+v, want (10 + 10 − 8) / 2 = 6", g)
	}
}

// TestRouterLatencyGuardTPOT: with Config.LearnLatency a kv-mode router
// learns the SLO rule's TPOT line from its own requests, and the guard then
// judges a worker's fill by it against the line at fill 0.
func TestRouterLatencyGuardTPOT(t *testing.T) {
	cfg := DefaultConfig()
	cfg.LearnLatency = true
	r := newTestRouter(t, cfg, NewIndex(cfg.BlockSize), WorkerInfo{ID: "a", TotalBlocks: 100, MaxBatchedTokens: 10_000})
	now := t0
	// Two requests of 10 output tokens: one alone (TPOT 10 ms), one beside
	// 50 held blocks (TPOT 30 ms).
	learn := func(id string, base uint64, tpot time.Duration) {
		if _, err := r.Route(Request{ID: id, Tokens: 160, Hashes: hashesFrom(base, 10)}, now); err != nil {
			t.Fatal(err)
		}
		now = now.Add(10 * time.Millisecond)
		r.PrefillDoneAt(id, now)
		now = now.Add(9 * tpot)
		r.FinishedAt(id, 10, now)
	}
	learn("alone", 100, 10*time.Millisecond)
	r.Load().Add(Booking{ID: "held", Worker: "a", Hashes: hashesFrom(1, 50), Added: now})
	r.PrefillDoneAt("held", now) // running: no prefill queue, only its fill
	learn("beside", 200, 30*time.Millisecond)
	req := Request{ID: "x", Tokens: 160, Hashes: hashesFrom(1000, 10)}
	g := r.GuardRatios(req, now)
	if len(g) != 1 || !(g[0].TPOT > 2) || g[0].TTFT != 1 {
		t.Fatalf("beside 50 held blocks: %+v, want a TPOT ratio over 2 and a TTFT ratio of 1", g)
	}
	if out, hold := r.LatencyGuard(req, 2, now, nil); !hold || !slices.Equal(out, []WorkerID{"a"}) {
		t.Errorf("factor 2: out %v hold %v, want a held", out, hold)
	}
	// The first-token guard (tenant isolation's unreserved workers) does
	// not read the TPOT line: no prefill queue, nobody kept off.
	if out, hold := r.FirstTokenGuard(req, 1, now, nil); hold || len(out) != 0 {
		t.Errorf("first-token guard, factor 1: out %v hold %v, want nothing (the TTFT ratio is 1)", out, hold)
	}
	r.Free("held")
	if g := r.GuardRatios(req, now); len(g) != 1 || g[0].TPOT != 1 {
		t.Errorf("idle again: %+v, want a TPOT ratio of 1", g)
	}
	// Without LearnLatency a kv-mode router learns no line: TTFT alone.
	cfg.LearnLatency = false
	r2 := newTestRouter(t, cfg, NewIndex(cfg.BlockSize), WorkerInfo{ID: "a", TotalBlocks: 100, MaxBatchedTokens: 10_000})
	r, now = r2, t0
	learn("alone", 100, 10*time.Millisecond)
	r.Load().Add(Booking{ID: "held", Worker: "a", Hashes: hashesFrom(1, 50), Added: now})
	r.PrefillDoneAt("held", now)
	learn("beside", 200, 30*time.Millisecond)
	if g := r.GuardRatios(req, now); len(g) != 1 || !math.IsNaN(g[0].TPOT) {
		t.Errorf("not learning: %+v, want no TPOT prediction", g)
	}
}

// TestRouterLatencyGuardValidate: 0 is off; a factor is finite and at
// least 1 (an idle worker's ratio), else ErrInvalidConfig.
func TestRouterLatencyGuardValidate(t *testing.T) {
	for _, tc := range []struct {
		f  float64
		ok bool
	}{
		{0, true}, {1, true}, {1.2, true}, {40, true},
		{0.99, false}, {-1, false}, {math.NaN(), false}, {math.Inf(1), false}, {math.Inf(-1), false},
	} {
		err := ValidateLatencyGuard(tc.f)
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrInvalidConfig)) {
			t.Errorf("factor %v: error %v, want ok %v", tc.f, err, tc.ok)
		}
	}
}
