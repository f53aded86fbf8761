package api

import (
	"slices"
	"time"

	"github.com/kvrouter/kvrouter/api/tenant"
	"github.com/kvrouter/kvrouter/router"
)

// Tenant isolation (TenantConfig.Isolation, kvrouter serve
// --tenant-isolation S; DESIGN.md, "Tenants and priority classes"): while a
// tenant is over its share, the ledger reserves k of the model's workers
// for the tenants under theirs (tenant.Ledger.Isolation says k, from the
// shared counters; tenant.ReservedWorkers which, from the worker ids
// alone, so every replica reserves the same ones without a word). A
// request of the over-share tenant is admitted only while a worker outside
// the set has room (router.Router.ShouldQueueExcept) and is routed there;
// a request of a tenant under its share is routed, with the latency guard
// on, among the workers quickest to its first token, the reserved ones
// first when they are among them (router.Router.FirstTokenOrder: the guard
// keeps the unreserved workers quick); without it, among the reserved
// workers while one of them has room, else among all by cost. With the
// latency guard too, the guard judges the workers isolation leaves the
// over-share tenant.

// isolationHolds reports whether tenant isolation holds p in the queue now
// (its tenant is over its share, by its recent demand and by the fair
// queue's counters, and every unreserved worker is over share of its
// window), and keeps in p.isoOut the workers it keeps p off at
// admission: the reserved ones (p.isoOver), or, for a tenant under its
// share, with the guard the ones slower to its first token than the
// quickest (router.Router.FirstTokenOrder), without it the unreserved ones
// while a reserved worker has room. A
// replica's wait loop calls it on every wake and tick.
func (s *Server) isolationHolds(p *prepared, share float64) bool {
	p.isoOut, p.isoOver = p.isoOut[:0], false
	if s.tenants == nil || s.tenants.Config().Isolation == 0 {
		return false
	}
	p.isoIDs = p.rt.WorkerIDs(p.isoIDs[:0])
	k, over := s.tenants.Isolation(p.model, p.tenant, len(p.isoIDs))
	if k == 0 {
		return false
	}
	reserved := tenant.ReservedWorkers(p.model, p.isoIDs, k, p.isoOut)
	if over {
		p.isoOut, p.isoOver = reserved, true
		// Held only while that holds nobody else behind it
		// (tenant.Ledger.MayHold); else admitted like any request,
		// then kept off the reserved workers all the same.
		hold := p.rt.ShouldQueueExcept(share, p.req, reserved) && s.tenants.MayHold(p.model, p.tenant)
		if hold && !p.isoHeld {
			p.isoHeld = true
			s.tenantMetrics.isolationHeld.WithLabelValues(p.model).Inc()
		}
		return hold
	}
	if s.tenants.Config().LatencyGuard > 0 {
		// Under its share, with the guard keeping the unreserved workers
		// quick to a first token: the quickest workers, the reserved
		// ones among them first (router.Router.FirstTokenOrder).
		out := p.rt.FirstTokenOrder(p.req, reserved, time.Now(), reserved[len(reserved):])
		p.isoOut = append(reserved[:0], out...)
		return false
	}
	others := reserved[len(reserved):]
	for _, w := range p.isoIDs {
		if !slices.Contains(reserved, w) {
			others = append(others, w)
		}
	}
	if p.rt.ShouldQueueExcept(1, p.req, others) {
		p.isoOut = reserved[:0] // every reserved worker is full: anywhere by cost
		return false
	}
	p.isoOut = append(reserved[:0], others...)
	return false
}

// isolationPasses reports whether p, arriving with requests queued, may
// pass them when it has room now (tenant.Ledger.IsolationPasses: isolation
// reserves workers, p's tenant is under its share and has nothing queued
// here).
func (s *Server) isolationPasses(p *prepared) bool {
	if s.tenants == nil || s.tenants.Config().Isolation == 0 {
		return false
	}
	p.isoIDs = p.rt.WorkerIDs(p.isoIDs[:0])
	return s.tenants.IsolationPasses(p.model, p.tenant, len(p.isoIDs))
}

// isolationReq is p's request as the latency guard judges it: without the
// workers isolation keeps an over-share tenant off.
func isolationReq(p *prepared) router.Request {
	req := p.req
	if p.isoOver && len(p.isoOut) > 0 {
		req.Exclude = append(slices.Clone(p.req.Exclude), p.isoOut...)
	}
	return req
}
