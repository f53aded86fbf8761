package router

import (
	"container/heap"
	"slices"
	"time"
)

// Queue holds requests waiting while every worker is above the queue
// threshold. Its order has three levels, as Dynamo orders its pending queue
// plus tenant fairness:
//
//  1. Class (Dynamo's strict_priority): a higher class always goes first.
//  2. Tenant, within a class: the tenant the fairness order puts first
//     (SetFairness: the api's token-weighted share). Without one, the
//     tenants' heads compete by the policy, as one queue.
//  3. The policy, within a tenant: priority first (higher first), then fcfs
//     oldest first, lcfs newest first, wspt shortest prompt first.
//
// A request's latency sensitivity (Dynamo's agent hint, in seconds) moves
// its effective arrival that much earlier: under fcfs it goes before every
// request that arrived less than that long before it (unless theirs is
// higher still); under lcfs it counts as that much newer (the direction
// that favours it, as the hint means); under wspt its weight is
// 1 + sensitivity in seconds (Dynamo's WSPT weight), so it goes first
// among prompts up to that many times longer. Priority still comes first.
//
// With every request in class 0 of tenant "" (no strict priority, fairness
// off) the order is exactly the policy's, as before classes existed. It is
// not safe for concurrent use; the caller (the API's admission loop, or the
// simulator) owns it.
type Queue struct {
	policy QueuePolicy
	// lanes holds one heap per (class, tenant); an emptied lane is removed.
	lanes map[laneKey]*queueHeap
	// fair orders tenants within a class (nil: by their heads' policy order).
	fair func(a, b string) bool
	n    int
	seq  uint64
}

type laneKey struct {
	class  uint32
	tenant string
}

// Waiting is one queued request. Value is the caller's handle.
type Waiting struct {
	Request Request
	Arrived time.Time
	Value   any
	// Class is the strict tier (Dynamo's nvext.agent_hints.strict_priority):
	// every waiting request of a higher class goes before any of a lower.
	Class uint32
	// Tenant is whose share the request is served from ("" when fairness
	// is off: one tenant).
	Tenant string
	seq    uint64
}

// NewQueue returns an empty queue ordered by policy ("" = fcfs).
func NewQueue(policy QueuePolicy) *Queue {
	if policy == "" {
		policy = QueueFCFS
	}
	return &Queue{policy: policy, lanes: map[laneKey]*queueHeap{}}
}

// SetFairness orders the tenants of a class: less(a, b) reports that tenant
// a is further below its share than b, so a's head goes first. The order may
// change between calls (usage moves it); Peek and Pop read it at the time.
// Ties fall back to the heads' policy order.
func (q *Queue) SetFairness(less func(a, b string) bool) { q.fair = less }

// Push adds a request.
func (q *Queue) Push(w Waiting) {
	q.seq++
	w.seq = q.seq
	k := laneKey{w.Class, w.Tenant}
	l := q.lanes[k]
	if l == nil {
		l = &queueHeap{less: q.less}
		q.lanes[k] = l
	}
	heap.Push(l, w)
	q.n++
}

// Pop removes the next request (Peek's); ok is false when empty.
func (q *Queue) Pop() (Waiting, bool) {
	w, ok := q.Peek()
	if ok {
		q.Drop(w)
	}
	return w, ok
}

// Peek returns the next request without removing it: the head of the
// first tenant (by the fairness order) of the highest class.
func (q *Queue) Peek() (Waiting, bool) {
	if q.n == 0 {
		return Waiting{}, false
	}
	var top uint32
	first := true
	for k := range q.lanes {
		if first || k.class > top {
			top, first = k.class, false
		}
	}
	var best Waiting
	found := false
	for k, l := range q.lanes {
		if k.class != top {
			continue
		}
		h := l.w[0]
		if !found || q.before(h, best) {
			best, found = h, true
		}
	}
	return best, found
}

// before reports whether head a (of one tenant) goes before head b (of
// another) in the same class: fairness first, then the policy.
func (q *Queue) before(a, b Waiting) bool {
	if q.fair != nil && a.Tenant != b.Tenant {
		if q.fair(a.Tenant, b.Tenant) {
			return true
		}
		if q.fair(b.Tenant, a.Tenant) {
			return false
		}
	}
	return q.less(a, b)
}

// Drop removes w, the head of its lane (as Peek returned it, with no Push
// or Drop since); false when it is not.
func (q *Queue) Drop(w Waiting) bool {
	k := laneKey{w.Class, w.Tenant}
	l := q.lanes[k]
	if l == nil || len(l.w) == 0 || l.w[0].seq != w.seq {
		return false
	}
	heap.Pop(l)
	q.n--
	if len(l.w) == 0 {
		delete(q.lanes, k)
	}
	return true
}

// Len is the number of waiting requests.
func (q *Queue) Len() int { return q.n }

// Tenants lists the tenants with requests waiting in class, sorted.
func (q *Queue) Tenants(class uint32) []string {
	var out []string
	for k := range q.lanes {
		if k.class == class {
			out = append(out, k.tenant)
		}
	}
	slices.Sort(out)
	return out
}

// less orders by priority first (higher first), then by the policy:
// fcfs oldest first; lcfs newest first; wspt shortest prompt first (the
// weight is the priority, the processing time the prompt length).
func (q *Queue) less(a, b Waiting) bool {
	if a.Request.Priority != b.Request.Priority {
		return a.Request.Priority > b.Request.Priority
	}
	la, lb := a.Request.LatencySensitivity, b.Request.LatencySensitivity
	switch q.policy {
	case QueueLCFS:
		if la != 0 || lb != 0 {
			if ea, eb := a.Arrived.Add(la), b.Arrived.Add(lb); !ea.Equal(eb) {
				return ea.After(eb)
			}
		}
		return a.seq > b.seq
	case QueueWSPT:
		if la != 0 || lb != 0 {
			// weight/time, compared without division: (1+la)/ta > (1+lb)/tb.
			wa, wb := 1+la.Seconds(), 1+lb.Seconds()
			if x, y := wa*float64(b.Request.Tokens), wb*float64(a.Request.Tokens); x != y {
				return x > y
			}
			break
		}
		if a.Request.Tokens != b.Request.Tokens {
			return a.Request.Tokens < b.Request.Tokens
		}
	default:
		if la != 0 || lb != 0 {
			if ea, eb := a.Arrived.Add(-la), b.Arrived.Add(-lb); !ea.Equal(eb) {
				return ea.Before(eb)
			}
		}
	}
	return a.seq < b.seq
}

type queueHeap struct {
	w    []Waiting
	less func(a, b Waiting) bool
}

func (h *queueHeap) Len() int           { return len(h.w) }
func (h *queueHeap) Less(i, j int) bool { return h.less(h.w[i], h.w[j]) }
func (h *queueHeap) Swap(i, j int)      { h.w[i], h.w[j] = h.w[j], h.w[i] }
func (h *queueHeap) Push(x any)         { h.w = append(h.w, x.(Waiting)) }
func (h *queueHeap) Pop() any {
	n := len(h.w) - 1
	x := h.w[n]
	h.w = h.w[:n]
	return x
}
