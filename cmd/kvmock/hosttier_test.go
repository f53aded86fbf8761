package main

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/router"
)

// replayTiers applies evs from the last device-tier cleared event on to an
// index, as a replica would.
func replayTiers(t *testing.T, evs []eventbus.WireEvent) *router.Index {
	t.Helper()
	start := 0
	for i, ev := range evs {
		if ev.Kind == eventbus.KindCleared && ev.Tier == 0 {
			start = i
		}
	}
	ix := router.NewIndex(16)
	ix.AddWorker("mock-1")
	for _, ev := range evs[start:] {
		if err := ix.Apply("mock-1", ev.KVEvent()); err != nil {
			t.Fatalf("event %d (%+v): %v", ev.EventID, ev, err)
		}
	}
	return ix
}

// The host tier (--host-tier-blocks): blocks the GPU evicts move into a
// host LRU (stored events of the host tier), the LRU's evictions are
// removed events of the host tier, a prompt whose blocks wait there is
// served with them loaded back (cached tokens count them) and stored on
// the GPU again, and what the events say is always the tier's content, a
// resync included.
func TestMockHostTier(t *testing.T) {
	const gpu, host = 24, 16
	tm := startMock(t, func(c *config) { c.KVBlocks, c.HostTierBlocks = gpu, host }, false)
	hooks := <-tm.hooks
	ask := func(prompt string) answer {
		t.Helper()
		code, body := post(t, tm.url+"/v1/completions", map[string]any{"model": "kvmock", "prompt": prompt, "max_tokens": 1})
		if code != 200 {
			t.Fatalf("HTTP %d: %s", code, body)
		}
		return decodeAnswer(t, body)
	}
	settled := func() []eventbus.WireEvent {
		t.Helper()
		checkFor(t, 5*time.Second, 5*time.Millisecond, func() error {
			if n := tm.m.q.len(); n > 0 {
				return fmt.Errorf("%d events queued", n)
			}
			return nil
		})
		return tm.pub.snapshot()
	}
	tierOf := func(ix *router.Index, tier router.Tier) map[uint64]bool {
		out := map[uint64]bool{}
		src := ix
		if tier != router.TierDevice {
			if src = ix.LowerTier(tier); src == nil {
				return out
			}
		}
		for _, b := range src.WorkerBlocks("mock-1") {
			out[b.ContentHash] = true
		}
		return out
	}

	prompt := words("held", 100)
	a := ask(prompt)
	full := (a.Usage.PromptTokens - 1) / 16 // blocks a resubmission can hit
	if full < 3 || full > host/2 {
		t.Fatalf("prompt of %d tokens: %d blocks, want 3..%d", a.Usage.PromptTokens, full, host/2)
	}
	mine := tierOf(replayTiers(t, settled()), router.TierDevice)
	if len(mine) < full {
		t.Fatalf("GPU holds %d blocks after the first prompt, want ≥ %d", len(mine), full)
	}
	// Other prompts push it off the GPU, into the host tier.
	for i := 0; ; i++ {
		if i == 20 {
			t.Fatal("the prompt never left the GPU for the host tier")
		}
		if f := ask(words(fmt.Sprintf("fill%c", 'a'+i), 100)); f.Usage.PromptTokens != a.Usage.PromptTokens {
			t.Fatalf("filler of %d tokens, want %d", f.Usage.PromptTokens, a.Usage.PromptTokens)
		}
		ix := replayTiers(t, settled())
		dev, hst := tierOf(ix, router.TierDevice), tierOf(ix, router.TierHost)
		onGPU, onHost := 0, 0
		for h := range mine {
			if dev[h] {
				onGPU++
			}
			if hst[h] {
				onHost++
			}
		}
		t.Logf("filler %d: %d of %d blocks on the GPU, %d on the host (host holds %d)", i, onGPU, len(mine), onHost, len(hst))
		if onGPU == 0 && onHost == len(mine) {
			break
		}
	}
	evs := settled()
	sawHostStored := slices.ContainsFunc(evs, func(ev eventbus.WireEvent) bool {
		return ev.Kind == eventbus.KindStored && ev.Tier == uint8(router.TierHost) && !ev.HasParent
	})
	if !sawHostStored {
		t.Fatal("no host-tier stored event")
	}
	// Loaded back: every block a hit can take, none computed.
	b := ask(prompt)
	if got, want := b.Usage.PromptTokensDetails.CachedTokens, full*16; got != want {
		t.Fatalf("resubmission cached %d tokens, want %d (loaded from the host tier)", got, want)
	}
	d, err := tm.m.statsDoc(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if d.HostTier == nil || d.HostTier.LoadedTokens != uint64(full*16) || d.HostTier.CapacityBlocks != host {
		t.Fatalf("stats host_tier %+v", d.HostTier)
	}
	ix := replayTiers(t, settled())
	dev := tierOf(ix, router.TierDevice)
	for h := range mine {
		if !dev[h] {
			t.Fatal("a loaded block is not stored on the GPU again")
		}
	}
	// More traffic: the host LRU drops blocks (removed events of the host
	// tier); the events always say what the tier holds.
	for i := 0; i < 20 && d.HostTier.Evicted == 0; i++ {
		ask(words(fmt.Sprintf("more%c", 'a'+i), 100))
		if d, err = tm.m.statsDoc(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	evs = settled()
	if !slices.ContainsFunc(evs, func(ev eventbus.WireEvent) bool {
		return ev.Kind == eventbus.KindRemoved && ev.Tier == uint8(router.TierHost)
	}) {
		t.Fatalf("host tier evicted %d blocks, no host-tier removed event", d.HostTier.Evicted)
	}
	check := func(evs []eventbus.WireEvent) {
		t.Helper()
		ix := replayTiers(t, evs)
		st, _ := tm.m.drv.stats(context.Background())
		d, _ := tm.m.statsDoc(context.Background())
		if got := ix.TierHeld("mock-1", router.TierHost); int64(got) != d.HostTier.Blocks || got > host || got == 0 {
			t.Fatalf("events put %d blocks in the host tier, it holds %d (capacity %d)", got, d.HostTier.Blocks, host)
		}
		if got := ix.Held("mock-1"); got != st.CachedBlocks {
			t.Fatalf("events put %d blocks on the GPU, the engine caches %d", got, st.CachedBlocks)
		}
	}
	check(evs)
	// A resync republishes both tiers, each after its own cleared event.
	hooks.resync(eventbus.ResyncRequest{Worker: "mock-1", LastEventID: 1, Reason: "test"}, tm.pub)
	evs = settled()
	var cleared []uint8
	for _, ev := range evs {
		if ev.Kind == eventbus.KindCleared {
			cleared = append(cleared, ev.Tier)
		}
	}
	if n := len(cleared); n < 2 || cleared[n-2] != 0 || cleared[n-1] != uint8(router.TierHost) {
		t.Fatalf("cleared events of tiers %v, want the resync's device then host", cleared)
	}
	check(evs)
}

// Without --host-tier-blocks nothing changes: no host events, no stats.
func TestMockHostTierOff(t *testing.T) {
	tm := startMock(t, func(c *config) { c.KVBlocks = 24 }, false)
	for i := range 6 {
		post(t, tm.url+"/v1/completions", map[string]any{"model": "kvmock", "prompt": words(fmt.Sprintf("off%c", 'a'+i), 100), "max_tokens": 1})
	}
	checkFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		if n := tm.m.q.len(); n > 0 {
			return fmt.Errorf("%d events queued", n)
		}
		return nil
	})
	for _, ev := range tm.pub.snapshot() {
		if ev.Tier != 0 {
			t.Fatalf("event %+v has a tier", ev)
		}
	}
	if d, _ := tm.m.statsDoc(context.Background()); d.HostTier != nil {
		t.Fatalf("host_tier %+v", d.HostTier)
	}
}
