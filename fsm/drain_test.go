package fsm

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
)

func TestFSMWorkerDrainValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		c    SetWorkerDrain
		ok   bool
	}{
		{"drain", SetWorkerDrain{Worker: "w", Drained: true}, true},
		{"drain with deadline", SetWorkerDrain{Worker: "w", Drained: true, Deadline: 5}, true},
		{"undrain", SetWorkerDrain{Worker: "w"}, true},
		{"complete", SetWorkerDrain{Worker: "w", Drained: true, Deregister: true}, true},
		{"empty id", SetWorkerDrain{Drained: true}, false},
		{"rank id", SetWorkerDrain{Worker: "w#1", Drained: true}, false},
		{"long id", SetWorkerDrain{Worker: strings.Repeat("w", MaxStringLen+1), Drained: true}, false},
		{"deregister undrained", SetWorkerDrain{Worker: "w", Deregister: true}, false},
		{"negative deadline", SetWorkerDrain{Worker: "w", Drained: true, Deadline: -1}, false},
		{"undrain with deadline", SetWorkerDrain{Worker: "w", Deadline: 5}, false},
		{"complete with deadline", SetWorkerDrain{Worker: "w", Drained: true, Deregister: true, Deadline: 5}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.c.Validate()
			if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrInvalidCommand)) {
				t.Fatalf("Validate: %v", err)
			}
			_, encErr := Encode(tc.c)
			if (encErr == nil) != tc.ok {
				t.Fatalf("Encode: %v, Validate: %v", encErr, err)
			}
		})
	}
}

// TestFSMWorkerDrainDecode: the decoder refuses every shape the encoder
// refuses (one encoding per meaning) and unknown flag bits; an empty or
// rank id decodes and is refused on apply, like every worker command.
func TestFSMWorkerDrainDecode(t *testing.T) {
	entry := func(id string, flags byte, deadline int64) []byte {
		b := appendString([]byte{byte(CmdSetWorkerDrain), EnvelopeVersion}, id)
		return binary.AppendVarint(append(b, flags), deadline)
	}
	for _, tc := range []struct {
		name string
		data []byte
	}{
		{"unknown flag", entry("w", 4|drainFlagDrained, 0)},
		{"deregister undrained", entry("w", drainFlagDeregister, 0)},
		{"negative deadline", entry("w", drainFlagDrained, -5)},
		{"undrain with deadline", entry("w", 0, 5)},
		{"complete with deadline", entry("w", drainFlagDrained|drainFlagDeregister, 5)},
		{"no deadline", entry("w", 1, 0)[:4]},
		{"trailing bytes", append(entry("w", 1, 0), 0)},
	} {
		if _, err := Decode(tc.data); !errors.Is(err, ErrUndecodable) {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
	for _, id := range []string{"", "w#0"} {
		c, err := DecodeSetWorkerDrain(entry(id, drainFlagDrained, 0))
		if err != nil || c.Worker != id {
			t.Fatalf("id %q: %+v %v", id, c, err)
		}
		h := newHarness(t)
		if res := h.raw(entry(id, drainFlagDrained, 0)); !errors.Is(res.Err, ErrInvalidCommand) {
			t.Fatalf("apply id %q: %v", id, res.Err)
		}
	}
}

// TestFSMWorkerDrainApply walks a worker through drains, undrains and a
// completion, checking each step's outcome, change and state.
func TestFSMWorkerDrainApply(t *testing.T) {
	h := newHarness(t)
	h.ok(worker("a", 2))
	h.ok(worker("b", 1))
	var changes []Change
	h.f.OnChange(func(c Change) { changes = append(changes, c) })
	undrained := h.f.Digest()

	type step struct {
		name    string
		c       Command
		err     error  // the domain error, or nil
		change  string // the reason of the one change reported, "" = none
		drained map[string]int64
	}
	steps := []step{
		{"unknown worker", SetWorkerDrain{Worker: "x", Drained: true}, ErrUnknownWorker, "", nil},
		{"complete an undrained worker", SetWorkerDrain{Worker: "a", Drained: true, Deregister: true}, ErrNotDrained, "", nil},
		{"undrain an undrained worker", SetWorkerDrain{Worker: "a"}, nil, "", nil},
		{"drain", SetWorkerDrain{Worker: "a", Drained: true}, nil, "drained", map[string]int64{"a": 0}},
		{"drain again", SetWorkerDrain{Worker: "a", Drained: true}, nil, "", map[string]int64{"a": 0}},
		{"deadline", SetWorkerDrain{Worker: "a", Drained: true, Deadline: 90}, nil, "drain deadline changed", map[string]int64{"a": 90}},
		{"renewal keeps the drain", worker("a", 2), nil, "", map[string]int64{"a": 90}},
		{"undrain", SetWorkerDrain{Worker: "a"}, nil, "undrained", nil},
		{"drain b", SetWorkerDrain{Worker: "b", Drained: true, Deadline: 7}, nil, "drained", map[string]int64{"b": 7}},
		{"complete b", SetWorkerDrain{Worker: "b", Drained: true, Deregister: true}, nil, "drained", nil},
		{"complete b again", SetWorkerDrain{Worker: "b", Drained: true, Deregister: true}, ErrUnknownWorker, "", nil},
		{"b comes back undrained", worker("b", 1), nil, "registered", nil},
		{"a stale completion spares b", SetWorkerDrain{Worker: "b", Drained: true, Deregister: true}, ErrNotDrained, "", nil},
	}
	for _, s := range steps {
		changes = nil
		before := h.f.Digest()
		res := h.apply(s.c)
		if !errors.Is(res.Err, s.err) || (s.err == nil) != (res.Err == nil) {
			t.Fatalf("%s: err %v, want %v", s.name, res.Err, s.err)
		}
		if s.err != nil && h.f.Digest() != before {
			t.Fatalf("%s: a refused command changed the state", s.name)
		}
		switch {
		case s.change == "" && len(changes) != 0:
			t.Fatalf("%s: changes %+v, want none", s.name, changes)
		case s.change != "" && (len(changes) != 1 || changes[0].Reason != s.change):
			t.Fatalf("%s: changes %+v, want %q", s.name, changes, s.change)
		}
		got := map[string]int64{}
		for _, d := range h.f.Drains() {
			got[d.Worker] = d.Deadline
		}
		if len(got) != len(s.drained) {
			t.Fatalf("%s: drains %v, want %v", s.name, got, s.drained)
		}
		for w, dl := range s.drained {
			if d, ok := h.f.Drain(w); !ok || d.Deadline != dl || got[w] != dl {
				t.Fatalf("%s: drain of %s %+v %v, want deadline %d", s.name, w, d, ok, dl)
			}
		}
	}
	if _, ok := h.f.Worker("b"); !ok {
		t.Fatal("the stale completion removed b")
	}
	// Completing b removed it with everything it had: b is back and a
	// undrained, so the state is the one before any drain (b's re-registration
	// is identical to its first).
	if h.f.Digest() != undrained {
		t.Fatal("undrained state does not digest as before the drains")
	}
	if err := h.f.CheckWorkerDrain(SetWorkerDrain{Worker: "a", Drained: true, Deregister: true}); !errors.Is(err, ErrNotDrained) {
		t.Fatalf("CheckWorkerDrain: %v", err)
	}
}

// TestFSMWorkerDrainLeaseExpiry: a drained worker whose lease expires
// goes with its drain; registered again it is not drained.
func TestFSMWorkerDrainLeaseExpiry(t *testing.T) {
	h := newHarness(t)
	h.ok(Tick{Now: 1_000})
	w := worker("a", 1)
	w.LeaseUntil = 5_000
	h.ok(w)
	h.ok(SetWorkerDrain{Worker: "a", Drained: true})
	// The first clocked tick lands just before the lease (DESIGN.md, The
	// clock); the next one expires it.
	h.ok(Tick{Now: 6_000})
	h.ok(Tick{Now: 6_001})
	if _, ok := h.f.Worker("a"); ok {
		t.Fatal("lease did not expire")
	}
	h.ok(worker("a", 1))
	if _, ok := h.f.Drain("a"); ok || len(h.f.Drains()) != 0 {
		t.Fatal("a worker registered again is still drained")
	}
}

// TestFSMWorkerDrainDigest: a drain changes the digest (replicas that
// disagree on it disagree on the digest), its deadline too, and an
// undrain brings the digest back.
func TestFSMWorkerDrainDigest(t *testing.T) {
	h := newHarness(t)
	h.ok(worker("a", 1))
	d0 := h.f.Digest()
	h.ok(SetWorkerDrain{Worker: "a", Drained: true})
	d1 := h.f.Digest()
	h.ok(SetWorkerDrain{Worker: "a", Drained: true, Deadline: 3})
	d2 := h.f.Digest()
	h.ok(SetWorkerDrain{Worker: "a"})
	if d1 == d0 || d2 == d1 || d2 == d0 || h.f.Digest() != d0 {
		t.Fatalf("digests %s %s %s %s", d0, d1, d2, h.f.Digest())
	}
}

// goldenStateDrains is goldenStatePlacements with two workers drained,
// one with a deadline: the state pinned by testdata/snapshot-v6.bin.
func goldenStateDrains(t testing.TB) *FSM {
	f := goldenStatePlacements(t)
	h := &harness{t: t, f: f, idx: f.AppliedIndex()}
	ids := []string{}
	for _, w := range f.Workers() {
		ids = append(ids, w.ID)
	}
	slices.Sort(ids)
	h.ok(SetWorkerDrain{Worker: ids[0], Drained: true, Deadline: 1_700_000_300_000_000_000})
	h.ok(SetWorkerDrain{Worker: ids[len(ids)-1], Drained: true})
	return f
}

// TestFSMSnapshotDrains: drains make the snapshot format 6, also in a
// data group's state (no group count), restore to the same state and
// bytes; an undrained state keeps its older format and digest; format 5
// readers refuse format 6, drain records in format 5 are refused, and so
// is a format 6 snapshot breaking a drain rule.
func TestFSMSnapshotDrains(t *testing.T) {
	placements := goldenStatePlacements(t)
	placementsDigest := placements.Digest()
	f := goldenStateDrains(t)
	if f.Digest() == placementsDigest {
		t.Fatal("drains do not change the digest")
	}
	b, g := restoreSame(t, f, 6)
	if !slices.Equal(g.Drains(), f.Drains()) || len(g.Drains()) != 2 {
		t.Fatalf("restored drains %v, want %v", g.Drains(), f.Drains())
	}
	if snap := snapshotBytes(t, placements); snap[4] != 5 {
		t.Fatalf("an undrained state is format %d", snap[4])
	}

	// A data group's state: workers, a drain, no group count.
	h := newHarness(t)
	h.ok(worker("a", 1))
	h.ok(worker("b", 2))
	plain := h.f.Digest()
	h.ok(SetWorkerDrain{Worker: "b", Drained: true, Deadline: 9})
	_, g = restoreSame(t, h.f, 6)
	if d, ok := g.Drain("b"); !ok || d.Deadline != 9 || g.PlacementGroups() != 0 {
		t.Fatalf("restored drain %+v %v groups %d", d, ok, g.PlacementGroups())
	}
	h.ok(SetWorkerDrain{Worker: "b"})
	if snap := snapshotBytes(t, h.f); snap[4] != 1 || h.f.Digest() != plain {
		t.Fatalf("undrained again: format %d", snap[4])
	}

	older := newFSM(t)
	older.newestFormat = 5
	if err := restoreBytes(older, b); !errors.Is(err, ErrCorruptSnapshot) || !strings.Contains(err.Error(), "format version 6, this build reads 1 to 5") {
		t.Fatalf("format 5 build restores format 6: %v", err)
	}
	if err := restoreBytes(newFSM(t), reformat(b, 5)); !errors.Is(err, ErrCorruptSnapshot) {
		t.Fatalf("drain records as format 5: %v", err)
	}

	// Format 6 streams that break a rule, built record by record: a
	// worker "a" with one rank, then its drains.
	header := func(groups uint32, drains int) rawRec {
		body := appendU64(nil, 7)
		body = binary.AppendUvarint(body, 16)
		body = binary.AppendVarint(body, 0)
		for _, n := range []int{0, 1, 0, 1, 0, 0, 0} { // nodes, workers, models, cursors, blocks, preds, tier blocks
			body = binary.AppendUvarint(body, uint64(n))
		}
		body = binary.AppendUvarint(body, uint64(groups))
		body = binary.AppendUvarint(body, 0) // placements
		return rawRec{recHeader, binary.AppendUvarint(body, uint64(drains))}
	}
	rw := worker("a", 1)
	rw.BlockSize = 16
	wrec, err := appendRegisterWorker(nil, &rw)
	if err != nil {
		t.Fatal(err)
	}
	cursor := rawRec{recCursor, append(binary.AppendUvarint(binary.AppendUvarint(appendString(nil, "a"), 0), 0), 0)}
	drain := func(w string, deadline int64) rawRec {
		return rawRec{recDrain, binary.AppendVarint(appendString(nil, w), deadline)}
	}
	good := reformat(rawSnapshot(header(0, 1), rawRec{recWorker, wrec}, cursor, drain("a", 4)), 6)
	if err := restoreBytes(newFSM(t), good); err != nil {
		t.Fatalf("a valid hand-made format 6 snapshot: %v", err)
	}
	for _, tc := range []struct {
		name string
		recs []rawRec
	}{
		{"one group", []rawRec{header(1, 1), {recWorker, wrec}, cursor, drain("a", 0)}},
		{"unregistered worker", []rawRec{header(0, 1), {recWorker, wrec}, cursor, drain("b", 0)}},
		{"repeated", []rawRec{header(0, 2), {recWorker, wrec}, cursor, drain("a", 0), drain("a", 1)}},
		{"negative deadline", []rawRec{header(0, 1), {recWorker, wrec}, cursor, drain("a", -1)}},
		{"count", []rawRec{header(0, 2), {recWorker, wrec}, cursor, drain("a", 0)}},
		{"trailing bytes", []rawRec{header(0, 1), {recWorker, wrec}, cursor, {recDrain, append(drain("a", 0).body, 0)}}},
	} {
		if err := restoreBytes(newFSM(t), reformat(rawSnapshot(tc.recs...), 6)); !errors.Is(err, ErrCorruptSnapshot) {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
}

// TestFSMWorkerDrainOlderBuild: a build without drains (newest type 15,
// format 5) applies what comes before the first drain alike, halts on it
// without moving — rather than keep routing to a worker every newer
// replica excludes — and refuses the format 6 snapshot by version.
func TestFSMWorkerDrainOlderBuild(t *testing.T) {
	entries := [][]byte{
		mustEncode(t, worker("w", 1)),
		mustEncode(t, SetWorkerDrain{Worker: "w", Drained: true, Deadline: 10}),
		mustEncode(t, SetWorkerDrain{Worker: "w", Drained: true, Deregister: true}),
	}
	older, newer := olderBuildHalts(t, entries, 1, CmdSetGroupsChecked, 5, CmdSetWorkerDrain)
	if _, ok := newer.Worker("w"); ok {
		t.Fatal("newer build did not complete the drain")
	}
	if _, ok := older.Worker("w"); !ok {
		t.Fatal("the halted build moved")
	}
	// The snapshot of a drained worker, before its completion.
	mid := newFSM(t)
	mid.ApplyBatch(logsOf(entries[:2], 1))
	if err := restoreBytes(older, snapshotBytes(t, mid)); !errors.Is(err, ErrCorruptSnapshot) {
		t.Fatalf("older build restores format 6: %v", err)
	}
}

// TestFSMWorkerDrainCheckTime: a drain deadline far from the proposer's
// clock is refused before proposing, as a lease is.
func TestFSMWorkerDrainCheckTime(t *testing.T) {
	const now = 1_000 * nanosPerSecond
	for _, tc := range []struct {
		deadline int64
		ok       bool
	}{
		{0, true}, {now + 60*nanosPerSecond, true}, {now - 2*MaxProposalSkew, false}, {now + 2*MaxTimeAhead, false},
	} {
		c := SetWorkerDrain{Worker: "w", Drained: true, Deadline: tc.deadline}
		if err := CheckTime(c, now); (err == nil) != tc.ok {
			t.Errorf("deadline %d: %v", tc.deadline, err)
		}
		if err := CheckEntryTime(mustEncode(t, c), now); (err == nil) != tc.ok {
			t.Errorf("entry with deadline %d: %v", tc.deadline, err)
		}
	}
}

// TestFSMWorkerDrainResultJSON: a refused completion forwarded from the
// leader (its ApplyResult as JSON) still satisfies errors.Is for
// ErrNotDrained and ErrInvalidCommand, so a follower proposing it tells
// "nothing to complete" from a failure.
func TestFSMWorkerDrainResultJSON(t *testing.T) {
	h := newHarness(t)
	h.ok(worker("a", 1))
	r := h.apply(SetWorkerDrain{Worker: "a", Drained: true, Deregister: true})
	raw, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	var back ApplyResult
	if err := json.Unmarshal(raw, &back); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(back.Err, ErrNotDrained) || !errors.Is(back.Err, ErrInvalidCommand) || back.Err.Error() != r.Err.Error() {
		t.Fatalf("%s → %v", raw, back.Err)
	}
}
