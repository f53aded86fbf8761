package fsm

import (
	"bytes"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/router"
)

// tiered is e with its event moved to tier t.
func tiered(e KVBatchEvent, t router.Tier) KVBatchEvent {
	e.Event.Tier = t
	return e
}

// TestFSMTieredBatchType: a batch of device events is type 3, whatever
// build wrote it; one lower-tier event makes it type 12, and its device
// events encode as in type 3 (only lower-tier events carry the tier byte).
func TestFSMTieredBatchType(t *testing.T) {
	dev := stored("w", 0, 1, 1, 2)
	plain := mustEncode(t, KVEventBatch{Events: []KVBatchEvent{dev}})
	if plain[0] != byte(CmdKVEventBatch) {
		t.Fatalf("device batch is type %d", plain[0])
	}
	mixed := mustEncode(t, KVEventBatch{Events: []KVBatchEvent{dev, tiered(stored("w", 0, 2, 3), router.TierHost)}})
	if mixed[0] != byte(CmdKVEventBatchTiered) {
		t.Fatalf("tiered batch is type %d", mixed[0])
	}
	// Both payloads: name table, count, then the device event's bytes.
	evBytes := plain[2+1+2+1+1:] // table (1 name "w"), event count
	if !bytes.Contains(mixed, evBytes) {
		t.Fatalf("device event encodes differently in type 12:\n%x\n%x", plain, mixed)
	}
	for _, e := range []KVBatchEvent{tiered(dev, router.Tier(router.NumTiers))} {
		if _, err := AppendKVBatch(nil, []KVBatchEvent{e}); !errors.Is(err, ErrInvalidCommand) {
			t.Fatalf("tier %d encodes: %v", e.Event.Tier, err)
		}
	}
	// A tier byte of 0 (not written: the device tier is its absence) or of
	// a tier this build does not know is undecodable.
	for _, tb := range []byte{0, byte(router.NumTiers)} {
		bad := slices.Clone(mixed)
		i := bytes.IndexByte(bad[len(plain)-len(evBytes)+len(evBytes):], byte(router.EventStored)) // second event's kind
		at := len(plain) - len(evBytes) + len(evBytes) + i + 2                                     // kind, flags, tier
		bad[at] = tb
		if _, err := DecodeKVBatch(bad); !errors.Is(err, ErrUndecodable) {
			t.Fatalf("tier byte %d decodes: %v", tb, err)
		}
	}
}

func isStale(f *FSM, w string) bool { _, ok := f.Stale()[RankKey{w, 0}]; return ok }

// TestFSMTieredApply: lower-tier events land in their tier, not on the
// device; only a device-tier cleared event clears a stale mark; removing a
// rank drops its lower tiers; the lower-tier cap is LowerTierBlockCap.
func TestFSMTieredApply(t *testing.T) {
	h := newHarness(t)
	h.ok(RegisterWorker{ID: "w", DPRanks: 1, Model: "m", BlockSize: 16, TotalBlocks: 2})
	if r := h.events(stored("w", 0, 1, 1, 2), tiered(stored("w", 0, 2, 3, 4, 5), router.TierHost)); r.Applied != 2 || r.Rejected != 0 {
		t.Fatalf("%+v", r)
	}
	ix := h.f.Index()
	if ix.Held("w") != 2 || ix.TierHeld("w", router.TierHost) != 3 {
		t.Fatalf("device %d host %d", ix.Held("w"), ix.TierHeld("w", router.TierHost))
	}
	// 3 host blocks: over the device cap of 2·2 = 4? no; the host tier
	// is capped by LowerTierBlockCap, not the registered capacity.
	if r := h.events(tiered(stored("w", 0, 3, 6, 7), router.TierHost)); r.Applied != 1 || r.OverCapacity != 0 {
		t.Fatalf("host past the GPU capacity: %+v", r)
	}
	tm := ix.FindTieredMatches([]uint64{1, 2, 3, 4, 9}, ix.FindMatches([]uint64{1, 2, 3, 4, 9}, nil), nil)
	if len(tm) != 1 || tm[0] != (router.TierOverlap{Worker: "w", Host: 2}) {
		t.Fatalf("tiered matches %v", tm)
	}
	// A gap makes the rank stale; a host-tier cleared does not clear it,
	// a device-tier cleared does.
	h.events(stored("w", 0, 9, 8))
	if r := h.events(KVBatchEvent{Worker: "w", EventID: 10, Event: router.KVEvent{Kind: router.EventCleared, Tier: router.TierHost}}); r.Applied != 1 {
		t.Fatalf("%+v", r)
	}
	if !isStale(h.f, "w") || ix.TierHeld("w", router.TierHost) != 0 {
		t.Fatalf("after a host clear: stale %v, host %d", isStale(h.f, "w"), ix.TierHeld("w", router.TierHost))
	}
	h.events(KVBatchEvent{Worker: "w", EventID: 11, Event: router.KVEvent{Kind: router.EventCleared}})
	if isStale(h.f, "w") {
		t.Fatal("a device clear left the rank stale")
	}
	h.events(tiered(stored("w", 0, 12, 1), router.TierDisk))
	h.ok(ResyncWorker{Worker: "w"})
	if ix.TierHeld("w", router.TierDisk) != 0 {
		t.Fatal("a resync left the disk tier")
	}
	h.events(tiered(stored("w", 0, 1, 1), router.TierDisk))
	h.ok(DeregisterWorker{ID: "w"})
	if l := ix.LowerTier(router.TierDisk); l == nil || l.HasWorker("w") {
		t.Fatal("a deregistered worker's disk tier stays")
	}
}

// goldenStateTiers is goldenStateBlockSizes plus lower-tier blocks (host
// with an engine alias, disk, external): the state pinned by
// testdata/snapshot-v4.bin.
func goldenStateTiers(t testing.TB) *FSM {
	f := goldenStateBlockSizes(t)
	h := &harness{t: t, f: f, idx: f.AppliedIndex()}
	host := stored("vllm-0", 1, 100, 14643705804678351452, 4945711292740353085)
	host.Event.Blocks[0].EngineHash = 77
	ext := stored("vllm-0", 0, 101, 31, 32)
	ext.EventID = 0
	if r := h.events(tiered(host, router.TierHost), tiered(stored("kvmock-1", 0, 100, 21, 22, 23), router.TierDisk),
		tiered(ext, router.TierExternal)); r.Applied != 3 {
		t.Fatalf("tier events: %+v", r)
	}
	return h.f
}

// TestFSMSnapshotTiers: a state with lower-tier blocks is written as
// format 4 and restores to the same digest and tiered matches; a state
// without them keeps its older format and digest; format 3 readers refuse
// format 4, and a tier record relabelled as format 3 is refused too.
func TestFSMSnapshotTiers(t *testing.T) {
	base := goldenStateBlockSizes(t)
	f := goldenStateTiers(t)
	if f.Digest() == base.Digest() {
		t.Fatal("lower-tier blocks do not change the digest")
	}
	b, g := restoreSame(t, f, 4)
	if got := g.Index().TierHeld("vllm-0#1", router.TierHost); got != 2 {
		t.Fatalf("restored host blocks %d", got)
	}
	older := newFSM(t)
	older.newestFormat = 3
	if err := restoreBytes(older, b); !errors.Is(err, ErrCorruptSnapshot) || !strings.Contains(err.Error(), "format version 4, this build reads 1 to 3") {
		t.Fatalf("format 3 build restores format 4: %v", err)
	}
	as3 := slices.Clone(b)
	as3[4] = 3
	binary.LittleEndian.PutUint32(as3[len(as3)-4:], crc32.Checksum(as3[:len(as3)-4], castagnoli))
	if err := restoreBytes(newFSM(t), as3); !errors.Is(err, ErrCorruptSnapshot) {
		t.Fatalf("tier records as format 3: %v", err)
	}
	// Clearing every lower tier takes the state back to format 3, which
	// a build without tiers installs.
	h := &harness{t: t, f: f, idx: f.AppliedIndex()}
	for _, k := range []struct {
		w    string
		rank uint32
		tier router.Tier
	}{{"vllm-0", 1, router.TierHost}, {"kvmock-1", 0, router.TierDisk}, {"vllm-0", 0, router.TierExternal}} {
		h.events(KVBatchEvent{Worker: k.w, DPRank: k.rank, Event: router.KVEvent{Kind: router.EventCleared, Tier: k.tier}})
	}
	snap := snapshotBytes(t, f)
	if snap[4] != 3 {
		t.Fatalf("without tiers: format %d", snap[4])
	}
	if err := restoreBytes(older, snap); err != nil || older.Digest() != f.Digest() {
		t.Fatalf("format 3 build restores the tierless state: %v", err)
	}
}

// TestFSMTiersOlderBuild: a build without tiers (newest type 11, format 3)
// applies the device batches of a tiered cluster alike, halts on the first
// type-12 entry without moving, and refuses the format 4 snapshot by
// version.
func TestFSMTiersOlderBuild(t *testing.T) {
	entries := [][]byte{
		mustEncode(t, RegisterWorker{ID: "w", DPRanks: 1, Model: "m", BlockSize: 16}),
		mustEncode(t, KVEventBatch{Events: []KVBatchEvent{stored("w", 0, 1, 1, 2)}}),
		mustEncode(t, KVEventBatch{Events: []KVBatchEvent{tiered(stored("w", 0, 2, 3), router.TierHost)}}),
	}
	older, newer := olderBuildHalts(t, entries, 2, CmdRegisterWorkerBlockSize, 3, CmdKVEventBatchTiered)
	if newer.Index().TierHeld("w", router.TierHost) != 1 {
		t.Fatal("newer build did not apply the tiered batch")
	}
	if err := restoreBytes(older, snapshotBytes(t, newer)); !errors.Is(err, ErrCorruptSnapshot) {
		t.Fatalf("older build restores format 4: %v", err)
	}
}
