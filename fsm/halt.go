package fsm

import (
	"errors"
	"fmt"
)

// ErrHalted marks the result of every entry a halted FSM refused to apply
// (see HaltError). errors.Is(err, ErrHalted) also holds for the HaltError
// itself.
var ErrHalted = errors.New("state machine halted")

// HaltError is why the FSM stopped applying: the entry at Index has a
// command type (or envelope version) this build does not know and no
// ignore bit, so applying anything after it could only diverge from the
// replicas that do know it. The FSM keeps the state of the entries before
// Index and refuses every later entry until a Restore replaces the state
// or a build that knows the type replays the log.
type HaltError struct {
	Index   uint64      // log index of the entry this build cannot apply
	Type    CommandType // its type (ignore bit clear)
	Version byte        // its envelope version
}

func (e *HaltError) Error() string {
	return fmt.Sprintf("halted at log index %d: command type %d version %d unknown to this build (upgrade this replica)",
		e.Index, uint8(e.Type), e.Version)
}

// Unwrap makes errors.Is work with ErrHalted and ErrUnknownCommand.
func (e *HaltError) Unwrap() []error { return []error{ErrHalted, ErrUnknownCommand} }

// Halted returns the *HaltError once the FSM met an entry it cannot apply,
// nil while it applies normally. Safe to call at any time without waiting
// for an apply (readiness probes call it).
func (f *FSM) Halted() error {
	if h := f.halt.Load(); h != nil {
		return h
	}
	return nil
}

// Refused returns the counters of entries not applied that a replica
// exports (Stats has them all).
func (f *FSM) Refused() (unknownTypes, undecodable, domainErrors uint64) {
	return f.stats.unknownTypes.Load(), f.stats.undecodable.Load(), f.stats.domainErrors.Load()
}
