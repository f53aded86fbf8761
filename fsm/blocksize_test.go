package fsm

import (
	"bytes"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/router"
)

// Per-model block sizes (issue 14 item 1): a model's block size is the one
// its registered workers declared; models without one keep the cluster
// default (16 here).

// prompt is the token ids every test model caches: the same tokens hash to
// different blocks at different block sizes.
var prompt = func() []uint32 {
	out := make([]uint32, 128)
	for i := range out {
		out[i] = uint32(1000 + 7*i)
	}
	return out
}()

// promptBlocks is the prompt's sequence hashes at blockSize.
func promptBlocks(blockSize int) []uint64 { return router.SequenceHashes(prompt, blockSize, "") }

// modelWorker registers id for model at blockSize (0 = unstated), with its
// own block size when own.
func modelWorker(id, model string, ranks uint32, blockSize int, own bool) RegisterWorker {
	return RegisterWorker{ID: id, DPRanks: ranks, Address: id + ":8000", Model: model, BlockSize: blockSize,
		TotalBlocks: 1000, MaxBatchedTokens: 4096, OwnBlockSize: own}
}

// storedAt is a stored event of blocks hashed at blockSize, declaring it.
func storedAt(worker string, rank uint32, id uint64, blockSize int, hashes ...uint64) KVBatchEvent {
	e := stored(worker, rank, id, hashes...)
	e.Event.BlockSize = blockSize
	return e
}

func TestFSMModelBlockSizes(t *testing.T) {
	p16, p32 := promptBlocks(16), promptBlocks(32)
	if len(p16) != 8 || len(p32) != 4 {
		t.Fatalf("prompt blocks %d at 16, %d at 32", len(p16), len(p32))
	}
	for _, h := range p32 {
		if slices.Contains(p16, h) {
			t.Fatal("a 32-token block hashes like a 16-token block")
		}
	}
	type step struct {
		cmd     Command
		err     error // domain error of the entry
		applied int   // KV batches: events applied
	}
	cases := []struct {
		name    string
		steps   []step
		sizes   map[string]int                  // ModelBlockSize
		matches map[int]map[router.WorkerID]int // block size of the lookup → overlaps
	}{
		{"two models, 16 and 32", []step{
			{cmd: modelWorker("a1", "A", 1, 16, false)},
			{cmd: modelWorker("a2", "A", 1, 0, false)},
			{cmd: modelWorker("b1", "B", 2, 32, true)},
			{cmd: KVEventBatch{Events: []KVBatchEvent{
				storedAt("a1", 0, 1, 16, p16...),
				storedAt("a2", 0, 1, 0, p16[:3]...),
				storedAt("b1", 0, 1, 32, p32...),
				storedAt("b1", 1, 1, 32, p32[:1]...),
			}}, applied: 4},
		}, map[string]int{"A": 16, "B": 32, "C": 16},
			map[int]map[router.WorkerID]int{16: {"a1": 8, "a2": 3}, 32: {"b1": 4, "b1#1": 1}}},
		{"an event at another size than its worker's is rejected", []step{
			{cmd: modelWorker("a1", "A", 1, 0, false)},
			{cmd: modelWorker("b1", "B", 1, 32, true)},
			{cmd: KVEventBatch{Events: []KVBatchEvent{
				storedAt("b1", 0, 1, 16, p16...),
				storedAt("a1", 0, 1, 32, p32...),
				storedAt("b1", 0, 2, 32, p32[:2]...),
			}}, applied: 1},
		}, map[string]int{"A": 16, "B": 32},
			map[int]map[router.WorkerID]int{16: {}, 32: {"b1": 2}}},
		{"a third worker of A at 32 is refused", []step{
			{cmd: modelWorker("a1", "A", 1, 0, false)},
			{cmd: modelWorker("a2", "A", 1, 16, false)},
			{cmd: modelWorker("a3", "A", 1, 32, true), err: ErrBlockSizeMismatch},
			{cmd: modelWorker("b1", "B", 1, 32, true)},
			{cmd: modelWorker("b2", "B", 1, 0, false), err: ErrBlockSizeMismatch},
			{cmd: modelWorker("b3", "B", 1, 16, true), err: ErrBlockSizeMismatch},
		}, map[string]int{"A": 16, "B": 32}, nil},
		{"another size without OwnBlockSize is refused, as by older builds", []step{
			{cmd: modelWorker("b1", "B", 1, 32, false), err: ErrBlockSizeMismatch},
		}, map[string]int{"B": 16}, nil},
		{"the default size with OwnBlockSize is accepted", []step{
			{cmd: modelWorker("a1", "A", 1, 16, true)},
			{cmd: modelWorker("a2", "A", 1, 0, true)},
			{cmd: modelWorker("a3", "A", 1, 0, false)},
		}, map[string]int{"A": 16}, nil},
		{"all of A's workers leave, A comes back at 32", []step{
			{cmd: modelWorker("a1", "A", 1, 0, false)},
			{cmd: func() Command { c := modelWorker("a2", "A", 1, 0, false); c.LeaseUntil = 5_000; return c }()},
			{cmd: KVEventBatch{Events: []KVBatchEvent{storedAt("a1", 0, 1, 16, p16...), storedAt("a2", 0, 1, 16, p16...)}}, applied: 2},
			{cmd: DeregisterWorker{ID: "a1"}},
			{cmd: modelWorker("a3", "A", 1, 32, true), err: ErrBlockSizeMismatch}, // a2 is still there
			{cmd: Tick{Now: 4_000}},
			{cmd: Tick{Now: 6_000}}, // a2's lease expires
			{cmd: modelWorker("a3", "A", 1, 32, true)},
			{cmd: modelWorker("a1", "A", 1, 0, false), err: ErrBlockSizeMismatch},
			{cmd: KVEventBatch{Events: []KVBatchEvent{storedAt("a3", 0, 1, 32, p32...)}}, applied: 1},
		}, map[string]int{"A": 32}, map[int]map[router.WorkerID]int{16: {}, 32: {"a3": 4}}},
		{"a model's sole worker changes its size and starts afresh", []step{
			{cmd: modelWorker("a1", "A", 2, 0, false)},
			{cmd: KVEventBatch{Events: []KVBatchEvent{storedAt("a1", 0, 1, 16, p16...), storedAt("a1", 1, 1, 16, p16...)}}, applied: 2},
			{cmd: Predictions{Worker: "a1#1", Hashes: p16[:2], Until: 100}},
			{cmd: modelWorker("a1", "A", 2, 32, true)},
			// Cursors start again: event 1 is no duplicate.
			{cmd: KVEventBatch{Events: []KVBatchEvent{storedAt("a1", 1, 1, 32, p32...), storedAt("a1", 0, 2, 16, p16...)}}, applied: 1},
		}, map[string]int{"A": 32}, map[int]map[router.WorkerID]int{16: {}, 32: {"a1#1": 4}}},
		{"a worker cannot move to a model of another size", []step{
			{cmd: modelWorker("a1", "A", 1, 0, false)},
			{cmd: modelWorker("b1", "B", 1, 32, true)},
			{cmd: modelWorker("a1", "B", 1, 0, false), err: ErrBlockSizeMismatch},
			{cmd: modelWorker("a1", "B", 1, 32, true)}, // its blocks were hashed at 16: gone
		}, map[string]int{"A": 16, "B": 32}, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			for i, s := range tc.steps {
				before := h.f.Digest()
				r := h.apply(s.cmd)
				if !errors.Is(r.Err, s.err) || (s.err == nil) != (r.Err == nil) {
					t.Fatalf("step %d %T: err %v, want %v", i, s.cmd, r.Err, s.err)
				}
				if r.Err != nil && h.f.Digest() != before {
					t.Fatalf("step %d: a refused command changed the state", i)
				}
				if _, ok := s.cmd.(KVEventBatch); ok && r.Applied != s.applied {
					t.Fatalf("step %d: applied %d events, want %d: %+v", i, r.Applied, s.applied, r)
				}
			}
			for m, want := range tc.sizes {
				if got := h.f.ModelBlockSize(m); got != want {
					t.Errorf("model %s block size %d, want %d", m, got, want)
				}
				if got := h.f.ModelConfig(m).BlockSize; got != want {
					t.Errorf("model %s config block size %d, want %d", m, got, want)
				}
				if cfg, err := h.f.CheckModelConfig(SetModelConfig{Model: m}); err != nil || cfg.BlockSize != want {
					t.Errorf("model %s checked config block size %d (%v), want %d", m, cfg.BlockSize, err, want)
				}
			}
			for _, w := range h.f.Workers() {
				if w.BlockSize != h.f.ModelBlockSize(w.Model) {
					t.Errorf("worker %s block size %d, its model %s %d", w.ID, w.BlockSize, w.Model, h.f.ModelBlockSize(w.Model))
				}
				for _, k := range w.Keys() {
					if bs, ok := h.f.Index().WorkerBlockSize(k); !ok || bs != w.BlockSize {
						t.Errorf("index: %s block size %d %v, want %d", k, bs, ok, w.BlockSize)
					}
				}
			}
			for size, want := range tc.matches {
				got := map[router.WorkerID]int{}
				for _, o := range h.f.Index().FindMatches(promptBlocks(size), nil) {
					got[o.Worker] = o.Blocks
				}
				if !maps.Equal(got, want) {
					t.Errorf("matches at block size %d: %v, want %v", size, got, want)
				}
			}
			// Every state here snapshots and restores to itself.
			b := newFSM(t)
			if err := restoreBytes(b, snapshotBytes(t, h.f)); err != nil {
				t.Fatal(err)
			}
			sameState(t, h.f, b)
			for m := range tc.sizes {
				if b.ModelBlockSize(m) != h.f.ModelBlockSize(m) {
					t.Fatalf("restored model %s block size %d", m, b.ModelBlockSize(m))
				}
			}
		})
	}
}

// TestFSMBlockSizeMismatchNamesBoth: the refusal says which sizes collide.
func TestFSMBlockSizeMismatchNamesBoth(t *testing.T) {
	h := newHarness(t)
	h.ok(modelWorker("a1", "A", 1, 0, false))
	r := h.apply(modelWorker("a3", "A", 1, 32, true))
	if !errors.Is(r.Err, ErrBlockSizeMismatch) || !strings.Contains(r.Err.Error(), "block size 32, model \"A\" uses 16") {
		t.Fatalf("err %v", r.Err)
	}
	r = h.apply(modelWorker("b1", "B", 1, 32, false))
	if !errors.Is(r.Err, ErrBlockSizeMismatch) || !strings.Contains(r.Err.Error(), "block size 32, cluster default 16") {
		t.Fatalf("err %v", r.Err)
	}
}

// TestFSMCheckRegisterWorker: proposers get the registration as it must be
// encoded (OwnBlockSize exactly when the size is not the default, so a
// default registration keeps its old bytes) or Apply's domain error.
func TestFSMCheckRegisterWorker(t *testing.T) {
	h := newHarness(t)
	h.ok(modelWorker("b1", "B", 1, 32, true))
	for _, tc := range []struct {
		cmd  RegisterWorker
		typ  CommandType
		err  error
		desc string
	}{
		{modelWorker("a1", "A", 1, 0, false), CmdRegisterWorker, nil, "unstated"},
		{modelWorker("a1", "A", 1, 16, true), CmdRegisterWorker, nil, "the default, own set by mistake"},
		{func() RegisterWorker {
			c := modelWorker("a1", "A", 1, 16, false)
			c.Role = router.RolePrefill
			return c
		}(), CmdRegisterWorkerRole, nil, "default with a role"},
		{modelWorker("c1", "C", 1, 32, false), CmdRegisterWorkerBlockSize, nil, "another size"},
		{modelWorker("b2", "B", 1, 32, false), CmdRegisterWorkerBlockSize, nil, "the model's size"},
		{modelWorker("b2", "B", 1, 16, false), 0, ErrBlockSizeMismatch, "not the model's size"},
		{modelWorker("b2", "B", 1, 0, false), 0, ErrBlockSizeMismatch, "unstated, model at 32"},
		{modelWorker("b1", "B", 1, 64, false), CmdRegisterWorkerBlockSize, nil, "the model's sole worker"},
		{modelWorker("", "B", 1, 32, false), 0, ErrInvalidCommand, "invalid"},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			c, err := h.f.CheckRegisterWorker(tc.cmd)
			if !errors.Is(err, tc.err) || (tc.err == nil) != (err == nil) {
				t.Fatalf("err %v, want %v", err, tc.err)
			}
			if err != nil {
				return
			}
			if c.Type() != tc.typ {
				t.Fatalf("type %s, want %s", c.Type(), tc.typ)
			}
			if tc.typ != CmdRegisterWorkerBlockSize {
				// Byte for byte what builds before per-model sizes wrote.
				old := tc.cmd
				old.OwnBlockSize = false
				if !bytes.Equal(mustEncode(t, c), mustEncode(t, old)) {
					t.Fatal("a default registration changed its encoding")
				}
			}
			// What the check accepts, Apply accepts.
			g := newHarness(t)
			g.ok(modelWorker("b1", "B", 1, 32, true))
			g.ok(c)
		})
	}
}

// TestFSMBlockSizeOlderBuild: a build before per-model block sizes (it
// knows command types up to 10 and snapshot formats up to 2) halts on a
// registration with another block size, at that entry, where it would
// otherwise have refused it and diverged from the builds that accept it;
// registrations with the default apply alike on both builds; and it
// refuses a snapshot holding such a worker by its format version.
func TestFSMBlockSizeOlderBuild(t *testing.T) {
	p16, p32 := promptBlocks(16), promptBlocks(32)
	entries := [][]byte{
		mustEncode(t, modelWorker("a1", "A", 1, 16, false)),
		mustEncode(t, modelWorker("b0", "B", 1, 32, false)), // refused by both
		mustEncode(t, KVEventBatch{Events: []KVBatchEvent{storedAt("a1", 0, 1, 16, p16...)}}),
		mustEncode(t, modelWorker("b1", "B", 1, 32, true)),
		mustEncode(t, KVEventBatch{Events: []KVBatchEvent{storedAt("b1", 0, 1, 32, p32...)}}),
		mustEncode(t, Tick{Now: 5}),
	}
	older, newer := olderBuildHalts(t, entries, 3, CmdRegisterWorkerRole, 2, CmdRegisterWorkerBlockSize)
	before := older.Digest() // the halted build's, which a refused snapshot must not move
	if older.Stats().DomainErrors != 1 || newer.Stats().DomainErrors != 1 {
		t.Fatalf("the refused registration counted %d / %d domain errors", older.Stats().DomainErrors, newer.Stats().DomainErrors)
	}
	if newer.Halted() != nil || newer.AppliedIndex() != 6 || newer.ModelBlockSize("B") != 32 || newer.Index().Held("b1") != 4 {
		t.Fatalf("newer build: halted %v applied %d, B at %d holding %d", newer.Halted(), newer.AppliedIndex(), newer.ModelBlockSize("B"), newer.Index().Held("b1"))
	}

	// Its state travels as format 3, which the older build refuses by
	// version; relabelled format 2 (what the older build reads), the worker
	// of another size is refused as corrupt, never installed.
	snap := snapshotBytes(t, newer)
	if snap[4] != 3 {
		t.Fatalf("format %d", snap[4])
	}
	if err := restoreBytes(older, snap); !errors.Is(err, ErrCorruptSnapshot) || !strings.Contains(err.Error(), "format version 3, this build reads 1 to 2") {
		t.Fatalf("older build restores format 3: %v", err)
	}
	as2 := slices.Clone(snap)
	as2[4] = 2
	binary.LittleEndian.PutUint32(as2[len(as2)-4:], crc32.Checksum(as2[:len(as2)-4], castagnoli))
	for _, f := range []*FSM{older, newFSM(t)} {
		if err := restoreBytes(f, as2); !errors.Is(err, ErrCorruptSnapshot) || !strings.Contains(err.Error(), `worker "b1" block size 32`) {
			t.Fatalf("format 2 with a worker at 32: %v", err)
		}
	}
	if older.Halted() == nil || older.Digest() != before {
		t.Fatal("a refused snapshot changed the halted build")
	}
	// Once every worker of another size is gone the state is format 1
	// again, and the older build installs it and follows the log.
	gone := logsOf([][]byte{mustEncode(t, DeregisterWorker{ID: "b1"})}, 7)
	newer.ApplyBatch(gone)
	if snap := snapshotBytes(t, newer); snap[4] != 1 {
		t.Fatalf("format %d without workers of another size", snap[4])
	} else if err := restoreBytes(older, snap); err != nil || older.Halted() != nil || older.Digest() != newer.Digest() {
		t.Fatalf("older build restores format 1: %v (halted %v)", err, older.Halted())
	}
}

// TestFSMSnapshotBlockSizes: a state with a worker of another block size
// is written as format 3 and restores to the same digest; the digest does
// not depend on the format (it hashes version byte 1, as always); a format
// 3 snapshot whose workers of one model disagree is refused.
func TestFSMSnapshotBlockSizes(t *testing.T) {
	f := goldenStateBlockSizes(t)
	_, g := restoreSame(t, f, 3)
	var canon bytes.Buffer
	img := f.captureLocked()
	if err := writeImage(&canon, img, false); err != nil || canon.Bytes()[4] != digestVersion {
		t.Fatalf("digest form: version %d, %v", canon.Bytes()[4], err)
	}
	// The restored FSM goes on applying each model at its size.
	h := &harness{t: t, f: g, idx: g.AppliedIndex()}
	if r := h.events(storedAt("mistral-0", 0, 2, 32, promptBlocks(32)...)); r.Applied != 1 {
		t.Fatalf("%+v", r)
	}
	if r := h.apply(modelWorker("mistral-2", "mistral", 1, 16, false)); !errors.Is(r.Err, ErrBlockSizeMismatch) {
		t.Fatal("mistral accepted a 16-token worker after a restore")
	}

	// Workers of one model at two sizes: no build writes it; refused.
	bad := newFSM(t)
	rec := func(w RegisterWorker) rawRec {
		body, err := appendRegisterWorker(nil, &w)
		if err != nil {
			t.Fatal(err)
		}
		return rawRec{recWorker, body}
	}
	hdr := appendU64(nil, 0)
	hdr = binary.AppendUvarint(hdr, 16)
	hdr = binary.AppendVarint(hdr, 0)
	for _, n := range []uint64{0, 2, 0, 2, 0, 0} {
		hdr = binary.AppendUvarint(hdr, n)
	}
	cursor := func(id string) rawRec { return rawRec{recCursor, append(appendString(nil, id), 0, 0, 0)} }
	twoSizes := rawSnapshot(rawRec{recHeader, hdr},
		rec(modelWorker("x1", "X", 1, 32, false)), rec(modelWorker("x2", "X", 1, 64, false)), cursor("x1"), cursor("x2"))
	if err := restoreBytes(bad, twoSizes); !errors.Is(err, ErrCorruptSnapshot) || !strings.Contains(err.Error(), "another worker of model") {
		t.Fatalf("two sizes in one model: %v", err)
	}
	oneSize := rawSnapshot(rawRec{recHeader, hdr},
		rec(modelWorker("x1", "X", 1, 32, false)), rec(modelWorker("x2", "X", 1, 32, false)), cursor("x1"), cursor("x2"))
	if err := restoreBytes(bad, oneSize); err != nil || bad.ModelBlockSize("X") != 32 {
		t.Fatalf("one size: %v, X at %d", err, bad.ModelBlockSize("X"))
	}
}
