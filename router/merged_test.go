package router

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// TestMergedOverlapsEqualsOneIndex: workers split across several indexes
// (the sharded Raft groups) answer every lookup as one index holding them
// all would, including with a reused buffer, for device and lower tiers,
// and CacheCounts: held, and unique fleet-wide (a block two parts' workers
// hold is unique in neither), through stores and removals, past 64
// workers too.
func TestMergedOverlapsEqualsOneIndex(t *testing.T) {
	for _, c := range []struct{ parts, workers int }{{1, 40}, {2, 40}, {3, 40}, {5, 40}, {2, 150}} {
		t.Run(fmt.Sprintf("parts=%d,workers=%d", c.parts, c.workers), func(t *testing.T) {
			parts, workers := c.parts, c.workers
			rng := rand.New(rand.NewPCG(uint64(parts*workers), 7))
			whole := NewIndex(0)
			shards := make([]*Index, parts)
			srcs := make([]OverlapSource, parts)
			idx := make([]func() *Index, parts)
			for i := range shards {
				shards[i] = NewIndex(0)
				srcs[i], idx[i] = shards[i], func() *Index { return shards[i] }
			}
			merged := NewMergedOverlaps(srcs, MergeOptions{Indexes: idx})
			id := func(w int) WorkerID { return WorkerID(fmt.Sprintf("w%03d", w)) }
			for w := range workers {
				whole.AddWorker(id(w))
				shards[w%parts].AddWorker(id(w))
			}
			apply := func(w int, ev KVEvent) {
				t.Helper()
				if err := whole.Apply(id(w), ev); err != nil {
					t.Fatal(err)
				}
				if err := shards[w%parts].Apply(id(w), ev); err != nil {
					t.Fatal(err)
				}
			}
			check := func(step int) {
				t.Helper()
				buf := make([]Overlap, 0, 4)
				var tbuf []TierOverlap
				for root := uint64(0); root < 600; root += 100 {
					seq := make([]uint64, 14)
					for i := range seq {
						seq[i] = root + uint64(i) + 1
					}
					want := whole.FindMatches(seq, nil)
					buf = merged.FindMatches(seq, buf)
					if !sameOverlaps(want, buf) {
						t.Fatalf("step %d root %d: merged %v, one index %v", step, root, buf, want)
					}
					wantT := whole.FindTieredMatches(seq, want, nil)
					tbuf = merged.FindTieredMatches(seq, buf, tbuf)
					if !sameTiers(wantT, tbuf) {
						t.Fatalf("step %d root %d tiers: merged %v, one index %v", step, root, tbuf, wantT)
					}
				}
				for w := range workers {
					wh, wu := whole.CacheCounts(id(w))
					mh, mu := merged.CacheCounts(id(w))
					if wh != mh || wu != mu {
						t.Fatalf("step %d %s: held %d unique %d merged, %d and %d one index", step, id(w), mh, mu, wh, wu)
					}
				}
			}
			// Chains over a few shared prefixes, so lookups meet several
			// holders with different depths in every part, and blocks
			// are held in one part, in several, by one worker or many.
			for step := range 600 {
				w := rng.IntN(workers)
				root := uint64(rng.IntN(6)) * 100
				n := 1 + rng.IntN(12)
				hs := make([]uint64, n)
				for i := range hs {
					hs[i] = root + uint64(i) + 1
				}
				if step >= 400 && rng.IntN(3) == 0 {
					apply(w, KVEvent{Kind: EventRemoved, Removed: hs[rng.IntN(n):]})
				} else {
					ev := KVEvent{Kind: EventStored, Blocks: chain(hs...)}
					if rng.IntN(5) == 0 {
						ev.Tier = TierHost
					}
					apply(w, ev)
				}
				if step%100 == 99 {
					check(step)
				}
			}
		})
	}
}

// TestMergedOverlapsMovingWorker: a worker registered in two parts while
// it moves — its owner holds its blocks, the other part a copy that grows
// block by block in any order — is found as in one index at every step,
// with the owner named and without (the deepest entry), and so are its
// held and fleet-wide unique counts and those of a worker sharing blocks
// with it; then the owner lets go and the complete copy answers.
func TestMergedOverlapsMovingWorker(t *testing.T) {
	seq := make([]uint64, 20)
	for i := range seq {
		seq[i] = uint64(i + 1)
	}
	for _, named := range []bool{true, false} {
		t.Run(fmt.Sprintf("owner named=%v", named), func(t *testing.T) {
			whole, from, to := NewIndex(0), NewIndex(0), NewIndex(0)
			for _, ix := range []*Index{whole, from} {
				ix.AddWorker("mv")
				if err := ix.Apply("mv", KVEvent{Kind: EventStored, Blocks: chain(seq...)}); err != nil {
					t.Fatal(err)
				}
				if err := ix.Apply("mv", KVEvent{Kind: EventStored, Blocks: chain(seq[:6]...), Tier: TierHost}); err != nil {
					t.Fatal(err)
				}
			}
			// "peer", in the target group, shares the first 5 blocks.
			for _, ix := range []*Index{whole, to} {
				ix.AddWorker("peer")
				if err := ix.Apply("peer", KVEvent{Kind: EventStored, Blocks: chain(seq[:5]...)}); err != nil {
					t.Fatal(err)
				}
			}
			owner := 0 // the source, until it lets go
			opt := MergeOptions{Indexes: []func() *Index{func() *Index { return from }, func() *Index { return to }}}
			if named {
				opt.Owner = func(w WorkerID) int {
					if w == "mv" {
						return owner
					}
					return 1
				}
			}
			merged := NewMergedOverlaps([]OverlapSource{from, to}, opt)
			check := func(stage string) {
				t.Helper()
				for _, n := range []int{1, 3, 5, 12, 20} {
					want := whole.FindMatches(seq[:n], nil)
					got := merged.FindMatches(seq[:n], nil)
					if !sameOverlaps(want, got) {
						t.Fatalf("%s, %d blocks: merged %v, one index %v", stage, n, got, want)
					}
					wantT := whole.FindTieredMatches(seq[:n], want, nil)
					gotT := merged.FindTieredMatches(seq[:n], got, nil)
					if !sameTiers(wantT, gotT) {
						t.Fatalf("%s, %d blocks, tiers: merged %v, one index %v", stage, n, gotT, wantT)
					}
				}
				for _, w := range []WorkerID{"mv", "peer"} {
					wh, wu := whole.CacheCounts(w)
					mh, mu := merged.CacheCounts(w)
					if wh != mh || wu != mu {
						t.Fatalf("%s: %s held %d unique %d merged, %d and %d one index", stage, w, mh, mu, wh, wu)
					}
				}
			}
			check("before the move")
			to.AddWorker("mv") // registered in the target: its copy starts empty
			check("registered in both")
			for i, j := range rand.New(rand.NewPCG(3, 4)).Perm(len(seq)) {
				if err := to.Apply("mv", KVEvent{Kind: EventStored, Blocks: chain(seq[j])}); err != nil {
					t.Fatal(err)
				}
				if i == 3 {
					if err := to.Apply("mv", KVEvent{Kind: EventStored, Blocks: chain(seq[:6]...), Tier: TierHost}); err != nil {
						t.Fatal(err)
					}
				}
				check(fmt.Sprintf("%d blocks copied", i+1))
			}
			from.RemoveWorker("mv")
			owner = 1
			check("after the move")
		})
	}
}

// TestMergedPooledDecisionsEqualOneIndex: kv-pooled over the merged view
// of several parts decides as over one index holding every worker — the
// same worker and the same cost table at every step — while blocks come
// and go, many of them held in more than one part.
func TestMergedPooledDecisionsEqualOneIndex(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	const parts = 3
	ws := make([]WorkerInfo, 9)
	for i := range ws {
		ws[i] = WorkerInfo{ID: WorkerID(fmt.Sprintf("w%d", i)), TotalBlocks: 120 + 40*(i%3)}
	}
	whole := NewIndex(16)
	shards := make([]*Index, parts)
	srcs := make([]OverlapSource, parts)
	idx := make([]func() *Index, parts)
	for i := range shards {
		shards[i] = NewIndex(16)
		srcs[i], idx[i] = shards[i], func() *Index { return shards[i] }
	}
	merged := NewMergedOverlaps(srcs, MergeOptions{Indexes: idx,
		Owner: func(w WorkerID) int { return int(w[1]-'0') % parts }})
	one, err := New(pooledConfig(), whole, 1)
	if err != nil {
		t.Fatal(err)
	}
	sharded, err := New(pooledConfig(), merged, 1)
	if err != nil {
		t.Fatal(err)
	}
	one.SetWorkers(ws)
	sharded.SetWorkers(ws)
	for i, w := range ws {
		whole.AddWorker(w.ID)
		shards[i%parts].AddWorker(w.ID)
	}
	prefixes := make([][]uint32, 12)
	for k := range prefixes {
		prefixes[k] = tokens(1000*k+1, 16*(4+rng.IntN(20)))
	}
	differs := 0 // decisions where per-part uniqueness would have priced differently
	for step := range 400 {
		i := rng.IntN(len(ws))
		w := ws[i].ID
		p := prefixes[rng.IntN(len(prefixes))]
		h := SequenceHashes(p, 16, "")
		if rng.IntN(3) > 0 {
			for _, ix := range []*Index{whole, shards[i%parts]} {
				store(t, ix, w, p)
			}
		} else {
			cut := rng.IntN(len(h))
			for _, ix := range []*Index{whole, shards[i%parts]} {
				_ = ix.Apply(w, KVEvent{Kind: EventRemoved, Removed: h[cut:]})
			}
		}
		q := append(append([]uint32{}, prefixes[rng.IntN(len(prefixes))]...), tokens(900_000+step*50, 16*rng.IntN(3))...)
		req := Request{ID: fmt.Sprint("q", step), Tokens: len(q), Hashes: SequenceHashes(q, 16, "")}
		da, err1 := one.Decide(req, t0)
		db, err2 := sharded.Decide(req, t0)
		if err1 != nil || err2 != nil {
			t.Fatal(err1, err2)
		}
		if da.Worker != db.Worker {
			t.Fatalf("step %d: one index picks %s, the merged view %s\n%s\n%s", step, da.Worker, db.Worker, da.Explain(), db.Explain())
		}
		for r := range da.Rows {
			if da.Rows[r] != db.Rows[r] {
				t.Fatalf("step %d: cost rows differ: %+v vs %+v", step, da.Rows[r], db.Rows[r])
			}
		}
		for _, w := range ws {
			_, pu := shards[int(w.ID[1]-'0')%parts].CacheCounts(w.ID)
			if _, u := whole.CacheCounts(w.ID); u != pu {
				differs++
			}
		}
	}
	if differs == 0 {
		t.Fatal("no block was ever held in two parts: the test checks nothing fleet-wide")
	}
}

func sameOverlaps(a, b []Overlap) bool {
	return sameSorted(a, b, func(x, y Overlap) int {
		if c := strings.Compare(string(x.Worker), string(y.Worker)); c != 0 {
			return c
		}
		return x.Blocks - y.Blocks
	})
}

func sameTiers(a, b []TierOverlap) bool {
	return sameSorted(a, b, func(x, y TierOverlap) int { return strings.Compare(string(x.Worker), string(y.Worker)) })
}

// sameSorted: a and b hold the same entries in any order.
func sameSorted[T comparable](a, b []T, cmp func(T, T) int) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.SortFunc(a, cmp)
	slices.SortFunc(b, cmp)
	return slices.Equal(a, b)
}
