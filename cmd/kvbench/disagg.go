package main

import (
	"flag"
	"fmt"
	"io"
	"math"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/disagg"
	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/router"
)

// disaggOptions are kvbench disagg's validated flags.
type disaggOptions struct {
	Grid     disagg.Grid
	Seed001  bool
	JSON     string
	Plot     string
	Strict   bool
	Progress bool
}

// parseDisaggFlags parses kvbench disagg's arguments; every error is a
// usage error, flag.ErrHelp for -h.
func parseDisaggFlags(args []string, output io.Writer) (*disaggOptions, error) {
	o := &disaggOptions{}
	fs := flag.NewFlagSet("kvbench disagg", flag.ContinueOnError)
	fs.SetOutput(output)
	var links, prompts, modes, kvShape, profile, latency, think string
	var bytesPerToken int64
	var perTransfer float64
	b := &o.Grid.Base
	fs.StringVar(&links, "link-mbps", "100,1000,10000,50000", "comma list of KV link throughputs in MB/s (10⁶ bytes), shared fairly by concurrent transfers")
	fs.StringVar(&prompts, "prompt-tokens", "500,1500,3000,8000,32000", "comma list of prompt lengths (tokens)")
	fs.StringVar(&modes, "modes", "off,always,auto", "comma list of --disagg modes run side by side")
	fs.IntVar(&b.Concurrency, "concurrency", 4, "closed-loop clients")
	fs.IntVar(&b.Requests, "requests", 200, "requests per run")
	fs.IntVar(&b.OutputTokens, "output-tokens", 64, "tokens generated per request")
	fs.IntVar(&b.PrefillWorkers, "prefill-workers", 1, "prefill-only workers")
	fs.IntVar(&b.DecodeWorkers, "decode-workers", 1, "decode-only workers (they also serve aggregated requests)")
	fs.Int64Var(&bytesPerToken, "kv-bytes-per-token", 114_688, "KV cache bytes per token (Qwen3-0.6B: 28 layers × 8 KV heads × 128 × 2 × 2 bytes)")
	fs.StringVar(&kvShape, "kv-shape", "", "layers,kv-heads,head-dim,dtype-bytes: computes the bytes per token instead of --kv-bytes-per-token")
	fs.StringVar(&profile, "profile", engine.ProfileSeed001Small, "engine timing profile: "+strings.Join(engine.Profiles(), ", "))
	fs.IntVar(&b.MaxBatchedTokens, "max-batched-tokens", engine.DefaultMaxBatchedTokens, "per-step token budget (chunks long prefills)")
	fs.IntVar(&b.MaxRunning, "max-running", engine.DefaultMaxRunning, "max running sequences per worker")
	fs.IntVar(&b.KVCapacityTokens, "kv-capacity-tokens", 262_144, "KV cache capacity per worker, in tokens")
	fs.IntVar(&b.BlockSize, "block-size", 16, "tokens per KV block (router hashes)")
	fs.Float64Var(&perTransfer, "link-per-transfer-mbps", 0, "cap on one transfer's throughput in MB/s (0 = none)")
	fs.IntVar(&b.Link.MaxConcurrent, "link-max-concurrent", 0, "transfers on the link at once; more wait in order (0 = no limit)")
	fs.StringVar(&latency, "link-latency", "0s", "fixed cost per transfer before bytes flow")
	fs.IntVar(&b.PrefixGroups, "prefix-groups", 0, "requests share one of N prefixes (0 = unique prompts)")
	fs.IntVar(&b.PrefixTokens, "prefix-tokens", 0, "tokens of each shared prefix (with --prefix-groups)")
	fs.IntVar(&b.FailEvery, "fail-every", 0, "every Nth transfer fails (retried, then served aggregated); 0 = none")
	fs.IntVar(&b.TransferRetries, "transfer-retries", 1, "retries of a failed transfer before falling back to aggregated")
	fs.Float64Var(&b.InterferenceWeight, "interference-weight", 0, "auto: weight of the decode stall an aggregated prefill causes (0 = TTFT only)")
	fs.StringVar(&think, "think-time", "0s", "mean of each client's exponential wait before a request (0 = closed loop without think time)")
	fs.Uint64Var(&b.Seed, "seed", 1, "seed of the router's tie-breaks and the prompts' hashes")
	fs.Float64Var(&o.Grid.Bound, "bound", 1.05, "check: auto's p50 TTFT ≤ bound × min(off, always)")
	fs.BoolVar(&o.Strict, "strict", false, "exit 1 when the auto bound fails in any cell")
	fs.BoolVar(&o.Seed001, "seed001", true, "also reproduce seed 001 §4.5 (104 MB/s, 1,500/3,000 tokens, concurrency 1 and 4)")
	fs.IntVar(&o.Grid.Parallel, "parallel", 0, "simulations run at once (default GOMAXPROCS)")
	fs.StringVar(&o.JSON, "json", "", "write the JSON report to this file")
	fs.StringVar(&o.Plot, "plot", "", "write a PNG of p50 TTFT against link speed, one line per mode, to this file")
	fs.BoolVar(&o.Progress, "progress", false, "print progress on stderr")
	if err := cli.Parse(fs, args); err != nil {
		return nil, err
	}
	var err error
	if o.Grid.LinkMBps, err = parseFloatList("--link-mbps", links); err != nil {
		return nil, err
	}
	for _, l := range o.Grid.LinkMBps {
		if !(l > 0) || math.IsInf(l, 0) {
			return nil, cli.Usagef("--link-mbps: %v is not a positive throughput", l)
		}
	}
	if o.Grid.PromptTokens, err = parseIntList("--prompt-tokens", prompts); err != nil {
		return nil, err
	}
	for _, m := range strings.Split(modes, ",") {
		mode, err := router.ParseDisaggMode(m)
		if err != nil || strings.TrimSpace(m) == "" {
			return nil, cli.Usagef("--modes: %q is not off, always or auto", m)
		}
		for _, seen := range o.Grid.Modes {
			if seen == mode {
				return nil, cli.Usagef("--modes: %s listed twice", mode)
			}
		}
		o.Grid.Modes = append(o.Grid.Modes, mode)
	}
	if kvShape != "" {
		dims, err := parseIntList("--kv-shape", kvShape)
		if err != nil || len(dims) != 4 {
			return nil, cli.Usagef("--kv-shape %q: want layers,kv-heads,head-dim,dtype-bytes", kvShape)
		}
		b.KV = router.ModelKV{Layers: dims[0], KVHeads: dims[1], HeadDim: dims[2], DTypeBytes: dims[3]}
	} else {
		b.KV = router.ModelKV{Given: bytesPerToken}
	}
	if err := b.KV.Validate(); err != nil {
		return nil, cli.Usagef("KV size: %v", err)
	}
	if b.Profile, err = engine.LookupProfile(profile); err != nil {
		return nil, cli.Usagef("--profile %q: unknown (have %s)", profile, strings.Join(engine.Profiles(), ", "))
	}
	if b.Link.Latency, err = time.ParseDuration(latency); err != nil || b.Link.Latency < 0 {
		return nil, cli.Usagef("--link-latency %q: want a non-negative duration such as 2ms", latency)
	}
	if b.ThinkTime, err = time.ParseDuration(think); err != nil || b.ThinkTime < 0 {
		return nil, cli.Usagef("--think-time %q: want a non-negative duration such as 500ms", think)
	}
	if !(perTransfer >= 0) || math.IsInf(perTransfer, 0) {
		return nil, cli.Usagef("--link-per-transfer-mbps %v: must be finite and non-negative", perTransfer)
	}
	b.Link.PerTransferBytesPerS = perTransfer * 1e6
	if !(o.Grid.Bound >= 1) || math.IsInf(o.Grid.Bound, 0) {
		return nil, cli.Usagef("--bound %v: want a finite ratio ≥ 1", o.Grid.Bound)
	}
	if o.Grid.Parallel < 0 {
		return nil, cli.Usagef("--parallel %d: must not be negative", o.Grid.Parallel)
	}
	if o.Grid.Parallel == 0 {
		o.Grid.Parallel = runtime.GOMAXPROCS(0)
	}
	if (b.PrefixGroups > 0) != (b.PrefixTokens > 0) {
		return nil, cli.Usagef("--prefix-groups and --prefix-tokens go together")
	}
	// Validate one cell per prompt length (the link is validated per cell).
	for _, p := range o.Grid.PromptTokens {
		c := *b
		c.PromptTokens, c.Mode = p, router.DisaggOff
		c.Link.ThroughputBytesPerS = o.Grid.LinkMBps[0] * 1e6
		if err := c.Validate(); err != nil {
			return nil, cli.Usagef("%v", err)
		}
	}
	return o, nil
}

func parseFloatList(name, s string) ([]float64, error) {
	var out []float64
	for _, p := range strings.Split(s, ",") {
		v, err := strconv.ParseFloat(strings.TrimSpace(p), 64)
		if err != nil {
			return nil, cli.Usagef("%s %q: %q is not a number", name, s, p)
		}
		out = append(out, v)
	}
	return out, nil
}

func parseIntList(name, s string) ([]int, error) {
	var out []int
	for _, p := range strings.Split(s, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(p))
		if err != nil {
			return nil, cli.Usagef("%s %q: %q is not a whole number", name, s, p)
		}
		if v < 1 {
			return nil, cli.Usagef("%s: %d must be positive", name, v)
		}
		out = append(out, v)
	}
	return out, nil
}

// runDisagg is the `kvbench disagg` subcommand.
func runDisagg(args []string, stdout, stderr io.Writer) int {
	o, err := parseDisaggFlags(args, stderr)
	if code, failed := cli.ParseFailed("disagg", err, stderr); failed {
		return code
	}
	var progress func(done, total int)
	if o.Progress {
		progress = func(done, total int) { fmt.Fprintf(stderr, "\rkvbench disagg: %d/%d runs", done, total) }
	}
	rep, err := o.Grid.Run(progress)
	if o.Progress {
		fmt.Fprintln(stderr)
	}
	if err != nil {
		return cli.Fail(stderr, "disagg", err, cli.ExitFail)
	}
	if o.Seed001 {
		if rep.Seed001, err = disagg.RunSeed001(o.Grid.Base, o.Grid.Parallel); err != nil {
			return cli.Fail(stderr, "disagg", fmt.Errorf("seed 001: %w", err), cli.ExitFail)
		}
	}
	if err := disagg.WriteTable(stdout, rep); err != nil {
		return cli.Fail(stderr, "disagg", err, cli.ExitFail)
	}
	if o.JSON != "" {
		if err := cli.WriteJSONFile(o.JSON, rep); err != nil {
			return cli.Fail(stderr, "disagg", fmt.Errorf("write report: %w", err), cli.ExitFail)
		}
	}
	if o.Plot != "" {
		if err := disagg.Plot(o.Plot, rep); err != nil {
			return cli.Fail(stderr, "disagg", fmt.Errorf("write plot: %w", err), cli.ExitFail)
		}
	}
	if o.Strict && rep.Check != nil && rep.Check.Holding < rep.Check.Cells {
		return cli.Fail(stderr, "disagg", fmt.Errorf("auto exceeds %.2f × min(off, always) in %d of %d cells",
			rep.Check.Bound, rep.Check.Cells-rep.Check.Holding, rep.Check.Cells), cli.ExitFail)
	}
	return cli.ExitOK
}
