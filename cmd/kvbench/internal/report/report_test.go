package report

import (
	"encoding/json"
	"fmt"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/sim"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/stats"
	"gonum.org/v1/plot/plotter"
)

func TestSimReportMedian(t *testing.T) {
	runs := []Run{
		{Seed: 1, Summary: sim.Summary{Requests: 10, RequestHitRate: 0.5, TTFT: stats.Quantiles{P50: 30, P99: 90}, Errors: 0}},
		{Seed: 2, Summary: sim.Summary{Requests: 10, RequestHitRate: 0.9, TTFT: stats.Quantiles{P50: 10, P99: 50}, Errors: 2}},
		{Seed: 3, Summary: sim.Summary{Requests: 10, RequestHitRate: 0.7, TTFT: stats.Quantiles{P50: 20, P99: 70}, Errors: 0}},
	}
	r := Median("kv", runs)
	if r.RequestHitRate != 0.7 || r.TTFT.P50 != 20 || r.TTFT.P99 != 70 || r.Errors != 0 || r.ErrorsAllReps != 2 || r.Requests != 10 || len(r.Reps) != 3 {
		t.Fatalf("median %+v", r)
	}
	if m := median([]float64{4, 1, 3, 2}); m != 2.5 {
		t.Fatalf("median of 1..4 = %v", m)
	}
	ref := MedianReference([]sim.Reference{{PooledLRU: 0.3, Ideal: 0.9, OneEngine: 0.25}, {PooledLRU: 0.1, Ideal: 0.8, OneEngine: 0.05}, {PooledLRU: 0.2, Ideal: 0.7, OneEngine: 0.15}})
	if ref.PooledLRUCachedTokenRatio != 0.2 || ref.IdealCachedTokenRatio != 0.8 || ref.EnginePooledCachedTokenRatio != 0.15 {
		t.Fatalf("reference %+v", ref)
	}
}

// The JSON keys are a contract (docs/CONTRACTS.md).
func TestSimReportJSONContract(t *testing.T) {
	p := filepath.Join(t.TempDir(), "r.json")
	rep := &Report{Config: map[string]int{"workers": 2}, Results: []Result{Median("kv", []Run{{}})}}
	if err := cli.WriteJSONFile(p, rep); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]json.RawMessage
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"config", "reference", "results"} {
		if _, ok := doc[k]; !ok {
			t.Fatalf("no %q in %s", k, b)
		}
	}
	var ref map[string]float64
	json.Unmarshal(doc["reference"], &ref)
	for _, k := range []string{"pooled_lru_cached_token_ratio", "ideal_cached_token_ratio"} {
		if _, ok := ref[k]; !ok {
			t.Fatalf("reference lacks %q", k)
		}
	}
	var results []map[string]json.RawMessage
	json.Unmarshal(doc["results"], &results)
	for _, k := range []string{"policy", "requests", "request_hit_rate", "cached_token_ratio", "ttft_ms", "e2e_ms", "throughput_rps", "errors"} {
		if _, ok := results[0][k]; !ok {
			t.Fatalf("result lacks %q", k)
		}
	}
	for _, k := range []string{"ttft_ms", "e2e_ms"} {
		var q map[string]float64
		json.Unmarshal(results[0][k], &q)
		if _, ok := q["p50"]; !ok {
			t.Fatalf("%s lacks p50", k)
		}
		if _, ok := q["p99"]; !ok {
			t.Fatalf("%s lacks p99", k)
		}
	}
}

func TestSimReportTable(t *testing.T) {
	var b strings.Builder
	if err := WriteTable(&b, "head", &Report{Results: plotResults()[:2]}); err != nil {
		t.Fatal(err)
	}
	if out := b.String(); !strings.Contains(out, "85.7%") || !strings.Contains(out, "round-robin") {
		t.Fatalf("table:\n%s", out)
	}
}

func plotResults() []Result {
	return []Result{
		{Policy: "round-robin", Requests: 600, RequestHitRate: 0.535, TTFT: stats.Quantiles{P50: 44, P99: 73}},
		{Policy: "kv", Requests: 600, RequestHitRate: 0.857, TTFT: stats.Quantiles{P50: 27, P99: 55}},
		{Policy: "kv-pooled", Requests: 600, RequestHitRate: 0.9, TTFT: stats.Quantiles{P50: 25, P99: 2780}},
	}
}

// The figure is checked before rendering: its panels, their axis labels
// and one bar per policy holding the policy's figure.
func TestSimFigureStructure(t *testing.T) {
	results := plotResults()
	fig, err := Figure("seed 002, 7 prefixes", results)
	if err != nil {
		t.Fatal(err)
	}
	if fig.Subtitle != "seed 002, 7 prefixes" || !strings.Contains(fig.Title, "routing policy") {
		t.Errorf("title %q, subtitle %q", fig.Title, fig.Subtitle)
	}
	if got, want := strings.Join(fig.LegendLabels(), ","), "round-robin,kv,kv-pooled"; got != want {
		t.Errorf("legend %s, want %s", got, want)
	}
	wants := []struct {
		title, yLabel string
		values        []float64
	}{
		{"Request hit rate", "requests that hit the cache (%)", []float64{53.5, 85.7, 90}},
		{"TTFT p50", "time to first token, p50 (ms)", []float64{44, 27, 25}},
		{"TTFT p99", "time to first token, p99 (ms)", []float64{73, 55, 2780}},
	}
	if len(fig.Panels) != len(wants) {
		t.Fatalf("%d panels, want %d", len(fig.Panels), len(wants))
	}
	for i, w := range wants {
		pan := fig.Panels[i]
		p := pan.Plot
		if p.Title.Text != w.title || p.Y.Label.Text != w.yLabel || p.X.Label.Text != "routing policy" {
			t.Errorf("panel %d: title %q, x %q, y %q", i, p.Title.Text, p.X.Label.Text, p.Y.Label.Text)
		}
		if len(pan.Series) != len(results) {
			t.Fatalf("panel %s: %d series, want %d", w.title, len(pan.Series), len(results))
		}
		for k, s := range pan.Series {
			bar, ok := s.Plotters[0].(*plotter.BarChart)
			if s.Label != results[k].Policy || !ok || len(bar.Values) != 1 || math.Abs(bar.Values[0]-w.values[k]) > 1e-9 || bar.XMin != float64(k) {
				t.Errorf("panel %s series %d: %q %+v", w.title, k, s.Label, s.Plotters[0])
			}
		}
		// Every bar and its label fit under the axis' top.
		if top := slices.Max(w.values); p.Y.Max < top || p.Y.Min != 0 {
			t.Errorf("panel %s: y axis [%v, %v], tallest bar %v", w.title, p.Y.Min, p.Y.Max, top)
		}
	}
}

func TestSimPlotPNG(t *testing.T) {
	for _, n := range []int{1, 3, 7} {
		var results []Result
		for i := range n {
			results = append(results, Result{Policy: fmt.Sprintf("policy-%d", i), RequestHitRate: float64(i) / 10,
				TTFT: stats.Quantiles{P50: float64(10 * i), P99: math.NaN()}})
		}
		p := filepath.Join(t.TempDir(), "p.png")
		if err := Plot(p, "a run", results); err != nil {
			t.Fatal(err)
		}
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		img, err := png.Decode(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		if b := img.Bounds(); b.Dx() != plotWidth || b.Dy() != plotHeight {
			t.Errorf("%d policies: plot is %v, want %d×%d", n, b, plotWidth, plotHeight)
		}
	}
	if err := Plot(filepath.Join(t.TempDir(), "missing", "p.png"), "", plotResults()); err == nil {
		t.Error("plot into a missing directory: no error")
	}
}
