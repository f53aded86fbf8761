// Package report turns simulation summaries into kvbench's JSON report
// (docs/CONTRACTS.md), a console table and a PNG chart.
package report

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/sim"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/stats"
)

// Report is the JSON document. Field names and nesting are a contract.
type Report struct {
	Config    any       `json:"config"`
	Reference Reference `json:"reference"`
	Results   []Result  `json:"results"`
}

// Reference holds the policy-independent cache figures.
type Reference struct {
	PooledLRUCachedTokenRatio float64 `json:"pooled_lru_cached_token_ratio"`
	IdealCachedTokenRatio     float64 `json:"ideal_cached_token_ratio"`
	// EnginePooledCachedTokenRatio: one engine of the fleet's total
	// capacity running the same requests at the same concurrency (sim
	// only; absent when not computed). PooledLRU keeps its meaning.
	EnginePooledCachedTokenRatio float64 `json:"engine_pooled_cached_token_ratio,omitempty"`
}

// Result is one policy's figures (medians over reps).
type Result struct {
	Policy           string          `json:"policy"`
	Requests         int             `json:"requests"`
	RequestHitRate   float64         `json:"request_hit_rate"`
	CachedTokenRatio float64         `json:"cached_token_ratio"`
	TTFT             stats.Quantiles `json:"ttft_ms"`
	E2E              stats.Quantiles `json:"e2e_ms"`
	ThroughputRPS    float64         `json:"throughput_rps"`
	Errors           int             `json:"errors"`

	// What users feel (issue 27): time per output token after the first,
	// the share of all requests within the SLO (--slo-ttft-ms,
	// --slo-tpot-ms; absent without one) and output tokens per second.
	TPOT             stats.Quantiles `json:"tpot_ms"`
	SLOAttainment    stats.Optional  `json:"slo_attainment,omitzero"`
	OutputTokensPerS float64         `json:"output_tokens_per_s"`

	// Extras (not in the contract).
	Completed        int     `json:"completed"`
	ErrorsAllReps    int     `json:"errors_all_reps"`
	Preemptions      float64 `json:"preemptions"`
	IndexErrors      float64 `json:"index_apply_errors"`
	WorkersPerPrefix float64 `json:"workers_per_prefix,omitempty"`
	VirtualSeconds   float64 `json:"virtual_seconds"`
	WallSeconds      float64 `json:"wall_seconds"` // summed over reps
	// Reps are the per-rep figures the medians come from.
	Reps []RepFigures `json:"reps,omitempty"`

	// Sessions and fleet changes (issues 28 and 29): the mean over
	// sessions of each session's cached fraction (median over reps;
	// absent without sessions), and each fleet event's dip (means over
	// reps, each rep's figures in its reps).
	SessionCachedFraction stats.Optional `json:"session_cached_fraction,omitzero"`
	FleetEvents           []EventResult  `json:"fleet_events,omitempty"`
	// Prefix pins (issue 28 item 2, --pin-every): the later turns of the
	// pinned session trees and of the others (medians over reps; absent
	// without pins).
	PinnedSessions   *sim.SessionTurns `json:"pinned_sessions,omitempty"`
	UnpinnedSessions *sim.SessionTurns `json:"unpinned_sessions,omitempty"`

	// Tenants (issue 28, --tenants): each tenant's figures, medians over
	// reps, and the time every tenant had a request queued (its median).
	Tenants           []sim.TenantFigures `json:"tenants,omitempty"`
	BackloggedSeconds float64             `json:"backlogged_s,omitempty"`
}

// EventResult is one fleet event over the reps: the mean of each figure
// (an optional figure only over the reps that have it, Have of them), the
// workers the reps took, and every rep's own figures.
type EventResult struct {
	sim.EventFigures
	Workers []string           `json:"workers"`
	Have    map[string]int     `json:"reps_with,omitempty"`
	Reps    []sim.EventFigures `json:"reps,omitempty"`
}

// RepFigures are one rep's headline figures.
type RepFigures struct {
	Seed             uint64          `json:"seed"`
	RequestHitRate   float64         `json:"request_hit_rate"`
	CachedTokenRatio float64         `json:"cached_token_ratio"`
	TTFT             stats.Quantiles `json:"ttft_ms"`
	ThroughputRPS    float64         `json:"throughput_rps"`
	Errors           int             `json:"errors"`
}

// Run is one policy's run in one rep.
type Run struct {
	Seed        uint64
	Summary     sim.Summary
	WallSeconds float64
}

// Median folds a policy's reps into one Result: every figure is the median
// over reps (the mean of the middle two for an even count).
func Median(policy string, runs []Run) Result {
	med := func(f func(s sim.Summary) float64) float64 {
		xs := make([]float64, len(runs))
		for i, r := range runs {
			xs[i] = f(r.Summary)
		}
		return median(xs)
	}
	// medQ is the median of each percentile; p90 only where every rep has one.
	medQ := func(f func(s sim.Summary) stats.Quantiles) stats.Quantiles {
		q := stats.Quantiles{
			P50: med(func(s sim.Summary) float64 { return f(s).P50 }),
			P99: med(func(s sim.Summary) float64 { return f(s).P99 }),
		}
		if optionalInAll(runs, func(s sim.Summary) stats.Optional { return f(s).P90 }) {
			q.P90 = stats.Optional{Value: med(func(s sim.Summary) float64 { return f(s).P90.Value }), Valid: true}
		}
		return q
	}
	res := Result{
		Policy:           policy,
		Requests:         int(med(func(s sim.Summary) float64 { return float64(s.Requests) })),
		RequestHitRate:   med(func(s sim.Summary) float64 { return s.RequestHitRate }),
		CachedTokenRatio: med(func(s sim.Summary) float64 { return s.CachedTokenRatio }),
		TTFT:             medQ(func(s sim.Summary) stats.Quantiles { return s.TTFT }),
		TPOT:             medQ(func(s sim.Summary) stats.Quantiles { return s.TPOT }),
		E2E: stats.Quantiles{
			P50: med(func(s sim.Summary) float64 { return s.E2E.P50 }),
			P99: med(func(s sim.Summary) float64 { return s.E2E.P99 }),
		},
		ThroughputRPS:    med(func(s sim.Summary) float64 { return s.ThroughputRPS }),
		OutputTokensPerS: med(func(s sim.Summary) float64 { return s.OutputTokensPerS }),
		Errors:           int(med(func(s sim.Summary) float64 { return float64(s.Errors) }) + 0.5),
		Completed:        int(med(func(s sim.Summary) float64 { return float64(s.Completed) }) + 0.5),
		Preemptions:      med(func(s sim.Summary) float64 { return s.Preemptions }),
		IndexErrors:      med(func(s sim.Summary) float64 { return s.IndexErrors }),
		WorkersPerPrefix: med(func(s sim.Summary) float64 { return s.WorkersPerPrefix }),
		VirtualSeconds:   med(func(s sim.Summary) float64 { return s.VirtualSeconds }),
	}
	if optionalInAll(runs, func(s sim.Summary) stats.Optional { return s.SessionCachedFraction }) {
		res.SessionCachedFraction = stats.Optional{Value: med(func(s sim.Summary) float64 { return s.SessionCachedFraction.Value }), Valid: true}
	}
	res.FleetEvents = MeanEvents(runs)
	res.PinnedSessions = medianTurns(runs, func(s sim.Summary) *sim.SessionTurns { return s.PinnedSessions })
	res.UnpinnedSessions = medianTurns(runs, func(s sim.Summary) *sim.SessionTurns { return s.UnpinnedSessions })
	res.Tenants = medianTenants(runs, med)
	if res.Tenants != nil {
		res.BackloggedSeconds = med(func(s sim.Summary) float64 { return s.BackloggedSeconds })
	}
	if optionalInAll(runs, func(s sim.Summary) stats.Optional { return s.SLOAttainment }) {
		res.SLOAttainment = stats.Optional{Value: med(func(s sim.Summary) float64 { return s.SLOAttainment.Value }), Valid: true}
	}
	for _, r := range runs {
		res.ErrorsAllReps += r.Summary.Errors
		res.WallSeconds += r.WallSeconds
		if len(runs) > 1 {
			res.Reps = append(res.Reps, RepFigures{
				Seed: r.Seed, RequestHitRate: r.Summary.RequestHitRate, CachedTokenRatio: r.Summary.CachedTokenRatio,
				TTFT: r.Summary.TTFT, ThroughputRPS: r.Summary.ThroughputRPS, Errors: r.Summary.Errors,
			})
		}
	}
	return res
}

// medianTenants folds each tenant's figures over the reps (every rep has
// the same tenants: one flag gives them).
func medianTenants(runs []Run, med func(f func(s sim.Summary) float64) float64) []sim.TenantFigures {
	if len(runs) == 0 || runs[0].Summary.Tenants == nil {
		return nil
	}
	out := make([]sim.TenantFigures, len(runs[0].Summary.Tenants))
	for t := range out {
		at := func(f func(x sim.TenantFigures) float64) float64 {
			return med(func(s sim.Summary) float64 { return f(s.Tenants[t]) })
		}
		opt := func(f func(x sim.TenantFigures) stats.Optional) stats.Optional {
			if !optionalInAll(runs, func(s sim.Summary) stats.Optional { return f(s.Tenants[t]) }) {
				return stats.Optional{}
			}
			return stats.Optional{Value: at(func(x sim.TenantFigures) float64 { return f(x).Value }), Valid: true}
		}
		out[t] = sim.TenantFigures{
			Tenant:   runs[0].Summary.Tenants[t].Tenant,
			Requests: int(at(func(x sim.TenantFigures) float64 { return float64(x.Requests) }) + 0.5),
			TTFT: stats.Quantiles{
				P50: at(func(x sim.TenantFigures) float64 { return x.TTFT.P50 }),
				P90: opt(func(x sim.TenantFigures) stats.Optional { return x.TTFT.P90 }),
				P99: at(func(x sim.TenantFigures) float64 { return x.TTFT.P99 }),
			},
			TTFTAfterStart: stats.Quantiles{
				P50: at(func(x sim.TenantFigures) float64 { return x.TTFTAfterStart.P50 }),
				P90: opt(func(x sim.TenantFigures) stats.Optional { return x.TTFTAfterStart.P90 }),
				P99: at(func(x sim.TenantFigures) float64 { return x.TTFTAfterStart.P99 }),
			},
			Queue: stats.Quantiles{
				P50: at(func(x sim.TenantFigures) float64 { return x.Queue.P50 }),
				P90: opt(func(x sim.TenantFigures) stats.Optional { return x.Queue.P90 }),
				P99: at(func(x sim.TenantFigures) float64 { return x.Queue.P99 }),
			},
			SLOAttainment:   opt(func(x sim.TenantFigures) stats.Optional { return x.SLOAttainment }),
			Tokens:          int64(at(func(x sim.TenantFigures) float64 { return float64(x.Tokens) }) + 0.5),
			BackloggedShare: opt(func(x sim.TenantFigures) stats.Optional { return x.BackloggedShare }),
			SharedRPS:       opt(func(x sim.TenantFigures) stats.Optional { return x.SharedRPS }),
			SharedOutputTPS: opt(func(x sim.TenantFigures) stats.Optional { return x.SharedOutputTPS }),
		}
	}
	return out
}

// optionalInAll reports whether every run has the figure f reads.
func optionalInAll(runs []Run, f func(s sim.Summary) stats.Optional) bool {
	for _, r := range runs {
		if !f(r.Summary).Valid {
			return false
		}
	}
	return len(runs) > 0
}

// MedianReference folds per-rep references.
func MedianReference(refs []sim.Reference) Reference {
	p := make([]float64, len(refs))
	q := make([]float64, len(refs))
	e := make([]float64, len(refs))
	for i, r := range refs {
		p[i], q[i], e[i] = r.PooledLRU, r.Ideal, r.OneEngine
	}
	return Reference{PooledLRUCachedTokenRatio: median(p), IdealCachedTokenRatio: median(q), EnginePooledCachedTokenRatio: median(e)}
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	xs = slices.Clone(xs)
	slices.Sort(xs)
	n := len(xs)
	if n%2 == 1 {
		return xs[n/2]
	}
	return (xs[n/2-1] + xs[n/2]) / 2
}

// WriteTable prints r for a terminal: a header naming the workload and the
// reference, then one row per policy.
func WriteTable(w io.Writer, header string, r *Report) error {
	var b strings.Builder
	if header != "" {
		b.WriteString(header)
		b.WriteByte('\n')
	}
	if e := r.Reference.EnginePooledCachedTokenRatio; e > 0 {
		fmt.Fprintf(&b, "reference: pooled-LRU cached-token ratio %.3f, one engine of the fleet's capacity %.3f, ideal %.3f\n",
			r.Reference.PooledLRUCachedTokenRatio, e, r.Reference.IdealCachedTokenRatio)
	} else {
		fmt.Fprintf(&b, "reference: pooled-LRU cached-token ratio %.3f, ideal %.3f\n",
			r.Reference.PooledLRUCachedTokenRatio, r.Reference.IdealCachedTokenRatio)
	}
	slo := false
	for _, x := range r.Results {
		slo = slo || x.SLOAttainment.Valid
	}
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
	head := "policy\trequests\thit rate\tcached ratio\tTTFT p50 ms\tTTFT p99 ms\tE2E p50 ms\tE2E p99 ms\treq/s\terrors\t"
	if slo {
		head += "TPOT p50 ms\tTPOT p99 ms\tSLO met\t"
	}
	fmt.Fprintln(tw, head)
	for _, x := range r.Results {
		fmt.Fprintf(tw, "%s\t%d\t%.1f%%\t%.3f\t%.1f\t%.1f\t%.1f\t%.1f\t%.2f\t%d\t",
			x.Policy, x.Requests, 100*x.RequestHitRate, x.CachedTokenRatio,
			x.TTFT.P50, x.TTFT.P99, x.E2E.P50, x.E2E.P99, x.ThroughputRPS, x.Errors)
		if slo {
			fmt.Fprintf(tw, "%.1f\t%.1f\t%.1f%%\t", x.TPOT.P50, x.TPOT.P99, 100*x.SLOAttainment.Value)
		}
		fmt.Fprintln(tw)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	writeSessionsAndEvents(&b, r.Results)
	if note := PolicyNote(r.Results); note != "" {
		b.WriteString(note)
		b.WriteByte('\n')
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// PolicyNote names what the kv-family rows are, so that no table passes our
// reproduction of Dynamo off as Dynamo: "" when no such policy is listed.
func PolicyNote(results []Result) string {
	var notes []string
	for _, x := range results {
		switch x.Policy {
		case "kv":
			notes = append(notes, "kv: Dynamo's cost function with Dynamo's defaults, this implementation (not Dynamo's code)")
		case "kv-approx":
			notes = append(notes, "kv-approx: Dynamo's approximate mode, this implementation")
		case "gaie":
			notes = append(notes, "gaie: the Gateway API Inference Extension v1.3.0 scheduler's own code, default profile")
		}
	}
	return strings.Join(notes, "; ")
}

// medianTurns is the median over the runs of each figure of a group of
// session turns; nil unless every run has the group.
func medianTurns(runs []Run, of func(sim.Summary) *sim.SessionTurns) *sim.SessionTurns {
	var groups []*sim.SessionTurns
	for _, r := range runs {
		g := of(r.Summary)
		if g == nil {
			return nil
		}
		groups = append(groups, g)
	}
	if len(groups) == 0 {
		return nil
	}
	med := func(f func(*sim.SessionTurns) float64) float64 {
		xs := make([]float64, len(groups))
		for i, g := range groups {
			xs[i] = f(g)
		}
		return median(xs)
	}
	return &sim.SessionTurns{
		Turns: int(med(func(g *sim.SessionTurns) float64 { return float64(g.Turns) }) + 0.5),
		TTFT: stats.Quantiles{P50: med(func(g *sim.SessionTurns) float64 { return g.TTFT.P50 }),
			P90: stats.Optional{Value: med(func(g *sim.SessionTurns) float64 { return g.TTFT.P90.Value }), Valid: true},
			P99: med(func(g *sim.SessionTurns) float64 { return g.TTFT.P99 })},
		CachedFraction: med(func(g *sim.SessionTurns) float64 { return g.CachedFraction }),
	}
}
