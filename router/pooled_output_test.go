package router

import (
	"math"
	"testing"
)

// kv-pooled's decode reserve with output-block tracking on: the load
// already holds the output generated so far, so the reserve covers only
// the expected output not yet booked, per request, and the pinned blocks
// count whole (no decay). Block size 16, an expected output of 64 tokens:
// the reserve is (64 + 7.5)/16 = 4.46875 blocks per sequence.
//
// Worker a:
//
//	bg1  40 prompt blocks (640 tokens), 50 generated: ceil(690/16) − 40 = 4 output blocks, covers min(4, 4.46875) = 4
//	bg2  30 prompt blocks (480 tokens), 130 generated: ceil(610/16) − 30 = 9, covers 4.46875; expected 130, so
//	     its 39 blocks decay to nothing in ActiveBlocks (93 − 39 = 54)
//	bg3  10 prompt blocks, no output yet: covers 0
//
// pinned 80 + 13 = 93, covered 8.46875, so the reserve still to come is
// 3 × 4.46875 − 8.46875 = 4.9375.
//
// Worker b: bg4, 20 prompt blocks (320 tokens), n = 2, 80 tokens together
// (40 each): 2 × (ceil(360/16) − 20) = 6 output blocks, covers
// min(6, 2 × 4.46875) = 6; pinned 26.
func pooledTrackedRouter(t *testing.T, capacity int) (*Router, []uint64) {
	t.Helper()
	cfg := pooledConfig()
	cfg.TrackOutputBlocks = true
	out := 64.0
	cfg.Pooled.OutputTokens = &out
	r := newTestRouter(t, cfg, NewIndex(16), WorkerInfo{ID: "a", TotalBlocks: capacity}, WorkerInfo{ID: "b", TotalBlocks: capacity})
	book := func(id string, w WorkerID, tag, blocks, seqs, expected, generated int) {
		h := SequenceHashes(tokens(tag, 16*blocks), 16, "")
		r.Load().Add(Booking{ID: id, Worker: w, Hashes: h, Sequences: seqs, Added: t0, PromptTokens: 16 * blocks, ExpectedOutput: expected})
		if generated > 0 {
			if _, ok := r.Generated(id, generated); !ok {
				t.Fatalf("%s: no output block booked at %d tokens", id, generated)
			}
		}
	}
	book("bg1", "a", 100_000, 40, 1, 0, 50)
	book("bg2", "a", 200_000, 30, 1, 130, 130)
	book("bg3", "a", 300_000, 10, 1, 0, 0)
	book("bg4", "b", 400_000, 20, 2, 0, 80)
	return r, SequenceHashes(tokens(7, 16*12), 16, "")
}

func TestPooledTrackedOutputs(t *testing.T) {
	r, _ := pooledTrackedRouter(t, 115)
	if got := r.Load().Load("a"); got.ActiveBlocks != 54 || got.Requests != 3 {
		t.Fatalf("a's load %+v, want 54 active blocks (bg2 decayed away) and 3 requests", got)
	}
	r.mu.Lock()
	reserve := r.pooledReserveLocked()
	got, ok := r.load.trackedOutputs(r.workers, []int{0, 1}, reserve, nil)
	r.mu.Unlock()
	if reserve != 4.46875 {
		t.Fatalf("reserve %v blocks, want 4.46875", reserve)
	}
	want := []trackedOutput{{pinned: 93, covered: 8.46875}, {pinned: 26, covered: 6}}
	if !ok || len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("tracked outputs %+v (%v), want %+v", got, ok, want)
	}

	// Without any output booked (tracking off everywhere) the reserve is
	// the old one: nothing is reported.
	cfg := pooledConfig()
	plain := newTestRouter(t, cfg, NewIndex(16), WorkerInfo{ID: "a", TotalBlocks: 115})
	plain.Load().Add(Booking{ID: "x", Worker: "a", Hashes: SequenceHashes(tokens(1, 160), 16, ""), PromptTokens: 160, Added: t0})
	if _, ok := plain.Generated("x", 100); ok {
		t.Fatal("Generated booked a block with tracking off")
	}
	plain.mu.Lock()
	_, ok = plain.load.trackedOutputs(plain.workers, []int{0}, 1, nil)
	plain.mu.Unlock()
	if ok {
		t.Error("tracked outputs reported with nothing tracked")
	}

	// Every output freed: nothing tracked any more.
	for _, id := range []string{"bg1", "bg2", "bg3", "bg4"} {
		r.Free(id)
	}
	r.mu.Lock()
	_, ok = r.load.trackedOutputs(r.workers, []int{0, 1}, reserve, nil)
	r.mu.Unlock()
	if ok || r.load.tracked != 0 {
		t.Errorf("after the frees: reported %v, %d tracked", ok, r.load.tracked)
	}
}

// A 12-block request for new content: on a, admission needs
// 93 pinned + 12 new + 4.9375 still to come + 4.46875 for itself
// = 114.40625 blocks. It fits a capacity of 115 (0.59375 to spare) and not
// one of 114. Counting the tracked output twice (the whole reserve on top
// of the 13 booked output blocks: 93 + 12 + 4 × 4.46875 = 122.875) would
// exclude a at 115 too; the rule before tracking, on the decayed active
// blocks (54 + 12 + 4 × 4.46875 = 83.875), would admit it at 84, where it
// waits for 30 blocks.
func TestPooledTrackedAdmission(t *testing.T) {
	for _, c := range []struct {
		capacity int
		busy     bool
	}{{115, false}, {114, true}} {
		r, hashes := pooledTrackedRouter(t, c.capacity)
		d, err := r.Decide(Request{ID: "q", Tokens: 16 * 12, Hashes: hashes}, t0)
		if err != nil {
			t.Fatal(err)
		}
		if d.Rows[0].Worker != "a" || d.Rows[0].Busy != c.busy {
			t.Errorf("capacity %d: a busy %v (%s), want %v\n%s", c.capacity, d.Rows[0].Busy, d.Rows[0].Reason(), c.busy, d.Explain())
		}
		r.mu.Lock()
		over := r.pooled.over[0]
		r.mu.Unlock()
		if want := 114.40625 - float64(c.capacity); math.Abs(over-want) > 1e-12 {
			t.Errorf("capacity %d: a's admission overflow %v blocks, want %v", c.capacity, over, want)
		}
	}
}
