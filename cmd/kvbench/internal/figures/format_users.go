package figures

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/report"
)

// usersPolicies are the "what users feel" tables' columns, in order: the
// baseline, the peer's own code, our reproduction of Dynamo, ours.
var usersPolicies = []string{"round-robin", "gaie", "kv", "kv-pooled"}

// goodputJSON is the part of a `kvbench goodput --json` report the tables read.
type goodputJSON struct {
	Config struct {
		SimConfig
		SLO *struct {
			TTFTMs float64 `json:"ttft_ms"`
			TPOTMs float64 `json:"tpot_ms"`
		} `json:"slo"`
		Target    float64 `json:"attainment_target"`
		TraceRate float64 `json:"trace_rate"`
	} `json:"config"`
	Results []struct {
		Policy string         `json:"policy"`
		RPS    float64        `json:"goodput_rps"`
		Capped bool           `json:"capped"`
		At     *report.Result `json:"at_goodput"`
	} `json:"results"`
}

// formatUsersFeel: goodput at a stated SLO per workload and policy, from
// g-<workload>-<slo>.json (kvbench goodput), then TTFT p50 / p99 at a
// stated rate, from r-<workload>.json (kvbench sim --arrival-rate, or a
// trace at its own timestamps). Cells: goodput req/s (× round-robin's);
// p50 / p99 ms.
func formatUsersFeel(out Output) (string, error) {
	gs, err := filepath.Glob(filepath.Join(out.Dir, "g-*.json"))
	if err != nil || len(gs) == 0 {
		return "", fmt.Errorf("the command wrote no g-*.json goodput report")
	}
	slices.Sort(gs)
	var b strings.Builder
	b.WriteString("| workload | SLO (≥ 90 % of requests) |")
	for _, p := range usersPolicies {
		b.WriteString(" " + p + " |")
	}
	b.WriteString("\n|---|---|---:|---:|---:|---:|\n")
	for _, path := range gs {
		raw, err := os.ReadFile(path)
		if err != nil {
			return "", err
		}
		var g goodputJSON
		if err := json.Unmarshal(raw, &g); err != nil {
			return "", fmt.Errorf("%s: %w", filepath.Base(path), err)
		}
		by := map[string]float64{}
		capped := map[string]bool{}
		for _, r := range g.Results {
			by[r.Policy], capped[r.Policy] = r.RPS, r.Capped
		}
		cells := []string{usersWorkload(&g.Config.SimConfig), usersSLO(g.Config.SLO)}
		for _, p := range usersPolicies {
			v, ok := by[p]
			if !ok {
				return "", fmt.Errorf("%s: no %s result", filepath.Base(path), p)
			}
			c := fmt.Sprintf("%.3g", v)
			if capped[p] {
				c = "≥ " + c
			}
			if rr := by["round-robin"]; rr > 0 && p != "round-robin" {
				c += fmt.Sprintf(" (%.2f ×)", v/rr)
			}
			cells = append(cells, c)
		}
		row(&b, cells...)
	}
	rs, err := globSim(out.Dir, "r-*.json")
	if err != nil {
		return "", err
	}
	b.WriteString("\n| workload | arrival rate | TTFT p50 / p99 ms: round-robin | gaie | kv | kv-pooled |\n|---|---:|---:|---:|---:|---:|\n")
	for _, r := range rs {
		cells := []string{usersWorkload(&r.Config), usersRate(r)}
		for _, p := range usersPolicies {
			x, err := r.Policy(p)
			if err != nil {
				return "", err
			}
			cells = append(cells, f0(x.TTFT.P50)+" / "+f0(x.TTFT.P99))
		}
		row(&b, cells...)
	}
	return b.String(), nil
}

func usersWorkload(c *SimConfig) string {
	fleet := fmt.Sprintf("%d × %s blocks", c.Workers, capacityLabel(c.KVBlocks))
	if c.Trace != nil {
		return fmt.Sprintf("Mooncake %s, first %d rows, %s", strings.TrimSuffix(filepath.Base(c.Trace.Path), ".jsonl"), c.Requests, fleet)
	}
	if s := c.Synthetic; s != nil {
		return fmt.Sprintf("%d prefixes, %d-token outputs, %s", s.Prefixes, s.OutputTokens, fleet)
	}
	return fleet
}

func usersSLO(s *struct {
	TTFTMs float64 `json:"ttft_ms"`
	TPOTMs float64 `json:"tpot_ms"`
}) string {
	if s == nil {
		return "none"
	}
	var parts []string
	if s.TTFTMs > 0 {
		parts = append(parts, fmt.Sprintf("TTFT ≤ %g ms", s.TTFTMs))
	}
	if s.TPOTMs > 0 {
		parts = append(parts, fmt.Sprintf("TPOT ≤ %g ms", s.TPOTMs))
	}
	return strings.Join(parts, ", ")
}

// usersRate is a sim report's arrival rate: the synthetic --arrival-rate,
// or a trace's requests over its virtual span (its own timestamps).
func usersRate(r *SimReport) string {
	if s := r.Config.Synthetic; s != nil && s.ArrivalRate > 0 {
		return fmt.Sprintf("%g req/s", s.ArrivalRate)
	}
	return "its timestamps"
}
