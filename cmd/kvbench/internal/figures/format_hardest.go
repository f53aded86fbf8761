package figures

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/report"
)

// hardestCell is one cell of the hardest-cases table: cached ratio ÷
// pooled-LRU · request hit rate · TTFT p99 · req/s.
func hardestCell(r *SimReport, x report.Result) string {
	return fmt.Sprintf("%s · %.0f %% · %s ms · %s", f2(r.pooled(x)), 100*x.RequestHitRate, f0(x.TTFT.P99), f2(x.ThroughputRPS))
}

// betterKV is the "best kv" rule of the hardest-cases and beyond-seed-002
// tables: x caches more than than, or as much at a lower p99 TTFT (a tie
// on both keeps the earlier run).
func betterKV(x, than report.Result) bool {
	return x.CachedTokenRatio > than.CachedTokenRatio ||
		x.CachedTokenRatio == than.CachedTokenRatio && x.TTFT.P99 < than.TTFT.P99
}

// knob is one setting of Dynamo's kv knobs in a sweep run's config.
type knob struct {
	run                   *SimReport
	kv                    report.Result
	scale, credit, temper float64
}

// formatS002Hardest: seed 002's 24-prefix cells against Dynamo's kv and its
// best knob setting, from h<W>-c<C>.json (round-robin, kv, kv-pooled) and
// k<W>-c<C>-s<scale>-cr<credit>-t<temperature>.json (kv with one setting
// of --prefill-load-scale, --overlap-credit and --temperature each). "best
// kv" is the setting with the highest cached-token ratio, first among
// those whose p99 TTFT is at most 1.1 × default kv's, then without that
// limit. Of settings with the same ratio the one with the lower p99 wins,
// then the first in the sweep's loop order (scale, credit, temperature
// ascending).
func formatS002Hardest(out Output) (string, error) {
	cells, err := globSynth(out.Dir, "h*-c*.json")
	if err != nil {
		return "", err
	}
	sweep, err := globSynth(out.Dir, "k*-c*-s*-cr*-t*.json")
	if err != nil {
		return "", err
	}
	type cellKey struct{ w, c int }
	knobs := map[cellKey][]knob{}
	for _, r := range sweep {
		c := r.Config
		if c.PrefillLoadScale == nil || c.OverlapCredit == nil || c.Temperature == nil {
			return "", fmt.Errorf("%s: a sweep run without --prefill-load-scale, --overlap-credit and --temperature", r.File)
		}
		if !slices.Equal(c.Policies, []string{"kv"}) {
			return "", fmt.Errorf("%s: a sweep run of %v, not kv alone", r.File, c.Policies)
		}
		kv, err := r.Policy("kv")
		if err != nil {
			return "", err
		}
		k := cellKey{c.Workers, c.Synthetic.Concurrency}
		knobs[k] = append(knobs[k], knob{r, kv, *c.PrefillLoadScale, *c.OverlapCredit, *c.Temperature})
	}
	sortGrid(cells)
	var b strings.Builder
	b.WriteString("| workers | conc. | pooled-LRU | one engine | round-robin | kv (Dynamo defaults) | best kv, p99 ≤ 1.1 × kv | best kv, any p99 | **kv-pooled** |\n")
	b.WriteString("|---:|---:|---:|---:|---|---|---|---|---|\n")
	for _, r := range cells {
		var xs [3]report.Result
		for i, p := range []string{"round-robin", "kv", "kv-pooled"} {
			if xs[i], err = r.Policy(p); err != nil {
				return "", err
			}
		}
		w, c := r.Config.Workers, r.Config.Synthetic.Concurrency
		ks := knobs[cellKey{w, c}]
		if len(ks) == 0 {
			return "", fmt.Errorf("no kv sweep run of %d workers at concurrency %d", w, c)
		}
		slices.SortFunc(ks, func(a, b knob) int {
			return cmp.Or(cmp.Compare(a.scale, b.scale), cmp.Compare(a.credit, b.credit), cmp.Compare(a.temper, b.temper))
		})
		best := func(limit float64) (string, error) {
			var top *knob
			for i := range ks {
				if ks[i].kv.TTFT.P99 > limit {
					continue
				}
				if top == nil || betterKV(ks[i].kv, top.kv) {
					top = &ks[i]
				}
			}
			if top == nil {
				return "", fmt.Errorf("no kv setting of %d workers at concurrency %d has p99 TTFT ≤ %.1f ms", w, c, limit)
			}
			return fmt.Sprintf("%s (s%g c%g t%g)", hardestCell(top.run, top.kv), top.scale, top.credit, top.temper), nil
		}
		limited, err := best(1.1 * xs[1].TTFT.P99)
		if err != nil {
			return "", err
		}
		anyP99, err := best(math.Inf(1))
		if err != nil {
			return "", err
		}
		ref := r.Reference
		row(&b, fmt.Sprint(w), fmt.Sprint(c), f3(ref.PooledLRUCachedTokenRatio), f3(ref.EnginePooledCachedTokenRatio),
			hardestCell(r, xs[0]), hardestCell(r, xs[1]), limited, anyP99, "**"+hardestCell(r, xs[2])+"**")
	}
	return b.String(), nil
}
