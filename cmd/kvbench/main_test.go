package main

import (
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/sim"
)

func TestSimFlagValidation(t *testing.T) {
	trace := filepath.Join(t.TempDir(), "t.jsonl")
	os.WriteFile(trace, []byte(`{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}`+"\n"), 0o644)
	good := [][]string{
		{},
		{"--workers", "2", "--kv-blocks", "926", "--prefixes", "12", "--prefix-tokens", "1500", "--tail-tokens", "32", "--policies", "round-robin,kv,kv-approx"},
		{"--workers", "3", "--kv-blocks", "400,500,600", "--policies", "random,least-loaded,load-aware"},
		{"--trace", trace, "--max-requests", "5", "--speedup", "10"},
		{"--policies", "kv", "--temperature", "0.5", "--overlap-credit", "0.5", "--prefill-load-scale", "2"},
		{"--policies", "round_robin"}, // Dynamo's spelling
		{"--policies", "kv-pooled,kv", "--popularity", "zipf:1.1", "--hot-shift", "100"},
		{"--arrival-rate", "2.5"},
		{"--policies", "kv,gaie", "--peer-scrape-interval", "0s"},
		{"--arrival-rate", "2.5", "--arrival-cv", "3", "--slo-ttft-ms", "500", "--slo-tpot-ms", "30"},
	}
	for _, args := range good {
		if _, err := parseSimFlags(args, io.Discard); err != nil {
			t.Errorf("%q: %v", args, err)
		}
	}
	bad := map[string][]string{
		"zero workers":            {"--workers", "0"},
		"capacity list length":    {"--workers", "3", "--kv-blocks", "100,200"},
		"zero capacity":           {"--kv-blocks", "0"},
		"capacity not a number":   {"--kv-blocks", "lots"},
		"request exceeds a cache": {"--workers", "2", "--kv-blocks", "585,100"},
		"block size":              {"--block-size", "0"},
		"unknown policy":          {"--policies", "kv,best"},
		"empty policy":            {"--policies", "kv,"},
		"duplicate policy":        {"--policies", "kv,kv"},
		"concurrency with trace":  {"--trace", trace, "--concurrency", "4"},
		"prefixes with trace":     {"--trace", trace, "--prefixes", "4"},
		"max-requests, no trace":  {"--max-requests", "4"},
		"reps":                    {"--reps", "0"},
		"speedup":                 {"--speedup", "0"},
		"event delay":             {"--event-delay", "-1ms"},
		"event delay unit":        {"--event-delay", "5"},
		"no router":               {"--routers", "0"},
		"sync delay":              {"--sync-delay", "-1ms"},
		"timeout":                 {"--timeout", "0s"},
		"approx ttl":              {"--approx-ttl", "0s"},
		"sync free extra":         {"--sync-free-extra", "-1s"},
		"repeat":                  {"--repeat", "0"},
		"arrival rate negative":   {"--arrival-rate", "-1"},
		"arrival rate NaN":        {"--arrival-rate", "NaN"},
		"arrival cv zero":         {"--arrival-rate", "1", "--arrival-cv", "0"},
		"arrival cv, no rate":     {"--arrival-cv", "2"},
		"rate and concurrency":    {"--arrival-rate", "1", "--concurrency", "4"},
		"rate and repeat":         {"--arrival-rate", "1", "--repeat", "2"},
		"rate with trace":         {"--trace", trace, "--arrival-rate", "1"},
		"slo negative":            {"--slo-ttft-ms", "-5"},
		"gaie with routers":       {"--policies", "kv,gaie", "--routers", "3"},
		"scrape interval":         {"--policies", "gaie", "--peer-scrape-interval", "-1s"},
		"slo infinite":            {"--slo-tpot-ms", "+Inf"},
		"repeat with trace":       {"--trace", trace, "--repeat", "2"},
		"overlap credit":          {"--overlap-credit", "1.5"},
		"temperature":             {"--temperature", "-1"},
		"profile":                 {"--profile", "h100"},
		"no output":               {"--output-tokens", "0"},
		"no prompt":               {"--prefix-tokens", "0", "--tail-tokens", "0"},
		"prefix order":            {"--prefix-order", "sorted"},
		"popularity":              {"--popularity", "zipf:0"},
		"hot shift":               {"--hot-shift", "-1"},
		"popularity, shuffled":    {"--prefix-order", "shuffled", "--popularity", "zipf:1"},
		"popularity with trace":   {"--trace", trace, "--popularity", "zipf:1"},
		"pooled evict weight":     {"--pooled-evict-weight", "-1"},
		"pooled output tokens":    {"--pooled-output-tokens", "NaN"},
		"stray argument":          {"extra"},
		"unknown flag":            {"--nope"},
	}
	for name, args := range bad {
		_, err := parseSimFlags(args, io.Discard)
		if !errors.Is(err, cli.ErrUsage) {
			t.Errorf("%s %q: err %v, want a usage error", name, args, err)
			continue
		}
		// And the command exits 2 with the message on stderr.
		var stdout, stderr strings.Builder
		if code := run(append([]string{"sim"}, args...), &stdout, &stderr); code != cli.ExitUsage || stderr.Len() == 0 {
			t.Errorf("%s: exit %d, stderr %q; want 2 and a message", name, code, stderr.String())
		}
	}
	o, _ := parseSimFlags([]string{"--workers", "3", "--kv-blocks", "7000", "--policies", "round-robin,kv", "--temperature", "0.25"}, io.Discard)
	if len(o.KVBlocks) != 3 || o.KVBlocks[2] != 7000 {
		t.Fatalf("one capacity for 3 workers: %v", o.KVBlocks)
	}
	if c := o.routerConfig("kv"); c.Temperature != 0.25 {
		t.Fatalf("kv temperature %v", c.Temperature)
	}
	if c := o.routerConfig("round-robin"); c.Temperature != 0 {
		t.Fatalf("knobs leak into round-robin: temperature %v", c.Temperature)
	}
	// kv-pooled's flags: set ones reach the router config, the others stay
	// nil (the router's defaults).
	o, err := parseSimFlags([]string{"--policies", "kv-pooled", "--pooled-evict-weight", "16", "--pooled-output-tokens", "0"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	p := o.routerConfig("kv-pooled").Pooled
	if p.EvictWeight == nil || *p.EvictWeight != 16 || p.OutputTokens == nil || *p.OutputTokens != 0 ||
		p.HomeWeight != nil || p.CopyWeight != nil || p.Overloaded != nil || p.QueueWeight != nil {
		t.Fatalf("pooled config %+v", p)
	}
}

func TestSimSubcommands(t *testing.T) {
	for _, args := range [][]string{{}, {"bogus"}, {"load", "--target", "x"}, {"ingest"}} {
		var stdout, stderr strings.Builder
		if code := run(args, &stdout, &stderr); code != cli.ExitUsage {
			t.Errorf("%q: exit %d, want 2", args, code)
		}
	}
	var stdout, stderr strings.Builder
	run([]string{"load"}, &stdout, &stderr)
	if !strings.Contains(stderr.String(), "--target") {
		t.Errorf("load: %q", stderr.String())
	}
	if code := run([]string{"sim", "-h"}, &stdout, &stderr); code != cli.ExitOK {
		t.Errorf("sim -h: exit %d", code)
	}
}

func TestSimMalformedTraceExit(t *testing.T) {
	p := filepath.Join(t.TempDir(), "bad.jsonl")
	os.WriteFile(p, []byte(`{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}`+"\n"+`{"timestamp": 0`+"\n"), 0o644)
	var stdout, stderr strings.Builder
	code := run([]string{"sim", "--trace", p}, &stdout, &stderr)
	if code != cli.ExitUsage || !strings.Contains(stderr.String(), p+":2:") {
		t.Fatalf("exit %d, stderr %q; want 2 naming %s:2", code, stderr.String(), p)
	}
	code = run([]string{"sim", "--trace", p + ".missing"}, &stdout, &stderr)
	if code != cli.ExitUsage {
		t.Fatalf("missing trace: exit %d", code)
	}
}

func TestSimEndToEnd(t *testing.T) {
	dir := t.TempDir()
	js, plot, reqs := filepath.Join(dir, "r.json"), filepath.Join(dir, "r.png"), filepath.Join(dir, "r.jsonl")
	var stdout, stderr strings.Builder
	code := run([]string{"sim", "--workers", "2", "--kv-blocks", "926", "--prefixes", "12", "--prefix-tokens", "1500",
		"--tail-tokens", "32", "--output-tokens", "16", "--requests", "72", "--concurrency", "1",
		"--policies", "round-robin,kv,kv-approx", "--seed", "3", "--reps", "2", "--json", js, "--plot", plot,
		"--requests-out", reqs}, &stdout, &stderr)
	if code != cli.ExitOK {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	var rep struct {
		Config    map[string]any `json:"config"`
		Reference struct {
			Pooled float64 `json:"pooled_lru_cached_token_ratio"`
			Ideal  float64 `json:"ideal_cached_token_ratio"`
		} `json:"reference"`
		Results []struct {
			Policy   string  `json:"policy"`
			Requests int     `json:"requests"`
			Hit      float64 `json:"request_hit_rate"`
			Ratio    float64 `json:"cached_token_ratio"`
			Errors   int     `json:"errors"`
		} `json:"results"`
	}
	b, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Results) != 3 || rep.Reference.Ideal <= 0 || rep.Reference.Pooled > rep.Reference.Ideal {
		t.Fatalf("report: %s", b)
	}
	hits := map[string]float64{}
	for _, r := range rep.Results {
		if r.Requests != 72 || r.Errors != 0 {
			t.Fatalf("%s: %d requests, %d errors", r.Policy, r.Requests, r.Errors)
		}
		hits[r.Policy] = r.Hit * 72
	}
	// Seed 001's experiment: kv and kv-approx hit (almost) every repeat.
	if hits["kv"] < 58 || hits["kv-approx"] < 58 || hits["round-robin"] >= hits["kv"] {
		t.Fatalf("repeat hits %v", hits)
	}
	if !strings.Contains(stdout.String(), "kv-approx") || !strings.Contains(stdout.String(), "pooled-LRU") {
		t.Fatalf("table:\n%s", stdout.String())
	}
	// --requests-out: each policy's and rep's 72 requests, in order, rep
	// r with seed 3+r, all completed; in rep 0 kv finds cached tokens for
	// (almost) every repeat, as the report's hit rate says, and for more
	// requests than round-robin.
	f, err := os.Open(reqs)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dec := json.NewDecoder(f)
	cachedReqs := map[string]int{}
	for p, policy := range []string{"round-robin", "kv", "kv-approx"} {
		for r := range 2 {
			for i := range 72 {
				var rec sim.RequestRecord
				if err := dec.Decode(&rec); err != nil {
					t.Fatalf("requests line %d: %v", (p*2+r)*72+i+1, err)
				}
				if rec.Policy != policy || rec.Rep != r || rec.Seed != uint64(3+r) || !rec.Done || rec.TTFTMs == nil {
					t.Fatalf("requests line %d: %+v, want policy %s rep %d seed %d, done", (p*2+r)*72+i+1, rec, policy, r, 3+r)
				}
				if rec.CachedTokens > 0 && r == 0 {
					cachedReqs[policy]++
				}
			}
		}
	}
	if dec.More() {
		t.Fatalf("requests: more than 3 policies × 2 reps × 72 lines")
	}
	if cachedReqs["kv"] < 58 || cachedReqs["kv"] <= cachedReqs["round-robin"] {
		t.Fatalf("requests with cached tokens, rep 0: %v", cachedReqs)
	}
	if st, err := os.Stat(plot); err != nil || st.Size() == 0 {
		t.Fatalf("plot: %v", err)
	}
}

// A peer policy whose binary is missing fails the run with a message that
// says how to build it.
func TestSimPeerPolicyMissingBinary(t *testing.T) {
	t.Setenv("KVBENCH_PEER_DIR", t.TempDir())
	var stdout, stderr strings.Builder
	code := run([]string{"sim", "--policies", "kv,gaie", "--requests", "20"}, &stdout, &stderr)
	if code != cli.ExitFail || !strings.Contains(stderr.String(), "make build") {
		t.Fatalf("exit %d, stderr %q", code, stderr.String())
	}
}
