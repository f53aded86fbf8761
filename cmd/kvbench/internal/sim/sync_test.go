package sim

import (
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/router"
)

// inView is how many requests router k's load view holds over all workers.
func (s *state) inView(k int) int {
	n := 0
	for _, id := range s.ids {
		n += s.rts[k].Load().Load(id).Requests
	}
	return n
}

func syncState(t *testing.T, routers int, delay time.Duration) *state {
	t.Helper()
	w := synthetic(t, workload.SyntheticSpec{
		Prefixes: 3, PrefixTokens: 256, TailTokens: 32, OutputTokens: 64,
		Requests: 6, Concurrency: 3, Seed: 2,
	})
	cfg := config(router.ModeKV, 3, 256)
	cfg.Routers, cfg.SyncDelay = routers, delay
	s := &state{w: w, cfg: cfg, feed: true}
	if err := s.build(); err != nil {
		t.Fatal(err)
	}
	s.start()
	return s
}

// Three routers, 100 ms of sync lag: the balancer deals the three first
// requests one to each router; each router sees its own booking at once
// and the two others' only 100 ms later; once everything finished and the
// frees arrived, every view is empty.
func TestSyncDelaysTheOtherRoutersView(t *testing.T) {
	const lag = 100 * time.Millisecond
	s := syncState(t, 3, lag)
	if !s.step() || s.now != 0 {
		t.Fatalf("first step at %v", s.now)
	}
	for i := range 3 {
		if s.owner[i] != i {
			t.Fatalf("request %d routed by router %d, want %d (round-robin over routers)", i, s.owner[i], i)
		}
		if got := s.inView(i); got != 1 {
			t.Fatalf("router %d sees %d requests at t=0, want its own 1", i, got)
		}
	}
	for s.now < lag {
		if !s.step() {
			t.Fatal("ran out of events before the sync lag")
		}
		if s.now < lag && s.finished == 0 {
			for k := range 3 {
				if got := s.inView(k); got != 1 {
					t.Fatalf("router %d sees %d requests at %v < lag, want 1", k, got, s.now)
				}
			}
		}
	}
	if s.finished > 0 {
		t.Fatalf("a request finished within %v: the test needs longer requests", lag)
	}
	for k := range 3 {
		if got := s.inView(k); got != 3 {
			t.Fatalf("router %d sees %d requests at %v, want all 3", k, got, s.now)
		}
	}
	for s.step() {
	}
	if s.finished != len(s.res) {
		t.Fatalf("%d of %d finished", s.finished, len(s.res))
	}
	for k := range 3 {
		if got := s.inView(k); got != 0 {
			t.Fatalf("router %d still sees %d requests after every free was synced", k, got)
		}
	}
}

// No lag: every router sees every booking before the next request is routed.
func TestSyncWithoutDelayIsOneView(t *testing.T) {
	s := syncState(t, 3, 0)
	s.step()
	for k := range 3 {
		if got := s.inView(k); got != 3 {
			t.Fatalf("router %d sees %d requests, want all 3 at once", k, got)
		}
	}
}

// Lag costs cache hits: three kv routers that learn each other's bookings
// 1 s late spread a prefix wider (each sends to the worker it believes
// idle) than three that learn them at once.
func TestSyncLagCostsCacheHits(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{
		Prefixes: 8, PrefixTokens: 1024, TailTokens: 100, OutputTokens: 16,
		Requests: 400, Concurrency: 8, Seed: 5,
	})
	ratio := func(delay time.Duration) float64 {
		cfg := config(router.ModeKV, 4, 200)
		cfg.Routers, cfg.SyncDelay = 3, delay
		_, sum := run(t, w, cfg)
		if sum.Errors != 0 {
			t.Fatalf("delay %v: %d errors", delay, sum.Errors)
		}
		return sum.CachedTokenRatio
	}
	now, late := ratio(0), ratio(time.Second)
	t.Logf("cached ratio: %.3f without lag, %.3f with 1 s", now, late)
	if !(late < now) {
		t.Fatalf("cached ratio with 1 s sync lag %.3f, without %.3f: lag should cost hits", late, now)
	}
}

func TestRunRejectsNegativeRouters(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{Prefixes: 1, PrefixTokens: 32, OutputTokens: 1, Requests: 1, Concurrency: 1, Seed: 1})
	cfg := config(router.ModeKV, 1, 64)
	cfg.SyncDelay = -time.Second
	if _, err := Run(w, cfg); err == nil {
		t.Fatal("negative sync delay accepted")
	}
}

// Late frees: bookings reach every router at once, frees 100 ms later. At
// the first finishes each router has dropped its own finished requests but
// still counts the others' (phantom load): every view holds more than is in
// flight. Once the extra lag has passed, and before anything else finishes,
// every view is exactly what is in flight.
func TestSyncFreeExtraLeavesPhantomLoad(t *testing.T) {
	s := syncState(t, 3, 0)
	s.cfg.SyncFreeExtra = 100 * time.Millisecond
	for s.finished == 0 {
		if !s.step() {
			t.Fatal("nothing finished")
		}
	}
	inFlight := s.routed - s.finished
	for k := range 3 {
		if got := s.inView(k); got <= inFlight {
			t.Fatalf("router %d sees %d requests at the first finish, %d in flight: the others' frees should still be on their way", k, got, inFlight)
		}
	}
	end, finished := s.now+s.cfg.SyncFreeExtra, s.finished
	for s.now < end && s.step() {
	}
	if s.finished != finished {
		t.Fatal("more requests finished within the extra lag: the workload no longer isolates the first frees")
	}
	inFlight = s.routed - s.finished
	for k := range 3 {
		if got := s.inView(k); got != inFlight {
			t.Fatalf("router %d sees %d requests after the extra lag, %d in flight", k, got, inFlight)
		}
	}
}
