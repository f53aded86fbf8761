package router

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"
)

var t0 = time.Unix(1_700_000_000, 0)

func ptr[T any](v T) *T { return &v }

// tokens returns n deterministic token ids starting at base.
func tokens(base, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(base + i)
	}
	return out
}

func newTestRouter(t *testing.T, cfg Config, ix *Index, workers ...WorkerInfo) *Router {
	t.Helper()
	r, err := New(cfg, ix, 1)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	r.SetWorkers(workers)
	for _, w := range workers {
		if ix != nil {
			ix.AddWorker(w.ID)
		}
	}
	return r
}

// store records the full blocks of toks on worker w, as a worker's KV event would.
func store(t *testing.T, ix *Index, w WorkerID, toks []uint32) {
	t.Helper()
	seq := SequenceHashes(toks, ix.BlockSize(), "")
	blocks := make([]StoredBlock, len(seq))
	for i, h := range seq {
		blocks[i] = StoredBlock{EngineHash: h, ContentHash: h}
	}
	if err := ix.Apply(w, KVEvent{Kind: EventStored, Blocks: blocks}); err != nil {
		t.Fatalf("store on %s: %v", w, err)
	}
}

// The seeds' three-worker table (seed 004): isl 10 blocks, overlaps 2/5/8,
// decode blocks 10/5/9 → costs 18/10/11, worker 2 chosen.
func TestCostSeedTable(t *testing.T) {
	cfg := DefaultConfig()
	rows := []struct {
		overlap, decode int
		wantCost        float64
	}{{2, 10, 18}, {5, 5, 10}, {8, 9, 11}}
	var wc []WorkerCost
	for i, row := range rows {
		prefill, decode, cost := computeCost(&cfg, costInput{isl: 10 * cfg.BlockSize, overlap: row.overlap, load: WorkerLoad{ActiveBlocks: row.decode}})
		if cost != row.wantCost || prefill != float64(10-row.overlap) || decode != float64(row.decode) {
			t.Errorf("worker %d: prefill %v decode %v cost %v, want cost %v", i+1, prefill, decode, cost, row.wantCost)
		}
		wc = append(wc, WorkerCost{Worker: WorkerID(fmt.Sprint(i + 1)), Cost: cost})
	}
	for range 100 {
		if got := pickByCost(wc, 0, newRand(7)); wc[got].Worker != "2" {
			t.Fatalf("chose worker %s, want 2", wc[got].Worker)
		}
	}
}

// The seeds' logged formulas (seed 004) with overlap_score_weight 1.5 and
// block size 16: a cold 34-token prompt, then a 36-token prompt sharing the
// first block with it.
func TestCostSeedLogLines(t *testing.T) {
	cfg := DefaultConfig()
	cfg.PrefillLoadScale = 1.5
	ix := NewIndex(16)
	r := newTestRouter(t, cfg, ix, WorkerInfo{ID: "w890"}, WorkerInfo{ID: "w892"})

	first := tokens(100, 34)
	seq := SequenceHashes(first, 16, "")
	d, err := r.Route(Request{ID: "a", Hashes: seq, Tokens: len(first)}, t0)
	if err != nil {
		t.Fatal(err)
	}
	for _, row := range d.Rows {
		if got := row.Formula(1.5); got != "5.188 = 1.5 * 2.125 + 2.000" {
			t.Errorf("cold %s: %q", row.Worker, got)
		}
	}
	r.Free("a")
	// Only the first block of the first prompt is cached, on w892.
	store(t, ix, "w892", first[:16])

	second := append(append([]uint32{}, first[:16]...), tokens(900, 20)...)
	d, err = r.Route(Request{ID: "b", Hashes: SequenceHashes(second, 16, ""), Tokens: len(second)}, t0)
	if err != nil {
		t.Fatal(err)
	}
	want := map[WorkerID]string{"w890": "5.375 = 1.5 * 2.250 + 2.000", "w892": "3.875 = 1.5 * 1.250 + 2.000"}
	for _, row := range d.Rows {
		if got := row.Formula(1.5); got != want[row.Worker] {
			t.Errorf("%s: %q, want %q", row.Worker, got, want[row.Worker])
		}
	}
	if d.Worker != "w892" || d.Overlap != 1 {
		t.Errorf("chose %s with %d cached, want w892 with 1", d.Worker, d.Overlap)
	}
	if ex := d.Explain(); !strings.Contains(ex, "Selected worker: worker_id=w892, logit: 3.875, cached blocks: 1") {
		t.Errorf("explain:\n%s", ex)
	}
}

func TestCostKnobs(t *testing.T) {
	tests := []struct {
		name              string
		credit, scale     float64
		track             bool
		active, overlap   int
		wantPrefill, want float64
	}{
		{"defaults", 1, 1, true, 0, 2, 8, 8},
		{"active prefill counts", 1, 1, true, 32, 2, 10, 10},
		{"prefill tracking off", 1, 1, false, 32, 2, 8, 8},
		{"half credit", 0.5, 1, true, 0, 4, 8, 8},
		{"decode set: no credit, no tracking", 0, 1, false, 32, 9, 10, 10},
		{"clamped at zero", 1, 1, true, 0, 12, 0, 0},
		{"scale 2", 1, 2, true, 0, 2, 8, 16},
	}
	for _, tc := range tests {
		cfg := DefaultConfig()
		cfg.OverlapCredit, cfg.PrefillLoadScale, cfg.TrackPrefillTokens = tc.credit, tc.scale, tc.track
		prefill, _, cost := computeCost(&cfg, costInput{isl: 160, overlap: tc.overlap, load: WorkerLoad{ActivePrefillTokens: tc.active}})
		if prefill != tc.wantPrefill || cost != tc.want {
			t.Errorf("%s: prefill %v cost %v, want %v %v", tc.name, prefill, cost, tc.wantPrefill, tc.want)
		}
	}
	if d := DecodeConfig(DefaultConfig()); d.OverlapCredit != 0 || d.TrackPrefillTokens {
		t.Errorf("decode config %+v", d)
	}
}

func TestConfigValidate(t *testing.T) {
	mut := func(f func(*Config)) Config { c := DefaultConfig(); f(&c); return c }
	tests := []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"defaults", DefaultConfig(), true},
		{"NaN credit", mut(func(c *Config) { c.OverlapCredit = math.NaN() }), false},
		{"credit above 1", mut(func(c *Config) { c.OverlapCredit = 1.5 }), false},
		{"negative scale", mut(func(c *Config) { c.PrefillLoadScale = -1 }), false},
		{"+Inf temperature", mut(func(c *Config) { c.Temperature = math.Inf(1) }), false},
		{"negative temperature", mut(func(c *Config) { c.Temperature = -0.1 }), false},
		{"decode threshold 1.2", mut(func(c *Config) { c.Thresholds.ActiveDecodeBlocks = ptr(1.2) }), false},
		{"decode threshold 0.85", mut(func(c *Config) { c.Thresholds.ActiveDecodeBlocks = ptr(0.85) }), true},
		{"negative prefill threshold", mut(func(c *Config) { c.Thresholds.ActivePrefillTokens = ptr(int64(-1)) }), false},
		{"NaN frac", mut(func(c *Config) { c.Thresholds.ActivePrefillTokensFrac = ptr(math.NaN()) }), false},
		{"frac 1.5", mut(func(c *Config) { c.Thresholds.ActivePrefillTokensFrac = ptr(1.5) }), true},
		{"zero block size", mut(func(c *Config) { c.BlockSize = 0 }), false},
		{"bad mode", mut(func(c *Config) { c.Mode = "fastest" }), false},
		{"bad queue policy", mut(func(c *Config) { c.QueuePolicy = "sjf" }), false},
		{"negative queue threshold", mut(func(c *Config) { c.QueueThreshold = ptr(-0.5) }), false},
	}
	for _, tc := range tests {
		err := tc.cfg.Validate()
		if (err == nil) != tc.ok {
			t.Errorf("%s: err = %v, want ok=%v", tc.name, err, tc.ok)
		}
		if err != nil && !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("%s: %v is not ErrInvalidConfig", tc.name, err)
		}
	}
}

func TestRouterBusyThresholds(t *testing.T) {
	ws := []WorkerInfo{{ID: "a", TotalBlocks: 10, MaxBatchedTokens: 100}, {ID: "b", TotalBlocks: 10, MaxBatchedTokens: 100}}
	tests := []struct {
		name  string
		th    Thresholds
		busyA bool
	}{
		{"decode blocks", Thresholds{ActiveDecodeBlocks: ptr(0.5)}, true},
		{"decode blocks under", Thresholds{ActiveDecodeBlocks: ptr(0.9)}, false},
		{"prefill tokens", Thresholds{ActivePrefillTokens: ptr(int64(50))}, true},
		{"prefill frac", Thresholds{ActivePrefillTokensFrac: ptr(0.5)}, true},
		{"prefill frac under", Thresholds{ActivePrefillTokensFrac: ptr(1.0)}, false},
		{"none", Thresholds{}, false},
	}
	for _, tc := range tests {
		cfg := DefaultConfig()
		cfg.Thresholds = tc.th
		r := newTestRouter(t, cfg, NewIndex(16), ws...)
		// a: 6 active blocks, 96 prefill tokens.
		r.Load().Add(Booking{ID: "x", Worker: "a", Hashes: []uint64{1, 2, 3, 4, 5, 6}, PrefillTokens: 96, Added: t0})
		d, err := r.Decide(Request{ID: "q", Tokens: 16, Hashes: []uint64{99}}, t0)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if d.Rows[0].Busy != tc.busyA || d.Rows[1].Busy {
			t.Errorf("%s: busy a=%v b=%v (%s)", tc.name, d.Rows[0].Busy, d.Rows[1].Busy, d.Rows[0].Reason())
		}
		if tc.busyA && d.Worker != "b" {
			t.Errorf("%s: routed to busy worker %s", tc.name, d.Worker)
		}
	}
	// Both busy: a distinct outcome, not a random pick.
	cfg := DefaultConfig()
	cfg.Thresholds.ActivePrefillTokens = ptr(int64(0))
	r := newTestRouter(t, cfg, NewIndex(16), ws...)
	r.Load().Add(Booking{ID: "x", Worker: "a", PrefillTokens: 10, Added: t0})
	r.Load().Add(Booking{ID: "y", Worker: "b", PrefillTokens: 10, Added: t0})
	if _, err := r.Route(Request{ID: "q", Tokens: 16}, t0); !errors.Is(err, ErrAllBusy) {
		t.Errorf("all busy: err = %v", err)
	}
}

func TestRouterNoWorkersAndShortPrompts(t *testing.T) {
	r := newTestRouter(t, DefaultConfig(), NewIndex(16))
	if _, err := r.Route(Request{ID: "a", Tokens: 3}, t0); !errors.Is(err, ErrNoWorkers) {
		t.Errorf("no workers: %v", err)
	}
	r.SetWorkers([]WorkerInfo{{ID: "w"}})
	for _, n := range []int{0, 1, 15} {
		d, err := r.Route(Request{ID: fmt.Sprint("p", n), Tokens: n, Hashes: SequenceHashes(tokens(1, n), 16, "")}, t0)
		if err != nil || d.Worker != "w" || d.Overlap != 0 {
			t.Errorf("%d-token prompt: %+v %v", n, d, err)
		}
	}
}

func TestRouterModes(t *testing.T) {
	ws := []WorkerInfo{{ID: "a"}, {ID: "b"}, {ID: "c"}}
	t.Run("round-robin cycles", func(t *testing.T) {
		cfg := DefaultConfig()
		cfg.Mode = ModeRoundRobin
		r := newTestRouter(t, cfg, nil, ws...)
		var got []WorkerID
		for i := range 6 {
			d, _ := r.Route(Request{ID: fmt.Sprint(i), Tokens: 16}, t0)
			got = append(got, d.Worker)
		}
		if fmt.Sprint(got) != "[a b c a b c]" {
			t.Errorf("order %v", got)
		}
	})
	t.Run("least-loaded", func(t *testing.T) {
		cfg := DefaultConfig()
		cfg.Mode = ModeLeastLoaded
		r := newTestRouter(t, cfg, nil, ws...)
		r.Load().Add(Booking{ID: "x", Worker: "a", Added: t0})
		r.Load().Add(Booking{ID: "y", Worker: "c", Added: t0})
		d, _ := r.Route(Request{ID: "q", Tokens: 16}, t0)
		if d.Worker != "b" {
			t.Errorf("chose %s", d.Worker)
		}
	})
	t.Run("random covers all", func(t *testing.T) {
		cfg := DefaultConfig()
		cfg.Mode = ModeRandom
		r := newTestRouter(t, cfg, nil, ws...)
		seen := map[WorkerID]int{}
		for i := range 300 {
			d, _ := r.Decide(Request{ID: fmt.Sprint(i), Tokens: 16}, t0)
			seen[d.Worker]++
		}
		if len(seen) != 3 {
			t.Errorf("random picks %v", seen)
		}
	})
	t.Run("kv follows the cache, load-aware ignores it", func(t *testing.T) {
		ix := NewIndex(16)
		prompt := tokens(5, 160)
		for _, mode := range []Mode{ModeKV, ModeLoadAware} {
			cfg := DefaultConfig()
			cfg.Mode = mode
			r := newTestRouter(t, cfg, ix, ws...)
			store(t, ix, "b", prompt)
			d, _ := r.Decide(Request{ID: "q", Tokens: len(prompt), Hashes: SequenceHashes(prompt, 16, "")}, t0)
			if mode == ModeKV && (d.Worker != "b" || d.Overlap != 10) {
				t.Errorf("kv chose %s overlap %d", d.Worker, d.Overlap)
			}
			if mode == ModeLoadAware && d.Overlap != 0 {
				t.Errorf("load-aware saw overlap %d", d.Overlap)
			}
		}
	})
	t.Run("temperature spreads, zero does not", func(t *testing.T) {
		rows := []WorkerCost{{Cost: 10}, {Cost: 11}, {Cost: 20}}
		rng := newRand(3)
		counts := make([]int, 3)
		for range 3000 {
			counts[pickByCost(rows, 1, rng)]++
		}
		// p ∝ exp(-(c-10)/10): 1, e^-0.1, e^-1 → about 0.43, 0.39, 0.16.
		if counts[0] < 1100 || counts[1] < 1000 || counts[2] < 350 || counts[2] > 650 {
			t.Errorf("softmax counts %v", counts)
		}
		for range 100 {
			if pickByCost(rows, 0, rng) != 0 {
				t.Fatal("temperature 0 must take the minimum")
			}
		}
	})
}

func TestRouterApproxPredictsAndExpires(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Mode = ModeKVApprox
	cfg.ApproxTTL = 120 * time.Second
	r := newTestRouter(t, cfg, nil, WorkerInfo{ID: "a"}, WorkerInfo{ID: "b"})
	prompt := tokens(1, 64)
	req := Request{ID: "1", Tokens: 64, Hashes: SequenceHashes(prompt, 16, "")}
	d1, _ := r.Route(req, t0)
	r.Free("1")
	req.ID = "2"
	d2, _ := r.Route(req, t0.Add(time.Minute))
	if d2.Worker != d1.Worker || d2.Overlap != 4 {
		t.Errorf("second request went to %s with overlap %d, want %s with 4", d2.Worker, d2.Overlap, d1.Worker)
	}
	r.Free("2")
	// The refresh at t0+1m keeps the blocks until t0+3m.
	req.ID = "3"
	if d, _ := r.Decide(req, t0.Add(170*time.Second)); d.Overlap != 4 {
		t.Errorf("refreshed prediction expired early: overlap %d", d.Overlap)
	}
	if d, _ := r.Decide(req, t0.Add(181*time.Second)); d.Overlap != 0 {
		t.Errorf("prediction outlived its TTL: overlap %d", d.Overlap)
	}
	if n := r.Predicted().Len(); n != 0 {
		t.Errorf("%d predicted blocks left", n)
	}
}

func TestRouterConcurrentRoutingAndEvents(t *testing.T) {
	ix := NewIndex(16)
	ws := []WorkerInfo{{ID: "a"}, {ID: "b"}, {ID: "c"}, {ID: "d"}}
	r := newTestRouter(t, DefaultConfig(), ix, ws...)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(2)
		go func() {
			defer wg.Done()
			for i := range 300 {
				p := tokens(i%7*1000, 128)
				id := fmt.Sprint(g, "-", i)
				if _, err := r.Route(Request{ID: id, Tokens: 128, Hashes: SequenceHashes(p, 16, "")}, t0); err != nil {
					t.Error(err)
					return
				}
				r.PrefillDone(id)
				r.Free(id)
			}
		}()
		go func() {
			defer wg.Done()
			w := ws[g].ID
			for i := range 300 {
				p := tokens(i%7*1000, 128)
				store(t, ix, w, p)
				seq := SequenceHashes(p, 16, "")
				_ = ix.Apply(w, KVEvent{Kind: EventRemoved, Removed: seq[4:]})
			}
		}()
	}
	wg.Wait()
	if n := r.Load().Len(); n != 0 {
		t.Errorf("%d requests still booked", n)
	}
}
