//go:build chaos

package chaos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"sort"
	"strings"
	"time"
)

// Options configure a chaos run.
type Options struct {
	Scenarios []string
	Duration  time.Duration // fault phase of each scenario
	Root      string        // repository root (deploy/haproxy/haproxy.cfg)
	BinDir    string        // kvrouter, kvmock
	OutDir    string        // chaos/out: report.json and <run-id>/
	RunID     string
	HAProxy   string // haproxy binary
	// PrevBin is the previous release's kvrouter, for the scenarios that
	// start replicas on it (U1); default <BinDir>/kvrouter-prev.
	PrevBin string

	LedgerWorkers int
	LedgerEvery   time.Duration
	RouteClients  int
	AdminClients  int
	KeepRuns      int // artifact folders kept in OutDir (older ones are deleted)

	Out io.Writer // progress
}

// DefaultOptions fills what the caller left out.
func (o Options) withDefaults() Options {
	if o.Duration == 0 {
		o.Duration = DefaultDuration
	}
	if o.Root == "" {
		o.Root = "."
	}
	o.Root = mustAbs(o.Root)
	if o.BinDir == "" {
		o.BinDir = filepath.Join(o.Root, "bin")
	}
	o.BinDir = mustAbs(o.BinDir)
	if o.OutDir == "" {
		o.OutDir = filepath.Join(o.Root, "chaos", "out")
	}
	o.OutDir = mustAbs(o.OutDir)
	if o.RunID == "" {
		o.RunID = time.Now().Format("20060102-150405")
	}
	if o.HAProxy == "" {
		o.HAProxy, _ = exec.LookPath("haproxy")
	}
	if o.PrevBin == "" {
		o.PrevBin = filepath.Join(o.BinDir, "kvrouter-prev")
	}
	o.PrevBin = mustAbs(o.PrevBin)
	if o.LedgerWorkers == 0 {
		o.LedgerWorkers = 4
	}
	if o.LedgerEvery == 0 {
		o.LedgerEvery = 25 * time.Millisecond
	}
	if o.RouteClients == 0 {
		o.RouteClients = 4
	}
	if o.AdminClients == 0 {
		o.AdminClients = 3
	}
	if o.KeepRuns == 0 {
		o.KeepRuns = 10
	}
	if o.Out == nil {
		o.Out = os.Stdout
	}
	return o
}

// Preflight says what is missing to run at all.
func Preflight(o Options) error {
	o = o.withDefaults()
	var errs []error
	if os.Geteuid() != 0 {
		errs = append(errs, errors.New("needs root (network namespaces, iptables)"))
	}
	for _, b := range []string{"kvrouter", "kvmock"} {
		if _, err := os.Stat(filepath.Join(o.BinDir, b)); err != nil {
			errs = append(errs, fmt.Errorf("%s missing in %s: run make build", b, o.BinDir))
		}
	}
	if o.HAProxy == "" {
		errs = append(errs, errors.New("haproxy not found (apt-get install -y haproxy)"))
	}
	for _, id := range o.Scenarios {
		if len(scenarios[id].prev) == 0 {
			continue
		}
		if _, err := os.Stat(o.PrevBin); err != nil {
			errs = append(errs, fmt.Errorf("%s needs the previous release's kvrouter at %s (chaos/run.sh builds it from PREV_REF)", id, o.PrevBin))
		}
		break
	}
	for _, t := range []string{"ip", "iptables"} {
		if _, err := exec.LookPath(t); err != nil {
			errs = append(errs, fmt.Errorf("%s not found (apt-get install -y iproute2 iptables)", t))
		}
	}
	return errors.Join(errs...)
}

// Run runs the scenarios one after the other, each on a fresh cluster, and
// writes OutDir/report.json after each (a partial report survives an
// interrupted run).
func Run(ctx context.Context, o Options) (*Report, error) {
	o = o.withDefaults()
	runDir := filepath.Join(o.OutDir, o.RunID)
	rep := &Report{RunID: o.RunID, Started: time.Now(), Duration: o.Duration.String(), ArtifactDir: runDir}
	reportPath := filepath.Join(o.OutDir, "report.json")
	if err := os.MkdirAll(runDir, 0o755); err != nil {
		return nil, err
	}
	pruneRuns(o.OutDir, o.KeepRuns, o.RunID)
	if err := Preflight(o); err != nil {
		for _, id := range o.Scenarios {
			sc, _ := Lookup(id)
			rep.Scenarios = append(rep.Scenarios, Result{ID: id, Title: sc.Title, Lost: -1, Duplicates: -1, Error: "preflight: " + err.Error()})
		}
		rep.Finished = time.Now()
		_ = rep.Write(reportPath)
		return rep, err
	}
	// One CA and one set of certificates and tokens for the run: each
	// scenario starts a fresh cluster, but issuing per scenario would only
	// cost time.
	cred, err := issueCredentials(ctx, filepath.Join(o.BinDir, "kvrouter"), runDir, workerIDs(o))
	if err != nil {
		for _, id := range o.Scenarios {
			sc, _ := Lookup(id)
			rep.Scenarios = append(rep.Scenarios, Result{ID: id, Title: sc.Title, Lost: -1, Duplicates: -1, Error: "credentials: " + err.Error()})
		}
		rep.Finished = time.Now()
		_ = rep.Write(reportPath)
		return rep, err
	}
	for _, id := range o.Scenarios {
		if ctx.Err() != nil {
			break
		}
		res := runScenario(ctx, o, runDir, id, cred)
		rep.Scenarios = append(rep.Scenarios, res)
		rep.Finished = time.Now()
		if err := rep.Write(reportPath); err != nil {
			return rep, err
		}
		_ = rep.Write(filepath.Join(runDir, "report.json"))
		verdict := "PASSED"
		if !res.Passed {
			verdict = "FAILED"
		}
		fmt.Fprintf(o.Out, "[%s] %s in %.0fs: lost %d, duplicates %d, failover p99 %.2fs, availability %.4f (no retry %.4f)\n",
			id, verdict, res.ElapsedS, res.Lost, res.Duplicates, res.FailoverP99, res.Availability, res.AvailabilityNoRetry)
		for _, f := range res.Failures {
			fmt.Fprintf(o.Out, "[%s]     failed: %s\n", id, f)
		}
		if res.Error != "" {
			fmt.Fprintf(o.Out, "[%s]     error: %s\n", id, res.Error)
		}
	}
	return rep, ctx.Err()
}

// pruneRuns keeps the newest keep artifact folders (run ids sort by time).
func pruneRuns(outDir string, keep int, current string) {
	ents, err := os.ReadDir(outDir)
	if err != nil {
		return
	}
	var runs []string
	for _, e := range ents {
		if e.IsDir() && len(e.Name()) == len("20060102-150405") && e.Name() != current && e.Name()[8] == '-' {
			runs = append(runs, e.Name())
		}
	}
	sort.Strings(runs)
	for len(runs) > keep-1 && len(runs) > 0 {
		_ = os.RemoveAll(filepath.Join(outDir, runs[0]))
		runs = runs[1:]
	}
}

func runScenario(parent context.Context, o Options, runDir, id string, cred *credentials) (res Result) {
	sc, _ := Lookup(id)
	impl := scenarios[id]
	dir := filepath.Join(runDir, id)
	res = Result{ID: id, Title: sc.Title, ArtifactDir: dir}
	t0 := time.Now()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		res.Error = err.Error()
		return res
	}
	logFile, err := os.Create(filepath.Join(dir, "harness.log"))
	if err != nil {
		res.Error = err.Error()
		return res
	}
	defer logFile.Close()
	ctx, cancel := context.WithCancel(parent)
	defer cancel()
	bgCtx, stopBG := context.WithCancel(ctx)
	e := &env{ctx: ctx, opts: o, id: id, dir: dir, out: o.Out,
		log:        slog.New(slog.NewTextHandler(logFile, &slog.HandlerOptions{Level: slog.LevelInfo})).With("scenario", id),
		net:        nil,
		pids:       newPidRegistry(filepath.Join(o.OutDir, "pids")),
		replicas:   map[int]*replica{},
		members:    []int{1, 2, 3},
		prev:       impl.prev,
		raftGroups: impl.raftGroups,
		serveArgs:  impl.serveArgs,
		iso:        newIsolationWatch(),
		route:      newRouteStats(),
		admin:      &adminHistory{start: time.Now()},
		res:        &res,
		bgCtx:      bgCtx, stopBackground: stopBG,
	}
	e.net = newNetwork(func(f string, a ...any) { e.log.Warn(fmt.Sprintf(f, a...)) })
	e.routeClients, e.adminClients, e.registerEvery = o.RouteClients, o.AdminClients, 20*time.Second
	if impl.quiet {
		e.routeClients, e.adminClients, e.registerEvery = 0, 0, quietRenewal
	}
	if impl.registerEvery > 0 {
		e.registerEvery = impl.registerEvery
	}
	insecure := impl.insecure
	if insecure == "" && len(impl.prev) > 0 && !hasTLSFlags(ctx, o.PrevBin) {
		insecure = fmt.Sprintf("the previous release (%s) has no TLS flags, and a replica without TLS cannot speak to members "+
			"that accept Raft only over mutual TLS: the whole cluster runs without TLS and authentication (chaos/run.sh, PREV_REF)", o.PrevBin)
	}
	if insecure == "" {
		e.cred = cred
	} else {
		e.metric("insecure", insecure)
	}
	acc, err := newAccess(e.cred)
	if err != nil {
		res.Error = "credentials: " + err.Error()
		return res
	}
	e.acc = acc
	e.tlFile, _ = os.Create(filepath.Join(dir, "timeline.jsonl"))
	if impl.ledgerEvery > 0 {
		e.opts.LedgerEvery = impl.ledgerEvery
	}
	if impl.maxDuration > 0 && e.opts.Duration > impl.maxDuration {
		e.opts.Duration = impl.maxDuration
		e.metric("duration_cut_to_s", impl.maxDuration.Seconds())
	}
	if e.opts.Duration < impl.minDuration {
		e.opts.Duration = impl.minDuration
		e.metric("duration_extended_to_s", impl.minDuration.Seconds())
	}
	defer func() {
		if p := recover(); p != nil {
			res.Error = fmt.Sprintf("harness panic: %v\n%s", p, debug.Stack())
		}
		e.event("teardown", "stopping every process and deleting the network")
		e.teardown()
		res.ElapsedS = time.Since(t0).Seconds()
		res.Finish()
		e.writeJSON("result.json", res)
	}()
	fmt.Fprintf(o.Out, "[%s] %s (fault phase %s, artifacts %s)\n", id, sc.Title, e.opts.Duration, dir)
	if err := e.setup(); err != nil {
		res.Error = "setup: " + err.Error()
		res.Lost, res.Duplicates = -1, -1
		e.event("error", "setup failed: %v", err)
		return res
	}
	e.startWorkload()
	if err := impl.nemesis(e); err != nil {
		res.Error = "nemesis: " + err.Error()
		e.event("error", "nemesis: %v", err)
	}
	e.sleepUntil(e.end)
	if ctx.Err() != nil {
		res.Error = "interrupted"
		return res
	}
	e.event("nemesis", "fault phase over")
	e.finish()
	if !impl.selfTest {
		res.Require("lost", float64(res.Lost), "==", 0, "acknowledged ledger events missing on a replica")
		res.Require("duplicates", float64(res.Duplicates), "==", 0, "ledger events applied twice")
		res.Require("unexpected", float64(res.Unexpected), "==", 0, "stale ranks, cursors past the ledger, replicas disagreeing")
		res.RequireTrue("digests_equal", res.DigestsEqual, "every replica's FSM digest after heal and drain")
	}
	if impl.check != nil {
		impl.check(e)
	}
	return res
}

// hasTLSFlags reports whether a kvrouter binary's serve knows --tls-ca
// (every build since issue 16's secure defaults).
func hasTLSFlags(ctx context.Context, bin string) bool {
	out, _ := run(ctx, bin, "serve", "--help") // -help exits non-zero on some builds; the text is what counts
	return strings.Contains(out, "-tls-ca")
}

// scenario is one fault schedule and its own pass criteria.
type scenario struct {
	nemesis     func(e *env) error
	check       func(e *env)
	ledgerEvery time.Duration // 0: Options.LedgerEvery
	minDuration time.Duration // a shorter DURATION is extended to this
	maxDuration time.Duration // a longer DURATION is cut to this (0: none)
	// registerEvery: the workers' lease renewal (0: Options' 20 s, or
	// quietRenewal for a quiet scenario).
	registerEvery time.Duration
	// selfTest: the scenario injects anomalies; its checks replace the
	// common ones (which must fail there).
	selfTest bool
	// prev: replicas started on the previous release's binary
	// (Options.PrevBin) instead of this build's.
	prev []int
	// insecure, when set, says why this scenario runs the cluster without
	// TLS and authentication (plaintext Raft, bus and HTTP, no tokens);
	// every other scenario runs with the secure defaults. It is recorded in
	// the result's metrics.
	insecure string
	// raftGroups: the replicas run with --raft-groups raftGroups (> 1:
	// a control group and that many data groups, each with its own Raft
	// log on raftPort + g × raftGroupPortStep); 0: one group, as before.
	raftGroups int
	// quiet: no route or admin clients, and workers renew their leases
	// only every quietRenewal, so nothing but the ledger writes to the
	// cluster (A1 compares the state before and after its probes).
	quiet bool
	// serveArgs: more flags for every replica's `kvrouter serve` (AF1
	// turns session affinity on).
	serveArgs []string
}

// quietRenewal is the workers' lease renewal in a quiet scenario: the
// lease is 120 s (replica leaseFor), so one renewal 100 s after the first
// registration keeps them registered while leaving a window of that long
// without renewal writes.
const quietRenewal = 100 * time.Second
