package cluster

import (
	"errors"
	"fmt"

	"github.com/hashicorp/raft"
)

var (
	// ErrNoLeader: no leader is known, the known leader cannot be reached, or
	// this node lost leadership before the command was enqueued. The command
	// was not applied; retrying is safe.
	ErrNoLeader = errors.New("cluster: no leader")

	// ErrOutcomeUnknown: the command reached a leader but its fate is not
	// known (leadership was lost, the context ended, or the forwarding
	// connection broke after the request was sent). The entry may still
	// commit. Retry only with an idempotent command (the FSM deduplicates by
	// event id).
	ErrOutcomeUnknown = errors.New("cluster: outcome unknown, the entry may still commit")

	// ErrShutdown: the node is shutting down.
	ErrShutdown = errors.New("cluster: node is shut down")
)

// RejectedError is a domain error the state machine returned as the response
// to a committed command (e.g. unknown model). The entry is in the log; the
// state machine chose not to change state. errors.Is works with the FSM's
// sentinel errors, across forwarding too when the sentinel is listed in
// Config.ForwardErrors.
type RejectedError struct {
	Message string
	Err     error // the FSM's error on the leader; the matched sentinel (or nil) on a follower
}

func (e *RejectedError) Error() string { return e.Message }
func (e *RejectedError) Unwrap() error { return e.Err }

// mapRaftError converts raft errors into this package's sentinels, keeping
// the raft error in the chain so errors.Is works for both.
func mapRaftError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, raft.ErrLeadershipLost):
		return fmt.Errorf("%w: %w", ErrOutcomeUnknown, err)
	case errors.Is(err, raft.ErrNotLeader), errors.Is(err, raft.ErrLeadershipTransferInProgress):
		return fmt.Errorf("%w: %w", ErrNoLeader, err)
	case errors.Is(err, raft.ErrRaftShutdown):
		// Raft may have shut down with the entry already replicated.
		return fmt.Errorf("%w: %w: %w", ErrShutdown, ErrOutcomeUnknown, err)
	default:
		return err
	}
}
