package sim

import (
	"fmt"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/stats"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/router"
)

// pinFigures are the TTFTs (ms) of the later turns (2nd on) of the
// session trees a run pins (PinEvery) and of the others.
type pinFigures struct {
	pinned, others []float64
	cachedPinned   float64 // cached ÷ prompt tokens over the pinned trees' later turns
	cachedOthers   float64
}

func laterTurnTTFTs(w *workload.Workload, res *Result, pinned func(i int) bool) pinFigures {
	var f pinFigures
	var cp, pp, co, po float64
	for i, r := range w.Requests {
		if r.Session == workload.NoSession || w.Sessions[r.Session][0] == i {
			continue // first turns have nothing of their own cached yet
		}
		rr := res.Requests[i]
		ms := float64(rr.FirstToken-rr.Sent) / float64(time.Millisecond)
		if pinned(i) {
			f.pinned = append(f.pinned, ms)
			cp, pp = cp+float64(rr.CachedTokens), pp+float64(r.PromptTokens)
		} else {
			f.others = append(f.others, ms)
			co, po = co+float64(rr.CachedTokens), po+float64(r.PromptTokens)
		}
	}
	f.cachedPinned, f.cachedOthers = cp/pp, co/po
	return f
}

func pct(xs []float64, p float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return stats.Percentile(s, p)
}

// TestSimPinnedSessions: agent sessions under memory pressure (two workers
// whose caches hold a few of the live conversations), every session bound
// to its worker (hard affinity). A quarter of the session trees pin their
// prompts (nvext.cache_control, TTL 60 s; the engine keeps pinned blocks as
// SGLang's HiCache does): their later turns find their conversation cached
// and start sooner than the other sessions', and sooner than the same
// sessions did unpinned. The figures go to BENCHMARKS.md ("Prefix pins").
func TestSimPinnedSessions(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{
		Prefixes: 16, PrefixTokens: 4096, TailTokens: 512, OutputTokens: 64,
		Requests: 384, Concurrency: 8, Seed: 11,
		Agent: workload.AgentSpec{Turns: 8, Think: 10 * time.Second},
	})
	cfg := config(router.ModeKV, 2, 1024)
	cfg.Affinity = Affinity{Mode: AffinityHard}
	const every = 4
	inTree := func(i int) bool { // the trees the pinned run pins, in either run
		r := w.Requests[i]
		return r.Session != workload.NoSession && w.SessionRoot[r.Session]%every == 0
	}
	base, bs := run(t, w, cfg)
	cfg.PinTTL, cfg.PinEvery = time.Minute, every
	pinned, ps := run(t, w, cfg)
	for _, s := range []Summary{bs, ps} {
		if s.Errors != 0 || s.Completed != len(w.Requests) {
			t.Fatalf("%d errors, %d of %d completed", s.Errors, s.Completed, len(w.Requests))
		}
	}
	b, p := laterTurnTTFTs(w, base, inTree), laterTurnTTFTs(w, pinned, inTree)
	if bs.PinnedSessions != nil || ps.PinnedSessions == nil || ps.UnpinnedSessions == nil ||
		ps.PinnedSessions.Turns != len(p.pinned) || ps.UnpinnedSessions.Turns != len(p.others) ||
		math.Abs(ps.PinnedSessions.CachedFraction-p.cachedPinned) > 1e-12 || ps.PinnedSessions.TTFT.P50 != pct(p.pinned, 50) {
		t.Fatalf("summary of the pinned groups %+v / %+v, want %d and %d turns, cached %.3f", ps.PinnedSessions, ps.UnpinnedSessions,
			len(p.pinned), len(p.others), p.cachedPinned)
	}
	line := func(name string, f []float64, cached float64) string {
		return fmt.Sprintf("%-34s n=%3d  TTFT p50 %7.1f ms  p90 %7.1f ms  mean %7.1f ms  cached %.3f", name, len(f), pct(f, 50), pct(f, 90), mean(f), cached)
	}
	t.Log("later turns (2nd on) of agent sessions (4k-token system prompts, +576 tokens a turn, 8 turns, 10 s think), 2 workers × 1024 blocks, 8 concurrent sessions, hard affinity, kv:")
	t.Log(line("no pins, trees 0 mod 4", b.pinned, b.cachedPinned))
	t.Log(line("no pins, other trees", b.others, b.cachedOthers))
	t.Log(line("pins (TTL 60s), pinned trees", p.pinned, p.cachedPinned))
	t.Log(line("pins (TTL 60s), other trees", p.others, p.cachedOthers))
	if !(pct(p.pinned, 50) < pct(p.others, 50) && pct(p.pinned, 50) < pct(b.pinned, 50) && p.cachedPinned > b.cachedPinned) {
		t.Errorf("pinned sessions' later turns: p50 %.1f ms (others %.1f, unpinned before %.1f), cached %.3f (unpinned %.3f): pins did not keep their prefixes",
			pct(p.pinned, 50), pct(p.others, 50), pct(b.pinned, 50), p.cachedPinned, b.cachedPinned)
	}
}

func mean(xs []float64) float64 {
	s := 0.0
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}
