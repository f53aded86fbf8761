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

	"github.com/hashicorp/raft"
)

func TestFSMPlaceWorkerValidate(t *testing.T) {
	cases := []struct {
		name string
		p    PlaceWorker
		ok   bool
	}{
		{"first group", PlaceWorker{Worker: "w", Group: 1, Groups: 2}, true},
		{"last group", PlaceWorker{Worker: "w", Group: 2, Groups: 2}, true},
		{"remove", PlaceWorker{Worker: "w", Group: 3, Groups: 4, Remove: true}, true},
		{"empty worker", PlaceWorker{Group: 1, Groups: 2}, false},
		{"rank id", PlaceWorker{Worker: "w#1", Group: 1, Groups: 2}, false},
		{"one group", PlaceWorker{Worker: "w", Group: 1, Groups: 1}, false},
		{"no groups", PlaceWorker{Worker: "w"}, false},
		{"control group", PlaceWorker{Worker: "w", Group: 0, Groups: 2}, false},
		{"group past groups", PlaceWorker{Worker: "w", Group: 3, Groups: 2}, false},
		{"remove from group 0", PlaceWorker{Worker: "w", Group: 0, Groups: 2, Remove: true}, false},
		{"remove past groups", PlaceWorker{Worker: "w", Group: 5, Groups: 4, Remove: true}, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.p.Validate()
			if tc.ok != (err == nil) || (err != nil && !errors.Is(err, ErrInvalidCommand)) {
				t.Fatalf("Validate: %v, want ok %v", err, tc.ok)
			}
		})
	}
}

// TestFSMPlacementApply runs one cluster's placements step by step: each
// step's outcome, the map and group count after it, and the changes
// observers heard.
func TestFSMPlacementApply(t *testing.T) {
	h := newHarness(t)
	var heard []Change
	h.f.OnChange(func(c Change) { heard = append(heard, c) })
	steps := []struct {
		name   string
		p      PlaceWorker
		err    string // substring of the domain error; "" = applies
		want   map[string]uint32
		groups uint32
		change string // Reason of the ChangePlacement heard; "" = none
	}{
		{"remove before any placement fixes nothing", PlaceWorker{Worker: "a", Group: 1, Groups: 3, Remove: true},
			"", map[string]uint32{}, 0, ""},
		{"invalid", PlaceWorker{Worker: "a", Group: 4, Groups: 3}, "group 4 outside [1,3]", map[string]uint32{}, 0, ""},
		{"first placement fixes the groups", PlaceWorker{Worker: "a", Group: 2, Groups: 3},
			"", map[string]uint32{"a": 2}, 3, "placed in group 2"},
		{"same group is a no-op", PlaceWorker{Worker: "a", Group: 2, Groups: 3}, "", map[string]uint32{"a": 2}, 3, ""},
		{"another worker", PlaceWorker{Worker: "b", Group: 1, Groups: 3},
			"", map[string]uint32{"a": 2, "b": 1}, 3, "placed in group 1"},
		{"move", PlaceWorker{Worker: "a", Group: 3, Groups: 3},
			"", map[string]uint32{"a": 3, "b": 1}, 3, "moved from group 2 to 3"},
		{"other group count", PlaceWorker{Worker: "c", Group: 1, Groups: 4},
			"proposed for 4 data groups, the placements are for 3", map[string]uint32{"a": 3, "b": 1}, 3, ""},
		{"remove with another group count", PlaceWorker{Worker: "a", Group: 1, Groups: 2, Remove: true},
			"proposed for 2 data groups, the placements are for 3", map[string]uint32{"a": 3, "b": 1}, 3, ""},
		{"remove from whatever group", PlaceWorker{Worker: "a", Group: 1, Groups: 3, Remove: true},
			"", map[string]uint32{"b": 1}, 3, "removed from group 3"},
		{"remove absent", PlaceWorker{Worker: "a", Group: 1, Groups: 3, Remove: true}, "", map[string]uint32{"b": 1}, 3, ""},
		{"the groups outlive the placements", PlaceWorker{Worker: "b", Group: 1, Groups: 3, Remove: true},
			"", map[string]uint32{}, 3, "removed from group 1"},
		{"and still refuse another count", PlaceWorker{Worker: "b", Group: 1, Groups: 2},
			"the placements are for 3", map[string]uint32{}, 3, ""},
	}
	for _, s := range steps {
		heard = nil
		before, domainErrs := h.f.Digest(), h.f.Stats().DomainErrors
		checkErr := h.f.CheckPlaceWorker(s.p)
		r := h.apply(s.p)
		if s.err == "" {
			if r.Err != nil || checkErr != nil || r.Applied != 1 {
				t.Fatalf("%s: %v (check %v), applied %d", s.name, r.Err, checkErr, r.Applied)
			}
		} else {
			if !errors.Is(r.Err, ErrInvalidCommand) || !strings.Contains(r.Err.Error(), s.err) || !errors.Is(checkErr, ErrInvalidCommand) {
				t.Fatalf("%s: %v (check %v), want %q", s.name, r.Err, checkErr, s.err)
			}
			if h.f.Digest() != before || h.f.Stats().DomainErrors != domainErrs+1 {
				t.Fatalf("%s: a refused placement changed the state or was not counted", s.name)
			}
		}
		if got := h.f.Placements(); !maps.Equal(got, s.want) || h.f.PlacementGroups() != s.groups {
			t.Fatalf("%s: placements %v groups %d, want %v %d", s.name, got, h.f.PlacementGroups(), s.want, s.groups)
		}
		for w, g := range s.want {
			if got, ok := h.f.Placement(w); !ok || got != g {
				t.Fatalf("%s: Placement(%s) = %d %v", s.name, w, got, ok)
			}
		}
		if _, ok := h.f.Placement(s.p.Worker); ok != (s.want[s.p.Worker] != 0) {
			t.Fatalf("%s: Placement(%s) ok %v", s.name, s.p.Worker, ok)
		}
		var reasons []string
		for _, c := range heard {
			if c.Kind != ChangePlacement || c.Worker != s.p.Worker || c.Index != h.idx || c.Removed != s.p.Remove {
				t.Fatalf("%s: heard %+v", s.name, c)
			}
			reasons = append(reasons, c.Reason)
		}
		if want := slices.DeleteFunc([]string{s.change}, func(x string) bool { return x == "" }); !slices.Equal(reasons, want) {
			t.Fatalf("%s: changes %q, want %q", s.name, reasons, want)
		}
	}
	if ChangePlacement.String() != "placement" || ChangePlacement != ChangeOverCapacity+1 {
		t.Fatalf("ChangePlacement = %d %q: append-only, after ChangeOverCapacity", ChangePlacement, ChangePlacement)
	}
	// Readers get copies.
	h.ok(PlaceWorker{Worker: "x", Group: 1, Groups: 3})
	h.f.Placements()["x"] = 2
	if g, _ := h.f.Placement("x"); g != 1 {
		t.Fatal("Placements returned the FSM's own map")
	}
}

// goldenStatePlacements is goldenStateTiers plus placements in 3 data
// groups (one moved, one removed, one of a worker not registered here:
// the control group registers none): the state pinned by
// testdata/snapshot-v5.bin.
func goldenStatePlacements(t testing.TB) *FSM {
	return withPlacements(t, goldenStateTiers(t))
}

func withPlacements(t testing.TB, f *FSM) *FSM {
	h := &harness{t: t, f: f, idx: f.AppliedIndex()}
	for _, p := range []PlaceWorker{
		{Worker: "vllm-0", Group: 1, Groups: 3},
		{Worker: "mistral-0", Group: 3, Groups: 3},
		{Worker: "kvmock-1", Group: 2, Groups: 3},
		{Worker: "gone", Group: 2, Groups: 3},
		{Worker: "elsewhere-0", Group: 3, Groups: 3},
		{Worker: "mistral-0", Group: 1, Groups: 3},
		{Worker: "gone", Group: 2, Groups: 3, Remove: true},
	} {
		h.ok(p)
	}
	return f
}

// TestFSMSnapshotPlacements: placements make the snapshot format 5, with
// or without lower-tier blocks, and restore to the same state and bytes;
// the group count keeps it format 5 after the last placement goes; a
// state never placed keeps its older format and digest; format 4 readers
// refuse format 5, placement records in format 4 are refused, and so is
// a format 5 snapshot breaking a placement rule.
func TestFSMSnapshotPlacements(t *testing.T) {
	tiers, blockSizes := goldenStateTiers(t), goldenStateBlockSizes(t)
	tiersDigest := tiers.Digest()
	f := goldenStatePlacements(t)
	if f.Digest() == tiersDigest {
		t.Fatal("placements do not change the digest")
	}
	b, g := restoreSame(t, f, 5)
	if want := map[string]uint32{"vllm-0": 1, "mistral-0": 1, "kvmock-1": 2, "elsewhere-0": 3}; !maps.Equal(g.Placements(), want) || g.PlacementGroups() != 3 {
		t.Fatalf("restored placements %v groups %d", g.Placements(), g.PlacementGroups())
	}
	// Without tiers the header's tier count is 0, and it still restores.
	restoreSame(t, withPlacements(t, blockSizes), 5)
	// The state before anything was placed keeps its format and digest.
	if snap := snapshotBytes(t, tiers); snap[4] != 4 || tiers.Digest() != tiersDigest {
		t.Fatalf("a state never placed is format %d", snap[4])
	}

	older := newFSM(t)
	older.newestFormat = 4
	if err := restoreBytes(older, b); !errors.Is(err, ErrCorruptSnapshot) || !strings.Contains(err.Error(), "format version 5, this build reads 1 to 4") {
		t.Fatalf("format 4 build restores format 5: %v", err)
	}
	if err := restoreBytes(newFSM(t), reformat(b, 4)); !errors.Is(err, ErrCorruptSnapshot) {
		t.Fatalf("placement records as format 4: %v", err)
	}

	// Removing every placement leaves the group count: still format 5.
	h := &harness{t: t, f: f, idx: f.AppliedIndex()}
	for w := range f.Placements() {
		h.ok(PlaceWorker{Worker: w, Group: 1, Groups: 3, Remove: true})
	}
	_, g = restoreSame(t, f, 5)
	if len(g.Placements()) != 0 || g.PlacementGroups() != 3 || f.Digest() == tiersDigest {
		t.Fatalf("emptied placements restore as %v groups %d", g.Placements(), g.PlacementGroups())
	}

	// Format 5 streams that break a rule, built record by record.
	header := func(groups uint32, placements int) rawRec {
		body := appendU64(nil, 7)
		body = binary.AppendUvarint(body, 16)
		body = binary.AppendVarint(body, 0)
		for range 7 { // nodes … tier blocks
			body = binary.AppendUvarint(body, 0)
		}
		body = binary.AppendUvarint(body, uint64(groups))
		return rawRec{recHeader, binary.AppendUvarint(body, uint64(placements))}
	}
	place := func(w string, g uint32) rawRec {
		return rawRec{recPlacement, binary.AppendUvarint(appendString(nil, w), uint64(g))}
	}
	good := reformat(rawSnapshot(header(2, 2), place("a", 1), place("b", 2)), 5)
	if err := restoreBytes(newFSM(t), good); err != nil {
		t.Fatalf("a valid hand-made format 5 snapshot: %v", err)
	}
	for _, tc := range []struct {
		name string
		recs []rawRec
	}{
		{"one group", []rawRec{header(1, 1), place("a", 1)}},
		{"no groups", []rawRec{header(0, 0)}},
		{"group 0", []rawRec{header(2, 1), place("a", 0)}},
		{"group past the groups", []rawRec{header(2, 1), place("a", 3)}},
		{"rank id", []rawRec{header(2, 1), place("a#0", 1)}},
		{"empty worker", []rawRec{header(2, 1), place("", 1)}},
		{"repeated", []rawRec{header(2, 2), place("a", 1), place("a", 2)}},
		{"count", []rawRec{header(2, 2), place("a", 1)}},
		{"trailing bytes", []rawRec{header(2, 1), {recPlacement, append(place("a", 1).body, 0)}}},
	} {
		if err := restoreBytes(newFSM(t), reformat(rawSnapshot(tc.recs...), 5)); !errors.Is(err, ErrCorruptSnapshot) {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
}

// reformat is snapshot b relabelled as format v, its CRC recomputed.
func reformat(b []byte, v byte) []byte {
	b = bytes.Clone(b)
	b[4] = v
	binary.LittleEndian.PutUint32(b[len(b)-4:], crc32.Checksum(b[:len(b)-4], castagnoli))
	return b
}

// TestFSMPlacementOlderBuild: a build without placements (newest type
// 12, format 4) applies what comes before the first placement alike,
// halts on it without moving, and refuses the format 5 snapshot by
// version.
func TestFSMPlacementOlderBuild(t *testing.T) {
	entries := [][]byte{
		mustEncode(t, RegisterNode{NodeID: "r1", RaftAddr: "a", HTTPAddr: "b"}),
		mustEncode(t, PlaceWorker{Worker: "w", Group: 1, Groups: 2}),
		mustEncode(t, Tick{Now: 5}),
	}
	older, newer := olderBuildHalts(t, entries, 1, CmdKVEventBatchTiered, 4, CmdPlaceWorker)
	if g, ok := newer.Placement("w"); !ok || g != 1 {
		t.Fatal("newer build did not apply the placement")
	}
	if err := restoreBytes(older, snapshotBytes(t, newer)); !errors.Is(err, ErrCorruptSnapshot) {
		t.Fatalf("older build restores format 5: %v", err)
	}
}

func TestFSMSetGroupsValidate(t *testing.T) {
	cases := []struct {
		groups uint32
		ok     bool
	}{{0, false}, {1, false}, {2, true}, {3, true}, {MaxDataGroups, true}, {MaxDataGroups + 1, false}, {1 << 31, false}}
	for _, tc := range cases {
		err := SetGroups{Groups: tc.groups}.Validate()
		if tc.ok != (err == nil) || (err != nil && !errors.Is(err, ErrInvalidCommand)) {
			t.Errorf("SetGroups{%d}.Validate: %v, want ok %v", tc.groups, err, tc.ok)
		}
	}
}

// TestFSMSetGroupsApply grows a cluster's data groups step by step,
// SetGroups and PlaceWorker interleaved: each step's outcome (CheckSetGroups
// and CheckPlaceWorker agree with Apply), the group count and map after
// it, and the changes observers heard.
func TestFSMSetGroupsApply(t *testing.T) {
	h := newHarness(t)
	var heard []Change
	h.f.OnChange(func(c Change) { heard = append(heard, c) })
	place := func(w string, g, groups uint32) Command { return PlaceWorker{Worker: w, Group: g, Groups: groups} }
	steps := []struct {
		name   string
		cmd    Command
		err    string // substring of the domain error; "" = applies
		groups uint32
		want   map[string]uint32
		change string // "<kind>: <reason>" heard; "" = none
	}{
		{"one group", SetGroups{Groups: 1}, "1 data groups outside [2,64]", 0, map[string]uint32{}, ""},
		{"too many", SetGroups{Groups: 65}, "65 data groups outside [2,64]", 0, map[string]uint32{}, ""},
		{"before any placement it fixes the count", SetGroups{Groups: 2}, "", 2, map[string]uint32{}, "groups: data groups 0 → 2"},
		{"the same count is a no-op", SetGroups{Groups: 2}, "", 2, map[string]uint32{}, ""},
		{"placements follow it", place("a", 2, 2), "", 2, map[string]uint32{"a": 2}, "placement: placed in group 2"},
		{"a group beyond it", place("b", 3, 3), "proposed for 3 data groups, the placements are for 2", 2, map[string]uint32{"a": 2}, ""},
		{"raise", SetGroups{Groups: 3}, "", 3, map[string]uint32{"a": 2}, "groups: data groups 2 → 3"},
		{"the new group", place("b", 3, 3), "", 3, map[string]uint32{"a": 2, "b": 3}, "placement: placed in group 3"},
		{"an old group with the new count", place("c", 1, 3), "", 3, map[string]uint32{"a": 2, "b": 3, "c": 1}, "placement: placed in group 1"},
		{"the old count is refused", place("d", 1, 2), "proposed for 2 data groups, the placements are for 3", 3,
			map[string]uint32{"a": 2, "b": 3, "c": 1}, ""},
		{"a removal with the old count too", PlaceWorker{Worker: "a", Group: 2, Groups: 2, Remove: true},
			"proposed for 2 data groups, the placements are for 3", 3, map[string]uint32{"a": 2, "b": 3, "c": 1}, ""},
		{"move into the new group", place("a", 3, 3), "", 3, map[string]uint32{"a": 3, "b": 3, "c": 1}, "placement: moved from group 2 to 3"},
		{"shrink", SetGroups{Groups: 2}, "cannot shrink from 3 to 2: workers placed in the groups beyond would be lost", 3,
			map[string]uint32{"a": 3, "b": 3, "c": 1}, ""},
		{"raise again", SetGroups{Groups: 64}, "", 64, map[string]uint32{"a": 3, "b": 3, "c": 1}, "groups: data groups 3 → 64"},
		{"the last group", place("d", 64, 64), "", 64, map[string]uint32{"a": 3, "b": 3, "c": 1, "d": 64}, "placement: placed in group 64"},
		{"past the bound", SetGroups{Groups: 65}, "outside [2,64]", 64, map[string]uint32{"a": 3, "b": 3, "c": 1, "d": 64}, ""},
	}
	for _, s := range steps {
		heard = nil
		before, domainErrs := h.f.Digest(), h.f.Stats().DomainErrors
		var checkErr error
		switch c := s.cmd.(type) {
		case SetGroups:
			checkErr = h.f.CheckSetGroups(c)
		case PlaceWorker:
			checkErr = h.f.CheckPlaceWorker(c)
		}
		r := h.apply(s.cmd)
		if s.err == "" {
			if r.Err != nil || checkErr != nil || r.Applied != 1 {
				t.Fatalf("%s: %v (check %v), applied %d", s.name, r.Err, checkErr, r.Applied)
			}
		} else {
			if !errors.Is(r.Err, ErrInvalidCommand) || !strings.Contains(r.Err.Error(), s.err) ||
				!errors.Is(checkErr, ErrInvalidCommand) || !strings.Contains(checkErr.Error(), s.err) {
				t.Fatalf("%s: %v (check %v), want %q", s.name, r.Err, checkErr, s.err)
			}
			if h.f.Digest() != before || h.f.Stats().DomainErrors != domainErrs+1 {
				t.Fatalf("%s: a refused command changed the state or was not counted", s.name)
			}
		}
		if h.f.PlacementGroups() != s.groups || !maps.Equal(h.f.Placements(), s.want) {
			t.Fatalf("%s: groups %d placements %v, want %d %v", s.name, h.f.PlacementGroups(), h.f.Placements(), s.groups, s.want)
		}
		var got []string
		for _, c := range heard {
			if c.Index != h.idx {
				t.Fatalf("%s: heard %+v at index %d", s.name, c, h.idx)
			}
			if c.Kind == ChangeGroups && (c.Worker != "" || c.Removed) {
				t.Fatalf("%s: heard %+v", s.name, c)
			}
			got = append(got, c.Kind.String()+": "+c.Reason)
		}
		if want := slices.DeleteFunc([]string{s.change}, func(x string) bool { return x == "" }); !slices.Equal(got, want) {
			t.Fatalf("%s: changes %q, want %q", s.name, got, want)
		}
	}
	if ChangeGroups.String() != "groups" || ChangeGroups != ChangePlacement+1 {
		t.Fatalf("ChangeGroups = %d %q: append-only, after ChangePlacement", ChangeGroups, ChangeGroups)
	}
}

// TestFSMSnapshotSetGroups: a group count set by SetGroups with nothing
// placed makes the state format 5 (its header holds the count) and
// changes the digest; it round-trips, and a restored replica refuses and
// accepts placements as the original does. A raised count round-trips
// with the placements.
func TestFSMSnapshotSetGroups(t *testing.T) {
	cases := []struct {
		name   string
		base   func(testing.TB) *FSM
		before byte // the base's format
	}{
		{"empty", newFSM, 1},
		{"tiers", goldenStateTiers, 4},
		{"placed", goldenStatePlacements, 5},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := tc.base(t)
			if snap := snapshotBytes(t, f); snap[4] != tc.before {
				t.Fatalf("base is format %d, want %d", snap[4], tc.before)
			}
			digest, placed := f.Digest(), f.Placements()
			h := &harness{t: t, f: f, idx: f.AppliedIndex()}
			h.ok(SetGroups{Groups: 5})
			if f.Digest() == digest {
				t.Fatal("SetGroups does not change the digest")
			}
			_, g := restoreSame(t, f, 5)
			if g.PlacementGroups() != 5 || !maps.Equal(g.Placements(), placed) {
				t.Fatalf("restored groups %d placements %v", g.PlacementGroups(), g.Placements())
			}
			rh := &harness{t: t, f: g, idx: g.AppliedIndex()}
			if r := rh.apply(PlaceWorker{Worker: "new", Group: 1, Groups: 3}); !errors.Is(r.Err, ErrInvalidCommand) {
				t.Fatalf("restored replica placed with the old count: %v", r.Err)
			}
			if r := rh.apply(SetGroups{Groups: 4}); !errors.Is(r.Err, ErrInvalidCommand) {
				t.Fatalf("restored replica shrank: %v", r.Err)
			}
			rh.ok(PlaceWorker{Worker: "new", Group: 5, Groups: 5})
			h.ok(PlaceWorker{Worker: "new", Group: 5, Groups: 5})
			if f.Digest() != g.Digest() {
				t.Fatal("the restored replica diverged")
			}
		})
	}
}

// TestFSMSetGroupsOlderBuild: a build that knows placements but not
// SetGroups (newest type 13) applies the placements before it alike, then
// halts on it without moving, so it never serves the old count while the
// others place with the new one. SetGroups needs no new snapshot format
// (the count is in format 5's header): a build before placements refuses
// a SetGroups-only state by version, as it refuses any format 5.
func TestFSMSetGroupsOlderBuild(t *testing.T) {
	entries := [][]byte{
		mustEncode(t, PlaceWorker{Worker: "w", Group: 2, Groups: 2}),
		mustEncode(t, SetGroups{Groups: 3}),
		mustEncode(t, PlaceWorker{Worker: "v", Group: 3, Groups: 3}),
	}
	older, newer := olderBuildHalts(t, entries, 1, CmdPlaceWorker, 0, CmdSetGroups)
	if older.PlacementGroups() != 2 {
		t.Fatalf("the halted build's group count moved to %d", older.PlacementGroups())
	}
	if g, ok := newer.Placement("v"); !ok || g != 3 || newer.PlacementGroups() != 3 {
		t.Fatal("newer build did not place into the raised group")
	}

	// Before placements: a format 4 build refuses a SetGroups-only state.
	setOnly := newFSM(t)
	(&harness{t: t, f: setOnly}).ok(SetGroups{Groups: 2})
	format4 := newFSM(t)
	format4.newestType, format4.newestFormat = CmdKVEventBatchTiered, 4
	if err := restoreBytes(format4, snapshotBytes(t, setOnly)); !errors.Is(err, ErrCorruptSnapshot) ||
		!strings.Contains(err.Error(), "format version 5, this build reads 1 to 4") {
		t.Fatalf("format 4 build restores a SetGroups-only state: %v", err)
	}
}

// TestFSMSetGroupsCheckedApply: a SetGroups carrying the nodes its
// proposer checked (command 15) applies as SetGroups while every
// registered node is in the list, and is refused (ErrUncheckedNode, state
// unchanged, counted) while one is not: it registered after the check.
// CheckSetGroups agrees with Apply at every step; the unchecked command
// (14) still applies as before, whatever the registry.
func TestFSMSetGroupsCheckedApply(t *testing.T) {
	h := newHarness(t)
	var heard []Change
	h.f.OnChange(func(c Change) { heard = append(heard, c) })
	checked := func(groups uint32, ids ...string) SetGroups { return SetGroups{Groups: groups, Checked: ids} }
	steps := []struct {
		name      string
		register  []string // nodes registered before the step
		cmd       SetGroups
		err       string // substring of the domain error; "" = applies
		unchecked bool   // the error is ErrUncheckedNode
		groups    uint32
		change    string // the ChangeGroups reason heard; "" = none
	}{
		{"no node registered: the proposer alone", nil, checked(2, "r1"), "", false, 2, "data groups 0 → 2"},
		{"the checked set is the registry", []string{"r1", "r2"}, checked(3, "r1", "r2"), "", false, 3, "data groups 2 → 3"},
		{"the same count, every node checked: a no-op", nil, checked(3, "r1", "r2"), "", false, 3, ""},
		{"a node checked, then gone (a superset)", nil, checked(4, "r0", "r1", "r2"), "", false, 4, "data groups 3 → 4"},
		{"a node registered after the check", []string{"r3"}, checked(5, "r1", "r2"),
			`set groups to 5: node "r3" registered after the check (2 checked); retry`, true, 4, ""},
		{"at the same count too", nil, checked(4, "r1", "r2"), `node "r3" registered after the check`, true, 4, ""},
		{"two of them, named in order", []string{"r0"}, checked(5, "r1", "r2"), `nodes "r0", "r3" registered after the check`, true, 4, ""},
		{"shrinking is refused as shrinking", nil, checked(3, "r1"), "cannot shrink from 4 to 3", false, 4, ""},
		{"the unchecked command still applies (old logs)", nil, SetGroups{Groups: 5}, "", false, 5, "data groups 4 → 5"},
		{"every node checked", nil, checked(6, "r0", "r1", "r2", "r3"), "", false, 6, "data groups 5 → 6"},
	}
	for _, s := range steps {
		for _, id := range s.register {
			h.ok(RegisterNode{NodeID: id, RaftAddr: id + ":7000", HTTPAddr: "http://" + id + ":8000"})
		}
		heard = nil
		before, domainErrs := h.f.Digest(), h.f.Stats().DomainErrors
		checkErr := h.f.CheckSetGroups(s.cmd)
		want := CmdSetGroups
		if s.cmd.Checked != nil {
			want = CmdSetGroupsChecked
		}
		if b := mustEncode(t, s.cmd); CommandType(b[0]) != want {
			t.Fatalf("%s: travels as type %d", s.name, b[0])
		}
		r := h.apply(s.cmd)
		if s.err == "" {
			if r.Err != nil || checkErr != nil || r.Applied != 1 {
				t.Fatalf("%s: %v (check %v), applied %d", s.name, r.Err, checkErr, r.Applied)
			}
		} else {
			for _, err := range []error{r.Err, checkErr} {
				if !errors.Is(err, ErrInvalidCommand) || !strings.Contains(err.Error(), s.err) || errors.Is(err, ErrUncheckedNode) != s.unchecked {
					t.Fatalf("%s: %v (check %v), want %q (unchecked %v)", s.name, r.Err, checkErr, s.err, s.unchecked)
				}
			}
			if h.f.Digest() != before || h.f.Stats().DomainErrors != domainErrs+1 {
				t.Fatalf("%s: a refused command changed the state or was not counted", s.name)
			}
		}
		if h.f.PlacementGroups() != s.groups {
			t.Fatalf("%s: groups %d, want %d", s.name, h.f.PlacementGroups(), s.groups)
		}
		var got []string
		for _, c := range heard {
			if c.Kind != ChangeGroups || c.Index != h.idx {
				t.Fatalf("%s: heard %+v", s.name, c)
			}
			got = append(got, c.Reason)
		}
		if want := slices.DeleteFunc([]string{s.change}, func(x string) bool { return x == "" }); !slices.Equal(got, want) {
			t.Fatalf("%s: changes %q, want %q", s.name, got, want)
		}
	}
	// A malformed list (here empty: not nil, so not the unchecked command)
	// is refused by the check and by the encoder; the decoder refuses it
	// too (TestFSMDecodeRejects), so Apply never sees one.
	empty := SetGroups{Groups: 7, Checked: []string{}}
	if err := h.f.CheckSetGroups(empty); !errors.Is(err, ErrInvalidCommand) || !strings.Contains(err.Error(), "0 checked nodes outside [1,1024]") {
		t.Fatalf("check of an empty list: %v", err)
	}
	if _, err := Encode(empty); !errors.Is(err, ErrInvalidCommand) {
		t.Fatalf("encode of an empty list: %v", err)
	}
}

// TestFSMSetGroupsCheckedDeterministic: replicas whose node registries
// were built in different orders refuse (or apply) a checked SetGroups
// alike, with the same error and digest; the entry re-applied at its
// index is skipped as a replay, refused or not; and a checked SetGroups
// leaves the very state (digest, snapshot) the unchecked one does: it
// only reads the registry, so no snapshot format changes.
func TestFSMSetGroupsCheckedDeterministic(t *testing.T) {
	ids := []string{"r1", "r2", "r3", "r4", "r5", "r6", "r7", "r8", "r9", "r10"}
	build := func(seed uint64) *harness {
		h := newHarness(t)
		order := slices.Clone(ids)
		newRand(seed).Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
		for _, id := range order {
			h.ok(RegisterNode{NodeID: id, RaftAddr: id + ":7000"})
		}
		return h
	}
	refused := mustEncode(t, SetGroups{Groups: 3, Checked: []string{"r1", "r5"}})
	var first *harness
	var firstErr string
	for seed := range uint64(8) {
		h := build(seed)
		r := h.raw(refused)
		if !errors.Is(r.Err, ErrUncheckedNode) {
			t.Fatalf("seed %d: %v", seed, r.Err)
		}
		if seed == 0 {
			first, firstErr = h, r.Err.Error()
			if !strings.Contains(firstErr, `nodes "r10", "r2", "r3", "r4", "r6", "r7", "r8", "r9" registered after the check (2 checked)`) {
				t.Fatalf("error %q", firstErr)
			}
			continue
		}
		if r.Err.Error() != firstErr || h.f.Digest() != first.f.Digest() {
			t.Fatalf("seed %d: %q, want %q (digests equal %v)", seed, r.Err, firstErr, h.f.Digest() == first.f.Digest())
		}
	}
	// Re-applied at its index: a replay, nothing changes.
	before := first.f.Digest()
	if r := first.f.Apply(&raft.Log{Index: first.idx, Type: raft.LogCommand, Data: refused}).(*ApplyResult); !r.Replayed || r.Err != nil || first.f.Digest() != before {
		t.Fatalf("replayed refusal: %+v", r)
	}
	sorted := slices.Sorted(slices.Values(ids))
	applied := mustEncode(t, SetGroups{Groups: 3, Checked: sorted})
	first.raw(applied)
	if first.f.PlacementGroups() != 3 {
		t.Fatalf("groups %d after a checked raise", first.f.PlacementGroups())
	}
	after := first.f.Digest()
	if r := first.f.Apply(&raft.Log{Index: first.idx, Type: raft.LogCommand, Data: applied}).(*ApplyResult); !r.Replayed || first.f.Digest() != after {
		t.Fatalf("replayed raise: %+v", r)
	}
	// The unchecked command from the same state: the same state after it.
	plain := build(1)
	plain.idx++ // the refused entry's index, skipped
	plain.ok(SetGroups{Groups: 3})
	if plain.f.Digest() != after || !bytes.Equal(snapshotBytes(t, plain.f), snapshotBytes(t, first.f)) {
		t.Fatal("a checked SetGroups leaves another state than SetGroups")
	}
	_, g := restoreSame(t, first.f, 5)
	if g.PlacementGroups() != 3 {
		t.Fatalf("restored groups %d", g.PlacementGroups())
	}
}

// TestFSMSetGroupsCheckedOlderBuild: a build that knows SetGroups but not
// its checked form (newest type 14) halts on command 15 without moving,
// instead of raising the count unchecked or not at all while newer
// builds raise it.
func TestFSMSetGroupsCheckedOlderBuild(t *testing.T) {
	entries := [][]byte{
		mustEncode(t, RegisterNode{NodeID: "r1", RaftAddr: "r1:7000"}),
		mustEncode(t, SetGroups{Groups: 3, Checked: []string{"r1"}}),
		mustEncode(t, PlaceWorker{Worker: "v", Group: 3, Groups: 3}),
	}
	older, newer := olderBuildHalts(t, entries, 1, CmdSetGroups, 0, CmdSetGroupsChecked)
	if older.PlacementGroups() != 0 {
		t.Fatalf("the halted build's group count moved to %d", older.PlacementGroups())
	}
	if g, ok := newer.Placement("v"); !ok || g != 3 || newer.PlacementGroups() != 3 {
		t.Fatal("newer build did not place into the raised group")
	}
}
