package router

import (
	"fmt"
	"testing"
	"time"
)

func TestActiveLoadLifecycle(t *testing.T) {
	a := NewActiveLoad(300 * time.Second)
	a.Add(Booking{ID: "r1", Worker: "w", Hashes: []uint64{1, 2, 3}, PrefillTokens: 40, Added: t0})
	a.Add(Booking{ID: "r2", Worker: "w", Hashes: []uint64{1, 2, 9}, PrefillTokens: 10, Added: t0.Add(time.Second)})
	steps := []struct {
		name         string
		do           func()
		prefill, blk int
	}{
		{"both booked; shared prefix counted once", func() {}, 50, 4},
		{"r1 first token", func() { a.PrefillDone("r1") }, 10, 4},
		{"r1 first token again", func() { a.PrefillDone("r1") }, 10, 4},
		{"r1 freed", func() { a.Free("r1") }, 10, 3},
		{"unknown free", func() { a.Free("nope") }, 10, 3},
		{"r2 expired after 300 s", func() { a.Expire(t0.Add(302 * time.Second)) }, 0, 0},
	}
	for _, s := range steps {
		s.do()
		if l := a.Load("w"); l.ActivePrefillTokens != s.prefill || l.ActiveBlocks != s.blk {
			t.Errorf("%s: %+v, want prefill %d blocks %d", s.name, l, s.prefill, s.blk)
		}
	}
	if n := a.NewBlocks("w", []uint64{1, 2}); n != 2 {
		t.Errorf("new blocks on empty worker = %d", n)
	}
}

func TestActiveLoadNewBlocksAndOrigins(t *testing.T) {
	a := NewActiveLoad(0)
	a.Add(Booking{ID: "x", Origin: "r2", Worker: "w", Hashes: []uint64{1, 2}, Added: t0})
	a.Add(Booking{ID: "y", Worker: "w", Hashes: []uint64{5}, Added: t0})
	if n := a.NewBlocks("w", []uint64{1, 2, 3}); n != 1 {
		t.Errorf("new blocks %d, want 1", n)
	}
	if got := a.Bookings("r2"); len(got) != 1 || got[0].ID != "x" {
		t.Errorf("bookings %v", got)
	}
	if n := a.DropOrigin("r2"); n != 1 || a.Load("w").ActiveBlocks != 1 {
		t.Errorf("drop origin: %d, load %+v", n, a.Load("w"))
	}
	// Re-adding a booking replaces it instead of double counting.
	a.Add(Booking{ID: "y", Worker: "w", Hashes: []uint64{5}, PrefillTokens: 3, Added: t0})
	if l := a.Load("w"); l.Requests != 1 || l.ActivePrefillTokens != 3 {
		t.Errorf("re-add: %+v", l)
	}
	if len(a.Expire(t0.Add(time.Hour))) != 0 {
		t.Error("expiry 0 must never expire")
	}
}

func TestQueuePolicies(t *testing.T) {
	reqs := []Request{{ID: "long", Tokens: 900}, {ID: "short", Tokens: 100}, {ID: "vip", Tokens: 500, Priority: 5}, {ID: "mid", Tokens: 300}}
	tests := []struct {
		policy QueuePolicy
		want   []string
	}{
		{QueueFCFS, []string{"vip", "long", "short", "mid"}},
		{QueueLCFS, []string{"vip", "mid", "short", "long"}},
		{QueueWSPT, []string{"vip", "short", "mid", "long"}},
	}
	for _, tc := range tests {
		q := NewQueue(tc.policy)
		for i, r := range reqs {
			q.Push(Waiting{Request: r, Arrived: t0.Add(time.Duration(i))})
		}
		var got []string
		for q.Len() > 0 {
			w, _ := q.Pop()
			got = append(got, w.Request.ID)
		}
		if len(got) != len(tc.want) {
			t.Fatalf("%s: %v", tc.policy, got)
		}
		for i := range got {
			if got[i] != tc.want[i] {
				t.Errorf("%s: order %v, want %v", tc.policy, got, tc.want)
				break
			}
		}
		if _, ok := q.Pop(); ok {
			t.Errorf("%s: pop from empty", tc.policy)
		}
	}
}

func TestRouterShouldQueue(t *testing.T) {
	cfg := DefaultConfig()
	cfg.QueueThreshold = ptr(0.5)
	r := newTestRouter(t, cfg, nil, WorkerInfo{ID: "a", MaxBatchedTokens: 100}, WorkerInfo{ID: "b", MaxBatchedTokens: 100})
	r.Load().Add(Booking{ID: "1", Worker: "a", PrefillTokens: 60, Added: t0})
	if r.ShouldQueue() {
		t.Error("b is below the threshold")
	}
	r.Load().Add(Booking{ID: "2", Worker: "b", PrefillTokens: 60, Added: t0})
	if !r.ShouldQueue() {
		t.Error("every worker is above the threshold")
	}
	r.PrefillDone("2")
	if r.ShouldQueue() {
		t.Error("b's prefill finished")
	}
}

// TestRouterShouldQueueWithin: a request that may fill only a share of the
// window waits unless a worker is idle of prefill or stays within that
// share with its tokens added; a share of 1 is ShouldQueue.
func TestRouterShouldQueueWithin(t *testing.T) {
	cfg := DefaultConfig()
	cfg.QueueThreshold = ptr(0.8)
	r := newTestRouter(t, cfg, nil, WorkerInfo{ID: "a", MaxBatchedTokens: 100}, WorkerInfo{ID: "b", MaxBatchedTokens: 100})
	r.Load().Add(Booking{ID: "1", Worker: "a", PrefillTokens: 50, Added: t0})
	if r.ShouldQueueWithin(0.5, Request{Tokens: 30}) {
		t.Error("b has no prefill work")
	}
	r.Load().Add(Booking{ID: "2", Worker: "b", PrefillTokens: 10, Added: t0})
	for _, tc := range []struct {
		share  float64
		tokens int
		want   bool
	}{
		{0.5, 30, false},  // b: 10 + 30 ≤ 40
		{0.5, 31, true},   // b: 41 > 40, a: 81 > 40
		{0.25, 10, false}, // b: 10 + 10 ≤ 20
		{0.25, 11, true},  // b: 21 > 20
		{1, 1000, false},  // ShouldQueue: b at 10 ≤ 80
	} {
		if got := r.ShouldQueueWithin(tc.share, Request{Tokens: tc.tokens}); got != tc.want {
			t.Errorf("share %v, %d tokens: queue %v, want %v", tc.share, tc.tokens, got, tc.want)
		}
	}
	r.Load().Add(Booking{ID: "3", Worker: "b", PrefillTokens: 80, Added: t0})
	r.Load().Add(Booking{ID: "4", Worker: "a", PrefillTokens: 40, Added: t0})
	if !r.ShouldQueueWithin(1, Request{}) || !r.ShouldQueue() {
		t.Error("every worker over the threshold")
	}
}

// TestRouterShouldQueueWithinCountsTheCache: the room a request takes on a
// worker is what that worker must compute, its prompt less the prefix it
// caches.
func TestRouterShouldQueueWithinCountsTheCache(t *testing.T) {
	cfg := DefaultConfig()
	cfg.BlockSize = 16
	cfg.QueueThreshold = ptr(0.8)
	ix := NewIndex(16)
	r := newTestRouter(t, cfg, ix, WorkerInfo{ID: "a", MaxBatchedTokens: 100}, WorkerInfo{ID: "b", MaxBatchedTokens: 100})
	r.Load().Add(Booking{ID: "1", Worker: "a", PrefillTokens: 50, Added: t0})
	r.Load().Add(Booking{ID: "2", Worker: "b", PrefillTokens: 10, Added: t0})
	req := Request{Tokens: 48, Hashes: []uint64{11, 12, 13}}
	if !r.ShouldQueueWithin(0.5, req) {
		t.Fatal("nothing cached: b would hold 10 + 48 > 40")
	}
	if err := ix.Apply("b", KVEvent{Kind: EventStored, Blocks: []StoredBlock{{EngineHash: 11, ContentHash: 11}, {EngineHash: 12, ContentHash: 12}}}); err != nil {
		t.Fatal(err)
	}
	if r.ShouldQueueWithin(0.5, req) {
		t.Error("b caches two of three blocks: 10 + 16 ≤ 40")
	}
}

// A request generating n sequences (OpenAI's n) is booked as n decoding
// requests sharing the prompt's blocks, and freed as n.
func TestActiveLoadSequences(t *testing.T) {
	a := NewActiveLoad(0)
	a.Add(Booking{ID: "n4", Worker: "w", Hashes: []uint64{1, 2}, PrefillTokens: 32, Sequences: 4, Added: t0})
	a.Add(Booking{ID: "one", Worker: "w", Hashes: []uint64{1, 2}, PrefillTokens: 32, Added: t0})
	if l := a.Load("w"); l.Requests != 5 || l.ActiveBlocks != 2 || l.ActivePrefillTokens != 64 {
		t.Errorf("booked: %+v, want 5 requests, 2 shared blocks, 64 prefill tokens", l)
	}
	if b := a.Bookings(""); len(b) != 2 || b[0].ID != "n4" || b[0].Sequences != 4 {
		t.Errorf("bookings must carry the sequences: %+v", b)
	}
	a.Free("n4")
	if l := a.Load("w"); l.Requests != 1 {
		t.Errorf("after freeing n=4: %+v", l)
	}
}

func TestRouterBooksSequences(t *testing.T) {
	cfg := DefaultConfig()
	rt, err := New(cfg, NewIndex(cfg.BlockSize), 1)
	if err != nil {
		t.Fatal(err)
	}
	rt.SetWorkers([]WorkerInfo{{ID: "w", TotalBlocks: 100}})
	if _, err := rt.Route(Request{ID: "r", Tokens: 10, Sequences: 3}, t0); err != nil {
		t.Fatal(err)
	}
	if l := rt.Load().Load("w"); l.Requests != 3 {
		t.Errorf("n=3 booked as %d requests", l.Requests)
	}
}

// TestLoadHolderFilterSaturates: 300 in-flight blocks whose hashes share
// the filter's counter (past its 255), then 255 of them freed (a counter
// that went on counting down would read 0): the load rows still find every
// block still held, and none of the freed ones.
func TestLoadHolderFilterSaturates(t *testing.T) {
	a := NewActiveLoad(0)
	ws := []WorkerInfo{{ID: "a"}, {ID: "b"}}
	pos := map[WorkerID]int{"a": 0, "b": 1}
	hash := func(i int) uint64 { return uint64(i)<<16 | 5 }
	for i := range 300 {
		a.Add(Booking{ID: fmt.Sprint("r", i), Worker: "a", Hashes: []uint64{hash(i)}, Added: t0})
	}
	for i := range 255 {
		a.Free(fmt.Sprint("r", i))
	}
	var cache LoadRowsCache
	for _, c := range []struct {
		i       int
		newOnA  int
		comment string
	}{{260, 0, "still held"}, {299, 0, "still held, last"}, {10, 1, "freed"}, {400, 1, "never held"}} {
		rows := a.RowsCached(ws, pos, []uint64{hash(c.i)}, nil, &cache)
		if rows[0].NewBlocks != c.newOnA || rows[1].NewBlocks != 1 {
			t.Errorf("block %d (%s): new blocks a=%d b=%d, want a=%d b=1", c.i, c.comment, rows[0].NewBlocks, rows[1].NewBlocks, c.newOnA)
		}
	}
	// Below saturation the counter is exact: one key, freed, reads empty.
	b := NewActiveLoad(0)
	b.Add(Booking{ID: "x", Worker: "a", Hashes: []uint64{7}, Added: t0})
	b.Free("x")
	if b.mayHold(7) {
		t.Error("a freed block's counter is not back to 0")
	}
}

// TestActiveLoadReusesHolderLists: booking a request whose blocks no other
// request holds reuses the holder lists freed requests left (the proxy
// books ~150 new keys per 2,400-token prompt), and reused lists start
// empty: a block freed on one worker and booked on another has only the
// new holder.
func TestActiveLoadReusesHolderLists(t *testing.T) {
	a := NewActiveLoad(0)
	hashes := make([]uint64, 150)
	for i := range hashes {
		hashes[i] = uint64(i)*0x9e3779b97f4a7c15 + 1
	}
	a.Add(Booking{ID: "warm", Worker: "w1", Hashes: hashes, Added: t0})
	a.Free("warm")
	allocs := testing.AllocsPerRun(20, func() {
		a.Add(Booking{ID: "r", Worker: "w2", Hashes: hashes, Added: t0})
		a.Free("r")
	})
	if allocs > 20 { // the request's own few; one per block without reuse
		t.Errorf("Add+Free of a 150-block request: %.0f allocations", allocs)
	}
	a.Add(Booking{ID: "r", Worker: "w2", Hashes: hashes, Added: t0})
	if n := a.NewBlocks("w1", hashes); n != len(hashes) {
		t.Errorf("w1 holds %d of the blocks after its request was freed", len(hashes)-n)
	}
	if n := a.NewBlocks("w2", hashes); n != 0 {
		t.Errorf("w2 misses %d of its booked blocks", n)
	}
}
