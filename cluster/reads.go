package cluster

import (
	"context"
	"fmt"
	"time"

	"github.com/hashicorp/raft"
)

// LinearizableRead returns once this node's state machine reflects every
// write committed before the call (the read-index protocol): the leader
// confirms its leadership with a quorum and takes its commit index; a
// follower asks the leader for it. Then both wait until they applied it.
// Reads after it are linearizable with all writes.
func (n *Node) LinearizableRead(ctx context.Context) error {
	var idx uint64
	if n.raft.State() == raft.Leader {
		if err := n.raft.VerifyLeader().Error(); err != nil {
			return mapRaftError(err)
		}
		idx = n.raft.CommitIndex()
	} else {
		_, sid := n.raft.LeaderWithID()
		if sid == "" {
			return ErrNoLeader
		}
		var err error
		if n.cfg.LeaderHTTP == nil {
			return fmt.Errorf("read index from leader %s: no HTTP address lookup: %w", sid, ErrNoLeader)
		}
		if idx, err = n.leaderCommitIndex(string(sid)); err != nil {
			return fmt.Errorf("read index from leader %s: %v: %w", sid, err, ErrNoLeader)
		}
	}
	// raft's applied index moves when entries are handed to the state
	// machine's goroutine, before they are applied: wait for it, then for
	// the state machine itself to reach the last command at or below idx
	// (no-op and configuration entries never reach it).
	wait := func(applied func() uint64, target uint64) error {
		for applied() < target {
			if err := n.sm.Halted(); err != nil {
				return fmt.Errorf("waiting to apply up to %d: state machine %w", target, err)
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("waiting to apply up to %d: %w", target, ctx.Err())
			case <-n.closing:
				return ErrShutdown
			case <-time.After(2 * time.Millisecond):
			}
		}
		return nil
	}
	if err := wait(n.raft.AppliedIndex, idx); err != nil {
		return err
	}
	return wait(n.sm.AppliedIndex, n.lastCommandAtOrBelow(idx))
}

// Barrier blocks until every entry before it is applied to this leader's
// FSM; it fails on followers.
func (n *Node) Barrier(ctx context.Context) error {
	return mapRaftError(waitFuture(ctx, n.raft.Barrier(n.cfg.ApplyTimeout)))
}
