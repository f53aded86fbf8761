package figures

import (
	"cmp"
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/report"
)

// beyondRows are the rows of the "Beyond seed 002" table: file
// b<policies>-<row>.json is row <row> (1-based), run on workers workers.
var beyondRows = []struct {
	label   string
	workers int
}{
	{"Zipf 1.1, 48 prefixes, 6 workers, c16", 6},
	{"Zipf 0.8, 24 prefixes, hot set moves every 200, 6 w, c8", 6},
	{"Zipf 1.2, 64 prefixes, hot set moves every 300, 3 w, c8", 3},
	{"24 prefixes, 3 × 900 + 3 × 400 blocks, c16", 6},
	{"sessions, 8 × 4,096 blocks", 8},
	{"sessions, 4 × 6,144 + 4 × 2,048 blocks", 8},
}

var reBeyondFile = regexp.MustCompile(`^b(\d+)-(\d+)\.json$`)

// beyondCell: ÷ pooled-LRU · hit rate · TTFT p50 / p99 ms · req/s.
func beyondCell(r *SimReport, x report.Result) string {
	return fmt.Sprintf("%s · %.0f %% · %s / %s ms · %s", f2(r.pooled(x)), 100*x.RequestHitRate, f0(x.TTFT.P50), f0(x.TTFT.P99), f2(x.ThroughputRPS))
}

// formatBeyondS002: skew, a moving hot set, heterogeneous workers and
// multi-turn sessions, one row per workload, from b<policies>-<row>.json.
// The run of round-robin, kv and kv-pooled gives the references and those
// columns; "best kv" is the kv run (one per --prefill-load-scale) with the
// highest cached-token ratio; of equal ratios the lower p99 TTFT, then the
// lower scale.
func formatBeyondS002(out Output) (string, error) {
	reps, err := globSim(out.Dir, "b*-*.json")
	if err != nil {
		return "", err
	}
	full := make([]*SimReport, len(beyondRows))
	scaled := make([][]*SimReport, len(beyondRows))
	for _, r := range reps {
		m := reBeyondFile.FindStringSubmatch(filepath.Base(r.File))
		if m == nil {
			return "", fmt.Errorf("%s: not b<policies>-<row>.json", r.File)
		}
		i, _ := strconv.Atoi(m[2])
		if i < 1 || i > len(beyondRows) {
			return "", fmt.Errorf("%s: row %d of %d", r.File, i, len(beyondRows))
		}
		i--
		if r.Config.Workers != beyondRows[i].workers {
			return "", fmt.Errorf("%s: %d workers, its row (%s) has %d", r.File, r.Config.Workers, beyondRows[i].label, beyondRows[i].workers)
		}
		switch {
		case slices.Equal(r.Config.Policies, []string{"round-robin", "kv", "kv-pooled"}):
			if full[i] != nil {
				return "", fmt.Errorf("%s and %s: two runs of round-robin, kv and kv-pooled for row %d", full[i].File, r.File, i+1)
			}
			full[i] = r
		case slices.Equal(r.Config.Policies, []string{"kv"}) && r.Config.PrefillLoadScale != nil:
			scaled[i] = append(scaled[i], r)
		default:
			return "", fmt.Errorf("%s: neither round-robin, kv and kv-pooled nor kv with --prefill-load-scale", r.File)
		}
	}
	var b strings.Builder
	b.WriteString("| workload | pooled-LRU / one engine / ideal | round-robin | kv | best kv (scale) | **kv-pooled** |\n")
	b.WriteString("|---|---|---|---|---|---|\n")
	for i, w := range beyondRows {
		r := full[i]
		if r == nil {
			return "", fmt.Errorf("no run of round-robin, kv and kv-pooled for row %d (%s)", i+1, w.label)
		}
		if len(scaled[i]) == 0 {
			return "", fmt.Errorf("no kv run with --prefill-load-scale for row %d (%s)", i+1, w.label)
		}
		ref := r.Reference
		cells := []string{w.label, f3(ref.PooledLRUCachedTokenRatio) + " / " + f3(ref.EnginePooledCachedTokenRatio) + " / " + f3(ref.IdealCachedTokenRatio)}
		for _, p := range []string{"round-robin", "kv"} {
			x, err := r.Policy(p)
			if err != nil {
				return "", err
			}
			cells = append(cells, beyondCell(r, x))
		}
		slices.SortFunc(scaled[i], func(a, b *SimReport) int { return cmp.Compare(*a.Config.PrefillLoadScale, *b.Config.PrefillLoadScale) })
		var top *SimReport
		var topKV report.Result
		for _, s := range scaled[i] {
			x, err := s.Policy("kv")
			if err != nil {
				return "", err
			}
			if top == nil || betterKV(x, topKV) {
				top, topKV = s, x
			}
		}
		cells = append(cells, fmt.Sprintf("%s (%g)", beyondCell(top, topKV), *top.Config.PrefillLoadScale))
		kp, err := r.Policy("kv-pooled")
		if err != nil {
			return "", err
		}
		cells = append(cells, "**"+beyondCell(r, kp)+"**")
		row(&b, cells...)
	}
	return b.String(), nil
}
