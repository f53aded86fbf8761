package figures

import (
	"cmp"
	"fmt"
	"slices"
	"strings"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/stats"
)

// formatS002Seeds: seed 002's acceptance cell (24 prefixes, concurrency
// 16) seed by seed, from w<W>-s<seed>.json (one rep each), one row per
// worker count, most workers first. Per seed: kv-pooled's cached-token
// ratio ÷ that seed's own pooled-LRU reference; then their mean, lowest,
// the median of seeds 11–13 (what quality-seed002 checks), and the median
// over seeds of kv-pooled's p99 TTFT beside kv's.
func formatS002Seeds(out Output) (string, error) {
	reps, err := globSynth(out.Dir, "w*-s*.json")
	if err != nil {
		return "", err
	}
	slices.SortFunc(reps, func(a, b *SimReport) int {
		return cmp.Or(cmp.Compare(b.Config.Workers, a.Config.Workers), cmp.Compare(a.Config.Seed, b.Config.Seed))
	})
	var b strings.Builder
	b.WriteString("| kv-pooled now, seeds 11…22 | per seed | mean | lowest | median 11–13 | p99 TTFT (median) |\n")
	b.WriteString("|---|---|---:|---:|---:|---:|\n")
	for i := 0; i < len(reps); {
		w := reps[i].Config.Workers
		var per []string
		var ratios, first3, p99, p99kv []float64
		for ; i < len(reps) && reps[i].Config.Workers == w; i++ {
			r := reps[i]
			if r.Config.Reps != 1 {
				return "", fmt.Errorf("%s: %d reps, want one per seed", r.File, r.Config.Reps)
			}
			kp, err := r.Policy("kv-pooled")
			if err != nil {
				return "", err
			}
			kv, err := r.Policy("kv")
			if err != nil {
				return "", err
			}
			x := r.pooled(kp)
			per = append(per, f3(x))
			ratios = append(ratios, x)
			if r.Config.Seed >= 11 && r.Config.Seed <= 13 {
				first3 = append(first3, x)
			}
			p99 = append(p99, kp.TTFT.P99)
			p99kv = append(p99kv, kv.TTFT.P99)
		}
		if len(first3) != 3 {
			return "", fmt.Errorf("%d workers: %d of seeds 11–13 run, want all 3", w, len(first3))
		}
		// The 50th percentile by linear interpolation is the median: the
		// mean of the middle two for an even count.
		row(&b, fmt.Sprintf("%d workers", w), strings.Join(per, " "), "**"+f3(stats.Mean(ratios))+"**", "**"+f3(slices.Min(ratios))+"**",
			"**"+f3(stats.Percentile(first3, 50))+"**",
			fmt.Sprintf("%s ms (kv %s)", f0(stats.Percentile(p99, 50)), f0(stats.Percentile(p99kv, 50))))
	}
	return b.String(), nil
}
