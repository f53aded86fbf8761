package main

import (
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
)

func TestGoodputFlagValidation(t *testing.T) {
	g, err := parseGoodputFlags([]string{"--slo-ttft-ms", "300", "--attainment=0.95", "--workers", "3", "--rate-start", "2"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if g.Search.Target != 0.95 || g.Search.Start != 2 || g.Workers != 3 || g.ArrivalRate != 1 {
		t.Fatalf("parsed %+v, workers %d, base rate %v", g.Search, g.Workers, g.ArrivalRate)
	}
	bad := map[string][]string{
		"no SLO":           {"--workers", "3"},
		"attainment > 1":   {"--slo-ttft-ms", "300", "--attainment", "1.5"},
		"attainment 0":     {"--slo-ttft-ms", "300", "--attainment", "0"},
		"start below min":  {"--slo-ttft-ms", "300", "--rate-start", "0.001"},
		"max below start":  {"--slo-ttft-ms", "300", "--rate-max", "0.5"},
		"precision":        {"--slo-ttft-ms", "300", "--precision", "0"},
		"rate is searched": {"--slo-ttft-ms", "300", "--arrival-rate", "3"},
		"closed loop":      {"--slo-ttft-ms", "300", "--concurrency", "8"},
		"repeat":           {"--slo-ttft-ms", "300", "--repeat", "2"},
		"sim's own checks": {"--slo-ttft-ms", "300", "--workers", "0"},
	}
	for name, args := range bad {
		if _, err := parseGoodputFlags(args, io.Discard); err == nil {
			t.Errorf("%s: %q accepted", name, args)
		}
	}
}

func TestGoodputSplitFlags(t *testing.T) {
	own, rest := splitFlags([]string{"--attainment", "0.8", "--workers", "2", "-precision=0.05", "--seed", "3", "--rate-max"},
		[]string{"attainment", "precision", "rate-max"})
	if !slices.Equal(own, []string{"--attainment", "0.8", "-precision=0.05", "--rate-max"}) ||
		!slices.Equal(rest, []string{"--workers", "2", "--seed", "3"}) {
		t.Fatalf("own %q, rest %q", own, rest)
	}
}

// A small fleet end to end: every policy gets a goodput whose figures meet
// the SLO, the JSON has the documented shape, the chart is written.
func TestGoodputEndToEnd(t *testing.T) {
	dir := t.TempDir()
	js, plot := filepath.Join(dir, "g.json"), filepath.Join(dir, "g.png")
	var stdout, stderr strings.Builder
	code := run([]string{"goodput", "--workers", "3", "--kv-blocks", "585", "--prefixes", "6", "--prefix-tokens", "1024",
		"--tail-tokens", "64", "--output-tokens", "64", "--requests", "400", "--policies", "round-robin,kv",
		"--slo-ttft-ms", "200", "--seed", "3", "--precision", "0.1", "--json", js, "--plot", plot}, &stdout, &stderr)
	if code != cli.ExitOK {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	var rep struct {
		Config struct {
			Target float64 `json:"attainment_target"`
			SLO    struct {
				TTFT float64 `json:"ttft_ms"`
			} `json:"slo"`
		} `json:"config"`
		Results []struct {
			Policy  string  `json:"policy"`
			Goodput float64 `json:"goodput_rps"`
			At      struct {
				TTFT struct {
					P50, P90, P99 float64
				} `json:"ttft_ms"`
				TPOT struct {
					P50, P90, P99 float64
				} `json:"tpot_ms"`
				Cached     float64 `json:"cached_token_ratio"`
				Attainment float64 `json:"slo_attainment"`
			} `json:"at_goodput"`
			Points []struct {
				Rate       float64 `json:"rate"`
				Attainment float64 `json:"slo_attainment"`
			} `json:"points"`
		} `json:"results"`
	}
	b, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	if rep.Config.Target != 0.9 || rep.Config.SLO.TTFT != 200 || len(rep.Results) != 2 {
		t.Fatalf("report: %s", b)
	}
	for _, r := range rep.Results {
		if r.Goodput <= 0 || r.At.Attainment < 0.9 || r.At.TTFT.P90 <= 0 || r.At.TTFT.P90 > 200 || r.At.TPOT.P50 <= 0 {
			t.Fatalf("%s: goodput %v at %+v", r.Policy, r.Goodput, r.At)
		}
		// The goodput is a measured rate, and some rate above it missed.
		measured, missedAbove := false, false
		for _, p := range r.Points {
			measured = measured || p.Rate == r.Goodput
			missedAbove = missedAbove || (p.Rate > r.Goodput && p.Attainment < 0.9)
		}
		if !measured || !missedAbove {
			t.Fatalf("%s: goodput %v not bracketed by its points %+v", r.Policy, r.Goodput, r.Points)
		}
	}
	if !strings.Contains(stdout.String(), "× round-robin") || !strings.Contains(stdout.String(), "this implementation") {
		t.Fatalf("table:\n%s", stdout.String())
	}
	if st, err := os.Stat(plot); err != nil || st.Size() < 1000 {
		t.Fatalf("chart: %v", err)
	}
}
