package router

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"
)

// refIndex is the index's meaning written plainly (a set of holders per
// block, engine names per worker), to check the packed index against for
// fleets on both sides of 64 workers.
type refIndex struct {
	holders map[uint64]map[WorkerID]bool
	engine  map[WorkerID]map[uint64]uint64 // engine hash → content hash, aliased names only
}

func newRefIndex() *refIndex {
	return &refIndex{holders: map[uint64]map[WorkerID]bool{}, engine: map[WorkerID]map[uint64]uint64{}}
}

func (r *refIndex) add(w WorkerID) {
	if r.engine[w] == nil {
		r.engine[w] = map[uint64]uint64{}
	}
}

func (r *refIndex) drop(w WorkerID, ch uint64) {
	delete(r.holders[ch], w)
	if len(r.holders[ch]) == 0 {
		delete(r.holders, ch)
	}
}

func (r *refIndex) remove(w WorkerID) {
	for ch := range r.holders {
		r.drop(w, ch)
	}
	delete(r.engine, w)
}

func (r *refIndex) store(w WorkerID, blocks []StoredBlock) {
	for _, b := range blocks {
		if b.EngineHash != b.ContentHash {
			r.engine[w][b.EngineHash] = b.ContentHash // names never reused for other content here
		}
		if r.holders[b.ContentHash] == nil {
			r.holders[b.ContentHash] = map[WorkerID]bool{}
		}
		r.holders[b.ContentHash][w] = true
	}
}

func (r *refIndex) removed(w WorkerID, engine []uint64) {
	for _, eh := range engine {
		ch, ok := r.engine[w][eh]
		if ok {
			delete(r.engine[w], eh)
		} else {
			ch = eh
		}
		r.drop(w, ch)
	}
}

func (r *refIndex) blocksOf(w WorkerID) []StoredBlock {
	var out []StoredBlock
	aliased := map[uint64]bool{}
	for eh, ch := range r.engine[w] {
		out = append(out, StoredBlock{EngineHash: eh, ContentHash: ch})
		aliased[ch] = true
	}
	for ch, hs := range r.holders {
		if hs[w] && !aliased[ch] {
			out = append(out, StoredBlock{EngineHash: ch, ContentHash: ch})
		}
	}
	slices.SortFunc(out, compareStored)
	return out
}

func (r *refIndex) overlaps(seq []uint64) map[WorkerID]int {
	out := map[WorkerID]int{}
	for w := range r.engine {
		n := 0
		for n < len(seq) && r.holders[seq[n]][w] {
			n++
		}
		if n > 0 {
			out[w] = n
		}
	}
	return out
}

// aliasedChain is chain with engine names that never equal a content hash
// of these tests (a removal by a name the worker does not alias falls back
// to the content hash: a collision would leave an alias behind).
func aliasedChain(hashes ...uint64) []StoredBlock {
	out := make([]StoredBlock, len(hashes))
	for i, h := range hashes {
		out[i] = StoredBlock{EngineHash: h ^ 1<<40, ContentHash: h}
	}
	return out
}

// check compares every read of ix with r over the prompts.
func (r *refIndex) check(t *testing.T, ix *Index, prompts [][]uint64) {
	t.Helper()
	workers := slices.Sorted(maps.Keys(r.engine))
	if got := ix.Workers(); !slices.Equal(got, workers) {
		t.Fatalf("workers %v, want %v", got, workers)
	}
	if ix.Len() != len(r.holders) {
		t.Fatalf("len %d, want %d", ix.Len(), len(r.holders))
	}
	all := ix.AllWorkerBlocks()
	for _, w := range workers {
		want := r.blocksOf(w)
		if got := ix.WorkerBlocks(w); !slices.Equal(got, want) {
			t.Fatalf("%s holds %v, want %v", w, got, want)
		}
		if !slices.Equal(all[w], want) {
			t.Fatalf("%s in AllWorkerBlocks %v, want %v", w, all[w], want)
		}
		unique := 0
		for _, b := range want {
			if len(r.holders[b.ContentHash]) == 1 {
				unique++
			}
		}
		if held, u := ix.CacheCounts(w); held != len(want) || u != unique {
			t.Fatalf("%s held %d unique %d, want %d %d", w, held, u, len(want), unique)
		}
	}
	for _, seq := range prompts {
		for _, ch := range seq {
			if got := ix.Holders(ch); got != len(r.holders[ch]) {
				t.Fatalf("block %d: %d holders, want %d", ch, got, len(r.holders[ch]))
			}
		}
		got := ix.FindMatches(seq, nil)
		for i := 1; i < len(got); i++ {
			if got[i].Blocks < got[i-1].Blocks {
				t.Fatalf("prompt %v: overlaps out of order: %v", seq[:2], got)
			}
		}
		m := map[WorkerID]int{}
		for _, o := range got {
			m[o.Worker] = o.Blocks
		}
		if want := r.overlaps(seq); !maps.Equal(m, want) {
			t.Fatalf("prompt %v: overlaps %v, want %v", seq[:2], m, want)
		}
	}
}

// TestIndexAcrossFleetSizes: fleets on both sides of one word of worker
// bits hold a prefix every worker shares (a popular system prompt: held
// past the inline wide sets) and a tail of their own; lookups, counts and
// block lists agree with the plain model after every phase, workers removed
// from the middle and the ends, added back (taking freed slots) and added
// past the old end.
func TestIndexAcrossFleetSizes(t *testing.T) {
	for _, fleet := range []int{1, 63, 64, 65, 130, 1024} {
		t.Run(fmt.Sprintf("workers=%d", fleet), func(t *testing.T) {
			ix, ref := NewIndex(16), newRefIndex()
			name := func(i int) WorkerID { return WorkerID(fmt.Sprintf("w%04d", i)) }
			shared := []uint64{1, 2, 3, 4}
			own := func(i int) []uint64 { return []uint64{uint64(10_000 + 2*i), uint64(10_001 + 2*i)} }
			store := func(i int) {
				blocks := aliasedChain(append(slices.Clone(shared), own(i)...)...)
				if i%2 == 1 { // half the fleet names blocks by our hash (kvmock)
					for j := range blocks {
						blocks[j].EngineHash = blocks[j].ContentHash
					}
				}
				if err := ix.Apply(name(i), KVEvent{Kind: EventStored, Blocks: blocks}); err != nil {
					t.Fatal(err)
				}
				ref.store(name(i), blocks)
			}
			add := func(i int) {
				ix.AddWorker(name(i))
				ref.add(name(i))
				store(i)
			}
			remove := func(i int) {
				ix.RemoveWorker(name(i))
				ref.remove(name(i))
			}
			prompts := func() [][]uint64 {
				out := [][]uint64{shared}
				for _, i := range []int{0, fleet / 2, fleet - 1, fleet, fleet + 5} {
					out = append(out, append(slices.Clone(shared), own(i)...))
				}
				return out
			}
			for i := range fleet {
				add(i)
			}
			ref.check(t, ix, prompts())
			for _, i := range []int{0, fleet / 2, fleet - 1} {
				if ref.engine[name(i)] != nil {
					remove(i)
				}
			}
			ref.check(t, ix, prompts())
			for _, i := range []int{fleet - 1, fleet / 2, 0, fleet, fleet + 5} {
				if ref.engine[name(i)] == nil {
					add(i)
				}
			}
			ref.check(t, ix, prompts())
			// Clear one worker, remove another's shared prefix (the block
			// leaves the arena set), then everyone but one.
			if err := ix.Apply(name(fleet-1), KVEvent{Kind: EventCleared}); err != nil {
				t.Fatal(err)
			}
			ref.remove(name(fleet - 1))
			ref.add(name(fleet - 1))
			ev := KVEvent{Kind: EventRemoved, Removed: []uint64{shared[0] ^ 1<<40}}
			if err := ix.Apply(name(0), ev); err != nil {
				t.Fatal(err)
			}
			ref.removed(name(0), ev.Removed)
			ref.check(t, ix, prompts())
			for _, w := range ix.Workers()[1:] {
				ix.RemoveWorker(w)
				ref.remove(w)
			}
			ref.check(t, ix, prompts())
		})
	}
}

// TestIndexRandomOps: random stores, removals, clears, workers added and
// removed in any order, on fleets across the 64 boundary; after every
// batch of operations the index reads as the plain model does.
func TestIndexRandomOps(t *testing.T) {
	for _, fleet := range []int{63, 64, 65, 200, 1024} {
		t.Run(fmt.Sprintf("workers=%d", fleet), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(fleet), 19))
			ix, ref := NewIndex(16), newRefIndex()
			// Prompts share roots so some blocks have many holders.
			prompts := make([][]uint64, 40)
			for p := range prompts {
				root := uint64(p%4) * 100
				prompts[p] = []uint64{root + 1, root + 2, uint64(1000 + 10*p), uint64(1001 + 10*p), uint64(1002 + 10*p)}
			}
			name := func(i int) WorkerID { return WorkerID(fmt.Sprintf("w%04d", i)) }
			blocksOf := func(i int, hs []uint64) []StoredBlock {
				out := aliasedChain(hs...)
				if i%3 == 0 {
					for j := range out {
						out[j].EngineHash = out[j].ContentHash
					}
				}
				return out
			}
			for i := range fleet {
				ix.AddWorker(name(i))
				ref.add(name(i))
			}
			ops := 30 * fleet
			for op := range ops {
				i := rng.IntN(fleet + fleet/8) // some ids never added or since removed
				w := name(i)
				known := ref.engine[w] != nil
				switch r := rng.IntN(100); {
				case r < 2:
					ix.RemoveWorker(w)
					if known {
						ref.remove(w)
					}
				case r < 5:
					ix.AddWorker(w)
					ref.add(w)
				case r < 6:
					err := ix.Apply(w, KVEvent{Kind: EventCleared})
					if known != (err == nil) {
						t.Fatalf("clear of %s (known %v): %v", w, known, err)
					}
					if known {
						ref.remove(w)
						ref.add(w)
					}
				case r < 70:
					p := prompts[rng.IntN(len(prompts))]
					blocks := blocksOf(i, p[:1+rng.IntN(len(p))])
					err := ix.Apply(w, KVEvent{Kind: EventStored, Blocks: blocks})
					if known != (err == nil) {
						t.Fatalf("store on %s (known %v): %v", w, known, err)
					}
					if known {
						ref.store(w, blocks)
					}
				default:
					p := prompts[rng.IntN(len(prompts))]
					var removed []uint64
					for _, b := range blocksOf(i, p[rng.IntN(len(p)):]) {
						removed = append(removed, b.EngineHash)
					}
					err := ix.Apply(w, KVEvent{Kind: EventRemoved, Removed: removed})
					if known != (err == nil) {
						t.Fatalf("removal on %s (known %v): %v", w, known, err)
					}
					if known {
						ref.removed(w, removed)
					}
				}
				if (op+1)%(ops/10) == 0 {
					ref.check(t, ix, prompts)
				}
			}
		})
	}
}

// TestWideSetForms: a wide set is inline up to three slots below 2^21 and
// in the arena otherwise, and goes back inline (freeing its arena entry)
// when it shrinks to inline-able slots.
func TestWideSetForms(t *testing.T) {
	tests := []struct {
		name      string
		add, drop []int
		arena     bool
	}{
		{"one", []int{64}, nil, false},
		{"three unsorted", []int{900, 64, 300}, nil, false},
		{"four", []int{64, 65, 66, 1023}, nil, true},
		{"four then one dropped", []int{64, 65, 66, 1023}, []int{65}, false},
		{"past the inline range", []int{1 << 21}, nil, true},
		{"past the inline range, dropped", []int{70, 1 << 21}, []int{1 << 21}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ix := NewIndex(16)
			var v wideSet
			for i, s := range tt.add {
				v = ix.wideAddLocked(v, i > 0, s)
			}
			want := map[int]bool{}
			for _, s := range tt.add {
				want[s] = true
			}
			for _, s := range tt.drop {
				var left bool
				v, left = ix.wideRemoveLocked(v, s)
				delete(want, s)
				if left != (len(want) > 0) {
					t.Fatalf("left %v with %d slots", left, len(want))
				}
			}
			if got := v&wideArena != 0; got != tt.arena {
				t.Errorf("arena %v, want %v", got, tt.arena)
			}
			var got []int
			ix.wideEachLocked(v, func(s int) { got = append(got, s) })
			if wantSlots := slices.Sorted(maps.Keys(want)); !slices.Equal(got, wantSlots) {
				t.Errorf("slots %v, want %v", got, wantSlots)
			}
			if n, lowest := ix.wideCountLocked(v); n != len(want) || lowest != slices.Min(got) {
				t.Errorf("count %d lowest %d", n, lowest)
			}
			for _, s := range got {
				if !ix.wideHasLocked(v, s) || ix.wideWordLocked(v, wideWordOf(s))&(1<<uint(s%64)) == 0 {
					t.Errorf("slot %d not found", s)
				}
			}
			if !tt.arena && len(ix.sets) != len(ix.freeSets) {
				t.Errorf("%d arena entries, %d free", len(ix.sets), len(ix.freeSets))
			}
		})
	}
}
