package replica

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/fsm"
)

// Session affinity (issue 28; api.SessionReplica). Bindings are replicated
// state of the control group's FSM (fsm/sessions.go): every replica reads
// them locally, and a binding is committed through Raft before a session's
// first turn is sent, so every replica routes the session's next turn to
// the same worker. Expiry is the FSM's: the control group's leader ticks
// when a binding is due (fsm.NextExpiry), so every replica drops it at the
// same log index.

// SessionConfig is --router-session-affinity-ttl-secs and
// --router-session-affinity-mode.
type SessionConfig struct {
	TTL  time.Duration // idle TTL; 0 = affinity off
	Soft bool          // soft: the bound worker is preferred, not required
}

// sessionWrites are the replica's background binding writes: refreshes of
// bound sessions (coalesced: at most one in flight per session) and ends.

var _ api.SessionReplica = (*replica)(nil)

func (r *replica) SessionAffinity() api.SessionPolicy {
	return api.SessionPolicy{TTL: r.cfg.Sessions.TTL, Soft: r.cfg.Sessions.Soft}
}

func (r *replica) SessionCount() int { return r.fsm.SessionCount() }

// SessionBinding reads the control group's FSM: no consensus round trip.
func (r *replica) SessionBinding(id string) (api.SessionBinding, bool) {
	b, ok := r.fsm.Session(id)
	if !ok {
		return api.SessionBinding{}, false
	}
	return apiBinding(b), true
}

func apiBinding(b fsm.SessionBinding) api.SessionBinding {
	return api.SessionBinding{Session: b.Session, Worker: b.Worker, Prefill: b.Prefill, Parent: b.Parent, Until: time.Unix(0, b.Until)}
}

// BindSession proposes the binding (stamped with this replica's clock plus
// the TTL) to the control group and returns the binding in force after
// its commit, which the leader's apply result carries: the one asked for,
// or the one another replica committed first. While no leader can take it
// (an election) it retries, up to sessionBindWait.
func (r *replica) BindSession(ctx context.Context, b api.SessionBind) (api.SessionBinding, error) {
	ctx, cancel := context.WithTimeout(ctx, sessionBindWait)
	defer cancel()
	for {
		res, err := r.proposeSession(ctx, bindCommand(b, time.Now()))
		switch {
		case err == nil && res.Session == nil:
			return api.SessionBinding{}, fmt.Errorf("bind session %q: the commit reported no binding", b.Session)
		case err == nil:
			return apiBinding(*res.Session), nil
		case errors.Is(err, fsm.ErrInvalidCommand), errors.Is(err, api.ErrSessionLimit), errors.Is(err, api.ErrInvalid):
			return api.SessionBinding{}, err // the state refuses it: retrying cannot help
		}
		// No leader reachable (an election, its address not yet
		// registered, a timeout): wait for one, within sessionBindWait. A
		// retry of a bind that did commit is a touch of the same binding.
		t := time.NewTimer(sessionBindRetry)
		select {
		case <-ctx.Done():
			t.Stop()
			return api.SessionBinding{}, fmt.Errorf("bind session %q: %w (last: %v)", b.Session, ctx.Err(), err)
		case <-t.C:
		}
	}
}

// bindCommand is the command of a bind: BindSession (17) for a one-stage
// binding, BindSessionStages (21) for a two-stage one, stamped with now
// plus the TTL.
func bindCommand(b api.SessionBind, now time.Time) fsm.Command {
	until := now.Add(b.TTL).UnixNano()
	if b.Prefill != "" {
		c := fsm.BindSessionStages{Session: b.Session, Prefill: b.Prefill, Decode: b.Worker, Parent: b.Parent, Until: until}
		if b.Replace != "" {
			c.SeenPrefill, c.SeenDecode = b.ReplacePrefill, b.Replace
		}
		return c
	}
	return fsm.BindSession{Session: b.Session, Worker: b.Worker, Parent: b.Parent, Until: until, Replace: b.Replace}
}

// proposeSession validates, encodes and commits a binding command; a full
// binding table is api.ErrSessionLimit.
func (r *replica) proposeSession(ctx context.Context, c fsm.Command) (*fsm.ApplyResult, error) {
	var check error
	switch bc := c.(type) {
	case fsm.BindSession:
		check = r.fsm.CheckBindSession(bc)
	case fsm.BindSessionStages:
		check = r.fsm.CheckBindSessionStages(bc)
	}
	if check != nil {
		return nil, sessionError(check)
	}
	res, err := r.commitControl(ctx, c)
	if err != nil {
		return nil, err
	}
	if res.Err != nil {
		return nil, sessionError(res.Err)
	}
	return res, nil
}

func sessionError(err error) error {
	if errors.Is(err, fsm.ErrSessionLimit) {
		return fmt.Errorf("%w: %v", api.ErrSessionLimit, err)
	}
	return err
}

// TouchSession refreshes a bound session's expiry once less than half its
// TTL is left, in the background: an active session writes one entry per
// half TTL, never one per turn. The cost: a binding may expire up to half
// a TTL early after the session's last turn (its expiry is between TTL/2
// and TTL after that turn), and every replica agrees on when. A two-stage
// binding is touched through its decode worker: BindSession keeps its
// prefill stage.
func (r *replica) TouchSession(b api.SessionBinding, ttl time.Duration) {
	if ttl <= 0 || time.Until(b.Until) >= ttl/2 {
		return
	}
	r.sessionWrite(b.Session, fsm.BindSession{Session: b.Session, Worker: b.Worker, Parent: b.Parent,
		Until: time.Now().Add(ttl).UnixNano()})
}

// EndSession ends a session's binding in the background.
func (r *replica) EndSession(id string) {
	r.sessionWrite(id, fsm.UnbindSessions{Session: id})
}

// sessionWrite commits c in the background unless a write of the same
// session is in flight (a burst of turns writes once).
func (r *replica) sessionWrite(id string, c fsm.Command) {
	r.sessWrites.start(id, r.log, "session write", func() error {
		_, err := r.proposeSession(context.Background(), c)
		return err
	}, "session", id, "command", c.Type().String())
}

// sessionStatus is the "sessions" part of /cluster/status: the policy, the
// count and the bindings per worker id.
func (r *replica) sessionStatus() map[string]any {
	mode := "hard"
	if r.cfg.Sessions.Soft {
		mode = "soft"
	}
	return map[string]any{"ttl_seconds": r.cfg.Sessions.TTL.Seconds(), "mode": mode,
		"bindings": r.fsm.SessionCount(), "per_worker": r.fsm.SessionsPerWorker()}
}
