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
