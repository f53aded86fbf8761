package eventbus

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/router"
)

// checkSyncWire fails unless m's hand encoding is the library's encoding
// byte for byte, and decodes (with this build's decoder and with an older
// peer's message type) to what the library's bytes decode to.
func checkSyncWire(t *testing.T, m SyncMsg) {
	t.Helper()
	want, err := msgpack.Marshal(&m)
	if err != nil {
		t.Fatal(err)
	}
	got, ok := appendSyncMsg([]byte("prefix"), &m)
	if !ok {
		t.Fatalf("hand encoder refused %+v", m)
	}
	if !bytes.HasPrefix(got, []byte("prefix")) {
		t.Fatalf("hand encoder overwrote the buffer's contents: %q", got[:min(len(got), 6)])
	}
	got = got[len("prefix"):]
	if !bytes.Equal(got, want) {
		t.Fatalf("hand encoding of %+v\n got % x\nwant % x", m, got, want)
	}
	var fromHand, fromLib SyncMsg
	if err := decodeSync(got, &fromHand); err != nil {
		t.Fatalf("decode hand encoding: %v", err)
	}
	if err := decodeSync(want, &fromLib); err != nil {
		t.Fatalf("decode library encoding: %v", err)
	}
	if !reflect.DeepEqual(fromHand, fromLib) {
		t.Fatalf("decoded differently:\nhand %+v\n lib %+v", fromHand, fromLib)
	}
	// The message itself comes back (an empty hash list decodes as none).
	orig := m
	if len(orig.Hashes) == 0 {
		orig.Hashes = nil
	}
	if !reflect.DeepEqual(fromHand, orig) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", fromHand, orig)
	}
	var oldHand, oldLib syncMsgV1
	if err := msgpack.Unmarshal(got, &oldHand); err != nil {
		t.Fatalf("older peer cannot read the hand encoding: %v", err)
	}
	if err := msgpack.Unmarshal(want, &oldLib); err != nil || !reflect.DeepEqual(oldHand, oldLib) {
		t.Fatalf("older peer read\nhand %+v\n lib %+v (%v)", oldHand, oldLib, err)
	}
}

func TestSyncWireMatchesLibrary(t *testing.T) {
	hashes := func(n int) []uint64 {
		h := make([]uint64, n)
		for i := range h {
			h[i] = uint64(i) * 0x9e3779b97f4a7c15
		}
		return h
	}
	ints := []int{1, 127, 128, 255, 256, 65535, 65536, math.MaxUint32, math.MaxUint32 + 1, math.MaxInt64,
		-1, -32, -33, -128, -129, -32768, -32769, math.MinInt32, math.MinInt32 - 1, math.MinInt64}
	cases := map[string]SyncMsg{
		"add, kvbench's 148 blocks": {Replica: "r1", Epoch: 0x8000000000000001, Seq: 42, Op: SyncAdd, Request: "chatcmpl-0123456789abcdef",
			Worker: "http://127.0.0.1:8001#0", Hashes: hashes(148), ISL: 2371, Overlap: 140, Sequences: 1},
		"add, no hashes":            {Replica: "r1", Epoch: 1, Seq: 1, Op: SyncAdd, Request: "q", Worker: "w"},
		"add, empty hash list":      {Replica: "r1", Epoch: 1, Seq: 1, Op: SyncAdd, Request: "q", Worker: "w", Hashes: []uint64{}},
		"add, 15 hashes":            {Replica: "r1", Epoch: 1, Seq: 1, Op: SyncAdd, Hashes: hashes(15)},
		"add, 16 hashes":            {Replica: "r1", Epoch: 1, Seq: 1, Op: SyncAdd, Hashes: hashes(16)},
		"add, 65535 hashes":         {Replica: "r1", Epoch: 1, Seq: 1, Op: SyncAdd, Hashes: hashes(65535)},
		"add, 65536 hashes":         {Replica: "r1", Epoch: 1, Seq: 1, Op: SyncAdd, Hashes: hashes(65536)},
		"prefill done":              {Replica: "r2", Epoch: 7, Seq: 3, Op: SyncPrefillDone, Request: "q"},
		"output progress":           {Replica: "r2", Epoch: 7, Seq: 4, Op: SyncPrefillDone, Request: "q", OutputBlocks: 2, Generated: 25, ExpectedOutput: 64},
		"free":                      {Replica: "r2", Epoch: 7, Seq: 5, Op: SyncFree, Request: "q"},
		"zero message":              {},
		"unknown op":                {Replica: "r", Epoch: math.MaxUint64, Seq: math.MaxUint64, Op: SyncOp(255)},
		"tenants version, no usage": {Replica: "r", Epoch: 1, Seq: 1, Op: SyncTenants, TenantsVersion: 200},
	}
	for _, n := range []int{0, 1, 31, 32, 255, 256, 65535, 65536} {
		s := strings.Repeat("x", n)
		cases[fmt.Sprintf("strings of %d bytes", n)] = SyncMsg{Replica: s, Op: SyncAdd, Request: s, Worker: router.WorkerID(s)}
	}
	for _, v := range ints {
		cases[fmt.Sprintf("ints %d", v)] = SyncMsg{Replica: "r", Op: SyncAdd, ISL: v, Overlap: -v, Sequences: v / 3,
			OutputBlocks: v, Generated: -v / 5, ExpectedOutput: v / 7}
	}
	for name, m := range cases {
		t.Run(name, func(t *testing.T) { checkSyncWire(t, m) })
	}
}

// Snapshots and tenant usage stay with the library: the hand encoder says
// so and leaves the buffer alone.
func TestSyncWireRefusesSnapshotsAndTenants(t *testing.T) {
	for _, m := range []SyncMsg{
		{Replica: "r", Op: SyncFull, Full: []ActiveRequest{{Request: "q", Worker: "w"}}},
		{Replica: "r", Op: SyncTenants, TenantsVersion: 1, Tenants: []TenantUsage{{Model: "m", Tenant: "t"}}},
	} {
		if b, ok := appendSyncMsg([]byte("x"), &m); ok || string(b) != "x" {
			t.Fatalf("hand encoder took %+v: %q %v", m, b, ok)
		}
	}
}

// An add written into a buffer with room costs no allocation: no
// reflection, nothing per hash.
func TestSyncWireNoAllocs(t *testing.T) {
	m := SyncMsg{Replica: "r1", Epoch: 3, Seq: 9, Op: SyncAdd, Request: "chatcmpl-1", Worker: "w#0", Hashes: make([]uint64, 148), ISL: 2371, Overlap: 3}
	buf := make([]byte, 0, 4096)
	if n := testing.AllocsPerRun(100, func() { buf, _ = appendSyncMsg(buf[:0], &m) }); n != 0 {
		t.Fatalf("%v allocations per add", n)
	}
}

// FuzzSyncAddEncodeMatchesReflect: any add, prefill-done, output or free
// message the hand encoder writes is the library's encoding byte for byte,
// and decodes to the same SyncMsg.
func FuzzSyncAddEncodeMatchesReflect(f *testing.F) {
	f.Add("r1", uint64(7), uint64(2), uint8(SyncAdd), "q1|p", "w1", []byte("\x00\x00\x00\x00\x00\x00\x00\x09"), int64(16), int64(1), int64(0), int64(0), int64(0), int64(0), uint8(0))
	f.Add("r2", uint64(1), uint64(40), uint8(SyncPrefillDone), "x", "", []byte(nil), int64(0), int64(0), int64(0), int64(3), int64(41), int64(64), uint8(0))
	f.Add("r2", uint64(1), uint64(41), uint8(SyncFree), "x|d", "", []byte(nil), int64(0), int64(0), int64(0), int64(0), int64(0), int64(0), uint8(0))
	f.Add(strings.Repeat("r", 40), uint64(math.MaxUint64), uint64(1), uint8(SyncAdd), strings.Repeat("q", 300), "w", bytes.Repeat([]byte{0xff}, 8*20),
		int64(-129), int64(math.MinInt64), int64(1<<40), int64(-33), int64(255), int64(65536), uint8(1))
	f.Fuzz(func(t *testing.T, replica string, epoch, seq uint64, op uint8, request, worker string, hb []byte,
		isl, overlap, sequences, outBlocks, generated, expected int64, tv uint8) {
		hashes := make([]uint64, len(hb)/8)
		for i := range hashes {
			hashes[i] = binary.BigEndian.Uint64(hb[8*i:])
		}
		checkSyncWire(t, SyncMsg{Replica: replica, Epoch: epoch, Seq: seq, Op: SyncOp(op), Request: request, Worker: router.WorkerID(worker),
			Hashes: hashes, ISL: int(isl), Overlap: int(overlap), Sequences: int(sequences),
			OutputBlocks: int(outBlocks), Generated: int(generated), ExpectedOutput: int(expected), TenantsVersion: tv})
	})
}

// One add of kvbench's prompt (148 blocks), as the replica announces each
// booking: the library's reflection against the hand encoder into a reused
// buffer. Compare with benchstat -col /enc.
func BenchmarkSyncAddEncode(b *testing.B) {
	h := make([]uint64, 148)
	for i := range h {
		h[i] = uint64(i+1) * 0x9e3779b97f4a7c15
	}
	m := SyncMsg{Replica: "replica-1", Epoch: 0x8000000000000001, Seq: 42, Op: SyncAdd, Request: "chatcmpl-0123456789abcdef",
		Worker: "http://127.0.0.1:8001#0", Hashes: h, ISL: 2371, Overlap: 140, Sequences: 1}
	b.Run("enc=reflect", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			mc := m
			if _, err := msgpack.Marshal(&mc); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("enc=hand", func(b *testing.B) {
		b.ReportAllocs()
		var buf []byte
		for b.Loop() {
			buf, _ = appendSyncMsg(buf[:0], &m)
		}
	})
}
