package fsm

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/router"
)

// fuzzBase is the state every FuzzFSMApply input is applied to, so that
// fuzzed entries reach registered workers, cursors and predictions.
func fuzzBase(t testing.TB) *FSM {
	h := newHarness(t)
	h.ok(worker("w1", 2))
	h.ok(worker("w2", 1))
	h.events(stored("w1", 0, 1, 1, 2), storedAfter("w1", 0, 2, 2, 3), stored("w1", 1, 5, 1), stored("w2", 0, 1, 1))
	h.ok(Predictions{Worker: "w2", Hashes: []uint64{1, 2}, Until: 100})
	h.ok(SetModelConfig{Model: "m", Temperature: ptr(0.5)})
	h.ok(RegisterNode{NodeID: "n1", RaftAddr: "a", HTTPAddr: "b"})
	h.ok(PlaceWorker{Worker: "w1", Group: 1, Groups: 2})
	h.ok(SetWorkerDrain{Worker: "w2", Drained: true, Deadline: 50})
	h.ok(BindSession{Session: "s1", Worker: "w1#1", Until: 200})
	h.ok(BindSessionStages{Session: "s2", Prefill: "w2", Decode: "w1", Until: 220})
	h.ok(PinPrefix{Model: "m", Worker: "w1", Key: 2, Blocks: []uint64{1, 2}, TTL: sec, Until: 150})
	return h.f
}

// fuzzSeeds are valid entries of every type plus near misses.
func fuzzSeeds(t testing.TB) map[string][]byte {
	seeds := map[string][]byte{}
	for _, c := range goldenCommands() {
		seeds[c.name] = mustEncode(t, c.cmd)
	}
	seeds["batch-known-workers"] = mustEncode(t, KVEventBatch{Events: []KVBatchEvent{
		storedAfter("w1", 0, 3, 3, 4, 5), stored("w1", 1, 9, 2), removed("w2", 0, 2, 1), stored("w1", 0, 3, 4),
		{Worker: "w2", EventID: 3, Event: router.KVEvent{Kind: router.EventCleared}},
	}})
	seeds["tick-expires"] = mustEncode(t, Tick{Now: 100})
	seeds["resync-w1"] = mustEncode(t, ResyncWorker{Worker: "w1", DPRank: 1})
	seeds["deregister-w1"] = mustEncode(t, DeregisterWorker{ID: "w1"})
	seeds["place-w1-move"] = mustEncode(t, PlaceWorker{Worker: "w1", Group: 2, Groups: 2})
	seeds["place-w1-remove"] = mustEncode(t, PlaceWorker{Worker: "w1", Group: 1, Groups: 2, Remove: true})
	seeds["place-other-groups"] = mustEncode(t, PlaceWorker{Worker: "w2", Group: 1, Groups: 3})
	seeds["set-groups-raise"] = mustEncode(t, SetGroups{Groups: 3})
	seeds["set-groups-same"] = mustEncode(t, SetGroups{Groups: 2})
	seeds["set-groups-too-many"] = mustEncode(t, SetGroups{Groups: MaxDataGroups + 1})
	seeds["set-groups-one"] = mustEncode(t, SetGroups{Groups: 1})
	seeds["set-groups-checked-all"] = mustEncode(t, SetGroups{Groups: 3, Checked: []string{"n1"}})
	seeds["set-groups-checked-missing"] = mustEncode(t, SetGroups{Groups: 3, Checked: []string{"n0", "n2"}})
	seeds["drain-w1"] = mustEncode(t, SetWorkerDrain{Worker: "w1", Drained: true})
	seeds["undrain-w2"] = mustEncode(t, SetWorkerDrain{Worker: "w2"})
	seeds["complete-w2"] = mustEncode(t, SetWorkerDrain{Worker: "w2", Drained: true, Deregister: true})
	seeds["complete-w1-undrained"] = mustEncode(t, SetWorkerDrain{Worker: "w1", Drained: true, Deregister: true})
	seeds["drain-unknown"] = mustEncode(t, SetWorkerDrain{Worker: "zz", Drained: true, Deadline: 3})
	seeds["bind-s1-touch"] = mustEncode(t, BindSession{Session: "s1", Worker: "w1#1", Until: 300})
	seeds["bind-s1-lose"] = mustEncode(t, BindSession{Session: "s1", Worker: "w2", Until: 300})
	seeds["bind-s1-replace"] = mustEncode(t, BindSession{Session: "s1", Worker: "w2", Until: 300, Replace: "w1#1"})
	seeds["unbind-w1"] = mustEncode(t, UnbindSessions{Worker: "w1"})
	seeds["unbind-w2-prefill"] = mustEncode(t, UnbindSessions{Worker: "w2"})
	seeds["stages-s2-touch"] = mustEncode(t, BindSessionStages{Session: "s2", Prefill: "w2", Decode: "w1", Until: 300})
	seeds["stages-s2-lose"] = mustEncode(t, BindSessionStages{Session: "s2", Prefill: "w1#1", Decode: "w2", Until: 300})
	seeds["stages-s2-replace-prefill"] = mustEncode(t, BindSessionStages{Session: "s2", Prefill: "w1#1", Decode: "w1", Until: 300, SeenPrefill: "w2", SeenDecode: "w1"})
	seeds["stages-s1-add-prefill"] = mustEncode(t, BindSessionStages{Session: "s1", Prefill: "w2", Decode: "w1#1", Until: 300, SeenDecode: "w1#1"})
	seeds["bind-s2-one-stage"] = mustEncode(t, BindSession{Session: "s2", Worker: "w2", Until: 300, Replace: "w1"})
	seeds["tick-expires-session"] = mustEncode(t, Tick{Now: 250})
	seeds["pin-refresh"] = mustEncode(t, PinPrefix{Model: "m", Worker: "w1", Key: 2, TTL: sec, Until: 300})
	seeds["pin-supersede"] = mustEncode(t, PinPrefix{Model: "m", Worker: "w1", Key: 3, Blocks: []uint64{1, 2, 3}, TTL: sec, Until: 300})
	seeds["pin-move"] = mustEncode(t, PinPrefix{Model: "m", Worker: "w2", Key: 2, Blocks: []uint64{1, 2}, TTL: sec, Until: 300, Replace: "w1"})
	seeds["pin-expired"] = mustEncode(t, PinPrefix{Model: "m", Worker: "w2", Key: 2, Blocks: []uint64{1, 2}, TTL: sec, Until: 1})
	seeds["unpin-prefix"] = mustEncode(t, UnpinPrefix{Model: "m", Key: 2})
	seeds["unpin-w1"] = mustEncode(t, UnpinPrefix{Worker: "w1"})
	seeds["tick-expires-pin"] = mustEncode(t, Tick{Now: 160})
	seeds["bad-threshold"] = mustEncode(t, SetModelConfig{Model: "m", Thresholds: router.Thresholds{ActiveDecodeBlocks: ptr(2.0)}})
	seeds["unknown-ignored"] = []byte{77 | IgnoreIfUnknown, 1, 0}
	seeds["unknown"] = []byte{77, 1, 0}
	seeds["empty"] = []byte{}
	return seeds
}

// FuzzFSMApply: any bytes as a log entry never panic, two replicas applying
// them agree, undecodable bytes change nothing, the entry is idempotent,
// and the state survives a snapshot round trip.
func FuzzFSMApply(f *testing.F) {
	for _, s := range fuzzSeeds(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		a, b := fuzzBase(t), fuzzBase(t)
		before := a.Digest()
		idx := a.AppliedIndex() + 1
		ra := a.Apply(&raft.Log{Index: idx, Type: raft.LogCommand, Data: data})
		rb := b.ApplyBatch([]*raft.Log{{Index: idx, Type: raft.LogCommand, Data: data}})[0]
		res, ok := ra.(*ApplyResult)
		if !ok || !reflect.DeepEqual(errString(res.Err), errString(rb.(*ApplyResult).Err)) {
			t.Fatalf("responses %+v / %+v", ra, rb)
		}
		if a.Digest() != b.Digest() {
			t.Fatal("replicas diverged")
		}
		if a.Halted() != nil {
			// An unknown type: nothing applies any more, snapshots are refused.
			next := a.Apply(&raft.Log{Index: idx + 1, Type: raft.LogCommand, Data: mustEncode(t, Tick{Now: 1})}).(*ApplyResult)
			if !errors.Is(res.Err, ErrUnknownCommand) || !errors.Is(next.Err, ErrHalted) || a.Digest() != before || a.AppliedIndex() != idx-1 {
				t.Fatalf("halt: %v, then %v, applied %d", res.Err, next.Err, a.AppliedIndex())
			}
			if _, err := a.Snapshot(); !errors.Is(err, ErrHalted) {
				t.Fatalf("halted snapshot: %v", err)
			}
			return
		}
		if errors.Is(res.Err, ErrUndecodable) || errors.Is(res.Err, ErrUnknownCommand) || res.Ignored {
			if a.Digest() != before {
				t.Fatal("an undecodable or skipped entry changed the state")
			}
		}
		after := a.Digest()
		if r := a.Apply(&raft.Log{Index: idx, Type: raft.LogCommand, Data: data}).(*ApplyResult); !r.Replayed || a.Digest() != after {
			t.Fatal("re-applying the entry changed the state")
		}
		// The same bytes again as a new entry (a redelivery) keep replicas equal.
		a.Apply(&raft.Log{Index: idx + 1, Type: raft.LogCommand, Data: data})
		b.Apply(&raft.Log{Index: idx + 1, Type: raft.LogCommand, Data: data})
		if a.Digest() != b.Digest() {
			t.Fatal("replicas diverged on the second application")
		}
		c := newFSM(t)
		if err := restoreBytes(c, snapshotBytes(t, a)); err != nil {
			t.Fatal(err)
		}
		if c.Digest() != a.Digest() {
			t.Fatal("snapshot round trip changed the state")
		}
	})
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// FuzzDecodeKVBatch: any payload decodes or fails cleanly (no panic, no
// allocation from unchecked lengths), and whatever decodes re-encodes to a
// canonical form that decodes to the same events.
func FuzzDecodeKVBatch(f *testing.F) {
	for _, s := range kvSeeds(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, payload []byte) { checkKVBatchRoundTrip(t, CmdKVEventBatch, payload) })
}

// checkKVBatchRoundTrip decodes payload as an entry of type typ (3 or 12):
// it fails cleanly or re-encodes canonically, as type 12 exactly when an
// event is of a lower tier, to the same events.
func checkKVBatchRoundTrip(t *testing.T, typ CommandType, payload []byte) {
	entry := append([]byte{byte(typ), EnvelopeVersion}, payload...)
	evs, err := DecodeKVBatch(entry)
	if err != nil {
		if !errors.Is(err, ErrUndecodable) {
			t.Fatalf("error %v is not ErrUndecodable", err)
		}
		return
	}
	enc, err := AppendKVBatch(nil, evs)
	if err != nil {
		t.Fatalf("decoded events do not encode: %v", err)
	}
	if tiered := CommandType(enc[0]) == CmdKVEventBatchTiered; tiered != kvBatchTiered(evs) {
		t.Fatalf("encoded as type %d, lower-tier events %v", enc[0], kvBatchTiered(evs))
	}
	again, err := DecodeKVBatch(enc)
	if err != nil {
		t.Fatalf("re-encoded batch does not decode: %v", err)
	}
	if !reflect.DeepEqual(canonical(KVEventBatch{Events: again}), canonical(KVEventBatch{Events: evs})) {
		t.Fatal("round trip changed the events")
	}
	if enc2, _ := AppendKVBatch(nil, again); !bytes.Equal(enc, enc2) {
		t.Fatal("encoding is not canonical")
	}
}

// kvSeeds are KVEventBatch payloads (without the envelope).
func kvSeeds(t testing.TB) map[string][]byte {
	out := map[string][]byte{}
	for name, c := range map[string]KVEventBatch{
		"golden":  goldenCommands()[2].cmd.(KVEventBatch),
		"known":   {Events: []KVBatchEvent{storedAfter("w1", 0, 3, 3, 4, 5), removed("w2", 0, 2, 1)}},
		"empty":   {},
		"cleared": {Events: []KVBatchEvent{{Worker: "w", DPRank: 3, EventID: 1 << 40, Event: router.KVEvent{Kind: router.EventCleared, BlockSize: 16}}}},
	} {
		out[name] = mustEncode(t, c)[2:]
	}
	return out
}

// goldenCommand is the goldenCommands entry called name (by name: the
// list only grows, so positions other than the first move).
func goldenCommand(t testing.TB, name string) Command {
	for _, c := range goldenCommands() {
		if c.name == name {
			return c.cmd
		}
	}
	t.Fatalf("no golden command %q", name)
	return nil
}

// kvTieredSeeds are KVEventBatchTiered payloads (without the envelope).
func kvTieredSeeds(t testing.TB) map[string][]byte {
	host := stored("w1", 0, 3, 3, 4, 5)
	host.Event.Tier = router.TierHost
	out := map[string][]byte{}
	for name, c := range map[string]KVEventBatch{
		"golden": goldenCommand(t, "kv-event-batch-tiered").(KVEventBatch),
		"host":   {Events: []KVBatchEvent{host, removed("w2", 0, 2, 1)}},
	} {
		b := mustEncode(t, c)
		if CommandType(b[0]) != CmdKVEventBatchTiered {
			t.Fatalf("seed %s is type %d", name, b[0])
		}
		out[name] = b[2:]
	}
	return out
}

// FuzzDecodeKVBatchTiered is FuzzDecodeKVBatch for type 12: any payload
// decodes or fails cleanly, and what decodes re-encodes canonically (as
// type 3 when no event is of a lower tier) to the same events.
func FuzzDecodeKVBatchTiered(f *testing.F) {
	for _, s := range kvTieredSeeds(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, payload []byte) { checkKVBatchRoundTrip(t, CmdKVEventBatchTiered, payload) })
}

// setGroupsCheckedSeeds are SetGroupsChecked payloads (without the
// envelope), valid and near misses.
func setGroupsCheckedSeeds(t testing.TB) map[string][]byte {
	out := map[string][]byte{}
	for name, c := range map[string]SetGroups{
		"golden": goldenCommand(t, "set-groups-checked").(SetGroups),
		"one":    {Groups: 2, Checked: []string{"n1"}},
		"wide":   {Groups: 1 << 31, Checked: checkedIDs(40)},
	} {
		out[name] = mustEncode(t, c)[2:]
	}
	out["unsorted"] = []byte{3, 2, 1, 'b', 1, 'a'}
	out["empty"] = []byte{3, 0}
	return out
}

// FuzzDecodeSetGroupsChecked: any CmdSetGroupsChecked payload decodes or
// fails cleanly (ErrUndecodable, no allocation from unchecked counts), and
// what decodes is a well-formed list (sorted, unique, non-empty ids,
// bounded) that re-encodes canonically to the same command (the ids have
// one order; integers, as in every command, may arrive as over-long
// varints).
func FuzzDecodeSetGroupsChecked(f *testing.F) {
	for _, s := range setGroupsCheckedSeeds(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		entry := append([]byte{byte(CmdSetGroupsChecked), EnvelopeVersion}, payload...)
		c, err := DecodeSetGroups(entry)
		if err != nil {
			if !errors.Is(err, ErrUndecodable) {
				t.Fatalf("error %v is not ErrUndecodable", err)
			}
			return
		}
		if c.Checked == nil || c.Type() != CmdSetGroupsChecked {
			t.Fatalf("decoded %+v without its list", c)
		}
		if err := checkCheckedNodes(c.Checked); err != nil {
			t.Fatalf("decoded a malformed list: %v", err)
		}
		enc, err := Encode(c)
		if err != nil {
			t.Fatalf("decoded command does not encode: %v", err)
		}
		again, err := DecodeSetGroups(enc)
		if err != nil || !reflect.DeepEqual(again, c) {
			t.Fatalf("re-encoded %+v decodes to %+v, %v", c, again, err)
		}
		if enc2, _ := Encode(again); !bytes.Equal(enc, enc2) {
			t.Fatal("encoding is not canonical")
		}
	})
}

// TestFSMFuzzSeedCorpus keeps the committed seed corpora under
// testdata/fuzz/ in step with the seeds above (-update rewrites them).
func TestFSMFuzzSeedCorpus(t *testing.T) {
	for target, seeds := range map[string]map[string][]byte{
		"FuzzFSMApply":               fuzzSeeds(t),
		"FuzzDecodeKVBatch":          kvSeeds(t),
		"FuzzDecodeKVBatchTiered":    kvTieredSeeds(t),
		"FuzzDecodeSetGroupsChecked": setGroupsCheckedSeeds(t),
		"FuzzDecodeSetWorkerDrain":   setWorkerDrainSeeds(t),
		"FuzzDecodeSessionCommands":  sessionSeeds(t),
		"FuzzDecodePinCommands":      pinSeeds(t),
	} {
		dir := filepath.Join("testdata", "fuzz", target)
		if *update {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			for name, data := range seeds {
				body := fmt.Sprintf("go test fuzz v1\n[]byte(%s)\n", strconv.QuoteToASCII(string(data)))
				if err := os.WriteFile(filepath.Join(dir, "seed-"+name), []byte(body), 0o644); err != nil {
					t.Fatal(err)
				}
			}
		}
		for name := range seeds {
			b, err := os.ReadFile(filepath.Join(dir, "seed-"+name))
			if err != nil {
				t.Fatalf("%s: %v (run with -update and commit testdata/fuzz)", target, err)
			}
			if !strings.HasPrefix(string(b), "go test fuzz v1\n[]byte(") {
				t.Fatalf("%s/%s: not a corpus file", target, name)
			}
		}
	}
}

// FuzzFSMRestore feeds arbitrary bytes to Restore, as a corrupted or
// hostile snapshot file would: never a panic; a snapshot that restores is
// canonical (it snapshots again and restores into the same digest), and one
// that fails leaves an error, not a half-built state that snapshots.
func FuzzFSMRestore(f *testing.F) {
	good := snapshotBytes(f, goldenState(f))
	f.Add(good)
	f.Add(good[:len(good)/2])
	f.Add(append(bytes.Clone(good), 0))
	f.Add(snapshotBytes(f, goldenStateRoles(f)))         // format 2
	f.Add(snapshotBytes(f, goldenStateBlockSizes(f)))    // format 3
	f.Add(snapshotBytes(f, goldenStateTiers(f)))         // format 4
	f.Add(snapshotBytes(f, goldenStatePlacements(f)))    // format 5
	f.Add(snapshotBytes(f, goldenStateSessions(f)))      // format 7
	f.Add(snapshotBytes(f, goldenStatePins(f)))          // format 8
	f.Add(snapshotBytes(f, goldenStateSessionStages(f))) // format 9
	empty := snapshotBytes(f, newFSM(f))
	f.Add(empty)
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		a := newFSM(t)
		if err := restoreBytes(a, data); err != nil {
			return
		}
		again := snapshotBytes(t, a)
		b := newFSM(t)
		if err := restoreBytes(b, again); err != nil {
			t.Fatalf("a restored snapshot does not restore after a round trip: %v", err)
		}
		if a.Digest() != b.Digest() {
			t.Fatalf("digest changed across a snapshot round trip")
		}
	})
}

// FuzzDecodeResult: a forwarded Apply response is decoded from whatever the
// leader (or a man in the middle) sent, without panicking.
func FuzzDecodeResult(f *testing.F) {
	f.Add([]byte(`{}`))
	f.Add([]byte(`{"err":"unknown worker","kind":"unknown_worker"}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, raw []byte) {
		r, err := DecodeResult(nil, raw)
		if err == nil {
			_ = ResponseError(r)
		}
	})
}

// setWorkerDrainSeeds are SetWorkerDrain payloads (without the envelope),
// valid and near misses.
func setWorkerDrainSeeds(t testing.TB) map[string][]byte {
	out := map[string][]byte{}
	for _, name := range []string{"set-worker-drain", "set-worker-undrain", "set-worker-drain-deregister"} {
		out[name] = mustEncode(t, goldenCommand(t, name))[2:]
	}
	out["unknown-flag"] = []byte{1, 'w', 5, 0}
	out["deregister-undrained"] = []byte{1, 'w', 2, 0}
	out["negative-deadline"] = []byte{1, 'w', 1, 1}
	out["empty-id"] = []byte{0, 1, 0}
	return out
}

// FuzzDecodeSetWorkerDrain: any CmdSetWorkerDrain payload decodes or
// fails cleanly (ErrUndecodable); what decodes has a shape the encoder
// accepts (one encoding per meaning), and re-encodes to a command that
// decodes the same. An empty or rank id decodes (refused on apply).
func FuzzDecodeSetWorkerDrain(f *testing.F) {
	for _, s := range setWorkerDrainSeeds(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		entry := append([]byte{byte(CmdSetWorkerDrain), EnvelopeVersion}, payload...)
		c, err := DecodeSetWorkerDrain(entry)
		if err != nil {
			if !errors.Is(err, ErrUndecodable) {
				t.Fatalf("error %v is not ErrUndecodable", err)
			}
			return
		}
		if err := c.shape(); err != nil {
			t.Fatalf("decoded a malformed command %+v: %v", c, err)
		}
		if c.Validate() != nil {
			return // an empty or rank id: a domain error on apply
		}
		enc, err := Encode(c)
		if err != nil {
			t.Fatalf("decoded command does not encode: %v", err)
		}
		again, err := DecodeSetWorkerDrain(enc)
		if err != nil || again != c {
			t.Fatalf("re-encoded %+v decodes to %+v, %v", c, again, err)
		}
	})
}
