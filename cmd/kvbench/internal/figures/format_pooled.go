package figures

import (
	"cmp"
	"fmt"
	"slices"
	"strings"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/report"
)

// sortGrid orders synthetic runs (globSynth's) as the tables list them:
// workers descending, then concurrency, then prefixes.
func sortGrid(reps []*SimReport) {
	slices.SortFunc(reps, func(a, b *SimReport) int {
		sa, sb := a.Config.Synthetic, b.Config.Synthetic
		return cmp.Or(cmp.Compare(b.Config.Workers, a.Config.Workers), cmp.Compare(sa.Concurrency, sb.Concurrency),
			cmp.Compare(sa.Prefixes, sb.Prefixes))
	})
}

// formatPooledGrid: the seed-002 grid, round-robin, kv and kv-pooled, from
// p<W>-c<C>-k<K>.json. Cell: hit rate · ÷ pooled-LRU · TTFT p99 · req/s.
func formatPooledGrid(out Output) (string, error) {
	reps, err := globSynth(out.Dir, "p*-c*-k*.json")
	if err != nil {
		return "", err
	}
	sortGrid(reps)
	var b strings.Builder
	b.WriteString("| workers | conc. | prefixes | round-robin | kv | **kv-pooled** |\n")
	b.WriteString("|---:|---:|---:|---|---|---|\n")
	for _, r := range reps {
		s := r.Config.Synthetic
		cells := []string{fmt.Sprint(r.Config.Workers), fmt.Sprint(s.Concurrency), fmt.Sprint(s.Prefixes)}
		for _, p := range []string{"round-robin", "kv", "kv-pooled"} {
			x, err := r.Policy(p)
			if err != nil {
				return "", err
			}
			c := fmt.Sprintf("%.1f %% · %s · %s · %s", 100*x.RequestHitRate, f2(r.pooled(x)), f0(x.TTFT.P99), f2(x.ThroughputRPS))
			if p == "kv-pooled" {
				c = "**" + c + "**"
			}
			cells = append(cells, c)
		}
		row(&b, cells...)
	}
	return b.String(), nil
}

// lagLabel prints a sync lag as the tables do: 0, 10 ms, 1 s.
func lagLabel(ms float64) string {
	switch {
	case ms == 0:
		return "0"
	case ms >= 1000:
		return fmt.Sprintf("%g s", ms/1000)
	}
	return fmt.Sprintf("%g ms", ms)
}

// formatRouters returns the formatter of a routers × sync-lag table from
// the files matching pattern. Rows of one router are folded into one
// ("any" + anySuffix) when every lag gives the same cells, as it must: a
// single router has no one to sync with. indent prefixes every line (a
// table inside a list item); boldPooled bolds kv-pooled's ÷ pooled figure.
func formatRouters(pattern, anySuffix, indent string, boldPooled bool) func(Output) (string, error) {
	return func(out Output) (string, error) {
		reps, err := globSim(out.Dir, pattern)
		if err != nil {
			return "", err
		}
		slices.SortFunc(reps, func(a, b *SimReport) int {
			return cmp.Or(cmp.Compare(a.Config.Routers, b.Config.Routers), cmp.Compare(a.Config.SyncDelayMs, b.Config.SyncDelayMs))
		})
		cells := func(r *SimReport) ([]string, error) {
			var cs []string
			for _, p := range []string{"round-robin", "kv", "kv-pooled"} {
				x, err := r.Policy(p)
				if err != nil {
					return nil, err
				}
				ratio := f2(r.pooled(x))
				if p == "kv-pooled" && boldPooled {
					ratio = "**" + ratio + "**"
				}
				cs = append(cs, strings.Join([]string{pct(x.RequestHitRate), f3(x.CachedTokenRatio), ratio, f0(x.TTFT.P99)}, " · "))
			}
			return cs, nil
		}
		var b strings.Builder
		b.WriteString(indent + "| routers | sync lag | round-robin | kv | kv-pooled |\n")
		b.WriteString(indent + "|---:|---:|---|---|---|\n")
		for i := 0; i < len(reps); {
			j := i + 1
			first, err := cells(reps[i])
			if err != nil {
				return "", err
			}
			if reps[i].Config.Routers == 1 {
				for j < len(reps) && reps[j].Config.Routers == 1 {
					c, err := cells(reps[j])
					if err != nil {
						return "", err
					}
					if !slices.Equal(c, first) {
						break
					}
					j++
				}
			}
			lag := lagLabel(reps[i].Config.SyncDelayMs)
			if j > i+1 {
				lag = "any" + anySuffix
			}
			b.WriteString(indent)
			row(&b, append([]string{fmt.Sprint(reps[i].Config.Routers), lag}, first...)...)
			i = j
		}
		return b.String(), nil
	}
}

// formatApproxColumn: seed 002 §8's approximate-mode column beside ours at
// two run lengths, from a<requests>-<prefixes>.json.
func formatApproxColumn(out Output) (string, error) {
	reps, err := globSynth(out.Dir, "a*-*.json")
	if err != nil {
		return "", err
	}
	seed := map[int]string{7: "0.439 / 0.702 / **0.638**", 12: "0.247 / 0.573 / **0.480**", 24: "0.149 / 0.361 / **0.245**"}
	byCell := map[[2]int]*SimReport{}
	var ks, ns []int
	for _, r := range reps {
		k, n := r.Config.Synthetic.Prefixes, r.Config.Requests
		byCell[[2]int{n, k}] = r
		if !slices.Contains(ks, k) {
			ks = append(ks, k)
		}
		if !slices.Contains(ns, n) {
			ns = append(ns, n)
		}
	}
	slices.Sort(ks)
	slices.Sort(ns)
	slices.Reverse(ns)
	var b strings.Builder
	b.WriteString("| prefixes | seed 002: round-robin / kv / **approximate** |")
	for i, n := range ns {
		if i == 0 {
			fmt.Fprintf(&b, " ours, %s requests: round-robin / kv / **kv-approx** |", thousands(n))
		} else {
			fmt.Fprintf(&b, " ours, %s requests |", thousands(n))
		}
	}
	b.WriteString("\n|---:|---|" + strings.Repeat("---|", len(ns)) + "\n")
	for _, k := range ks {
		cells := []string{fmt.Sprint(k), cmp.Or(seed[k], "–")}
		for _, n := range ns {
			r, ok := byCell[[2]int{n, k}]
			if !ok {
				return "", fmt.Errorf("no run of %d requests with %d prefixes", n, k)
			}
			var xs [3]report.Result
			for i, p := range []string{"round-robin", "kv", "kv-approx"} {
				if xs[i], err = r.Policy(p); err != nil {
					return "", err
				}
			}
			cells = append(cells, fmt.Sprintf("%s / %s / **%s**", f3(xs[0].CachedTokenRatio), f3(xs[1].CachedTokenRatio), f3(xs[2].CachedTokenRatio)))
		}
		row(&b, cells...)
	}
	return b.String(), nil
}

// thousands prints n with a comma every three digits (1,200).
func thousands(n int) string {
	s := fmt.Sprint(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}
