package report

import (
	"fmt"
	"strings"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/sim"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/stats"
)

// MeanEvents folds the reps' fleet events, event by event (every rep has
// the same events): nil when the runs had none.
func MeanEvents(runs []Run) []EventResult {
	if len(runs) == 0 || len(runs[0].Summary.Events) == 0 {
		return nil
	}
	out := make([]EventResult, len(runs[0].Summary.Events))
	for k := range out {
		reps := make([]sim.EventFigures, 0, len(runs))
		for _, r := range runs {
			if k < len(r.Summary.Events) {
				reps = append(reps, r.Summary.Events[k])
			}
		}
		out[k] = meanEvent(reps)
	}
	return out
}

func meanEvent(reps []sim.EventFigures) EventResult {
	first := reps[0]
	e := EventResult{EventFigures: sim.EventFigures{Kind: first.Kind, Chooser: first.Chooser, AtS: first.AtS}, Have: map[string]int{}}
	n := float64(len(reps))
	mean := func(f func(x *sim.EventFigures) float64) float64 {
		sum := 0.0
		for i := range reps {
			sum += f(&reps[i])
		}
		return sum / n
	}
	opt := func(name string, f func(x *sim.EventFigures) stats.Optional) stats.Optional {
		sum, have := 0.0, 0
		for i := range reps {
			if o := f(&reps[i]); o.Valid {
				sum += o.Value
				have++
			}
		}
		if have == 0 {
			return stats.Optional{}
		}
		if have < len(reps) {
			e.Have[name] = have
		}
		return stats.Optional{Value: sum / float64(have), Valid: true}
	}
	win := func(f func(x *sim.EventFigures) *sim.WindowFigures) sim.WindowFigures {
		return sim.WindowFigures{
			StartS:           mean(func(x *sim.EventFigures) float64 { return f(x).StartS }),
			Requests:         int(mean(func(x *sim.EventFigures) float64 { return float64(f(x).Requests) }) + 0.5),
			CachedTokenRatio: mean(func(x *sim.EventFigures) float64 { return f(x).CachedTokenRatio }),
			TTFT: stats.Quantiles{
				P50: mean(func(x *sim.EventFigures) float64 { return f(x).TTFT.P50 }),
				P99: mean(func(x *sim.EventFigures) float64 { return f(x).TTFT.P99 }),
			},
		}
	}
	e.Steady = win(func(x *sim.EventFigures) *sim.WindowFigures { return &x.Steady })
	e.After = win(func(x *sim.EventFigures) *sim.WindowFigures { return &x.After })
	e.MinCachedTokenRatio = mean(func(x *sim.EventFigures) float64 { return x.MinCachedTokenRatio })
	e.MaxTTFTP99Ms = mean(func(x *sim.EventFigures) float64 { return x.MaxTTFTP99Ms })
	e.LostCachedTokens = mean(func(x *sim.EventFigures) float64 { return x.LostCachedTokens })
	e.BaselineCachedTokens = mean(func(x *sim.EventFigures) float64 { return x.BaselineCachedTokens })
	e.LostFraction = mean(func(x *sim.EventFigures) float64 { return x.LostFraction })
	e.Resent = mean(func(x *sim.EventFigures) float64 { return x.Resent })
	e.RecoveredS = opt("recovered_s", func(x *sim.EventFigures) stats.Optional { return x.RecoveredS })
	e.TTFTRecoveredS = opt("ttft_recovered_s", func(x *sim.EventFigures) stats.Optional { return x.TTFTRecoveredS })
	e.SessionsKept = opt("sessions_kept", func(x *sim.EventFigures) stats.Optional { return x.SessionsKept })
	e.LeftS = opt("left_s", func(x *sim.EventFigures) stats.Optional { return x.LeftS })
	e.WarmS = opt("warm_s", func(x *sim.EventFigures) stats.Optional { return x.WarmS })
	e.NewWorkerShare = opt("new_worker_share", func(x *sim.EventFigures) stats.Optional { return x.NewWorkerShare })
	e.Steered = opt("steered", func(x *sim.EventFigures) stats.Optional { return x.Steered })
	e.WarmComparableS = opt("warm_comparable_s", func(x *sim.EventFigures) stats.Optional { return x.WarmComparableS })
	e.WarmComparableFineS = opt("warm_comparable_fine_s", func(x *sim.EventFigures) stats.Optional { return x.WarmComparableFineS })
	e.WarmUpTTFTP99Ms = mean(func(x *sim.EventFigures) float64 { return x.WarmUpTTFTP99Ms })
	e.WarmUpBaseTTFTP99Ms = mean(func(x *sim.EventFigures) float64 { return x.WarmUpBaseTTFTP99Ms })
	e.BaseMaxTTFTP99Ms = mean(func(x *sim.EventFigures) float64 { return x.BaseMaxTTFTP99Ms })
	e.WorstWindowP99VsBase = mean(func(x *sim.EventFigures) float64 { return x.WorstWindowP99VsBase })
	e.TTFTP99VsBase = mean(func(x *sim.EventFigures) float64 { return x.TTFTP99VsBase })
	e.WarmUpEndS = opt("warm_up_end_s", func(x *sim.EventFigures) stats.Optional { return x.WarmUpEndS })
	e.Shadows = opt("shadows", func(x *sim.EventFigures) stats.Optional { return x.Shadows })
	e.ShadowSkipped = opt("shadow_skipped", func(x *sim.EventFigures) stats.Optional { return x.ShadowSkipped })
	e.ShadowRebinds = opt("shadow_rebinds", func(x *sim.EventFigures) stats.Optional { return x.ShadowRebinds })
	e.ShadowRedirects = opt("shadow_redirects", func(x *sim.EventFigures) stats.Optional { return x.ShadowRedirects })
	e.ShadowUsed = opt("shadow_used", func(x *sim.EventFigures) stats.Optional { return x.ShadowUsed })
	e.ShadowPrefillTokens = opt("shadow_prefill_tokens", func(x *sim.EventFigures) stats.Optional { return x.ShadowPrefillTokens })
	e.ShadowPrefillMs = opt("shadow_prefill_ms", func(x *sim.EventFigures) stats.Optional { return x.ShadowPrefillMs })
	e.ShadowPrefillShare = opt("shadow_prefill_share", func(x *sim.EventFigures) stats.Optional { return x.ShadowPrefillShare })
	for _, r := range reps {
		e.Workers = append(e.Workers, r.Worker)
	}
	if len(reps) > 1 {
		e.Reps = reps
	}
	if len(e.Have) == 0 {
		e.Have = nil
	}
	return e
}

// writeSessionsAndEvents adds, under the table, each policy's session
// cached fraction and each fleet event's dip (nothing without them).
func writeSessionsAndEvents(b *strings.Builder, results []Result) {
	for _, x := range results {
		for _, t := range x.Tenants {
			fmt.Fprintf(b, "%s: tenant %s: %d requests, TTFT p50/p90/p99 %.1f/%.1f/%.1f ms (in the routers' queue %.1f/%.1f/%.1f), %d tokens",
				x.Policy, t.Tenant, t.Requests, t.TTFT.P50, t.TTFT.P90.Value, t.TTFT.P99, t.Queue.P50, t.Queue.P90.Value, t.Queue.P99, t.Tokens)
			if t.BackloggedShare.Valid {
				fmt.Fprintf(b, ", share %.3f of the tokens while every tenant was backlogged (%.1f s)", t.BackloggedShare.Value, x.BackloggedSeconds)
			}
			if t.SLOAttainment.Valid {
				fmt.Fprintf(b, ", SLO met %.1f%%", 100*t.SLOAttainment.Value)
			}
			if t.SharedRPS.Valid {
				fmt.Fprintf(b, ", %.1f req/s and %.0f output tokens/s while every tenant was sending", t.SharedRPS.Value, t.SharedOutputTPS.Value)
			}
			b.WriteByte('\n')
		}
	}
	for _, x := range results {
		if x.SessionCachedFraction.Valid {
			fmt.Fprintf(b, "%s: session cached fraction %.3f\n", x.Policy, x.SessionCachedFraction.Value)
		}
		if p, u := x.PinnedSessions, x.UnpinnedSessions; p != nil && u != nil {
			fmt.Fprintf(b, "%s: later turns of pinned sessions: TTFT p50/p99 %.1f/%.1f ms, cached %.3f (%d turns); of the others: %.1f/%.1f ms, cached %.3f (%d turns)\n",
				x.Policy, p.TTFT.P50, p.TTFT.P99, p.CachedFraction, p.Turns, u.TTFT.P50, u.TTFT.P99, u.CachedFraction, u.Turns)
		}
	}
	for _, x := range results {
		for _, e := range x.FleetEvents {
			what := e.Kind
			if e.Chooser != "" {
				what += " (" + e.Chooser + ")"
			}
			fmt.Fprintf(b, "%s: %s at %.0fs, worker %s: steady %.3f cached, TTFT p50/p99 %.0f/%.0f ms; after %.3f, %.0f/%.0f ms; min window %.3f, max window p99 %.0f ms; lost %.0f cached tokens (%.1f%% of the run without it)",
				x.Policy, what, e.AtS, strings.Join(e.Workers, ","), e.Steady.CachedTokenRatio, e.Steady.TTFT.P50, e.Steady.TTFT.P99,
				e.After.CachedTokenRatio, e.After.TTFT.P50, e.After.TTFT.P99, e.MinCachedTokenRatio, e.MaxTTFTP99Ms,
				e.LostCachedTokens, 100*e.LostFraction)
			if e.RecoveredS.Valid {
				fmt.Fprintf(b, "; recovered in %.0fs", e.RecoveredS.Value)
			} else {
				b.WriteString("; not recovered")
			}
			for _, o := range []struct {
				format string
				v      stats.Optional
				scale  float64
			}{
				{"; its sessions kept %.1f%%", e.SessionsKept, 100},
				{"; left after %.1fs", e.LeftS, 1},
				{"; warm in %.0fs", e.WarmS, 1},
				{"; warm like with like in %.0fs", e.WarmComparableS, 1},
				{" (tested at each of its requests: %.1fs)", e.WarmComparableFineS, 1},
				{"; new worker's share %.1f%%", e.NewWorkerShare, 100},
				{"; warm-up steered %.0f", e.Steered, 1},
				{", ended after %.0fs", e.WarmUpEndS, 1},
				{"; shadow prefills %.0f", e.Shadows, 1},
				{" (skipped %.0f", e.ShadowSkipped, 1},
				{", sessions moved %.0f", e.ShadowRebinds, 1},
				{", requests sent to its copies %.0f", e.ShadowUsed, 1},
				{", requests sent to the holder instead %.0f)", e.ShadowRedirects, 1},
				{", computing %.0f prompt tokens", e.ShadowPrefillTokens, 1},
				{" (%.2f%% of the fleet's prefill", e.ShadowPrefillShare, 100},
				{", ≤ %.0f ms of steps)", e.ShadowPrefillMs, 1},
			} {
				if o.v.Valid {
					fmt.Fprintf(b, o.format, o.scale*o.v.Value)
				}
			}
			if e.WarmUpTTFTP99Ms > 0 {
				fmt.Fprintf(b, "; while it warmed: p99 %.0f ms (%.0f ms without the event)", e.WarmUpTTFTP99Ms, e.WarmUpBaseTTFTP99Ms)
			}
			if e.TTFTP99VsBase > 0 {
				fmt.Fprintf(b, "; against the run without it: p99 × %.2f, worst window p99 × %.2f (its own max window p99 %.0f ms)",
					e.TTFTP99VsBase, e.WorstWindowP99VsBase, e.BaseMaxTTFTP99Ms)
			}
			b.WriteByte('\n')
		}
	}
}
