package api

import (
	"fmt"
	"math"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// The request path's side of tenant fairness (tenants.go): who a request is
// for, its budgets at admission, its charges, its metrics. Every function
// here does nothing when fairness is off.

// tenantOf is the tenant a request is served for, resolved to the id its
// share is kept under ("" when fairness is off).
func (s *Server) tenantOf(header http.Header, key, model string) string {
	if s.tenants == nil {
		return ""
	}
	return s.tenants.Resolve(model, s.tenants.Identify(key, header.Get))
}

// capStrictPriority bounds a client's strict_priority by the same cap as its
// priority (MaxPriority, MaxPriorityByKey): a strict tier jumps every
// tenant's queue, so only keys trusted with a priority may claim one. The
// default cap (math.MaxInt32, "none, as Dynamo") leaves it alone.
func (s *Server) capStrictPriority(key string, strict uint32) uint32 {
	limit := s.capPriority(key, math.MaxInt32)
	if limit >= math.MaxInt32 {
		return strict
	}
	return min(strict, uint32(max(limit, 0)))
}

// tenantBegin checks the tenant's budgets and counts the request in flight;
// the 429 (with Retry-After) to answer when it is over a budget.
func (s *Server) tenantBegin(p *prepared) *refusal {
	if s.tenants == nil || p.begun {
		return nil
	}
	retry, ok := s.tenants.Begin(p.model, p.tenant)
	if !ok {
		secs := max(int(math.Ceil(retry.Seconds())), 1)
		s.metrics.rejected.WithLabelValues("tenant_budget").Inc()
		s.tenantMetrics.rejected.WithLabelValues(p.model, s.tenants.Series(p.model, p.tenant)).Inc()
		return &refusal{status: http.StatusTooManyRequests, kind: "rate_limit_exceeded", retryAfter: secs,
			msg: fmt.Sprintf("tenant %q is over its budget for model %q (tokens per minute or concurrent requests): retry in %d s", p.tenant, p.model, secs)}
	}
	p.begun = true
	return nil
}

// tenantEnd counts the request out of its tenant's requests in flight.
func (s *Server) tenantEnd(p *prepared) {
	if s.tenants == nil || !p.begun {
		return
	}
	p.begun = false
	s.tenants.End(p.model, p.tenant)
}

// chargeTenant adds tokens of a kind (prompt, output) to the tenant's
// counter and series.
func (s *Server) chargeTenant(p *prepared, tokens int, kind string) {
	if s.tenants == nil || tokens <= 0 {
		return
	}
	s.tenants.Charge(p.model, p.tenant, tokens)
	s.tenantMetrics.tokens.WithLabelValues(p.model, s.tenants.Series(p.model, p.tenant), kind).Add(float64(tokens))
}

// chargeOutput charges the output tokens beyond those already charged:
// total is the request's output so far (streamed tokens, or the usage the
// answer reported at its end), so each token is charged once.
func (s *Server) chargeOutput(p *prepared, total int) {
	if total > p.charged {
		s.chargeTenant(p, total-p.charged, "output")
		p.charged = total
	}
}

// tenantQueued observes a request's time in the admission queue.
func (s *Server) tenantQueued(p *prepared, waited time.Duration) {
	if s.tenants == nil {
		return
	}
	s.tenantMetrics.queue.WithLabelValues(p.model, s.tenants.Series(p.model, p.tenant)).Observe(waited.Seconds())
}

// tenantFirstByte observes the time from arrival to the worker's first
// byte, the tenant's TTFT as the proxy sees it (streams and not).
func (s *Server) tenantFirstByte(p *prepared) {
	if s.tenants == nil {
		return
	}
	s.tenantMetrics.firstByte.WithLabelValues(p.model, s.tenants.Series(p.model, p.tenant)).Observe(p.firstByteAt.Sub(p.start).Seconds())
}

// tenantMetrics are the per-tenant series. Their tenant label is bounded
// by TenantConfig.MetricTenants (the first tenants seen; the rest are
// "_other"), so the cardinality is models × (MetricTenants + 1).
type tenantMetrics struct {
	tokens    *prometheus.CounterVec
	queue     *prometheus.HistogramVec
	firstByte *prometheus.HistogramVec
	rejected  *prometheus.CounterVec
	// yieldExpired counts queue heads admitted after holding back
	// TenantConfig.MaxYield for another replica's waiter.
	yieldExpired *prometheus.CounterVec
	// guardHeld counts requests the tenant latency guard held in the
	// queue (once each, however long).
	guardHeld *prometheus.CounterVec
	// isolationHeld counts requests tenant isolation held in the queue
	// (once each).
	isolationHeld *prometheus.CounterVec
}

func newTenantMetrics(reg prometheus.Registerer) *tenantMetrics {
	latency := []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}
	m := &tenantMetrics{
		tokens: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_tenant_tokens_total",
			Help: "Tokens charged to a tenant's fair share by this replica: uncached prompt tokens at routing, output tokens as reported."},
			[]string{"model", "tenant", "kind"}),
		queue: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvrouter_tenant_queue_seconds",
			Help: "Time a tenant's requests waited in the admission queue (requests that queued).", Buckets: latency}, []string{"model", "tenant"}),
		firstByte: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvrouter_tenant_ttft_seconds",
			Help: "Time from a tenant's request arriving to the worker's first byte (its TTFT as the proxy sees it, streamed or not).", Buckets: latency},
			[]string{"model", "tenant"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_tenant_rejected_total",
			Help: "A tenant's requests refused with 429 for its budget (tokens per minute, concurrent requests)."}, []string{"model", "tenant"}),
		yieldExpired: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_tenant_yield_expired_total",
			Help: "Queue heads admitted after holding back the longest allowed for a request another replica reported waiting (a report that no longer held, or a peer that could not admit)."}, []string{"model"}),
		guardHeld: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_tenant_guard_held_total",
			Help: "Requests of a tenant over its share that the tenant latency guard held in the admission queue (every worker predicted over --tenant-latency-guard × its idle TTFT or TPOT), once each."}, []string{"model"}),
		isolationHeld: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_tenant_isolation_held_total",
			Help: "Requests of a tenant over its share that tenant isolation held in the admission queue (every worker not reserved for the tenants under their share over the queue threshold), once each."}, []string{"model"}),
	}
	reg.MustRegister(m.tokens, m.queue, m.firstByte, m.rejected, m.yieldExpired, m.guardHeld, m.isolationHeld)
	return m
}
