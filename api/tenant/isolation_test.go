package tenant

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestAPITenantIsolationRule: a tenant is over its share while it has a
// request queued in the fleet and another active tenant has none; k, the
// workers reserved for the tenants under their share, follows their recent
// share of the fleet's tokens times the safety factor, rounded up, within
// [1, n−1]; it is 0 with one active tenant, with every active tenant queued
// (all backlogged) or none, with fewer than two workers and with isolation
// off; the tenant under its share is never the one kept off.
func TestAPITenantIsolationRule(t *testing.T) {
	// Both active, a with a request queued: a is over its share.
	pair := func(a, b uint64) func(l *Ledger) {
		return func(l *Ledger) {
			l.Charge("m", "a", int(a))
			l.Charge("m", "b", int(b))
			l.Begin("m", "a")
			l.Begin("m", "b")
			l.Enqueue("m", "a", 0)
		}
	}
	for _, tc := range []struct {
		name      string
		isolation float64
		workers   int
		setup     func(l *Ledger)
		tenant    string
		wantK     int
		wantOver  bool
	}{
		{"under-share demand 0.4 of 10 workers, S 1", 1, 10, pair(6000, 4000), "a", 4, true},
		{"the under-share tenant is never kept off", 1, 10, pair(6000, 4000), "b", 4, false},
		{"S 1.5 scales k", 1.5, 10, pair(6000, 4000), "a", 6, true},
		{"share 0.25 rounds up", 1, 10, pair(7500, 2500), "a", 3, true},
		{"a small share still reserves one", 1, 10, pair(100_000, 10), "a", 1, true},
		{"at most all workers but one", 4, 10, pair(6000, 4000), "a", 9, true},
		{"three workers, S 1.5", 1.5, 3, pair(6000, 4000), "a", 2, true},
		{"one tenant alone", 1, 10, func(l *Ledger) { l.Charge("m", "a", 5000); l.Begin("m", "a"); l.Enqueue("m", "a", 0) }, "a", 0, false},
		{"the other tenant idle, nothing charged lately", 1, 10, func(l *Ledger) { pair(6000, 0)(l); l.End("m", "b") }, "a", 0, false},
		{"the other tenant between requests, charged lately", 1, 10, func(l *Ledger) { pair(6000, 4000)(l); l.End("m", "b") }, "a", 4, true},
		{"both backlogged", 1, 10, func(l *Ledger) { pair(6000, 4000)(l); l.Enqueue("m", "b", 0) }, "a", 0, false},
		{"nobody queued", 1, 10, func(l *Ledger) { pair(6000, 4000)(l); l.Dequeue("m", "a", 0) }, "a", 0, false},
		{"the least queued tenant backlogged itself (past its start, BacklogAge)", 1, 3, func(l *Ledger) {
			pair(6000, 4000)(l)
			for range 20 {
				l.Enqueue("m", "a", 0)
			}
			for range 4 {
				l.Enqueue("m", "b", 0) // more than a request per worker
			}
		}, "a", 0, false},
		{"the least queued tenant with a burst of a few", 1, 3, func(l *Ledger) {
			pair(6000, 4000)(l)
			for range 20 {
				l.Enqueue("m", "a", 0)
			}
			for range 3 {
				l.Enqueue("m", "b", 0)
			}
		}, "a", 2, true},
		{"the queued tenant is over whatever it was charged", 1, 10, func(l *Ledger) {
			pair(4000, 6000)(l) // a queued, b served more lately: b's demand is 0.6
		}, "a", 6, true},
		{"one worker", 1, 1, pair(6000, 4000), "a", 0, false},
		{"off", 0, 10, pair(6000, 4000), "a", 0, false},
		{"the other tenant's demand from another replica's reports", 1, 10, func(l *Ledger) {
			l.Charge("m", "a", 8000)
			l.Begin("m", "a")
			l.Enqueue("m", "a", 0)
			// A replica's first report is its baseline; the growth counts.
			l.Remote("r2", []Usage{{Model: "m", Tenant: "b", Tokens: 100, Inflight: 1}})
			l.Remote("r2", []Usage{{Model: "m", Tenant: "b", Tokens: 2100, Inflight: 1}})
		}, "a", 2, true},
	} {
		now := time.Unix(1000, 0)
		l, err := New(Config{From: SourceHeader, Slack: 512, Burst: 4096, Isolation: tc.isolation,
			Now: func() time.Time { return now }})
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		tc.setup(l)
		now = now.Add(BacklogAge) // past every tenant's start (TestAPITenantIsolationStartRule has the start)
		if k, over := l.Isolation("m", tc.tenant, tc.workers); k != tc.wantK || over != tc.wantOver {
			t.Errorf("%s: k %d over %v, want k %d over %v", tc.name, k, over, tc.wantK, tc.wantOver)
		}
	}
	for _, bad := range []float64{0.5, -1, math.NaN(), math.Inf(1)} {
		if _, err := New(Config{From: SourceHeader, Isolation: bad}); err == nil || !strings.Contains(err.Error(), "isolation") {
			t.Errorf("isolation %v: error %v, want one naming isolation", bad, err)
		}
	}
}

// TestAPITenantIsolationRecentWindow: the demand share looks back
// RecentWindow only: tokens charged before it no longer count, so a tenant
// under its share that has been quiet for longer still gets one worker
// (at least one while it is active) and no more.
func TestAPITenantIsolationRecentWindow(t *testing.T) {
	now := time.Unix(1000, 0)
	l, err := New(Config{From: SourceHeader, Isolation: 1, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	l.Charge("m", "a", 6000)
	l.Charge("m", "b", 4000)
	l.Begin("m", "a")
	l.Begin("m", "b")
	l.Enqueue("m", "a", 0)
	if k, _ := l.Isolation("m", "a", 10); k != 4 {
		t.Fatalf("k %d, want 4", k)
	}
	now = now.Add(RecentWindow + recentBucket)
	l.Charge("m", "a", 1000)
	if got := l.Recent("m", "b"); got != 0 {
		t.Errorf("b's recent tokens after the window %d, want 0", got)
	}
	if k, over := l.Isolation("m", "a", 10); k != 1 || !over {
		t.Errorf("after the window: k %d over %v, want 1, true", k, over)
	}
}

// TestAPITenantIsolationSameOnEveryReplica: two replicas, one charging the
// tenants itself and one hearing it on replica sync, compute the same k,
// and ReservedWorkers gives them the same workers however each lists them.
func TestAPITenantIsolationSameOnEveryReplica(t *testing.T) {
	now := time.Unix(1000, 0)
	cfg := Config{From: SourceHeader, Isolation: 1.5, Now: func() time.Time { return now }}
	r1, _ := New(cfg)
	r2, _ := New(cfg)
	r2.Remote("r1", r1.Usage()) // the baseline report
	for step := range 8 {
		r1.Charge("m", "flood", 900)
		r1.Charge("m", "steady", 100+20*step)
		r1.Begin("m", "flood")
		r1.Begin("m", "steady")
		r1.Enqueue("m", "flood", 0)
		now = now.Add(100 * time.Millisecond)
		r2.Remote("r1", r1.Usage())
		workers := []string{"w3", "w1", "w0", "w4", "w2", "w5"}
		k1, over1 := r1.Isolation("m", "flood", len(workers))
		k2, over2 := r2.Isolation("m", "flood", len(workers))
		if k1 != k2 || over1 != over2 || k1 == 0 {
			t.Fatalf("step %d: replica 1 k %d over %v, replica 2 k %d over %v; want the same, k > 0", step, k1, over1, k2, over2)
		}
		set1 := ReservedWorkers("m", workers, k1, nil)
		shuffled := slices.Clone(workers)
		slices.Reverse(shuffled)
		set2 := ReservedWorkers("m", shuffled, k2, nil)
		if !slices.Equal(set1, set2) {
			t.Fatalf("step %d: replica 1 reserves %v, replica 2 %v", step, set1, set2)
		}
	}
}

// TestAPITenantReservedWorkers: the reserved set is the first k of one
// order of the workers: k of them (all when k ≥ n), nested as k grows,
// independent of the order they are listed in, and a departing unreserved
// worker leaves it unchanged; different models spread their sets.
func TestAPITenantReservedWorkers(t *testing.T) {
	var ws []string
	for i := range 16 {
		ws = append(ws, fmt.Sprintf("w%02d", i))
	}
	for _, tc := range []struct {
		name string
		k    int
		want int
	}{{"none", 0, 0}, {"one", 1, 1}, {"some", 5, 5}, {"all", 16, 16}, {"more than all", 20, 16}} {
		got := ReservedWorkers("m", ws, tc.k, nil)
		if len(got) != tc.want {
			t.Errorf("%s: %d workers %v, want %d", tc.name, len(got), got, tc.want)
		}
		rev := slices.Clone(ws)
		slices.Reverse(rev)
		if again := ReservedWorkers("m", rev, tc.k, nil); !slices.Equal(got, again) {
			t.Errorf("%s: %v listed reversed gives %v", tc.name, got, again)
		}
	}
	all := ReservedWorkers("m", ws, len(ws), nil)
	for k := 1; k <= len(ws); k++ {
		if got := ReservedWorkers("m", ws, k, nil); !slices.Equal(got, all[:k]) {
			t.Fatalf("k %d: %v, want the first %d of %v", k, got, k, all)
		}
	}
	set := ReservedWorkers("m", ws, 4, nil)
	gone := all[len(all)-1] // never reserved at k 4
	left := slices.DeleteFunc(slices.Clone(ws), func(w string) bool { return w == gone })
	if got := ReservedWorkers("m", left, 4, nil); !slices.Equal(got, set) {
		t.Errorf("after %s left: %v, want %v unchanged", gone, got, set)
	}
	differ := false
	for _, m := range []string{"m2", "m3", "m4", "m5"} {
		if !slices.Equal(ReservedWorkers(m, ws, 4, nil), set) {
			differ = true
		}
	}
	if !differ {
		t.Errorf("five models reserve the same 4 of 16 workers %v: the hash ignores the model", set)
	}
}

// TestAPITenantIsolationMayHold: isolation may hold a request of a tenant
// in this replica's queue while the counters put it over its share, or
// while no other tenant has a request queued here; never when it could be
// the head with another tenant's request behind it.
func TestAPITenantIsolationMayHold(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(l *Ledger)
		want  bool
	}{
		{"over by the counters, the other queued here", func(l *Ledger) {
			l.Charge("m", "a", 10_000)
			l.Begin("m", "a")
			l.Begin("m", "b")
			l.Enqueue("m", "a", 0)
			l.Enqueue("m", "b", 0)
		}, true},
		{"within the counters' slack, the other queued here", func(l *Ledger) {
			l.Charge("m", "a", 5000)
			l.Charge("m", "b", 4900)
			l.Begin("m", "a")
			l.Begin("m", "b")
			l.Enqueue("m", "a", 0)
			l.Enqueue("m", "b", 0)
		}, false},
		{"within the counters' slack, nobody else queued here", func(l *Ledger) {
			l.Charge("m", "a", 5000)
			l.Charge("m", "b", 4900)
			l.Begin("m", "a")
			l.Begin("m", "b")
			l.Enqueue("m", "a", 0)
			l.Remote("r2", []Usage{{Model: "m", Tenant: "b", Waiting: 3}}) // queued elsewhere: not behind this head
		}, true},
	} {
		l, err := New(Config{From: SourceHeader, Slack: 512, Burst: 4096, Isolation: 1})
		if err != nil {
			t.Fatal(err)
		}
		tc.setup(l)
		if got := l.MayHold("m", "a"); got != tc.want {
			t.Errorf("%s: MayHold %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestAPITenantIsolationStartRule: the start rules. A tenant alone on the
// model gets RampShare of each worker's window for RampWindow after its
// activity begins, nobody else does; a queue of more than a request per
// worker read as the least queued tenant's own backlog (nothing reserved)
// only BacklogAge after that tenant's activity began, before it a cold
// start (workers reserved for it).
func TestAPITenantIsolationStartRule(t *testing.T) {
	base := time.Unix(1000, 0)
	for _, tc := range []struct {
		name       string
		b          uint64        // tokens charged to b (0: a alone)
		bQueued    int           // b's requests queued
		after      time.Duration // from the charges to the check
		tenant     string
		wantK      int
		wantOver   bool
		wantWindow float64
	}{
		{"alone at its start: half window", 0, 0, 0, "a", 0, false, RampShare},
		{"alone just before the ramp ends", 0, 0, RampWindow - time.Millisecond, "a", 0, false, RampShare},
		{"alone after the ramp: full window", 0, 0, RampWindow, "a", 0, false, 1},
		{"with another tenant: no ramp", 1_000, 0, 0, "a", 2, true, 1},
		{"the other tenant: no ramp", 1_000, 0, 0, "b", 2, false, 1},
		{"b queued 4 on 3 workers at its start: a cold start, reserved", 1_000, 4, 0, "a", 2, true, 1},
		{"b queued 4 just before BacklogAge: still reserved", 1_000, 4, BacklogAge - time.Millisecond, "a", 2, true, 1},
		{"b queued 4 past BacklogAge: backlogged, nothing reserved", 1_000, 4, BacklogAge, "a", 0, false, 1},
		{"b queued 3 (one per worker) past BacklogAge: reserved", 1_000, 3, BacklogAge, "a", 2, true, 1},
	} {
		now := base
		l, err := New(Config{From: SourceHeader, Slack: 512, Burst: 4096, Isolation: 1.5, Now: func() time.Time { return now }})
		if err != nil {
			t.Fatal(err)
		}
		l.Charge("m", "a", 2_000)
		l.Begin("m", "a")
		for range 20 {
			l.Enqueue("m", "a", 0)
		}
		if tc.b > 0 {
			l.Charge("m", "b", int(tc.b))
			l.Begin("m", "b")
			for range tc.bQueued {
				l.Enqueue("m", "b", 0)
			}
		}
		now = now.Add(tc.after)
		if k, over := l.Isolation("m", tc.tenant, 3); k != tc.wantK || over != tc.wantOver {
			t.Errorf("%s: k %d over %v, want k %d over %v", tc.name, k, over, tc.wantK, tc.wantOver)
		}
		if w := l.Window("m", tc.tenant); w != tc.wantWindow {
			t.Errorf("%s: window %v, want %v", tc.name, w, tc.wantWindow)
		}
	}
}

// TestAPITenantIsolationPasses: while isolation reserves workers, a
// request of a tenant under its share with nothing of its own queued here
// may pass the over-share tenant's backlog (IsolationPasses), and the
// latency guard's "who is over" is isolation's (Guard), even where the fair
// counters say the opposite: the over-share tenant, served less than the
// steady one while kept off the reserved workers, has the lower counter.
// The guard still never holds it as a head another tenant waits behind
// (MayHold's rule). Both backlogged, nothing is reserved: no pass, and the
// counters say who is guarded, as before. Before this the steady tenant's
// arrival queued behind the flood's backlog, whose head (first by the
// counters, not held with the steady request behind it) was released past
// isolation and the guard at every steady arrival (kvbench sim,
// 2026-12-06).
func TestAPITenantIsolationPasses(t *testing.T) {
	now := time.Unix(1000, 0)
	l, err := New(Config{From: SourceHeader, Slack: 512, Burst: 4096, Isolation: 1.5, LatencyGuard: 1,
		Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	// flood: served less (its counter the lower), 20 requests queued;
	// steady: served more, none queued.
	l.Charge("m", "flood", 2000)
	l.Charge("m", "steady", 9000)
	l.Begin("m", "flood")
	l.Begin("m", "steady")
	for range 20 {
		l.Enqueue("m", "flood", 0)
	}
	now = now.Add(BacklogAge)
	if l.Guard("m", "flood") != 0 || l.Guard("m", "steady") != 1 {
		t.Fatalf("before isolation is consulted the counters say who is guarded (the steady tenant): flood %v steady %v",
			l.Guard("m", "flood"), l.Guard("m", "steady"))
	}
	if !l.IsolationPasses("m", "steady", 3) {
		t.Error("the steady tenant, under its share with nothing queued, does not pass the flood's backlog")
	}
	if l.IsolationPasses("m", "flood", 3) {
		t.Error("the flood, over its share, passes")
	}
	if l.IsolationPasses("m", "steady", 1) {
		t.Error("one worker (nothing to reserve): the steady tenant passes")
	}
	noGuard, err := New(Config{From: SourceHeader, Slack: 512, Burst: 4096, Isolation: 1.5, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	noGuard.Charge("m", "flood", 2000)
	noGuard.Charge("m", "steady", 9000)
	noGuard.Begin("m", "flood")
	noGuard.Begin("m", "steady")
	noGuard.Enqueue("m", "flood", 0)
	if k, _ := noGuard.Isolation("m", "flood", 3); k == 0 || noGuard.IsolationPasses("m", "steady", 3) {
		t.Errorf("isolation without the guard: k %d, and the steady tenant passes (want workers reserved, no pass)", k)
	}
	if g := l.Guard("m", "flood"); g != 1 {
		t.Errorf("with isolation: guard factor for the flood %v, want 1", g)
	}
	if g := l.Guard("m", "steady"); g != 0 {
		t.Errorf("with isolation: guard factor for the steady tenant %v, want 0 (never held)", g)
	}
	// A steady request queued here: it does not pass its own, and the
	// flood's head, first by the counters, is not held in front of it.
	l.Enqueue("m", "steady", 0)
	if l.IsolationPasses("m", "steady", 3) {
		t.Error("the steady tenant passes with a request of its own queued")
	}
	if g := l.Guard("m", "flood"); g != 0 {
		t.Errorf("with the steady tenant queued behind it: guard factor for the flood %v, want 0", g)
	}
	// Both backlogged (the steady tenant with more than a request per
	// worker queued): nothing reserved, the counters say who is guarded.
	for range 3 {
		l.Enqueue("m", "steady", 0)
	}
	if k, _ := l.Isolation("m", "flood", 3); k != 0 {
		t.Fatalf("both backlogged: k %d, want 0", k)
	}
	if l.IsolationPasses("m", "steady", 3) || l.Guard("m", "steady") != 1 || l.Guard("m", "flood") != 0 {
		t.Errorf("both backlogged: passes %v, guard steady %v flood %v; want no pass and the counters' (1, 0)",
			l.IsolationPasses("m", "steady", 3), l.Guard("m", "steady"), l.Guard("m", "flood"))
	}
}
