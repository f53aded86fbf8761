package router

import (
	"fmt"
	"slices"
	"testing"
)

// TestIndexBlocksCopyResolves: after random stores (engine names that
// differ from content hashes, several names for one content, content
// shared across workers), removals and clears, over more than 64 workers
// (the wide path), the copy taken under the lock resolves to exactly
// WorkerBlocks' lists, and its dangling flags mark exactly the aliases
// whose content the worker does not hold.
func TestIndexBlocksCopyResolves(t *testing.T) {
	for seed := range uint64(5) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := newRand(seed)
			ix := NewIndex(16)
			const workers = 70
			for i := range workers {
				ix.AddWorker(WorkerKey("w", uint32(i)))
			}
			for range 3000 {
				w := WorkerKey("w", uint32(rng.IntN(workers)))
				switch r := rng.IntN(10); {
				case r < 6:
					ev := KVEvent{Kind: EventStored}
					for range 1 + rng.IntN(4) {
						ch := uint64(rng.IntN(400))
						eh := ch
						if rng.IntN(2) == 0 {
							eh = 1000 + uint64(rng.IntN(800)) // an engine name of its own
						}
						ev.Blocks = append(ev.Blocks, StoredBlock{EngineHash: eh, ContentHash: ch})
					}
					_ = ix.Apply(w, ev)
				case r < 9:
					held := ix.WorkerBlocks(w)
					if len(held) == 0 {
						continue
					}
					b := held[rng.IntN(len(held))]
					_ = ix.Apply(w, KVEvent{Kind: EventRemoved, Removed: []uint64{b.EngineHash}})
				default:
					if rng.IntN(20) == 0 {
						_ = ix.Apply(w, KVEvent{Kind: EventCleared})
					}
				}
			}
			res := ix.CopyWorkerBlocks().Resolve()
			if len(res) != workers {
				t.Fatalf("%d workers resolved, want %d", len(res), workers)
			}
			var dst []Overlap
			aliases, plain, danglings := 0, 0, 0
			for _, w := range ix.Workers() {
				r := res[w]
				if want := ix.WorkerBlocks(w); !slices.Equal(r.Blocks, want) {
					t.Fatalf("%s: resolved %v, WorkerBlocks %v", w, r.Blocks, want)
				}
				for i, b := range r.Blocks {
					dst = ix.FindMatches([]uint64{b.ContentHash}, dst)
					holds := slices.ContainsFunc(dst, func(o Overlap) bool { return o.Worker == w })
					dangling := r.Dangling != nil && r.Dangling[i]
					if dangling {
						danglings++
					}
					if b.EngineHash == b.ContentHash {
						plain++
					} else {
						aliases++
					}
					if dangling != !holds {
						t.Fatalf("%s block %v: dangling %v, but the worker holds its content: %v", w, b, dangling, holds)
					}
				}
				if r.Dangling != nil && len(r.Dangling) != len(r.Blocks) {
					t.Fatalf("%s: %d flags for %d blocks", w, len(r.Dangling), len(r.Blocks))
				}
			}
			if aliases == 0 || plain == 0 || danglings == 0 {
				t.Fatalf("the random history left %d aliased, %d plain and %d dangling blocks: it tests too little", aliases, plain, danglings)
			}
		})
	}
}
