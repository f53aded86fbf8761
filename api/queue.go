package api

import (
	"context"
	"fmt"
	"net/http"
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

// admit waits while the model's workers are all above the queue threshold.
// It returns false when the request does not go on (the client left, or it
// was answered: gave up or timed out).
func (s *Server) admit(c *gin.Context, p *prepared) bool {
	ok, ref := s.wait(c.Request.Context(), p)
	if ref != nil {
		ref.answer(c)
	}
	return ok
}

// wait is admit for any caller (the proxy, the endpoint picker): true once
// the request may be routed; false with the refusal to answer, or with none
// when ctx ended (the client left).
func (s *Server) wait(ctx context.Context, p *prepared) (bool, *refusal) {
	if !p.rt.ShouldQueue() {
		return true, nil
	}
	g := s.gates
	me := &waiter{}
	g.mu.Lock()
	if n := g.waiting[p.model]; n >= s.cfg.MaxQueue {
		// Every waiter holds a goroutine, its body and a connection: past
		// the cap, refuse at once rather than queue without bound.
		g.mu.Unlock()
		s.metrics.rejected.WithLabelValues("queue_full").Inc()
		return false, &refusal{status: http.StatusTooManyRequests, kind: "rate_limit_exceeded", retryAfter: true,
			msg: fmt.Sprintf("%d requests already wait for a worker of model %q (the queue cap): retry later", n, p.model)}
	}
	q := g.queues[p.model]
	if q == nil {
		q = router.NewQueue(p.rt.Config().QueuePolicy)
		g.queues[p.model] = q
	}
	q.Push(router.Waiting{Request: p.req, Arrived: time.Now(), Value: me})
	g.waiting[p.model]++
	g.mu.Unlock()
	defer g.done(p.model)
	gauge := s.metrics.queued.WithLabelValues(p.model)
	gauge.Inc()
	defer gauge.Dec()

	deadline := time.NewTimer(s.cfg.QueueTimeout)
	defer deadline.Stop()
	tick := time.NewTicker(gateTick)
	defer tick.Stop()
	for {
		g.mu.Lock()
		wake := g.wakeCh
		admitted := g.admitting[p.model] == 0 && g.headLocked(q, me) && !p.rt.ShouldQueue()
		if admitted {
			q.Pop()
			g.admitting[p.model]++
			p.settle = sync.OnceFunc(func() { g.settled(p.model) })
		}
		g.mu.Unlock()
		if admitted {
			return true, nil
		}
		select {
		case <-wake:
		case <-tick.C:
		case <-ctx.Done():
			g.leave(me)
			return false, nil
		case <-deadline.C:
			g.leave(me)
			s.metrics.rejected.WithLabelValues("queue_timeout").Inc()
			return false, &refusal{status: s.cfg.BusyStatus, kind: "service_overloaded", msg: "timed out waiting for a worker below the queue threshold"}
		}
	}
}

// headLocked drops departed waiters from the head and reports whether me is
// next. g.mu must be held.
func (g *gates) headLocked(q *router.Queue, me *waiter) bool {
	for {
		w, ok := q.Peek()
		if !ok {
			return false
		}
		if h := w.Value.(*waiter); h.gone {
			q.Pop()
			continue
		} else {
			return h == me
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
