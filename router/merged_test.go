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
// and CacheCounts' held count.
func TestMergedOverlapsEqualsOneIndex(t *testing.T) {
	for _, parts := range []int{1, 2, 3, 5} {
		t.Run(fmt.Sprintf("parts=%d", parts), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(parts), 7))
			whole := NewIndex(0)
			shards := make([]*Index, parts)
			merged := make(MergedOverlaps, parts)
			for i := range shards {
				shards[i] = NewIndex(0)
				merged[i] = shards[i]
			}
			const workers = 40
			for w := range workers {
				id := WorkerID(fmt.Sprintf("w%02d", w))
				whole.AddWorker(id)
				shards[w%parts].AddWorker(id)
			}
			// Chains over a few shared prefixes, so lookups meet several
			// holders with different depths in every part.
			for range 400 {
				w := rng.IntN(workers)
				id := WorkerID(fmt.Sprintf("w%02d", w))
				root := uint64(rng.IntN(6)) * 100
				n := 1 + rng.IntN(12)
				hs := make([]uint64, n)
				for i := range hs {
					hs[i] = root + uint64(i) + 1
				}
				ev := KVEvent{Kind: EventStored, Blocks: chain(hs...)}
				if rng.IntN(5) == 0 {
					ev.Tier = TierHost
				}
				if err := whole.Apply(id, ev); err != nil {
					t.Fatal(err)
				}
				if err := shards[w%parts].Apply(id, ev); err != nil {
					t.Fatal(err)
				}
			}
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
					t.Fatalf("root %d: merged %v, one index %v", root, buf, want)
				}
				wantT := whole.FindTieredMatches(seq, want, nil)
				tbuf = merged.FindTieredMatches(seq, buf, tbuf)
				if !sameTiers(wantT, tbuf) {
					t.Fatalf("root %d tiers: merged %v, one index %v", root, tbuf, wantT)
				}
			}
			for w := range workers {
				id := WorkerID(fmt.Sprintf("w%02d", w))
				wh, _ := whole.CacheCounts(id)
				mh, mu := merged.CacheCounts(id)
				if wh != mh || mu > mh {
					t.Fatalf("%s: held %d (unique %d) merged, %d one index", id, mh, mu, wh)
				}
			}
		})
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
