package fsm

import (
	"encoding/binary"
	"fmt"
	"slices"
	"strings"
)

// Draining a worker (issue 29 item 2; DESIGN.md, Draining workers).
//
// The drain flag lives in the worker's registration: in the FSM that
// registers the worker (its data group when the index is sharded), so it
// is read, snapshotted and dropped with the registration it qualifies, and
// every replica's routers exclude the worker from the same log index on.

// SetWorkerDrain drains a registered worker (Drained): no new requests go
// there on any replica; the leader of the worker's group deregisters it
// once it is idle or past Deadline, with Deregister. Drained false
// undrains it. Deregister completes a drain: it removes the worker only
// while it is still drained, so a completion proposed twice (a leader
// that failed over between proposing and learning the outcome) or after
// an undrain changes nothing: a drain completes once, exactly.
type SetWorkerDrain struct {
	Worker  string // a worker id (no '#'): all its ranks drain together
	Drained bool
	// Deadline (unix nanoseconds, stamped by the proposer; 0 = none) is
	// when the leader deregisters the worker even if requests still run
	// there. Only with Drained and without Deregister. The FSM only
	// stores it: no apply reads a clock.
	Deadline int64
	// Deregister completes the drain (requires Drained): the worker is
	// removed as by DeregisterWorker, only if it is drained now.
	Deregister bool
}

// Type is CmdSetWorkerDrain.
func (SetWorkerDrain) Type() CommandType { return CmdSetWorkerDrain }

// Flag bits of CmdSetWorkerDrain's payload; other bits are undecodable.
const (
	drainFlagDrained    = 1 << 0
	drainFlagDeregister = 1 << 1
)

// ErrNotDrained: a SetWorkerDrain{Deregister} of a worker that is not
// drained (undrained, or deregistered and registered again, since the
// completion was proposed). A domain error: nothing changes.
var ErrNotDrained = fmt.Errorf("worker not drained: %w", ErrInvalidCommand)

// Validate checks the command's own fields; whether the worker is
// registered (and, for Deregister, drained) is checked on apply
// (FSM.CheckWorkerDrain checks both).
func (c SetWorkerDrain) Validate() error {
	if err := c.shape(); err != nil {
		return err
	}
	switch {
	case c.Worker == "":
		return fmt.Errorf("drain worker: empty id: %w", ErrInvalidCommand)
	case strings.ContainsRune(c.Worker, '#'):
		return fmt.Errorf("drain worker %q: '#' is reserved for dp ranks (drain the worker, not a rank): %w", c.Worker, ErrInvalidCommand)
	}
	return checkString("worker id", c.Worker)
}

// shape is what the decoder refuses too: one encoding per meaning.
func (c SetWorkerDrain) shape() error {
	switch {
	case c.Deregister && !c.Drained:
		return fmt.Errorf("drain worker %q: deregister without drained: %w", c.Worker, ErrInvalidCommand)
	case c.Deadline < 0:
		return fmt.Errorf("drain worker %q: negative deadline %d: %w", c.Worker, c.Deadline, ErrInvalidCommand)
	case c.Deadline != 0 && (!c.Drained || c.Deregister):
		return fmt.Errorf("drain worker %q: a deadline belongs to a drain only: %w", c.Worker, ErrInvalidCommand)
	}
	return nil
}

// appendSetWorkerDrain writes the payload: worker id, flags byte, deadline
// (varint). It refuses what Validate refuses.
func appendSetWorkerDrain(b []byte, c SetWorkerDrain) ([]byte, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	b = appendString(b, c.Worker)
	flags := byte(0)
	if c.Drained {
		flags |= drainFlagDrained
	}
	if c.Deregister {
		flags |= drainFlagDeregister
	}
	b = append(b, flags)
	return binary.AppendVarint(b, c.Deadline), nil
}

// readSetWorkerDrain reads the payload; an unknown flag bit or a shape
// Validate refuses is undecodable (an empty or '#' id is a domain error on
// apply, as for every other worker command).
func readSetWorkerDrain(r *reader) SetWorkerDrain {
	c := SetWorkerDrain{Worker: r.string("worker id")}
	flags := r.byte()
	c.Deadline = r.varint()
	if r.err != nil {
		return c
	}
	if flags&^(drainFlagDrained|drainFlagDeregister) != 0 {
		r.fail("drain flags %#x", flags)
		return c
	}
	c.Drained, c.Deregister = flags&drainFlagDrained != 0, flags&drainFlagDeregister != 0
	if err := c.shape(); err != nil {
		r.fail("%v", err)
	}
	return c
}

// WorkerDrain is a drained worker as the FSM holds it.
type WorkerDrain struct {
	Worker   string
	Deadline int64 // unix nanoseconds; 0 = none
}

// drainState is a drained worker's part of its workerState; nil = not
// drained.
type drainState struct {
	deadline int64
}

// checkDrain returns the domain error that refuses c, or nil. f.mu held
// (read).
func (st *state) checkDrain(c SetWorkerDrain) error {
	if err := c.Validate(); err != nil {
		return err
	}
	ws := st.workers[c.Worker]
	if ws == nil {
		return fmt.Errorf("drain worker %q: %w", c.Worker, ErrUnknownWorker)
	}
	if c.Deregister && ws.drain == nil {
		return fmt.Errorf("complete the drain of worker %q: %w", c.Worker, ErrNotDrained)
	}
	return nil
}

// drainLocked applies a SetWorkerDrain. f.mu held.
func (f *FSM) drainLocked(idx uint64, c SetWorkerDrain, res *ApplyResult) error {
	st := f.st
	if err := st.checkDrain(c); err != nil {
		return err
	}
	res.Applied = 1
	ws := st.workers[c.Worker]
	var reason string
	switch {
	case c.Deregister:
		f.removeWorkerLocked(idx, c.Worker, "drained")
		return nil
	case !c.Drained && ws.drain == nil, c.Drained && ws.drain != nil && ws.drain.deadline == c.Deadline:
		return nil // nothing changes: nothing to report
	case !c.Drained:
		ws.drain = nil
		reason = "undrained"
	case ws.drain != nil:
		ws.drain.deadline = c.Deadline
		reason = "drain deadline changed"
	default:
		ws.drain = &drainState{deadline: c.Deadline}
		reason = "drained"
	}
	f.changes = append(f.changes, Change{Kind: ChangeDrain, Index: idx, Worker: c.Worker, Model: ws.rec.Model,
		Removed: !c.Drained, Reason: reason})
	return nil
}

// Drains are the drained workers, sorted by id.
func (f *FSM) Drains() []WorkerDrain {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var out []WorkerDrain
	for id, ws := range f.st.workers {
		if ws.drain != nil {
			out = append(out, WorkerDrain{Worker: id, Deadline: ws.drain.deadline})
		}
	}
	slices.SortFunc(out, func(a, b WorkerDrain) int { return strings.Compare(a.Worker, b.Worker) })
	return out
}

// Drain reports whether worker is drained, and its deadline.
func (f *FSM) Drain(worker string) (WorkerDrain, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	ws := f.st.workers[worker]
	if ws == nil || ws.drain == nil {
		return WorkerDrain{}, false
	}
	return WorkerDrain{Worker: worker, Deadline: ws.drain.deadline}, true
}

// CheckWorkerDrain returns the error Apply would give c now.
func (f *FSM) CheckWorkerDrain(c SetWorkerDrain) error {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.st.checkDrain(c)
}
