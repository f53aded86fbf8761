package cluster

import (
	"fmt"
	"time"

	"github.com/hashicorp/raft"
)

// readiness is the follower's catch-up state for the current leader epoch.
type readiness struct {
	epoch       uint64 // bumped on every leader change
	leaderID    string
	since       time.Time // when this node first saw leaderID
	targeted    bool
	target      uint64 // the leader's commit index, learned once per epoch
	fsmTargeted bool
	fsmTarget   uint64 // last command entry at or below target (0: none known)
	fetching    bool   // a leader commit-index request is in flight
	lastFetch   time.Time
	fetchErr    string
	ready       bool // latched until the leader changes
}

// noteLeaderLocked starts a new readiness epoch when the leader changes and
// starts learning the new leader's commit index. mu must be held.
func (n *Node) noteLeaderLocked(id string) {
	if id == n.rd.leaderID {
		return
	}
	n.rd = readiness{epoch: n.rd.epoch + 1, leaderID: id, since: time.Now()}
	if id != "" && id != n.cfg.NodeID && n.cfg.LeaderHTTP != nil {
		n.fetchTargetLocked()
	}
}

// fetchTargetLocked asks the leader for its commit index in the background
// (at most one request in flight, retried no faster than every 100ms).
// mu must be held.
func (n *Node) fetchTargetLocked() {
	rd := &n.rd
	if rd.fetching || time.Since(rd.lastFetch) < 100*time.Millisecond {
		return
	}
	rd.fetching, rd.lastFetch = true, time.Now()
	epoch, leader := rd.epoch, rd.leaderID
	go func() {
		idx, err := n.leaderCommitIndex(leader)
		n.mu.Lock()
		defer n.mu.Unlock()
		if n.rd.epoch != epoch {
			return
		}
		n.rd.fetching = false
		if err != nil {
			n.rd.fetchErr = err.Error()
			return
		}
		// The leader's value is authoritative; the local one is a floor.
		n.rd.target, n.rd.targeted, n.rd.fetchErr = max(idx, n.raft.CommitIndex()), true, ""
	}()
}

// Ready reports whether this node may serve: it knows a leader and its state
// machine has caught up with that leader's commit index as of when the
// leader became known.
//
//   - The leader: ready once its post-election barrier completed (its FSM
//     holds every entry of earlier terms).
//   - A follower asks the leader (GET /cluster/commit over LeaderHTTP) for its
//     commit index once per leader epoch, then is ready when raft's applied
//     index and the FSM's reach it (the FSM target is the last command entry
//     at or below it: no-ops never reach the FSM). Without LeaderHTTP it
//     falls back to its own commit index after the first successful contact
//     from the leader, which can be early while a far-behind follower is
//     still receiving batches.
//
// Ready is latched until the leader changes, so steady replication lag under
// load does not flap it. It never blocks on Raft or the network.
func (n *Node) Ready() (bool, string) {
	if n.isClosing() {
		return false, "shut down"
	}
	if err := n.sm.Halted(); err != nil {
		return false, "state machine " + err.Error()
	}
	_, sid := n.raft.LeaderWithID()
	id := string(sid)
	n.mu.Lock()
	defer n.mu.Unlock()
	n.noteLeaderLocked(id)
	rd := &n.rd
	switch {
	case id == "":
		return false, "no leader"
	case rd.ready:
		return true, "ok"
	case id == n.cfg.NodeID:
		if n.leaderReadyTermIsCurrent() {
			rd.ready = true
			return true, "ok"
		}
		return false, "leader: barrier pending"
	}
	if !rd.targeted {
		if n.cfg.LeaderHTTP != nil {
			n.fetchTargetLocked()
			if rd.fetchErr != "" {
				return false, "waiting for the commit index of leader " + id + ": " + rd.fetchErr
			}
			return false, "waiting for the commit index of leader " + id
		}
		if !n.raft.LastContact().After(rd.since) {
			return false, "waiting for first contact from leader " + id
		}
		rd.target, rd.targeted = n.raft.CommitIndex(), true
	}
	if ra := n.raft.AppliedIndex(); ra < rd.target {
		return false, fmt.Sprintf("catching up: applied %d of %d", ra, rd.target)
	}
	if !rd.fsmTargeted {
		rd.fsmTarget, rd.fsmTargeted = n.lastCommandAtOrBelow(rd.target), true
	}
	if fa := n.sm.AppliedIndex(); fa < rd.fsmTarget {
		return false, fmt.Sprintf("catching up: applied %d of %d", fa, rd.fsmTarget)
	}
	rd.ready = true
	return true, "ok"
}

// leaderReadyTermIsCurrent: this node leads and finished its barrier in
// this term.
func (n *Node) leaderReadyTermIsCurrent() bool {
	return n.raft.State() == raft.Leader && n.leaderReadyTerm.Load() == n.raft.CurrentTerm()
}
