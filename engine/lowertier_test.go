package engine

import (
	"testing"

	"github.com/kvrouter/kvrouter/router"
)

// Config.LowerTier: the blocks past the GPU hit that the lower tier holds
// contiguously are loaded, not computed: cached tokens count them, they are
// cached on the GPU (stored events chained to the GPU prefix), the prefill
// computes only the rest, and a gap in the lower tier ends the load.
func TestEngineLowerTierLoad(t *testing.T) {
	const bs = 4
	prompt := seqTokens(1, 10*bs+2) // 10 full blocks and 2 tokens
	hashes := router.SequenceHashes(prompt, bs, "")
	held := map[uint64]bool{}
	asked := 0
	e := mustNew(t, "w", Config{BlockSize: bs, CapacityBlocks: 64, LowerTier: func(h uint64) bool { asked++; return held[h] }})
	// Warm the GPU with the first 3 blocks.
	runOne(t, e, Request{ID: "warm", Tokens: prompt[:3*bs+1], OutputTokens: 1})
	// The lower tier holds blocks 3..6 and 8 (not 7).
	for _, i := range []int{3, 4, 5, 6, 8} {
		held[hashes[i]] = true
	}
	e.DrainEvents()
	before := e.Stats()
	out := runOne(t, e, Request{ID: "r", Tokens: prompt, OutputTokens: 1})
	if out.CachedTokens != 7*bs {
		t.Fatalf("cached %d tokens, want %d (3 GPU + 4 loaded blocks)", out.CachedTokens, 7*bs)
	}
	st := e.Stats()
	if got := st.LoadedTokens - before.LoadedTokens; got != 4*bs {
		t.Errorf("loaded %d tokens, want %d", got, 4*bs)
	}
	if got := st.PrefillTokens - before.PrefillTokens; got != uint64(len(prompt)-7*bs) {
		t.Errorf("computed %d prompt tokens, want %d", got, len(prompt)-7*bs)
	}
	var stored []uint64
	for _, ev := range e.DrainEvents() {
		if ev.KV.Kind == router.EventStored {
			if len(stored) == 0 && (!ev.KV.HasParent || ev.KV.Parent != hashes[2]) {
				t.Errorf("first stored event %+v: want chained to block 2", ev.KV)
			}
			for _, b := range ev.KV.Blocks {
				stored = append(stored, b.ContentHash)
			}
		}
	}
	if len(stored) != 7 || stored[0] != hashes[3] || stored[6] != hashes[9] {
		t.Errorf("stored %d blocks, want blocks 3..9 (loaded ones included)", len(stored))
	}
	// Now on the GPU: a resubmission hits there and asks the tier nothing
	// for those blocks.
	asked = 0
	if out := runOne(t, e, Request{ID: "again", Tokens: prompt, OutputTokens: 1}); out.CachedTokens != 10*bs {
		t.Errorf("resubmission cached %d tokens, want %d", out.CachedTokens, 10*bs)
	}
	if asked != 0 {
		t.Errorf("lower tier asked %d times for a full GPU hit", asked)
	}
	// Remote prefills never load.
	e2 := mustNew(t, "w2", Config{BlockSize: bs, CapacityBlocks: 64, LowerTier: func(uint64) bool { return true }})
	if err := e2.Submit(0, Request{ID: "rp", Tokens: prompt, OutputTokens: 1, RemotePrefill: true}); err != nil {
		t.Fatal(err)
	}
	e2.NextEventTime() // admits it: AwaitingKV
	outs := e2.TakeOutputs()
	if o, ok := find(outs, "rp", AwaitingKV); !ok || o.CachedTokens != 0 || e2.Stats().LoadedTokens != 0 {
		t.Errorf("remote prefill: %+v, loaded %d", o, e2.Stats().LoadedTokens)
	}
}
