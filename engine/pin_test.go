package engine

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/router"
)

// TestEnginePrefixPin: a pinned prefix survives a flood that evicts an
// unpinned one (HiCache's PIN: evicted from the device, loaded back from
// host memory, counted cached) and takes no device block meanwhile; a hit
// renews the pin; once it expires the prefix is lost like any block; pins
// hold at most the device's capacity.
func TestEnginePrefixPin(t *testing.T) {
	const bs = 4
	conv := seqTokens(1, 12) // a conversation: 3 blocks
	hashes := router.SequenceHashes(conv, bs, "")
	flood := func(e *Engine, from int) {
		for i := range 6 { // 6 × 4 blocks through a 10-block cache
			runOne(t, e, Request{ID: fmt.Sprintf("flood-%d-%d", from, i), Tokens: seqTokens(1000*(from+i+1), 16), OutputTokens: 1})
		}
	}
	probe := func(e *Engine, id string) int {
		return runOne(t, e, Request{ID: id, Tokens: cat(conv, seqTokens(900, 3)), OutputTokens: 1}).CachedTokens
	}
	for _, tc := range []struct {
		name       string
		ttl        time.Duration // 0: no pin
		wait       time.Duration // virtual time before the flood
		wantCached int
	}{
		{"unpinned: evicted", 0, 0, 0},
		{"pinned: kept", time.Minute, 0, 12},
		{"pin expired: evicted", time.Second, 2 * time.Second, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := mustNew(t, "w", Config{BlockSize: bs, CapacityBlocks: 10})
			runOne(t, e, Request{ID: "turn-1", Tokens: conv, OutputTokens: 1})
			if tc.ttl > 0 {
				if n := e.Pin(e.Stats().Now, hashes, tc.ttl); n != 3 || e.PinnedBlocks() != 3 {
					t.Fatalf("pinned %d blocks (%d held)", n, e.PinnedBlocks())
				}
			}
			if tc.wait > 0 {
				// Time passes: the next submission releases the due pin.
				if err := e.Submit(e.Stats().Now+tc.wait, Request{ID: "later", Tokens: seqTokens(5000, 4), OutputTokens: 1}); err != nil {
					t.Fatal(err)
				}
				runIdle(t, e)
			}
			flood(e, 0)
			if st := e.Stats(); st.UsedBlocks != 0 {
				t.Fatalf("%d device blocks held after the flood: pins must take none", st.UsedBlocks)
			}
			if got := probe(e, "probe"); got != tc.wantCached {
				t.Fatalf("probe cached %d tokens, want %d (pinned %d)", got, tc.wantCached, e.PinnedBlocks())
			}
		})
	}

	// A hit renews the pin: pinned for 1s, hit at 0.8s, still held at 1.5s.
	e := mustNew(t, "w", Config{BlockSize: bs, CapacityBlocks: 10})
	runOne(t, e, Request{ID: "turn-1", Tokens: conv, OutputTokens: 1})
	t0 := e.Stats().Now
	e.Pin(t0, hashes, time.Second)
	if err := e.Submit(t0+800*time.Millisecond, Request{ID: "turn-2", Tokens: cat(conv, seqTokens(700, 4)), OutputTokens: 1}); err != nil {
		t.Fatal(err)
	}
	runIdle(t, e)
	if err := e.Submit(t0+1500*time.Millisecond, Request{ID: "x", Tokens: seqTokens(6000, 4), OutputTokens: 1}); err != nil {
		t.Fatal(err)
	}
	runIdle(t, e)
	if e.PinnedBlocks() != 3 {
		t.Fatalf("a hit did not renew the pin: %d blocks pinned", e.PinnedBlocks())
	}

	// The bound: a 10-block device pins 10 blocks at most.
	e = mustNew(t, "w", Config{BlockSize: bs, CapacityBlocks: 10})
	a, b := seqTokens(2, 32), seqTokens(3000, 32) // 8 blocks each
	runOne(t, e, Request{ID: "a", Tokens: a, OutputTokens: 1})
	if n := e.Pin(e.Stats().Now, router.SequenceHashes(a, bs, ""), time.Minute); n != 8 {
		t.Fatalf("pinned %d of a's 8 blocks", n)
	}
	runOne(t, e, Request{ID: "b", Tokens: b, OutputTokens: 1})
	if n := e.Pin(e.Stats().Now, router.SequenceHashes(b, bs, ""), time.Minute); n != 2 {
		t.Fatalf("pinned %d of b's 8 blocks past 8 pinned in a 10-block device, want 2", n)
	}
	if err := e.Clear(e.Stats().Now); err != nil || e.PinnedBlocks() != 0 {
		t.Fatalf("clear: %v, %d pinned", err, e.PinnedBlocks())
	}
}
