package replica

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// Session bindings over three in-process replicas (cluster harness, no API
// server): what the API's routing relies on.

func withSessions(ttl time.Duration) func(*Config) {
	return func(c *Config) { c.Sessions = SessionConfig{TTL: ttl} }
}

// bindUntilCommitted retries a bind while the cluster forms.
func bindUntilCommitted(t testing.TB, r *replica, b api.SessionBind) api.SessionBinding {
	t.Helper()
	var got api.SessionBinding
	poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error {
		var err error
		got, err = r.BindSession(context.Background(), b)
		return err
	})
	return got
}

// TestReplicaSessionFirstCommitWins: the three replicas bind one session
// at once, each to another worker; each gets the same binding back (the
// first committed), which every replica then reads locally.
func TestReplicaSessionFirstCommitWins(t *testing.T) {
	tc := newTestClusterWith(t, 3, withSessions(time.Minute))
	tc.WaitLeader()
	bindUntilCommitted(t, tc.R(0), api.SessionBind{Session: "warm-up", Worker: "w0", TTL: time.Minute})
	for round := range 5 {
		id := fmt.Sprintf("race-%d", round)
		got := make([]api.SessionBinding, 3)
		var wg sync.WaitGroup
		for i := range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				got[i] = bindUntilCommitted(t, tc.R(i), api.SessionBind{Session: id, Worker: router.WorkerID(fmt.Sprintf("w%d", i)), TTL: time.Minute})
			}()
		}
		wg.Wait()
		if got[0].Worker != got[1].Worker || got[1].Worker != got[2].Worker {
			t.Fatalf("%s: the replicas were told %v", id, got)
		}
		poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error {
			return tc.eachReplica(func(r *replica) error {
				if b, ok := r.SessionBinding(id); !ok || b.Worker != got[0].Worker {
					return fmt.Errorf("reads %+v (%v), committed %s", b, ok, got[0].Worker)
				}
				return nil
			})
		})
	}
	tc.WaitConverged()
}

// TestReplicaSessionStages: two-stage bindings (command 21) over three
// replicas: concurrent first turns choosing other pairs get the one
// committed first back; a stage replaced is seen by every replica; a
// one-stage touch keeps the prefill stage; a stale replace follows the
// binding in force.
func TestReplicaSessionStages(t *testing.T) {
	tc := newTestClusterWith(t, 3, withSessions(time.Minute))
	tc.WaitLeader()
	bindUntilCommitted(t, tc.R(0), api.SessionBind{Session: "warm-up", Worker: "w0", TTL: time.Minute})
	got := make([]api.SessionBinding, 3)
	var wg sync.WaitGroup
	for i := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i] = bindUntilCommitted(t, tc.R(i), api.SessionBind{Session: "s", Worker: router.WorkerID(fmt.Sprintf("d%d", i)),
				Prefill: router.WorkerID(fmt.Sprintf("p%d", i)), TTL: time.Minute})
		}()
	}
	wg.Wait()
	first := got[0]
	for _, g := range got {
		if g.Worker != first.Worker || g.Prefill != first.Prefill || first.Prefill == "" {
			t.Fatalf("the replicas were told %+v", got)
		}
	}
	steps := []struct {
		name string
		bind api.SessionBind
		want api.SessionBinding // Prefill and Worker in force after
	}{
		{"the prefill stage replaced", api.SessionBind{Session: "s", Worker: first.Worker, Prefill: "p9", Replace: first.Worker, ReplacePrefill: first.Prefill, TTL: time.Minute},
			api.SessionBinding{Worker: first.Worker, Prefill: "p9"}},
		{"a stale replace follows", api.SessionBind{Session: "s", Worker: "d8", Prefill: "p8", Replace: first.Worker, ReplacePrefill: first.Prefill, TTL: time.Minute},
			api.SessionBinding{Worker: first.Worker, Prefill: "p9"}},
		{"a one-stage touch keeps the prefill stage", api.SessionBind{Session: "s", Worker: first.Worker, TTL: 2 * time.Minute},
			api.SessionBinding{Worker: first.Worker, Prefill: "p9"}},
	}
	for i, st := range steps {
		b := bindUntilCommitted(t, tc.R(i%3), st.bind)
		if b.Worker != st.want.Worker || b.Prefill != st.want.Prefill {
			t.Fatalf("%s: told %+v", st.name, b)
		}
		poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error {
			return tc.eachReplica(func(r *replica) error {
				if b, ok := r.SessionBinding("s"); !ok || b.Worker != st.want.Worker || b.Prefill != st.want.Prefill {
					return fmt.Errorf("%s: reads %+v (%v)", st.name, b, ok)
				}
				return nil
			})
		})
	}
	tc.WaitConverged()
}

// TestReplicaSessionTouchCoalesced: bound turns write nothing while more
// than half the TTL is left; below half, a burst of turns writes one
// refresh, which every replica applies.
func TestReplicaSessionTouchCoalesced(t *testing.T) {
	tc := newTestClusterWith(t, 3, withSessions(time.Minute))
	leader := tc.WaitLeader()
	r := tc.follower(leader)
	b := bindUntilCommitted(t, r, api.SessionBind{Session: "s", Worker: "w1", TTL: 20 * time.Second})
	tc.WaitConverged()
	before := r.fsm.AppliedIndex()
	for range 100 {
		r.TouchSession(b, 30*time.Second) // 20 s left of 30: more than half, nothing to write
	}
	r.sessWrites.mu.Lock()
	inFlight := len(r.sessWrites.inFlight)
	r.sessWrites.mu.Unlock()
	if n := r.fsm.AppliedIndex() - before; n != 0 || inFlight != 0 {
		t.Fatalf("%d entries and %d writes in flight for bound turns with more than half the TTL left", n, inFlight)
	}
	for range 100 {
		r.TouchSession(b, time.Minute) // 20 s left of 60: one refresh for the burst
	}
	poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error {
		return tc.eachReplica(func(x *replica) error {
			if got, ok := x.SessionBinding("s"); !ok || time.Until(got.Until) < 55*time.Second {
				return fmt.Errorf("binding %+v not refreshed", got)
			}
			return nil
		})
	})
	tc.WaitConverged()
	if n := r.fsm.AppliedIndex() - before; n < 1 || n > 2 {
		t.Fatalf("%d entries for 200 bound turns, want the one refresh", n)
	}
}

// TestReplicaSessionExpiresEverywhere: an idle binding ends on every
// replica at the same log index, by the leader's ticks, and an ended one
// (Final) at once.
func TestReplicaSessionExpiresEverywhere(t *testing.T) {
	tc := newTestClusterWith(t, 3, withSessions(2*time.Second))
	tc.WaitLeader()
	bindUntilCommitted(t, tc.R(1), api.SessionBind{Session: "idle", Worker: "w1", TTL: 2 * time.Second})
	bindUntilCommitted(t, tc.R(2), api.SessionBind{Session: "final", Worker: "w2", TTL: time.Minute})
	tc.R(0).EndSession("final")
	poll.Until(t, 2*time.Second+10*tickEvery+10*time.Second, 50*time.Millisecond, func() error {
		return tc.eachReplica(func(r *replica) error {
			if n := r.SessionCount(); n != 0 {
				return fmt.Errorf("%d bindings left", n)
			}
			return nil
		})
	})
	tc.WaitConverged()
}

// TestReplicaSessionLimitIsAMiss: the state's limit surfaces as
// api.ErrSessionLimit (the API serves the turn unbound); checked before
// proposing, so nothing is written.
func TestReplicaSessionLimitIsAMiss(t *testing.T) {
	tc := newTestClusterWith(t, 1, withSessions(time.Minute))
	tc.WaitLeader()
	r := tc.R(0)
	_, err := r.BindSession(context.Background(), api.SessionBind{Session: string(make([]byte, 300)), Worker: "w", TTL: time.Minute})
	if err == nil || errors.Is(err, api.ErrSessionLimit) {
		t.Fatalf("an oversized id: %v", err)
	}
}

// BenchmarkReplicaSession is what a binding costs a session's turns in
// three in-process replicas (loopback TCP, Raft with fsync to a temp dir):
//   - first-turn/leader and first-turn/follower: the commit a session's
//     first turn waits for before it is sent (a follower forwards to the
//     leader: one more HTTP round trip);
//   - first-turn-two-stage/…: the same for a two-stage model's binding of
//     both stages in one record (command 21);
//   - bound-turn: a later turn's read of the binding (local, no consensus).
func BenchmarkReplicaSession(b *testing.B) {
	tc := newTestClusterWith(b, 3, withSessions(time.Hour))
	leader := tc.WaitLeader()
	bindUntilCommitted(b, tc.R(leader.Index), api.SessionBind{Session: "warm-up", Worker: "w0", TTL: time.Hour})
	bindUntilCommitted(b, tc.follower(leader), api.SessionBind{Session: "warm-up-2", Worker: "w0", TTL: time.Hour})
	for _, bc := range []struct {
		name    string
		r       *replica
		prefill router.WorkerID // a two-stage binding's prefill worker (command 21); "" one stage (17)
	}{{"first-turn/leader", tc.R(leader.Index), ""}, {"first-turn/follower", tc.follower(leader), ""},
		{"first-turn-two-stage/leader", tc.R(leader.Index), "p1"}, {"first-turn-two-stage/follower", tc.follower(leader), "p1"}} {
		b.Run(bc.name, func(b *testing.B) {
			i := 0
			for b.Loop() {
				i++
				if _, err := bc.r.BindSession(context.Background(), api.SessionBind{Session: fmt.Sprintf("%s-%d", bc.name, i), Worker: "w1", Prefill: bc.prefill, TTL: time.Hour}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	b.Run("bound-turn", func(b *testing.B) {
		r := tc.follower(leader)
		for b.Loop() {
			if _, ok := r.SessionBinding("warm-up"); !ok {
				b.Fatal("not bound")
			}
		}
	})
}
