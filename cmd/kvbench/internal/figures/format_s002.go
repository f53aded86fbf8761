package figures

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
)

// Seed 002's round-robin hit rates as measured on Dynamo (seed 002 §2), by
// number of prefixes.
var seed002RoundRobin = map[int]float64{2: 0.950, 7: 0.535, 12: 0.292, 24: 0.175}

// formatS002Calibration: round-robin against seed 002's measurement, one
// row per s002-<prefixes>.json.
func formatS002Calibration(out Output) (string, error) {
	reps, err := globSynth(out.Dir, "s002-*.json")
	if err != nil {
		return "", err
	}
	slices.SortFunc(reps, func(a, b *SimReport) int {
		return cmp.Compare(a.Config.Synthetic.Prefixes, b.Config.Synthetic.Prefixes)
	})
	var b strings.Builder
	b.WriteString("| prefixes | simulated hit rate (median) | per rep | Dynamo measured (round-robin) | difference (points) | simulated cached ratio |\n")
	b.WriteString("|---:|---:|---|---:|---:|---:|\n")
	for _, r := range reps {
		x, err := r.Policy("round-robin")
		if err != nil {
			return "", err
		}
		k := r.Config.Synthetic.Prefixes
		var per []string
		for _, p := range x.Reps {
			per = append(per, f1(100*p.RequestHitRate))
		}
		measured, diff := "–", "–"
		if m, ok := seed002RoundRobin[k]; ok {
			measured, diff = pct(m), fmt.Sprintf("%+.1f", 100*(x.RequestHitRate-m))
		}
		row(&b, fmt.Sprint(k), pct(x.RequestHitRate), strings.Join(per, " / "), measured, diff, f3(x.CachedTokenRatio))
	}
	return b.String(), nil
}

// formatS001Calibration: repeat hits of seed 001's 72 requests (the 12
// first sends are compulsory misses), one row per s001-*.json.
func formatS001Calibration(out Output) (string, error) {
	reps, err := globSynth(out.Dir, "s001-*.json")
	if err != nil {
		return "", err
	}
	slices.SortFunc(reps, func(a, b *SimReport) int { return cmp.Compare(a.Config.Reps, b.Config.Reps) })
	var b strings.Builder
	b.WriteString("| setting | round-robin hits of 60 (per rep) | kv | kv-approx | Dynamo measured |\n")
	b.WriteString("|---|---|---|---|---|\n")
	for _, r := range reps {
		s := r.Config.Synthetic
		label := fmt.Sprintf("uniform draws, %d reps", r.Config.Reps)
		if s.PrefixOrder == "shuffled" {
			label = fmt.Sprintf("shuffled ×%d, %s, %d reps", r.Config.Requests/s.Prefixes, r.Config.Profile, r.Config.Reps)
		}
		cells := []string{label}
		for _, p := range []string{"round-robin", "kv", "kv-approx"} {
			x, err := r.Policy(p)
			if err != nil {
				return "", err
			}
			hits := func(rate float64) string { return f0(rate * float64(r.Config.Requests)) }
			var per []string
			for _, q := range x.Reps {
				per = append(per, hits(q.RequestHitRate))
			}
			cells = append(cells, fmt.Sprintf("%s (%s)", hits(x.RequestHitRate), strings.Join(per, ", ")))
		}
		cells = append(cells, "round-robin 35–43, kv 53–60")
		row(&b, cells...)
	}
	return b.String(), nil
}

// seed002Grid is what seed 002 measured on Dynamo v1.6.2 for a grid cell
// and policy ("w<workers>-c<concurrency>-k<prefixes>/<policy>"): hit ·
// cached ratio · TTFT p50/p99 ms · req/s, "–" where it published nothing.
var seed002Grid = map[string]string{
	"w6-c4-k2/round-robin":   "– · 0.814 · 41/125 · –",
	"w6-c4-k2/kv":            "– · 0.857 · 34/73 · –",
	"w6-c4-k7/round-robin":   "– · 0.385 · 89/142 · –",
	"w6-c4-k7/kv":            "93.0% · 0.788 · 40/129 · –",
	"w6-c4-k12/round-robin":  "– · 0.262 · 106/140 · –",
	"w6-c4-k12/kv":           "80.0% · 0.664 · 43/138 · –",
	"w6-c4-k24/round-robin":  "– · 0.126 · 113/143 · –",
	"w6-c4-k24/kv":           "52.0% · 0.429 · 64/149 · –",
	"w6-c8-k2/round-robin":   "95.0% · 0.814 · – · –",
	"w6-c8-k2/kv":            "97.5% · 0.835 · – · –",
	"w6-c8-k7/round-robin":   "53.5% · 0.439 · – · –",
	"w6-c8-k7/kv":            "83.0% · 0.702 · – · –",
	"w6-c8-k12/round-robin":  "29.2% · 0.247 · – · –",
	"w6-c8-k12/kv":           "67.9% · 0.573 · – · –",
	"w6-c8-k24/round-robin":  "17.5% · 0.149 · – · –",
	"w6-c8-k24/kv":           "43.3% · 0.361 · – · –",
	"w6-c16-k2/round-robin":  "– · 0.814 · 74/332 · 19.1",
	"w6-c16-k2/kv":           "– · 0.835 · 67/206 · 21.1",
	"w6-c16-k7/round-robin":  "– · 0.442 · 111/576 · 16.0",
	"w6-c16-k7/kv":           "91.0% · 0.779 · 72/240 · 20.1",
	"w6-c16-k12/round-robin": "– · 0.237 · 190/646 · 14.7",
	"w6-c16-k12/kv":          "82.0% · 0.695 · 77/193 · 19.2",
	"w6-c16-k24/round-robin": "– · 0.148 · 199/774 · 14.3",
	"w6-c16-k24/kv":          "52.0% · 0.431 · 109/242 · 17.6",
	"w3-c4-k7/kv":            "77.0% · – · – · –",
	"w3-c4-k12/kv":           "53.0% · – · – · –",
	"w3-c4-k24/kv":           "29.0% · – · – · –",
	"w3-c8-k2/round-robin":   "– · 0.840 · –/171 · 17.3",
	"w3-c8-k2/kv":            "– · 0.848 · –/83 · 20.6",
	"w3-c8-k7/round-robin":   "– · 0.475 · –/413 · 13.6",
	"w3-c8-k7/kv":            "82.0% · 0.690 · –/145 · 18.5",
	"w3-c8-k12/round-robin":  "– · 0.291 · –/679 · 12.5",
	"w3-c8-k12/kv":           "58.0% · 0.474 · –/152 · 17.2",
	"w3-c8-k24/round-robin":  "– · 0.141 · –/830 · 11.8",
	"w3-c8-k24/kv":           "30.0% · 0.252 · –/202 · 16.6",
	"w3-c16-k7/kv":           "90.0% · – · – · –",
	"w3-c16-k12/kv":          "64.0% · – · – · –",
	"w3-c16-k24/kv":          "28.0% · – · 279/962 · –",
}

// formatS002Grid: the whole seed-002 grid, one table per workers ×
// concurrency, from w<W>-c<C>-k<K>.json.
func formatS002Grid(out Output) (string, error) {
	reps, err := globSynth(out.Dir, "w*-c*-k*.json")
	if err != nil {
		return "", err
	}
	sortGrid(reps)
	var b strings.Builder
	for i, r := range reps {
		s := r.Config.Synthetic
		if i == 0 || r.Config.Workers != reps[i-1].Config.Workers || s.Concurrency != reps[i-1].Config.Synthetic.Concurrency {
			if i > 0 {
				b.WriteString("\n")
			}
			fmt.Fprintf(&b, "**%d workers, concurrency %d**\n\n", r.Config.Workers, s.Concurrency)
			b.WriteString("| prefixes | pooled-LRU / ideal | policy | hit rate | cached ratio | ÷ pooled | TTFT p50 / p99 ms | req/s | Dynamo measured: hit · cached · TTFT p50/p99 · req/s |\n")
			b.WriteString("|---:|---|---|---:|---:|---:|---:|---:|---|\n")
		}
		for j, x := range r.Results {
			lead := "| | | "
			if j == 0 {
				lead = fmt.Sprintf("| %d | %s / %s | ", s.Prefixes, f3(r.Reference.PooledLRUCachedTokenRatio), f3(r.Reference.IdealCachedTokenRatio))
			}
			measured := seed002Grid[fmt.Sprintf("w%d-c%d-k%d/%s", r.Config.Workers, s.Concurrency, s.Prefixes, x.Policy)]
			b.WriteString(lead + strings.Join([]string{x.Policy, pct(x.RequestHitRate), f3(x.CachedTokenRatio), f2(r.pooled(x)),
				f0(x.TTFT.P50) + " / " + f0(x.TTFT.P99), f2(x.ThroughputRPS), measured}, " | ") + " |\n")
		}
	}
	return b.String(), nil
}
