package sim

import (
	"errors"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/internal/fleetplan"
	"github.com/kvrouter/kvrouter/internal/warmup"
	"github.com/kvrouter/kvrouter/router"
)

// fleetWorkload is an open-loop prefix workload with skewed popularity,
// long enough to run PlanWindow before a removal and the horizon after.
// fleetBlocks is each worker's KV capacity: the fleet holds the whole
// working set (24 prefixes × 128 blocks) with room to spare.
var fleetBlocks = 1200

func fleetWorkload(t *testing.T, seed uint64) *workload.Workload {
	return synthetic(t, workload.SyntheticSpec{
		Prefixes: 24, PrefixTokens: 2048, TailTokens: 64, OutputTokens: 8, Popularity: "zipf:1.1",
		Requests: 4000, Concurrency: 1, ArrivalRate: 4, Seed: seed,
	})
}

// TestSimRemovalChoices: a removal happens once, at its time, on the
// worker its choice names; no request is sent there afterwards; every
// request completes (running ones finish on the removed worker); the
// result covers the horizon after it.
func TestSimRemovalChoices(t *testing.T) {
	w := fleetWorkload(t, 3)
	at := 10 * time.Minute
	for _, choose := range Choices {
		cfg := config(router.ModeKV, 4, fleetBlocks)
		cfg.Remove = &Removal{At: at, Choose: choose}
		res, err := Run(w, cfg)
		if err != nil {
			t.Fatal(err)
		}
		r := res.Removal
		if r == nil || r.Choose != choose || r.At < at || r.At > at+time.Second || r.PromptTokensAfter == 0 {
			t.Fatalf("%s: removal %+v", choose, r)
		}
		gone := -1
		for i, id := range []string{"w0", "w1", "w2", "w3"} {
			if id == r.Worker {
				gone = i
			}
		}
		for i, rr := range res.Requests {
			if !rr.Done {
				t.Fatalf("%s: request %d: %s", choose, i, rr.Err)
			}
			if rr.Sent >= r.At && rr.Worker == gone {
				t.Fatalf("%s: request %d sent at %v to the removed %s", choose, i, rr.Sent, r.Worker)
			}
		}
		if res.IndexErrors != 0 {
			t.Errorf("%s: %d index errors", choose, res.IndexErrors)
		}
	}
	for _, bad := range []Config{
		func() Config {
			c := config(router.ModeKV, 4, fleetBlocks)
			c.Remove = &Removal{Choose: "oldest"}
			return c
		}(),
		func() Config { c := config(router.ModeKV, 1, 600); c.Remove = &Removal{Choose: ChoosePlan}; return c }(),
		func() Config {
			c := config(router.ModeKV, 4, fleetBlocks)
			c.Remove = &Removal{At: -1, Choose: ChoosePlan}
			return c
		}(),
	} {
		if _, err := Run(w, bad); !errors.Is(err, ErrConfig) {
			t.Errorf("%+v: %v", bad.Remove, err)
		}
	}
}

// TestSimRemovalPlanLosesLess: on a fleet whose workers differ (three
// of 1200 blocks, one of 300), removing the worker the plan ranks
// cheapest loses at most half the cached tokens (over the horizon) that
// removing a random worker loses, averaged over seeds — the bar.
// "Random" is the exact expectation: the mean loss over every worker.
// On a fleet of equal workers every removal costs about the same (the
// fleet's lost capacity dominates, not whose cache goes): there the
// plan is no worse than random (kvbench/DESIGN.md, Fleet events).
func TestSimRemovalPlanLosesLess(t *testing.T) {
	if testing.Short() {
		t.Skip("simulates 3 × 6 runs")
	}
	at := 10 * time.Minute
	fleet := func() Config {
		c := config(router.ModeKV, 4, fleetBlocks)
		c.KVBlocks = []int{fleetBlocks, fleetBlocks, fleetBlocks, fleetBlocks / 4}
		return c
	}
	var planLoss, randomLoss float64
	for seed := uint64(1); seed <= 3; seed++ {
		w := fleetWorkload(t, seed)
		base, err := Run(w, fleet())
		if err != nil {
			t.Fatal(err)
		}
		var kept int64 // the cached tokens of the horizon after at, with every worker
		for _, rr := range base.Requests {
			if rr.Sent >= at && rr.Sent < at+fleetplan.Horizon {
				kept += int64(rr.CachedTokens)
			}
		}
		lossOf := func(r Removal) (float64, string) {
			cfg := fleet()
			cfg.Remove = &r
			res, err := Run(w, cfg)
			if err != nil {
				t.Fatal(err)
			}
			return float64(kept - res.Removal.CachedTokensAfter), res.Removal.Worker
		}
		p, chosen := lossOf(Removal{At: at, Choose: ChoosePlan})
		var r float64
		for i := range 4 {
			l, _ := lossOf(Removal{At: at, Choose: ChooseWorker, Worker: WorkerID(i, 4)})
			r += l / 4
		}
		t.Logf("seed %d: cached tokens over the horizon without removal %d; lost removing the plan's cheapest (%s) %.0f, a random worker %.0f", seed, kept, chosen, p, r)
		planLoss += p
		randomLoss += r
	}
	t.Logf("mean over seeds: plan %.0f, random %.0f (ratio %.2f)", planLoss/3, randomLoss/3, planLoss/max(randomLoss, 1))
	if planLoss > randomLoss/2 {
		t.Fatalf("the plan's cheapest worker lost %.0f cached tokens, a random one %.0f: more than half", planLoss, randomLoss)
	}
}

// TestSimAddition: the last worker takes no request before its time and
// takes requests after; the result reports its share, when it warmed,
// and the fleet's dips. Logged: how kv routing and cache-blind
// round-robin warm it (issue 29 item 3's baseline; no warm-up policy yet).
func TestSimAddition(t *testing.T) {
	w := fleetWorkload(t, 1)
	at := 10 * time.Minute
	for _, mode := range []router.Mode{router.ModeKV, router.ModeRoundRobin} {
		cfg := config(mode, 4, fleetBlocks)
		cfg.Add = &Addition{At: at}
		res, err := Run(w, cfg)
		if err != nil {
			t.Fatal(err)
		}
		a := res.Addition
		if a == nil || a.Worker != "w3" || a.AtS < at.Seconds() || a.Share <= 0 || a.WarmS > a.HorizonS {
			t.Fatalf("%s: addition %+v", mode, a)
		}
		for i, rr := range res.Requests {
			if !rr.Done {
				t.Fatalf("%s: request %d: %s", mode, i, rr.Err)
			}
			if rr.Worker == 3 && rr.Sent.Seconds() < a.AtS {
				t.Fatalf("%s: request %d sent at %v to the worker joining at %vs", mode, i, rr.Sent, a.AtS)
			}
		}
		t.Logf("%s: the new worker took %.0f%% of the requests, reached the fleet's hit rate %.2f after %.0f s; fleet hit-rate dip %.3f for %.0f s, TTFT peak %.2f×",
			mode, 100*a.Share, a.HitRateBefore, a.WarmS, a.HitRateDip, a.HitRateDipS, a.TTFTPeakRatio)
	}
	bad := config(router.ModeKV, 4, fleetBlocks)
	bad.Add, bad.Remove = &Addition{At: at}, &Removal{At: at, Choose: ChoosePlan}
	if _, err := Run(w, bad); !errors.Is(err, ErrConfig) {
		t.Fatalf("two fleet events: %v", err)
	}
}

// TestSimWarmUp: with the warm-up policy the joining worker is sent
// requests on purpose (new and duplicated prefixes), stops being steered
// once warm, and warms no later than with kv routing alone. Logged:
// its time to warm, share and the fleet's dips, against kv alone and
// round-robin (cache-blind), over three seeds.
func TestSimWarmUp(t *testing.T) {
	if testing.Short() {
		t.Skip("simulates 3 × 3 runs")
	}
	at := 10 * time.Minute
	var sums [3]float64
	for seed := uint64(1); seed <= 3; seed++ {
		w := fleetWorkload(t, seed)
		for i, tc := range []struct {
			name string
			mode router.Mode
			warm *warmup.Policy
		}{
			{"kv", router.ModeKV, nil},
			{"kv+warm-up", router.ModeKV, &warmup.Policy{Share: 0.3, Headroom: warmup.DefaultHeadroom}},
			{"round-robin", router.ModeRoundRobin, nil},
		} {
			cfg := config(tc.mode, 4, fleetBlocks)
			cfg.Add, cfg.WarmUp = &Addition{At: at}, tc.warm
			res, err := Run(w, cfg)
			if err != nil {
				t.Fatal(err)
			}
			a := res.Addition
			if tc.warm != nil && (a.Steered == 0 || a.WarmUpEndS == nil) {
				t.Fatalf("seed %d %s: steered %d, warm-up end %v", seed, tc.name, a.Steered, a.WarmUpEndS)
			}
			sums[i] += a.WarmS
			t.Logf("seed %d %-12s warm after %3.0f s, share %4.1f%%, steered %d, fleet hit-rate dip %.3f, TTFT peak %.2f×",
				seed, tc.name, a.WarmS, 100*a.Share, a.Steered, a.HitRateDip, a.TTFTPeakRatio)
		}
	}
	t.Logf("mean time to warm: kv %.0f s, kv+warm-up %.0f s, round-robin %.0f s", sums[0]/3, sums[1]/3, sums[2]/3)
	if sums[1] > sums[0] {
		t.Fatalf("the warm-up made the joiner warm later (%.0f s) than kv alone (%.0f s)", sums[1]/3, sums[0]/3)
	}
}
