package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime/pprof"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/progress"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/report"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/sim"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/internal/peerpolicy"
	"github.com/kvrouter/kvrouter/router"
)

// runSim is the `kvbench sim` subcommand.
func runSim(args []string, stdout, stderr io.Writer) int {
	o, err := parseSimFlags(args, stderr)
	if code, failed := cli.ParseFailed("sim", err, stderr); failed {
		return code
	}
	if o.CPUProfile != "" {
		stop, err := startCPUProfile(o.CPUProfile)
		if err != nil {
			return cli.Fail(stderr, "sim", err, cli.ExitFail)
		}
		defer stop()
	}
	rep, header, recs, err := executeSim(o, stderr)
	if err != nil {
		code := cli.ExitFail
		if badInput(err) {
			code = cli.ExitUsage
		}
		return cli.Fail(stderr, "sim", err, code)
	}
	if err := report.WriteTable(stdout, header, rep); err != nil {
		return cli.Fail(stderr, "sim", err, cli.ExitFail)
	}
	if o.JSON != "" {
		if err := cli.WriteJSONFile(o.JSON, rep); err != nil {
			return cli.Fail(stderr, "sim", fmt.Errorf("write report: %w", err), cli.ExitFail)
		}
	}
	if o.Plot != "" {
		if err := report.Plot(o.Plot, header, rep.Results); err != nil {
			return cli.Fail(stderr, "sim", fmt.Errorf("write plot: %w", err), cli.ExitFail)
		}
	}
	if o.RequestsOut != "" {
		if err := writeRecordsFile(o.RequestsOut, recs); err != nil {
			return cli.Fail(stderr, "sim", fmt.Errorf("write requests: %w", err), cli.ExitFail)
		}
	}
	return cli.ExitOK
}

// writeRecordsFile writes the runs' request records, policy by policy and
// rep by rep, as JSON Lines to path.
func writeRecordsFile(path string, recs [][][]sim.RequestRecord) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	bw := bufio.NewWriter(f)
	for _, byRep := range recs {
		for _, rs := range byRep {
			if err := sim.WriteRecords(bw, rs); err != nil {
				f.Close()
				return fmt.Errorf("%s: %w", path, err)
			}
		}
	}
	if err := bw.Flush(); err != nil {
		f.Close()
		return fmt.Errorf("%s: %w", path, err)
	}
	return f.Close()
}

// startCPUProfile profiles the process into path until stop is called.
func startCPUProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}

// badInput: the user's input is wrong (exit 2), not the run.
func badInput(err error) bool {
	if errors.Is(err, peerpolicy.ErrPeerMissing) {
		return false // a build left undone, not the user's input
	}
	return errors.Is(err, workload.ErrTraceLine) || errors.Is(err, workload.ErrSpec) || errors.Is(err, fs.ErrNotExist)
}

// simConfig is the report's "config" object: every setting of the run.
type simConfig struct {
	Workload         string    `json:"workload"`
	Workers          int       `json:"workers"`
	KVBlocks         []int     `json:"kv_blocks"`
	BlockSize        int       `json:"block_size"`
	MaxBatchedTokens int       `json:"max_batched_tokens"`
	MaxRunning       int       `json:"max_running"`
	Profile          string    `json:"profile"`
	Speedup          float64   `json:"speedup"`
	EventDelayMs     float64   `json:"event_delay_ms"`
	Routers          int       `json:"routers"`
	SyncDelayMs      float64   `json:"sync_delay_ms"`
	SyncFreeExtraMs  float64   `json:"sync_free_extra_ms,omitempty"`
	TimeoutS         float64   `json:"timeout_s"`
	SLO              *sloCfg   `json:"slo,omitempty"`
	Denominator      string    `json:"denominator"` // what every ratio and quantile is over (sim.Denominator)
	EngineHashSeed   uint64    `json:"engine_hash_seed"`
	EngineScheduling string    `json:"engine_scheduling,omitempty"` // absent: fcfs
	Policies         []string  `json:"policies"`
	PrefillLoadScale *float64  `json:"prefill_load_scale,omitempty"`
	OverlapCredit    *float64  `json:"overlap_credit,omitempty"`
	Temperature      *float64  `json:"temperature,omitempty"`
	ApproxTTLS       float64   `json:"approx_ttl_s"`
	Pooled           pooledCfg `json:"pooled"`
	Seed             uint64    `json:"seed"`
	Reps             int       `json:"reps"`
	Synthetic        *synthCfg `json:"synthetic,omitempty"`
	// Agent sessions, session affinity and fleet events (issues 28, 29).
	Sessions        *sessionsCfg `json:"sessions,omitempty"`
	SessionAffinity *affinityCfg `json:"session_affinity,omitempty"`
	FleetEvents     *fleetCfg    `json:"fleet_events,omitempty"`
	// The routers' admission queue and tenants (issue 28 items 3–4).
	Admission   *tenantsCfg `json:"admission,omitempty"`
	Trace       *traceCfg   `json:"trace,omitempty"`
	Requests    int         `json:"requests"`
	HitRule     string      `json:"hit_rule"`
	WallSeconds float64     `json:"wall_seconds"`

	// --track-output-blocks and --sim-osl-hint.
	TrackOutputBlocks bool `json:"track_output_blocks,omitempty"`
	OSLHint           bool `json:"osl_hint,omitempty"`
}

// pooledCfg is kv-pooled's settings as given by --pooled-* (absent: the
// router's default; output_tokens absent: the mean the router observes).
type pooledCfg struct {
	EvictWeight  *float64 `json:"evict_weight,omitempty"`
	CopyWeight   *float64 `json:"copy_weight,omitempty"`
	HomeWeight   *float64 `json:"home_weight,omitempty"`
	Overloaded   *float64 `json:"overloaded,omitempty"`
	QueueWeight  *float64 `json:"queue_weight,omitempty"`
	OutputTokens *float64 `json:"output_tokens,omitempty"`
	WaitWeight   *float64 `json:"wait_weight,omitempty"`
}

// sloCfg is the SLO requests were judged against (0: that figure not judged).
type sloCfg struct {
	TTFTMs float64 `json:"ttft_ms"`
	TPOTMs float64 `json:"tpot_ms"`
}

func newSLOCfg(o cli.SLO) *sloCfg {
	if !o.Set() {
		return nil
	}
	return &sloCfg{TTFTMs: o.TTFTMs, TPOTMs: o.TPOTMs}
}

type synthCfg struct {
	Prefixes     int     `json:"prefixes"`
	PrefixTokens int     `json:"prefix_tokens"`
	TailTokens   int     `json:"tail_tokens"`
	OutputTokens int     `json:"output_tokens"`
	Concurrency  int     `json:"concurrency"` // closed loop (0 with an arrival rate)
	ArrivalRate  float64 `json:"arrival_rate,omitempty"`
	ArrivalCV    float64 `json:"arrival_cv,omitempty"`
	PrefixOrder  string  `json:"prefix_order"`
	Popularity   string  `json:"popularity"`
	HotShift     int     `json:"hot_shift,omitempty"`
	Repeat       int     `json:"repeat,omitempty"`
}

type traceCfg struct {
	Path        string `json:"path"`
	MaxRequests int    `json:"max_requests"`
	Sessions    int    `json:"sessions"`
}

// executeSim builds the workloads (one per rep), runs every policy on each,
// and folds the reps into a report; with --requests-out it also returns
// every run's request records ([policy][rep]).
func executeSim(o *simOptions, stderr io.Writer) (*report.Report, string, [][][]sim.RequestRecord, error) {
	start := time.Now()
	loads, err := o.workloads(stderr)
	if err != nil {
		return nil, "", nil, err
	}

	capacity := 0
	for _, b := range o.KVBlocks {
		capacity += b
	}
	np := len(o.Policies)
	runs := make([][]report.Run, np) // [policy][rep]
	for p := range runs {
		runs[p] = make([]report.Run, o.Reps)
	}
	refs := make([]sim.Reference, o.Reps)
	errs := make([]error, (np+1)*o.Reps) // runs, then references
	var recs [][][]sim.RequestRecord
	if o.RequestsOut != "" {
		recs = make([][][]sim.RequestRecord, np)
		for p := range recs {
			recs[p] = make([][]sim.RequestRecord, o.Reps)
		}
	}

	var done atomic.Int64
	total := int64(np * o.Reps * len(loads[0].Requests))
	if len(o.Fleet.events()) > 0 {
		total *= 2 // each run again without the events
	}
	stop := progress.Start(stderr, progress.Meter{Name: "kvbench sim", Unit: "requests", Total: total, Count: done.Load},
		o.Progress.Options(stderr))

	type job struct{ p, r int } // p < 0: the reference of rep r
	jobs := make(chan job)
	var wg sync.WaitGroup
	for range o.Parallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				if j.p < 0 {
					if o.Trace != "" && j.r > 0 {
						continue // same workload: filled in below
					}
					refs[j.r] = sim.ComputeReference(loads[j.r], capacity)
					one, err := sim.EngineReference(loads[j.r], sim.Config{
						Engine: o.engineConfig(), Router: o.routerConfig(router.ModeRoundRobin),
						EventDelay: o.EventDelay, Seed: o.Seed + uint64(j.r),
					}, capacity)
					if err != nil {
						errs[j.r] = fmt.Errorf("rep %d: %w", j.r, err)
					}
					refs[j.r].OneEngine = one
					continue
				}
				t0 := time.Now()
				seed := o.Seed + uint64(j.r)
				res, err := o.runPolicy(loads[j.r], o.Policies[j.p], seed, func() { done.Add(1) })
				if err != nil {
					errs[(j.p+1)*o.Reps+j.r] = fmt.Errorf("policy %s, rep %d: %w", o.Policies[j.p], j.r, err)
					continue
				}
				sum := sim.SummarizeSLO(loads[j.r], res, o.Timeout, o.slo())
				if evs := o.Fleet.events(); len(evs) > 0 {
					base, err := o.runBaseline(loads[j.r], o.Policies[j.p], seed, func() { done.Add(1) })
					if err != nil {
						errs[(j.p+1)*o.Reps+j.r] = fmt.Errorf("policy %s, rep %d, without fleet events: %w", o.Policies[j.p], j.r, err)
						continue
					}
					sum.Events = sim.MeasureEvents(loads[j.r], res, base, o.Fleet.dip(o.Timeout))
				}
				runs[j.p][j.r] = report.Run{Seed: seed, Summary: sum, WallSeconds: time.Since(t0).Seconds()}
				if recs != nil {
					recs[j.p][j.r] = sim.Records(loads[j.r], res, j.r, seed)
				}
			}
		}()
	}
	for r := range o.Reps {
		jobs <- job{-1, r}
	}
	for r := range o.Reps {
		for p := range np {
			jobs <- job{p, r}
		}
	}
	close(jobs)
	wg.Wait()
	stop()
	if err := errors.Join(errs...); err != nil {
		return nil, "", nil, err
	}
	if o.Trace != "" {
		for r := 1; r < o.Reps; r++ {
			refs[r] = refs[0]
		}
	}

	wall := time.Since(start)
	rep := &report.Report{Reference: report.MedianReference(refs)}
	for p, m := range o.Policies {
		rep.Results = append(rep.Results, report.Median(string(m), runs[p]))
	}
	rep.Config = o.reportConfig(loads[0], wall)
	header := fmt.Sprintf("kvbench sim: %s, %d requests, %d workers × %s blocks of %d tokens, seed %d",
		loads[0].Name, len(loads[0].Requests), o.Workers, blocksLabel(o.KVBlocks), o.BlockSize, o.Seed)
	if o.Routers > 1 {
		header += fmt.Sprintf(", %d routers with %v sync lag", o.Routers, o.SyncDelay)
	}
	if o.TrackOutputBlocks {
		header += ", output blocks tracked"
		if o.OSLHint {
			header += " (osl hint)"
		}
	} else if o.OSLHint {
		header += ", osl hint"
	}
	if a := o.Sessions.affinity(); a.Mode != sim.AffinityOff {
		header += fmt.Sprintf(", %s session affinity", a.Mode)
		if o.Routers > 1 {
			header += " (" + o.Sessions.Table + " bindings)"
		}
	}
	if n := len(o.Fleet.events()); n > 0 {
		header += fmt.Sprintf(", %d fleet events", n)
		if w := o.Fleet.warmUp(); w != nil {
			header += fmt.Sprintf(" (warm-up share %.2f)", w.Share)
		}
	}
	if o.Reps > 1 {
		header += fmt.Sprintf(", medians of %d reps", o.Reps)
	}
	header += fmt.Sprintf(" (%.1fs)", wall.Seconds())
	return rep, header, recs, nil
}

// peerPolicies are the policies run by another project's own code in a peer
// process (internal/peerpolicy): the binary that runs it, built by make
// build next to kvbench.
var peerPolicies = map[router.Mode]string{"gaie": "kvbench-gaie"}

// defaultPeerScrape is how often the Gateway API Inference Extension's
// endpoint picker refreshes the metrics it routes on (its
// --refresh-metrics-interval default).
const defaultPeerScrape = 50 * time.Millisecond

// runPolicy simulates w routed by policy m with seed: our router in mode m,
// or the peer policy m in its own process.
func (o *simOptions) runPolicy(w *workload.Workload, m router.Mode, seed uint64, progress func()) (*sim.Result, error) {
	bin, peer := peerPolicies[m]
	if !peer {
		cfg := o.simConfig(o.routerConfig(m), seed)
		cfg.Progress = progress
		cfg.Events = o.Fleet.events()
		cfg.WarmUp = o.Fleet.warmUp()
		cfg.ShadowWarmUp = o.Fleet.WarmUpShadow
		cfg.Shadow = sim.ShadowPolicy{Inflight: o.Fleet.ShadowInflight, MinHolders: o.Fleet.ShadowMinHolders, Eager: o.Fleet.ShadowEager, FreshShare: o.Fleet.WarmUpFreshShare}
		return sim.Run(w, cfg)
	}
	cfg := o.simConfig(o.routerConfig(router.ModeRoundRobin), seed) // the router is not consulted
	cfg.Progress = progress
	c, err := peerpolicy.Start(context.Background(), peerPath(bin),
		peerpolicy.Init{Seed: seed, BlockSize: o.BlockSize, Pods: sim.PeerPods(o.Workers, o.KVBlocks)})
	if err != nil {
		return nil, fmt.Errorf("policy %s: %w", m, err)
	}
	cfg.Peer, cfg.ScrapeInterval = c, o.PeerScrape
	res, err := sim.Run(w, cfg)
	if cerr := c.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("policy %s: %w", m, cerr)
	}
	if res != nil {
		res.Policy = string(m)
	}
	return res, err
}

// runBaseline is runPolicy's run of our router in mode m without the
// fleet events, its workers named as in the run with them.
func (o *simOptions) runBaseline(w *workload.Workload, m router.Mode, seed uint64, progress func()) (*sim.Result, error) {
	cfg := o.simConfig(o.routerConfig(m), seed)
	cfg.Progress = progress
	cfg.IDSlots = o.Workers + len(o.Fleet.Add)
	return sim.Run(w, cfg)
}

// peerPath is where a peer binary is: $KVBENCH_PEER_DIR, else beside this
// kvbench executable (bin/ after make build), else the PATH.
func peerPath(bin string) string {
	if d := os.Getenv("KVBENCH_PEER_DIR"); d != "" {
		return filepath.Join(d, bin)
	}
	if exe, err := os.Executable(); err == nil {
		if p := filepath.Join(filepath.Dir(exe), bin); fileExists(p) {
			return p
		}
	}
	return bin
}

// simConfig is one fleet run of the simulator: the fleet, engines, event
// and sync delays the flags describe, routed by rc, with seed (kvbench sim
// and kvbench tune build every run here).
func (o *simOptions) simConfig(rc router.Config, seed uint64) sim.Config {
	return sim.Config{
		Workers: o.Workers, KVBlocks: o.KVBlocks, Engine: o.engineConfig(), Router: rc, EventDelay: o.EventDelay, Seed: seed,
		Routers: o.Routers, SyncDelay: o.SyncDelay, SyncFreeExtra: o.SyncFreeExtra, OSLHint: o.OSLHint,
		Affinity: o.Sessions.affinity(), Tenants: o.Tenants.config(),
		PinTTL: o.Sessions.PinTTL, PinEvery: o.Sessions.PinEvery,
	}
}

// workloads are the request lists of the reps: a trace's rows every rep
// (the router's seed changes), or a synthetic list per seed.
func (o *simOptions) workloads(stderr io.Writer) ([]*workload.Workload, error) {
	loads := make([]*workload.Workload, o.Reps)
	if o.Trace != "" {
		w, err := workload.LoadTrace(workload.TraceSpec{Path: o.Trace, Speedup: o.Speedup, MaxRequests: o.MaxRequests, BlockSize: o.BlockSize})
		if err != nil {
			return nil, err
		}
		for r := range loads {
			loads[r] = w
		}
		if n := tooLarge(w, o); n > 0 {
			fmt.Fprintf(stderr, "kvbench: warning: %d of %d requests need more tokens than a worker's KV cache holds; they will fail\n", n, len(w.Requests))
		}
		return loads, nil
	}
	for r := range loads {
		spec := o.Workload.Spec(o.BlockSize, o.Seed+uint64(r))
		spec.Popularity, spec.HotShift = o.Popularity, o.HotShift
		spec.Agent = o.Sessions.agent()
		if spec.ArrivalRate > 0 && spec.Agent.Turns == 0 {
			// Each tenant its own stream: its requests are the same with
			// or without the others (workload.SyntheticSpec.Tenants).
			for _, t := range o.Tenants.tenants {
				spec.Tenants = append(spec.Tenants, workload.TenantStream{Name: t.Name, Weight: t.Weight})
			}
			spec.TenantPrefixes = o.Tenants.Prefixes
		}
		w, err := workload.NewSynthetic(spec)
		if err != nil {
			return nil, err
		}
		loads[r] = repeated(w, o.Repeat)
	}
	return loads, nil
}

// repeated is w's request list n times in a row under fresh ids: the same
// prompts sent again, as reps sent back to back with one seed (the workers'
// caches and the routers' state carry over). Only the simulator replays
// it: token sources stay those of the first copy.
func repeated(w *workload.Workload, n int) *workload.Workload {
	if n <= 1 {
		return w
	}
	out := *w
	out.Requests = make([]workload.Request, 0, n*len(w.Requests))
	for k := range n {
		for _, q := range w.Requests {
			if k > 0 {
				q.ID = fmt.Sprintf("%s.again%d", q.ID, k)
			}
			out.Requests = append(out.Requests, q)
		}
	}
	return &out
}

func blocksLabel(b []int) string {
	for _, v := range b[1:] {
		if v != b[0] {
			return fmt.Sprint(b)
		}
	}
	return fmt.Sprint(b[0])
}

// tooLarge counts requests that fit no worker.
func tooLarge(w *workload.Workload, o *simOptions) int {
	biggest := 0
	for _, b := range o.KVBlocks {
		biggest = max(biggest, b*o.BlockSize)
	}
	n := 0
	for _, r := range w.Requests {
		if r.PromptTokens+r.OutputTokens > biggest {
			n++
		}
	}
	return n
}

func (o *simOptions) reportConfig(w *workload.Workload, wall time.Duration) simConfig {
	c := simConfig{
		Workload: w.Kind.String(), Workers: o.Workers, KVBlocks: o.KVBlocks, BlockSize: o.BlockSize,
		MaxBatchedTokens: o.MaxBatchedTokens, MaxRunning: o.MaxRunning, Profile: o.Profile, Speedup: o.Speedup,
		EventDelayMs: float64(o.EventDelay) / float64(time.Millisecond),
		Routers:      o.Routers, SyncDelayMs: float64(o.SyncDelay) / float64(time.Millisecond),
		SyncFreeExtraMs: float64(o.SyncFreeExtra) / float64(time.Millisecond),
		TimeoutS:        o.Timeout.Seconds(), SLO: newSLOCfg(o.SLO), Denominator: sim.Denominator,
		EngineHashSeed: o.EngineHashSeed, EngineScheduling: nonFCFS(o.Tenants.Scheduling), PrefillLoadScale: o.PrefillLoadScale, OverlapCredit: o.OverlapCredit,
		Temperature: o.Temperature, ApproxTTLS: o.routerConfig(router.ModeKVApprox).ApproxTTL.Seconds(), Seed: o.Seed, Reps: o.Reps, Requests: len(w.Requests),
		Pooled: pooledCfg{EvictWeight: o.Pooled.EvictWeight, CopyWeight: o.Pooled.CopyWeight, HomeWeight: o.Pooled.HomeWeight,
			Overloaded: o.Pooled.Overloaded, QueueWeight: o.Pooled.QueueWeight, OutputTokens: o.Pooled.OutputTokens,
			WaitWeight: o.Pooled.WaitWeight},
		WallSeconds: wall.Seconds(), TrackOutputBlocks: o.TrackOutputBlocks, OSLHint: o.OSLHint,
	}
	for _, m := range o.Policies {
		c.Policies = append(c.Policies, string(m))
	}
	c.Sessions, c.SessionAffinity = o.Sessions.config()
	c.FleetEvents = o.Fleet.config()
	c.Admission = o.Tenants.reportConfig()
	if w.Kind == workload.Trace {
		c.Trace = &traceCfg{Path: o.Trace, MaxRequests: o.MaxRequests, Sessions: len(w.Sessions)}
		c.HitRule = fmt.Sprintf("cached prompt tokens >= one block (%d tokens)", o.BlockSize)
	} else {
		c.Synthetic = &synthCfg{Prefixes: o.Prefixes, PrefixTokens: o.PrefixTokens, TailTokens: o.TailTokens,
			OutputTokens: o.OutputTokens, Concurrency: o.Concurrency, PrefixOrder: o.PrefixOrder,
			Popularity: o.Popularity, HotShift: o.HotShift}
		if o.ArrivalRate > 0 {
			c.Synthetic.Concurrency, c.Synthetic.ArrivalRate, c.Synthetic.ArrivalCV = 0, o.ArrivalRate, o.ArrivalCV
		}
		if o.Repeat > 1 {
			c.Synthetic.Repeat = o.Repeat
		}
		c.HitRule = fmt.Sprintf("cached prompt tokens >= half the shared prefix (%d tokens)", (o.PrefixTokens+1)/2)
	}
	return c
}

// nonFCFS is the report's engine_scheduling: absent for fcfs, the default,
// so that earlier reports and these compare equal.
func nonFCFS(policy string) string {
	if policy == engine.SchedulingFCFS {
		return ""
	}
	return policy
}
