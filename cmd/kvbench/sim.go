package main

import (
	"flag"
	"io"
	"math"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/progress"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/sim"
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
	Routers          int           // simulated routers (replicas), requests round-robin
	SyncDelay        time.Duration // replica sync lag between them
	SyncFreeExtra    time.Duration // first tokens and frees this much later still
	Repeat           int           // synthetic: the request list this many times in a row
	Timeout          time.Duration // a failed request's TTFT and E2E in the figures
	SLO              cli.SLO       // --slo-ttft-ms, --slo-tpot-ms

	Policies         []router.Mode
	PeerScrape       time.Duration // peer policies: metrics refresh interval
	PrefillLoadScale *float64      // nil: the router's default
	OverlapCredit    *float64
	Temperature      *float64
	ApproxTTL        time.Duration       // kv-approx: lifetime of a predicted block (0: the router's default)
	Pooled           router.PooledConfig // kv-pooled's --pooled-* flags (nil: the router's default)
	// TrackOutputBlocks is the router's --router-track-output-blocks
	// (router.Config.TrackOutputBlocks): the engines report output blocks
	// and the routers book them. OSLHint sends each request's output
	// length as its expected output (nvext.agent_hints.osl).
	TrackOutputBlocks bool
	OSLHint           bool

	Seed     uint64
	Reps     int
	Parallel int

	// Synthetic workload.
	cli.Workload
	Popularity string
	HotShift   int

	// Agent sessions (synthetic) and session affinity (sessions.go).
	Sessions sessionOptions
	// Fleet events (fleetflags.go).
	Fleet fleetOptions
	// The routers' admission queue and tenants (simtenants.go).
	Tenants tenantOptions

	// Trace workload.
	Trace       string
	MaxRequests int

	JSON string
	Plot string
	// RequestsOut is --requests-out: every request of every run, as
	// JSON Lines (sim.RequestRecord).
	RequestsOut string
	CPUProfile  string
	Progress    progress.Flags
}

// syntheticFlags configure the synthetic workload; sim refuses them with --trace.
func syntheticFlags() []string {
	return append(cli.WorkloadFlags(), "popularity", "hot-shift", "repeat", "session-turns", "think-time-ms", "subagents")
}

// parseSimFlags parses and validates kvbench sim's arguments. Every error it
// returns is a usage error (exit code 2); flag.ErrHelp for -h.
func parseSimFlags(args []string, output io.Writer) (*simOptions, error) {
	o := &simOptions{}
	fs := flag.NewFlagSet("kvbench sim", flag.ContinueOnError)
	fs.SetOutput(output)
	var kvBlocks, policies, eventDelay, syncDelay, syncFreeExtra, approxTTL string
	var scale, credit, temp float64
	var pEvict, pHome, pOverloaded, pQueue, pOutput float64
	var pCopy, pWait float64
	fs.IntVar(&o.Workers, "workers", 6, "number of simulated engines")
	fs.StringVar(&kvBlocks, "kv-blocks", "16384", "KV cache capacity in blocks: one number for every worker, or a comma list, one per worker")
	fs.IntVar(&o.BlockSize, "block-size", 16, "tokens per KV block (engines and router)")
	fs.IntVar(&o.MaxBatchedTokens, "max-batched-tokens", engine.DefaultMaxBatchedTokens, "engine token budget per step")
	fs.IntVar(&o.MaxRunning, "max-running", engine.DefaultMaxRunning, "engine max running sequences")
	fs.StringVar(&o.Profile, "profile", engine.ProfileDynamoMocker, "engine timing profile: "+strings.Join(engine.Profiles(), ", "))
	fs.Float64Var(&o.Speedup, "speedup", 1, "divides engine step times and trace arrival times")
	fs.StringVar(&eventDelay, "event-delay", "5ms", "virtual delay from an engine's KV event to the router's index")
	fs.IntVar(&o.Routers, "routers", 1, "simulated routers (kvrouter replicas) behind a round-robin balancer; each keeps its own load view, all read the one event-fed index")
	fs.StringVar(&syncDelay, "sync-delay", "0s", "with --routers > 1: replica sync lag, from one router's booking, first token or free to the others' load views")
	fs.StringVar(&syncFreeExtra, "sync-free-extra", "0s", "with --routers > 1: first tokens and frees reach the other routers this much later than bookings do (the phantom load of a late free)")
	fs.IntVar(&o.Repeat, "repeat", 1, "synthetic: send the request list this many times in a row (back-to-back reps with one seed, caches and router state carried over)")
	fs.DurationVar(&o.Timeout, "timeout", 60*time.Second, "a request that fails counts in TTFT and E2E as this long (kvbench load's default timeout); the simulator itself enforces none")
	fs.Uint64Var(&o.EngineHashSeed, "engine-hash-seed", 0, "0: engines name blocks by content hash; N: worker i names them with seed N+i (opaque engine hashes)")
	fs.StringVar(&policies, "policies", "round-robin,kv", "comma list of policies (router modes, or gaie: the Gateway API Inference Extension's own scheduler, bin/kvbench-gaie) run side by side: "+modeNames())
	fs.DurationVar(&o.PeerScrape, "peer-scrape-interval", defaultPeerScrape, "gaie: how often its scheduler's view of the workers' metrics is refreshed (its endpoint picker's default refresh interval; 0: at every decision)")
	fs.Float64Var(&scale, "prefill-load-scale", 0, "kv-family policies: prefill load scale (default: the router's)")
	fs.Float64Var(&credit, "overlap-credit", 0, "kv-family policies: overlap score credit in [0,1] (default: the router's)")
	fs.Float64Var(&temp, "temperature", 0, "kv-family policies: selection temperature (default: the router's)")
	fs.StringVar(&approxTTL, "approx-ttl", router.DefaultConfig().ApproxTTL.String(), "kv-approx: how long a block the router sent to a worker counts as cached there (Dynamo's --router-ttl-secs)")
	fs.Float64Var(&pEvict, "pooled-evict-weight", router.DefaultPooledEvictWeight, "kv-pooled: price of one evicted block no other worker holds, in cost units")
	fs.Float64Var(&pHome, "pooled-home-weight", router.DefaultPooledHomeWeight, "kv-pooled: price per fresh block of placing it one rank further from its rendezvous home, per 1/(N-1)")
	fs.Float64Var(&pOverloaded, "pooled-overloaded", router.DefaultPooledOverloaded, "kv-pooled: in-flight blocks over this fraction of the fleet's capacity turn the admission rule soft")
	fs.Float64Var(&pQueue, "pooled-queue-weight", router.DefaultPooledQueueWeight, "kv-pooled: price of one block of admission overflow when overloaded")
	fs.Float64Var(&pOutput, "pooled-output-tokens", 0, "kv-pooled: output tokens the decode reserve plans for (default: the mean the router observes)")
	fs.BoolVar(&o.TrackOutputBlocks, "track-output-blocks", false, "the routers book output blocks as the engines generate them (Dynamo's --router-track-output-blocks, router.Config.TrackOutputBlocks)")
	fs.BoolVar(&o.OSLHint, "sim-osl-hint", false, "send each request's output length as its expected output (nvext.agent_hints.osl): output-block tracking decays toward it; real clients rarely send it")
	fs.Float64Var(&pCopy, "pooled-copy-weight", router.DefaultPooledEvictWeight, "kv-pooled: price of recomputing one block another worker holds, when not overloaded (default: the evict weight)")
	fs.Float64Var(&pWait, "pooled-wait-weight", router.DefaultPooledWaitWeight, "kv-pooled: price of one second of expected wait for KV admission, in the worker's observed prefill blocks per second (0: no wait price, over-the-line workers excluded)")
	fs.Uint64Var(&o.Seed, "seed", 1, "seed of the workload and the router; rep k uses seed+k")
	fs.IntVar(&o.Reps, "reps", 1, "repetitions (seeds seed, seed+1, …); figures are medians over reps")
	fs.IntVar(&o.Parallel, "parallel", 0, "simulations run at once (default GOMAXPROCS)")
	o.Workload.Register(fs)
	o.SLO.Register(fs)
	fs.StringVar(&o.Popularity, "popularity", "uniform", "synthetic: how requests pick prefixes: uniform, or zipf:S (rank r with probability ∝ 1/(r+1)^S)")
	fs.IntVar(&o.HotShift, "hot-shift", 0, "synthetic: every N requests deal the popularity ranks to the prefixes anew (a hot set that moves); 0 = never")
	fs.StringVar(&o.Trace, "trace", "", "Mooncake trace (JSONL) to replay open loop instead of the synthetic workload")
	fs.IntVar(&o.MaxRequests, "max-requests", 0, "trace: replay only the first N rows (0 = all)")
	fs.StringVar(&o.JSON, "json", "", "write the JSON report to this file")
	fs.StringVar(&o.Plot, "plot", "", "write a PNG chart (hit rate, TTFT p50/p99 per policy) to this file")
	fs.StringVar(&o.RequestsOut, "requests-out", "", "write every request of every run (policy, rep) to this file, one JSON object per line: its tenant, router, worker, send, routing, first-token and finish times, cached and charged tokens")
	fs.StringVar(&o.CPUProfile, "cpuprofile", "", "write a CPU profile to this file")
	o.Sessions.register(fs)
	o.Fleet.register(fs)
	o.Tenants.register(fs)
	o.Progress.Register(fs)
	if err := cli.Parse(fs, args); err != nil {
		return nil, err
	}
	if err := o.Progress.Check(); err != nil {
		return nil, cli.Usagef("%v", err)
	}
	set := cli.Given(fs)

	if o.Workers < 1 {
		return nil, cli.Usagef("--workers %d: need at least one worker", o.Workers)
	}
	if o.BlockSize < 1 {
		return nil, cli.Usagef("--block-size %d: must be positive", o.BlockSize)
	}
	var err error
	if o.KVBlocks, err = parseKVBlocks(kvBlocks, o.Workers); err != nil {
		return nil, err
	}
	if o.MaxBatchedTokens < 1 {
		return nil, cli.Usagef("--max-batched-tokens %d: must be positive", o.MaxBatchedTokens)
	}
	if o.MaxRunning < 1 {
		return nil, cli.Usagef("--max-running %d: must be positive", o.MaxRunning)
	}
	if _, err := engine.LookupProfile(o.Profile); err != nil {
		return nil, cli.Usagef("--profile %q: unknown (have %s)", o.Profile, strings.Join(engine.Profiles(), ", "))
	}
	if !(o.Speedup > 0) || math.IsInf(o.Speedup, 0) {
		return nil, cli.Usagef("--speedup %v: must be a positive number", o.Speedup)
	}
	if o.EventDelay, err = time.ParseDuration(eventDelay); err != nil || o.EventDelay < 0 {
		return nil, cli.Usagef("--event-delay %q: want a non-negative duration such as 5ms", eventDelay)
	}
	if o.Routers < 1 {
		return nil, cli.Usagef("--routers %d: need at least one router", o.Routers)
	}
	if o.SyncDelay, err = time.ParseDuration(syncDelay); err != nil || o.SyncDelay < 0 {
		return nil, cli.Usagef("--sync-delay %q: want a non-negative duration such as 100ms", syncDelay)
	}
	if o.SyncFreeExtra, err = time.ParseDuration(syncFreeExtra); err != nil || o.SyncFreeExtra < 0 {
		return nil, cli.Usagef("--sync-free-extra %q: want a non-negative duration such as 1s", syncFreeExtra)
	}
	if o.Repeat < 1 {
		return nil, cli.Usagef("--repeat %d: need at least once", o.Repeat)
	}
	if o.Repeat > 1 && o.ArrivalRate > 0 {
		return nil, cli.Usagef("--repeat replays the closed loop's request list; with --arrival-rate send more --requests instead")
	}
	if o.Timeout <= 0 {
		return nil, cli.Usagef("--timeout %v: must be positive", o.Timeout)
	}
	if err := o.SLO.Check(); err != nil {
		return nil, err
	}
	if o.Policies, err = parsePolicies(policies); err != nil {
		return nil, err
	}
	if set["approx-ttl"] {
		if o.ApproxTTL, err = time.ParseDuration(approxTTL); err != nil || o.ApproxTTL <= 0 {
			return nil, cli.Usagef("--approx-ttl %q: want a positive duration such as 120s", approxTTL)
		}
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
	for name, dst := range map[string]struct {
		v   *float64
		out **float64
	}{
		"pooled-evict-weight": {&pEvict, &o.Pooled.EvictWeight}, "pooled-home-weight": {&pHome, &o.Pooled.HomeWeight},
		"pooled-overloaded": {&pOverloaded, &o.Pooled.Overloaded}, "pooled-queue-weight": {&pQueue, &o.Pooled.QueueWeight},
		"pooled-output-tokens": {&pOutput, &o.Pooled.OutputTokens}, "pooled-copy-weight": {&pCopy, &o.Pooled.CopyWeight},
		"pooled-wait-weight": {&pWait, &o.Pooled.WaitWeight},
	} {
		if set[name] {
			*dst.out = dst.v
		}
	}
	for _, m := range o.Policies {
		if _, peer := peerPolicies[m]; peer {
			if o.Routers > 1 {
				return nil, cli.Usagef("policy %s: its scheduler runs as one picker (active-passive); --routers %d simulates several of ours", m, o.Routers)
			}
			continue
		}
		if err := o.routerConfig(m).Validate(); err != nil {
			return nil, cli.Usagef("policy %s: %v", m, err)
		}
	}
	if o.PeerScrape < 0 {
		return nil, cli.Usagef("--peer-scrape-interval %v: must not be negative", o.PeerScrape)
	}
	if o.Reps < 1 {
		return nil, cli.Usagef("--reps %d: need at least one", o.Reps)
	}
	if o.Parallel < 0 {
		return nil, cli.Usagef("--parallel %d: must not be negative", o.Parallel)
	}
	if o.Parallel == 0 {
		o.Parallel = runtime.GOMAXPROCS(0)
	}
	if err := o.Sessions.check(set, o); err != nil {
		return nil, err
	}
	if err := o.Fleet.check(o); err != nil {
		return nil, err
	}
	if err := o.Tenants.check(set, o); err != nil {
		return nil, err
	}

	if o.Trace != "" {
		for _, name := range syntheticFlags() {
			if !set[name] {
				continue
			}
			if name == "repeat" {
				return nil, cli.Usagef("--repeat applies to the synthetic workload, not to --trace")
			}
			if name == "concurrency" {
				return nil, cli.Usagef("--concurrency does not apply to --trace: a trace is replayed open loop at its timestamps (rows with a session_id run as closed-loop turns by themselves)")
			}
			return nil, cli.Usagef("--%s configures the synthetic workload; it cannot be combined with --trace", name)
		}
		if o.MaxRequests < 0 {
			return nil, cli.Usagef("--max-requests %d: must not be negative", o.MaxRequests)
		}
		return o, nil
	}
	if set["max-requests"] {
		return nil, cli.Usagef("--max-requests applies to --trace only (use --requests for the synthetic workload)")
	}
	if err := o.Workload.Check(); err != nil {
		return nil, err
	}
	if err := o.Workload.CheckArrival(set); err != nil {
		return nil, err
	}
	switch {
	case o.HotShift < 0:
		return nil, cli.Usagef("--hot-shift %d: must not be negative", o.HotShift)
	case o.PrefixOrder == workload.PrefixShuffled && (set["popularity"] || set["hot-shift"]):
		return nil, cli.Usagef("--prefix-order shuffled sends every prefix equally often: it cannot be combined with --popularity or --hot-shift")
	}
	if _, err := workload.ParsePopularity(o.Popularity); err != nil {
		return nil, cli.Usagef("--popularity %q: want uniform or zipf:S with S > 0", o.Popularity)
	}
	// A request must fit in every worker's cache, or it could never run there.
	need := o.PrefixTokens + o.TailTokens + o.OutputTokens
	if t := o.Sessions.Turns; t > 0 {
		// The last turn carries every earlier answer and message (a
		// subagent's also the parent's first).
		if o.Sessions.Subagents == 0 {
			t--
		}
		need += t * (o.TailTokens + o.OutputTokens)
	}
	for i, b := range o.KVBlocks {
		if need > b*o.BlockSize {
			return nil, cli.Usagef("a request needs %d tokens (%d prompt + %d output) but worker %d holds only %d blocks of %d tokens (%d): raise --kv-blocks",
				need, o.PrefixTokens+o.TailTokens, o.OutputTokens, i, b, o.BlockSize, b*o.BlockSize)
		}
	}
	return o, nil
}

func parseKVBlocks(s string, workers int) ([]int, error) {
	parts := strings.Split(s, ",")
	if len(parts) != 1 && len(parts) != workers {
		return nil, cli.Usagef("--kv-blocks lists %d capacities for %d workers: give one number, or exactly one per worker", len(parts), workers)
	}
	vals := make([]int, len(parts))
	for i, p := range parts {
		v, err := strconv.Atoi(strings.TrimSpace(p))
		if err != nil {
			return nil, cli.Usagef("--kv-blocks %q: %q is not a whole number", s, p)
		}
		if v < 1 {
			return nil, cli.Usagef("--kv-blocks: capacity %d blocks cannot hold a single block", v)
		}
		if v > math.MaxInt32-1 {
			return nil, cli.Usagef("--kv-blocks: capacity %d blocks is too large", v)
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
	for m := range peerPolicies {
		names = append(names, string(m))
	}
	return strings.Join(names, ", ")
}

func parsePolicies(s string) ([]router.Mode, error) {
	var out []router.Mode
	seen := map[router.Mode]bool{}
	for _, p := range strings.Split(s, ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			return nil, cli.Usagef("--policies %q: empty policy name", s)
		}
		m, err := router.ParseMode(p)
		if _, peer := peerPolicies[router.Mode(p)]; peer {
			m, err = router.Mode(p), nil
		}
		if err != nil {
			return nil, cli.Usagef("unknown policy %q (known: %s)", p, modeNames())
		}
		if seen[m] {
			return nil, cli.Usagef("--policies %q: %s listed twice", s, m)
		}
		seen[m] = true
		out = append(out, m)
	}
	return out, nil
}

// kvFamily: the knob flags apply to policies that score cache overlap.
func kvFamily(m router.Mode) bool { return strings.HasPrefix(string(m), "kv") }

// routerConfig is the router configuration of policy m: Dynamo's defaults,
// the block size, for kv-family policies the knob flags, and the SLO.
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
	if o.ApproxTTL > 0 {
		c.ApproxTTL = o.ApproxTTL
	}
	c.Pooled = o.Pooled
	c.TrackOutputBlocks = o.TrackOutputBlocks
	// The SLO the run is judged against is the router's objective too
	// (only kv-pooled reads it: router/slo.go).
	c.SLO.TTFT, c.SLO.TPOT = o.SLO.Durations()
	if o.Tenants.queue {
		c.QueueThreshold = &o.Tenants.QueueThreshold
		c.QueuePolicy = router.QueuePolicy(o.Tenants.QueuePolicy)
	}
	return c
}

// slo is the SLO every request is judged against.
func (o *simOptions) slo() sim.SLO { return simSLO(o.SLO) }

// simSLO is the SLO the --slo-* flags give, as the simulator's summary
// judges requests against it (sim, load and goodput alike).
func simSLO(f cli.SLO) sim.SLO {
	ttft, tpot := f.Durations()
	return sim.SLO{TTFT: ttft, TPOT: tpot}
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
		Scheduling:       o.Tenants.Scheduling,
	}
}
