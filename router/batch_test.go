package router

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// applyStoredMore adds BenchmarkApplyStored's sub-benchmarks of
// ApplyBatch (kept here, apart from bench_test.go, so that file builds
// against commits before ApplyBatch for side-by-side runs).
func applyStoredMore(b *testing.B) {
	// The same events, 8 workers' removal and store at a time, through
	// ApplyBatch (what fsm does with a Raft entry's events).
	b.Run("batch=8/blocks=1M/workers=64", func(b *testing.B) { benchApplyStoredBatch(b, 64, 8, 4096) })
	b.Run("batch=8/fresh/blocks=1M/workers=64", func(b *testing.B) { benchApplyStoredBatch(b, 64, 8, 4099) })
}

// batchGen draws random events over a small hash space, so that a batch
// stores blocks other workers hold, stores a block twice, removes blocks
// stored earlier in the same batch (and blocks never stored), reuses an
// engine name for other content, names parents held and not, mismatches
// block sizes, clears workers, goes over caps and reaches lower tiers.
type batchGen struct {
	rng     *rand.Rand
	workers []WorkerID // known ones, and "ghost", unknown to the index
	stored  map[WorkerID][]uint64
}

func newBatchGen(seed uint64, known int) *batchGen {
	g := &batchGen{rng: newRand(seed), stored: map[WorkerID][]uint64{}}
	for w := range known {
		g.workers = append(g.workers, WorkerID(fmt.Sprintf("w%03d", w)))
	}
	g.workers = append(g.workers, "ghost")
	return g
}

// engineName is the engine's name for content hash h: mostly a fixed
// alias, sometimes h itself (engines that use our hashes), sometimes
// another alias (a name reused for other content, or content renamed).
func (g *batchGen) engineName(h uint64) uint64 {
	switch g.rng.IntN(8) {
	case 0:
		return h
	case 1:
		return 5000 + uint64(g.rng.IntN(64))
	}
	return h + 1000
}

func (g *batchGen) event() BatchEvent {
	// Runs of one worker, as batches carry them; now and then a jump.
	w := g.workers[g.rng.IntN(len(g.workers))]
	ev := &KVEvent{}
	switch r := g.rng.IntN(20); {
	case r < 11:
		ev.Kind = EventStored
		n := 1 + g.rng.IntN(6)
		base := uint64(g.rng.IntN(160))
		for i := range n {
			h := base + uint64(i)
			if g.rng.IntN(10) == 0 {
				h = 0 // the key 0, kept beside the table
			}
			ev.Blocks = append(ev.Blocks, StoredBlock{EngineHash: g.engineName(h), ContentHash: h})
		}
		if held := g.stored[w]; g.rng.IntN(3) > 0 {
			ev.HasParent = true
			if len(held) > 0 && g.rng.IntN(4) > 0 {
				ev.Parent = held[g.rng.IntN(len(held))]
			} else {
				ev.Parent = uint64(g.rng.IntN(6000)) // most likely not held
			}
		}
		for _, b := range ev.Blocks {
			g.stored[w] = append(g.stored[w], b.EngineHash)
		}
	case r < 18:
		ev.Kind = EventRemoved
		held := g.stored[w]
		for range 1 + g.rng.IntN(6) {
			if len(held) > 0 && g.rng.IntN(5) > 0 {
				ev.Removed = append(ev.Removed, held[g.rng.IntN(len(held))])
			} else {
				ev.Removed = append(ev.Removed, uint64(g.rng.IntN(6000)))
			}
		}
	case r < 19:
		ev.Kind = EventCleared
	default:
		ev.Kind = EventKind(4 + g.rng.IntN(3)) // invalid
	}
	switch g.rng.IntN(30) {
	case 0:
		ev.BlockSize = 32 // not the workers' 16
	case 1, 2:
		ev.Tier = Tier(1 + g.rng.IntN(4)) // host, disk, external, or one this build does not know
	case 3, 4, 5:
		ev.BlockSize = 16
	}
	maxHeld := 0
	if g.rng.IntN(4) == 0 {
		maxHeld = 4 + g.rng.IntN(40)
	}
	return BatchEvent{Worker: w, Event: ev, MaxHeld: maxHeld}
}

// compareIndexes fails unless a and b hold the same state: every worker's
// blocks and counts, every tier's, the number of blocks, the counters, and
// what a few lookups find.
func compareIndexes(t testing.TB, a, b *Index, workers []WorkerID) {
	t.Helper()
	if a.Len() != b.Len() {
		t.Fatalf("Len: batch %d, one by one %d", a.Len(), b.Len())
	}
	if sa, sb := a.Stats(), b.Stats(); sa != sb {
		t.Fatalf("Stats:\nbatch      %+v\none by one %+v", sa, sb)
	}
	for _, w := range workers {
		if ga, gb := a.WorkerBlocks(w), b.WorkerBlocks(w); !slices.Equal(ga, gb) {
			t.Fatalf("worker %s blocks:\nbatch      %v\none by one %v", w, ga, gb)
		}
		ha, ua := a.CacheCounts(w)
		hb, ub := b.CacheCounts(w)
		if ha != hb || ua != ub {
			t.Fatalf("worker %s held/unique: batch %d/%d, one by one %d/%d", w, ha, ua, hb, ub)
		}
		for tier := TierHost; tier < NumTiers; tier++ {
			if ta, tb := a.TierHeld(w, tier), b.TierHeld(w, tier); ta != tb {
				t.Fatalf("worker %s %v held: batch %d, one by one %d", w, tier, ta, tb)
			}
		}
	}
	for tier := TierHost; tier < NumTiers; tier++ {
		la, lb := a.LowerTier(tier), b.LowerTier(tier)
		if (la == nil) != (lb == nil) {
			t.Fatalf("%v tier: batch %v, one by one %v", tier, la != nil, lb != nil)
		}
		if la != nil {
			compareIndexes(t, la, lb, workers)
		}
	}
	for start := uint64(0); start < 160; start += 7 {
		q := []uint64{start, start + 1, start + 2, start + 3, 0}
		if ma, mb := overlapOf(a, q), overlapOf(b, q); fmt.Sprint(ma) != fmt.Sprint(mb) {
			t.Fatalf("FindMatches(%v): batch %v, one by one %v", q, ma, mb)
		}
	}
}

// applyBoth applies batch to a with ApplyBatch and to b event by event
// with ApplyCapped, and fails unless every event's outcome is the same.
func applyBoth(t testing.TB, a, b *Index, batch []BatchEvent) {
	t.Helper()
	errs := make([]error, len(batch))
	a.ApplyBatch(batch, errs)
	for i, e := range batch {
		want := b.ApplyCapped(e.Worker, *e.Event, e.MaxHeld)
		if fmt.Sprint(errs[i]) != fmt.Sprint(want) || fmt.Sprintf("%T", errs[i]) != fmt.Sprintf("%T", want) {
			t.Fatalf("event %d (%s %+v): batch %v (%T), one by one %v (%T)", i, e.Worker, *e.Event, errs[i], errs[i], want, want)
		}
	}
}

func newBatchIndexes(workers []WorkerID) (a, b *Index) {
	a, b = NewIndex(16), NewIndex(16)
	for _, w := range workers {
		if w != "ghost" {
			a.AddWorker(w)
			b.AddWorker(w)
		}
	}
	return a, b
}

// TestIndexApplyBatchMatchesOneByOne: random batches applied whole give
// the index, counters and per-event errors that the same events applied
// one by one give, in a fleet of one word and in one past 64 workers (the
// wide sets), with a worker removed and re-added between batches.
func TestIndexApplyBatchMatchesOneByOne(t *testing.T) {
	for _, known := range []int{5, 70} {
		t.Run(fmt.Sprintf("workers=%d", known), func(t *testing.T) {
			for seed := range uint64(12) {
				g := newBatchGen(seed, known)
				if known > 64 {
					// Most events from the wide slots and the first ones.
					g.workers = append(g.workers[:3], g.workers[60:]...)
				}
				a, b := newBatchIndexes(g.workers)
				for round := range 40 {
					batch := make([]BatchEvent, g.rng.IntN(80))
					for i := range batch {
						batch[i] = g.event()
					}
					applyBoth(t, a, b, batch)
					compareIndexes(t, a, b, g.workers)
					if round%10 == 9 {
						w := g.workers[g.rng.IntN(len(g.workers)-1)]
						a.RemoveWorker(w)
						b.RemoveWorker(w)
						a.AddWorker(w)
						b.AddWorker(w)
						g.stored[w] = nil
					}
				}
				if st := a.Stats(); st.StoredBlocks == 0 || st.RemovedBlocks == 0 || st.MissingParents == 0 ||
					st.UnknownRemovals == 0 || st.DuplicateStores == 0 || st.Clears == 0 || st.UnknownWorkers == 0 ||
					st.SizeMismatches == 0 || st.OverCapacity == 0 {
					t.Fatalf("seed %d: a case was never drawn: %+v", seed, st)
				}
			}
		})
	}
}

// TestIndexApplyBatchStoreThenRemove: a removal of blocks stored earlier
// in the same batch (their engine names are not in the table when the
// batch reads ahead) removes them; a store after their removal holds them
// again.
func TestIndexApplyBatchStoreThenRemove(t *testing.T) {
	ix := NewIndex(4)
	ix.AddWorker("a")
	ix.AddWorker("b")
	blocks := chain(1, 2, 3, 4)
	batch := []BatchEvent{
		{Worker: "a", Event: &KVEvent{Kind: EventStored, Blocks: blocks}},
		{Worker: "b", Event: &KVEvent{Kind: EventStored, Blocks: blocks[:2]}},
		{Worker: "a", Event: &KVEvent{Kind: EventRemoved, Removed: []uint64{1001, 1003, 9999}}},
		{Worker: "b", Event: &KVEvent{Kind: EventStored, HasParent: true, Parent: 1003, Blocks: chain(5)}},
		{Worker: "b", Event: &KVEvent{Kind: EventStored, HasParent: true, Parent: 1001, Blocks: chain(3)}},
		{Worker: "a", Event: &KVEvent{Kind: EventStored, Blocks: blocks[2:3]}},
	}
	errs := make([]error, len(batch))
	ix.ApplyBatch(batch, errs)
	if errs[0] != nil || errs[1] != nil || errs[2] != nil || errs[4] != nil || errs[5] != nil {
		t.Fatalf("errors %v", errs)
	}
	if _, ok := errs[3].(*MissingParentError); !ok {
		t.Fatalf("b's parent 1003 is not b's: %v", errs[3])
	}
	if got := overlapOf(ix, []uint64{1, 2, 3, 4}); got["a"] != 0 || got["b"] != 3 {
		t.Fatalf("overlaps %v", got)
	}
	if got := overlapOf(ix, []uint64{3, 4}); got["a"] != 2 || got["b"] != 1 {
		t.Fatalf("overlaps of 3, 4: %v", got)
	}
	st := ix.Stats()
	if st.StoredBlocks != 4+2+1+1 || st.RemovedBlocks != 2 || st.UnknownRemovals != 1 || st.MissingParents != 1 {
		t.Fatalf("stats %+v", st)
	}
	if ix.Held("a") != 3 || ix.Unique("a") != 1 || ix.Held("b") != 3 || ix.Unique("b") != 1 {
		t.Fatalf("a %d/%d, b %d/%d", ix.Held("a"), ix.Unique("a"), ix.Held("b"), ix.Unique("b"))
	}
}

// FuzzIndexApplyBatch: any events, cut into batches anywhere, applied
// whole and one by one, leave the same index with the same outcomes.
func FuzzIndexApplyBatch(f *testing.F) {
	f.Add([]byte{1, 0, 3, 1, 2, 3, 2, 0, 1, 2, 255, 1, 1, 2, 5, 6, 3, 1, 0, 9})
	f.Add([]byte{1, 1, 2, 5, 6, 3, 1, 0, 9, 2, 1, 2, 7, 7})
	f.Fuzz(func(t *testing.T, data []byte) {
		workers := []WorkerID{"x", "y", "z", "ghost"}
		a, b := newBatchIndexes(workers)
		var batch []BatchEvent
		for len(data) >= 4 {
			op, w, n, cut := data[0], workers[int(data[1])%len(workers)], int(data[2]%7), data[3]
			data = data[4:]
			ev := &KVEvent{Kind: EventKind(op % 5), BlockSize: []int{0, 4, 16}[int(op/5)%3]}
			if op >= 240 {
				ev.Tier = Tier(op % 5)
			}
			hs := make([]uint64, 0, n)
			for i := 0; i < n && i < len(data); i++ {
				hs = append(hs, uint64(data[i]%24))
			}
			data = data[min(n, len(data)):]
			if n%2 == 1 && len(hs) > 0 {
				ev.HasParent, ev.Parent, hs = true, hs[0]+1000*uint64(cut%2), hs[1:]
			}
			ev.Blocks = make([]StoredBlock, len(hs))
			for i, h := range hs {
				ev.Blocks[i] = StoredBlock{EngineHash: h + 1000*uint64(cut%3%2), ContentHash: h}
			}
			ev.Removed = hs
			if cut%4 == 3 {
				for i := range ev.Removed {
					ev.Removed[i] += 1000
				}
			}
			batch = append(batch, BatchEvent{Worker: w, Event: ev, MaxHeld: int(cut / 16)})
			if cut&8 != 0 {
				applyBoth(t, a, b, batch)
				batch = batch[:0]
			}
		}
		applyBoth(t, a, b, batch)
		compareIndexes(t, a, b, workers)
	})
}

// TestIndexRemovedEventIsBlockByBlock: a removed event applies its blocks
// in two passes (the engine names, then the words); the index it leaves is
// the one its blocks leave removed one at a time, each in an event of its
// own: with names removed twice in one event, content hashes named as
// engine names, and blocks held by other workers.
func TestIndexRemovedEventIsBlockByBlock(t *testing.T) {
	for seed := range uint64(12) {
		g := newBatchGen(100+seed, 6)
		a, b := newBatchIndexes(g.workers)
		for range 1500 {
			e := g.event()
			ev := *e.Event
			_ = a.ApplyCapped(e.Worker, ev, e.MaxHeld)
			if ev.Kind != EventRemoved || !ev.Tier.Valid() || e.Worker == "ghost" || len(ev.Removed) == 0 {
				_ = b.ApplyCapped(e.Worker, ev, e.MaxHeld)
				continue
			}
			for _, eh := range ev.Removed {
				one := ev
				one.Removed = []uint64{eh}
				if err := b.ApplyCapped(e.Worker, one, e.MaxHeld); err != nil {
					t.Fatal(err)
				}
			}
		}
		compareIndexes(t, a, b, g.workers)
	}
}

// benchApplyStoredBatch is benchApplyStored (no cap) through ApplyBatch,
// perBatch workers' removal and store in each batch.
func benchApplyStoredBatch(b *testing.B, workers, perBatch, poolSize int) {
	ix, _ := benchIndex(b, 1<<20, workers, 256)
	const chain = 16
	ring := max(1, 64*64/workers)
	rng := rand.New(rand.NewPCG(9, 9))
	fresh := func() KVEvent {
		sb := make([]StoredBlock, chain)
		for i := range sb {
			h := rng.Uint64()
			sb[i] = StoredBlock{EngineHash: h ^ 0x5bd1e995, ContentHash: h}
		}
		return KVEvent{Kind: EventStored, Blocks: sb, BlockSize: 16}
	}
	ids := ix.Workers()
	rings := make([][]KVEvent, len(ids))
	for w := range rings {
		for range ring {
			ev := fresh()
			_ = ix.Apply(ids[w], ev)
			rings[w] = append(rings[w], ev)
		}
	}
	pool := make([]KVEvent, poolSize)
	for i := range pool {
		pool[i] = fresh()
	}
	removals := make([]KVEvent, perBatch)
	for i := range removals {
		removals[i] = KVEvent{Kind: EventRemoved, Removed: make([]uint64, chain)}
	}
	batch := make([]BatchEvent, 0, 2*perBatch)
	errs := make([]error, 2*perBatch)
	b.ResetTimer()
	defer startCPU().report(b, 0)
	for e := 0; e*chain < b.N; e += perBatch {
		batch = batch[:0]
		for k := range perBatch {
			w := (e + k) % len(ids)
			slot := ((e + k) / len(ids)) % ring
			for i, blk := range rings[w][slot].Blocks {
				removals[k].Removed[i] = blk.EngineHash
			}
			ev := &pool[(e+k)%len(pool)]
			batch = append(batch, BatchEvent{Worker: ids[w], Event: &removals[k]}, BatchEvent{Worker: ids[w], Event: ev})
			rings[w][slot] = *ev
		}
		ix.ApplyBatch(batch, errs)
		for _, err := range errs[:len(batch)] {
			if err != nil {
				b.Fatal(err)
			}
		}
	}
}
