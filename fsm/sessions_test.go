package fsm

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/router"
)

// goldenStateSessions is goldenStatePlacements plus session bindings: one
// touched, one rebound, one with a parent, one ended, one ended with its
// worker, one expired by a Tick: the state pinned by testdata/snapshot-v7.bin.
func goldenStateSessions(t testing.TB) *FSM {
	return withSessions(t, goldenStateDrains(t)) // format 7 holds the drains of format 6 too
}

func withSessions(t testing.TB, f *FSM) *FSM {
	h := &harness{t: t, f: f, idx: f.AppliedIndex()}
	// Times near the state's clock, and the Tick before its predictions
	// expire (the golden states keep them).
	base := f.LastTick()
	for _, c := range []Command{
		BindSession{Session: "agent-1", Worker: "vllm-0", Until: base + 300*sec},
		BindSession{Session: "agent-1:sub", Worker: "vllm-0#1", Parent: "agent-1", Until: base + 300*sec},
		BindSession{Session: "claude/9f3c", Worker: "mistral-0", Until: base + 60*sec},
		BindSession{Session: "claude/9f3c", Worker: "mistral-0", Until: base + 200*sec}, // touch
		BindSession{Session: "codex-7", Worker: "kvmock-1", Until: base + 300*sec},
		BindSession{Session: "codex-7", Worker: "vllm-0", Until: base + 310*sec, Replace: "kvmock-1"}, // rebound
		BindSession{Session: "done", Worker: "vllm-0", Until: base + 300*sec},
		UnbindSessions{Session: "done"},
		BindSession{Session: "gone-worker", Worker: "elsewhere-0", Until: base + 300*sec},
		UnbindSessions{Worker: "elsewhere-0"},
		BindSession{Session: "short", Worker: "vllm-0", Until: base + 500},
		Tick{Now: base + 1000},
	} {
		h.ok(c)
	}
	return f
}

// rawCommand is an entry built by hand, past the encoder's checks: the
// payload given, then a varint 2000 s (until) and an empty replace.
type rawCommand struct {
	typ     CommandType
	payload []byte
}

func (r rawCommand) Type() CommandType { return r.typ }
func (r rawCommand) entry() []byte {
	b := append([]byte{byte(r.typ), EnvelopeVersion}, r.payload...)
	return appendString(binary.AppendVarint(b, 2000*sec), "")
}

func TestFSMSessionValidate(t *testing.T) {
	long := strings.Repeat("x", MaxSessionIDBytes)
	for _, tc := range []struct {
		name string
		cmd  interface{ Validate() error }
		ok   bool
	}{
		{"bind", BindSession{Session: "s", Worker: "w", Until: 1}, true},
		{"bind rank and parent", BindSession{Session: long, Worker: "w#3", Parent: long, Until: 1, Replace: "v#1"}, true},
		{"empty id", BindSession{Worker: "w", Until: 1}, false},
		{"id too long", BindSession{Session: long + "x", Worker: "w", Until: 1}, false},
		{"parent too long", BindSession{Session: "s", Parent: long + "x", Worker: "w", Until: 1}, false},
		{"control character", BindSession{Session: "a\nb", Worker: "w", Until: 1}, false},
		{"invalid utf-8", BindSession{Session: "a\xffb", Worker: "w", Until: 1}, false},
		{"no worker", BindSession{Session: "s", Until: 1}, false},
		{"rank of nobody", BindSession{Session: "s", Worker: "#1", Until: 1}, false},
		{"replace of nobody", BindSession{Session: "s", Worker: "w", Until: 1, Replace: "#2"}, false},
		{"zero until", BindSession{Session: "s", Worker: "w"}, false},
		{"negative until", BindSession{Session: "s", Worker: "w", Until: -5}, false},
		{"unbind session", UnbindSessions{Session: "s"}, true},
		{"unbind worker", UnbindSessions{Worker: "w"}, true},
		{"unbind both", UnbindSessions{Session: "s", Worker: "w"}, false},
		{"unbind neither", UnbindSessions{}, false},
		{"unbind a rank", UnbindSessions{Worker: "w#1"}, false},
		{"unbind a long id", UnbindSessions{Session: long + "x"}, false},
	} {
		err := tc.cmd.Validate()
		if tc.ok != (err == nil) || (err != nil && !errors.Is(err, ErrInvalidCommand)) {
			t.Errorf("%s: %v, want ok %v", tc.name, err, tc.ok)
		}
		// The encoder refuses what Validate refuses (nothing bad reaches the log).
		if _, encErr := Encode(tc.cmd.(Command)); (encErr == nil) != tc.ok {
			t.Errorf("%s: encode %v, want ok %v", tc.name, encErr, tc.ok)
		}
	}
}

// TestFSMSessionApply steps through a session's life: each step's result
// (the binding in force, Applied, the domain error) and the bindings after.
func TestFSMSessionApply(t *testing.T) {
	h := newHarness(t)
	h.ok(Tick{Now: 1000 * sec}) // no effect: nothing can expire yet
	h.ok(BindSession{Session: "warm", Worker: "w9", Until: 1500 * sec})
	h.ok(Tick{Now: 1000 * sec}) // the clock is 1000 s now
	steps := []struct {
		name    string
		cmd     Command
		err     string // substring of the domain error; "" = none
		applied int
		bound   router.WorkerID // the result's binding ("" = none reported)
		until   int64
		count   int
	}{
		{"first turn binds", BindSession{Session: "s1", Worker: "a", Until: 1300 * sec}, "", 1, "a", 1300 * sec, 2},
		{"a concurrent first turn loses", BindSession{Session: "s1", Worker: "b", Until: 1301 * sec}, "", 0, "a", 1300 * sec, 2},
		{"a touch extends", BindSession{Session: "s1", Worker: "a", Until: 1400 * sec}, "", 1, "a", 1400 * sec, 2},
		{"an older touch never shortens", BindSession{Session: "s1", Worker: "a", Until: 1350 * sec}, "", 1, "a", 1400 * sec, 2},
		{"a stale replace loses", BindSession{Session: "s1", Worker: "c", Until: 1400 * sec, Replace: "b"}, "", 0, "a", 1400 * sec, 2},
		{"a replace of the one in force rebinds", BindSession{Session: "s1", Worker: "c#1", Until: 1410 * sec, Replace: "a"}, "", 1, "c#1", 1410 * sec, 2},
		{"a replace of nothing binds", BindSession{Session: "s2", Worker: "d", Parent: "s1", Until: 1300 * sec, Replace: "x"}, "", 1, "d", 1300 * sec, 3},
		{"expired by the clock", BindSession{Session: "s3", Worker: "d", Until: 1000 * sec}, "not after the clock", 0, "", 0, 3},
		{"id too long", rawCommand{CmdBindSession, appendString(appendString(appendString(nil, strings.Repeat("y", 257)), "d"), "")}, "limit 256", 0, "", 0, 3},
		{"unbind", UnbindSessions{Session: "s2"}, "", 1, "", 0, 2},
		{"unbind again", UnbindSessions{Session: "s2"}, "", 0, "", 0, 2},
		{"unbind a worker's ranks", UnbindSessions{Worker: "c"}, "", 1, "", 0, 1},
		// Clamped to a year past the reference: the later of the clock and
		// the earliest lease or prediction (none here); other bindings
		// ("warm", 1500 s) never stretch it.
		{"a far expiry is clamped", BindSession{Session: "s4", Worker: "a", Until: 1000*sec + 2*MaxSessionTTL}, "", 1, "a", 1000*sec + MaxSessionTTL, 2},
	}
	for _, s := range steps {
		var res *ApplyResult
		if r, ok := s.cmd.(rawCommand); ok {
			// What no encoder writes: a proposer of another build, or a forger.
			res = h.raw(r.entry())
		} else {
			res = h.apply(s.cmd)
		}
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
		case s.bound == "" && res.Session != nil:
			t.Errorf("%s: result reports %+v", s.name, *res.Session)
		case s.bound != "" && (res.Session == nil || res.Session.Worker != s.bound || res.Session.Until != s.until):
			t.Errorf("%s: result %+v, want %s until %d", s.name, res.Session, s.bound, s.until)
		}
		if n := h.f.SessionCount(); n != s.count {
			t.Errorf("%s: %d bindings, want %d", s.name, n, s.count)
		}
	}
	if b, ok := h.f.Session("s1"); ok {
		t.Errorf("s1 survived its worker's unbinding: %+v", b)
	}
	// Expiry: a Tick at the expiry ends "warm" (1500 s) but not s4.
	h.ok(Tick{Now: 1060 * sec})
	if res := h.ok(Tick{Now: 1120 * sec}); res.Expired != 0 {
		t.Fatalf("expired %d early", res.Expired)
	}
	for now := int64(1180); now <= 1500; now += 60 {
		h.ok(Tick{Now: now * sec})
	}
	if res := h.ok(Tick{Now: 1501 * sec}); res.Expired != 1 {
		t.Fatalf("tick past the expiry expired %d", res.Expired)
	}
	if _, ok := h.f.Session("warm"); ok || h.f.SessionCount() != 1 {
		t.Fatalf("after expiry: %v", h.f.Sessions())
	}
	if got := h.f.SessionsPerWorker(); len(got) != 1 || got["a"] != 1 {
		t.Fatalf("per worker %v", got)
	}
}

// TestFSMSessionLimit: the 65,537th binding is refused (its proposer
// serves the turn unbound), a touch of a held one still applies, and one
// ending makes room.
func TestFSMSessionLimit(t *testing.T) {
	h := newHarness(t)
	logs := make([]*raft.Log, 0, MaxSessionBindings)
	for i := range MaxSessionBindings {
		logs = append(logs, h.next(mustEncode(t, BindSession{Session: fmt.Sprintf("s%d", i), Worker: "w", Until: 100 * sec})))
	}
	for i, r := range h.f.ApplyBatch(logs) {
		if err := ResponseError(r); err != nil {
			t.Fatalf("binding %d: %v", i, err)
		}
	}
	extra := BindSession{Session: "one-more", Worker: "w", Until: 100 * sec}
	if err := h.f.CheckBindSession(extra); !errors.Is(err, ErrSessionLimit) {
		t.Fatalf("check: %v", err)
	}
	if res := h.apply(extra); !errors.Is(res.Err, ErrSessionLimit) || !errors.Is(res.Err, ErrInvalidCommand) {
		t.Fatalf("binding past the limit: %v", res.Err)
	}
	h.ok(BindSession{Session: "s7", Worker: "w", Until: 200 * sec})
	h.ok(UnbindSessions{Session: "s7"})
	h.ok(extra)
	if n := h.f.SessionCount(); n != MaxSessionBindings {
		t.Fatalf("%d bindings", n)
	}
}

// TestFSMSessionIdempotent: a replayed entry changes nothing (a touch or
// rebind applied twice is applied once).
func TestFSMSessionIdempotent(t *testing.T) {
	h := newHarness(t)
	h.ok(BindSession{Session: "s", Worker: "a", Until: 100 * sec})
	l := h.next(mustEncode(t, BindSession{Session: "s", Worker: "b", Until: 200 * sec, Replace: "a"}))
	h.f.Apply(l)
	before := h.f.Digest()
	if res := h.f.Apply(l).(*ApplyResult); !res.Replayed {
		t.Fatalf("replay applied: %+v", res)
	}
	if h.f.Digest() != before {
		t.Fatal("replay changed the state")
	}
}

// TestFSMSessionExpiryDeterministic: replicas expire the same bindings at
// the same entries whatever the proposers' clocks, one restored midway
// from a snapshot included; refreshes that leave stale heap entries do not
// expire a live binding.
func TestFSMSessionExpiryDeterministic(t *testing.T) {
	var entries [][]byte
	now := int64(1_000) * sec
	entries = append(entries, mustEncode(t, Tick{Now: now}))
	for i := range 40 {
		s := fmt.Sprintf("s%d", i%10)
		entries = append(entries, mustEncode(t, BindSession{Session: s, Worker: router.WorkerKey("w", uint32(i%3)), Until: now + int64(5+i%7)*sec}))
		if i%4 == 0 {
			now += 3 * sec
			entries = append(entries, mustEncode(t, Tick{Now: now}))
		}
	}
	for range 10 {
		now += 2 * sec
		entries = append(entries, mustEncode(t, Tick{Now: now}))
	}
	a, b := newFSM(t), newFSM(t)
	half := len(entries) / 2
	a.ApplyBatch(logsOf(entries, 1))
	b.ApplyBatch(logsOf(entries[:half], 1))
	c := newFSM(t)
	if err := restoreBytes(c, snapshotBytes(t, b)); err != nil {
		t.Fatal(err)
	}
	c.ApplyBatch(logsOf(entries[half:], uint64(half+1)))
	b.ApplyBatch(logsOf(entries[half:], uint64(half+1)))
	sameState(t, a, b)
	sameState(t, a, c)
	for _, s := range a.Sessions() {
		if s.Until <= a.LastTick() {
			t.Errorf("binding %+v outlived the clock %d", s, a.LastTick())
		}
	}
	if n := a.NextExpiry(); a.SessionCount() > 0 && n == 0 {
		t.Error("bindings held but nothing due: the leader would never tick them away")
	}
}

// TestFSMSnapshotSessions: bindings make the snapshot format 7 (with or
// without placements) and restore to the same state and bytes; a state
// without them keeps its older format and digest; a format 5 reader refuses
// format 7; session records in format 5 and records breaking a rule are
// refused.
func TestFSMSnapshotSessions(t *testing.T) {
	placements := goldenStatePlacements(t)
	placementsDigest := placements.Digest()
	f := goldenStateSessions(t)
	if f.Digest() == placementsDigest {
		t.Fatal("sessions do not change the digest")
	}
	b, g := restoreSame(t, f, SnapshotFormatSessions)
	if got := g.Sessions(); len(got) != 4 || got[0].Session != "agent-1" || got[1].Parent != "agent-1" || got[3].Worker != "vllm-0" {
		t.Fatalf("restored sessions %+v", got)
	}
	// Without placements (group count 0) it still restores.
	restoreSame(t, withSessions(t, goldenStateTiers(t)), SnapshotFormatSessions)
	if snap := snapshotBytes(t, placements); snap[4] != 5 || placements.Digest() != placementsDigest {
		t.Fatalf("a state without sessions is format %d", snap[4])
	}
	older := newFSM(t)
	older.newestFormat = 5
	if err := restoreBytes(older, b); !errors.Is(err, ErrCorruptSnapshot) || !strings.Contains(err.Error(), "format version 7, this build reads 1 to 5") {
		t.Fatalf("format 5 build restores format 7: %v", err)
	}
	if err := restoreBytes(newFSM(t), reformat(b, 5)); !errors.Is(err, ErrCorruptSnapshot) {
		t.Fatalf("session records as format 5: %v", err)
	}
	if err := restoreBytes(newFSM(t), reformat(b, 6)); !errors.Is(err, ErrCorruptSnapshot) {
		t.Fatalf("session records as format 6: %v", err)
	}

	header := func(clock int64, groups uint32, sessions int) rawRec {
		body := appendU64(nil, 7)
		body = binary.AppendUvarint(body, 16)
		body = binary.AppendVarint(body, clock)
		for range 7 { // nodes … tier blocks
			body = binary.AppendUvarint(body, 0)
		}
		body = binary.AppendUvarint(body, uint64(groups))
		body = binary.AppendUvarint(body, 0) // placements
		body = binary.AppendUvarint(body, 0) // drains (format 6)
		return rawRec{recHeader, binary.AppendUvarint(body, uint64(sessions))}
	}
	sess := func(id, worker, parent string, until int64) rawRec {
		return rawRec{recSession, appendSessionRecord(nil, &SessionBinding{Session: id, Worker: router.WorkerID(worker), Parent: parent, Until: until}, false)}
	}
	good := reformat(rawSnapshot(header(10, 0, 2), sess("a", "w", "", 20), sess("b", "w#1", "a", 30)), 7)
	if err := restoreBytes(newFSM(t), good); err != nil {
		t.Fatalf("a valid hand-made format 7 snapshot: %v", err)
	}
	for _, tc := range []struct {
		name string
		recs []rawRec
	}{
		{"one group", []rawRec{header(10, 1, 0)}},
		{"expired", []rawRec{header(10, 0, 1), sess("a", "w", "", 10)}},
		{"empty id", []rawRec{header(10, 0, 1), sess("", "w", "", 20)}},
		{"long id", []rawRec{header(10, 0, 1), sess(strings.Repeat("x", 257), "w", "", 20)}},
		{"no worker", []rawRec{header(10, 0, 1), sess("a", "", "", 20)}},
		{"bad parent", []rawRec{header(10, 0, 1), sess("a", "w", "p\x00", 20)}},
		{"repeated", []rawRec{header(10, 0, 2), sess("a", "w", "", 20), sess("a", "v", "", 20)}},
		{"count", []rawRec{header(10, 0, 2), sess("a", "w", "", 20)}},
		{"trailing bytes", []rawRec{header(10, 0, 1), {recSession, append(sess("a", "w", "", 20).body, 0)}}},
	} {
		if err := restoreBytes(newFSM(t), reformat(rawSnapshot(tc.recs...), 7)); !errors.Is(err, ErrCorruptSnapshot) {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
}

// TestFSMSessionsOlderBuild: a build without sessions (newest type 15,
// format 5) applies what comes before the first binding alike, halts on
// BindSession (and on UnbindSessions) without moving, and refuses the
// format 7 snapshot by version.
func TestFSMSessionsOlderBuild(t *testing.T) {
	node := mustEncode(t, RegisterNode{NodeID: "r1", RaftAddr: "a", HTTPAddr: "b"})
	entries := [][]byte{node, mustEncode(t, BindSession{Session: "s", Worker: "w", Until: 100}), mustEncode(t, Tick{Now: 5})}
	older, newer := olderBuildHalts(t, entries, 1, CmdSetGroupsChecked, 5, CmdBindSession)
	if _, ok := newer.Session("s"); !ok {
		t.Fatal("newer build did not bind")
	}
	if err := restoreBytes(older, snapshotBytes(t, newer)); !errors.Is(err, ErrCorruptSnapshot) {
		t.Fatalf("older build restores format 7: %v", err)
	}
	olderBuildHalts(t, [][]byte{node, mustEncode(t, UnbindSessions{Session: "s"})}, 1, CmdSetGroupsChecked, 5, CmdUnbindSessions)
}

// TestFSMSessionResultJSON: a follower forwarding a bind gets the binding
// in force back from the leader, and the limit's sentinel survives.
func TestFSMSessionResultJSON(t *testing.T) {
	in := &ApplyResult{Type: CmdBindSession, Session: &SessionBinding{Session: "s", Worker: "w#1", Parent: "p", Until: 42},
		Err: fmt.Errorf("apply: %w", ErrSessionLimit)}
	raw, err := json.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	out, err := DecodeResult(nil, raw)
	if err != nil {
		t.Fatal(err)
	}
	r := out.(*ApplyResult)
	if r.Session == nil || *r.Session != *in.Session || !errors.Is(r.Err, ErrSessionLimit) || !errors.Is(r.Err, ErrInvalidCommand) {
		t.Fatalf("round trip: %+v (%v)", r, r.Err)
	}
}

// TestFSMSessionCheckTime: a proposer refuses a binding whose expiry is
// far from its clock (a wrong clock or a forged TTL), before the log.
func TestFSMSessionCheckTime(t *testing.T) {
	now := int64(1_700_000_000) * sec
	for _, tc := range []struct {
		until int64
		ok    bool
	}{
		{now + 300*sec, true}, {now + MaxSessionTTL, true}, {now - 30*sec, true},
		{now - 2*MaxProposalSkew, false}, {now + MaxSessionTTL + 2*MaxProposalSkew, false},
	} {
		c := BindSession{Session: "s", Worker: "w", Until: tc.until}
		if err := CheckEntryTime(mustEncode(t, c), now); (err == nil) != tc.ok {
			t.Errorf("until now%+ds: %v, want ok %v", (tc.until-now)/sec, err, tc.ok)
		}
	}
}

// FuzzDecodeSessionCommands: any payload as a command 17 or 18 decodes or
// is refused as undecodable, never panics, and what decodes re-encodes to
// the same command when it is valid (varints may arrive overlong).
func FuzzDecodeSessionCommands(f *testing.F) {
	for _, s := range sessionSeeds(f) {
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
		case BindSession, UnbindSessions:
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

func sessionSeeds(t testing.TB) map[string][]byte {
	seeds := map[string][]byte{}
	for _, c := range goldenCommands() {
		if c.cmd.Type() == CmdBindSession || c.cmd.Type() == CmdUnbindSessions {
			seeds[c.name] = mustEncode(t, c.cmd)
		}
	}
	long := mustEncode(t, BindSession{Session: strings.Repeat("z", MaxSessionIDBytes), Worker: "w", Until: 1})
	seeds["bind-long"] = long
	seeds["bind-truncated"] = long[:len(long)-3]
	seeds["unbind-empty"] = []byte{byte(CmdUnbindSessions), 1, 0, 0}
	return seeds
}

// TestFSMSessionClock: after a quiet hour an honest Tick reaches a due
// binding (it lands just before it, the next expires it), and a binding a
// year out does not stretch the bound on a lease (a forged far lease is
// still clamped to a day past the clock).
func TestFSMSessionClock(t *testing.T) {
	h := newHarness(t)
	h.ok(BindSession{Session: "first", Worker: "w", Until: 10 * sec})
	h.ok(Tick{Now: 5 * sec})
	h.ok(BindSession{Session: "hour", Worker: "w", Until: 3600 * sec})
	h.ok(BindSession{Session: "year", Worker: "w", Until: 5*sec + MaxSessionTTL})
	h.ok(Tick{Now: 11 * sec}) // "first" expires
	res := h.ok(Tick{Now: 3601 * sec})
	if !res.Clamped || h.f.LastTick() != 3600*sec-1 {
		t.Fatalf("a tick after a quiet hour: clock %d, clamped %v", h.f.LastTick(), res.Clamped)
	}
	if res := h.ok(Tick{Now: 3602 * sec}); res.Expired != 1 {
		t.Fatalf("the next tick expired %d", res.Expired)
	}
	h.ok(RegisterWorker{ID: "forged", DPRanks: 1, LeaseUntil: MaxSessionTTL})
	if w, _ := h.f.Worker("forged"); w.LeaseUntil != h.f.LastTick()+MaxTimeAhead {
		t.Fatalf("a forged lease became %d, clock %d", w.LeaseUntil, h.f.LastTick())
	}
}
