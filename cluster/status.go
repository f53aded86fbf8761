package cluster

import (
	"context"
	"os"
	"strings"
	"time"
)

// PeerStatus is one server of the Raft configuration.
type PeerStatus struct {
	ID       string `json:"id"`
	RaftAddr string `json:"raft_addr"`
	Suffrage string `json:"suffrage"`
	Leader   bool   `json:"leader"`
}

// Status is this node's view of the cluster (GET /cluster/status).
type Status struct {
	NodeID            string       `json:"node_id"`
	RaftAddr          string       `json:"raft_addr"`
	State             string       `json:"state"` // leader, follower, candidate, shutdown
	LeaderID          string       `json:"leader_id"`
	LeaderAddr        string       `json:"leader_addr"`
	Term              uint64       `json:"term"`
	AppliedIndex      uint64       `json:"applied_index"` // the FSM's
	RaftAppliedIndex  uint64       `json:"raft_applied_index"`
	CommitIndex       uint64       `json:"commit_index"`
	LastLogIndex      uint64       `json:"last_log_index"`
	LastSnapshotIndex uint64       `json:"last_snapshot_index"`
	SnapshotsRestored uint64       `json:"snapshots_restored"`
	Peers             []PeerStatus `json:"peers"`
	Ready             bool         `json:"ready"`
	ReadyReason       string       `json:"ready_reason"`
	Digest            string       `json:"digest"`
	PID               int          `json:"pid"`
	// Halted is why the state machine stopped applying ("" while it
	// applies): see StateMachine.Halted.
	Halted string `json:"halted,omitempty"`
}

// Status gathers Status, with the state machine's digest. Reading the
// configuration can wait behind a snapshot install on a follower, so peers
// are given up after a second.
func (n *Node) Status() Status {
	st := n.StatusWithoutDigest()
	st.Digest = n.sm.Digest()
	return st
}

// StatusWithoutDigest is Status without the digest, which is a pass over
// the whole state machine under its lock: pollers that do not compare
// digests (the replica's /cluster/status?digest=0, membership checks) must
// not pay it. Profiled during kvbench ingest, status polls computing it
// anyway took 10.7 % of a follower's CPU.
func (n *Node) StatusWithoutDigest() Status {
	leaderAddr, leaderID := n.raft.LeaderWithID()
	ready, reason := n.Ready()
	st := Status{
		NodeID:            n.cfg.NodeID,
		RaftAddr:          n.cfg.AdvertiseAddr,
		State:             strings.ToLower(n.raft.State().String()),
		LeaderID:          string(leaderID),
		LeaderAddr:        string(leaderAddr),
		Term:              n.raft.CurrentTerm(),
		AppliedIndex:      n.sm.AppliedIndex(),
		RaftAppliedIndex:  n.raft.AppliedIndex(),
		CommitIndex:       n.raft.CommitIndex(),
		LastLogIndex:      n.raft.LastIndex(),
		SnapshotsRestored: n.fsm.restores.Load(),
		Ready:             ready,
		ReadyReason:       reason,
		PID:               os.Getpid(),
	}
	if err := n.sm.Halted(); err != nil {
		st.Halted = err.Error()
	}
	if metas, err := n.snaps.List(); err == nil && len(metas) > 0 {
		st.LastSnapshotIndex = metas[0].Index
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	cf := n.raft.GetConfiguration()
	if err := waitFuture(ctx, cf); err == nil {
		for _, s := range cf.Configuration().Servers {
			st.Peers = append(st.Peers, PeerStatus{
				ID:       string(s.ID),
				RaftAddr: string(s.Address),
				Suffrage: strings.ToLower(s.Suffrage.String()),
				Leader:   s.ID == leaderID,
			})
		}
	}
	return st
}

// Stats returns raft's own statistics map (may block briefly).
func (n *Node) Stats() map[string]string { return n.raft.Stats() }
