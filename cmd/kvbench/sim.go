package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/router"
)

// simOptions are kvbench sim's validated flags.
type simOptions struct {
	Workers          int
	KVBlocks         []int // one per worker
	BlockSize        int
	MaxBatchedTokens int
	MaxRunning       int
	Profile          string
	Speedup          float64
	EventDelay       time.Duration
	EngineHashSeed   uint64

	Policies         []router.Mode
	PrefillLoadScale *float64 // nil: the router's default
	OverlapCredit    *float64
	Temperature      *float64

	Seed     uint64
	Reps     int
	Parallel int

	// Synthetic workload.
	Prefixes     int
	PrefixTokens int
	TailTokens   int
	OutputTokens int
	Requests     int
	Concurrency  int
	PrefixOrder  string
	Popularity   string
	HotShift     int

	// Trace workload.
	Trace       string
	MaxRequests int

	JSON       string
	Plot       string
	CPUProfile string
	Progress   bool
}

// errUsage marks a flag problem: kvbench prints it and exits 2.
var errUsage = errors.New("usage")

// parseFailed turns a flag-parsing outcome into the exit code: help is
// success, anything else a usage error printed without its "usage: " prefix.
func parseFailed(cmd string, err error, stderr io.Writer) (int, bool) {
	switch {
	case err == nil:
		return 0, false
	case errors.Is(err, flag.ErrHelp):
		return exitOK, true
	}
	fmt.Fprintf(stderr, "kvbench %s: %s\n", cmd, strings.TrimPrefix(err.Error(), errUsage.Error()+": "))
	return exitUsage, true
}

// checkSynthetic validates the synthetic prefix workload shared by sim and load.
func checkSynthetic(prefixes, prefixTokens, tailTokens int) error {
	switch {
	case prefixes < 1:
		return usagef("--prefixes %d: need at least one", prefixes)
	case prefixTokens < 0 || tailTokens < 0:
		return usagef("--prefix-tokens and --tail-tokens must not be negative")
	case prefixTokens+tailTokens < 1:
		return usagef("--prefix-tokens + --tail-tokens must be at least one token")
	}
	return nil
}

func usagef(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{errUsage}, args...)...)
}

// synthetic-only flags, rejected with --trace.
var syntheticFlags = []string{"prefixes", "prefix-tokens", "tail-tokens", "output-tokens", "requests", "concurrency", "prefix-order", "popularity", "hot-shift"}

// parseSimFlags parses and validates kvbench sim's arguments. Every error it
// returns is a usage error (exit code 2); flag.ErrHelp for -h.
func parseSimFlags(args []string, output io.Writer) (*simOptions, error) {
	o := &simOptions{}
	fs := flag.NewFlagSet("kvbench sim", flag.ContinueOnError)
	fs.SetOutput(output)
	var kvBlocks, policies, eventDelay string
	var scale, credit, temp float64
	fs.IntVar(&o.Workers, "workers", 6, "number of simulated engines")
	fs.StringVar(&kvBlocks, "kv-blocks", "16384", "KV cache capacity in blocks: one number for every worker, or a comma list, one per worker")
	fs.IntVar(&o.BlockSize, "block-size", 16, "tokens per KV block (engines and router)")
	fs.IntVar(&o.MaxBatchedTokens, "max-batched-tokens", engine.DefaultMaxBatchedTokens, "engine token budget per step")
	fs.IntVar(&o.MaxRunning, "max-running", engine.DefaultMaxRunning, "engine max running sequences")
	fs.StringVar(&o.Profile, "profile", engine.ProfileDynamoMocker, "engine timing profile: "+strings.Join(engine.Profiles(), ", "))
	fs.Float64Var(&o.Speedup, "speedup", 1, "divides engine step times and trace arrival times")
	fs.StringVar(&eventDelay, "event-delay", "5ms", "virtual delay from an engine's KV event to the router's index")
	fs.Uint64Var(&o.EngineHashSeed, "engine-hash-seed", 0, "0: engines name blocks by content hash; N: worker i names them with seed N+i (opaque engine hashes)")
	fs.StringVar(&policies, "policies", "round-robin,kv", "comma list of policies (router modes) run side by side: "+modeNames())
	fs.Float64Var(&scale, "prefill-load-scale", 0, "kv-family policies: prefill load scale (default: the router's)")
	fs.Float64Var(&credit, "overlap-credit", 0, "kv-family policies: overlap score credit in [0,1] (default: the router's)")
	fs.Float64Var(&temp, "temperature", 0, "kv-family policies: selection temperature (default: the router's)")
	fs.Uint64Var(&o.Seed, "seed", 1, "seed of the workload and the router; rep k uses seed+k")
	fs.IntVar(&o.Reps, "reps", 1, "repetitions (seeds seed, seed+1, …); figures are medians over reps")
	fs.IntVar(&o.Parallel, "parallel", 0, "simulations run at once (default GOMAXPROCS)")
	fs.IntVar(&o.Prefixes, "prefixes", 7, "synthetic: number of shared prefixes")
	fs.IntVar(&o.PrefixTokens, "prefix-tokens", 2032, "synthetic: tokens per shared prefix")
	fs.IntVar(&o.TailTokens, "tail-tokens", 339, "synthetic: fresh random tokens after the prefix")
	fs.IntVar(&o.OutputTokens, "output-tokens", 64, "synthetic: tokens generated per request")
	fs.IntVar(&o.Requests, "requests", 1200, "synthetic: requests per run")
	fs.IntVar(&o.Concurrency, "concurrency", 8, "synthetic: closed-loop clients")
	fs.StringVar(&o.PrefixOrder, "prefix-order", workload.PrefixRandom, "synthetic: random (each request draws a prefix uniformly) or shuffled (every prefix equally often, in random order)")
	fs.StringVar(&o.Popularity, "popularity", "uniform", "synthetic: how requests pick prefixes: uniform, or zipf:S (rank r with probability ∝ 1/(r+1)^S)")
	fs.IntVar(&o.HotShift, "hot-shift", 0, "synthetic: every N requests deal the popularity ranks to the prefixes anew (a hot set that moves); 0 = never")
	fs.StringVar(&o.Trace, "trace", "", "Mooncake trace (JSONL) to replay open loop instead of the synthetic workload")
	fs.IntVar(&o.MaxRequests, "max-requests", 0, "trace: replay only the first N rows (0 = all)")
	fs.StringVar(&o.JSON, "json", "", "write the JSON report to this file")
	fs.StringVar(&o.Plot, "plot", "", "write a PNG chart (hit rate, TTFT p50/p99 per policy) to this file")
	fs.StringVar(&o.CPUProfile, "cpuprofile", "", "write a CPU profile to this file")
	fs.BoolVar(&o.Progress, "progress", false, "show progress on stderr even when it is not a terminal")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, err
		}
		return nil, fmt.Errorf("%w: %v", errUsage, err)
	}
	if fs.NArg() > 0 {
		return nil, usagef("unexpected argument %q", fs.Arg(0))
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })

	if o.Workers < 1 {
		return nil, usagef("--workers %d: need at least one worker", o.Workers)
	}
	if o.BlockSize < 1 {
		return nil, usagef("--block-size %d: must be positive", o.BlockSize)
	}
	var err error
	if o.KVBlocks, err = parseKVBlocks(kvBlocks, o.Workers); err != nil {
		return nil, err
	}
	if o.MaxBatchedTokens < 1 {
		return nil, usagef("--max-batched-tokens %d: must be positive", o.MaxBatchedTokens)
	}
	if o.MaxRunning < 1 {
		return nil, usagef("--max-running %d: must be positive", o.MaxRunning)
	}
	if _, err := engine.LookupProfile(o.Profile); err != nil {
		return nil, usagef("--profile %q: unknown (have %s)", o.Profile, strings.Join(engine.Profiles(), ", "))
	}
	if !(o.Speedup > 0) || math.IsInf(o.Speedup, 0) {
		return nil, usagef("--speedup %v: must be a positive number", o.Speedup)
	}
	if o.EventDelay, err = time.ParseDuration(eventDelay); err != nil || o.EventDelay < 0 {
		return nil, usagef("--event-delay %q: want a non-negative duration such as 5ms", eventDelay)
	}
	if o.Policies, err = parsePolicies(policies); err != nil {
		return nil, err
	}
	if set["prefill-load-scale"] {
		o.PrefillLoadScale = &scale
	}
	if set["overlap-credit"] {
		o.OverlapCredit = &credit
	}
	if set["temperature"] {
		o.Temperature = &temp
	}
	for _, m := range o.Policies {
		if err := o.routerConfig(m).Validate(); err != nil {
			return nil, usagef("policy %s: %v", m, err)
		}
	}
	if o.Reps < 1 {
		return nil, usagef("--reps %d: need at least one", o.Reps)
	}
	if o.Parallel < 0 {
		return nil, usagef("--parallel %d: must not be negative", o.Parallel)
	}
	if o.Parallel == 0 {
		o.Parallel = runtime.GOMAXPROCS(0)
	}

	if o.Trace != "" {
		for _, name := range syntheticFlags {
			if !set[name] {
				continue
			}
			if name == "concurrency" {
				return nil, usagef("--concurrency does not apply to --trace: a trace is replayed open loop at its timestamps (rows with a session_id run as closed-loop turns by themselves)")
			}
			return nil, usagef("--%s configures the synthetic workload; it cannot be combined with --trace", name)
		}
		if o.MaxRequests < 0 {
			return nil, usagef("--max-requests %d: must not be negative", o.MaxRequests)
		}
		return o, nil
	}
	if set["max-requests"] {
		return nil, usagef("--max-requests applies to --trace only (use --requests for the synthetic workload)")
	}
	if err := checkSynthetic(o.Prefixes, o.PrefixTokens, o.TailTokens); err != nil {
		return nil, err
	}
	switch {
	case o.OutputTokens < 1:
		return nil, usagef("--output-tokens %d: need at least one", o.OutputTokens)
	case o.Requests < 1:
		return nil, usagef("--requests %d: need at least one", o.Requests)
	case o.Concurrency < 1:
		return nil, usagef("--concurrency %d: need at least one client", o.Concurrency)
	case o.PrefixOrder != workload.PrefixRandom && o.PrefixOrder != workload.PrefixShuffled:
		return nil, usagef("--prefix-order %q: want %s or %s", o.PrefixOrder, workload.PrefixRandom, workload.PrefixShuffled)
	case o.HotShift < 0:
		return nil, usagef("--hot-shift %d: must not be negative", o.HotShift)
	case o.PrefixOrder == workload.PrefixShuffled && (set["popularity"] || set["hot-shift"]):
		return nil, usagef("--prefix-order shuffled sends every prefix equally often: it cannot be combined with --popularity or --hot-shift")
	}
	if _, err := workload.ParsePopularity(o.Popularity); err != nil {
		return nil, usagef("--popularity %q: want uniform or zipf:S with S > 0", o.Popularity)
	}
	// A request must fit in every worker's cache, or it could never run there.
	need := o.PrefixTokens + o.TailTokens + o.OutputTokens
	for i, b := range o.KVBlocks {
		if need > b*o.BlockSize {
			return nil, usagef("a request needs %d tokens (%d prompt + %d output) but worker %d holds only %d blocks of %d tokens (%d): raise --kv-blocks",
				need, o.PrefixTokens+o.TailTokens, o.OutputTokens, i, b, o.BlockSize, b*o.BlockSize)
		}
	}
	return o, nil
}

func parseKVBlocks(s string, workers int) ([]int, error) {
	parts := strings.Split(s, ",")
	if len(parts) != 1 && len(parts) != workers {
		return nil, usagef("--kv-blocks lists %d capacities for %d workers: give one number, or exactly one per worker", len(parts), workers)
	}
	vals := make([]int, len(parts))
	for i, p := range parts {
		v, err := strconv.Atoi(strings.TrimSpace(p))
		if err != nil {
			return nil, usagef("--kv-blocks %q: %q is not a whole number", s, p)
		}
		if v < 1 {
			return nil, usagef("--kv-blocks: capacity %d blocks cannot hold a single block", v)
		}
		if v > math.MaxInt32-1 {
			return nil, usagef("--kv-blocks: capacity %d blocks is too large", v)
		}
		vals[i] = v
	}
	if len(vals) == 1 {
		for len(vals) < workers {
			vals = append(vals, vals[0])
		}
	}
	return vals, nil
}

func modeNames() string {
	names := make([]string, len(router.Modes))
	for i, m := range router.Modes {
		names[i] = string(m)
	}
	return strings.Join(names, ", ")
}

func parsePolicies(s string) ([]router.Mode, error) {
	var out []router.Mode
	seen := map[router.Mode]bool{}
	for _, p := range strings.Split(s, ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			return nil, usagef("--policies %q: empty policy name", s)
		}
		m, err := router.ParseMode(p)
		if err != nil {
			return nil, usagef("unknown policy %q (known: %s)", p, modeNames())
		}
		if seen[m] {
			return nil, usagef("--policies %q: %s listed twice", s, m)
		}
		seen[m] = true
		out = append(out, m)
	}
	return out, nil
}

// kvFamily: the knob flags apply to policies that score cache overlap.
func kvFamily(m router.Mode) bool { return strings.HasPrefix(string(m), "kv") }

// routerConfig is the router configuration of policy m: Dynamo's defaults,
// the block size, and for kv-family policies the knob flags.
func (o *simOptions) routerConfig(m router.Mode) router.Config {
	c := router.DefaultConfig()
	c.Mode = m
	c.BlockSize = o.BlockSize
	if kvFamily(m) {
		if o.PrefillLoadScale != nil {
			c.PrefillLoadScale = *o.PrefillLoadScale
		}
		if o.OverlapCredit != nil {
			c.OverlapCredit = *o.OverlapCredit
		}
		if o.Temperature != nil {
			c.Temperature = *o.Temperature
		}
	}
	return c
}

// engineConfig is every worker's engine template.
func (o *simOptions) engineConfig() engine.Config {
	return engine.Config{
		BlockSize:        o.BlockSize,
		MaxRunning:       o.MaxRunning,
		MaxBatchedTokens: o.MaxBatchedTokens,
		Profile:          o.Profile,
		Speedup:          o.Speedup,
		EngineHashSeed:   o.EngineHashSeed,
	}
}
