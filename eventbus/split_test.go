package eventbus

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

func TestSplitRuns(t *testing.T) {
	tests := []struct {
		name  string
		sizes []int
		limit int
		ends  []int
	}{
		{"empty", nil, 10, nil},
		{"one", []int{3}, 10, []int{1}},
		{"all fit", []int{3, 3, 4}, 10, []int{3}},
		{"one byte over", []int{3, 3, 5}, 10, []int{2, 3}},
		{"exactly at the cap, twice", []int{5, 5, 5, 5}, 10, []int{2, 4}},
		{"each alone at the cap", []int{10, 10, 10}, 10, []int{1, 2, 3}},
		{"a small one after a full run", []int{9, 1, 1}, 10, []int{2, 3}},
		{"greedy, never reordered", []int{6, 5, 4, 1, 7}, 10, []int{1, 4, 5}},
		{"an oversized one alone", []int{2, 11, 2}, 10, []int{1, 2, 3}},
		{"an oversized first", []int{11, 2, 2}, 10, []int{1, 3}},
		{"an oversized last", []int{2, 2, 11}, 10, []int{2, 3}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := splitRuns(tc.sizes, tc.limit)
			if !slices.Equal(got, tc.ends) {
				t.Fatalf("splitRuns(%v, %d) = %v, want %v", tc.sizes, tc.limit, got, tc.ends)
			}
			// Whatever the table says: runs cover every event once, in
			// order, and each fits unless it is one oversized event.
			from := 0
			for _, to := range got {
				sum := 0
				for _, n := range tc.sizes[from:to] {
					sum += n
				}
				if to <= from || (sum > tc.limit && to-from > 1) {
					t.Fatalf("run [%d,%d) of %d bytes", from, to, sum)
				}
				from = to
			}
			if from != len(tc.sizes) {
				t.Fatalf("runs end at %d of %d", from, len(tc.sizes))
			}
		})
	}
}

// entrySize is the test's EntryBytes: 10 bytes per event plus 8 per block.
func entrySize(ev *WireEvent) int { return 10 + 8*len(ev.Blocks) + 8*len(ev.Removed) }

// A fetched batch larger than the entry cap reaches the applier as several
// calls, each within the cap, in stream order, every event applied once and
// acked (the stream empties); one event too large for any entry is
// terminated as too_large and does not hold up the rest.
func TestBusConsumerSplitsBatches(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	nc, js := connect(t, s.ClientURL(), "t", log)
	ensureStream(t, js, 1)

	const limit = 4 * (10 + 8) // four one-block events per entry
	var rejections []Rejection
	var mu sync.Mutex
	c, err := NewConsumer(context.Background(), js, ConsumerConfig{Logger: log, Registerer: prometheus.NewRegistry(),
		MaxBatch: 64, BatchWait: 200 * time.Millisecond, EntryBytes: entrySize, MaxEntryBytes: limit,
		OnReject: func(r Rejection) { mu.Lock(); rejections = append(rejections, r); mu.Unlock() }})
	if err != nil {
		t.Fatal(err)
	}
	// A worker's event of 8 blocks (10+64 > 72 bytes) goes first, then 40
	// one-block events of two workers.
	huge := storedEvent(1, 1, 2, 3, 4, 5, 6, 7, 8)
	huge.Worker = "big"
	if _, err := js.Publish(context.Background(), EventSubject("big"), mustEncode(t, huge)); err != nil {
		t.Fatal(err)
	}
	ids := publishN(t, nc, []string{"w1", "w2"}, 20)

	a := newFakeApplier()
	var calls [][]string
	runConsumer(t, c, ApplierFunc(func(ctx context.Context, evs []WireEvent) error {
		size := 0
		var call []string
		for i := range evs {
			size += entrySize(&evs[i])
			call = append(call, evs[i].MsgID())
		}
		if size > limit {
			t.Errorf("one applier call of %d events carries %d bytes, cap %d", len(evs), size, limit)
		}
		mu.Lock()
		calls = append(calls, call)
		mu.Unlock()
		return a.ApplyEvents(ctx, evs)
	}))
	waitApplied(t, a, len(ids))
	waitStreamEmpty(t, js)
	a.check(t, ids, false) // each once, each worker's in order

	mu.Lock()
	defer mu.Unlock()
	if len(calls) < len(ids)/4 {
		t.Fatalf("%d applier calls for %d events, want at least %d", len(calls), len(ids), len(ids)/4)
	}
	if got := counterValue(t, c.Metrics().Batches); got != float64(len(calls)) {
		t.Fatalf("batches_total %v, applier calls %d", got, len(calls))
	}
	if got := counterValue(t, c.Metrics().SplitBatches); got < 1 {
		t.Fatalf("split_batches_total %v", got)
	}
	if got := rejected(t, c, ReasonTooLarge); got != 1 {
		t.Fatalf("rejected{too_large} = %v", got)
	}
	if len(rejections) != 1 || rejections[0].Event == nil || rejections[0].Event.Worker != "big" {
		t.Fatalf("rejections %+v", rejections)
	}
}

// A run that fails after an earlier run of the same fetched batch committed
// leaves the rest of the batch for redelivery: the committed runs were
// acked (work-queue retention removed them), the rest comes back first and
// in order; nothing is lost, applied twice or out of order.
func TestBusConsumerSplitRunFails(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	nc, js := connect(t, s.ClientURL(), "t", log)
	ensureStream(t, js, 1)
	c, err := NewConsumer(context.Background(), js, ConsumerConfig{Logger: log, MaxBatch: 64,
		BatchWait: 200 * time.Millisecond, RetryBackoff: 5 * time.Millisecond,
		EntryBytes: entrySize, MaxEntryBytes: 3 * 18})
	if err != nil {
		t.Fatal(err)
	}
	ids := publishN(t, nc, []string{"w1"}, 30)
	a := newFakeApplier()
	calls := 0
	a.fail = func([]WireEvent) error {
		calls++
		if calls%3 == 2 { // the second call fails: its batch's first run committed
			return context.DeadlineExceeded
		}
		return nil
	}
	runConsumer(t, c, a)
	waitApplied(t, a, len(ids))
	waitStreamEmpty(t, js)
	a.check(t, ids, false)
	if got := counterValue(t, c.Metrics().ApplyErrors); got < 1 {
		t.Fatalf("apply_errors_total %v", got)
	}
}
