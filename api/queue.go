package api

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/kvrouter/kvrouter/router"
)

// gates hold requests while every worker of a model is above the queue
// threshold, releasing them in the order of the model's queue policy.
// Waiters re-check on every load drop this replica sees and on a short tick,
// because load also drops on other replicas (replica sync) without a wake.
type gates struct {
	mu      sync.Mutex // guards queues, waiting, byTenant, wakeCh and every waiter's gone and out
	queues  map[string]*router.Queue
	waiting map[string]int // live waiters per model (a queue also holds departed ones until they reach its head)
	// byTenant lists each model's live waiters per tenant, oldest first
	// (tenant fairness on): a full queue makes room for a tenant below
	// its share of the slots by displacing the newest waiter of the
	// tenant holding most (pushOutLocked).
	byTenant map[string]map[string][]*waiter
	// admitting counts, per model, waiters admitted whose booking is not
	// in the load view yet: until it is, the load still looks as it did
	// before the admission, and a second waiter would pass on the same
	// free capacity (and out of policy order).
	admitting map[string]int
	wakeCh    chan struct{}
	// heads caches each model's queue head (Peek is linear in the
	// queue's lanes, one per class and tenant, and every waiter asks on
	// every wake): valid until the queue changes, the next wake, or
	// headTTL, since the tenants' counters move the order between wakes.
	heads map[string]cachedHead
	gen   uint64 // bumped by every wake
}

type cachedHead struct {
	gen uint64
	at  time.Time
	w   router.Waiting
	ok  bool
}

// headTTL bounds how long a cached head stands without a wake.
const headTTL = gateTick / 2

type waiter struct {
	gone bool // mu held: the client left or was displaced; skipped when at the head
	out  bool // mu held: counted out of waiting (done or displaced)
	// displaced is closed when a full queue gave this waiter's place to
	// a tenant below its share: the waiter answers the queue-full status.
	displaced chan struct{}
}

func newGates() *gates {
	return &gates{queues: make(map[string]*router.Queue), waiting: make(map[string]int), admitting: make(map[string]int),
		byTenant: make(map[string]map[string][]*waiter), wakeCh: make(chan struct{}), heads: make(map[string]cachedHead)}
}

// wake tells waiters that load dropped.
func (g *gates) wake(string) {
	g.mu.Lock()
	close(g.wakeCh)
	g.wakeCh = make(chan struct{})
	g.gen++
	g.mu.Unlock()
}

const gateTick = 10 * time.Millisecond

// admit waits for the request's turn (wait) and answers the client itself
// when it does not go on. It returns false when the request does not go on
// (the client left, or it was answered: over budget, queue full, gave up or
// timed out).
func (s *Server) admit(c *gin.Context, p *prepared) bool {
	ok, ref := s.wait(c.Request.Context(), p)
	if ref != nil {
		ref.answer(c)
	}
	return ok
}

// wait is admit for any caller (the proxy, the endpoint picker, the
// selection API): it checks the tenant's budgets, then waits while the
// model's workers are all above the queue threshold. True once the request
// may be routed (counted in its tenant's requests in flight until
// tenantEnd); false with the refusal to answer, or with none when ctx ended
// (the client left).
//
// The queue's order is strict class, then the tenants' fair shares, then
// the model's policy (router.Queue). With tenant fairness on, a replica also
// holds its next request back while another replica has a request waiting
// of a higher class, or of a tenant further below its share
// (TenantLedger.YieldTo): the queue is per replica, the order fleet-wide.
func (s *Server) wait(ctx context.Context, p *prepared) (bool, *refusal) {
	if ref := s.tenantBegin(p); ref != nil {
		return false, ref
	}
	g := s.gates
	g.mu.Lock()
	// A new arrival passes only when no one waits: it must not overtake
	// the queue's order (Dynamo: "a new arrival cannot bypass an existing
	// backlog"). Tenant isolation's one exception: a tenant under its share
	// with nothing of its own queued passes a backlog that waits for the
	// over-share tenant's workers (isolationPasses).
	if (g.waiting[p.model] == 0 || s.isolationPasses(p)) && !s.shouldQueue(p) {
		g.mu.Unlock()
		s.guardExclude(p)
		return true, nil
	}
	me := &waiter{displaced: make(chan struct{})}
	if n := g.waiting[p.model]; n >= s.cfg.MaxQueue && !(s.tenants != nil && g.pushOutLocked(p.model, p.tenant)) {
		// Every waiter holds a goroutine, its body and a connection: past
		// the cap, refuse at once rather than queue without bound. Dynamo
		// answers a full queue 529 (its policy-class queue limits); so do
		// we (--busy-status).
		g.mu.Unlock()
		s.metrics.rejected.WithLabelValues("queue_full").Inc()
		s.tenantEnd(p)
		return false, &refusal{status: s.cfg.BusyStatus, kind: "service_overloaded", retryAfter: 1,
			msg: fmt.Sprintf("%d requests already wait for a worker of model %q (the queue cap): retry later", n, p.model)}
	}
	q := g.queues[p.model]
	if q == nil {
		q = router.NewQueue(p.rt.Config().QueuePolicy)
		if s.tenants != nil {
			q.SetFairness(s.tenants.Less(p.model))
		}
		g.queues[p.model] = q
	}
	arrived := time.Now()
	if s.tenants != nil {
		s.tenants.Enqueue(p.model, p.tenant, p.class)
	}
	q.Push(router.Waiting{Request: p.req, Arrived: arrived, Value: me, Class: p.class, Tenant: p.tenant})
	delete(g.heads, p.model)
	g.waiting[p.model]++
	if s.tenants != nil {
		g.addTenantLocked(p.model, p.tenant, me)
	}
	g.mu.Unlock()
	defer g.done(p.model, p.tenant, me)
	gauge := s.metrics.queued.WithLabelValues(p.model)
	gauge.Inc()
	defer gauge.Dec()
	dequeue := sync.OnceFunc(func() {
		if s.tenants != nil {
			s.tenants.Dequeue(p.model, p.tenant, p.class)
		}
	})
	defer dequeue()

	var yielding time.Time // since when this head holds back for another replica
	deadline := time.NewTimer(s.cfg.QueueTimeout)
	defer deadline.Stop()
	tick := time.NewTicker(gateTick)
	defer tick.Stop()
	for {
		g.mu.Lock()
		wake := g.wakeCh
		head, isHead := g.headLocked(p.model, q, me)
		admitted := g.admitting[p.model] == 0 && isHead && !s.shouldQueue(p) && !s.yields(p, &yielding)
		if admitted {
			q.Drop(head)
			delete(g.heads, p.model)
			g.countOutLocked(p.model, p.tenant, me)
			g.admitting[p.model]++
			p.settle = sync.OnceFunc(func() { g.settled(p.model) })
		}
		g.mu.Unlock()
		if admitted {
			dequeue()
			s.tenantQueued(p, time.Since(arrived))
			s.guardExclude(p)
			return true, nil
		}
		select {
		case <-wake:
		case <-tick.C:
		case <-ctx.Done():
			g.leave(me)
			s.tenantEnd(p)
			return false, nil
		case <-me.displaced:
			s.tenantEnd(p)
			s.metrics.rejected.WithLabelValues("queue_full").Inc()
			return false, &refusal{status: s.cfg.BusyStatus, kind: "service_overloaded", retryAfter: 1,
				msg: fmt.Sprintf("the queue of model %q is full and this request's place went to a tenant below its share of it: retry later", p.model)}
		case <-deadline.C:
			g.leave(me)
			s.tenantEnd(p)
			s.metrics.rejected.WithLabelValues("queue_timeout").Inc()
			return false, &refusal{status: s.cfg.BusyStatus, kind: "service_overloaded", msg: "timed out waiting for a worker below the queue threshold"}
		}
	}
}

// shouldQueue reports whether p must wait for room: every worker over the
// queue threshold, or, with tenant headroom, over its tenant's share of it
// (TenantLedger.Window: a tenant over its share while others are active),
// or, with the tenant latency guard, every worker predicted too slow for
// the others beside it (guardHolds), or, with tenant isolation, every
// worker not reserved for the tenants under their share full
// (isolationHolds).
func (s *Server) shouldQueue(p *prepared) bool {
	share := 1.0
	if s.tenants != nil {
		share = s.tenants.Window(p.model, p.tenant)
	}
	return p.rt.ShouldQueueWithin(share, p.req) || s.isolationHolds(p, share) || s.guardHolds(p)
}

// yields reports whether p, at the head with capacity free, should wait
// for a request queued on another replica (TenantLedger.YieldTo). Replica
// sync refreshes what that is every tenant sync interval (at once when a
// tenant starts waiting); a replica that dies takes its waiters with it when
// sync drops it. A head holds back at most TenantConfig.MaxYield in all: a legitimate
// waiter elsewhere is admitted there within a wake, so a longer wait means
// a report that no longer holds (or a peer that cannot admit), and capacity
// must not stay idle for it. since is the head's yield start (zero: none).
func (s *Server) yields(p *prepared, since *time.Time) bool {
	if s.tenants == nil {
		return false
	}
	hold, expired := s.tenants.Hold(p.model, p.tenant, p.class, since)
	if expired {
		s.tenantMetrics.yieldExpired.WithLabelValues(p.model).Inc()
	}
	return hold
}

// headLocked drops departed waiters from the head and returns it,
// reporting whether it is me. g.mu must be held.
func (g *gates) headLocked(model string, q *router.Queue, me *waiter) (router.Waiting, bool) {
	if c, ok := g.heads[model]; ok && c.gen == g.gen && time.Since(c.at) < headTTL {
		if !c.ok {
			return c.w, false
		}
		if h := c.w.Value.(*waiter); !h.gone {
			return c.w, h == me
		}
	}
	for {
		w, ok := q.Peek()
		if !ok {
			g.heads[model] = cachedHead{gen: g.gen, at: time.Now()}
			return w, false
		}
		if h := w.Value.(*waiter); h.gone {
			q.Drop(w)
			continue
		} else {
			g.heads[model] = cachedHead{gen: g.gen, at: time.Now(), w: w, ok: true}
			return w, h == me
		}
	}
}

// settled ends an admission: the admitted request's booking is in the
// load view (or it will never be), so the next waiter may look at the load.
func (g *gates) settled(model string) {
	g.mu.Lock()
	g.admitting[model]--
	g.mu.Unlock()
	g.wake(model)
}

// done counts a waiter out, admitted or departed (once: a displaced
// waiter was counted out when displaced).
func (g *gates) done(model, tenant string, me *waiter) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.countOutLocked(model, tenant, me)
}

// countOutLocked: g.mu must be held.
func (g *gates) countOutLocked(model, tenant string, me *waiter) {
	if me.out {
		return
	}
	me.out = true
	g.waiting[model]--
	ws := g.byTenant[model][tenant]
	if i := slices.Index(ws, me); i >= 0 {
		ws = slices.Delete(ws, i, i+1)
		if len(ws) == 0 {
			delete(g.byTenant[model], tenant)
		} else {
			g.byTenant[model][tenant] = ws
		}
	}
}

// addTenantLocked lists a new waiter of tenant. g.mu must be held.
func (g *gates) addTenantLocked(model, tenant string, me *waiter) {
	if g.byTenant[model] == nil {
		g.byTenant[model] = map[string][]*waiter{}
	}
	g.byTenant[model][tenant] = append(g.byTenant[model][tenant], me)
}

// pushOutLocked makes room in a full queue for a request of tenant when
// another tenant holds more than one place more than tenant does: the
// newest waiter of the tenant holding most is displaced (answered the
// queue-full status). So a tenant flooding the queue cannot lock the
// others out of it; the queue never holds more than its cap. It reports
// whether room was made. g.mu must be held.
func (g *gates) pushOutLocked(model, tenant string) bool {
	mine := len(g.byTenant[model][tenant])
	top, most := "", 0
	for t, ws := range g.byTenant[model] {
		if len(ws) > most || (len(ws) == most && t < top) {
			top, most = t, len(ws)
		}
	}
	if top == "" || top == tenant || most <= mine+1 {
		return false
	}
	ws := g.byTenant[model][top]
	victim := ws[len(ws)-1]
	victim.gone = true
	g.countOutLocked(model, top, victim)
	close(victim.displaced)
	return true
}

func (g *gates) leave(me *waiter) {
	g.mu.Lock()
	me.gone = true
	g.mu.Unlock()
}
