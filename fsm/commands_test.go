package fsm

import (
	"bufio"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/router"
)

// TestFSMCommandTypesPinned pins the numbers that live in the Raft log
// forever. Changing any of them breaks every existing log: add, never edit.
func TestFSMCommandTypesPinned(t *testing.T) {
	pinned := []struct {
		typ  CommandType
		num  uint8
		name string
	}{
		{CmdRegisterWorker, 1, "RegisterWorker"},
		{CmdDeregisterWorker, 2, "DeregisterWorker"},
		{CmdKVEventBatch, 3, "KVEventBatch"},
		{CmdSetModelConfig, 4, "SetModelConfig"},
		{CmdPredictions, 5, "Predictions"},
		{CmdTick, 6, "Tick"},
		{CmdRegisterNode, 7, "RegisterNode"},
		{CmdResyncWorker, 8, "ResyncWorker"},
		{CmdRemoveNode, 9, "RemoveNode"},
		{CmdRegisterWorkerRole, 10, "RegisterWorkerRole"},
		{CmdRegisterWorkerBlockSize, 11, "RegisterWorkerBlockSize"},
		{CmdKVEventBatchTiered, 12, "KVEventBatchTiered"},
		{CmdPlaceWorker, 13, "PlaceWorker"},
		{CmdSetGroups, 14, "SetGroups"},
		{CmdSetGroupsChecked, 15, "SetGroupsChecked"},
		{CmdSetWorkerDrain, 16, "SetWorkerDrain"},
		{CmdBindSession, 17, "BindSession"},
		{CmdUnbindSessions, 18, "UnbindSessions"},
		{CmdPinPrefix, 19, "PinPrefix"},
		{CmdUnpinPrefix, 20, "UnpinPrefix"},
		{CmdBindSessionStages, 21, "BindSessionStages"},
	}
	for _, p := range pinned {
		if uint8(p.typ) != p.num || p.typ.String() != p.name || !p.typ.known() {
			t.Errorf("%s = %d (%q), pinned %d", p.name, uint8(p.typ), p.typ.String(), p.num)
		}
	}
	isPinned := map[CommandType]bool{}
	for _, p := range pinned {
		isPinned[p.typ] = true
	}
	for _, typ := range knownTypes() {
		if !isPinned[typ] {
			t.Errorf("type %d is known but not pinned here: add it to the table", typ)
		}
	}
	if IgnoreIfUnknown != 0x80 || EnvelopeVersion != 1 || SnapshotVersion != 9 || SnapshotFormatSessionStages != 9 || SnapshotFormatPins != 8 || SnapshotFormatSessions != 7 || SnapshotFormatDrains != 6 {
		t.Errorf("ignore bit %#x, envelope %d, snapshot format %d", IgnoreIfUnknown, EnvelopeVersion, SnapshotVersion)
	}
	fields := []ModelField{FieldActiveDecodeBlocks, FieldActivePrefillTokens, FieldActivePrefillTokensFrac,
		FieldOverlapCredit, FieldPrefillLoadScale, FieldTemperature, FieldTrackPrefillTokens,
		FieldQueueThreshold, FieldQueuePolicy}
	for i, f := range fields {
		if f != 1<<i {
			t.Errorf("model field %d = %#x, pinned %#x", i, f, 1<<i)
		}
	}
	// Event kinds travel inside KVEventBatch.
	if router.EventStored != 1 || router.EventRemoved != 2 || router.EventCleared != 3 {
		t.Error("router event kinds renumbered")
	}
}

// knownTypes is every command type this build applies, read off the code
// (CommandType.known), not off a hand-kept list.
func knownTypes() []CommandType {
	var out []CommandType
	for b := range int(IgnoreIfUnknown) {
		if CommandType(b).known() {
			out = append(out, CommandType(b))
		}
	}
	return out
}

// TestFSMKnownTypesAgree: the three places a type must be added agree on
// which types exist (known, String, the payload decoder), so a type added
// to one of them and forgotten in another fails here, and knownTypes sees
// every type the decoder does.
func TestFSMKnownTypesAgree(t *testing.T) {
	for b := range 256 {
		typ := CommandType(b)
		named := !strings.HasPrefix(typ.String(), "CommandType(")
		_, err := decodePayload(typ, nil)
		decodes := !errors.Is(err, ErrUnknownCommand)
		if typ.known() != named || typ.known() != decodes {
			t.Errorf("type %d: known %v, named %v (%s), decoder knows it %v", b, typ.known(), named, typ, decodes)
		}
	}
}

// goldenCommands is one of each command, with every optional field used.
// Their encodings are pinned in testdata/commands-v1.golden.
func goldenCommands() []struct {
	name string
	cmd  Command
} {
	return []struct {
		name string
		cmd  Command
	}{
		{"register-worker", RegisterWorker{ID: "vllm-0", DPRanks: 2, Address: "10.0.0.7:8000", Model: "llama-3-8b",
			BlockSize: 16, TotalBlocks: 8192, MaxBatchedTokens: 8192, LeaseUntil: 1_700_000_000_000_000_000}},
		{"deregister-worker", DeregisterWorker{ID: "vllm-0"}},
		{"kv-event-batch", KVEventBatch{Events: []KVBatchEvent{
			{Worker: "vllm-0", DPRank: 0, EventID: 1, Event: router.KVEvent{Kind: router.EventStored, BlockSize: 16,
				Blocks: []router.StoredBlock{{EngineHash: 11, ContentHash: 14643705804678351452}, {EngineHash: 12, ContentHash: 4945711292740353085}}}},
			{Worker: "vllm-0", DPRank: 1, EventID: 7, Event: router.KVEvent{Kind: router.EventStored, HasParent: true, Parent: 99,
				Blocks: []router.StoredBlock{{EngineHash: 5, ContentHash: 5}}}},
			{Worker: "kvmock-1", DPRank: 0, EventID: 0, Event: router.KVEvent{Kind: router.EventRemoved, Removed: []uint64{11, 12}, BlockSize: 16}},
			{Worker: "vllm-0", DPRank: 0, EventID: 2, Event: router.KVEvent{Kind: router.EventCleared}},
		}}},
		{"set-model-config", SetModelConfig{Model: "llama-3-8b",
			Thresholds:    router.Thresholds{ActiveDecodeBlocks: ptr(0.85), ActivePrefillTokens: ptr(int64(10000)), ActivePrefillTokensFrac: ptr(1.5)},
			OverlapCredit: ptr(0.5), PrefillLoadScale: ptr(1.5), Temperature: ptr(0.25), TrackPrefillTokens: ptr(false),
			QueueThreshold: ptr(2.0), QueuePolicy: ptr(router.QueueWSPT), Reset: FieldTemperature}},
		{"predictions", Predictions{Worker: "vllm-0#1", Hashes: []uint64{14643705804678351452, 4945711292740353085}, Until: 1_700_000_120_000_000_000}},
		{"tick", Tick{Now: 1_700_000_001_000_000_000}},
		{"register-node", RegisterNode{NodeID: "r1", RaftAddr: "10.0.0.1:7000", HTTPAddr: "10.0.0.1:8001"}},
		{"resync-worker", ResyncWorker{Worker: "vllm-0", DPRank: 1}},
		{"remove-node", RemoveNode{NodeID: "r3"}},
		{"register-worker-role", RegisterWorker{ID: "p-0", DPRanks: 1, Address: "10.0.0.8:8000", Model: "llama-3-8b",
			BlockSize: 16, TotalBlocks: 4096, MaxBatchedTokens: 16384, LeaseUntil: 1_700_000_000_000_000_000, Role: router.RolePrefill}},
		{"register-worker-block-size", RegisterWorker{ID: "sglang-0", DPRanks: 2, Address: "10.0.0.9:30000", Model: "qwen3-8b",
			BlockSize: 1, TotalBlocks: 262144, MaxBatchedTokens: 16384, LeaseUntil: 1_700_000_000_000_000_000, OwnBlockSize: true}},
		{"register-worker-block-size-role", RegisterWorker{ID: "d-0", DPRanks: 1, Address: "10.0.0.10:8000", Model: "mistral-7b",
			BlockSize: 32, TotalBlocks: 2048, MaxBatchedTokens: 8192, Role: router.RoleDecode, OwnBlockSize: true}},
		{"kv-event-batch-tiered", KVEventBatch{Events: []KVBatchEvent{
			{Worker: "vllm-0", DPRank: 0, EventID: 3, Event: router.KVEvent{Kind: router.EventStored, BlockSize: 16,
				Blocks: []router.StoredBlock{{EngineHash: 13, ContentHash: 7}}}},
			{Worker: "vllm-0", DPRank: 0, EventID: 4, Event: router.KVEvent{Kind: router.EventStored, BlockSize: 16, Tier: router.TierHost,
				Blocks: []router.StoredBlock{{EngineHash: 11, ContentHash: 14643705804678351452}, {EngineHash: 12, ContentHash: 4945711292740353085}}}},
			{Worker: "vllm-0", DPRank: 1, EventID: 8, Event: router.KVEvent{Kind: router.EventRemoved, Tier: router.TierDisk, Removed: []uint64{5}}},
			{Worker: "vllm-0", DPRank: 0, EventID: 5, Event: router.KVEvent{Kind: router.EventCleared, Tier: router.TierExternal}},
		}}},
		{"place-worker", PlaceWorker{Worker: "vllm-0", Group: 2, Groups: 4}},
		{"place-worker-remove", PlaceWorker{Worker: "sglang-0", Group: 300, Groups: 300, Remove: true}},
		{"set-groups", SetGroups{Groups: 64}},
		{"set-groups-checked", SetGroups{Groups: 3, Checked: []string{"r1", "r2", "r3"}}},
		{"set-worker-drain", SetWorkerDrain{Worker: "vllm-0", Drained: true, Deadline: 1_700_000_300_000_000_000}},
		{"set-worker-undrain", SetWorkerDrain{Worker: "vllm-0"}},
		{"set-worker-drain-deregister", SetWorkerDrain{Worker: "vllm-0", Drained: true, Deregister: true}},
		{"bind-session", BindSession{Session: "research-run-42:researcher", Worker: "vllm-0#1", Parent: "research-run-42",
			Until: 1_700_000_300_000_000_000, Replace: "vllm-1"}},
		{"unbind-sessions", UnbindSessions{Session: "research-run-42:researcher"}},
		{"unbind-sessions-worker", UnbindSessions{Worker: "vllm-0"}},
		{"pin-prefix", PinPrefix{Model: "llama-3-8b", Worker: "vllm-0#1", Key: 4945711292740353085,
			Blocks: []uint64{14643705804678351452, 4945711292740353085}, TTL: 300_000_000_000, Until: 1_700_000_300_000_000_000, Replace: "vllm-1"}},
		{"pin-prefix-refresh", PinPrefix{Model: "llama-3-8b", Worker: "vllm-0#1", Key: 4945711292740353085, TTL: 300_000_000_000,
			Until: 1_700_000_300_000_000_000}},
		{"unpin-prefix", UnpinPrefix{Model: "llama-3-8b", Key: 4945711292740353085, Worker: "vllm-0"}},
		{"unpin-prefix-worker", UnpinPrefix{Worker: "vllm-0"}},
		{"bind-session-stages", BindSessionStages{Session: "research-run-42", Prefill: "vllm-p0", Decode: "vllm-d1#1",
			Parent: "research", Until: 1_700_000_300_000_000_000, SeenPrefill: "vllm-p2", SeenDecode: "vllm-d1#1"}},
	}
}

// TestFSMCommandGolden decodes the pinned encodings of every command and
// re-encodes them byte for byte: an encoding change is a log format change.
func TestFSMCommandGolden(t *testing.T) {
	path := filepath.Join("testdata", "commands-v1.golden")
	cmds := goldenCommands()
	if *update {
		var b strings.Builder
		b.WriteString("# name hex(entry): pinned encodings of envelope version 1; never edit, only add\n")
		for _, c := range cmds {
			fmt.Fprintf(&b, "%s %s\n", c.name, hex.EncodeToString(mustEncode(t, c.cmd)))
		}
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	fh, err := os.Open(path)
	if err != nil {
		t.Fatalf("%v (run with -update to create)", err)
	}
	defer fh.Close()
	golden := map[string][]byte{}
	sc := bufio.NewScanner(fh)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		name, h, _ := strings.Cut(line, " ")
		b, err := hex.DecodeString(h)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		golden[name] = b
	}
	// Every type this build knows has a pinned encoding: a new type without
	// one fails here, whether or not someone remembered goldenCommands.
	pinned := map[CommandType]bool{}
	for _, b := range golden {
		pinned[CommandType(b[0]&^IgnoreIfUnknown)] = true
	}
	for _, typ := range knownTypes() {
		if !pinned[typ] {
			t.Errorf("command type %d (%s) has no golden encoding: add one to goldenCommands, run with -update and commit", uint8(typ), typ)
		}
	}
	for _, c := range cmds {
		b, ok := golden[c.name]
		if !ok {
			t.Errorf("%s: no golden encoding (run with -update and commit)", c.name)
			continue
		}
		got, err := Decode(b)
		if err != nil {
			t.Errorf("%s: decode golden: %v", c.name, err)
			continue
		}
		if !reflect.DeepEqual(canonical(got), canonical(c.cmd)) {
			t.Errorf("%s: golden decodes to %+v, want %+v", c.name, got, c.cmd)
		}
		if enc := mustEncode(t, c.cmd); string(enc) != string(b) {
			t.Errorf("%s: encoding changed:\n got %x\nwant %x", c.name, enc, b)
		}
	}
}

// canonical normalises what encoding does not keep (an empty slice vs nil).
func canonical(c Command) Command {
	if b, ok := c.(KVEventBatch); ok {
		evs := make([]KVBatchEvent, len(b.Events))
		for i, e := range b.Events {
			if len(e.Event.Blocks) == 0 {
				e.Event.Blocks = nil
			}
			if len(e.Event.Removed) == 0 {
				e.Event.Removed = nil
			}
			evs[i] = e
		}
		return KVEventBatch{Events: evs}
	}
	return c
}

func TestFSMCommandRoundTrip(t *testing.T) {
	cases := goldenCommands()
	cases = append(cases, []struct {
		name string
		cmd  Command
	}{
		{"empty-batch", KVEventBatch{}},
		{"many-workers", func() Command {
			var evs []KVBatchEvent
			for i := range 40 {
				evs = append(evs, stored(fmt.Sprintf("w%d", i%20), uint32(i%3), uint64(i+1), uint64(i)))
			}
			return KVEventBatch{Events: evs}
		}()},
		{"model-config-empty", SetModelConfig{Model: "m"}},
		{"tick-negative", Tick{Now: -5}},
		{"predictions-none", Predictions{Worker: "w", Until: 1}},
		{"register-prefill-worker", RegisterWorker{ID: "p-1", DPRanks: 1, Address: "http://10.0.0.9:8000", Model: "m", Role: router.RolePrefill}},
		{"register-decode-worker", RegisterWorker{ID: "d-1", DPRanks: 2, Model: "m", TotalBlocks: 9, Role: router.RoleDecode, LeaseUntil: 77}},
		{"register-own-default-block-size", RegisterWorker{ID: "o-1", DPRanks: 1, Model: "m", BlockSize: 16, OwnBlockSize: true}},
		{"register-own-block-size-both", RegisterWorker{ID: "o-2", DPRanks: 1, Model: "m", BlockSize: 64, Role: router.RoleBoth, OwnBlockSize: true}},
		{"set-groups-checked-one", SetGroups{Groups: 2, Checked: []string{"self"}}},
		{"set-groups-checked-most", SetGroups{Groups: 1, Checked: checkedIDs(MaxCheckedNodes)}}, // the count's bound is a domain rule
		{"set-groups-checked-long-id", SetGroups{Groups: MaxDataGroups, Checked: []string{"a", strings.Repeat("z", MaxStringLen)}}},
	}...)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := mustEncode(t, tc.cmd)
			if b[0] != byte(tc.cmd.Type()) || b[1] != EnvelopeVersion {
				t.Fatalf("envelope %x", b[:2])
			}
			got, err := Decode(b)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(canonical(got), canonical(tc.cmd)) {
				t.Fatalf("round trip:\n got %+v\nwant %+v", got, tc.cmd)
			}
			// The typed decoder agrees and refuses other types.
			if tc.cmd.Type().isKVBatch() {
				evs, err := DecodeKVBatch(b)
				if err != nil || len(evs) != len(tc.cmd.(KVEventBatch).Events) {
					t.Fatalf("DecodeKVBatch: %d events, %v", len(evs), err)
				}
			} else if _, err := DecodeKVBatch(b); !errors.Is(err, ErrUndecodable) {
				t.Fatalf("DecodeKVBatch of %s: %v", tc.cmd.Type(), err)
			}
			if tc.cmd.Type() != CmdTick {
				if _, err := DecodeTick(b); !errors.Is(err, ErrUndecodable) {
					t.Fatalf("DecodeTick of %s: %v", tc.cmd.Type(), err)
				}
			}
			// Truncations and extensions never decode.
			for n := 2; n < len(b); n++ {
				if _, err := Decode(b[:n]); err == nil {
					t.Fatalf("prefix of %d bytes decoded", n)
				}
			}
			if _, err := Decode(append(b, 0)); !errors.Is(err, ErrUndecodable) {
				t.Fatalf("trailing byte: %v", err)
			}
		})
	}
}

func TestFSMEncodeRefuses(t *testing.T) {
	long := strings.Repeat("x", MaxStringLen+1)
	cases := []struct {
		name string
		cmd  Command
	}{
		{"long worker id", RegisterWorker{ID: long, DPRanks: 1}},
		{"long model", RegisterWorker{ID: "w", DPRanks: 1, Model: long}},
		{"negative block size", RegisterWorker{ID: "w", DPRanks: 1, BlockSize: -1}},
		{"huge total blocks", RegisterWorker{ID: "w", DPRanks: 1, TotalBlocks: math.MaxInt32 + 1}},
		{"long deregister", DeregisterWorker{ID: long}},
		{"bad event kind", KVEventBatch{Events: []KVBatchEvent{{Worker: "w", Event: router.KVEvent{Kind: 9}}}}},
		{"negative event block size", KVEventBatch{Events: []KVBatchEvent{{Worker: "w", Event: router.KVEvent{Kind: router.EventCleared, BlockSize: -16}}}}},
		{"long event worker", KVEventBatch{Events: []KVBatchEvent{{Worker: long, Event: router.KVEvent{Kind: router.EventCleared}}}}},
		{"unknown reset bits", SetModelConfig{Model: "m", Reset: 1 << 20}},
		{"long node", RegisterNode{NodeID: "n", HTTPAddr: long}},
		{"long resync", ResyncWorker{Worker: long}},
		{"long placement", PlaceWorker{Worker: long, Group: 1, Groups: 2}},
		{"checked list empty", SetGroups{Groups: 3, Checked: []string{}}},
		{"checked list too long", SetGroups{Groups: 3, Checked: checkedIDs(MaxCheckedNodes + 1)}},
		{"checked list unsorted", SetGroups{Groups: 3, Checked: []string{"r2", "r1"}}},
		{"checked list repeated", SetGroups{Groups: 3, Checked: []string{"r1", "r1"}}},
		{"checked list empty id", SetGroups{Groups: 3, Checked: []string{"", "r1"}}},
		{"checked list long id", SetGroups{Groups: 3, Checked: []string{long}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Encode(tc.cmd); !errors.Is(err, ErrInvalidCommand) {
				t.Fatalf("encode: %v, want ErrInvalidCommand", err)
			}
		})
	}
}

func TestFSMDecodeRejects(t *testing.T) {
	good := mustEncode(t, KVEventBatch{Events: []KVBatchEvent{stored("w", 0, 1, 1, 2)}})
	cases := []struct {
		name string
		data []byte
		want error
	}{
		{"empty", nil, ErrUndecodable},
		{"one byte", []byte{3}, ErrUndecodable},
		{"unknown type", []byte{42, 1}, ErrUnknownCommand},
		{"unknown type with ignore bit", []byte{42 | IgnoreIfUnknown, 1}, ErrUnknownCommand},
		{"unknown version", append([]byte{3, 2}, good[2:]...), ErrUnknownCommand},
		{"huge string length", []byte{2, 1, 0xff, 0xff, 0xff, 0xff, 0x0f}, ErrUndecodable},
		{"huge event count", []byte{3, 1, 1, 1, 'w', 0xff, 0xff, 0xff, 0xff, 0x0f}, ErrUndecodable},
		{"worker index out of table", []byte{3, 1, 1, 1, 'w', 1, 5, 0, 0, 3, 0, 0}, ErrUndecodable},
		{"bad kind", []byte{3, 1, 1, 1, 'w', 1, 0, 0, 0, 9, 0, 0}, ErrUndecodable},
		{"flags on clear", []byte{3, 1, 1, 1, 'w', 1, 0, 0, 0, 3, 1, 0}, ErrUndecodable},
		{"rank overflows uint32", []byte{8, 1, 1, 'w', 0x80, 0x80, 0x80, 0x80, 0x10}, ErrUndecodable},
		{"bad bool", append(append([]byte{4, 1, 1, 'm', 0}, byte(FieldTrackPrefillTokens)), 7), ErrUndecodable},
		{"unknown set field", []byte{4, 1, 1, 'm', 0, 0x80, 0x40}, ErrUndecodable},
		{"trailing", append(append([]byte{}, good...), 0), ErrUndecodable},
		{"block size registration without its role field", []byte{11, 1, 1, 'w', 1, 0, 0, 32, 0, 0, 0}, ErrUndecodable},
		{"block size registration with a bad role", []byte{11, 1, 1, 'w', 1, 0, 0, 32, 0, 0, 0, 1, 'x'}, ErrUndecodable},
		{"placement with a bad remove flag", []byte{13, 1, 1, 'w', 1, 2, 2}, ErrUndecodable},
		{"placement without its remove flag", []byte{13, 1, 1, 'w', 1, 2}, ErrUndecodable},
		{"placement group overflows uint32", []byte{13, 1, 1, 'w', 0x80, 0x80, 0x80, 0x80, 0x10, 2, 0}, ErrUndecodable},
		{"set groups without its count", []byte{14, 1}, ErrUndecodable},
		{"set groups count overflows uint32", []byte{14, 1, 0x80, 0x80, 0x80, 0x80, 0x10}, ErrUndecodable},
		{"set groups with a truncated varint", []byte{14, 1, 0x83}, ErrUndecodable},
		{"set groups trailing byte", []byte{14, 1, 3, 0}, ErrUndecodable},
		{"set groups unknown version", []byte{14, 2, 3}, ErrUnknownCommand},
		{"checked set groups without its list", []byte{15, 1, 3}, ErrUndecodable},
		{"checked set groups with an empty list", []byte{15, 1, 3, 0}, ErrUndecodable},
		{"checked set groups list past the bytes", []byte{15, 1, 3, 2, 1, 'a'}, ErrUndecodable},
		{"checked set groups unsorted", []byte{15, 1, 3, 2, 1, 'b', 1, 'a'}, ErrUndecodable},
		{"checked set groups repeated", []byte{15, 1, 3, 2, 1, 'a', 1, 'a'}, ErrUndecodable},
		{"checked set groups empty id", []byte{15, 1, 3, 2, 0, 1, 'a'}, ErrUndecodable},
		{"checked set groups trailing byte", []byte{15, 1, 3, 1, 1, 'a', 0}, ErrUndecodable},
		{"checked set groups count overflows uint32", []byte{15, 1, 0x80, 0x80, 0x80, 0x80, 0x10, 1, 1, 'a'}, ErrUndecodable},
		{"checked set groups past the node bound", func() []byte {
			b := []byte{15, 1, 3}
			b = binary.AppendUvarint(b, MaxCheckedNodes+1)
			for _, id := range checkedIDs(MaxCheckedNodes + 1) {
				b = appendString(b, id)
			}
			return b
		}(), ErrUndecodable},
		{"checked set groups unknown version", []byte{15, 2, 3, 1, 1, 'a'}, ErrUnknownCommand},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Decode(tc.data); !errors.Is(err, tc.want) {
				t.Fatalf("decode %x: %v, want %v", tc.data, err, tc.want)
			}
		})
	}
}

// checkedIDs is n sorted, unique node ids for SetGroups.Checked.
func checkedIDs(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("r%05d", i)
	}
	return ids
}
