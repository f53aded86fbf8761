package disagg

import (
	"bytes"
	"encoding/json"
	"fmt"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/router"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
)

func testConfig(t *testing.T, mode router.DisaggMode, linkMBps float64, prompt, conc, requests int) Config {
	t.Helper()
	prof, err := engine.LookupProfile(engine.ProfileSeed001Small)
	if err != nil {
		t.Fatal(err)
	}
	return Config{Mode: mode, Profile: prof, Link: router.Link{ThroughputBytesPerS: linkMBps * 1e6}, KV: router.KVQwen3_0_6B,
		PromptTokens: prompt, OutputTokens: 64, Requests: requests, Concurrency: conc, PrefillWorkers: 1, DecodeWorkers: 1,
		MaxBatchedTokens: 8192, MaxRunning: 256, KVCapacityTokens: 262_144, BlockSize: 16, TransferRetries: 1, Seed: 1}
}

func run(t *testing.T, cfg Config) Result {
	t.Helper()
	res, err := Run(cfg)
	if err != nil {
		t.Fatalf("%s: %v", cfg.Mode, err)
	}
	if res.Completed != cfg.Requests {
		t.Fatalf("%s: %d of %d completed", cfg.Mode, res.Completed, cfg.Requests)
	}
	return res
}

// Seed 001 §4.5 in the simulator: at 104 MB/s, always adds bytes ÷ link
// (1.654 s for 1,500 tokens, 3.308 s for 3,000) plus one decode step to a
// lone request's TTFT; with four concurrent requests each transfer gets a
// quarter of the link.
func TestDisaggSimSeed001(t *testing.T) {
	for _, c := range []struct {
		tokens int
		added  float64 // ms
	}{{1500, 1654.154 + 7}, {3000, 3308.308 + 7}} {
		off := run(t, testConfig(t, router.DisaggOff, 104, c.tokens, 1, 5))
		alw := run(t, testConfig(t, router.DisaggAlways, 104, c.tokens, 1, 5))
		if got := alw.TTFT.P50 - off.TTFT.P50; math.Abs(got-c.added) > 1 {
			t.Errorf("%d tokens: always adds %.3f ms, want %.3f (off %.1f, always %.1f)", c.tokens, got, c.added, off.TTFT.P50, alw.TTFT.P50)
		}
		if alw.TransferMBpsMean < 103.99 || alw.TransferMBpsMean > 104.01 || alw.PeakTransfers != 1 {
			t.Errorf("%d tokens alone: %.3f MB/s per transfer, peak %d", c.tokens, alw.TransferMBpsMean, alw.PeakTransfers)
		}
	}
	alw := run(t, testConfig(t, router.DisaggAlways, 104, 3000, 4, 16))
	if alw.PeakTransfers != 4 || alw.TransferMBpsMean < 25.5 || alw.TransferMBpsMean > 28 {
		t.Errorf("4 concurrent: peak %d transfers at %.2f MB/s each, want 4 at ≈ 26", alw.PeakTransfers, alw.TransferMBpsMean)
	}
	// Seed 001: 12.5–13.1 s per transfer; four sharing 104 MB/s: 4 × 3.308 s.
	if alw.TransferMs.P50 < 12_500 || alw.TransferMs.P50 > 13_300 {
		t.Errorf("4 concurrent: transfer p50 %.0f ms", alw.TransferMs.P50)
	}
}

// auto ≤ 1.05 × min(off, always) in p50 TTFT at the grid's corners.
func TestDisaggSimAutoBound(t *testing.T) {
	g := Grid{Base: testConfig(t, router.DisaggOff, 100, 500, 4, 40), LinkMBps: []float64{100, 50_000}, PromptTokens: []int{500, 8000},
		Modes: router.DisaggModes, Bound: 1.05, Parallel: 2}
	rep, err := g.Run(nil)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Check == nil || rep.Check.Cells != 4 || rep.Check.Holding != 4 {
		t.Fatalf("check %+v", rep.Check)
	}
	for _, c := range rep.Cells {
		off, _ := c.Result(router.DisaggOff)
		alw, _ := c.Result(router.DisaggAlways)
		if alw.Disaggregated != 40 || off.Disaggregated != 0 {
			t.Errorf("%g MB/s %d tokens: always disaggregated %d, off %d", c.LinkMBps, c.PromptTokens, alw.Disaggregated, off.Disaggregated)
		}
		if c.LinkMBps == 100 {
			if auto, _ := c.Result(router.DisaggAuto); auto.Disaggregated != 0 {
				t.Errorf("auto disaggregated %d requests over 100 MB/s", auto.Disaggregated)
			}
		}
	}
}

// Failed transfers are retried, then served aggregated; none is lost.
func TestDisaggSimTransferFailures(t *testing.T) {
	cfg := testConfig(t, router.DisaggAlways, 1000, 1500, 4, 30)
	cfg.FailEvery = 2
	res := run(t, cfg)
	if res.TransferRetries == 0 || res.TransferFallbacks == 0 {
		t.Errorf("retries %d, fallbacks %d", res.TransferRetries, res.TransferFallbacks)
	}
	cfg.TransferRetries = 0
	res = run(t, cfg)
	if res.TransferRetries != 0 || res.TransferFallbacks == 0 {
		t.Errorf("no retries: retries %d, fallbacks %d", res.TransferRetries, res.TransferFallbacks)
	}
}

// Prefix reuse: the prefill router sends a shared prefix where it is cached.
func TestDisaggSimPrefixReuse(t *testing.T) {
	cold := testConfig(t, router.DisaggAlways, 50_000, 3000, 1, 12)
	cold.PrefillWorkers = 2
	warm := cold
	warm.PrefixGroups, warm.PrefixTokens = 2, 2800
	c, w := run(t, cold), run(t, warm)
	if !(w.TTFT.P50 < c.TTFT.P50/2) {
		t.Errorf("shared prefixes: TTFT p50 %.1f ms, unique %.1f ms", w.TTFT.P50, c.TTFT.P50)
	}
}

func TestDisaggSimDeterministic(t *testing.T) {
	cfg := testConfig(t, router.DisaggAuto, 10_000, 1500, 4, 40)
	cfg.ThinkTime = 100 * time.Millisecond
	a, b := run(t, cfg), run(t, cfg)
	if a != b {
		t.Errorf("two runs differ:\n%+v\n%+v", a, b)
	}
}

func TestDisaggSimValidate(t *testing.T) {
	bad := []func(*Config){
		func(c *Config) { c.PromptTokens = 0 },
		func(c *Config) { c.DecodeWorkers = 0 },
		func(c *Config) { c.KVCapacityTokens = 100 },
		func(c *Config) { c.Link.ThroughputBytesPerS = 0 },
		func(c *Config) { c.KV = router.ModelKV{} },
		func(c *Config) { c.PrefixTokens = 5000 },
		func(c *Config) { c.ThinkTime = -1 },
	}
	for i, f := range bad {
		cfg := testConfig(t, router.DisaggOff, 100, 1500, 1, 1)
		f(&cfg)
		if _, err := Run(cfg); err == nil {
			t.Errorf("bad config %d accepted", i)
		}
	}
	// No prefill workers: always falls back to aggregated for every request.
	cfg := testConfig(t, router.DisaggAlways, 100, 1500, 2, 6)
	cfg.PrefillWorkers = 0
	if res := run(t, cfg); res.Fallbacks != 6 || res.Aggregated != 6 {
		t.Errorf("no prefill workers: %+v", res)
	}
}

func TestDisaggReportTableJSONPlot(t *testing.T) {
	g := Grid{Base: testConfig(t, router.DisaggOff, 100, 500, 2, 8), LinkMBps: []float64{100, 1000, 10_000}, PromptTokens: []int{500, 1500},
		Modes: router.DisaggModes, Bound: 1.05, Parallel: 2}
	// Progress counts every simulation, up to the totals announced.
	var calls, last, total int
	count := func(done, t int) { calls, last, total = calls+1, done, t }
	rep, err := g.Run(count)
	if err != nil {
		t.Fatal(err)
	}
	if calls != 18 || last != 18 || total != g.Runs() || g.Runs() != 18 {
		t.Errorf("grid progress: %d calls, last %d/%d, want 18/%d", calls, last, total, g.Runs())
	}
	calls = 0
	if rep.Seed001, err = RunSeed001(g.Base, 2, count); err != nil {
		t.Fatal(err)
	}
	if calls != Seed001Runs || last != Seed001Runs || total != Seed001Runs {
		t.Errorf("seed 001 progress: %d calls, last %d/%d, want %d", calls, last, total, Seed001Runs)
	}
	if len(rep.Seed001.Rows) != 4 || rep.Seed001.Rows[1].PromptTokens != 3000 || math.Abs(rep.Seed001.Rows[1].ArithmeticS-3.3083) > 1e-3 {
		t.Errorf("seed 001 rows %+v", rep.Seed001.Rows)
	}
	var out bytes.Buffer
	if err := WriteTable(&out, rep); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"| 100 | 500 | 57.3 MB | 0.573 |", "auto ≤ 1.05 × min(off, always)", "seed 001 §4.5", "| 3000 | 4 | 344064000 | 3.308 |"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, out.String())
		}
	}
	dir := t.TempDir()
	jp, pp := filepath.Join(dir, "r.json"), filepath.Join(dir, "r.png")
	if err := cli.WriteJSONFile(jp, rep); err != nil {
		t.Fatal(err)
	}
	var back map[string]any
	raw, _ := os.ReadFile(jp)
	if err := json.Unmarshal(raw, &back); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"config", "cells", "check", "seed001"} {
		if _, ok := back[k]; !ok {
			t.Errorf("JSON lacks %q", k)
		}
	}
	cell := back["cells"].([]any)[0].(map[string]any)
	res := cell["results"].([]any)[0].(map[string]any)
	for _, k := range []string{"mode", "ttft_ms", "itl_ms", "transfer_mbps_mean", "disaggregated", "estimate_error_p50"} {
		if _, ok := res[k]; !ok {
			t.Errorf("result lacks %q", k)
		}
	}
	checkFigure(t, rep)
	if err := Plot(pp, rep); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(pp)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatal(err)
	}
	if b, w := img.Bounds(), 120+2*panelWidth+170; b.Dx() != w || b.Dy() != plotHeight {
		t.Errorf("plot %v, want %d×%d", b, w, plotHeight)
	}
}

// checkFigure checks the chart before rendering: a panel per prompt
// length with log axes under shared axis labels, a line per mode holding its p50
// TTFTs in seconds by link speed.
func checkFigure(t *testing.T, rep *Report) {
	t.Helper()
	fig, err := Figure(rep)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := strings.Join(fig.LegendLabels(), ","), "--disagg off,--disagg always,--disagg auto"; got != want {
		t.Errorf("legend %s, want %s", got, want)
	}
	if fig.XLabel != "KV link throughput (MB/s, log scale)" || fig.YLabel != "p50 time to first token (s, log scale)" {
		t.Errorf("axis labels x %q, y %q", fig.XLabel, fig.YLabel)
	}
	if !strings.Contains(fig.Title, "p50 TTFT against KV link speed") || !strings.Contains(fig.Subtitle, "1 prefill + 1 decode workers") {
		t.Errorf("title %q, subtitle %q", fig.Title, fig.Subtitle)
	}
	if len(fig.Panels) != 2 {
		t.Fatalf("%d panels, want one per prompt length (2)", len(fig.Panels))
	}
	for i, prompt := range []int{500, 1500} {
		pan := fig.Panels[i]
		p := pan.Plot
		if p.Title.Text != fmt.Sprintf("%d-token prompts", prompt) {
			t.Errorf("panel %d: title %q", i, p.Title.Text)
		}
		if _, ok := p.X.Scale.(plot.LogScale); !ok {
			t.Errorf("panel %d: x scale %T, want log", i, p.X.Scale)
		}
		if _, ok := p.Y.Scale.(plot.LogScale); !ok {
			t.Errorf("panel %d: y scale %T, want log", i, p.Y.Scale)
		}
		if len(pan.Series) != 3 {
			t.Fatalf("panel %d: %d series, want 3 modes", i, len(pan.Series))
		}
		for k, mode := range []router.DisaggMode{router.DisaggOff, router.DisaggAlways, router.DisaggAuto} {
			s := pan.Series[k]
			line, ok := s.Plotters[0].(*plotter.Line)
			if s.Label != "--disagg "+string(mode) || !ok || len(line.XYs) != 3 {
				t.Fatalf("panel %d series %d: %q %T", i, k, s.Label, s.Plotters[0])
			}
			for j, xy := range line.XYs {
				cell := rep.Cells[j*2+i] // cells run link by link, prompt by prompt
				res, _ := cell.Result(mode)
				if xy.X != cell.LinkMBps || xy.Y != res.TTFT.P50/1e3 || cell.PromptTokens != prompt {
					t.Errorf("%d-token %s point %d: %v, cell %v MB/s p50 %v ms", prompt, mode, j, xy, cell.LinkMBps, res.TTFT.P50)
				}
				if xy.Y < p.Y.Min || xy.Y > p.Y.Max {
					t.Errorf("%d-token %s point %v outside the y range [%v, %v]", prompt, mode, xy, p.Y.Min, p.Y.Max)
				}
			}
		}
	}
}
