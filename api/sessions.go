package api

import (
	"cmp"
	"context"
	"errors"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api/session"
	"github.com/kvrouter/kvrouter/router"
)

// Session affinity (issue 28; DESIGN.md "Sessions"): a session's turns go
// to the worker its binding names. Bindings are replicated state (the
// control group's FSM), so the replica reads them locally: a bound turn
// pays no consensus round trip. A session's first turn (or a rebind)
// commits its binding through Raft before the turn is sent, so the next
// turn, through any replica, however soon, finds it.

// SessionReplica is the optional part of a Replica that keeps session
// bindings (found by type assertion, like DisaggReplica). Without it, or
// with a zero TTL, session input is not read and requests are routed as
// before.
type SessionReplica interface {
	// SessionAffinity is the configured policy; TTL 0 = affinity off.
	SessionAffinity() SessionPolicy
	// SessionBinding reads a binding from the local replicated state.
	SessionBinding(id string) (SessionBinding, bool)
	// BindSession commits a binding (or a rebind: Replace is the worker
	// found gone) and returns the binding in force after the commit: the
	// one asked for, or another replica's that committed first.
	BindSession(ctx context.Context, b SessionBind) (SessionBinding, error)
	// TouchSession tells the replica a bound turn was served: it refreshes
	// the binding's expiry when less than half its TTL is left (a Raft
	// entry per session per half TTL at most, never per turn). Never blocks.
	TouchSession(b SessionBinding, ttl time.Duration)
	// EndSession ends a binding (X-Dynamo-Session-Final) in the background.
	EndSession(id string)
	// SessionCount is the number of bindings held.
	SessionCount() int
}

// SessionPolicy is --router-session-affinity-ttl-secs and -mode.
type SessionPolicy struct {
	TTL  time.Duration // idle TTL; 0 = off
	Soft bool          // soft: the bound worker is preferred; hard: required
}

// SessionBinding is one binding as the replicated state holds it. A
// session of a two-stage model is bound in two stages (sessionstages.go):
// Worker is its decode worker, Prefill its prefill worker; "" for a
// one-stage binding.
type SessionBinding struct {
	Session string          `json:"session"`
	Worker  router.WorkerID `json:"worker"`
	Prefill router.WorkerID `json:"prefill,omitempty"`
	Parent  string          `json:"parent,omitempty"`
	Until   time.Time       `json:"expires"`
}

// SessionBind asks for a binding: one-stage when Prefill is "", else both
// stages of a two-stage model in one record.
type SessionBind struct {
	Session, Parent string
	Worker          router.WorkerID
	Replace         router.WorkerID // the worker seen bound (and found gone, or busy); "" = none
	// Prefill is the prefill stage of a two-stage binding; ReplacePrefill
	// the prefill stage of the binding seen ("" = it had none). A
	// two-stage bind moves the binding only if the one in force is still
	// (ReplacePrefill, Replace).
	Prefill, ReplacePrefill router.WorkerID
	TTL                     time.Duration
}

// sessionTurn is a request's session and what its routing did.
type sessionTurn struct {
	key session.Key
	// worker is the session's worker for this turn ("" until routed, or
	// when the turn is served unbound).
	worker router.WorkerID
}

// sessionMetrics count what bindings did (kvrouter_session_*).
type sessionMetrics struct {
	turns   *prometheus.CounterVec
	binds   prometheus.Counter
	rebinds *prometheus.CounterVec
	misses  *prometheus.CounterVec
	bindDur prometheus.Histogram
}

// countMiss counts a turn served unbound because its binding could not be
// committed: limit (every binding slot held) or unavailable (no quorum).
func (m *sessionMetrics) countMiss(err error) {
	why := "unavailable"
	if errors.Is(err, ErrSessionLimit) {
		why = "limit"
	}
	m.misses.WithLabelValues(why).Inc()
	m.turns.WithLabelValues("miss").Inc()
}

func newSessionMetrics(reg prometheus.Registerer, sr SessionReplica) *sessionMetrics {
	m := &sessionMetrics{
		turns: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_session_turns_total",
			Help: "Requests carrying a session (two-stage turns included), by how they were routed: bound (the binding's worker), bind (a new binding), rebind, follow (another replica's binding committed first), miss (served unbound)."}, []string{"outcome"}),
		binds: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_session_binds_total",
			Help: "New session bindings this replica committed (a session's first turn)."}),
		rebinds: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_session_rebinds_total",
			Help: "Bindings this replica moved to another worker, by reason: worker_gone (deregistered, dead, failed the turn), busy (soft mode) or drain_copy (moved after its drain copy answered, --router-drain-shadow)."}, []string{"reason"}),
		misses: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_session_misses_total",
			Help: "Session turns served without a binding because none could be committed, by reason: limit (65,536 bindings held) or unavailable (no Raft commit)."}, []string{"reason"}),
		bindDur: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvrouter_session_bind_seconds",
			Help:    "What committing a binding adds to a session's first turn (a Raft round trip through the control group's leader).",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1}}),
	}
	bindings := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvrouter_session_bindings",
		Help: "Session bindings in the replicated state (every replica reports the same count)."},
		func() float64 { return float64(sr.SessionCount()) })
	reg.MustRegister(m.turns, m.binds, m.rebinds, m.misses, m.bindDur, bindings)
	return m
}

// sessionReplica returns the replica's session support when affinity is on.
func (s *Server) sessionReplica() (SessionReplica, SessionPolicy, bool) {
	sr, ok := s.rep.(SessionReplica)
	if !ok {
		return nil, SessionPolicy{}, false
	}
	pol := sr.SessionAffinity()
	return sr, pol, pol.TTL > 0
}

// readSession parses the request's session when affinity is on, answering
// 400 itself on malformed input (nothing bound, nothing proposed).
func (s *Server) readSession(header http.Header, body []byte) (*sessionTurn, *refusal) {
	if _, _, on := s.sessionReplica(); !on {
		return nil, nil // Dynamo: without the TTL, session ids are passive metadata
	}
	k, err := session.FromRequest(header, body)
	if err != nil {
		s.metrics.rejected.WithLabelValues("invalid_session").Inc()
		return nil, &refusal{status: http.StatusBadRequest, kind: "invalid_request_error", msg: err.Error()}
	}
	if k.ID == "" {
		return nil, nil
	}
	return &sessionTurn{key: k}, nil
}

// route decides and books one attempt: by the session's binding when the
// request has one, else as the router decides.
// A session's binding comes first; then prefix pins (pins.go), which also
// pin what a session turn asks after its binding placed it.
func (s *Server) route(ctx context.Context, p *prepared, now time.Time) (router.Decision, error) {
	pr, pins := s.pinReplica()
	if p.sess != nil {
		if sr, pol, on := s.sessionReplica(); on {
			d, err := s.routeSession(ctx, sr, pol, p, now)
			if err == nil && pins && p.pin != nil {
				s.writePin(pr, p, d.Worker, "pin", "")
			}
			return d, err
		}
	}
	if pins {
		return s.routePinned(pr, p, now)
	}
	return p.rt.Route(p.req, now)
}

// routeSession routes a session's turn:
//   - bound to a worker that can take it: that worker (a local read, no
//     consensus); in soft mode, a busy bound worker yields to normal
//     selection and the session is rebound;
//   - bound to a worker that is gone (deregistered, dead, excluded after a
//     failed attempt): rebound to the worker holding most of the session's
//     prefix (this turn's prompt);
//   - unbound: a subagent starts on its parent's worker when the parent is
//     bound (Dynamo's parent-aware seeding), else normal selection;
//
// and a new binding is committed before the turn is sent. When another
// replica's binding committed first, this turn follows it.
func (s *Server) routeSession(ctx context.Context, sr SessionReplica, pol SessionPolicy, p *prepared, now time.Time) (router.Decision, error) {
	m, k := s.sessMetrics, p.sess.key
	ttl := cmp.Or(k.TTL, pol.TTL)
	b, bound := sr.SessionBinding(k.ID)
	var replace router.WorkerID
	reason := "worker_gone"
	if bound {
		if s.canServe(p, b.Worker) {
			d, err := p.rt.Route(pinned(p.req, p.rt, b.Worker), now)
			if err == nil || !pol.Soft {
				if err == nil {
					p.sess.worker = b.Worker
					m.turns.WithLabelValues("bound").Inc()
					sr.TouchSession(b, ttl)
				}
				return d, err // hard: the bound worker's answer, busy or not
			}
			reason = "busy"
		}
		replace = b.Worker
	}
	var d router.Decision
	var err error
	switch {
	case bound && reason == "worker_gone":
		d, err = s.routeMostPrefix(p, now)
	case !bound && k.Parent != "":
		d, err = s.routeNearParent(sr, p, now)
	default:
		d, err = p.rt.Route(p.req, now)
	}
	if err != nil {
		return d, err
	}
	start := time.Now()
	got, err := sr.BindSession(ctx, SessionBind{Session: k.ID, Parent: k.Parent, Worker: d.Worker, Replace: replace, TTL: ttl})
	m.bindDur.Observe(time.Since(start).Seconds())
	switch {
	case err != nil && ctx.Err() != nil:
		// The client left while the bind waited for a leader (HAProxy
		// cuts the connections of a replica that lost its leader): no
		// miss; the attempt finds the client gone and answers 499.
		return d, nil
	case err != nil:
		// Serve the turn anyway, unbound: affinity is an optimisation.
		m.countMiss(err)
		s.log.Debug("session turn served unbound", "session", k.ID, "request", p.req.ID, "err", err)
		return d, nil
	case got.Worker == d.Worker:
		p.sess.worker = d.Worker
		if replace != "" {
			m.rebinds.WithLabelValues(reason).Inc()
			m.turns.WithLabelValues("rebind").Inc()
		} else {
			m.binds.Inc()
			m.turns.WithLabelValues("bind").Inc()
		}
		return d, nil
	}
	// Another replica's binding committed first: follow it.
	p.rt.Free(p.req.ID)
	m.turns.WithLabelValues("follow").Inc()
	if s.canServe(p, got.Worker) {
		if d2, err := p.rt.Route(pinned(p.req, p.rt, got.Worker), now); err == nil || !pol.Soft {
			if err == nil {
				p.sess.worker = got.Worker
			}
			return d2, err
		}
	}
	return p.rt.Route(p.req, now)
}

// routeMostPrefix books the turn on the worker holding most of its prefix
// among those that can take it (ties: the lower cost), falling back to
// normal selection.
func (s *Server) routeMostPrefix(p *prepared, now time.Time) (router.Decision, error) {
	d, err := p.rt.Decide(p.req, now)
	if err != nil {
		return p.rt.Route(p.req, now)
	}
	best := -1
	for i, r := range d.Rows {
		if r.Busy {
			continue
		}
		if best < 0 || r.Overlap > d.Rows[best].Overlap || (r.Overlap == d.Rows[best].Overlap && r.Cost < d.Rows[best].Cost) {
			best = i
		}
	}
	if best >= 0 {
		if d2, err := p.rt.Route(pinned(p.req, p.rt, d.Rows[best].Worker), now); err == nil {
			return d2, nil
		}
	}
	return p.rt.Route(p.req, now)
}

// routeNearParent places a subagent's first turn on its parent session's
// worker when the parent is bound and the worker can take it, else as the
// router decides: the parent's worker seeds the placement (Dynamo's
// parent-aware affinity), it is not a binding of this session, so a busy
// parent worker never refuses the turn in either mode.
func (s *Server) routeNearParent(sr SessionReplica, p *prepared, now time.Time) (router.Decision, error) {
	pb, ok := sr.SessionBinding(p.sess.key.Parent)
	if ok && s.canServe(p, pb.Worker) {
		if d, err := p.rt.Route(pinned(p.req, p.rt, pb.Worker), now); err == nil {
			return d, nil
		}
	}
	return p.rt.Route(p.req, now)
}

// canServe: w is one of the model's workers and not excluded for this
// request (a failed attempt, a cool-down).
func (s *Server) canServe(p *prepared, w router.WorkerID) bool {
	if slices.Contains(p.req.Exclude, w) {
		return false
	}
	return slices.ContainsFunc(p.rt.Workers(), func(i router.WorkerInfo) bool { return i.ID == w })
}

// pinned is req restricted to worker w: every other worker excluded.
func pinned(req router.Request, rt *router.Router, w router.WorkerID) router.Request {
	ws := rt.Workers()
	ex := make([]router.WorkerID, 0, len(ws))
	for _, i := range ws {
		if i.ID != w {
			ex = append(ex, i.ID)
		}
	}
	req.Exclude = ex
	return req
}

// endSession ends the binding of a session's last turn
// (X-Dynamo-Session-Final, nvext.session_control action close), after the
// answer.
func (s *Server) endSession(p *prepared) {
	if p.sess == nil || !p.sess.key.Final {
		return
	}
	if sr, _, on := s.sessionReplica(); on {
		sr.EndSession(p.sess.key.ID)
		s.dropSessionBody(p.sess.key.ID)
	}
}

// getSession is GET /sessions/{id} (admin): one binding, from this
// replica's replicated state, after a read barrier.
func (s *Server) getSession(c *gin.Context) {
	sr, ok := s.rep.(SessionReplica)
	if !ok {
		openAIError(c, http.StatusNotFound, "not_found_error", "session affinity is not supported by this replica")
		return
	}
	id := strings.TrimPrefix(c.Param("id"), "/")
	if err := session.CheckID("session id", id); err != nil || id == "" {
		openAIError(c, http.StatusBadRequest, "invalid_request_error", "session id: 1 to 256 bytes of UTF-8 without control characters")
		return
	}
	if err := s.rep.ReadBarrier(c.Request.Context()); err != nil {
		openAIError(c, statusOf(err), "server_error", err.Error())
		return
	}
	b, bound := sr.SessionBinding(id)
	if !bound {
		openAIError(c, http.StatusNotFound, "not_found_error", "session "+id+" is not bound")
		return
	}
	pol := sr.SessionAffinity()
	mode := "hard"
	if pol.Soft {
		mode = "soft"
	}
	out := gin.H{"session": b.Session, "worker": b.Worker, "parent": b.Parent,
		"expires": b.Until.UTC().Format(time.RFC3339Nano), "ttl_seconds": pol.TTL.Seconds(), "mode": mode}
	if b.Prefill != "" {
		// A two-stage binding: worker is its decode stage.
		out["prefill_worker"], out["decode_worker"] = b.Prefill, b.Worker
	}
	c.JSON(http.StatusOK, out)
}

// ErrSessionLimit is what BindSession returns while the state holds its
// maximum of bindings (the replica wraps fsm.ErrSessionLimit in it).
var ErrSessionLimit = errors.New("session bindings full")
