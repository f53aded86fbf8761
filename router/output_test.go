package router

import (
	"testing"
	"time"
)

// Output-block tracking (Dynamo's --router-track-output-blocks). The
// expected values are worked by hand from Dynamo's rule
// (lib/llm/src/kv_router/push_router.rs RequestGuard::on_item and
// lib/kv-router/src/sequences: one placeholder block each time
// ceil((isl + osl)/bs) grows past ceil(isl/bs); every block the request
// holds alone then counts max(0, 1 − osl/expected); active blocks are the
// rounded sum).

func TestOutputBlocksBoundaries(t *testing.T) {
	cases := []struct {
		prompt, generated, bs, want int
	}{
		{40, 0, 16, 0},
		{40, 8, 16, 0},  // the partial last prompt block (8 tokens) fills first
		{40, 9, 16, 1},  // 49 tokens: a 4th block begins
		{40, 24, 16, 1}, // 64 tokens: still 4 blocks
		{40, 25, 16, 2},
		{32, 1, 16, 1}, // a prompt of full blocks: the first token opens a block
		{0, 16, 16, 1},
		{0, 17, 16, 2},
		{40, 100, 0, 0}, // no block size: nothing
		{-5, 3, 4, 1},   // a negative prompt counts as none
	}
	for _, c := range cases {
		if got := OutputBlocks(c.prompt, c.generated, c.bs); got != c.want {
			t.Errorf("OutputBlocks(%d, %d, %d) = %d, want %d", c.prompt, c.generated, c.bs, got, c.want)
		}
	}
}

func TestOutputProgressDecay(t *testing.T) {
	cases := []struct {
		o    OutputProgress
		want float64
	}{
		{OutputProgress{Blocks: 1, Generated: 9, Expected: 64}, 0.140625},
		{OutputProgress{Blocks: 3, Generated: 41, Expected: 64}, 0.640625},
		{OutputProgress{Blocks: 5, Generated: 73, Expected: 64}, 1}, // past the expectation: max(0, 1 − 73/64) = 0 left
		{OutputProgress{Blocks: 2, Generated: 25}, 0},               // no expectation (Dynamo's None): no decay
		{OutputProgress{Blocks: 2, Generated: 25, Expected: -3}, 0},
	}
	for _, c := range cases {
		if got := c.o.Decay(); got != c.want {
			t.Errorf("%+v.Decay() = %v, want %v", c.o, got, c.want)
		}
	}
}

// One request of 40 prompt tokens (2 full blocks) on block size 16: the
// worker's active blocks as the output grows, with and without an expected
// output of 64 tokens.
func TestActiveLoadOutputBlocks(t *testing.T) {
	type step struct {
		generated int
		newBlock  bool // Generated reports a new block (one sync message)
		blocks    int  // the worker's ActiveBlocks after it
	}
	cases := []struct {
		name     string
		expected int
		steps    []step
	}{
		{"no expected output: whole blocks", 0, []step{
			{8, false, 2}, {9, true, 3}, {24, false, 3}, {25, true, 4}, {41, true, 5}, {40, false, 5}, {73, true, 7},
		}},
		{"expected 64: decay", 64, []step{
			{8, false, 2},
			{9, true, 3},   // 3 blocks × (1 − 9/64) = 2.578 → 3
			{24, false, 3}, // no new block: the decay is not refreshed either
			{25, true, 2},  // 4 × (1 − 25/64) = 2.4375 → 2
			{41, true, 2},  // 5 × (1 − 41/64) = 1.797 → 2
			{57, true, 1},  // 6 × (1 − 57/64) = 0.656 → 1
			{73, true, 0},  // past the expectation: nothing counts
			{89, true, 0},
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			a := NewActiveLoad(0)
			a.Add(Booking{ID: "r", Worker: "w", Hashes: []uint64{1, 2}, PromptTokens: 40, ExpectedOutput: c.expected, Added: t0})
			for _, s := range c.steps {
				_, grew := a.Generated("r", s.generated, 16)
				if got := a.Load("w").ActiveBlocks; grew != s.newBlock || got != s.blocks {
					t.Errorf("at %d tokens: new block %v, active blocks %d; want %v, %d", s.generated, grew, got, s.newBlock, s.blocks)
				}
			}
			a.Free("r")
			if l := a.Load("w"); l != (WorkerLoad{}) {
				t.Errorf("after free: %+v", l)
			}
		})
	}
}

// One sync message per new block: streaming 80 tokens one at a time
// reports exactly the 5 blocks they start.
func TestActiveLoadOutputOneReportPerBlock(t *testing.T) {
	a := NewActiveLoad(0)
	a.Add(Booking{ID: "r", Worker: "w", Hashes: []uint64{1, 2}, PromptTokens: 40, Added: t0})
	reports := 0
	for tok := 1; tok <= 80; tok++ {
		if o, ok := a.Generated("r", tok, 16); ok {
			reports++
			if o.Blocks != reports || o.Generated != tok {
				t.Fatalf("report %d at token %d: %+v", reports, tok, o)
			}
		}
	}
	if reports != 5 {
		t.Fatalf("%d reports for 80 tokens, want 5", reports)
	}
}

// Shared prompt blocks count whole: the decay only takes off blocks the
// request holds alone, and it stays on a block that becomes shared later
// (as Dynamo's fraction does).
func TestActiveLoadOutputSharedBlocks(t *testing.T) {
	a := NewActiveLoad(0)
	a.Add(Booking{ID: "r1", Worker: "w", Hashes: []uint64{1, 2}, PromptTokens: 40, ExpectedOutput: 64, Added: t0})
	a.Add(Booking{ID: "r2", Worker: "w", Hashes: []uint64{1, 3}, PromptTokens: 32, Added: t0})
	steps := []struct {
		name   string
		do     func()
		blocks int
	}{
		{"prompts: blocks 1, 2, 3", func() {}, 3},
		// r1 alone holds block 2 and its output block: 3 + 1 − 2 × 9/64 = 3.71875 → 4.
		{"r1 at 9 tokens", func() { a.Generated("r1", 9, 16) }, 4},
		// 3 + 3 − 4 × 41/64 = 3.4375 → 3 (block 1 is shared: whole).
		{"r1 at 41 tokens", func() { a.Generated("r1", 41, 16) }, 3},
		// r3 shares block 2, decayed while r1 held it alone: it keeps its
		// decay. Blocks 1, 2, 3, 4 and r1's 3 output blocks: 7 − 2.5625 → 4.
		{"r3 shares block 2", func() {
			a.Add(Booking{ID: "r3", Worker: "w", Hashes: []uint64{2, 4}, PromptTokens: 32, Added: t0})
		}, 4},
		// r1's output leaves; block 2, now r3's, keeps r1's last decay:
		// blocks 1, 2, 3, 4 − 41/64 = 3.36 → 3.
		{"r1 freed", func() { a.Free("r1") }, 3},
		{"r3 freed", func() { a.Free("r3") }, 2},
	}
	for _, s := range steps {
		s.do()
		if got := a.Load("w").ActiveBlocks; got != s.blocks {
			t.Errorf("%s: active blocks %d, want %d", s.name, got, s.blocks)
		}
	}
	// Block 2 left with r3; nothing decayed remains, so the count is exact.
	a.mu.Lock()
	wl := *a.workers["w"]
	a.mu.Unlock()
	if wl.nDecayed != 0 || wl.decayed != 0 || wl.outBlocks != 0 {
		t.Errorf("leftover output state %+v", wl)
	}
}

// n sequences each grow their own output; announced progress from a peer
// only grows, and re-adding a booking (a peer's snapshot) keeps it.
func TestActiveLoadOutputSequencesAndRemote(t *testing.T) {
	a := NewActiveLoad(time.Minute)
	a.Add(Booking{ID: "n2", Worker: "w", Hashes: []uint64{1, 2}, PromptTokens: 40, Sequences: 2, Added: t0})
	if o, ok := a.Generated("n2", 18, 16); !ok || o.Blocks != 2 || o.Generated != 9 {
		t.Fatalf("two sequences at 9 tokens each: %+v %v", o, ok)
	}
	if got := a.Load("w").ActiveBlocks; got != 4 {
		t.Fatalf("active blocks %d, want 2 prompt + 2 output", got)
	}

	a.Add(Booking{ID: "p/x", Origin: "p", Worker: "v", Hashes: []uint64{7}, Added: t0})
	for _, c := range []struct {
		o      OutputProgress
		ok     bool
		blocks int
	}{
		{OutputProgress{Blocks: 2, Generated: 20, Expected: 40}, true, 2}, // 3 − 3 × 0.5 = 1.5 → 2
		{OutputProgress{Blocks: 1, Generated: 9, Expected: 40}, false, 2}, // stale: ignored
		{OutputProgress{Blocks: 2, Generated: 30, Expected: 40}, false, 2},
		{OutputProgress{Blocks: 3, Generated: 40, Expected: 40}, true, 0},
	} {
		if ok := a.SetOutput("p/x", c.o); ok != c.ok || a.Load("v").ActiveBlocks != c.blocks {
			t.Errorf("SetOutput(%+v) = %v, blocks %d; want %v, %d", c.o, ok, a.Load("v").ActiveBlocks, c.ok, c.blocks)
		}
	}
	if a.SetOutput("unknown", OutputProgress{Blocks: 1}) {
		t.Error("progress for an unknown request applied")
	}
	// A snapshot re-adds the peer's bookings with their progress.
	bs := a.Bookings("p")
	if len(bs) != 1 || bs[0].Output.Blocks != 3 {
		t.Fatalf("bookings %+v", bs)
	}
	a.DropOrigin("p")
	a.Add(Booking{ID: "p/x", Origin: "p", Worker: "v", Hashes: []uint64{7}, Output: OutputProgress{Blocks: 1, Generated: 9}, Added: t0})
	if got := a.Load("v").ActiveBlocks; got != 2 {
		t.Errorf("re-added with 1 output block: %d, want 2", got)
	}
	// Expiry releases output blocks like a free.
	a.Expire(t0.Add(2 * time.Minute))
	if a.Load("v") != (WorkerLoad{}) || a.Load("w") != (WorkerLoad{}) {
		t.Errorf("after expiry: %+v %+v", a.Load("v"), a.Load("w"))
	}
}

// Through the Router: off by default (Generated does nothing); on, the
// cost table's active blocks grow with the output and a finish releases
// them.
func TestRouterTrackOutputBlocks(t *testing.T) {
	for _, track := range []bool{false, true} {
		cfg := DefaultConfig()
		cfg.TrackOutputBlocks = track
		r, err := New(cfg, nil, 1)
		if err != nil {
			t.Fatal(err)
		}
		r.SetWorkers([]WorkerInfo{{ID: "w"}})
		if _, err := r.Route(Request{ID: "a", Hashes: []uint64{1, 2}, Tokens: 40, ExpectedOutputTokens: 1000}, t0); err != nil {
			t.Fatal(err)
		}
		r.PrefillDone("a")
		// 60 tokens after a 40-token prompt: ceil(100/16) − ceil(40/16) = 4
		// output blocks; 2 prompt + 4 output blocks, all the request's
		// own, count 1 − 60/1000 each: 6 × 0.94 = 5.64 → 6.
		o, grew := r.Generated("a", 60)
		want := 2
		if track {
			want = 6
			if o != (OutputProgress{Blocks: 4, Generated: 60, Expected: 1000}) {
				t.Errorf("progress %+v", o)
			}
		}
		d, err := r.Decide(Request{ID: "b", Hashes: []uint64{9}, Tokens: 16}, t0)
		if err != nil {
			t.Fatal(err)
		}
		if got := d.Rows[0].ActiveBlocks; got != want || grew != track {
			t.Errorf("track=%v: active blocks %d (new block %v), want %d", track, got, grew, want)
		}
		r.Finished("a", 60)
		if l := r.Load().Load("w"); l != (WorkerLoad{}) {
			t.Errorf("track=%v: after finish %+v", track, l)
		}
	}
}
