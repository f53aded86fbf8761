package replica

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/fsm"
)

// Adding data groups to a running cluster (issue 19 item 2: "a group
// added"), in three operator steps:
//  1. restart every replica, one at a time, with the larger --raft-groups
//     N: each new group forms once a quorum of replicas runs it, and until
//     step 2 no worker is placed there (placements use the cluster's
//     recorded count, clusterGroups);
//  2. POST /cluster/raft_groups {"groups": N} on any replica: it checks
//     that every replica in the node registry runs N data groups, then
//     commits fsm.SetGroups with the ids it checked (the count only grows:
//     shrinking would strand the workers of the groups beyond; a replica
//     registered after the check refuses the commit: retry);
//  3. POST /workers/rebalance: workers move from the fullest groups to the
//     emptiest (moves.go), until every group holds within one worker of
//     the others. New workers already go to the emptiest group.
// A replica that runs fewer data groups than the cluster's count is not
// ready (Ready), saying so: it cannot see the workers of the groups it
// lacks.

// clusterGroups is the number of data groups placements are made for: the
// count recorded in the control group, or, before anything was recorded,
// this replica's own.
func (r *replica) clusterGroups() int {
	if n := int(r.fsm.PlacementGroups()); n > 0 {
		return n
	}
	return len(r.groups)
}

// activeGroups are the data groups workers are placed in: this replica's,
// up to the cluster's count (a replica restarted with more runs the extra
// ones before an operator adds them).
func (r *replica) activeGroups() []*dataGroup {
	return r.groups[:min(r.clusterGroups(), len(r.groups))]
}

// groupsBehind is the readiness complaint of a replica running fewer data
// groups than the cluster's count ("" when it runs enough).
func (r *replica) groupsBehind() string {
	if n := int(r.fsm.PlacementGroups()); r.sharded() && n > len(r.groups) {
		return fmt.Sprintf("this replica runs %d data groups, the cluster %d: restart it with --raft-groups %d (it cannot see the workers of the groups it lacks)", len(r.groups), n, n)
	}
	return ""
}

// RaftGroups reports the cluster's recorded data-group count and this
// replica's (api.ShardAdmin).
func (r *replica) RaftGroups() (cluster, running int) {
	return int(r.fsm.PlacementGroups()), len(r.groups)
}

// SetRaftGroups raises the cluster's data-group count to n once every
// replica in the node registry runs at least n data groups. The check
// (HTTP, each replica's status) and the commit are not atomic, so the
// commit carries what was checked: fsm.SetGroups with Checked, the ids of
// the replicas asked (this one included), which every replica's FSM
// refuses while the registry holds a node not among them — one
// registered in between, never asked. The refusal (fsm.ErrUncheckedNode)
// is a 400 saying to retry; the retry asks it too. Still unchecked: a
// replica that keeps its id and restarts with fewer groups in between;
// after the commit it is not ready until restarted with n (DESIGN.md,
// "Adding data groups").
func (r *replica) SetRaftGroups(ctx context.Context, n int) error {
	if !r.sharded() {
		return fmt.Errorf("%w: %v", api.ErrInvalid, ErrNotSharded)
	}
	if n > len(r.groups) {
		return fmt.Errorf("%w: this replica runs %d data groups; restart every replica with --raft-groups %d first", api.ErrInvalid, len(r.groups), n)
	}
	c := fsm.SetGroups{Groups: uint32(n)}
	if err := r.fsm.CheckSetGroups(c); err != nil {
		return fmt.Errorf("%w: %v", api.ErrInvalid, err)
	}
	checked := []string{r.cfg.NodeID} // this replica runs n: checked above
	for _, node := range r.fsm.Nodes() {
		if node.ID == r.cfg.NodeID {
			continue
		}
		if node.HTTPAddr == "" {
			// It cannot be asked, so it cannot be in Checked, and the
			// commit would be refused: say why now.
			return fmt.Errorf("%w: replica %s has no HTTP address in the node registry, so its data groups cannot be checked", api.ErrInvalid, node.ID)
		}
		var st struct {
			Groups []struct {
				Group    int    `json:"group"`
				LeaderID string `json:"leader_id"`
			} `json:"raft_groups"`
		}
		if err := peerStatus(ctx, r.state.client, node.HTTPAddr, false, &st); err != nil {
			return fmt.Errorf("%w: replica %s: %v (every replica must answer before the count grows)", api.ErrUnavailable, node.ID, err)
		}
		if len(st.Groups) < n {
			return fmt.Errorf("%w: replica %s runs %d data groups; restart it with --raft-groups %d first", api.ErrInvalid, node.ID, len(st.Groups), n)
		}
		checked = append(checked, node.ID)
	}
	slices.Sort(checked)
	c.Checked = slices.Compact(checked)
	for _, g := range r.groups[:n] {
		if id, _ := g.node.Leader(); id == "" {
			return fmt.Errorf("%w: data group %d has no leader yet", api.ErrUnavailable, g.id)
		}
	}
	// The registry as this replica has applied it now: a node registered
	// during the check is refused here, before anything is written; one
	// this replica has not applied yet, by the FSM on commit.
	if err := r.fsm.CheckSetGroups(c); err != nil {
		return growError(err)
	}
	cmd, err := fsm.EncodeSetGroups(c)
	if err != nil {
		return fmt.Errorf("%w: %v", api.ErrInvalid, err)
	}
	if err := r.propose(ctx, cmd); err != nil {
		return growError(err)
	}
	r.waitApplied(ctx)
	r.log.Info("the cluster's data groups grew: new workers go to the emptiest; POST /workers/rebalance moves existing ones", "groups", n)
	return nil
}

// growError is apiError for SetRaftGroups: a refusal because a replica
// registered after the check (fsm.ErrUncheckedNode, from this replica's
// check or the leader's apply, forwarded or not) is a 400 that says to
// retry; retrying checks the new replica too.
func growError(err error) error {
	if errors.Is(err, fsm.ErrUncheckedNode) {
		return fmt.Errorf("%w: %v (POST /cluster/raft_groups again: it checks every replica registered now)", api.ErrInvalid, err)
	}
	return apiError(err)
}

// Rebalance moves workers from the fullest data groups to the emptiest
// until every group's count is within one of every other's
// (api.ShardAdmin), one move at a time; it returns the moves made. Which
// worker moves: the fullest group's (lowest group id among equals) worker
// with the smallest id, so two calls make the same plan.
func (r *replica) Rebalance(ctx context.Context) ([]api.WorkerMove, error) {
	if !r.sharded() {
		return nil, fmt.Errorf("%w: %v", api.ErrInvalid, ErrNotSharded)
	}
	// Read the placements and the group count as committed, not as this
	// replica last applied them: a count just raised through another
	// replica must be seen here.
	r.waitApplied(ctx)
	var moves []api.WorkerMove
	for {
		n := len(r.activeGroups())
		members := make([][]string, n)
		for w, g := range r.fsm.Placements() {
			if _, ok := r.worker(w); ok && g >= 1 && int(g) <= n {
				members[g-1] = append(members[g-1], w)
			}
		}
		full, empty := 0, 0
		for i := range members {
			if len(members[i]) > len(members[full]) {
				full = i
			}
			if len(members[i]) < len(members[empty]) {
				empty = i
			}
		}
		if len(members[full])-len(members[empty]) <= 1 {
			return moves, nil
		}
		w := slices.MinFunc(members[full], cmp.Compare[string])
		if _, err := r.MoveWorker(ctx, w, empty+1); err != nil {
			return moves, fmt.Errorf("rebalance: moving %q from group %d to %d: %w", w, full+1, empty+1, err)
		}
		moves = append(moves, api.WorkerMove{Worker: w, From: full + 1, To: empty + 1})
	}
}
