package sim

import (
	"reflect"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/router"
)

func agentWorkload(t *testing.T, turns, subagents, requests int, think time.Duration, rate float64) *workload.Workload {
	t.Helper()
	return synthetic(t, workload.SyntheticSpec{
		Prefixes: 4, PrefixTokens: 512, TailTokens: 64, OutputTokens: 32,
		Requests: requests, Concurrency: 3, Seed: 9, ArrivalRate: rate,
		Agent: workload.AgentSpec{Turns: turns, Think: think, Subagents: subagents},
	})
}

// Turns follow their previous turn's end by its think time; subagents
// follow the parent's first turn alike; a closed loop keeps its clients'
// top-level sessions one after another.
func TestSimAgentTurnsFollowCompletion(t *testing.T) {
	for _, tc := range []struct {
		name string
		rate float64
	}{{"closed loop", 0}, {"open loop", 0.5}} {
		t.Run(tc.name, func(t *testing.T) {
			w := agentWorkload(t, 4, 2, 120, 300*time.Millisecond, tc.rate)
			res, sum := run(t, w, config(router.ModeKV, 3, 1024))
			if sum.Errors != 0 || sum.Completed != 120 {
				t.Fatalf("%d errors, %d completed", sum.Errors, sum.Completed)
			}
			for i, r := range w.Requests {
				rr := res.Requests[i]
				if r.NextTurn >= 0 && res.Requests[r.NextTurn].Sent != rr.Finished+r.Think {
					t.Fatalf("request %d: next turn sent at %v, want its finish %v + think %v", i, res.Requests[r.NextTurn].Sent, rr.Finished, r.Think)
				}
				for _, c := range r.Children {
					if res.Requests[c].Sent != rr.Finished+r.Think {
						t.Fatalf("request %d: subagent %d sent at %v, want %v", i, c, res.Requests[c].Sent, rr.Finished+r.Think)
					}
				}
			}
			if tc.rate > 0 {
				for _, root := range w.Roots {
					first := w.Sessions[root][0]
					if res.Requests[first].Sent != w.Requests[first].At {
						t.Fatalf("session %d started at %v, want its arrival %v", root, res.Requests[first].Sent, w.Requests[first].At)
					}
				}
				return
			}
			// Closed loop: root k ≥ 3 starts when an earlier root's last turn ends.
			ends := map[time.Duration]bool{}
			for _, root := range w.Roots {
				turns := w.Sessions[root]
				ends[res.Requests[turns[len(turns)-1]].Finished] = true
			}
			for k, root := range w.Roots {
				sent := res.Requests[w.Sessions[root][0]].Sent
				if (k < 3 && sent != 0) || (k >= 3 && !ends[sent]) {
					t.Fatalf("root %d started at %v: not at 0 nor at a session's end", k, sent)
				}
			}
		})
	}
}

// workersPerTree is how many distinct workers each session tree's turns
// went to, at most.
func workersPerTree(w *workload.Workload, res *Result) int {
	most := 0
	per := map[int]map[int]bool{}
	for i, r := range w.Requests {
		root := w.SessionRoot[r.Session]
		if per[root] == nil {
			per[root] = map[int]bool{}
		}
		per[root][res.Requests[i].Worker] = true
		most = max(most, len(per[root]))
	}
	return most
}

// Hard affinity keeps every turn of a session tree on one worker with one
// shared table, across three lagging routers, whatever the policy; a
// table per router over a lag longer than the think time does not; and
// binding raises round-robin's session cached fraction.
func TestSimAffinity(t *testing.T) {
	w := agentWorkload(t, 5, 1, 200, 50*time.Millisecond, 0)
	for _, tc := range []struct {
		name      string
		mode      router.Mode
		aff       Affinity
		routers   int
		oneWorker bool
	}{
		{"off, round-robin", router.ModeRoundRobin, Affinity{}, 1, false},
		{"hard, round-robin", router.ModeRoundRobin, Affinity{Mode: AffinityHard}, 1, true},
		{"hard, kv, shared over 3 routers", router.ModeKV, Affinity{Mode: AffinityHard}, 3, true},
		{"hard, least-loaded, shared over 3 routers", router.ModeLeastLoaded, Affinity{Mode: AffinityHard}, 3, true},
		{"hard, round-robin, per router", router.ModeRoundRobin, Affinity{Mode: AffinityHard, PerRouter: true}, 3, false},
		{"soft never busy, round-robin", router.ModeRoundRobin, Affinity{Mode: AffinitySoft, Busy: 1}, 1, true},
		{"soft always busy, round-robin", router.ModeRoundRobin, Affinity{Mode: AffinitySoft, Busy: 1e-9}, 1, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := config(tc.mode, 4, 1024)
			cfg.Affinity, cfg.Routers, cfg.SyncDelay = tc.aff, tc.routers, 5*time.Second
			res, sum := run(t, w, cfg)
			if sum.Errors != 0 || !sum.SessionCachedFraction.Valid {
				t.Fatalf("%d errors, session fraction %+v", sum.Errors, sum.SessionCachedFraction)
			}
			if got := workersPerTree(w, res) == 1; got != tc.oneWorker {
				t.Fatalf("every tree on one worker: %v, want %v", got, tc.oneWorker)
			}
		})
	}
	_, off := run(t, w, config(router.ModeRoundRobin, 4, 1024))
	cfg := config(router.ModeRoundRobin, 4, 1024)
	cfg.Affinity = Affinity{Mode: AffinityHard}
	_, hard := run(t, w, cfg)
	if hard.SessionCachedFraction.Value <= off.SessionCachedFraction.Value+0.05 {
		t.Fatalf("session cached fraction: hard %.3f, off %.3f", hard.SessionCachedFraction.Value, off.SessionCachedFraction.Value)
	}
}

func TestSimAffinityConfigErrors(t *testing.T) {
	w := agentWorkload(t, 2, 0, 10, 0, 0)
	for _, a := range []Affinity{{Mode: "sticky"}, {Mode: AffinitySoft}, {Mode: AffinitySoft, Busy: 1.5}} {
		cfg := config(router.ModeKV, 2, 512)
		cfg.Affinity = a
		if _, err := Run(w, cfg); err == nil {
			t.Errorf("%+v: accepted", a)
		}
	}
}

// Runs with sessions, affinity and fleet events are pure functions of
// their inputs.
func TestSimSessionsAndEventsDeterministic(t *testing.T) {
	w := agentWorkload(t, 4, 1, 160, 100*time.Millisecond, 2)
	cfg := config(router.ModeKVPooled, 4, 1024)
	cfg.Affinity = Affinity{Mode: AffinityHard, PerRouter: true}
	cfg.Routers, cfg.SyncDelay = 3, 200*time.Millisecond
	cfg.Events = []FleetEvent{{At: 3 * time.Second, Kind: EventRemove, Chooser: ChooserRandom}, {At: 6 * time.Second, Kind: EventAdd}}
	a, _ := run(t, w, cfg)
	b, _ := run(t, w, cfg)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("two runs of one configuration differ")
	}
}
