package api

import "time"

// The tenant latency guard (TenantConfig.LatencyGuard, kvrouter serve
// --tenant-latency-guard; DESIGN.md, "Tenants and priority classes"): a
// request of a tenant over its share, while another tenant is active, is
// admitted only while some worker of its model is predicted to give a fresh
// request its TTFT and TPOT within the factor × their idle values
// (router.Router.LatencyGuard, the SLO rule's prediction), and is then
// routed to such a worker only; otherwise it waits in the admission queue
// like a request over the queue threshold. Tenants at or under their share
// are never held by it.

// guardHolds reports whether the latency guard holds p in the queue now,
// and keeps in p.guardOut the workers it keeps p off. A replica's wait loop
// calls it on every wake and tick, so it judges the load as it is when p
// goes.
func (s *Server) guardHolds(p *prepared) bool {
	p.guardOut = p.guardOut[:0]
	if s.tenants == nil {
		return false
	}
	f := s.tenants.Guard(p.model, p.tenant)
	if f == 0 {
		return false
	}
	guard := p.rt.LatencyGuard
	if p.isoOver && len(p.isoOut) > 0 {
		// The workers isolation leaves it, judged by the first token
		// alone (router.Router.FirstTokenGuard).
		guard = p.rt.FirstTokenGuard
	}
	out, hold := guard(isolationReq(p), f, time.Now(), p.guardOut)
	p.guardOut = out
	if hold && !p.guardHeld {
		p.guardHeld = true
		s.tenantMetrics.guardHeld.WithLabelValues(p.model).Inc()
	}
	return hold
}

// guardExclude adds the workers the guard and tenant isolation kept p
// off, at its admission, to the ones its routing excludes.
func (s *Server) guardExclude(p *prepared) {
	if len(p.isoOut) > 0 {
		p.req.Exclude = append(p.req.Exclude, p.isoOut...)
		p.isoOut = nil
	}
	if len(p.guardOut) > 0 {
		p.req.Exclude = append(p.req.Exclude, p.guardOut...)
		p.guardOut = nil
	}
}
