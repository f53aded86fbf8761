package report

import (
	"encoding/json"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/sim"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/stats"
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

func TestSimReportTableAndPlot(t *testing.T) {
	results := []Result{
		{Policy: "round-robin", Requests: 600, RequestHitRate: 0.535, TTFT: stats.Quantiles{P50: 44, P99: 73}},
		{Policy: "kv", Requests: 600, RequestHitRate: 0.857, TTFT: stats.Quantiles{P50: 27, P99: 55}},
	}
	var b strings.Builder
	if err := WriteTable(&b, "head", &Report{Results: results}); err != nil {
		t.Fatal(err)
	}
	if out := b.String(); !strings.Contains(out, "85.7%") || !strings.Contains(out, "round-robin") {
		t.Fatalf("table:\n%s", out)
	}
	p := filepath.Join(t.TempDir(), "p.png")
	if err := Plot(p, "seed 002, 7 prefixes", results); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatal(err)
	}
	if b := img.Bounds(); b.Dx() < 600 || b.Dy() < 300 {
		t.Fatalf("plot is %v", b)
	}
	// The bars are drawn: the first palette colour appears.
	found := false
	for y := 100; y < 500 && !found; y++ {
		for x := 0; x < 1200 && !found; x++ {
			r, g, bl, _ := img.At(x, y).RGBA()
			found = r>>8 == 31 && g>>8 == 119 && bl>>8 == 180
		}
	}
	if !found {
		t.Fatal("no bar in the plot")
	}
}

func TestSimReportGlyphs(t *testing.T) {
	for r, g := range glyphs {
		for _, row := range g {
			if len(row) != glyphW {
				t.Fatalf("glyph %q has a row of %d columns", r, len(row))
			}
		}
	}
	if niceCeil(73) != 100 || niceCeil(0.4) != 1 || niceCeil(130) != 200 || niceCeil(480) != 500 {
		t.Fatalf("niceCeil: %v %v %v %v", niceCeil(73), niceCeil(0.4), niceCeil(130), niceCeil(480))
	}
}
