package router

import (
	"slices"
	"testing"
	"time"
)

// TestQueueClassesAndTenants: strict classes first, then the fairness
// order between a class's tenants, then the policy within a tenant; with
// no fairness the tenants' heads compete by the policy as one queue.
func TestQueueClassesAndTenants(t *testing.T) {
	type item struct {
		id       string
		class    uint32
		tenant   string
		tokens   int
		priority int
	}
	used := map[string]int{"a": 100, "b": 10, "c": 50}
	fairByUse := func(a, b string) bool { return used[a] < used[b] }
	tests := []struct {
		name   string
		policy QueuePolicy
		fair   func(a, b string) bool
		items  []item
		want   []string
	}{
		{"one class one tenant is the policy", QueueFCFS, nil,
			[]item{{id: "1"}, {id: "2"}, {id: "vip", priority: 2}, {id: "3"}}, []string{"vip", "1", "2", "3"}},
		{"strict class beats priority and arrival", QueueFCFS, nil,
			[]item{{id: "lo-vip", priority: 9}, {id: "hi", class: 1}, {id: "top", class: 7}, {id: "lo"}},
			[]string{"top", "hi", "lo-vip", "lo"}},
		{"no fairness: tenants interleave by arrival", QueueFCFS, nil,
			[]item{{id: "a1", tenant: "a"}, {id: "b1", tenant: "b"}, {id: "a2", tenant: "a"}, {id: "b2", tenant: "b"}},
			[]string{"a1", "b1", "a2", "b2"}},
		{"fairness: least used tenant first, policy within", QueueFCFS, fairByUse,
			[]item{{id: "a1", tenant: "a"}, {id: "c1", tenant: "c"}, {id: "b1", tenant: "b"}, {id: "b2", tenant: "b"}, {id: "c2", tenant: "c"}},
			[]string{"b1", "b2", "c1", "c2", "a1"}},
		{"fairness inside a class only", QueueFCFS, fairByUse,
			[]item{{id: "b-low", tenant: "b"}, {id: "a-high", tenant: "a", class: 1}},
			[]string{"a-high", "b-low"}},
		{"wspt within a tenant", QueueWSPT, fairByUse,
			[]item{{id: "a-long", tenant: "a", tokens: 900}, {id: "a-short", tenant: "a", tokens: 10}, {id: "c-long", tenant: "c", tokens: 5000}},
			[]string{"c-long", "a-short", "a-long"}},
		{"priority within a tenant, not across", QueueFCFS, fairByUse,
			[]item{{id: "a-vip", tenant: "a", priority: 100}, {id: "b-plain", tenant: "b"}},
			[]string{"b-plain", "a-vip"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			q := NewQueue(tc.policy)
			q.SetFairness(tc.fair)
			for i, it := range tc.items {
				q.Push(Waiting{Request: Request{ID: it.id, Tokens: it.tokens, Priority: it.priority}, Class: it.class, Tenant: it.tenant,
					Arrived: t0.Add(time.Duration(i))})
			}
			if q.Len() != len(tc.items) {
				t.Fatalf("len %d", q.Len())
			}
			var got []string
			for {
				p, ok := q.Peek()
				w, ok2 := q.Pop()
				if ok != ok2 {
					t.Fatal("peek and pop disagree on emptiness")
				}
				if !ok {
					break
				}
				if p.Request.ID != w.Request.ID {
					t.Fatalf("peek %s, pop %s", p.Request.ID, w.Request.ID)
				}
				got = append(got, w.Request.ID)
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("order %v, want %v", got, tc.want)
			}
		})
	}
}

// TestQueueDropOnlyHead: Drop removes a lane's head and nothing else, so a
// caller that peeked, then saw the queue change, cannot remove the wrong
// request.
func TestQueueDropOnlyHead(t *testing.T) {
	q := NewQueue(QueueFCFS)
	q.Push(Waiting{Request: Request{ID: "1"}, Tenant: "a"})
	q.Push(Waiting{Request: Request{ID: "2"}, Tenant: "a"})
	head, _ := q.Peek()
	q.Pop()
	if q.Drop(head) {
		t.Fatal("dropped a request no longer at the head")
	}
	if q.Len() != 1 || q.Tenants(0)[0] != "a" {
		t.Fatalf("len %d tenants %v", q.Len(), q.Tenants(0))
	}
	w, _ := q.Pop()
	if w.Request.ID != "2" || q.Len() != 0 || len(q.Tenants(0)) != 0 {
		t.Fatalf("left %s, len %d", w.Request.ID, q.Len())
	}
}

// TestQueueLatencySensitivity: Dynamo's nvext.agent_hints.latency_sensitivity
// moves a waiting request's effective arrival earlier by that many
// seconds: it overtakes requests that arrived less than that long before
// it, not older ones, and priority still comes first.
func TestQueueLatencySensitivity(t *testing.T) {
	type item struct {
		id       string
		at       time.Duration // arrival after t0
		ls       time.Duration
		tokens   int
		priority int
	}
	tests := []struct {
		name   string
		policy QueuePolicy
		items  []item
		want   []string
	}{
		{"fcfs: 5s overtakes the last 5s only", QueueFCFS,
			[]item{{id: "old", at: 0}, {id: "recent", at: 8 * time.Second}, {id: "agent", at: 10 * time.Second, ls: 5 * time.Second}},
			[]string{"old", "agent", "recent"}},
		{"fcfs: higher sensitivity first", QueueFCFS,
			[]item{{id: "a", at: time.Second, ls: time.Second / 2}, {id: "b", at: time.Second, ls: 3 * time.Second}, {id: "c", at: 0}},
			[]string{"b", "c", "a"}},
		{"fcfs: priority beats sensitivity", QueueFCFS,
			[]item{{id: "agent", ls: time.Hour}, {id: "vip", at: time.Second, priority: 1}},
			[]string{"vip", "agent"}},
		{"fcfs: none set is arrival order", QueueFCFS,
			[]item{{id: "1"}, {id: "2", at: time.Second}, {id: "3", at: 2 * time.Second}},
			[]string{"1", "2", "3"}},
		{"lcfs: counts as newer", QueueLCFS,
			[]item{{id: "agent", at: 0, ls: 5 * time.Second}, {id: "mid", at: 3 * time.Second}, {id: "new", at: 6 * time.Second}},
			[]string{"new", "agent", "mid"}},
		{"wspt: weight 1+s", QueueWSPT,
			[]item{{id: "short", tokens: 100}, {id: "agent", tokens: 250, ls: 2 * time.Second}, {id: "long", tokens: 301, ls: 2 * time.Second}},
			[]string{"agent", "short", "long"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			q := NewQueue(tc.policy)
			for _, it := range tc.items {
				q.Push(Waiting{Request: Request{ID: it.id, Tokens: it.tokens, Priority: it.priority, LatencySensitivity: it.ls},
					Arrived: t0.Add(it.at)})
			}
			var got []string
			for w, ok := q.Pop(); ok; w, ok = q.Pop() {
				got = append(got, w.Request.ID)
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("order %v, want %v", got, tc.want)
			}
		})
	}
}
