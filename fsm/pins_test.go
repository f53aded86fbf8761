package fsm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/router"
)

// goldenStatePins is goldenStateSessions plus prefix pins: one refreshed,
// one superseded by a longer prefix of the same prompt, one moved, one
// held by two workers, one unpinned, one ended with its worker, one
// expired by a Tick: the state pinned by testdata/snapshot-v8.bin.
func goldenStatePins(t testing.TB) *FSM {
	return withPins(t, goldenStateSessions(t)) // format 8 holds the sessions of format 7 too
}

func withPins(t testing.TB, f *FSM) *FSM {
	h := &harness{t: t, f: f, idx: f.AppliedIndex()}
	base := f.LastTick()
	ttl := 300 * sec
	pin := func(model string, w router.WorkerID, until int64, blocks ...uint64) PinPrefix {
		return PinPrefix{Model: model, Worker: w, Key: blocks[len(blocks)-1], Blocks: blocks, TTL: ttl, Until: until}
	}
	moved := pin("llama-3-8b", "vllm-0", base+300*sec, 21, 22)
	moved.Replace = "kvmock-1"
	for _, c := range []Command{
		pin("llama-3-8b", "vllm-0#1", base+100*sec, 1, 2, 3),
		PinPrefix{Model: "llama-3-8b", Worker: "vllm-0#1", Key: 3, TTL: ttl, Until: base + 250*sec}, // refresh
		pin("llama-3-8b", "vllm-0", base+300*sec, 11, 12),
		pin("llama-3-8b", "vllm-0", base+300*sec, 11, 12, 13, 14), // supersedes 11,12
		pin("llama-3-8b", "kvmock-1", base+300*sec, 21, 22),
		moved,
		pin("mistral", "mistral-0", base+300*sec, 31),
		pin("mistral", "mistral-1", base+200*sec, 31),
		pin("mistral", "mistral-0", base+300*sec, 41, 42),
		UnpinPrefix{Model: "mistral", Key: 42},
		pin("mistral", "gone-0#2", base+300*sec, 51),
		UnpinPrefix{Worker: "gone-0"},
		pin("mistral", "mistral-0", base+500, 61),
		Tick{Now: base + 1000},
	} {
		h.ok(c)
	}
	return f
}

func TestFSMPinValidate(t *testing.T) {
	many := make([]uint64, MaxPinBlocks+1)
	for i := range many {
		many[i] = uint64(i + 1)
	}
	ok := PinPrefix{Model: "m", Worker: "w#1", Key: 2, Blocks: []uint64{1, 2}, TTL: 300 * sec, Until: 1}
	with := func(f func(*PinPrefix)) PinPrefix { c := ok; f(&c); return c }
	for _, tc := range []struct {
		name string
		cmd  interface{ Validate() error }
		ok   bool
	}{
		{"pin", ok, true},
		{"refresh", with(func(c *PinPrefix) { c.Blocks = nil }), true},
		{"move", with(func(c *PinPrefix) { c.Replace = "v" }), true},
		{"max blocks", with(func(c *PinPrefix) { c.Blocks, c.Key = many[:MaxPinBlocks], uint64(MaxPinBlocks) }), true},
		{"too many blocks", with(func(c *PinPrefix) { c.Blocks, c.Key = many, uint64(len(many)) }), false},
		{"key not last", with(func(c *PinPrefix) { c.Key = 1 }), false},
		{"no model", with(func(c *PinPrefix) { c.Model = "" }), false},
		{"no worker", with(func(c *PinPrefix) { c.Worker = "" }), false},
		{"rank of nobody", with(func(c *PinPrefix) { c.Worker = "#1" }), false},
		{"replaces itself", with(func(c *PinPrefix) { c.Replace = c.Worker }), false},
		{"refresh that moves", with(func(c *PinPrefix) { c.Blocks, c.Replace = nil, "v" }), false},
		{"ttl short", with(func(c *PinPrefix) { c.TTL = sec - 1 }), false},
		{"ttl long", with(func(c *PinPrefix) { c.TTL = MaxPinTTL + 1 }), false},
		{"ttl max", with(func(c *PinPrefix) { c.TTL = MaxPinTTL }), true},
		{"zero until", with(func(c *PinPrefix) { c.Until = 0 }), false},
		{"unpin prefix", UnpinPrefix{Model: "m", Key: 2}, true},
		{"unpin prefix on worker", UnpinPrefix{Model: "m", Key: 2, Worker: "w"}, true},
		{"unpin worker", UnpinPrefix{Worker: "w"}, true},
		{"unpin nothing", UnpinPrefix{}, false},
		{"unpin key without model", UnpinPrefix{Key: 2, Worker: "w"}, false},
		{"unpin rank", UnpinPrefix{Worker: "w#1"}, false},
	} {
		if err := tc.cmd.Validate(); (err == nil) != tc.ok {
			t.Errorf("%s: %v, want ok %v", tc.name, err, tc.ok)
		}
		if c, isCmd := tc.cmd.(Command); isCmd {
			if _, err := Encode(c); (err == nil) != tc.ok {
				t.Errorf("%s: encode %v, want ok %v", tc.name, err, tc.ok)
			}
		}
	}
}

// TestFSMPinApply walks pins step by step: a pin, a lookup of a longer
// prompt, a refresh that never shortens, supersession by a longer prefix
// on the same worker (not on another), a move, the block counts, unpins,
// a refresh of what is not pinned, and expiry by the clock.
func TestFSMPinApply(t *testing.T) {
	h := newHarness(t)
	ttl := 60 * sec
	pin := func(w router.WorkerID, until int64, blocks ...uint64) PinPrefix {
		return PinPrefix{Model: "m", Worker: w, Key: blocks[len(blocks)-1], Blocks: blocks, TTL: ttl, Until: until}
	}
	holders := func(hashes ...uint64) (int, []router.WorkerID) {
		d, ps := h.f.PinLookup("m", hashes)
		var ws []router.WorkerID
		for _, p := range ps {
			ws = append(ws, p.Worker)
		}
		return d, ws
	}
	if res := h.ok(pin("a", 70*sec, 1, 2)); res.Applied != 1 || h.f.PinCount() != 1 {
		t.Fatalf("pin: %+v, count %d", res, h.f.PinCount())
	}
	h.ok(Tick{Now: 10 * sec}) // the clock starts: a pin can expire
	if d, ws := holders(1, 2, 3, 4); d != 2 || !slices.Equal(ws, []router.WorkerID{"a"}) {
		t.Fatalf("lookup of a longer prompt: depth %d holders %v", d, ws)
	}
	if d, _ := holders(1); d != 0 {
		t.Fatalf("a prompt shorter than the pin matched depth %d", d)
	}
	if d, _ := h.f.PinLookup("other", []uint64{1, 2}); d != 0 {
		t.Fatal("another model's prompt matched")
	}
	h.ok(PinPrefix{Model: "m", Worker: "a", Key: 2, TTL: ttl, Until: 40 * sec}) // earlier: no change
	if p := h.f.Pins()[0]; p.Until != 70*sec {
		t.Fatalf("a refresh shortened the pin to %d", p.Until)
	}
	h.ok(PinPrefix{Model: "m", Worker: "a", Key: 2, TTL: ttl, Until: 80 * sec})
	if p := h.f.Pins()[0]; p.Until != 80*sec {
		t.Fatalf("refresh: until %d", p.Until)
	}
	h.ok(pin("b", 70*sec, 1, 2, 3)) // another worker: a's pin stays
	h.ok(pin("a", 70*sec, 1, 2, 3, 4))
	if n := h.f.PinCount(); n != 2 {
		t.Fatalf("a longer prefix on a did not supersede a's shorter pin: %d pins %+v", n, h.f.Pins())
	}
	if got := h.f.PinnedBlocks("m", "a"); got != 4 {
		t.Fatalf("a pins %d blocks, want 4", got)
	}
	if d, ws := holders(1, 2, 3); d != 3 || !slices.Equal(ws, []router.WorkerID{"b"}) {
		t.Fatalf("lookup: depth %d holders %v", d, ws)
	}
	mv := pin("c", 70*sec, 1, 2, 3)
	mv.Replace = "b"
	h.ok(mv)
	if d, ws := holders(1, 2, 3); d != 3 || !slices.Equal(ws, []router.WorkerID{"c"}) || h.f.PinnedBlocks("m", "b") != 0 {
		t.Fatalf("move: depth %d holders %v, b pins %d", d, ws, h.f.PinnedBlocks("m", "b"))
	}
	// A move with a longer prompt ends the gone holder's shorter pin too.
	h.ok(pin("d", 70*sec, 1, 2))
	mv2 := pin("e", 70*sec, 1, 2, 7)
	mv2.Replace = "d"
	h.ok(mv2)
	if h.f.PinnedBlocks("m", "d") != 0 || h.f.PinnedBlocks("m", "e") != 3 {
		t.Fatalf("a longer move left d %d pinned blocks, e %d", h.f.PinnedBlocks("m", "d"), h.f.PinnedBlocks("m", "e"))
	}
	h.ok(UnpinPrefix{Worker: "e"})
	h.ok(pin("c#1", 70*sec, 1, 2, 3))
	if res := h.ok(UnpinPrefix{Model: "m", Key: 3, Worker: "c"}); res.Applied != 2 {
		t.Fatalf("unpin of a prefix on c's ranks ended %d", res.Applied)
	}
	if res := h.ok(PinPrefix{Model: "m", Worker: "c", Key: 3, TTL: ttl, Until: 90 * sec}); res.Applied != 0 || h.f.PinCount() != 1 {
		t.Fatalf("a refresh of what is not pinned: %+v, %d pins", res, h.f.PinCount())
	}
	h.ok(pin("z", 12*sec, 9))
	if res := h.ok(UnpinPrefix{Worker: "nobody"}); res.Applied != 0 {
		t.Fatal("unpinned a worker holding nothing")
	}
	if res := h.apply(pin("a", 10*sec, 5)); !errors.Is(res.Err, ErrInvalidCommand) {
		t.Fatalf("a pin already expired by the clock: %v", res.Err)
	}
	if res := h.ok(Tick{Now: 13 * sec}); res.Expired != 1 || h.f.PinCount() != 1 {
		t.Fatalf("tick: expired %d, %d pins left", res.Expired, h.f.PinCount())
	}
	// Left: a's pin of 1..4 (until 70s; the refreshed pin of 1,2 it
	// superseded does not lend it its expiry).
	if n := h.f.NextExpiry(); n == 0 || n > 70*sec {
		t.Fatalf("next expiry %d, want a's pin at 70s at the latest", n)
	}
	h.ok(Tick{Now: 60 * sec})
	h.ok(Tick{Now: 69 * sec})
	if h.f.PinCount() != 1 {
		t.Fatal("a pin until 70s ended before")
	}
	h.ok(Tick{Now: 70 * sec})
	if h.f.PinCount() != 0 || h.f.PinnedBlocks("m", "a") != 0 {
		t.Fatalf("pins left after their expiry: %+v", h.f.Pins())
	}
}

// TestFSMPinLimit: MaxPins held, a new pin is refused and nothing moves;
// a refresh and a pin that supersedes one of the worker's still apply.
func TestFSMPinLimit(t *testing.T) {
	h := newHarness(t)
	for i := range MaxPins {
		h.ok(PinPrefix{Model: "m", Worker: "w", Key: uint64(1000 + i), Blocks: []uint64{uint64(1000 + i)}, TTL: 60 * sec, Until: 60 * sec})
	}
	before := h.f.Digest()
	over := PinPrefix{Model: "m", Worker: "w", Key: 7, Blocks: []uint64{7}, TTL: 60 * sec, Until: 60 * sec}
	if err := h.f.CheckPinPrefix(over); !errors.Is(err, ErrPinLimit) {
		t.Fatalf("check: %v", err)
	}
	if res := h.apply(over); !errors.Is(res.Err, ErrPinLimit) || !errors.Is(res.Err, ErrInvalidCommand) || h.f.Digest() != before {
		t.Fatalf("a pin past the limit: %v", res.Err)
	}
	h.ok(PinPrefix{Model: "m", Worker: "w", Key: 1000, TTL: 60 * sec, Until: 70 * sec})
	h.ok(PinPrefix{Model: "m", Worker: "w", Key: 8, Blocks: []uint64{1000, 8}, TTL: 60 * sec, Until: 60 * sec})
	if h.f.PinCount() != MaxPins {
		t.Fatalf("%d pins", h.f.PinCount())
	}
}

// TestFSMPinExpiryDeterministic: replicas that replayed and one restored
// half way agree on every pin after random pins, refreshes and ticks.
func TestFSMPinExpiryDeterministic(t *testing.T) {
	var entries [][]byte
	now := int64(1_000) * sec
	entries = append(entries, mustEncode(t, Tick{Now: now}))
	rng := newRand(7)
	for i := range 60 {
		n := 1 + rng.IntN(4)
		blocks := make([]uint64, n)
		for j := range blocks {
			blocks[j] = uint64(j*10 + rng.IntN(3))
		}
		w := router.WorkerKey(fmt.Sprintf("w%d", rng.IntN(3)), uint32(rng.IntN(2)))
		c := PinPrefix{Model: "m", Worker: w, Key: blocks[n-1], Blocks: blocks, TTL: 5 * sec, Until: now + int64(2+rng.IntN(6))*sec}
		if rng.IntN(3) == 0 {
			c.Blocks = nil
		}
		entries = append(entries, mustEncode(t, c))
		if i%5 == 0 {
			now += 2 * sec
			entries = append(entries, mustEncode(t, Tick{Now: now}))
		}
	}
	for range 6 {
		now += 2 * sec
		entries = append(entries, mustEncode(t, Tick{Now: now}))
	}
	a, b, c := newFSM(t), newFSM(t), newFSM(t)
	half := len(entries) / 2
	a.ApplyBatch(logsOf(entries, 1))
	b.ApplyBatch(logsOf(entries[:half], 1))
	if b.PinCount() == 0 {
		t.Fatal("no pin half way: the test proves nothing")
	}
	if err := restoreBytes(c, snapshotBytes(t, b)); err != nil {
		t.Fatal(err)
	}
	c.ApplyBatch(logsOf(entries[half:], uint64(half+1)))
	b.ApplyBatch(logsOf(entries[half:], uint64(half+1)))
	sameState(t, a, b)
	sameState(t, a, c)
	for _, f := range []*FSM{b, c} {
		for _, w := range []router.WorkerID{"w0", "w1#1", "w2"} {
			if f.PinnedBlocks("m", w) != a.PinnedBlocks("m", w) {
				t.Fatalf("pinned blocks of %s differ after a restore", w)
			}
		}
	}
	for _, p := range a.Pins() {
		if p.Until <= a.LastTick() {
			t.Errorf("pin %+v outlived the clock %d", p, a.LastTick())
		}
	}
}

// TestFSMSnapshotPins: pins make the snapshot format 8 and restore to the
// same state, bytes and derived counts; a state without them keeps its
// older format and digest; a format 7 reader refuses format 8; pin records
// in older formats and records breaking a rule are refused.
func TestFSMSnapshotPins(t *testing.T) {
	sessions := goldenStateSessions(t)
	sessionsDigest := sessions.Digest()
	f := goldenStatePins(t)
	if f.Digest() == sessionsDigest {
		t.Fatal("pins do not change the digest")
	}
	b, g := restoreSame(t, f, SnapshotFormatPins)
	if !reflect.DeepEqual(g.Pins(), f.Pins()) || len(g.Pins()) != 5 {
		t.Fatalf("restored pins %+v, want %+v", g.Pins(), f.Pins())
	}
	if g.PinnedBlocks("llama-3-8b", "vllm-0") != 6 || g.PinnedBlocks("mistral", "mistral-1") != 1 {
		t.Fatalf("restored pinned blocks %d %d", g.PinnedBlocks("llama-3-8b", "vllm-0"), g.PinnedBlocks("mistral", "mistral-1"))
	}
	if snap := snapshotBytes(t, sessions); snap[4] != SnapshotFormatSessions || sessions.Digest() != sessionsDigest {
		t.Fatalf("a state without pins is format %d", snap[4])
	}
	// Pins without sessions, drains or placements still restore.
	restoreSame(t, withPins(t, goldenStateTiers(t)), SnapshotFormatPins)
	older := newFSM(t)
	older.newestFormat = SnapshotFormatSessions
	if err := restoreBytes(older, b); !errors.Is(err, ErrCorruptSnapshot) || !strings.Contains(err.Error(), "format version 8, this build reads 1 to 7") {
		t.Fatalf("format 7 build restores format 8: %v", err)
	}
	if err := restoreBytes(newFSM(t), reformat(b, SnapshotFormatSessions)); !errors.Is(err, ErrCorruptSnapshot) {
		t.Fatalf("pin records as format 7: %v", err)
	}

	header := func(clock int64, pins int) rawRec {
		body := appendU64(nil, 8)
		body = binary.AppendUvarint(body, 16)
		body = binary.AppendVarint(body, clock)
		for range 7 { // nodes … tier blocks
			body = binary.AppendUvarint(body, 0)
		}
		for range 4 { // groups, placements, drains, sessions
			body = binary.AppendUvarint(body, 0)
		}
		return rawRec{recHeader, binary.AppendUvarint(body, uint64(pins))}
	}
	pinRec := func(model, worker string, ttl, until int64, blocks ...uint64) rawRec {
		return rawRec{recPin, appendPinRecord(nil, &Pin{Model: model, Worker: router.WorkerID(worker), Blocks: blocks, TTL: ttl, Until: until})}
	}
	good := reformat(rawSnapshot(header(10, 2), pinRec("m", "w", 60*sec, 20, 1, 2), pinRec("m", "w#1", 60*sec, 30, 1, 2)), 8)
	if err := restoreBytes(newFSM(t), good); err != nil {
		t.Fatalf("a valid hand-made format 8 snapshot: %v", err)
	}
	for _, tc := range []struct {
		name string
		recs []rawRec
	}{
		{"expired", []rawRec{header(10, 1), pinRec("m", "w", 60*sec, 10, 1)}},
		{"no blocks", []rawRec{header(10, 1), pinRec("m", "w", 60*sec, 20)}},
		{"no model", []rawRec{header(10, 1), pinRec("", "w", 60*sec, 20, 1)}},
		{"no worker", []rawRec{header(10, 1), pinRec("m", "", 60*sec, 20, 1)}},
		{"bad ttl", []rawRec{header(10, 1), pinRec("m", "w", 0, 20, 1)}},
		{"repeated", []rawRec{header(10, 2), pinRec("m", "w", 60*sec, 20, 1), pinRec("m", "w", 60*sec, 30, 5, 1)}},
		{"count", []rawRec{header(10, 2), pinRec("m", "w", 60*sec, 20, 1)}},
		{"trailing bytes", []rawRec{header(10, 1), {recPin, append(pinRec("m", "w", 60*sec, 20, 1).body, 0)}}},
	} {
		if err := restoreBytes(newFSM(t), reformat(rawSnapshot(tc.recs...), 8)); !errors.Is(err, ErrCorruptSnapshot) {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
}

// TestFSMPinsOlderBuild: a build without pins (newest type 18, format 7)
// applies what comes before the first pin alike, halts on PinPrefix (and
// on UnpinPrefix) without moving, and refuses the format 8 snapshot by
// version.
func TestFSMPinsOlderBuild(t *testing.T) {
	node := mustEncode(t, RegisterNode{NodeID: "r1", RaftAddr: "a", HTTPAddr: "b"})
	entries := [][]byte{node, mustEncode(t, PinPrefix{Model: "m", Worker: "w", Key: 1, Blocks: []uint64{1}, TTL: 60 * sec, Until: 100}),
		mustEncode(t, Tick{Now: 5})}
	older, newer := olderBuildHalts(t, entries, 1, CmdUnbindSessions, SnapshotFormatSessions, CmdPinPrefix)
	if newer.PinCount() != 1 {
		t.Fatal("newer build did not pin")
	}
	if err := restoreBytes(older, snapshotBytes(t, newer)); !errors.Is(err, ErrCorruptSnapshot) {
		t.Fatalf("older build restores format 8: %v", err)
	}
	olderBuildHalts(t, [][]byte{node, mustEncode(t, UnpinPrefix{Worker: "w"})}, 1, CmdUnbindSessions, SnapshotFormatSessions, CmdUnpinPrefix)
}

// TestFSMPinCheckTime: a proposer refuses a pin whose expiry is far from
// its clock, before the log; apply clamps one that skipped the check.
func TestFSMPinCheckTime(t *testing.T) {
	now := int64(1_700_000_000) * sec
	for _, tc := range []struct {
		until int64
		ok    bool
	}{
		{now + 300*sec, true}, {now + MaxPinTTL, true}, {now - 30*sec, true},
		{now - 2*MaxProposalSkew, false}, {now + MaxPinTTL + 2*MaxProposalSkew, false},
	} {
		c := PinPrefix{Model: "m", Worker: "w", Key: 1, Blocks: []uint64{1}, TTL: 60 * sec, Until: tc.until}
		if err := CheckEntryTime(mustEncode(t, c), now); (err == nil) != tc.ok {
			t.Errorf("until now%+ds: %v, want ok %v", (tc.until-now)/sec, err, tc.ok)
		}
	}
	h := newHarness(t)
	h.ok(PinPrefix{Model: "m", Worker: "v", Key: 1, Blocks: []uint64{1}, TTL: 60 * sec, Until: now + 60*sec})
	h.ok(Tick{Now: now})
	if res := h.ok(PinPrefix{Model: "m", Worker: "w", Key: 1, Blocks: []uint64{1}, TTL: 60 * sec, Until: now + 10*MaxPinTTL}); !res.Clamped {
		t.Fatalf("a far pin was not clamped: %+v", h.f.Pins())
	}
	if p := h.f.Pins()[1]; p.Until != now+MaxPinTTL {
		t.Fatalf("a far pin: until now%+ds", (p.Until-now)/sec)
	}
}

// FuzzDecodePinCommands: any payload as a command 19 or 20 decodes or is
// refused as undecodable, never panics, and what decodes re-encodes to the
// same command when it is valid.
func FuzzDecodePinCommands(f *testing.F) {
	for _, s := range pinSeeds(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Decode(data)
		if err != nil {
			if !errors.Is(err, ErrUndecodable) && !errors.Is(err, ErrUnknownCommand) {
				t.Fatalf("decode error %v is neither undecodable nor unknown", err)
			}
			return
		}
		switch c.(type) {
		case PinPrefix, UnpinPrefix:
		default:
			return
		}
		b, err := Encode(c)
		if err != nil {
			if c.(interface{ Validate() error }).Validate() == nil {
				t.Fatalf("a valid %T does not encode: %v", c, err)
			}
			return
		}
		again, err := Decode(b)
		if err != nil || !reflect.DeepEqual(again, c) {
			t.Fatalf("%T does not survive a round trip: %+v / %+v (%v)", c, c, again, err)
		}
	})
}

func pinSeeds(t testing.TB) map[string][]byte {
	seeds := map[string][]byte{}
	for _, c := range goldenCommands() {
		if c.cmd.Type() == CmdPinPrefix || c.cmd.Type() == CmdUnpinPrefix {
			seeds[c.name] = mustEncode(t, c.cmd)
		}
	}
	blocks := make([]uint64, 64)
	for i := range blocks {
		blocks[i] = uint64(i) * 0x9e3779b97f4a7c15
	}
	long := mustEncode(t, PinPrefix{Model: "m", Worker: "w", Key: blocks[63], Blocks: blocks, TTL: 60 * sec, Until: 1})
	seeds["pin-long"] = long
	seeds["pin-truncated"] = long[:len(long)-9]
	seeds["unpin-empty"] = []byte{byte(CmdUnpinPrefix), 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	return seeds
}

// BenchmarkFSMPinLookup: the read on every request's path while pins are
// held (1,024 pins, MaxPins): a 2,048-block prompt that starts with one
// of them (the walk stops at its key) and one that matches none (the walk
// reads every hash).
func BenchmarkFSMPinLookup(b *testing.B) {
	h := newHarness(b)
	prompt := make([]uint64, 2048)
	for i := range prompt {
		prompt[i] = uint64(i+1) * 0x9e3779b97f4a7c15
	}
	for i := range MaxPins {
		blocks := []uint64{uint64(i+1) << 40}
		if i == 0 {
			blocks = prompt[:1024]
		}
		h.ok(PinPrefix{Model: "m", Worker: "w", Key: blocks[len(blocks)-1], Blocks: blocks, TTL: 60 * sec, Until: 60 * sec})
	}
	miss := make([]uint64, len(prompt))
	for i := range miss {
		miss[i] = prompt[i] + 1
	}
	// Another state: 1,024 conversations of one agent, every pin starting
	// with the same system-prompt block, the prompt's own the longest.
	shared := newHarness(b)
	for i := range MaxPins {
		blocks := []uint64{prompt[0], uint64(i+1) << 40}
		if i == 0 {
			blocks = prompt[:1024]
		}
		shared.ok(PinPrefix{Model: "m", Worker: "w", Key: blocks[len(blocks)-1], Blocks: blocks, TTL: 60 * sec, Until: 60 * sec})
	}
	for _, tc := range []struct {
		name   string
		f      *FSM
		hashes []uint64
		depth  int
	}{{"hit", h.f, prompt, 1024}, {"miss", h.f, miss, 0}, {"shared-first-block", shared.f, prompt, 1024}} {
		b.Run(tc.name, func(b *testing.B) {
			for b.Loop() {
				if d, _ := tc.f.PinLookup("m", tc.hashes); d != tc.depth {
					b.Fatalf("depth %d", d)
				}
			}
		})
	}
}
