package fsm

import (
	"fmt"
	"math"
)

// Bounds on the times commands carry, in nanoseconds (this package may not
// import time: Apply must never be able to read the clock). Apply enforces
// them with times from the log only, so every replica clamps the same way
// (see DESIGN.md, The clock).
const (
	nanosPerSecond int64 = 1_000_000_000

	// MaxClockStep bounds how far one Tick moves the FSM's clock: to the
	// later of clock+MaxClockStep and just before the earliest expiry the
	// state holds (tickTargetLocked). Leases last 120 s and are renewed
	// every 30 s, so a live worker's lease is at least 90 s ahead of the
	// leader's clock: one Tick, however far in the future it claims to be,
	// cannot expire a live worker. The leader ticks only when something is
	// due, so the clock may lag real time by hours; the second term lets an
	// honest tick reach what is due at once (one extra tick at most).
	MaxClockStep = 60 * nanosPerSecond

	// MaxTimeAhead is how far past the FSM's reference time a lease
	// (LeaseUntil) or a prediction (Until) may lie; later ones are clamped
	// to it. Without it a lease of year 2262 would never expire and a
	// prediction would live forever. A day: far beyond any lease or
	// prediction TTL, and beyond how stale the reference can be while
	// something is pending.
	MaxTimeAhead = 24 * 3600 * nanosPerSecond

	// MaxProposalSkew is how far the time a command carries may differ from
	// the proposer's own clock (CheckTime): a Tick must be this close to
	// now, a lease or prediction no earlier than now minus this, nor later
	// than now plus MaxTimeAhead plus this. NTP keeps replicas' clocks far
	// closer; a minute tolerates a badly synchronised host.
	MaxProposalSkew = 60 * nanosPerSecond
)

// addSat is a+b for b >= 0, saturating at MaxInt64 (a state pushed before
// these bounds existed may hold a clock near it).
func addSat(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// earliestExpiryLocked is the earliest lease or live prediction expiry in
// the state, 0 when nothing can expire. It pops stale heap entries off the
// top (the heap is derived, not state), so the answer depends only on the
// state and is the same after a restore. f.mu held for writing.
func (st *state) earliestExpiryLocked() int64 {
	for len(st.heap) > 0 {
		e := st.heap[0]
		if until, ok := st.preds[e.key][e.hash]; ok && until == e.until {
			break
		}
		st.heap.pop()
	}
	var next int64
	if len(st.heap) > 0 {
		next = st.heap[0].until
	}
	for _, ws := range st.workers {
		if l := ws.rec.LeaseUntil; l != 0 && (next == 0 || l < next) {
			next = l
		}
	}
	return next
}

// earliestDueLocked is the earliest expiry a Tick would act on: leases,
// live predictions and session bindings (0: none). Bindings count here, so
// an honest Tick after a quiet spell reaches a due binding, but not in
// earliestExpiryLocked, the reference that bounds leases, predictions and
// bindings ahead (clampAheadLocked, bindLocked): a binding may last a year
// (MaxSessionTTL), and must not stretch those bounds. f.mu held for writing.
func (st *state) earliestDueLocked() int64 {
	next := st.earliestExpiryLocked()
	if s := st.earliestSessionLocked(); s != 0 && (next == 0 || s < next) {
		next = s
	}
	if p := st.earliestPinLocked(); p != 0 && (next == 0 || p < next) {
		next = p
	}
	return next
}

// tickTargetLocked is the clock a Tick{Now: now} leaves: never earlier
// than the clock (it never runs backwards), and no later than the later of
//   - clock + MaxClockStep (a forged Tick moves the clock a minute), and
//   - just before the earliest expiry the state holds (an honest Tick after
//     a long quiet spell reaches what is due without crawling there a
//     minute at a time; it expires nothing by itself, the next Tick does).
//
// Before the first Tick (clock 0) the first term means nothing: the first
// Tick sets the clock and expires nothing; with nothing that could expire
// the clock stays 0 (an empty state has no use for one, and a forged Tick
// cannot poison a new cluster's clock). clamped reports that Now was
// beyond the bound. f.mu held for writing.
func (st *state) tickTargetLocked(now int64) (next int64, clamped bool) {
	e := st.earliestDueLocked()
	var limit int64
	switch {
	case st.lastTick == 0 && e == 0:
		return 0, now > 0
	case st.lastTick == 0:
		limit = e - 1
	case e == 0:
		limit = addSat(st.lastTick, MaxClockStep)
	default:
		limit = max(addSat(st.lastTick, MaxClockStep), e-1)
	}
	if now > limit {
		now, clamped = limit, true
	}
	return max(now, st.lastTick), clamped
}

// clampAheadLocked bounds a lease or prediction expiry t to MaxTimeAhead
// past the reference time: the later of the clock and the earliest expiry
// the state holds (the clock alone may be hours stale: the leader ticks
// only when something is due). With neither, t is not judged. f.mu held
// for writing.
func (st *state) clampAheadLocked(t int64) (int64, bool) {
	ref := max(st.lastTick, st.earliestExpiryLocked())
	if ref <= 0 {
		return t, false
	}
	if limit := addSat(ref, MaxTimeAhead); t > limit {
		return limit, true
	}
	return t, false
}

// CheckTime refuses a command whose time is far from the proposer's clock
// now (unix nanoseconds): a Tick more than MaxProposalSkew from now, a
// lease or prediction expiry before now-MaxProposalSkew or after
// now+MaxTimeAhead+MaxProposalSkew. Commands without a time pass. The
// leader checks what it proposes and what /cluster/apply forwards to it;
// Apply's clamps then only matter for a proposer that skipped the check.
// The error wraps ErrInvalidCommand.
func CheckTime(c Command, now int64) error {
	switch c := c.(type) {
	case Tick:
		// Compare against bounds derived from now: c.Now - now could
		// overflow for a hostile Now.
		if c.Now > addSat(now, MaxProposalSkew) || c.Now < now-MaxProposalSkew {
			return fmt.Errorf("tick at %d is more than %s from this proposer's clock %d: %w",
				c.Now, fmtNanos(MaxProposalSkew), now, ErrInvalidCommand)
		}
	case RegisterWorker:
		if c.LeaseUntil != 0 {
			return checkAhead("register worker "+c.ID+": lease", c.LeaseUntil, now)
		}
	case Predictions:
		return checkAhead("predictions for "+string(c.Worker)+": until", c.Until, now)
	case SetWorkerDrain:
		if c.Deadline != 0 {
			return checkAhead("drain worker "+c.Worker+": deadline", c.Deadline, now)
		}
	case BindSession:
		if c.Until < now-MaxProposalSkew || c.Until > addSat(now, MaxSessionTTL+MaxProposalSkew) {
			return fmt.Errorf("bind session %q: until %d is outside [%d, %d] of this proposer's clock: %w",
				c.Session, c.Until, now-MaxProposalSkew, addSat(now, MaxSessionTTL+MaxProposalSkew), ErrInvalidCommand)
		}
	case BindSessionStages:
		if c.Until < now-MaxProposalSkew || c.Until > addSat(now, MaxSessionTTL+MaxProposalSkew) {
			return fmt.Errorf("bind session %q in two stages: until %d is outside [%d, %d] of this proposer's clock: %w",
				c.Session, c.Until, now-MaxProposalSkew, addSat(now, MaxSessionTTL+MaxProposalSkew), ErrInvalidCommand)
		}
	case PinPrefix:
		if c.Until < now-MaxProposalSkew || c.Until > addSat(now, MaxPinTTL+MaxProposalSkew) {
			return fmt.Errorf("pin prefix %x of %q: until %d is outside [%d, %d] of this proposer's clock: %w",
				c.Key, c.Model, c.Until, now-MaxProposalSkew, addSat(now, MaxPinTTL+MaxProposalSkew), ErrInvalidCommand)
		}
	}
	return nil
}

// CheckEntryTime is CheckTime for an encoded entry (what /cluster/apply
// receives). An entry of a type this build does not know passes: refusing
// unknown types is the caller's rule, not this one's.
func CheckEntryTime(data []byte, now int64) error {
	t, _, v, _, err := header(data)
	if err != nil {
		return err
	}
	switch {
	case !t.known() || v != EnvelopeVersion:
		return nil
	case t != CmdTick && t != CmdRegisterWorker && t != CmdRegisterWorkerRole && t != CmdPredictions && t != CmdSetWorkerDrain &&
		t != CmdBindSession && t != CmdPinPrefix && t != CmdBindSessionStages:
		return nil // no time inside: skip decoding (KV batches are the hot path)
	}
	c, err := Decode(data)
	if err != nil {
		return fmt.Errorf("check entry time: %w", err)
	}
	return CheckTime(c, now)
}

func checkAhead(what string, t, now int64) error {
	switch {
	case t < now-MaxProposalSkew:
		return fmt.Errorf("%s %d is more than %s before this proposer's clock %d: %w",
			what, t, fmtNanos(MaxProposalSkew), now, ErrInvalidCommand)
	case t > addSat(now, MaxTimeAhead+MaxProposalSkew):
		return fmt.Errorf("%s %d is more than %s after this proposer's clock %d: %w",
			what, t, fmtNanos(MaxTimeAhead+MaxProposalSkew), now, ErrInvalidCommand)
	}
	return nil
}

// fmtNanos prints a duration in seconds (time.Duration is out of reach).
func fmtNanos(d int64) string {
	return fmt.Sprintf("%.3fs", float64(d)/float64(nanosPerSecond))
}
