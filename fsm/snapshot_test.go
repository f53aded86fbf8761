package fsm

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/router"
)

// goldenState builds the state pinned by testdata/snapshot-v1.bin: every
// record type, plain, aliased and dangling blocks, a stale and a resynced
// rank.
func goldenState(t testing.TB) *FSM {
	h := newHarness(t)
	h.ok(RegisterNode{NodeID: "r1", RaftAddr: "10.0.0.1:7000", HTTPAddr: "10.0.0.1:8001"})
	h.ok(RegisterNode{NodeID: "r2", RaftAddr: "10.0.0.2:7000", HTTPAddr: "10.0.0.2:8001"})
	h.ok(RegisterWorker{ID: "vllm-0", DPRanks: 2, Address: "10.0.1.1:8000", Model: "llama", TotalBlocks: 4096, MaxBatchedTokens: 8192, LeaseUntil: 9_000})
	h.ok(RegisterWorker{ID: "kvmock-1", DPRanks: 1, Address: "10.0.1.2:8000", Model: "llama", BlockSize: 16, TotalBlocks: 1024, MaxBatchedTokens: 2048})
	h.ok(goldenCommands()[3].cmd)
	h.ok(SetModelConfig{Model: "qwen", Thresholds: router.Thresholds{ActiveDecodeBlocks: ptr(0.5)}})
	h.events(
		KVBatchEvent{Worker: "vllm-0", EventID: 1, Event: router.KVEvent{Kind: router.EventStored, BlockSize: 16,
			Blocks: []router.StoredBlock{{EngineHash: 1001, ContentHash: 14643705804678351452}, {EngineHash: 1002, ContentHash: 4945711292740353085}}}},
		KVBatchEvent{Worker: "vllm-0", EventID: 2, Event: router.KVEvent{Kind: router.EventStored, HasParent: true, Parent: 1002,
			Blocks: []router.StoredBlock{{EngineHash: 1003, ContentHash: 12583592247330656132}}}},
		stored("vllm-0", 1, 1, 14643705804678351452),
		stored("vllm-0", 1, 3, 4945711292740353085), // gap: rank 1 goes stale
		stored("kvmock-1", 0, 1, 14643705804678351452, 4945711292740353085, 12583592247330656132),
		removed("kvmock-1", 0, 2, 12583592247330656132),
		removed("vllm-0", 0, 3, 12583592247330656132), // by content name: engine alias 1003 dangles
	)
	h.ok(ResyncWorker{Worker: "kvmock-1", DPRank: 0})
	h.events(stored("kvmock-1", 0, 0, 77)) // unsequenced: the resync baseline stays pending
	h.ok(Tick{Now: 1_000})
	h.ok(Predictions{Worker: "vllm-0#1", Hashes: []uint64{5, 6, 7}, Until: 121_000})
	h.ok(Predictions{Worker: "kvmock-1", Hashes: []uint64{5}, Until: 60_000})
	return h.f
}

// goldenStateRoles is goldenState plus workers of every role, with blocks:
// the state pinned by testdata/snapshot-v2.bin (and, as the build before
// snapshot format 2 wrote it, testdata/snapshot-v1-roles.bin).
func goldenStateRoles(t testing.TB) *FSM {
	f := goldenState(t)
	h := &harness{t: t, f: f, idx: f.AppliedIndex()}
	h.ok(RegisterWorker{ID: "prefill-0", DPRanks: 1, Address: "10.0.2.1:8000", Model: "llama", TotalBlocks: 2048, MaxBatchedTokens: 16384, Role: router.RolePrefill})
	h.ok(RegisterWorker{ID: "decode-0", DPRanks: 2, Address: "10.0.2.2:8000", Model: "llama", TotalBlocks: 8192, MaxBatchedTokens: 4096, LeaseUntil: 9_000, Role: router.RoleDecode})
	h.ok(RegisterWorker{ID: "both-0", DPRanks: 1, Address: "10.0.2.3:8000", Model: "qwen", BlockSize: 16, TotalBlocks: 512, Role: router.RoleBoth})
	h.events(
		stored("prefill-0", 0, 1, 14643705804678351452, 4945711292740353085),
		stored("decode-0", 1, 1, 14643705804678351452),
		stored("both-0", 0, 1, 77),
	)
	return h.f
}

// goldenStateBlockSizes is goldenStateRoles plus a model whose workers
// have their own block size (32, the cluster default being 16), one with
// a role, with blocks: the state pinned by testdata/snapshot-v3.bin.
func goldenStateBlockSizes(t testing.TB) *FSM {
	f := goldenStateRoles(t)
	h := &harness{t: t, f: f, idx: f.AppliedIndex()}
	h.ok(RegisterWorker{ID: "mistral-0", DPRanks: 1, Address: "10.0.3.1:8000", Model: "mistral", BlockSize: 32, TotalBlocks: 1024,
		MaxBatchedTokens: 8192, OwnBlockSize: true})
	h.ok(RegisterWorker{ID: "mistral-1", DPRanks: 2, Address: "10.0.3.2:8000", Model: "mistral", BlockSize: 32, TotalBlocks: 2048,
		LeaseUntil: 9_000, Role: router.RoleDecode, OwnBlockSize: true})
	p32 := router.SequenceHashes([]uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24,
		25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55,
		56, 57, 58, 59, 60, 61, 62, 63, 64}, 32, "")
	ev := func(w string, rank uint32, hashes ...uint64) KVBatchEvent {
		e := stored(w, rank, 1, hashes...)
		e.Event.BlockSize = 32
		return e
	}
	if r := h.events(ev("mistral-0", 0, p32...), ev("mistral-1", 1, p32[0])); r.Applied != 2 {
		t.Fatalf("mistral events: %+v", r)
	}
	return h.f
}

// richState is a larger random state, with a rank holding more blocks and
// predictions than fit one snapshot record.
func richState(t testing.TB, seed uint64, n int) (*FSM, uint64) {
	f := newFSM(t)
	logs := logsOf(newGen(seed).stream(t, n), 1)
	f.ApplyBatch(logs)
	idx := uint64(len(logs))
	big := make([]router.StoredBlock, snapshotChunk*2+100)
	preds := make([]uint64, snapshotChunk+5)
	rng := newRand(seed)
	for i := range big {
		h := rng.Uint64()
		big[i] = router.StoredBlock{EngineHash: h, ContentHash: h}
		if i%3 == 0 {
			big[i].EngineHash ^= 0xff
		}
	}
	for i := range preds {
		preds[i] = rng.Uint64()
	}
	extra := [][]byte{
		mustEncode(t, RegisterWorker{ID: "big", DPRanks: 2, Model: "m1"}),
		mustEncode(t, KVEventBatch{Events: []KVBatchEvent{{Worker: "big", DPRank: 1, EventID: 1, Event: router.KVEvent{Kind: router.EventStored, Blocks: big}}}}),
		mustEncode(t, Predictions{Worker: "big", Hashes: preds, Until: 1 << 62}),
	}
	f.ApplyBatch(logsOf(extra, idx+1))
	return f, idx + uint64(len(extra))
}

// restoreSame snapshots f, checks the snapshot is in format, restores it
// into a fresh FSM and checks that FSM holds the same state and snapshots
// to the same bytes; it returns the snapshot and the restored FSM.
func restoreSame(t *testing.T, f *FSM, format byte) ([]byte, *FSM) {
	t.Helper()
	b := snapshotBytes(t, f)
	if b[4] != format {
		t.Fatalf("format %d, want %d", b[4], format)
	}
	g := newFSM(t)
	if err := restoreBytes(g, b); err != nil {
		t.Fatal(err)
	}
	sameState(t, f, g)
	if !bytes.Equal(snapshotBytes(t, g), b) {
		t.Fatalf("a restored format %d snapshot snapshots differently", format)
	}
	return b, g
}

// sameState compares everything the read API shows.
func sameState(t *testing.T, a, b *FSM) {
	t.Helper()
	if a.Digest() != b.Digest() {
		t.Fatalf("digests differ: %s vs %s", a.Digest(), b.Digest())
	}
	for _, c := range []struct {
		name string
		x, y any
	}{
		{"workers", a.Workers(), b.Workers()},
		{"nodes", a.Nodes(), b.Nodes()},
		{"models", a.Models(), b.Models()},
		{"cursors", a.Cursors(), b.Cursors()},
		{"stale", a.Stale(), b.Stale()},
		{"clock", a.LastTick(), b.LastTick()},
		{"predictions", a.PredictionCount(), b.PredictionCount()},
		{"index workers", a.Index().Workers(), b.Index().Workers()},
		{"index len", a.Index().Len(), b.Index().Len()},
		{"predicted len", a.Predicted().Len(), b.Predicted().Len()},
		{"placements", a.Placements(), b.Placements()},
		{"placement groups", a.PlacementGroups(), b.PlacementGroups()},
		{"sessions", a.Sessions(), b.Sessions()},
	} {
		if !reflect.DeepEqual(c.x, c.y) {
			t.Fatalf("%s differ:\n%v\n%v", c.name, c.x, c.y)
		}
	}
	for _, m := range a.Models() {
		if !reflect.DeepEqual(a.ModelConfig(m), b.ModelConfig(m)) {
			t.Fatalf("model %s config differs", m)
		}
	}
	for _, w := range a.Index().Workers() {
		if !slices.Equal(a.Index().WorkerBlocks(w), b.Index().WorkerBlocks(w)) ||
			!slices.Equal(a.Predicted().WorkerBlocks(w), b.Predicted().WorkerBlocks(w)) {
			t.Fatalf("blocks of %s differ", w)
		}
		abs, _ := a.Index().WorkerBlockSize(w)
		bbs, _ := b.Index().WorkerBlockSize(w)
		pbs, _ := b.Predicted().WorkerBlockSize(w)
		if abs != bbs || bbs != pbs {
			t.Fatalf("%s block size %d vs %d (predicted %d)", w, abs, bbs, pbs)
		}
		if a.Index().Held(w) != b.Index().Held(w) {
			t.Fatalf("%s holds %d vs %d blocks", w, a.Index().Held(w), b.Index().Held(w))
		}
		// What routing sees: every listed content hash is held by the same workers.
		for _, blk := range a.Index().WorkerBlocks(w) {
			x := a.Index().FindMatches([]uint64{blk.ContentHash}, nil)
			y := b.Index().FindMatches([]uint64{blk.ContentHash}, nil)
			if !sameOverlaps(x, y) {
				t.Fatalf("holders of %d differ: %v vs %v", blk.ContentHash, x, y)
			}
		}
	}
}

func sameOverlaps(x, y []router.Overlap) bool {
	less := func(a, b router.Overlap) int { return strings.Compare(string(a.Worker), string(b.Worker)) }
	slices.SortFunc(x, less)
	slices.SortFunc(y, less)
	return slices.Equal(x, y)
}

// TestFSMSnapshotDanglingAliases: the router keeps an engine alias after
// its block is removed under another name, and the alias still satisfies
// parent checks. Snapshots and digests must carry it exactly.
func TestFSMSnapshotDanglingAliases(t *testing.T) {
	build := func(t *testing.T, evs ...KVBatchEvent) *FSM {
		h := newHarness(t)
		h.ok(worker("w", 1))
		h.events(evs...)
		return h.f
	}
	aliased := func(id uint64, pairs ...uint64) KVBatchEvent {
		e := KVBatchEvent{Worker: "w", EventID: id, Event: router.KVEvent{Kind: router.EventStored}}
		for i := 0; i < len(pairs); i += 2 {
			e.Event.Blocks = append(e.Event.Blocks, router.StoredBlock{EngineHash: pairs[i], ContentHash: pairs[i+1]})
		}
		return e
	}
	cases := []struct {
		name   string
		evs    []KVBatchEvent
		parent uint64 // a dangling engine name
	}{
		{"removed by content name", []KVBatchEvent{aliased(1, 100, 7, 101, 8), removed("w", 0, 2, 7)}, 100},
		{"two engine names", []KVBatchEvent{aliased(1, 100, 7, 200, 7), removed("w", 0, 2, 100)}, 200},
		{"two dangling names", []KVBatchEvent{aliased(1, 100, 7, 200, 7), removed("w", 0, 2, 7), stored("w", 0, 3, 9)}, 100},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := build(t, tc.evs...)
			b := newFSM(t)
			if err := restoreBytes(b, snapshotBytes(t, a)); err != nil {
				t.Fatal(err)
			}
			sameState(t, a, b)
			// The dangling alias still serves as a parent on both.
			next := mustEncode(t, KVEventBatch{Events: []KVBatchEvent{storedAfter("w", 0, 10, tc.parent, 55)}})
			ra := a.Apply(&raft.Log{Index: a.AppliedIndex() + 1, Type: raft.LogCommand, Data: next}).(*ApplyResult)
			rb := b.Apply(&raft.Log{Index: b.AppliedIndex() + 1, Type: raft.LogCommand, Data: next}).(*ApplyResult)
			if ra.Applied != 1 || rb.Applied != 1 {
				t.Fatalf("parent check: %+v vs %+v", ra, rb)
			}
			sameState(t, a, b)
			// A state without the alias must have another digest.
			plain := build(t, stored("w", 0, 1, 8))
			if tc.name == "removed by content name" && plain.Digest() == a.Digest() {
				t.Fatal("digest does not see the dangling alias")
			}
		})
	}
}

func TestFSMSnapshotRoundTrip(t *testing.T) {
	a, applied := richState(t, 5, 1500)
	snap := snapshotBytes(t, a)

	b := newFSM(t)
	overlaps := b.Overlaps()
	var changes []Change
	b.OnChange(func(c Change) { changes = append(changes, c) })
	if err := restoreBytes(b, snap); err != nil {
		t.Fatal(err)
	}
	sameState(t, a, b)
	if b.AppliedIndex() != applied {
		t.Fatalf("applied index %d, want %d", b.AppliedIndex(), applied)
	}
	if len(changes) != 1 || changes[0].Kind != ChangeRestored || changes[0].Index != applied {
		t.Fatalf("changes %+v", changes)
	}
	if b.Index().Held("big#1") != snapshotChunk*2+100 || b.PredictionCount() < snapshotChunk+5 {
		t.Fatal("chunked records lost blocks")
	}
	// A view taken before the restore reads the restored index.
	blocks := a.Index().WorkerBlocks("big#1")
	if m := overlaps.FindMatches([]uint64{blocks[0].ContentHash}, nil); len(m) == 0 {
		t.Fatal("Overlaps() does not follow the restore")
	}
	// Canonical: the restored state snapshots to the same bytes.
	if again := snapshotBytes(t, b); !bytes.Equal(again, snap) {
		t.Fatal("re-snapshot differs")
	}
	// Both continue identically.
	more := logsOf(newGen(99).stream(t, 500), applied+1)
	a.ApplyBatch(more)
	for _, l := range more {
		b.Apply(l)
	}
	sameState(t, a, b)
}

// TestFSMSnapshotIsConsistent: Persist writes the state as of Snapshot(),
// whatever was applied in between.
func TestFSMSnapshotIsConsistent(t *testing.T) {
	h := newHarness(t)
	h.ok(worker("w1", 1))
	h.events(stored("w1", 0, 1, 1, 2))
	want := h.f.Digest()
	snap, err := h.f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	h.events(stored("w1", 0, 2, 3))
	h.ok(worker("w2", 1))
	var sink memSink
	if err := snap.Persist(&sink); err != nil {
		t.Fatal(err)
	}
	snap.Release()
	f := newFSM(t)
	if err := restoreBytes(f, sink.Bytes()); err != nil {
		t.Fatal(err)
	}
	if f.Digest() != want {
		t.Fatal("snapshot saw later applies")
	}
}

type failSink struct {
	memSink
	n int
}

func (s *failSink) Write(p []byte) (int, error) {
	if s.n -= len(p); s.n < 0 {
		return 0, errors.New("disk full")
	}
	return s.memSink.Write(p)
}

func TestFSMPersistFailureCancels(t *testing.T) {
	f, _ := richState(t, 2, 300)
	snap, _ := f.Snapshot()
	sink := &failSink{n: 1000}
	if err := snap.Persist(sink); err == nil || !sink.cancelled || sink.closed {
		t.Fatalf("persist: %v cancelled=%v closed=%v", err, sink.cancelled, sink.closed)
	}
}

// TestFSMSnapshotCorrupt: every corruption is refused with
// ErrCorruptSnapshot and leaves the FSM exactly as it was.
func TestFSMSnapshotCorrupt(t *testing.T) {
	good := snapshotBytes(t, goldenState(t))
	target, _ := richState(t, 8, 300)
	wantDigest, wantApplied := target.Digest(), target.AppliedIndex()
	check := func(t *testing.T, name string, b []byte) {
		t.Helper()
		err := restoreBytes(target, b)
		if !errors.Is(err, ErrCorruptSnapshot) {
			t.Fatalf("%s: restore error %v", name, err)
		}
		if target.AppliedIndex() != wantApplied || target.Digest() != wantDigest {
			t.Fatalf("%s: refused restore changed the state", name)
		}
	}
	t.Run("bit flips", func(t *testing.T) {
		for i := range good {
			for _, bit := range []byte{0x01, 0x80} {
				b := slices.Clone(good)
				b[i] ^= bit
				check(t, fmt.Sprintf("flip %#x at %d", bit, i), b)
			}
		}
	})
	t.Run("truncations", func(t *testing.T) {
		for n := range len(good) {
			check(t, fmt.Sprintf("first %d bytes", n), good[:n])
		}
	})
	t.Run("framing", func(t *testing.T) {
		check(t, "trailing byte", append(slices.Clone(good), 0))
		check(t, "bad magic", append([]byte("KVRX"), good[4:]...))
		v3 := slices.Clone(good)
		v3[4] = SnapshotVersion + 1
		check(t, "unknown version", v3)
		v0 := slices.Clone(good)
		v0[4] = 0
		check(t, "version 0", v0)
	})
	// Well-framed snapshots (valid CRC) whose content breaks an invariant.
	img := func(mod func(*image)) []byte {
		f := goldenState(t)
		f.mu.RLock()
		im := f.captureLocked()
		f.mu.RUnlock()
		im.resolve()
		mod(im)
		var buf bytes.Buffer
		if err := writeImage(&buf, im, true); err != nil {
			t.Fatal(err)
		}
		return buf.Bytes()
	}
	cases := []struct {
		name string
		mod  func(*image)
	}{
		{"block size", func(im *image) { im.blockSize = 32 }},
		{"worker without ranks", func(im *image) { im.workers[0].DPRanks = 0 }},
		{"worker with other block size", func(im *image) { im.workers[0].BlockSize = 64 }},
		{"repeated worker", func(im *image) { im.workers = append(im.workers, im.workers[0]) }},
		{"repeated node", func(im *image) { im.nodes = append(im.nodes, im.nodes[0]) }},
		{"repeated model", func(im *image) { im.models = append(im.models, im.models[0]) }},
		{"invalid model config", func(im *image) { im.models[0].Thresholds.ActiveDecodeBlocks = ptr(3.0) }},
		{"cursor of unknown rank", func(im *image) { im.cursors[0].rank = 9 }},
		{"missing cursor", func(im *image) { im.cursors = im.cursors[1:] }},
		{"repeated cursor", func(im *image) { im.cursors = append(im.cursors, im.cursors[0]) }},
		{"blocks of unknown worker", func(im *image) { im.blocks[0].worker = "ghost" }},
		{"expired prediction", func(im *image) { im.preds[0].entries[0].until = im.lastTick }},
		{"repeated prediction", func(im *image) { im.preds[0].entries = append(im.preds[0].entries, im.preds[0].entries[0]) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { check(t, tc.name, img(tc.mod)) })
	}
	t.Run("records", func(t *testing.T) {
		header := func(nodes int) rawRec {
			b := appendU64(nil, 7)
			b = append(b, 16, 0) // block size, clock
			return rawRec{recHeader, append(b, byte(nodes), 0, 0, 0, 0, 0)}
		}
		node := func(id string) rawRec {
			return rawRec{recNode, appendString(appendString(appendString(nil, id), ""), "")}
		}
		if err := restoreBytes(newFSM(t), rawSnapshot(header(1), node("a"))); err != nil {
			t.Fatalf("the well-formed base case fails: %v", err)
		}
		for name, recs := range map[string][]rawRec{
			"no header":          {node("a")},
			"nothing":            {},
			"two headers":        {header(0), header(0)},
			"count too high":     {header(2), node("a")},
			"count too low":      {header(1), node("a"), node("b")},
			"out of order":       {header(0), {recWorker, nil}, node("a")},
			"unknown type":       {header(0), {recMaxType + 1, nil}},
			"short body":         {header(1), {recNode, []byte{5, 'a'}}},
			"long body":          {header(1), {recNode, append(node("a").body, 0)}},
			"empty node id":      {header(1), node("")},
			"end with a body":    {header(0), {recEnd, []byte{1}}},
			"huge record length": {header(0), {recNode, make([]byte, maxRecordLen+1)}},
		} {
			check(t, name, rawSnapshot(recs...))
		}
	})
	t.Run("other block size", func(t *testing.T) {
		cfg := router.DefaultConfig()
		cfg.BlockSize = 32
		f, err := NewFSM(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if err := restoreBytes(f, good); !errors.Is(err, ErrCorruptSnapshot) {
			t.Fatalf("restore into a block-size-32 FSM: %v", err)
		}
	})
}

// goldenWriters are the golden snapshots this build writes, with the state
// each pins: format 1 for a state without roles, 2 with them, 3 with a
// worker whose block size is not the cluster default, 4 with lower-tier
// blocks, 5 with worker placements, 6 with drained workers. Files not
// listed (testdata/snapshot-v1-roles.bin) were written by older builds.
var goldenWriters = map[string]func(testing.TB) *FSM{
	"snapshot-v1.bin": goldenState,
	"snapshot-v2.bin": goldenStateRoles,
	"snapshot-v3.bin": goldenStateBlockSizes,
	"snapshot-v4.bin": goldenStateTiers,
	"snapshot-v5.bin": goldenStatePlacements,
	"snapshot-v6.bin": goldenStateDrains,
	"snapshot-v7.bin": goldenStateSessions,
	"snapshot-v8.bin": goldenStatePins,
	"snapshot-v9.bin": goldenStateSessionStages,
}

// TestFSMGoldenSnapshots restores every committed snapshot, of every format
// version, forever, and checks the digest of the state it holds.
// go test ./fsm -run TestFSMGoldenSnapshots -update writes the files of
// goldenWriters that do not exist yet (a new format version adds a file,
// never replaces one).
func TestFSMGoldenSnapshots(t *testing.T) {
	if *update {
		for name, build := range goldenWriters {
			path := filepath.Join("testdata", name)
			if _, err := os.Stat(path); err == nil {
				continue
			}
			f := build(t)
			if err := os.WriteFile(path, snapshotBytes(t, f), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(strings.TrimSuffix(path, ".bin")+".digest", []byte(f.Digest()+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			t.Logf("wrote %s", path)
		}
	}
	files, err := filepath.Glob(filepath.Join("testdata", "snapshot-v*.bin"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no golden snapshots (%v): run with -update and commit testdata/", err)
	}
	for name := range goldenWriters {
		if !slices.Contains(files, filepath.Join("testdata", name)) {
			t.Errorf("%s missing: run with -update and commit testdata/", name)
		}
	}
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			b, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			d, err := os.ReadFile(strings.TrimSuffix(file, ".bin") + ".digest")
			if err != nil {
				t.Fatal(err)
			}
			want := strings.TrimSpace(string(d))
			f := newFSM(t)
			if err := restoreBytes(f, b); err != nil {
				t.Fatal(err)
			}
			if got := f.Digest(); got != want {
				t.Fatalf("digest %s, want %s", got, want)
			}
			build, current := goldenWriters[filepath.Base(file)]
			if !current {
				return
			}
			// A format this build writes: the commands still build this
			// state, and it still snapshots to these bytes.
			if !bytes.Equal(snapshotBytes(t, f), b) {
				t.Fatal("re-snapshot of the golden state differs from the golden bytes")
			}
			g := build(t)
			if g.Digest() != want {
				t.Fatal("the golden commands now build another state")
			}
			if g.AppliedIndex() != f.AppliedIndex() || len(f.Stale()) != 1 || f.PredictionCount() != 4 {
				t.Fatalf("restored applied %d stale %v predictions %d", f.AppliedIndex(), f.Stale(), f.PredictionCount())
			}
		})
	}
}

// TestFSMSnapshotVersions: a state without roles is written as format 1
// (every older build installs it), one with a role as format 2 (builds
// that read only format 1 refuse it by its version). The roles the builds
// before format 2 wrote into format 1 still restore, to the same state and
// digest as format 2 holds.
func TestFSMSnapshotVersions(t *testing.T) {
	plain, roles := snapshotBytes(t, goldenState(t)), snapshotBytes(t, goldenStateRoles(t))
	if plain[4] != 1 || roles[4] != 2 {
		t.Fatalf("format versions written: %d without roles, %d with", plain[4], roles[4])
	}
	old, err := os.ReadFile(filepath.Join("testdata", "snapshot-v1-roles.bin"))
	if err != nil {
		t.Fatal(err)
	}
	if old[4] != 1 {
		t.Fatalf("snapshot-v1-roles.bin is format %d", old[4])
	}
	f := newFSM(t)
	if err := restoreBytes(f, old); err != nil {
		t.Fatal(err)
	}
	want := goldenStateRoles(t)
	sameState(t, want, f)
	if !bytes.Equal(snapshotBytes(t, f), roles) {
		t.Fatal("a restored format-1 snapshot with roles does not snapshot as format 2")
	}
	// The digest does not depend on the format: the older build's digest of
	// this state is the one this build computes.
	d, err := os.ReadFile(filepath.Join("testdata", "snapshot-v1-roles.digest"))
	if err != nil {
		t.Fatal(err)
	}
	if got := want.Digest(); got != strings.TrimSpace(string(d)) {
		t.Fatalf("digest %s, the build before format 2 computed %s", got, d)
	}
	// A version this build does not know is refused by its version.
	next := slices.Clone(roles)
	next[4] = SnapshotVersion + 1
	if err := restoreBytes(newFSM(t), next); !errors.Is(err, ErrCorruptSnapshot) || !strings.Contains(err.Error(), fmt.Sprint("format version ", SnapshotVersion+1)) {
		t.Fatalf("format %d: %v", SnapshotVersion+1, err)
	}
}

// TestFSMRandomStreamsConverge feeds the same random command stream to FSMs
// applying it one entry at a time, in random batches, and through repeated
// snapshot/restore into fresh FSMs: all end (and meet) with equal digests.
func TestFSMRandomStreamsConverge(t *testing.T) {
	seeds := []uint64{1, 2, 3, 4, 5, 6}
	if testing.Short() {
		seeds = seeds[:2]
	}
	var finals []string
	for _, seed := range seeds {
		t.Run(fmt.Sprint("seed=", seed), func(t *testing.T) {
			logs := logsOf(newGen(seed).stream(t, 2500), 1)
			rng := newRand(seed + 100)
			one, batched, hopping := newFSM(t), newFSM(t), newFSM(t)
			for i := 0; i < len(logs); {
				n := 1 + rng.IntN(64)
				end := min(i+n, len(logs))
				for _, l := range logs[i:end] {
					one.Apply(l)
				}
				batched.ApplyBatch(logs[i:end])
				hopping.ApplyBatch(logs[i:end])
				if rng.IntN(8) == 0 {
					fresh := newFSM(t)
					if err := restoreBytes(fresh, snapshotBytes(t, hopping)); err != nil {
						t.Fatal(err)
					}
					hopping = fresh
				}
				if one.Digest() != batched.Digest() || one.Digest() != hopping.Digest() {
					t.Fatalf("diverged after entry %d", end)
				}
				i = end
			}
			sameState(t, one, batched)
			sameState(t, one, hopping)
			st := one.Stats()
			if st.Duplicates == 0 || st.Gaps == 0 || st.Rejected[RejectUnknownWorker] == 0 || st.Ignored == 0 ||
				st.Undecodable == 0 || st.DomainErrors == 0 || st.ExpiredPredictions == 0 {
				t.Fatalf("the stream misses paths: %+v", st)
			}
			finals = append(finals, one.Digest())
		})
	}
	slices.Sort(finals)
	if len(slices.Compact(finals)) != len(seeds) {
		t.Fatal("different streams ended with equal digests")
	}
}

type rawRec struct {
	typ  byte
	body []byte
}

// rawSnapshot frames records with a valid magic, version, end and CRC, to
// test what Restore checks beyond the CRC.
func rawSnapshot(recs ...rawRec) []byte {
	var buf bytes.Buffer
	w := &crcWriter{w: &buf}
	w.write([]byte(snapshotMagic))
	w.write([]byte{3}) // the records these tests write: format 3's header (no tier count)
	for _, r := range recs {
		w.buf = r.body
		w.record(r.typ)
	}
	w.buf = nil
	w.record(recEnd)
	var crc [4]byte
	crc[0], crc[1], crc[2], crc[3] = byte(w.crc), byte(w.crc>>8), byte(w.crc>>16), byte(w.crc>>24)
	buf.Write(crc[:])
	return buf.Bytes()
}

// TestFSMWorkerRoles: a registration's role is applied, replaced by a
// re-registration, kept by a snapshot, and an invalid one never encodes.
func TestFSMWorkerRoles(t *testing.T) {
	h := newHarness(t)
	h.ok(RegisterWorker{ID: "p", DPRanks: 1, Model: "m", Role: router.RolePrefill})
	h.ok(RegisterWorker{ID: "d", DPRanks: 2, Model: "m", Role: router.RoleDecode})
	h.ok(RegisterWorker{ID: "a", DPRanks: 1, Model: "m"})
	want := map[router.WorkerID]router.Role{"p": router.RolePrefill, "d": router.RoleDecode, "d#1": router.RoleDecode, "a": router.RoleBoth}
	check := func(f *FSM, want map[router.WorkerID]router.Role) {
		t.Helper()
		got := map[router.WorkerID]router.Role{}
		for _, w := range f.RoleWorkers("m") {
			got[w.ID] = w.Role
		}
		if !maps.Equal(got, want) {
			t.Fatalf("roles %v, want %v", got, want)
		}
	}
	check(h.f, want)

	b := newFSM(t)
	if err := restoreBytes(b, snapshotBytes(t, h.f)); err != nil {
		t.Fatal(err)
	}
	check(b, want)

	h.ok(RegisterWorker{ID: "p", DPRanks: 1, Model: "m", Role: router.RoleBoth})
	want["p"] = router.RoleBoth
	check(h.f, want)

	if _, err := Encode(RegisterWorker{ID: "x", DPRanks: 1, Model: "m", Role: "encoder"}); !errors.Is(err, ErrInvalidCommand) {
		t.Fatalf("bad role encoded: %v", err)
	}
	// A role entry with an unknown role never decodes.
	good, err := Encode(RegisterWorker{ID: "x", DPRanks: 1, Model: "m", Role: router.RoleDecode})
	if err != nil {
		t.Fatal(err)
	}
	bad := append(bytes.Clone(good[:len(good)-len("decode")-1]), byte(len("prefil")))
	bad = append(bad, "prefil"...)
	if _, err := Decode(bad); !errors.Is(err, ErrUndecodable) {
		t.Fatalf("unknown role decoded: %v", err)
	}
}
