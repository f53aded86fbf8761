package replica

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// drainLedger counts, per replica, the completed drains its FSM applied
// (ChangeWorkers, Removed, reason "drained").
type drainLedger struct {
	mu        sync.Mutex
	completed map[string]map[string]int // node → worker → completions
}

func watchCompletions(tc *testCluster) *drainLedger {
	l := &drainLedger{completed: map[string]map[string]int{}}
	for _, m := range tc.Running() {
		r := tc.R(m.Index)
		node := r.cfg.NodeID
		l.completed[node] = map[string]int{}
		r.fsm.OnChange(func(c fsm.Change) {
			if c.Kind == fsm.ChangeWorkers && c.Removed && c.Reason == "drained" {
				l.mu.Lock()
				l.completed[node][c.Worker]++
				l.mu.Unlock()
			}
		})
	}
	return l
}

// exactlyOnce: every watched replica applied worker's completion once.
func (l *drainLedger) exactlyOnce(worker string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for node, c := range l.completed {
		if c[worker] != 1 {
			return fmt.Errorf("%s applied the completion of %s %d times", node, worker, c[worker])
		}
	}
	return nil
}

// candidates is the model's router candidate set on r.
func candidates(t *testing.T, r *replica) []router.WorkerID {
	t.Helper()
	rt, ok := r.Router(model)
	if !ok {
		t.Fatalf("%s has no router for %s", r.cfg.NodeID, model)
	}
	var ids []router.WorkerID
	for _, w := range rt.Workers() {
		ids = append(ids, w.ID)
	}
	return ids
}

// drainStatus is worker's "drained" field in r's /cluster/status.
func drainStatus(r *replica, worker string) (bool, bool) {
	for _, w := range r.Status(false)["workers"].([]map[string]any) {
		if w["id"] == worker {
			d, _ := w["drained"].(bool)
			return d, true
		}
	}
	return false, false
}

// TestReplicaWorkerDrainEverywhereOnce: a drain committed through one
// replica takes the worker out of every replica's candidates and marks it
// drained in every status; while a request another replica booked runs
// there (replica sync), the leader does not complete the drain; once it
// ends the worker is deregistered on every replica, exactly once, and a
// second completion (a leader that failed over after proposing) changes
// nothing.
func TestReplicaWorkerDrainEverywhereOnce(t *testing.T) {
	// With TLS, as deployed: the drain and its completion cross
	// /cluster/apply only if checkForwarded lets them.
	tc := newTestClusterTLS(t, 3, nil, true)
	leader := tc.WaitLeader()
	registerWorker(t, tc.follower(leader), "a")
	registerWorker(t, tc.follower(leader), "b")
	ledger := watchCompletions(tc)
	poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
		return tc.eachReplica(func(r *replica) error {
			if got := candidates(t, r); !slices.Equal(got, []router.WorkerID{"a", "b"}) {
				return fmt.Errorf("candidates %v", got)
			}
			return nil
		})
	})

	// A follower routes a request to a; the others hear of it over replica sync.
	busy := tc.follower(leader)
	rt, _ := busy.Router(model)
	booking := router.Booking{ID: "req-1", Worker: "a", PrefillTokens: 64, Sequences: 1, Added: time.Now()}
	rt.Load().Add(booking)
	busy.Booked(model, booking)
	lead := tc.R(leader.Index)
	rec, _ := lead.worker("a")
	poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
		if n := lead.activeRequests(rec); n != 1 {
			return fmt.Errorf("leader sees %d requests on a", n)
		}
		return nil
	})

	// Drain through the other follower.
	var via *replica
	for _, m := range tc.Running() {
		if r := tc.R(m.Index); m != leader && r != busy {
			via = r
		}
	}
	if err := via.DrainWorker(t.Context(), "a", time.Time{}); err != nil {
		t.Fatalf("drain: %v", err)
	}
	poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
		return tc.eachReplica(func(r *replica) error {
			if got := candidates(t, r); !slices.Equal(got, []router.WorkerID{"b"}) {
				return fmt.Errorf("candidates %v", got)
			}
			if d, ok := drainStatus(r, "a"); !ok || !d {
				return errors.New("status does not say a is drained")
			}
			return nil
		})
	})
	// Every replica routes new requests to b only.
	if err := tc.eachReplica(func(r *replica) error {
		rt, _ := r.Router(model)
		for i := range 20 {
			d, err := rt.Decide(router.Request{ID: fmt.Sprint("probe-", i), Tokens: 64}, time.Now())
			if err != nil || d.Worker != "b" {
				return fmt.Errorf("decision %v %v", d.Worker, err)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// Busy: the leader's pass, however late it runs, leaves a registered.
	now := time.Now()
	idle := map[string]time.Time{}
	for _, at := range []time.Time{now, now.Add(10 * drainIdleGrace)} {
		lead.completeDrains(t.Context(), lead.control(), at, idle)
	}
	if _, ok := lead.fsm.Worker("a"); !ok {
		t.Fatal("a drained worker with a running request was deregistered")
	}

	// The request ends; the leader completes the drain.
	rt.Free(booking.ID)
	busy.Freed(model, booking.ID)
	poll.Until(t, 20*time.Second, 20*time.Millisecond, func() error {
		return tc.eachReplica(func(r *replica) error {
			if _, ok := r.fsm.Worker("a"); ok {
				return errors.New("a still registered")
			}
			return nil
		})
	})
	cmd, err := fsm.EncodeSetWorkerDrain(fsm.SetWorkerDrain{Worker: "a", Drained: true, Deregister: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := via.propose(t.Context(), cmd); !errors.Is(err, fsm.ErrUnknownWorker) {
		t.Fatalf("a second completion: %v", err)
	}
	tc.WaitConverged()
	if err := ledger.exactlyOnce("a"); err != nil {
		t.Fatal(err)
	}
	// An undrain or a drain of a worker gone is a 404 for the API.
	if err := via.UndrainWorker(t.Context(), "a"); !errors.Is(err, api.ErrUnknownWorker) {
		t.Fatalf("undrain of a gone worker: %v", err)
	}
}

// TestReplicaWorkerUndrain: an undrain before the drain completes puts
// the worker back into every replica's candidates and nothing is
// deregistered.
func TestReplicaWorkerUndrain(t *testing.T) {
	tc := newTestCluster(t, 3)
	leader := tc.WaitLeader()
	r := tc.follower(leader)
	registerWorker(t, r, "a")
	registerWorker(t, r, "b")
	// Keep a busy so the leader cannot complete the drain meanwhile.
	rt, _ := r.Router(model)
	booking := router.Booking{ID: "req-1", Worker: "a", PrefillTokens: 64, Sequences: 1, Added: time.Now()}
	rt.Load().Add(booking)
	r.Booked(model, booking)
	lead := tc.R(leader.Index)
	rec, _ := lead.worker("a")
	poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
		if n := lead.activeRequests(rec); n != 1 {
			return fmt.Errorf("leader sees %d requests on a", n)
		}
		return nil
	})
	if err := r.DrainWorker(t.Context(), "a", time.Now().Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if err := r.UndrainWorker(t.Context(), "a"); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
		return tc.eachReplica(func(r *replica) error {
			if got := candidates(t, r); !slices.Equal(got, []router.WorkerID{"a", "b"}) {
				return fmt.Errorf("candidates %v", got)
			}
			if d, ok := drainStatus(r, "a"); !ok || d {
				return errors.New("status still says a is drained")
			}
			return nil
		})
	})
	rt.Free(booking.ID)
	r.Freed(model, booking.ID)
	// Idle now and undrained: a pass well past the grace leaves it.
	now := time.Now()
	idle := map[string]time.Time{}
	for _, at := range []time.Time{now, now.Add(10 * drainIdleGrace)} {
		lead.completeDrains(t.Context(), lead.control(), at, idle)
	}
	if _, ok := lead.fsm.Worker("a"); !ok {
		t.Fatal("an undrained worker was deregistered")
	}
}

// TestReplicaWorkerDrainDeadlineAcrossFailover: a drained worker kept
// busy is deregistered at its deadline by whichever replica leads then —
// here a new leader, the one that took the drain having stopped — once,
// on every replica.
func TestReplicaWorkerDrainDeadlineAcrossFailover(t *testing.T) {
	tc := newTestCluster(t, 3)
	leader := tc.WaitLeader()
	r := tc.follower(leader)
	registerWorker(t, r, "a")
	registerWorker(t, r, "b")
	ledger := watchCompletions(tc)
	rt, _ := r.Router(model)
	booking := router.Booking{ID: "req-1", Worker: "a", PrefillTokens: 64, Sequences: 1, Added: time.Now()}
	rt.Load().Add(booking) // never freed: only the deadline ends the drain
	r.Booked(model, booking)
	if err := r.DrainWorker(t.Context(), "a", time.Now().Add(3*time.Second)); err != nil {
		t.Fatal(err)
	}
	tc.Stop(leader.Index)
	tc.WaitLeader()
	ledger.mu.Lock()
	delete(ledger.completed, tc.R(leader.Index).cfg.NodeID) // stopped: it applies nothing more
	ledger.mu.Unlock()
	poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error {
		return tc.eachReplica(func(r *replica) error {
			if _, ok := r.fsm.Worker("a"); ok {
				return errors.New("a still registered")
			}
			return nil
		})
	})
	tc.WaitConverged()
	if err := ledger.exactlyOnce("a"); err != nil {
		t.Fatal(err)
	}
}

// TestReplicaWorkerDrainIdleAcrossFailover: the leader that took a drain
// stops while a request another replica booked still runs on the worker;
// the next leader, which learned of that request through replica sync,
// does not complete the drain while it runs, and completes it once —
// on every replica — after it ends.
func TestReplicaWorkerDrainIdleAcrossFailover(t *testing.T) {
	tc := newTestCluster(t, 3)
	leader := tc.WaitLeader()
	busy := tc.follower(leader)
	registerWorker(t, busy, "a")
	registerWorker(t, busy, "b")
	ledger := watchCompletions(tc)
	rt, _ := busy.Router(model)
	booking := router.Booking{ID: "req-1", Worker: "a", PrefillTokens: 64, Sequences: 1, Added: time.Now()}
	rt.Load().Add(booking)
	busy.Booked(model, booking)
	rec, _ := busy.worker("a")
	poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
		return tc.eachReplica(func(r *replica) error {
			if n := r.activeRequests(rec); n != 1 {
				return fmt.Errorf("sees %d requests on a", n)
			}
			return nil
		})
	})
	if err := busy.DrainWorker(t.Context(), "a", time.Time{}); err != nil {
		t.Fatal(err)
	}
	tc.Stop(leader.Index)
	ledger.mu.Lock()
	delete(ledger.completed, tc.R(leader.Index).cfg.NodeID)
	ledger.mu.Unlock()
	next := tc.R(tc.WaitLeader().Index)
	now := time.Now()
	idle := map[string]time.Time{}
	for _, at := range []time.Time{now, now.Add(10 * drainIdleGrace)} {
		next.completeDrains(t.Context(), next.control(), at, idle)
	}
	if _, ok := next.fsm.Worker("a"); !ok {
		t.Fatal("the new leader completed the drain of a worker with a running request")
	}
	rt.Free(booking.ID)
	busy.Freed(model, booking.ID)
	poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error {
		return tc.eachReplica(func(r *replica) error {
			if _, ok := r.fsm.Worker("a"); ok {
				return errors.New("a still registered")
			}
			return nil
		})
	})
	tc.WaitConverged()
	if err := ledger.exactlyOnce("a"); err != nil {
		t.Fatal(err)
	}
}
