package main

import (
	"flag"
	"fmt"
	"io"
	"math"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/cmd/internal/disaggflag"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/disagg"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/progress"
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
	Progress progress.Flags
}

// parseDisaggFlags parses kvbench disagg's arguments; every error is a
// usage error, flag.ErrHelp for -h.
func parseDisaggFlags(args []string, output io.Writer) (*disaggOptions, error) {
	o := &disaggOptions{}
	fs := flag.NewFlagSet("kvbench disagg", flag.ContinueOnError)
	fs.SetOutput(output)
	var links, prompts, modes, profile, think string
	var perTransfer float64
	b := &o.Grid.Base
	if err := registerServeSettings(fs, b, &profile); err != nil {
		return nil, err
	}
	// The grid's axes are lists of what kvrouter serve takes one of; its
	// spellings name them too (--disagg-link-mbps 104 is a one-link grid).
	fs.StringVar(&links, "link-mbps", "100,1000,10000,50000", "comma list of KV link throughputs in MB/s (10⁶ bytes), shared fairly by concurrent transfers")
	fs.StringVar(&links, "disagg-link-mbps", "100,1000,10000,50000", "alias of --link-mbps (kvrouter serve's spelling)")
	fs.StringVar(&prompts, "prompt-tokens", "500,1500,3000,8000,32000", "comma list of prompt lengths (tokens)")
	fs.StringVar(&modes, "modes", "off,always,auto", "comma list of --disagg modes run side by side")
	fs.StringVar(&modes, "disagg", "off,always,auto", "alias of --modes (kvrouter serve's spelling)")
	fs.IntVar(&b.Concurrency, "concurrency", 4, "closed-loop clients")
	fs.IntVar(&b.Requests, "requests", 200, "requests per run")
	fs.IntVar(&b.OutputTokens, "output-tokens", 64, "tokens generated per request")
	fs.IntVar(&b.PrefillWorkers, "prefill-workers", 1, "prefill-only workers")
	fs.IntVar(&b.DecodeWorkers, "decode-workers", 1, "decode-only workers (they also serve aggregated requests)")
	fs.IntVar(&b.MaxBatchedTokens, "max-batched-tokens", engine.DefaultMaxBatchedTokens, "per-step token budget (chunks long prefills)")
	fs.IntVar(&b.MaxRunning, "max-running", engine.DefaultMaxRunning, "max running sequences per worker")
	fs.IntVar(&b.KVCapacityTokens, "kv-capacity-tokens", 262_144, "KV cache capacity per worker, in tokens")
	fs.IntVar(&b.BlockSize, "block-size", 16, "tokens per KV block (router hashes)")
	fs.Float64Var(&perTransfer, "link-per-transfer-mbps", 0, "cap on one transfer's throughput in MB/s (0 = none)")
	fs.IntVar(&b.PrefixGroups, "prefix-groups", 0, "requests share one of N prefixes (0 = unique prompts)")
	fs.IntVar(&b.PrefixTokens, "prefix-tokens", 0, "tokens of each shared prefix (with --prefix-groups)")
	fs.IntVar(&b.FailEvery, "fail-every", 0, "every Nth transfer fails (retried, then served aggregated); 0 = none")
	fs.Float64Var(&b.InterferenceWeight, "interference-weight", 0, "auto: weight of the decode stall an aggregated prefill causes (0 = TTFT only)")
	fs.StringVar(&think, "think-time", "0s", "mean of each client's exponential wait before a request (0 = closed loop without think time)")
	fs.Uint64Var(&b.Seed, "seed", 1, "seed of the router's tie-breaks and the prompts' hashes")
	fs.Float64Var(&o.Grid.Bound, "bound", 1.05, "check: auto's p50 TTFT ≤ bound × min(off, always)")
	fs.BoolVar(&o.Strict, "strict", false, "exit 1 when the auto bound fails in any cell")
	fs.BoolVar(&o.Seed001, "seed001", true, "also reproduce seed 001 §4.5 (104 MB/s, 1,500/3,000 tokens, concurrency 1 and 4)")
	fs.IntVar(&o.Grid.Parallel, "parallel", 0, "simulations run at once (default GOMAXPROCS)")
	fs.StringVar(&o.JSON, "json", "", "write the JSON report to this file")
	fs.StringVar(&o.Plot, "plot", "", "write a PNG of p50 TTFT against link speed, one line per mode, to this file")
	o.Progress.Register(fs)
	if err := cli.Parse(fs, args); err != nil {
		return nil, err
	}
	if err := o.Progress.Check(); err != nil {
		return nil, cli.Usagef("%v", err)
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
	if err := b.KV.Validate(); err != nil {
		return nil, cli.Usagef("KV size: %v", err)
	}
	if b.Profile, err = engine.LookupProfile(profile); err != nil {
		return nil, cli.Usagef("--profile %q: unknown (have %s)", profile, strings.Join(engine.Profiles(), ", "))
	}
	if b.Link.Latency < 0 {
		return nil, cli.Usagef("--link-latency %v: want a non-negative duration such as 2ms", b.Link.Latency)
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

// registerServeSettings defines the settings kvbench disagg shares with
// kvrouter serve, parsed by disaggflag: kvbench's own names first (its
// README and BENCHMARKS use them), serve's --disagg-* names as aliases.
// Two defaults differ from serve's: the simulator reproduces seed 001, so
// its profile is seed001-small; the KV size is the same Qwen3-0.6B shape.
// A positive --kv-bytes-per-token wins over --kv-shape, as in serve.
func registerServeSettings(fs *flag.FlagSet, b *disagg.Config, profile *string) error {
	flags := []disaggflag.Flag{
		rename(disaggflag.KVBytesPerToken(&b.KV), "kv-bytes-per-token", ""),
		rename(disaggflag.ModelShape(&b.KV), "kv-shape", ""),
		rename(disaggflag.Profile(profile), "profile", engine.ProfileSeed001Small),
		rename(disaggflag.LinkMaxTransfers(&b.Link.MaxConcurrent), "link-max-concurrent", ""),
		rename(disaggflag.LinkLatency(&b.Link.Latency), "link-latency", ""),
		rename(disaggflag.TransferRetries(&b.TransferRetries), "transfer-retries", ""),
	}
	for _, f := range flags {
		if err := f.Register(fs); err != nil {
			return err
		}
	}
	return nil
}

// rename puts kvbench's name for a shared setting first, so help lists
// serve's name as its alias, and sets kvbench's default when def != "".
func rename(f disaggflag.Flag, name, def string) disaggflag.Flag {
	f.Names = append([]string{name}, f.Names...)
	if def != "" {
		f.Default = def
	}
	return f
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

// runDisaggGrid runs the grid and, with --seed001, the reproduction,
// showing their simulations' progress on stderr.
func runDisaggGrid(o *disaggOptions, stderr io.Writer) (*disagg.Report, error) {
	var done atomic.Int64
	gridRuns, total := o.Grid.Runs(), o.Grid.Runs()
	if o.Seed001 {
		total += disagg.Seed001Runs
	}
	stop := progress.Start(stderr, progress.Meter{Name: "kvbench disagg", Unit: "runs", Total: int64(total), Count: done.Load},
		o.Progress.Options(stderr))
	defer stop()
	rep, err := o.Grid.Run(func(d, _ int) { done.Store(int64(d)) })
	if err != nil {
		return nil, err
	}
	if o.Seed001 {
		rep.Seed001, err = disagg.RunSeed001(o.Grid.Base, o.Grid.Parallel, func(d, _ int) { done.Store(int64(gridRuns + d)) })
		if err != nil {
			return nil, fmt.Errorf("seed 001: %w", err)
		}
	}
	return rep, nil
}

// runDisagg is the `kvbench disagg` subcommand.
func runDisagg(args []string, stdout, stderr io.Writer) int {
	o, err := parseDisaggFlags(args, stderr)
	if code, failed := cli.ParseFailed("disagg", err, stderr); failed {
		return code
	}
	rep, err := runDisaggGrid(o, stderr)
	if err != nil {
		return cli.Fail(stderr, "disagg", err, cli.ExitFail)
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
