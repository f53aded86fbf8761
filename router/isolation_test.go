package router

import (
	"slices"
	"testing"
	"time"
)

// TestRouterShouldQueueExcept: a request waits unless a worker that neither
// the set nor its Exclude names has room within its share of the window;
// with every worker named it waits; without a threshold nothing waits;
// WorkerIDs lists the workers sorted.
func TestRouterShouldQueueExcept(t *testing.T) {
	half := 0.5
	req := Request{ID: "x", Tokens: 160}
	busy := []Booking{{ID: "1", Worker: "a", PrefillTokens: 800}} // a over 0.5 × 1000; b idle
	for _, tc := range []struct {
		name      string
		threshold *float64
		share     float64
		bookings  []Booking
		except    []WorkerID
		exclude   []WorkerID
		want      bool
	}{
		{"an idle worker outside the set", &half, 1, busy, []WorkerID{"a"}, nil, false},
		{"the idle worker in the set", &half, 1, busy, []WorkerID{"b"}, nil, true},
		{"the idle worker excluded by the request", &half, 1, busy, nil, []WorkerID{"b"}, true},
		{"every worker in the set", &half, 1, nil, []WorkerID{"a", "b"}, nil, true},
		{"nothing named, one idle", &half, 1, busy, nil, nil, false},
		{"within a share: b's prefill plus the request's over half the window", &half, 0.5,
			[]Booking{{ID: "1", Worker: "a", PrefillTokens: 800}, {ID: "2", Worker: "b", PrefillTokens: 200}}, []WorkerID{"a"}, nil, true},
		{"no threshold", nil, 1, busy, []WorkerID{"b"}, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.QueueThreshold = tc.threshold
			r := newTestRouter(t, cfg, NewIndex(cfg.BlockSize),
				WorkerInfo{ID: "b", TotalBlocks: 100, MaxBatchedTokens: 1000}, WorkerInfo{ID: "a", TotalBlocks: 100, MaxBatchedTokens: 1000})
			for _, b := range tc.bookings {
				b.Added = time.Now()
				r.Load().Add(b)
			}
			q := req
			q.Exclude = tc.exclude
			if got := r.ShouldQueueExcept(tc.share, q, tc.except); got != tc.want {
				t.Errorf("ShouldQueueExcept = %v, want %v", got, tc.want)
			}
			if ids := r.WorkerIDs(nil); !slices.Equal(ids, []WorkerID{"a", "b"}) {
				t.Errorf("WorkerIDs = %v, want [a b]", ids)
			}
		})
	}
}

// TestRouterFirstTokenOrder: a request of a tenant under its share, with
// tenant isolation and the guard on, is kept off every worker predicted
// slower to its first token than the quickest (the prefill queue it would
// wait behind plus its own prefill less the cached prefix), and off the
// unreserved workers tied with a reserved one; the quickest unreserved
// worker is kept when every reserved one is slower. Before it the request
// went to a reserved worker while one had room, behind the tenant's own
// prefills there, with the flood's worker, kept quick, idle (kvbench sim,
// 2026-12-06).
func TestRouterFirstTokenOrder(t *testing.T) {
	req := Request{ID: "x", Tokens: 160, Hashes: hashesFrom(1000, 10)} // 10 blocks, none cached
	for _, tc := range []struct {
		name     string
		bookings []Booking
		cached   map[WorkerID]int // blocks of req each worker holds
		reserved []WorkerID
		exclude  []WorkerID
		want     []WorkerID
	}{
		{name: "idle fleet: the reserved ones", reserved: []WorkerID{"a", "b"}, want: []WorkerID{"c"}},
		{name: "a reserved worker busy: the other reserved", reserved: []WorkerID{"a", "b"},
			bookings: []Booking{{ID: "1", Worker: "a", PrefillTokens: 160}}, want: []WorkerID{"a", "c"}},
		{name: "both reserved busy: the unreserved one", reserved: []WorkerID{"a", "b"},
			bookings: []Booking{{ID: "1", Worker: "a", PrefillTokens: 160}, {ID: "2", Worker: "b", PrefillTokens: 320}},
			want:     []WorkerID{"a", "b"}},
		{name: "a reserved tied with the unreserved: the reserved", reserved: []WorkerID{"a", "b"},
			bookings: []Booking{{ID: "1", Worker: "a", PrefillTokens: 160}, {ID: "2", Worker: "b", PrefillTokens: 160}, {ID: "3", Worker: "c", PrefillTokens: 160}},
			want:     []WorkerID{"c"}},
		{name: "the cached prefix counts", reserved: []WorkerID{"a"},
			bookings: []Booking{{ID: "1", Worker: "b", PrefillTokens: 64}}, // b: 4 + 10 − 8 = 6 blocks; a, c: 10
			cached:   map[WorkerID]int{"b": 8}, want: []WorkerID{"a", "c"}},
		{name: "excluded workers are not judged", reserved: []WorkerID{"a", "b"},
			bookings: []Booking{{ID: "1", Worker: "a", PrefillTokens: 160}}, exclude: []WorkerID{"b"}, want: []WorkerID{"a"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			ix := NewIndex(cfg.BlockSize)
			r := newTestRouter(t, cfg, ix, WorkerInfo{ID: "a", TotalBlocks: 1000, MaxBatchedTokens: 1000},
				WorkerInfo{ID: "b", TotalBlocks: 1000, MaxBatchedTokens: 1000}, WorkerInfo{ID: "c", TotalBlocks: 1000, MaxBatchedTokens: 1000})
			for w, n := range tc.cached {
				blocks := make([]StoredBlock, n)
				for i := range blocks {
					blocks[i] = StoredBlock{EngineHash: 1000 + uint64(i), ContentHash: 1000 + uint64(i)}
				}
				if err := ix.Apply(w, KVEvent{Kind: EventStored, Blocks: blocks}); err != nil {
					t.Fatal(err)
				}
			}
			for _, b := range tc.bookings {
				b.Added = t0
				r.Load().Add(b)
			}
			q := req
			q.Exclude = tc.exclude
			got := r.FirstTokenOrder(q, tc.reserved, t0, nil)
			slices.Sort(got)
			if !slices.Equal(got, tc.want) {
				t.Errorf("kept off %v, want %v (ratios %+v)", got, tc.want, r.GuardRatios(q, t0))
			}
		})
	}
}
