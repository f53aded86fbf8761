package api

import (
	"fmt"
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
	mu      sync.Mutex // guards queues, waiting, wakeCh and every waiter's gone
	queues  map[string]*router.Queue
	waiting map[string]int // live waiters per model (a queue also holds departed ones until they reach its head)
	// admitting counts, per model, waiters admitted whose booking is not
	// in the load view yet: until it is, the load still looks as it did
	// before the admission, and a second waiter would pass on the same
	// free capacity (and out of policy order).
	admitting map[string]int
	wakeCh    chan struct{}
}

type waiter struct {
	gone bool // mu held: the client left; skipped when at the head
}

func newGates() *gates {
	return &gates{queues: make(map[string]*router.Queue), waiting: make(map[string]int), admitting: make(map[string]int),
		wakeCh: make(chan struct{})}
}

// wake tells waiters that load dropped.
func (g *gates) wake(string) {
	g.mu.Lock()
	close(g.wakeCh)
	g.wakeCh = make(chan struct{})
	g.mu.Unlock()
}

const gateTick = 10 * time.Millisecond

// admit checks the tenant's budgets, then waits while the model's workers
// are all above the queue threshold. It returns false when it answered the
// client (over budget, queue full, gave up or timed out).
//
// The queue's order is strict class, then the tenants' fair shares, then
// the model's policy (router.Queue). With tenant fairness on, a replica also
// holds its next request back while another replica has a request waiting
// of a higher class, or of a tenant further below its share
// (TenantLedger.YieldTo): the queue is per replica, the order fleet-wide.
func (s *Server) admit(c *gin.Context, p *prepared) bool {
	if !s.tenantBegin(c, p) {
		return false
	}
	if !p.rt.ShouldQueue() {
		return true
	}
	g := s.gates
	me := &waiter{}
	g.mu.Lock()
	if n := g.waiting[p.model]; n >= s.cfg.MaxQueue {
		// Every waiter holds a goroutine, its body and a connection: past
		// the cap, refuse at once rather than queue without bound. Dynamo
		// answers a full queue 529 (its policy-class queue limits); so do
		// we (--busy-status).
		g.mu.Unlock()
		s.metrics.rejected.WithLabelValues("queue_full").Inc()
		c.Header("Retry-After", "1")
		openAIError(c, s.cfg.BusyStatus, "service_overloaded",
			fmt.Sprintf("%d requests already wait for a worker of model %q (the queue cap): retry later", n, p.model))
		s.tenantEnd(p)
		return false
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
	g.waiting[p.model]++
	g.mu.Unlock()
	defer g.done(p.model)
	gauge := s.metrics.queued.WithLabelValues(p.model)
	gauge.Inc()
	defer gauge.Dec()
	dequeue := sync.OnceFunc(func() {
		if s.tenants != nil {
			s.tenants.Dequeue(p.model, p.tenant, p.class)
		}
	})
	defer dequeue()

	deadline := time.NewTimer(s.cfg.QueueTimeout)
	defer deadline.Stop()
	tick := time.NewTicker(gateTick)
	defer tick.Stop()
	for {
		g.mu.Lock()
		wake := g.wakeCh
		head, isHead := g.headLocked(q, me)
		admitted := g.admitting[p.model] == 0 && isHead && !p.rt.ShouldQueue() && !s.yields(p)
		if admitted {
			q.Drop(head)
			g.admitting[p.model]++
			p.settle = sync.OnceFunc(func() { g.settled(p.model) })
		}
		g.mu.Unlock()
		if admitted {
			dequeue()
			s.tenantQueued(p, time.Since(arrived))
			return true
		}
		select {
		case <-wake:
		case <-tick.C:
		case <-c.Request.Context().Done():
			g.leave(me)
			s.tenantEnd(p)
			return false
		case <-deadline.C:
			g.leave(me)
			s.tenantEnd(p)
			s.metrics.rejected.WithLabelValues("queue_timeout").Inc()
			openAIError(c, s.cfg.BusyStatus, "service_overloaded", "timed out waiting for a worker below the queue threshold")
			return false
		}
	}
}

// yields reports whether p should wait for a request queued on another
// replica (TenantLedger.YieldTo). Replica sync refreshes what that is every
// tenant sync interval; a replica that dies takes its waiters with it when
// sync drops it.
func (s *Server) yields(p *prepared) bool {
	if s.tenants == nil {
		return false
	}
	_, yield := s.tenants.YieldTo(p.model, p.tenant, p.class)
	return yield
}

// headLocked drops departed waiters from the head and returns it,
// reporting whether it is me. g.mu must be held.
func (g *gates) headLocked(q *router.Queue, me *waiter) (router.Waiting, bool) {
	for {
		w, ok := q.Peek()
		if !ok {
			return w, false
		}
		if h := w.Value.(*waiter); h.gone {
			q.Drop(w)
			continue
		} else {
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

// done counts a waiter out, admitted or departed.
func (g *gates) done(model string) {
	g.mu.Lock()
	g.waiting[model]--
	g.mu.Unlock()
}

func (g *gates) leave(me *waiter) {
	g.mu.Lock()
	me.gone = true
	g.mu.Unlock()
}
