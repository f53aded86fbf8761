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

// TestRouterFirstTokenOrderLag: an unreserved worker whose prefill load
// this router saw drop within the sync lag counts the admission window
// (threshold × max batched tokens) as filled; a reserved one, a drop older
// than the lag, a lag of 0 or no drop at all count nothing extra.
func TestRouterFirstTokenOrderLag(t *testing.T) {
	req := Request{ID: "x", Tokens: 160, Hashes: hashesFrom(1000, 10)} // 10 blocks, none cached
	lag := 5 * time.Millisecond
	for _, tc := range []struct {
		name     string
		dropAt   time.Duration // after t0, on the dropped worker
		dropped  WorkerID
		lag      time.Duration
		now      time.Duration // after t0
		reserved []WorkerID
		want     []WorkerID
	}{
		// a and b reserved and busy (10 + 10 blocks queued: 20), c
		// unreserved and empty (10): c is quickest.
		{name: "no drop: the unreserved one", lag: lag, now: time.Millisecond, reserved: []WorkerID{"a", "b"}, want: []WorkerID{"a", "b"}},
		{name: "c just freed: the reserved ones", dropped: "c", lag: lag, now: time.Millisecond, reserved: []WorkerID{"a", "b"}, want: []WorkerID{"c"}},
		{name: "c freed a lag ago: the unreserved one", dropped: "c", lag: lag, now: lag, reserved: []WorkerID{"a", "b"}, want: []WorkerID{"a", "b"}},
		{name: "lag 0: the unreserved one", dropped: "c", now: time.Millisecond, reserved: []WorkerID{"a", "b"}, want: []WorkerID{"a", "b"}},
		{name: "a reserved worker freed: nothing extra", dropped: "a", lag: lag, now: time.Millisecond, reserved: []WorkerID{"a", "b"}, want: []WorkerID{"a", "b"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			q := 0.5
			cfg.QueueThreshold = &q // window: 0.5 × 1000 tokens = 31.25 blocks
			r := newTestRouter(t, cfg, NewIndex(cfg.BlockSize), WorkerInfo{ID: "a", TotalBlocks: 1000, MaxBatchedTokens: 1000},
				WorkerInfo{ID: "b", TotalBlocks: 1000, MaxBatchedTokens: 1000}, WorkerInfo{ID: "c", TotalBlocks: 1000, MaxBatchedTokens: 1000})
			r.Load().Add(Booking{ID: "1", Worker: "a", PrefillTokens: 160, Added: t0})
			r.Load().Add(Booking{ID: "2", Worker: "b", PrefillTokens: 160, Added: t0})
			if tc.dropped != "" {
				r.Load().Add(Booking{ID: "d", Worker: tc.dropped, PrefillTokens: 160, Added: t0})
				r.PrefillDoneAt("d", t0.Add(tc.dropAt))
				if tc.dropped == "a" {
					r.Load().Add(Booking{ID: "1b", Worker: "a", PrefillTokens: 160, Added: t0}) // still busy
				}
			}
			got := r.FirstTokenOrderLag(req, tc.reserved, tc.lag, t0.Add(tc.now), nil)
			slices.Sort(got)
			if !slices.Equal(got, tc.want) {
				t.Errorf("kept off %v, want %v", got, tc.want)
			}
			// Without the lag it is FirstTokenOrder.
			if tc.lag == 0 {
				if plain := r.FirstTokenOrder(req, tc.reserved, t0.Add(tc.now), nil); !slices.Equal(sorted(plain), got) {
					t.Errorf("lag 0: %v, FirstTokenOrder %v", got, plain)
				}
			}
		})
	}
}

func sorted(w []WorkerID) []WorkerID { slices.Sort(w); return w }
