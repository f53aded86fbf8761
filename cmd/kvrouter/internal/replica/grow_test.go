package replica

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/router"
)

// TestGrowErrorUncheckedNode: SetRaftGroups' refusal because a replica
// registered after its check (fsm.ErrUncheckedNode) is a 400 naming the
// replica and saying to retry, whether the FSM that refused is this
// replica's or the leader's across a forward (the result's JSON); other
// errors map as apiError maps them.
func TestGrowErrorUncheckedNode(t *testing.T) {
	f, err := fsm.NewFSM(router.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	var idx uint64
	apply := func(c fsm.Command) error {
		t.Helper()
		b, err := fsm.Encode(c)
		if err != nil {
			t.Fatal(err)
		}
		idx++
		return f.Apply(&raft.Log{Index: idx, Type: raft.LogCommand, Data: b}).(*fsm.ApplyResult).Err
	}
	for _, id := range []string{"r1", "r2", "r4"} {
		if err := apply(fsm.RegisterNode{NodeID: id, RaftAddr: id + ":7000", HTTPAddr: "http://" + id}); err != nil {
			t.Fatal(err)
		}
	}
	stale := fsm.SetGroups{Groups: 3, Checked: []string{"r1", "r2"}}
	checkErr := f.CheckSetGroups(stale)
	applyErr := apply(stale)
	if f.PlacementGroups() != 0 {
		t.Fatalf("the refused command raised the count to %d", f.PlacementGroups())
	}
	raw, err := json.Marshal(&fsm.ApplyResult{Type: fsm.CmdSetGroupsChecked, Err: applyErr})
	if err != nil {
		t.Fatal(err)
	}
	var forwarded fsm.ApplyResult
	if err := json.Unmarshal(raw, &forwarded); err != nil {
		t.Fatal(err)
	}
	for name, err := range map[string]error{"check": checkErr, "apply": applyErr, "forwarded": forwarded.Err} {
		got := growError(err)
		if !errors.Is(got, api.ErrInvalid) || errors.Is(got, api.ErrUnavailable) ||
			!strings.Contains(got.Error(), `node "r4" registered after the check`) || !strings.Contains(got.Error(), "POST /cluster/raft_groups again") {
			t.Errorf("%s: %v", name, got)
		}
	}
	// With r4 checked too it applies.
	if err := apply(fsm.SetGroups{Groups: 3, Checked: []string{"r1", "r2", "r4"}}); err != nil || f.PlacementGroups() != 3 {
		t.Fatalf("checked raise: %v, groups %d", err, f.PlacementGroups())
	}
	// Other refusals keep apiError's mapping and get no retry hint.
	shrink := f.CheckSetGroups(fsm.SetGroups{Groups: 2, Checked: []string{"r1", "r2", "r4"}})
	if got := growError(shrink); !errors.Is(got, api.ErrInvalid) || strings.Contains(got.Error(), "again") {
		t.Errorf("shrink: %v", got)
	}
	if got := growError(cluster.ErrNoLeader); !errors.Is(got, api.ErrUnavailable) {
		t.Errorf("no leader: %v", got)
	}
}

// TestReplicaForwardsCheckedSetGroups: /cluster/apply takes both forms of
// SetGroups, so SetRaftGroups works from a follower.
func TestReplicaForwardsCheckedSetGroups(t *testing.T) {
	for _, c := range []fsm.SetGroups{{Groups: 3}, {Groups: 3, Checked: []string{"r1", "r2", "r3"}}} {
		b, err := fsm.EncodeSetGroups(c)
		if err != nil {
			t.Fatal(err)
		}
		if err := checkForwarded(b); err != nil {
			t.Errorf("type %d refused: %v", b[0], err)
		}
	}
}
