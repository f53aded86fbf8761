package cluster

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/hashicorp/raft"
)

// Apply proposes cmd and returns the FSM's response. On the leader it calls
// raft.Apply; on a follower it forwards cmd to the leader's HTTP address.
//
// Errors: ErrNoLeader — not applied, safe to retry; ErrOutcomeUnknown — the
// entry may still commit (leadership lost, ctx ended, forwarding broke after
// sending); *RejectedError — committed, and the FSM returned a domain error.
func (n *Node) Apply(ctx context.Context, cmd []byte) (any, error) {
	if n.isClosing() {
		return nil, ErrShutdown
	}
	if n.raft.State() == raft.Leader {
		resp, err := n.applyLeader(ctx, cmd)
		if !errors.Is(err, raft.ErrNotLeader) {
			return resp, err
		}
		// Lost leadership before the entry was enqueued: forward instead.
	}
	return n.forwardApply(ctx, cmd)
}

// applyLeader runs cmd through raft on this (leader) node.
func (n *Node) applyLeader(ctx context.Context, cmd []byte) (any, error) {
	if n.cfg.CheckCommand != nil {
		if err := n.cfg.CheckCommand(cmd); err != nil {
			return nil, &RejectedError{Message: err.Error(), Err: err}
		}
	}
	timeout := n.cfg.ApplyTimeout
	if dl, ok := ctx.Deadline(); ok {
		timeout = max(min(timeout, time.Until(dl)), time.Millisecond)
	}
	start := time.Now()
	f := n.raft.Apply(cmd, timeout)
	if err := waitFuture(ctx, f); err != nil {
		return nil, fmt.Errorf("apply: %w", mapRaftError(err))
	}
	n.m.applySeconds.Observe(time.Since(start).Seconds())
	resp := f.Response()
	if e := n.responseError(resp); e != nil {
		return nil, &RejectedError{Message: e.Error(), Err: e}
	}
	return resp, nil
}

// responseError is the domain error in an FSM response, if any.
func (n *Node) responseError(resp any) error {
	if e, ok := resp.(error); ok {
		return e
	}
	if n.cfg.ResponseError != nil {
		return n.cfg.ResponseError(resp)
	}
	return nil
}

// ApplyLocal is raft.Apply for the leader-only ingest consumer: no
// forwarding, no context. The future's Error maps raft errors like Apply
// (raft.ErrLeadershipLost also satisfies ErrOutcomeUnknown; raft.ErrNotLeader
// also ErrNoLeader) and records kvrouter_raft_apply_seconds on success. The
// FSM response, possibly an error value, is in Response().
func (n *Node) ApplyLocal(cmd []byte, timeout time.Duration) raft.ApplyFuture {
	return &timedFuture{ApplyFuture: n.raft.Apply(cmd, timeout), start: time.Now(), m: n.m}
}

type timedFuture struct {
	raft.ApplyFuture
	start time.Time
	m     *metrics
	once  sync.Once
}

func (f *timedFuture) Error() error {
	err := f.ApplyFuture.Error()
	f.once.Do(func() {
		if err == nil {
			f.m.applySeconds.Observe(time.Since(f.start).Seconds())
		}
	})
	return mapRaftError(err)
}
