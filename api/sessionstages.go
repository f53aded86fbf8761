package api

import (
	"cmp"
	"context"
	"slices"
	"time"

	"github.com/kvrouter/kvrouter/router"
)

// Sessions and pins of two-stage (disaggregated) models (issue 28;
// DESIGN.md "Sessions" and "Prefix pins").
//
// A session of a two-stage model is bound in two stages, in one replicated
// record: its prefill worker (whose prefix cache holds the conversation the
// next turn repeats) and its decode worker (which answers, holds the
// transferred KV, and serves the turns the plan keeps aggregated). Dynamo
// does the same per phase: its prefill router and its decode router each
// keep a sticky binding of the session id. Here the two are one record,
// committed through Raft once, so every replica sends the session's next
// turn to the same pair and a rebind moves both stages at once, or only
// the stage whose worker is gone.

// workerStage is the stage a worker serves for a request.
type workerStage uint8

const (
	stagePrefill workerStage = iota + 1
	stageDecode
)

// canServeStage: w is one of dr's workers, able to serve stage st, and not
// excluded for this request (a failed attempt, a cool-down). A drained or
// deregistered worker is not among dr's workers.
func (s *Server) canServeStage(p *prepared, dr *router.DisaggRouter, w router.WorkerID, st workerStage) bool {
	if w == "" || slices.Contains(p.req.Exclude, w) {
		return false
	}
	for _, rw := range dr.Workers() {
		if rw.ID == w {
			if st == stagePrefill {
				return rw.Role.Prefills()
			}
			return rw.Role.Decodes()
		}
	}
	return false
}

// computeWorker is the worker that computes a plan's prompt, whose prefix
// cache holds it next: the prefill worker when disaggregated, else the
// decode worker.
func computeWorker(plan router.DisaggPlan) router.WorkerID {
	if plan.Disaggregated {
		return plan.PrefillWorker
	}
	return plan.DecodeWorker
}

// bindingLimits are the stages a binding decides.
func bindingLimits(b SessionBinding) router.StageLimits {
	lim := router.StageLimits{Decode: []router.WorkerID{b.Worker}}
	if b.Prefill != "" {
		lim.Prefill = []router.WorkerID{b.Prefill}
	}
	return lim
}

// planDisagg decides and books one attempt of a two-stage request: by the
// session's binding when the request has one, else by prefix pins, else as
// the two-stage router decides. A session turn carrying cache_control pins
// its prefix on the worker that computed it.
func (s *Server) planDisagg(ctx context.Context, p *prepared, dr *router.DisaggRouter, now time.Time) (router.DisaggDecision, error) {
	pr, pins := s.pinReplica()
	if p.sess != nil {
		if sr, pol, on := s.sessionReplica(); on {
			dd, err := s.routeSessionStages(ctx, sr, pol, p, dr, now)
			if err == nil && pins && p.pin != nil {
				p.pinned = true
				s.writePin(pr, p, computeWorker(dd.DisaggPlan), "pin", "")
			}
			return dd, err
		}
	}
	if pins {
		return s.routePinnedStages(pr, p, dr, now)
	}
	return dr.Route(p.req, now)
}

// routeSessionStages routes a session's turn on a two-stage model:
//   - bound, and every bound stage's worker can take it: the plan limited
//     to them (a local read, no consensus; the plan may still serve the
//     turn aggregated on the decode worker, or on it alone when the bound
//     prefill worker is busy). Hard mode: busy bound workers answer busy;
//     soft mode: normal planning and a rebind;
//   - bound to a one-stage binding (made while the model served the
//     session aggregated) and the plan disaggregates: the prefill worker
//     the cost chose (by overlap) joins the binding;
//   - a bound stage's worker gone (deregistered, drained, dead, excluded
//     after a failed attempt or a cool-down): that stage rebound to the
//     worker of the stage holding most of the session's prefix (this
//     turn's prompt), the other stage kept;
//   - unbound: a subagent's first turn seeded on its parent's workers,
//     else normal planning;
//
// and the binding is committed before the turn is sent. When another
// replica's committed first, this turn follows it.
func (s *Server) routeSessionStages(ctx context.Context, sr SessionReplica, pol SessionPolicy, p *prepared, dr *router.DisaggRouter, now time.Time) (router.DisaggDecision, error) {
	k := p.sess.key
	ttl := cmp.Or(k.TTL, pol.TTL)
	b, bound := sr.SessionBinding(k.ID)
	if !bound {
		dd, err := s.planNearParentStages(sr, p, dr, now)
		if err != nil {
			return dd, err
		}
		return s.commitStages(ctx, sr, pol, p, dr, dd, SessionBinding{}, ttl, "", now)
	}
	decodeOK := s.canServeStage(p, dr, b.Worker, stageDecode)
	prefillOK := b.Prefill == "" || s.canServeStage(p, dr, b.Prefill, stagePrefill)
	if !decodeOK || !prefillOK {
		dd, err := s.planMostPrefixStages(p, dr, b, decodeOK, prefillOK, pol.Soft, now)
		if err != nil {
			return dd, err
		}
		return s.commitStages(ctx, sr, pol, p, dr, dd, b, ttl, "worker_gone", now)
	}
	dd, err := dr.RouteWithin(p.req, bindingLimits(b), now)
	switch {
	case err == nil && (b.Prefill != "" || !dd.Disaggregated):
		// The binding decided every stage the plan uses.
		s.sessMetrics.turns.WithLabelValues("bound").Inc()
		sr.TouchSession(b, ttl)
		return dd, nil
	case err == nil:
		// A one-stage binding gains the prefill stage the cost chose.
		return s.commitStages(ctx, sr, pol, p, dr, dd, b, ttl, "", now)
	case !pol.Soft:
		return dd, err // hard: the bound workers' answer, busy or not
	}
	if dd, err = dr.Route(p.req, now); err != nil {
		return dd, err
	}
	return s.commitStages(ctx, sr, pol, p, dr, dd, b, ttl, "busy", now)
}

// planMostPrefixStages books a turn whose bound stage's worker is gone: the
// stage kept where its worker can take it, the gone stage on the worker
// of that stage holding most of the prompt's prefix (ties: the lower
// cost), falling back to normal planning — except in hard mode while the
// kept decode worker is busy: that is its answer, as for a bound turn.
func (s *Server) planMostPrefixStages(p *prepared, dr *router.DisaggRouter, b SessionBinding, decodeOK, prefillOK, soft bool, now time.Time) (router.DisaggDecision, error) {
	var lim router.StageLimits
	if decodeOK {
		lim.Decode = []router.WorkerID{b.Worker}
	}
	if b.Prefill != "" && prefillOK {
		lim.Prefill = []router.WorkerID{b.Prefill}
	}
	plan, err := dr.PlanWithin(p.req, lim, now)
	switch {
	case err != nil && decodeOK && !soft:
		return plan, err
	case err != nil:
		return dr.Route(p.req, now)
	}
	if !decodeOK {
		if w := mostPrefix(plan.Decode.Rows); w != "" {
			lim.Decode = []router.WorkerID{w}
		}
	}
	if !prefillOK && plan.PrefillErr == nil {
		if w := mostPrefix(plan.Prefill.Rows); w != "" {
			lim.Prefill = []router.WorkerID{w}
		}
	}
	dd, err := dr.RouteWithin(p.req, lim, now)
	if err == nil || (decodeOK && !soft) {
		return dd, err
	}
	return dr.Route(p.req, now)
}

// mostPrefix is the worker of rows that can take the request holding most
// of its prefix (ties: the lower cost); "" when none can.
func mostPrefix(rows []router.WorkerCost) router.WorkerID {
	best := -1
	for i, r := range rows {
		if r.Busy {
			continue
		}
		if best < 0 || r.Overlap > rows[best].Overlap || (r.Overlap == rows[best].Overlap && r.Cost < rows[best].Cost) {
			best = i
		}
	}
	if best < 0 {
		return ""
	}
	return rows[best].Worker
}

// planNearParentStages places a subagent's first turn on its parent
// session's workers when the parent is bound and they can take it (the
// parent's binding seeds the placement, Dynamo's parent-aware affinity; a
// busy parent never refuses the turn), else as the router decides.
func (s *Server) planNearParentStages(sr SessionReplica, p *prepared, dr *router.DisaggRouter, now time.Time) (router.DisaggDecision, error) {
	if parent := p.sess.key.Parent; parent != "" {
		if pb, ok := sr.SessionBinding(parent); ok && s.canServeStage(p, dr, pb.Worker, stageDecode) {
			lim := router.StageLimits{Decode: []router.WorkerID{pb.Worker}}
			if s.canServeStage(p, dr, pb.Prefill, stagePrefill) {
				lim.Prefill = []router.WorkerID{pb.Prefill}
			}
			if dd, err := dr.RouteWithin(p.req, lim, now); err == nil {
				return dd, nil
			}
		}
	}
	return dr.Route(p.req, now)
}

// commitStages commits the binding a booked plan makes (seen: the binding
// in force when the turn looked, zero when none; reason: why it moved, ""
// for a new binding or a stage added) and returns the plan, or the plan of
// the binding another replica committed first. A binding that cannot be
// committed leaves the turn served unbound (affinity is an optimisation).
func (s *Server) commitStages(ctx context.Context, sr SessionReplica, pol SessionPolicy, p *prepared, dr *router.DisaggRouter,
	dd router.DisaggDecision, seen SessionBinding, ttl time.Duration, reason string, now time.Time) (router.DisaggDecision, error) {
	m, k := s.sessMetrics, p.sess.key
	want := SessionBind{Session: k.ID, Parent: k.Parent, Worker: dd.DecodeWorker, TTL: ttl,
		Replace: seen.Worker, ReplacePrefill: seen.Prefill}
	switch {
	case dd.Disaggregated:
		want.Prefill = dd.PrefillWorker
	case seen.Prefill != "" && seen.Prefill != dd.DecodeWorker && s.canServeStage(p, dr, seen.Prefill, stagePrefill):
		// An aggregated turn keeps a live bound prefill stage for the
		// session's next disaggregated turn.
		want.Prefill = seen.Prefill
	}
	if seen.Worker != "" && want.Worker == seen.Worker && (want.Prefill == seen.Prefill || want.Prefill == "") {
		// Nothing moves: most prefix chose the bound workers again, or an
		// aggregated turn on the bound decode worker (a gone prefill stage
		// stays in the binding until a disaggregated turn replaces it).
		m.turns.WithLabelValues("bound").Inc()
		sr.TouchSession(seen, ttl)
		return dd, nil
	}
	start := time.Now()
	got, err := sr.BindSession(ctx, want)
	m.bindDur.Observe(time.Since(start).Seconds())
	switch {
	case err != nil && ctx.Err() != nil:
		return dd, nil // the client left while the bind waited for a leader (routeSession)
	case err != nil:
		m.countMiss(err)
		s.log.Debug("two-stage session turn served unbound", "session", k.ID, "request", p.req.ID, "err", err)
		return dd, nil
	case got.Worker == want.Worker && (want.Prefill == "" || got.Prefill == want.Prefill):
		switch {
		case reason != "":
			m.rebinds.WithLabelValues(reason).Inc()
			m.turns.WithLabelValues("rebind").Inc()
		case seen.Worker == "":
			m.binds.Inc()
			m.turns.WithLabelValues("bind").Inc()
		default:
			m.turns.WithLabelValues("bind").Inc() // a one-stage binding gained its prefill stage
		}
		return dd, nil
	}
	// Another replica's binding committed first: follow it.
	dr.Free(p.req.ID)
	m.turns.WithLabelValues("follow").Inc()
	if s.canServeStage(p, dr, got.Worker, stageDecode) {
		lim := bindingLimits(got)
		if got.Prefill != "" && !s.canServeStage(p, dr, got.Prefill, stagePrefill) {
			lim.Prefill = nil
		}
		if dd2, err := dr.RouteWithin(p.req, lim, now); err == nil || !pol.Soft {
			return dd2, err
		}
	}
	return dr.Route(p.req, now)
}

// routePinnedStages routes a two-stage request when pinning is on. A
// pinned prefix steers the stage that computes the prompt to its holders:
// the prefill stage to the holders that are prefill workers; when none is
// live but a holder is a live decode worker (the prefix was pinned while
// the plan served it aggregated there), the decode stage to those. Like a
// pin of an aggregated model it is hard: holders that are busy answer busy
// (a busy limited prefill stage serves the request aggregated on the
// decode worker; the pin is then not refreshed). No holder live: the
// normal plan, and the pin moves to the worker that computed the prompt.
func (s *Server) routePinnedStages(pr PinReplica, p *prepared, dr *router.DisaggRouter, now time.Time) (router.DisaggDecision, error) {
	match, hit := PinMatch{}, false
	if pr.PinCount() > 0 && len(p.req.Hashes) > 0 {
		match, hit = pr.PinLookup(p.model, p.req.Hashes)
	}
	p.pinned = hit || p.pin != nil
	if !hit {
		dd, err := dr.Route(p.req, now)
		if err == nil && p.pin != nil {
			s.writePin(pr, p, computeWorker(dd.DisaggPlan), "pin", "")
		}
		return dd, err
	}
	var lim router.StageLimits
	for _, h := range match.Holders {
		if s.canServeStage(p, dr, h.Worker, stagePrefill) {
			lim.Prefill = append(lim.Prefill, h.Worker)
		}
	}
	if lim.Prefill == nil {
		for _, h := range match.Holders {
			if s.canServeStage(p, dr, h.Worker, stageDecode) {
				lim.Decode = append(lim.Decode, h.Worker)
			}
		}
	}
	if lim.Prefill == nil && lim.Decode == nil {
		dd, err := dr.Route(p.req, now)
		if err == nil {
			s.movePin(pr, p, match, computeWorker(dd.DisaggPlan))
		}
		return dd, err
	}
	dd, err := dr.RouteWithin(p.req, lim, now)
	if err != nil {
		return dd, err
	}
	served := computeWorker(dd.DisaggPlan) // a prefill holder computed the prompt, or the plan went elsewhere
	if lim.Decode != nil {
		served = dd.DecodeWorker // a decode holder took the transferred KV (or computed it)
	}
	s.pinHit(pr, p, match, served)
	return dd, nil
}
