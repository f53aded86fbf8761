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
	res := Result{
		Policy:           policy,
		Requests:         int(med(func(s sim.Summary) float64 { return float64(s.Requests) })),
		RequestHitRate:   med(func(s sim.Summary) float64 { return s.RequestHitRate }),
		CachedTokenRatio: med(func(s sim.Summary) float64 { return s.CachedTokenRatio }),
		TTFT: stats.Quantiles{
			P50: med(func(s sim.Summary) float64 { return s.TTFT.P50 }),
			P99: med(func(s sim.Summary) float64 { return s.TTFT.P99 }),
		},
		E2E: stats.Quantiles{
			P50: med(func(s sim.Summary) float64 { return s.E2E.P50 }),
			P99: med(func(s sim.Summary) float64 { return s.E2E.P99 }),
		},
		ThroughputRPS:    med(func(s sim.Summary) float64 { return s.ThroughputRPS }),
		Errors:           int(med(func(s sim.Summary) float64 { return float64(s.Errors) }) + 0.5),
		Completed:        int(med(func(s sim.Summary) float64 { return float64(s.Completed) }) + 0.5),
		Preemptions:      med(func(s sim.Summary) float64 { return s.Preemptions }),
		IndexErrors:      med(func(s sim.Summary) float64 { return s.IndexErrors }),
		WorkersPerPrefix: med(func(s sim.Summary) float64 { return s.WorkersPerPrefix }),
		VirtualSeconds:   med(func(s sim.Summary) float64 { return s.VirtualSeconds }),
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
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\trequests\thit rate\tcached ratio\tTTFT p50 ms\tTTFT p99 ms\tE2E p50 ms\tE2E p99 ms\treq/s\terrors\t")
	for _, x := range r.Results {
		fmt.Fprintf(tw, "%s\t%d\t%.1f%%\t%.3f\t%.1f\t%.1f\t%.1f\t%.1f\t%.2f\t%d\t\n",
			x.Policy, x.Requests, 100*x.RequestHitRate, x.CachedTokenRatio,
			x.TTFT.P50, x.TTFT.P99, x.E2E.P50, x.E2E.P99, x.ThroughputRPS, x.Errors)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := io.WriteString(w, b.String())
	return err
}
