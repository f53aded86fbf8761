package router

import (
	"container/heap"
	"time"
)

// Queue holds requests waiting while every worker is above the queue
// threshold, ordered by a policy. It is not safe for concurrent use; the
// caller (the API's admission loop, or the simulator) owns it.
type Queue struct {
	policy QueuePolicy
	items  queueHeap
	seq    uint64
}

// Waiting is one queued request. Value is the caller's handle.
type Waiting struct {
	Request Request
	Arrived time.Time
	Value   any
	seq     uint64
}

// NewQueue returns an empty queue ordered by policy ("" = fcfs).
func NewQueue(policy QueuePolicy) *Queue {
	if policy == "" {
		policy = QueueFCFS
	}
	q := &Queue{policy: policy}
	q.items.less = q.less
	return q
}

// Push adds a request.
func (q *Queue) Push(w Waiting) {
	q.seq++
	w.seq = q.seq
	heap.Push(&q.items, w)
}

// Pop removes the next request by policy; ok is false when empty.
func (q *Queue) Pop() (Waiting, bool) {
	if len(q.items.w) == 0 {
		return Waiting{}, false
	}
	return heap.Pop(&q.items).(Waiting), true
}

// Peek returns the next request by policy without removing it.
func (q *Queue) Peek() (Waiting, bool) {
	if len(q.items.w) == 0 {
		return Waiting{}, false
	}
	return q.items.w[0], true
}

// Len is the number of waiting requests.
func (q *Queue) Len() int { return len(q.items.w) }

// less orders by priority first (higher first), then by the policy:
// fcfs oldest first; lcfs newest first; wspt shortest prompt first (the
// weight is the priority, the processing time the prompt length).
func (q *Queue) less(a, b Waiting) bool {
	if a.Request.Priority != b.Request.Priority {
		return a.Request.Priority > b.Request.Priority
	}
	switch q.policy {
	case QueueLCFS:
		return a.seq > b.seq
	case QueueWSPT:
		if a.Request.Tokens != b.Request.Tokens {
			return a.Request.Tokens < b.Request.Tokens
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
