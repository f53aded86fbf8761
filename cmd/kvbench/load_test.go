package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
)

func TestLoadFlagValidation(t *testing.T) {
	u := "http://127.0.0.1:8001"
	good := [][]string{
		{"--target", u},
		{"--target", u + ",http://127.0.0.1:8002,http://localhost:8003"},
		{"--direct", "http://127.0.0.1:9001"},
		{"--target", u, "--direct", "http://127.0.0.1:9001", "--requests", "200", "--concurrency", "1", "--salt", "7"},
		{"--target", u, "--prefixes", "24", "--prefix-tokens", "0", "--tail-tokens", "16", "--output-tokens", "1", "--prefix-order", "shuffled"},
	}
	for _, args := range good {
		if _, err := parseLoadFlags(args, io.Discard); err != nil {
			t.Errorf("%q: %v", args, err)
		}
	}
	bad := map[string][]string{
		"nothing to send to": {},
		"empty target":       {"--target", ","},
		"remote target":      {"--target", "http://192.168.1.1:8001"},
		"remote direct":      {"--direct", "http://example.com:9001"},
		"target twice":       {"--target", u + "," + u},
		"no prefixes":        {"--target", u, "--prefixes", "0"},
		"empty prompt":       {"--target", u, "--prefix-tokens", "0", "--tail-tokens", "0"},
		"negative tail":      {"--target", u, "--tail-tokens", "-1"},
		"no output":          {"--target", u, "--output-tokens", "0"},
		"no requests":        {"--target", u, "--requests", "0"},
		"no clients":         {"--target", u, "--concurrency", "0"},
		"prefix order":       {"--target", u, "--prefix-order", "sorted"},
		"block size":         {"--target", u, "--block-size", "0"},
		"timeout":            {"--target", u, "--timeout", "0s"},
		"max duration":       {"--target", u, "--max-duration", "-1s"},
		"salt":               {"--target", u, "--salt", "4294967295"},
		"stray argument":     {"--target", u, "x"},
	}
	for name, args := range bad {
		if _, err := parseLoadFlags(args, io.Discard); !errors.Is(err, cli.ErrUsage) {
			t.Errorf("%s %q: err %v, want a usage error", name, args, err)
		}
		var stdout, stderr strings.Builder
		if code := run(append([]string{"load"}, args...), &stdout, &stderr); code != cli.ExitUsage {
			t.Errorf("%s: exit %d, want 2 (%s)", name, code, stderr.String())
		}
	}
}

// fakeWorker is an OpenAI endpoint with a block-level prefix cache: a
// prompt's cached tokens are the full blocks of its longest prefix seen
// before (by this endpoint), as an engine would report them.
type fakeWorker struct {
	id        string
	blockSize int
	fail      bool

	mu     sync.Mutex
	seen   map[string]bool
	prompt []int // prompt tokens of every request, in arrival order
}

func (f *fakeWorker) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/v1/models" {
		fmt.Fprint(w, `{"data":[{"id":"fake-model"}]}`)
		return
	}
	if r.URL.Path == "/workers" {
		fmt.Fprint(w, `{"models":{"fake-model":[{"id":"a","url":"http://x","total_kv_blocks":100},{"id":"b","url":"http://y","total_kv_blocks":100}]}}`)
		return
	}
	var req struct {
		Model  string `json:"model"`
		Prompt string `json:"prompt"`
	}
	_ = json.NewDecoder(r.Body).Decode(&req)
	if f.fail || req.Model != "fake-model" {
		http.Error(w, `{"error":{"message":"down"}}`, http.StatusServiceUnavailable)
		return
	}
	toks := tokenize.Builtin().Encode(req.Prompt)
	f.mu.Lock()
	f.prompt = append(f.prompt, len(toks))
	cached := 0
	for n := f.blockSize; n <= len(toks); n += f.blockSize {
		key := fmt.Sprint(toks[:n])
		if f.seen[key] && cached == n-f.blockSize {
			cached = n
		}
		f.seen[key] = true
	}
	f.mu.Unlock()
	w.Header().Set("X-Worker-Id", f.id)
	w.Header().Set("Content-Type", "text/event-stream")
	fmt.Fprint(w, "data: {\"choices\":[{\"text\":\"x\"}]}\n\n")
	fmt.Fprintf(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":%d,\"prompt_tokens_details\":{\"cached_tokens\":%d}}}\n\n", len(toks), cached)
	fmt.Fprint(w, "data: [DONE]\n\n")
}

func TestLoadAgainstFakeEndpoints(t *testing.T) {
	a := &fakeWorker{id: "a", blockSize: 16, seen: map[string]bool{}}
	b := &fakeWorker{id: "b", blockSize: 16, seen: map[string]bool{}}
	sa, sb := httptest.NewServer(a), httptest.NewServer(b)
	defer sa.Close()
	defer sb.Close()
	out := filepath.Join(t.TempDir(), "load.json")
	args := []string{"load", "--target", sa.URL + "," + sb.URL, "--prefixes", "3", "--prefix-tokens", "64", "--tail-tokens", "20",
		"--output-tokens", "4", "--requests", "30", "--concurrency", "1", "--seed", "5", "--salt", "11", "--json", out}
	var stdout, stderr strings.Builder
	if code := run(args, &stdout, &stderr); code != cli.ExitOK {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if !strings.Contains(stdout.String(), "kvbench load live") {
		t.Fatalf("console: %q", stdout.String())
	}
	// Every prompt has exactly prefix+tail tokens, and requests alternate.
	if len(a.prompt) != 15 || len(b.prompt) != 15 {
		t.Fatalf("requests per endpoint %d %d, want 15 15", len(a.prompt), len(b.prompt))
	}
	for _, n := range append(a.prompt, b.prompt...) {
		if n != 84 {
			t.Fatalf("prompt of %d tokens, want 84", n)
		}
	}
	// Expected hits: request i (to endpoint i%2) hits when that endpoint
	// saw its prefix before (64 cached tokens >= 32).
	w, _ := workload.NewSynthetic(workload.SyntheticSpec{Prefixes: 3, PrefixTokens: 64, TailTokens: 20, OutputTokens: 4,
		Requests: 30, Concurrency: 1, BlockSize: 16, Seed: 5})
	seen := [2]map[int]bool{{}, {}}
	hits := 0
	for i, r := range w.Requests {
		if seen[i%2][r.Prefix] {
			hits++
		}
		seen[i%2][r.Prefix] = true
	}
	raw, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var rep struct {
		Config    map[string]any     `json:"config"`
		Reference map[string]float64 `json:"reference"`
		Results   []map[string]any   `json:"results"`
	}
	if err := json.Unmarshal(raw, &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Results) != 1 {
		t.Fatalf("results %v", rep.Results)
	}
	r := rep.Results[0]
	for _, k := range []string{"policy", "requests", "request_hit_rate", "cached_token_ratio", "ttft_ms", "e2e_ms", "throughput_rps", "errors"} {
		if _, ok := r[k]; !ok {
			t.Fatalf("result lacks %q: %s", k, raw)
		}
	}
	if r["policy"] != "live" || r["requests"] != 30.0 || r["errors"] != 0.0 || r["prompt_token_mismatches"] != 0.0 {
		t.Fatalf("result %v", r)
	}
	if got, want := r["request_hit_rate"].(float64), float64(hits)/30; got != want {
		t.Fatalf("hit rate %v, want %v", got, want)
	}
	if got, want := r["cached_token_ratio"].(float64), float64(hits*64)/float64(30*84); got != want {
		t.Fatalf("cached ratio %v, want %v", got, want)
	}
	if rep.Config["capacity_blocks"] != 200.0 || rep.Reference["ideal_cached_token_ratio"] <= 0 || rep.Reference["pooled_lru_cached_token_ratio"] <= 0 {
		t.Fatalf("config %v reference %v", rep.Config, rep.Reference)
	}
	pw, _ := r["per_worker"].([]any)
	if len(pw) != 2 {
		t.Fatalf("per worker %v", r["per_worker"])
	}
}

func TestLoadErrorsAndDirect(t *testing.T) {
	good := &fakeWorker{id: "ok", blockSize: 16, seen: map[string]bool{}}
	down := &fakeWorker{id: "down", blockSize: 16, seen: map[string]bool{}, fail: true}
	sg, sd := httptest.NewServer(good), httptest.NewServer(down)
	defer sg.Close()
	defer sd.Close()
	o, err := parseLoadFlags([]string{"--target", sg.URL + "," + sd.URL, "--direct", sg.URL, "--model", "fake-model",
		"--prefixes", "2", "--prefix-tokens", "32", "--tail-tokens", "8", "--output-tokens", "2", "--requests", "20", "--concurrency", "3"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := executeLoad(context.Background(), o, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Results) != 2 || rep.Results[0].Policy != "live" || rep.Results[1].Policy != "direct" {
		t.Fatalf("results %+v", rep.Results)
	}
	live, direct := rep.Results[0], rep.Results[1]
	if live.Errors != 10 || live.Completed != 10 || len(live.ErrorSamples) == 0 || !strings.Contains(live.ErrorSamples[0], "503") {
		t.Fatalf("live: errors %d completed %d samples %v", live.Errors, live.Completed, live.ErrorSamples)
	}
	if direct.Errors != 0 || direct.Completed != 20 || direct.TTFT.P50 <= 0 || direct.E2E.P50 < direct.TTFT.P50 {
		t.Fatalf("direct: %+v", direct.Result)
	}
	// The direct pass used other text (salt+1): its first request on each
	// prefix missed although the live pass had sent that prefix there.
	if direct.RequestHitRate >= 1 {
		t.Fatalf("direct hit rate %v", direct.RequestHitRate)
	}
}

// sim and load share one set of workload defaults: load with no workload
// flags replays the requests sim simulates with none.
func TestLoadWorkloadDefaultsAreSims(t *testing.T) {
	s, err := parseSimFlags(nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	l, err := parseLoadFlags([]string{"--target", "http://127.0.0.1:8001"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if s.Workload != l.Workload || s.Seed != l.Seed || s.BlockSize != l.BlockSize {
		t.Fatalf("sim %+v seed %d block %d; load %+v seed %d block %d", s.Workload, s.Seed, s.BlockSize, l.Workload, l.Seed, l.BlockSize)
	}
	if s.Requests != cli.DefaultRequests {
		t.Fatalf("--requests default %d", s.Requests)
	}
}

// barrierWorker answers no request until n have arrived: only an open loop
// (every request sent at its arrival, whether or not earlier ones were
// answered) gets past it.
type barrierWorker struct {
	fakeWorker
	n       int
	arrived atomic.Int64
	all     chan struct{}
}

func (b *barrierWorker) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/v1/completions" {
		if b.arrived.Add(1) == int64(b.n) {
			close(b.all)
		}
		select {
		case <-b.all:
		case <-r.Context().Done():
			return
		}
	}
	b.fakeWorker.ServeHTTP(w, r)
}

func TestLoadOpenLoop(t *testing.T) {
	const n = 12
	bw := &barrierWorker{fakeWorker: fakeWorker{id: "a", blockSize: 16, seen: map[string]bool{}}, n: n, all: make(chan struct{})}
	srv := httptest.NewServer(bw)
	defer srv.Close()
	out := filepath.Join(t.TempDir(), "load.json")
	args := []string{"load", "--target", srv.URL, "--model", "fake-model", "--prefixes", "2", "--prefix-tokens", "32", "--tail-tokens", "8",
		"--output-tokens", "4", "--requests", fmt.Sprint(n), "--arrival-rate", "200", "--slo-ttft-ms", "60000", "--timeout", "30s", "--json", out}
	var stdout, stderr strings.Builder
	if code := run(args, &stdout, &stderr); code != cli.ExitOK {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	raw, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var rep struct {
		Config struct {
			Synthetic struct {
				Rate float64 `json:"arrival_rate"`
			} `json:"synthetic"`
		} `json:"config"`
		Results []struct {
			Errors     int     `json:"errors"`
			Attainment float64 `json:"slo_attainment"`
			TPOT       struct {
				P50 float64 `json:"p50"`
			} `json:"tpot_ms"`
		} `json:"results"`
	}
	if err := json.Unmarshal(raw, &rep); err != nil {
		t.Fatal(err)
	}
	if rep.Config.Synthetic.Rate != 200 || len(rep.Results) != 1 || rep.Results[0].Errors != 0 || rep.Results[0].Attainment != 1 {
		t.Fatalf("report %s", raw)
	}
}
