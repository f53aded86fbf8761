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

// SimReport is the part of a `kvbench sim --json` report the formatters
// read (docs/CONTRACTS.md).
type SimReport struct {
	File      string           `json:"-"`
	Config    SimConfig        `json:"config"`
	Reference report.Reference `json:"reference"`
	Results   []report.Result  `json:"results"`
}

// SimConfig is the report's config object, the fields the tables name.
type SimConfig struct {
	Workers          int                `json:"workers"`
	KVBlocks         []int              `json:"kv_blocks"`
	Profile          string             `json:"profile"`
	Routers          int                `json:"routers"`
	SyncDelayMs      float64            `json:"sync_delay_ms"`
	Policies         []string           `json:"policies"`
	PrefillLoadScale *float64           `json:"prefill_load_scale"`
	OverlapCredit    *float64           `json:"overlap_credit"`
	Temperature      *float64           `json:"temperature"`
	ApproxTTLS       float64            `json:"approx_ttl_s"`
	Pooled           map[string]float64 `json:"pooled"`
	Seed             uint64             `json:"seed"`
	Reps             int                `json:"reps"`
	Requests         int                `json:"requests"`
	Synthetic        *struct {
		Prefixes     int     `json:"prefixes"`
		OutputTokens int     `json:"output_tokens"`
		Concurrency  int     `json:"concurrency"`
		PrefixOrder  string  `json:"prefix_order"`
		Popularity   string  `json:"popularity"`
		HotShift     int     `json:"hot_shift"`
		ArrivalRate  float64 `json:"arrival_rate"`
	} `json:"synthetic"`
	Trace *struct {
		Path string `json:"path"`
	} `json:"trace"`
}

// loadSim reads one sim report from the scratch directory.
func loadSim(dir, name string) (*SimReport, error) {
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		return nil, fmt.Errorf("the command did not write %s: %w", name, err)
	}
	var r SimReport
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	r.File = name
	return &r, nil
}

// globSim reads every sim report whose name matches pattern, in name order;
// none is an error.
func globSim(dir, pattern string) ([]*SimReport, error) {
	names, err := filepath.Glob(filepath.Join(dir, pattern))
	if err != nil {
		return nil, err
	}
	if len(names) == 0 {
		return nil, fmt.Errorf("the command wrote no %s", pattern)
	}
	slices.Sort(names)
	out := make([]*SimReport, 0, len(names))
	for _, n := range names {
		r, err := loadSim(dir, filepath.Base(n))
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, nil
}

// globSynth is globSim for tables of synthetic runs only: a trace run
// among the files is an error naming it.
func globSynth(dir, pattern string) ([]*SimReport, error) {
	reps, err := globSim(dir, pattern)
	if err != nil {
		return nil, err
	}
	for _, r := range reps {
		if err := r.synth(); err != nil {
			return nil, err
		}
	}
	return reps, nil
}

// Policy is the result of one policy; absent is an error naming the file.
func (r *SimReport) Policy(name string) (report.Result, error) {
	for _, x := range r.Results {
		if x.Policy == name {
			return x, nil
		}
	}
	return report.Result{}, fmt.Errorf("%s has no policy %s", r.File, name)
}

// synth is the synthetic config; a trace run is an error.
func (r *SimReport) synth() error {
	if r.Config.Synthetic == nil {
		return fmt.Errorf("%s is not a synthetic workload", r.File)
	}
	return nil
}

// pooled is the cached-token ratio ÷ the pooled-LRU reference.
func (r *SimReport) pooled(x report.Result) float64 {
	if r.Reference.PooledLRUCachedTokenRatio == 0 {
		return 0
	}
	return x.CachedTokenRatio / r.Reference.PooledLRUCachedTokenRatio
}

// row writes one Markdown table row.
func row(b *strings.Builder, cells ...string) {
	b.WriteString("| ")
	b.WriteString(strings.Join(cells, " | "))
	b.WriteString(" |\n")
}

func f0(x float64) string  { return fmt.Sprintf("%.0f", x) }
func f1(x float64) string  { return fmt.Sprintf("%.1f", x) }
func f2(x float64) string  { return fmt.Sprintf("%.2f", x) }
func f3(x float64) string  { return fmt.Sprintf("%.3f", x) }
func pct(x float64) string { return fmt.Sprintf("%.1f%%", 100*x) }
