package zmqbridge

import (
	"errors"
	"reflect"
	"testing"

	"github.com/kvrouter/kvrouter/router"
)

func stored(hashes []uint64, parent *uint64, toks []uint32) Event {
	ev := Event{Kind: KindBlockStored, Tag: "BlockStored", BlockHashes: hashes, TokenIDs: toks, BlockSize: 16}
	if parent != nil {
		ev.HasParent, ev.Parent = true, *parent
	}
	return ev
}

func removed(hashes ...uint64) Event {
	return Event{Kind: KindBlockRemoved, Tag: "BlockRemoved", BlockHashes: hashes}
}

func ptr(v uint64) *uint64 { return &v }

// convertAll runs events through c into an index and returns the index's
// content hashes for the worker.
func convertAll(t *testing.T, c *Converter, sink *recordSink, evs ...Event) []error {
	t.Helper()
	var errs []error
	for i := range evs {
		out, err := c.Convert(&evs[i], nil)
		if err != nil {
			errs = append(errs, err)
		}
		if err := sink.Emit(t.Context(), Split(out, 0)); err != nil {
			t.Fatal(err)
		}
	}
	if ie := sink.indexErrors(); len(ie) > 0 {
		t.Fatalf("index rejected converted events: %v", ie)
	}
	return errs
}

func TestBridgeConverterChains(t *testing.T) {
	// Three blocks stored in two events (the second chained to the first)
	// must give exactly the content hashes the router computes for the
	// whole prompt.
	toks := tokens(500, 3)
	want := seqHashes(toks, "")
	c, sink := NewConverter(16, 0), newRecordSink(16)
	if errs := convertAll(t, c, sink,
		stored([]uint64{11}, nil, toks[:16]),
		stored([]uint64{12, 13}, ptr(11), toks[16:]),
	); errs != nil {
		t.Fatal(errs)
	}
	got := sink.contents()
	for _, h := range want {
		if !got[h] {
			t.Fatalf("index lacks %d: has %v, want %v", h, got, want)
		}
	}
	if len(got) != 3 {
		t.Fatalf("index holds %d blocks", len(got))
	}
	if ch, _ := c.Content(13); ch != want[2] {
		t.Fatalf("engine 13 → %d, want %d", ch, want[2])
	}
	// Removing the middle block leaves the others.
	convertAll(t, c, sink, removed(12))
	if got := sink.contents(); len(got) != 2 || got[want[1]] {
		t.Fatalf("after removal: %v", got)
	}
	// A child of an unknown parent cannot be hashed: skipped, counted.
	errs := convertAll(t, c, sink, stored([]uint64{20}, ptr(999), tokens(0, 1)))
	var se *SkipError
	if len(errs) != 1 || !errors.As(errs[0], &se) || se.Reason != SkipUnknownParent {
		t.Fatalf("unknown parent: %v", errs)
	}
	// AllBlocksCleared empties everything.
	convertAll(t, c, sink, Event{Kind: KindAllBlocksCleared})
	if got := sink.contents(); len(got) != 0 || c.Len() != 0 {
		t.Fatalf("after clear: %v", got)
	}
	if c.Stats().Skipped[SkipUnknownParent] != 1 || c.Stats().Clears != 1 {
		t.Fatalf("stats %+v", c.Stats())
	}
}

func TestBridgeConverterLoRA(t *testing.T) {
	toks := tokens(7, 2)
	c, sink := NewConverter(16, 0), newRecordSink(16)
	ev := stored([]uint64{1, 2}, nil, toks)
	ev.HasLoRAID, ev.LoRAID, ev.LoRAName = true, 4, "sql-adapter"
	convertAll(t, c, sink, ev)
	base, lora := seqHashes(toks, ""), seqHashes(toks, "sql-adapter")
	got := sink.contents()
	if !got[lora[0]] || !got[lora[1]] || got[base[0]] {
		t.Fatalf("lora blocks %v, want %v", got, lora)
	}
	// lora_id without a name: the seed is unknown, the event is skipped
	// rather than indexed as base-model blocks.
	ev = stored([]uint64{3}, nil, tokens(900, 1))
	ev.HasLoRAID, ev.LoRAID = true, 4
	errs := convertAll(t, c, sink, ev)
	if len(errs) != 1 || c.Stats().Skipped[SkipLoRAWithoutName] != 1 {
		t.Fatalf("lora without name: %v", errs)
	}
}

func TestBridgeConverterFilters(t *testing.T) {
	c, sink := NewConverter(16, 0), newRecordSink(16)
	cpu := stored([]uint64{1}, nil, tokens(0, 1))
	cpu.Medium = "CPU"
	bs := stored([]uint64{3}, nil, tokens(0, 1))
	bs.BlockSize = 32
	short := stored([]uint64{4, 5}, nil, tokens(0, 1))
	unknown := Event{Kind: KindUnknown, Tag: "BlockPinned"}
	gpuRemoveOnCPU := removed(1)
	gpuRemoveOnCPU.Medium = "CPU_PINNED"
	errs := convertAll(t, c, sink, cpu, bs, short, unknown, gpuRemoveOnCPU)
	st := c.Stats()
	if len(errs) != 5 || st.Skipped[SkipOtherMedium] != 2 ||
		st.Skipped[SkipBlockSizeMismatch] != 1 || st.Skipped[SkipBadTokens] != 1 || st.Skipped[SkipUnknownType] != 1 {
		t.Fatalf("errs %v stats %+v", errs, st)
	}
	if !errors.Is(errs[1], router.ErrBlockSizeMismatch) {
		t.Fatalf("block size mismatch does not say so: %v", errs[1])
	}
	if len(sink.contents()) != 0 {
		t.Fatal("filtered events reached the index")
	}
	// GPU (and group 0, and no medium at all) pass. KV cache groups:
	// TestBridgeConverterGroups.
	ok := stored([]uint64{6}, nil, tokens(0, 1))
	ok.Medium, ok.HasGroupIdx = "GPU", true
	if errs := convertAll(t, c, sink, ok); errs != nil || len(sink.contents()) != 1 {
		t.Fatalf("gpu event: %v", errs)
	}
}

func TestBridgeConverterCopies(t *testing.T) {
	c, sink := NewConverter(16, 0), newRecordSink(16)
	toks := tokens(40, 1)
	content := seqHashes(toks, "")[0]
	// The engine stores hash 1 twice (two copies): one removal keeps it.
	convertAll(t, c, sink, stored([]uint64{1}, nil, toks), stored([]uint64{1}, nil, toks), removed(1))
	if !sink.contents()[content] {
		t.Fatal("first removal of a doubly stored block dropped it")
	}
	convertAll(t, c, sink, removed(1))
	if len(sink.contents()) != 0 {
		t.Fatal("second removal left the block")
	}
	// Two engine hashes, same tokens (e.g. different images behind the
	// same placeholder tokens): the content stays while either is held.
	convertAll(t, c, sink, stored([]uint64{2}, nil, toks), stored([]uint64{3}, nil, toks), removed(2))
	if !sink.contents()[content] {
		t.Fatal("content dropped while engine hash 3 still holds it")
	}
	// A resync snapshot in between keeps the deferred name.
	snap := c.Snapshot(0)
	if len(snap) != 2 || snap[0].Kind != router.EventCleared || len(snap[1].Blocks) != 2 {
		t.Fatalf("snapshot %+v", snap)
	}
	if err := sink.Emit(t.Context(), snap); err != nil {
		t.Fatal(err)
	}
	convertAll(t, c, sink, removed(3))
	if len(sink.contents()) != 0 {
		t.Fatalf("content left after both names were removed: %v", sink.contents())
	}
	// Token-less stores are copies of known blocks.
	convertAll(t, c, sink, stored([]uint64{4}, nil, toks), Event{Kind: KindBlockStored, BlockHashes: []uint64{4}}, removed(4))
	if !sink.contents()[content] {
		t.Fatal("token-less copy not counted")
	}
	if st := c.Stats(); st.UnknownRemovals != 0 {
		t.Fatalf("stats %+v", st)
	}
	convertAll(t, c, sink, removed(77))
	if c.Stats().UnknownRemovals != 1 {
		t.Fatal("unknown removal not counted")
	}
}

func TestBridgeConverterRenamedHash(t *testing.T) {
	// An engine hash reused for other content: the old content goes.
	c, sink := NewConverter(16, 0), newRecordSink(16)
	a, b := tokens(1, 1), tokens(100, 1)
	convertAll(t, c, sink, stored([]uint64{1}, nil, a), stored([]uint64{1}, nil, b))
	got := sink.contents()
	if len(got) != 1 || !got[seqHashes(b, "")[0]] {
		t.Fatalf("after rename %v", got)
	}
	convertAll(t, c, sink, removed(1))
	if len(sink.contents()) != 0 {
		t.Fatal("renamed block not removed")
	}
}

func TestBridgeConverterOverflowAndSplit(t *testing.T) {
	c, sink := NewConverter(16, 4), newRecordSink(16)
	hashes := []uint64{1, 2, 3, 4, 5}
	out, err := c.Convert(&Event{Kind: KindBlockStored, BlockHashes: hashes, TokenIDs: tokens(0, 5), BlockSize: 16}, nil)
	if err != nil || len(out) != 2 || out[1].Kind != router.EventCleared || c.Len() != 0 || c.Stats().Overflows != 1 {
		t.Fatalf("overflow: %+v %v", out, err)
	}
	_ = sink
	// A long chain is split into chained parts the index accepts.
	c = NewConverter(16, 0)
	n := 2500
	hs := make([]uint64, n)
	for i := range hs {
		hs[i] = uint64(i + 1)
	}
	toks := tokens(0, n)
	out, err = c.Convert(&Event{Kind: KindBlockStored, BlockHashes: hs, TokenIDs: toks, BlockSize: 16}, nil)
	if err != nil {
		t.Fatal(err)
	}
	parts := Split(out, 1000)
	if len(parts) != 3 || !parts[1].HasParent || parts[1].Parent != 1000 || parts[2].Parent != 2000 {
		t.Fatalf("split into %d parts", len(parts))
	}
	sink = newRecordSink(16)
	if err := sink.Emit(t.Context(), parts); err != nil {
		t.Fatal(err)
	}
	want := seqHashes(toks, "")
	got := sink.contents()
	if len(got) != n || !got[want[n-1]] || len(sink.indexErrors()) > 0 {
		t.Fatalf("split chain: %d blocks, errors %v", len(got), sink.indexErrors())
	}
	rm := Split([]router.KVEvent{{Kind: router.EventRemoved, Removed: hs}}, 1000)
	if len(rm) != 3 || len(rm[2].Removed) != 500 {
		t.Fatalf("removal split %d", len(rm))
	}
	if got := Split(parts, 1000); !reflect.DeepEqual(got, parts) {
		t.Fatal("split of small events changed them")
	}
}

// TestBridgeConverterTiers: with the host tier kept, vLLM's offloading
// events (medium CPU, token-less, the GPU's engine hashes) reach the
// index's host tier under the content hashes the GPU tier gave those
// hashes; a host store with tokens chains from a parent on the GPU; a
// tier not kept and an unknown medium are skipped as other_medium; the
// stream's resets clear every tier kept, the engine's "all cleared" only
// the device tier; a snapshot republishes every tier.
func TestBridgeConverterTiers(t *testing.T) {
	toks := tokens(700, 3)
	want := seqHashes(toks, "")
	c, sink := NewConverter(16, 0), newRecordSink(16)
	c.KeepTiers(router.TierHost)
	medium := func(ev Event, m string) Event { ev.Medium = m; return ev }
	offload := Event{Kind: KindBlockStored, Tag: "BlockStored", BlockHashes: []uint64{11, 12}, BlockSize: 16, Medium: "CPU"}
	unknownOffload := Event{Kind: KindBlockStored, Tag: "BlockStored", BlockHashes: []uint64{99}, BlockSize: 16, Medium: "CPU"}
	errs := convertAll(t, c, sink,
		stored([]uint64{11, 12}, nil, toks[:32]),
		offload,
		removed(11, 12), // the GPU evicts both: the host copies stay
		medium(stored([]uint64{13}, ptr(12), toks[32:]), "CPU"),
		unknownOffload,
		medium(stored([]uint64{21}, nil, tokens(0, 1)), "DISK"),
		medium(stored([]uint64{22}, nil, tokens(0, 1)), "TAPE"),
	)
	st := c.Stats()
	if len(errs) != 3 || st.Skipped[SkipUnknownParent] != 1 || st.Skipped[SkipOtherMedium] != 2 {
		t.Fatalf("errs %v skipped %v", errs, st.Skipped)
	}
	ix := sink.ix
	if ix.Held("w") != 0 || ix.TierHeld("w", router.TierHost) != 3 {
		t.Fatalf("device %d host %d", ix.Held("w"), ix.TierHeld("w", router.TierHost))
	}
	tm := ix.FindTieredMatches(want, nil, nil)
	if len(tm) != 1 || tm[0] != (router.TierOverlap{Worker: "w", Host: 3}) {
		t.Fatalf("tiered matches %v (want the whole prompt in the host tier)", tm)
	}
	// The host tier removes its own copies.
	out, err := c.Convert(ptrTo(medium(removed(13), "CPU")), nil)
	if err != nil || len(out) != 1 || out[0].Kind != router.EventRemoved || out[0].Tier != router.TierHost {
		t.Fatalf("host removal: %+v %v", out, err)
	}
	if evs := c.ResetAll(); len(evs) != 2 || evs[0].Tier != router.TierDevice || evs[1].Tier != router.TierHost {
		t.Fatalf("ResetAll %+v", evs)
	}
	// Without lower tiers ResetAll is the one device clear of before.
	if evs := NewConverter(16, 0).ResetAll(); len(evs) != 1 || !reflect.DeepEqual(evs[0], router.KVEvent{Kind: router.EventCleared, BlockSize: 16}) {
		t.Fatalf("ResetAll without tiers %+v", evs)
	}
	c2 := NewConverter(16, 0)
	c2.KeepTiers(router.TierHost)
	convertAll(t, c2, newRecordSink(16), stored([]uint64{11}, nil, toks[:16]), medium(stored([]uint64{11}, nil, nil), "CPU"))
	snap := c2.Snapshot(0)
	var tiers []router.Tier
	for _, ev := range snap {
		tiers = append(tiers, ev.Tier)
	}
	if !reflect.DeepEqual(tiers, []router.Tier{router.TierDevice, router.TierDevice, router.TierHost, router.TierHost}) {
		t.Fatalf("snapshot tiers %v", tiers)
	}
	out, _ = c2.Convert(&Event{Kind: KindAllBlocksCleared}, nil)
	if len(out) != 1 || out[0].Tier != router.TierDevice || c2.Len() != 1 {
		t.Fatalf("engine clear %+v, %d held", out, c2.Len())
	}
}

func ptrTo(ev Event) *Event { return &ev }
