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
	// Halted is nil while the machine applies entries, and why it stopped
	// once it met an entry it must not skip and cannot apply (a command
	// type its build does not know): it then applies nothing more until a
	// restore or a restart with a newer build. The node is not ready while
	// it is halted. Must not block (readiness probes call it).
	Halted() error
	// Refused counts the entries the machine did not apply: unknown
	// command types, undecodable entries, commands refused with a domain
	// error (the kvrouter_fsm_*_total counters).
	Refused() (unknownTypes, undecodable, domainErrors uint64)
}

// fsmAdapter sits between raft and the StateMachine to count snapshot
// persists and restores (metrics, and proof in tests that a follower was
// caught up by snapshot install).
//
// It also watches for the machine halting (and resuming after a restore),
// which it reports once per change to onHalt.
type fsmAdapter struct {
	sm       StateMachine
	m        *metrics
	restores atomic.Uint64
	halted   atomic.Bool // as last reported to onHalt
	onHalt   func(err error)
}

func (f *fsmAdapter) Apply(l *raft.Log) any {
	resp := f.sm.Apply(l)
	f.checkHalt()
	return resp
}

func (f *fsmAdapter) ApplyBatch(logs []*raft.Log) []any {
	resp := f.sm.ApplyBatch(logs)
	f.checkHalt()
	return resp
}

// checkHalt reports a change of the machine's halt state. Raft calls the
// FSM from one goroutine, so changes are seen in order.
func (f *fsmAdapter) checkHalt() {
	err := f.sm.Halted()
	if f.halted.Swap(err != nil) != (err != nil) && f.onHalt != nil {
		f.onHalt(err)
	}
}

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
	f.checkHalt()
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
