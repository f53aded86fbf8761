package fsm

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/router"
)

// goldenStateSessionStages is goldenStatePins plus two-stage bindings: one
// touched, one whose prefill stage was replaced, one-stage bindings gaining
// a prefill stage, one made one-stage again by BindSession, one whose
// prefill worker left (kept on its decode worker): the state pinned by
// testdata/snapshot-v9.bin.
func goldenStateSessionStages(t testing.TB) *FSM {
	return withSessionStages(t, goldenStatePins(t)) // format 9 holds the pins of format 8 too
}

func withSessionStages(t testing.TB, f *FSM) *FSM {
	h := &harness{t: t, f: f, idx: f.AppliedIndex()}
	base := f.LastTick()
	for _, c := range []Command{
		BindSessionStages{Session: "disagg-1", Prefill: "prefill-0", Decode: "decode-0", Until: base + 300*sec},
		BindSessionStages{Session: "disagg-1", Prefill: "prefill-0", Decode: "decode-0", Until: base + 400*sec}, // touch
		BindSessionStages{Session: "disagg-2", Prefill: "prefill-1#1", Decode: "decode-1", Parent: "disagg-1", Until: base + 300*sec},
		BindSessionStages{Session: "disagg-2", Prefill: "prefill-0", Decode: "decode-1", Until: base + 310*sec,
			SeenPrefill: "prefill-1#1", SeenDecode: "decode-1"}, // prefill stage replaced
		BindSessionStages{Session: "agent-1", Prefill: "prefill-1", Decode: "vllm-0", Until: base + 320*sec, SeenDecode: "vllm-0"}, // gains a stage
		BindSessionStages{Session: "codex-7", Prefill: "prefill-1", Decode: "vllm-0", Until: base + 330*sec, SeenDecode: "vllm-0"},
		BindSession{Session: "codex-7", Worker: "kvmock-1", Until: base + 340*sec, Replace: "vllm-0"}, // one stage again
		BindSessionStages{Session: "left", Prefill: "leaving-0", Decode: "decode-0", Until: base + 300*sec},
		UnbindSessions{Worker: "leaving-0"}, // keeps the decode stage
	} {
		h.ok(c)
	}
	return f
}

func TestFSMSessionStagesValidate(t *testing.T) {
	long := strings.Repeat("x", MaxSessionIDBytes)
	ok := BindSessionStages{Session: "s", Prefill: "p#1", Decode: "d", Until: 1}
	with := func(f func(*BindSessionStages)) BindSessionStages { c := ok; f(&c); return c }
	for _, tc := range []struct {
		name string
		cmd  BindSessionStages
		ok   bool
	}{
		{"bind", ok, true},
		{"long ids and a parent", with(func(c *BindSessionStages) { c.Session, c.Parent = long, long }), true},
		{"replace both seen", with(func(c *BindSessionStages) { c.SeenPrefill, c.SeenDecode = "q", "e#2" }), true},
		{"a one-stage binding seen", with(func(c *BindSessionStages) { c.SeenDecode = "d" }), true},
		{"empty id", with(func(c *BindSessionStages) { c.Session = "" }), false},
		{"id too long", with(func(c *BindSessionStages) { c.Session = long + "x" }), false},
		{"parent with a control character", with(func(c *BindSessionStages) { c.Parent = "a\tb" }), false},
		{"no prefill worker", with(func(c *BindSessionStages) { c.Prefill = "" }), false},
		{"no decode worker", with(func(c *BindSessionStages) { c.Decode = "" }), false},
		{"a rank of nobody", with(func(c *BindSessionStages) { c.Prefill = "#1" }), false},
		{"one worker for both stages", with(func(c *BindSessionStages) { c.Prefill = "d" }), false},
		{"a seen prefill without its decode", with(func(c *BindSessionStages) { c.SeenPrefill = "p#1" }), false},
		{"a seen decode of nobody", with(func(c *BindSessionStages) { c.SeenDecode = "#0" }), false},
		{"zero until", with(func(c *BindSessionStages) { c.Until = 0 }), false},
		{"negative until", with(func(c *BindSessionStages) { c.Until = -1 }), false},
	} {
		err := tc.cmd.Validate()
		if (err == nil) != tc.ok {
			t.Errorf("%s: %v, want ok %v", tc.name, err, tc.ok)
			continue
		}
		// The encoder refuses exactly what Validate refuses.
		if _, eerr := Encode(tc.cmd); (eerr == nil) != tc.ok {
			t.Errorf("%s: encoder says %v", tc.name, eerr)
		}
		if !tc.ok && !errors.Is(err, ErrInvalidCommand) {
			t.Errorf("%s: %v does not wrap ErrInvalidCommand", tc.name, err)
		}
	}
}

// TestFSMSessionStagesApply walks a two-stage binding through its life:
// first commit wins, touches, a stage replaced only when the proposer saw
// the binding in force, one-stage bindings gaining a stage and losing it,
// a stage's worker leaving.
func TestFSMSessionStagesApply(t *testing.T) {
	h := newHarness(t)
	h.ok(BindSession{Session: "warm", Worker: "w9", Until: 1500 * sec})
	h.ok(Tick{Now: 1000 * sec}) // the clock is 1000 s now
	h.ok(UnbindSessions{Session: "warm"})
	type want struct{ prefill, decode router.WorkerID }
	steps := []struct {
		name    string
		cmd     Command
		err     string
		applied int
		bound   want // the result's binding ({} = none reported)
		until   int64
		count   int
	}{
		{"first turn binds both stages", BindSessionStages{Session: "s", Prefill: "p1", Decode: "d1", Until: 1300 * sec}, "", 1, want{"p1", "d1"}, 1300 * sec, 1},
		{"a concurrent first turn loses", BindSessionStages{Session: "s", Prefill: "p2", Decode: "d2", Until: 1301 * sec}, "", 0, want{"p1", "d1"}, 1300 * sec, 1},
		{"a touch extends", BindSessionStages{Session: "s", Prefill: "p1", Decode: "d1", Until: 1400 * sec}, "", 1, want{"p1", "d1"}, 1400 * sec, 1},
		{"an older touch never shortens", BindSessionStages{Session: "s", Prefill: "p1", Decode: "d1", Until: 1350 * sec}, "", 1, want{"p1", "d1"}, 1400 * sec, 1},
		{"a one-stage touch of the decode worker keeps the prefill stage", BindSession{Session: "s", Worker: "d1", Until: 1450 * sec}, "", 1, want{"p1", "d1"}, 1450 * sec, 1},
		{"a replace of a binding not in force loses", BindSessionStages{Session: "s", Prefill: "p2", Decode: "d1", Until: 1460 * sec, SeenPrefill: "p9", SeenDecode: "d1"}, "", 0, want{"p1", "d1"}, 1450 * sec, 1},
		{"a replace seeing one stage of a two-stage binding loses", BindSessionStages{Session: "s", Prefill: "p2", Decode: "d1", Until: 1460 * sec, SeenDecode: "d1"}, "", 0, want{"p1", "d1"}, 1450 * sec, 1},
		{"the prefill stage replaced", BindSessionStages{Session: "s", Prefill: "p2#1", Decode: "d1", Until: 1460 * sec, SeenPrefill: "p1", SeenDecode: "d1"}, "", 1, want{"p2#1", "d1"}, 1460 * sec, 1},
		{"the decode stage replaced", BindSessionStages{Session: "s", Prefill: "p2#1", Decode: "d2", Until: 1470 * sec, SeenPrefill: "p2#1", SeenDecode: "d1"}, "", 1, want{"p2#1", "d2"}, 1470 * sec, 1},
		{"a one-stage binding", BindSession{Session: "a", Worker: "d1", Until: 1300 * sec}, "", 1, want{"", "d1"}, 1300 * sec, 2},
		{"gains a prefill stage", BindSessionStages{Session: "a", Prefill: "p1", Decode: "d1", Until: 1310 * sec, SeenDecode: "d1"}, "", 1, want{"p1", "d1"}, 1310 * sec, 2},
		{"BindSession replacing it makes it one-stage", BindSession{Session: "a", Worker: "d3", Until: 1320 * sec, Replace: "d1"}, "", 1, want{"", "d3"}, 1320 * sec, 2},
		{"expired by the clock", BindSessionStages{Session: "b", Prefill: "p1", Decode: "d1", Until: 1000 * sec}, "not after the clock", 0, want{}, 0, 2},
		{"a far expiry is clamped", BindSessionStages{Session: "c", Prefill: "p1", Decode: "d1", Until: 1000*sec + 2*MaxSessionTTL}, "", 1, want{"p1", "d1"}, 1000*sec + MaxSessionTTL, 3},
		{"its prefill worker leaves: one stage kept", UnbindSessions{Worker: "p1"}, "", 1, want{}, 0, 3},
		{"its decode worker leaves: the binding ends", UnbindSessions{Worker: "d2"}, "", 1, want{}, 0, 2},
	}
	for _, s := range steps {
		res := h.apply(s.cmd)
		if s.err != "" {
			if res.Err == nil || !strings.Contains(res.Err.Error(), s.err) || !errors.Is(res.Err, ErrInvalidCommand) {
				t.Fatalf("%s: err %v, want %q", s.name, res.Err, s.err)
			}
		} else if res.Err != nil {
			t.Fatalf("%s: %v", s.name, res.Err)
		}
		if res.Applied != s.applied {
			t.Errorf("%s: applied %d, want %d", s.name, res.Applied, s.applied)
		}
		switch {
		case s.bound == want{} && res.Session != nil:
			t.Errorf("%s: result reports %+v", s.name, *res.Session)
		case s.bound != want{} && (res.Session == nil || res.Session.Prefill != s.bound.prefill || res.Session.Worker != s.bound.decode || res.Session.Until != s.until):
			t.Errorf("%s: result %+v, want %v until %d", s.name, res.Session, s.bound, s.until)
		}
		if n := h.f.SessionCount(); n != s.count {
			t.Errorf("%s: %d bindings, want %d", s.name, n, s.count)
		}
	}
	if b, ok := h.f.Session("c"); !ok || b.Prefill != "" || b.Worker != "d1" {
		t.Errorf("c after its prefill worker left: %+v %v", b, ok)
	}
	if got := h.f.SessionsPerWorker(); !reflect.DeepEqual(got, map[string]int{"d1": 1, "d3": 1}) {
		t.Errorf("per worker %v", got)
	}
	h.ok(BindSessionStages{Session: "c", Prefill: "p4", Decode: "d1", Until: 1500 * sec, SeenDecode: "d1"})
	if got := h.f.SessionsPerWorker(); !reflect.DeepEqual(got, map[string]int{"d1": 1, "d3": 1, "p4": 1}) {
		t.Errorf("per worker, both stages counted: %v", got)
	}
	if got := h.f.SessionsOf("p4"); !reflect.DeepEqual(got, []string{"c"}) {
		t.Errorf("sessions of a prefill worker: %v", got)
	}
	// The limit: a new two-stage binding is refused while the state is
	// full, a touch is not (CheckBindSessionStages predicts both).
	if err := h.f.CheckBindSessionStages(BindSessionStages{Session: "c", Prefill: "p4", Decode: "d1", Until: 900 * sec}); err == nil {
		t.Error("a proposer accepts an expiry before the clock")
	}
}

// TestFSMSnapshotSessionStages: format 9 round-trips two-stage bindings
// with the same state, bytes and digest; the prefill stage is in the
// digest; a state without one keeps format 8 and its digest; a format 8
// reader refuses format 9 by version; a format-8 session record carrying
// a stage is refused as trailing bytes.
func TestFSMSnapshotSessionStages(t *testing.T) {
	pins := goldenStatePins(t)
	pinsDigest := pins.Digest()
	f := goldenStateSessionStages(t)
	b, g := restoreSame(t, f, SnapshotFormatSessionStages)
	if !reflect.DeepEqual(g.Sessions(), f.Sessions()) {
		t.Fatalf("restored sessions %+v, want %+v", g.Sessions(), f.Sessions())
	}
	if s, _ := g.Session("disagg-2"); s.Prefill != "prefill-0" || s.Worker != "decode-1" || s.Parent != "" {
		t.Fatalf("restored disagg-2: %+v", s)
	}
	if snap := snapshotBytes(t, pins); snap[4] != SnapshotFormatPins || pins.Digest() != pinsDigest {
		t.Fatalf("a state without two-stage bindings is format %d", snap[4])
	}
	// Only the prefill stage differs: the digests must part.
	a, c := newHarness(t), newHarness(t)
	a.ok(BindSessionStages{Session: "s", Prefill: "p1", Decode: "d", Until: 100 * sec})
	c.ok(BindSessionStages{Session: "s", Prefill: "p2", Decode: "d", Until: 100 * sec})
	if a.f.Digest() == c.f.Digest() {
		t.Fatal("the prefill stage is not in the digest")
	}
	restoreSame(t, a.f, SnapshotFormatSessionStages) // without pins, drains or placements
	older := newFSM(t)
	older.newestFormat = SnapshotFormatPins
	if err := restoreBytes(older, b); !errors.Is(err, ErrCorruptSnapshot) || !strings.Contains(err.Error(), "format version 9, this build reads 1 to 8") {
		t.Fatalf("format 8 build restores format 9: %v", err)
	}
	if err := restoreBytes(newFSM(t), reformat(b, SnapshotFormatPins)); !errors.Is(err, ErrCorruptSnapshot) {
		t.Fatalf("format 9 records read as format 8: %v", err)
	}
}

// TestFSMSessionStagesOlderBuild: a build without two-stage bindings
// (newest type 20, format 8) applies what comes before alike, halts on
// BindSessionStages without moving, and refuses the format 9 snapshot by
// version.
func TestFSMSessionStagesOlderBuild(t *testing.T) {
	node := mustEncode(t, RegisterNode{NodeID: "r1", RaftAddr: "a", HTTPAddr: "b"})
	entries := [][]byte{node, mustEncode(t, BindSessionStages{Session: "s", Prefill: "p", Decode: "d", Until: 100}), mustEncode(t, Tick{Now: 5})}
	older, newer := olderBuildHalts(t, entries, 1, CmdUnpinPrefix, SnapshotFormatPins, CmdBindSessionStages)
	if s, ok := newer.Session("s"); !ok || s.Prefill != "p" {
		t.Fatal("newer build did not bind")
	}
	if err := restoreBytes(older, snapshotBytes(t, newer)); !errors.Is(err, ErrCorruptSnapshot) {
		t.Fatalf("older build restores format 9: %v", err)
	}
}

// TestFSMSessionStagesCheckTime: a proposer refuses a two-stage binding
// whose expiry is far from its clock, before the log.
func TestFSMSessionStagesCheckTime(t *testing.T) {
	now := int64(1_700_000_000) * sec
	for _, tc := range []struct {
		until int64
		ok    bool
	}{
		{now + 300*sec, true}, {now + MaxSessionTTL, true}, {now - 30*sec, true},
		{now - 2*MaxProposalSkew, false}, {now + MaxSessionTTL + 2*MaxProposalSkew, false},
	} {
		c := BindSessionStages{Session: "s", Prefill: "p", Decode: "d", Until: tc.until}
		if err := CheckEntryTime(mustEncode(t, c), now); (err == nil) != tc.ok {
			t.Errorf("until now%+ds: %v, want ok %v", (tc.until-now)/sec, err, tc.ok)
		}
	}
}

// FuzzDecodeSessionStages: any payload as a command 21 decodes or is
// refused as undecodable, never panics, and what decodes re-encodes to the
// same command when it is valid; what the decoder accepts and Validate
// refuses, the apply refuses as a domain error.
func FuzzDecodeSessionStages(f *testing.F) {
	for _, c := range goldenCommands() {
		if c.cmd.Type() == CmdBindSessionStages {
			f.Add(mustEncode(f, c.cmd))
		}
	}
	long := mustEncode(f, BindSessionStages{Session: strings.Repeat("z", MaxSessionIDBytes), Prefill: "p", Decode: "d", Until: 1})
	f.Add(long)
	f.Add(long[:len(long)-2])
	f.Add([]byte{byte(CmdBindSessionStages), 1, 1, 's', 1, 'p', 1, 'p', 0, 2, 0, 0}) // one worker for both stages
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Decode(data)
		if err != nil {
			if !errors.Is(err, ErrUndecodable) && !errors.Is(err, ErrUnknownCommand) {
				t.Fatalf("decode error %v is neither undecodable nor unknown", err)
			}
			return
		}
		bs, ok := c.(BindSessionStages)
		if !ok {
			return
		}
		b, err := Encode(bs)
		if err != nil {
			if bs.Validate() == nil {
				t.Fatalf("a valid command does not encode: %v", err)
			}
			h := newHarness(t)
			if res := h.raw(data); res.Err == nil || !errors.Is(res.Err, ErrInvalidCommand) || h.f.SessionCount() != 0 {
				t.Fatalf("apply of an invalid %+v: %v", bs, res.Err)
			}
			return
		}
		again, err := Decode(b)
		if err != nil || !reflect.DeepEqual(again, c) {
			t.Fatalf("does not survive a round trip: %+v / %+v (%v)", c, again, err)
		}
	})
}
