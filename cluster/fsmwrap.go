package cluster

import (
	"io"
	"sync/atomic"

	"github.com/hashicorp/raft"
)

// StateMachine is what the node replicates into. The fsm package implements
// it; cluster depends only on this interface.
type StateMachine interface {
	raft.BatchingFSM
	// Digest is a hash of the state: equal digests mean equal state.
	Digest() string
	// AppliedIndex is the Raft index of the last command entry the machine
	// applied (or restored from a snapshot). It need not advance for entries
	// raft never hands to the FSM (no-ops, barriers).
	AppliedIndex() uint64
}

// fsmAdapter sits between raft and the StateMachine to count snapshot
// persists and restores (metrics, and proof in tests that a follower was
// caught up by snapshot install).
type fsmAdapter struct {
	sm       StateMachine
	m        *metrics
	restores atomic.Uint64
}

func (f *fsmAdapter) Apply(l *raft.Log) any             { return f.sm.Apply(l) }
func (f *fsmAdapter) ApplyBatch(logs []*raft.Log) []any { return f.sm.ApplyBatch(logs) }

func (f *fsmAdapter) Snapshot() (raft.FSMSnapshot, error) {
	s, err := f.sm.Snapshot()
	if err != nil {
		return nil, err
	}
	return &countingSnapshot{FSMSnapshot: s, m: f.m}, nil
}

func (f *fsmAdapter) Restore(rc io.ReadCloser) error {
	if err := f.sm.Restore(rc); err != nil {
		return err
	}
	f.restores.Add(1)
	f.m.snapshots.WithLabelValues("restored").Inc()
	return nil
}

type countingSnapshot struct {
	raft.FSMSnapshot
	m *metrics
}

func (s *countingSnapshot) Persist(sink raft.SnapshotSink) error {
	if err := s.FSMSnapshot.Persist(sink); err != nil {
		return err
	}
	s.m.snapshots.WithLabelValues("persisted").Inc()
	return nil
}

var _ raft.BatchingFSM = (*fsmAdapter)(nil)
