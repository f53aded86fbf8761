package sim

import (
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/router"
)

// seed002Workload is the seed-002 shape of BENCHMARKS.md's warm-up
// sections: 24 prefixes of 2,032 tokens and tails of 339 over five
// workers of 585 blocks, closed loop of 16 (the fleet thrashes: each
// worker holds about four prefixes).
func seed002Workload(t *testing.T, seed uint64) *workload.Workload {
	return synthetic(t, workload.SyntheticSpec{
		Prefixes: 24, PrefixTokens: 2032, TailTokens: 339, OutputTokens: 64,
		Requests: 3000, Concurrency: 16, Seed: seed,
	})
}

// runSeed002 runs the seed-002 shape under kv with a sixth worker added
// at 60 s and the shadow warm-up, and without the event, and measures it.
func runSeed002(t *testing.T, seed uint64) (*Result, EventFigures) {
	t.Helper()
	w := seed002Workload(t, seed)
	cfg := config(router.ModeKV, 5, 585)
	cfg.Seed = seed
	base, err := Run(w, cfg)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Events, cfg.ShadowWarmUp = []FleetEvent{{At: 60 * time.Second, Kind: EventAdd}}, true
	res, err := Run(w, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return res, MeasureEvents(w, res, base, planDip)[0]
}

// TestSimShadowWarmUpEndsLikeWithLike: on the seed-002 shape (seeds 14
// and 17, the two slowest of 11–20) the shadow warm-up ends only when,
// over the last minute, the new worker had warmMinRequests requests with
// held tokens and served at least the other workers' share of them, and
// the new worker is warm like with like in the first 10-s window. It
// fails with the end judged by the worker's ratio over every token
// against the fleet's before it joined (warm): the warm-up ended 2.6 and
// 3.1 s after the event with 3 such requests, and the new worker took 30
// and 40 s.
func TestSimShadowWarmUpEndsLikeWithLike(t *testing.T) {
	if testing.Short() {
		t.Skip("simulates 2 × 2 runs")
	}
	for _, seed := range []uint64{14, 17} {
		res, f := runSeed002(t, seed)
		ev := res.Events[0]
		if ev.WarmUpEnd < 0 {
			t.Fatalf("seed %d: the warm-up never ended", seed)
		}
		n, mine, others := heldShares(res, ev.Worker, ev.WarmUpEnd-warmWindow, ev.WarmUpEnd)
		t.Logf("seed %d: warm-up ended after %.1f s (%d requests with held tokens, %.2f of them cached against the others' %.2f), warm like with like after %v s",
			seed, (ev.WarmUpEnd - ev.At).Seconds(), n, mine, others, f.WarmComparableS.Value)
		if n < warmMinRequests || mine < others {
			t.Errorf("seed %d: the warm-up ended with %d requests with held tokens at %.2f against the others' %.2f", seed, n, mine, others)
		}
		if !f.WarmComparableS.Valid || f.WarmComparableS.Value > planDip.Window.Seconds() {
			t.Errorf("seed %d: warm like with like after %+v, want the first window", seed, f.WarmComparableS)
		}
	}
}

// TestSimShadowWarmUpRedirectRoom: on the seed-002 shape (seed 15) the p99
// TTFT of the requests sent while the new worker warms stays within 1.2 ×
// the steady window's (the bar). It fails when the warm-up
// redirects a request to a holder that is not busy in kv's decision but
// goes over the headroom with it: 13 redirects, two of them waiting
// 0.67–0.81 s there, p99 1.30 × steady.
func TestSimShadowWarmUpRedirectRoom(t *testing.T) {
	if testing.Short() {
		t.Skip("simulates 2 runs")
	}
	res, f := runSeed002(t, 15)
	ratio := f.WarmUpTTFTP99Ms / f.Steady.TTFT.P99
	t.Logf("p99 while warming %.0f ms, steady %.0f ms (%.2f ×), %d redirects", f.WarmUpTTFTP99Ms, f.Steady.TTFT.P99, ratio, res.Events[0].ShadowRedirects)
	if ratio > planDip.TTFTFactor {
		t.Errorf("p99 while warming %.2f × steady, want ≤ %.1f", ratio, planDip.TTFTFactor)
	}
}

// heldShares: over the requests whose first token came in [from, to], the
// number of worker wi's with held tokens, its cached share of their held
// tokens and the other workers' share of theirs.
func heldShares(res *Result, wi int, from, to time.Duration) (n int, mine, others float64) {
	var m, o [2]int64
	for _, rr := range res.Requests {
		if rr.Worker < 0 || rr.FirstToken == 0 || rr.FirstToken < from || rr.FirstToken > to || rr.HeldTokens == 0 {
			continue
		}
		c, h := int64(min(rr.CachedTokens, rr.HeldTokens)), int64(rr.HeldTokens)
		if rr.Worker == wi {
			m[0], m[1], n = m[0]+c, m[1]+h, n+1
		} else {
			o[0], o[1] = o[0]+c, o[1]+h
		}
	}
	return n, float64(m[0]) / float64(max(m[1], 1)), float64(o[0]) / float64(max(o[1], 1))
}
