//go:build chaos

package chaos

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"
)

// env is one scenario's world: network, processes, workload, measurements.
type env struct {
	ctx  context.Context
	opts Options
	id   string
	dir  string // artifacts of this scenario
	log  *slog.Logger
	out  io.Writer // progress lines

	net      *network
	pids     *pidRegistry
	cred     *credentials // nil: this scenario runs insecure on purpose (scenario.insecure)
	acc      *access      // how the harness's clients reach the replicas
	mu       sync.Mutex   // replicas and members, which T7 changes while the monitor and clients read them
	replicas map[int]*replica
	members  []int // replicas that should be running and in the cluster
	prev     []int // replicas started on the previous release's binary (scenario.prev)
	// raftGroups: the replicas' --raft-groups (scenario.raftGroups); > 1
	// shards the index into data groups, which the drain and the final
	// comparison then check group by group.
	raftGroups int
	serveArgs  []string // more flags for every replica (scenario.serveArgs)
	mocks      []*mock
	haproxy    *proc

	iso    *isolationWatch
	ledger []*ledgerWorker
	route  *routeStats
	admin  *adminHistory

	routeClients  int           // Options.RouteClients, or 0 for a scenario without clients
	adminClients  int           // Options.AdminClients, likewise
	registerEvery time.Duration // workers' lease renewal

	bgCtx          context.Context // monitor, registrations: until teardown
	workloadCtx    context.Context
	stopClients    context.CancelFunc
	stopLedger     context.CancelFunc
	stopBackground context.CancelFunc
	clientsWG      sync.WaitGroup
	ledgerWG       sync.WaitGroup
	bgWG           sync.WaitGroup

	start time.Time // workload (and fault phase) start
	end   time.Time // fault phase end

	tlMu     sync.Mutex
	meas     map[string][]float64 // a nemesis's measurements for its check
	timeline []tlEvent
	tlFile   *os.File

	res *Result
	// d1, d1Routed: D1's drain rounds and its routing decisions while
	// drained (drain.go), from its nemesis to its check.
	d1       []*d1Round
	d1Routed d1Routed
	// groupsEqual: per data group, whether every replica reported the same
	// digest at the end (compare; empty when not sharded).
	groupsEqual map[int]bool
	// af: AF1's session turns (sessions.go), from its nemesis to its check.
	af *afRun
}

type tlEvent struct {
	T      float64 `json:"t"` // seconds since the workload started
	At     string  `json:"at"`
	Kind   string  `json:"kind"`
	Detail string  `json:"detail"`
}

// event records a timeline entry and prints it.
func (e *env) event(kind, format string, args ...any) {
	detail := fmt.Sprintf(format, args...)
	now := time.Now()
	t := 0.0
	if !e.start.IsZero() {
		t = now.Sub(e.start).Seconds()
	}
	ev := tlEvent{T: t, At: now.Format("15:04:05.000"), Kind: kind, Detail: detail}
	e.tlMu.Lock()
	e.timeline = append(e.timeline, ev)
	if e.tlFile != nil {
		b, _ := json.Marshal(ev)
		e.tlFile.Write(append(b, '\n'))
	}
	e.tlMu.Unlock()
	e.log.Info(kind, "detail", detail)
	fmt.Fprintf(e.out, "[%s] %+7.1fs %-10s %s\n", e.id, t, kind, detail)
}

func (e *env) metric(k string, v any) {
	if e.res.Metrics == nil {
		e.res.Metrics = map[string]any{}
	}
	e.res.Metrics[k] = v
}

func (e *env) writeJSON(name string, v any) {
	data, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		e.log.Warn("artifact", "name", name, "err", err)
		return
	}
	_ = os.WriteFile(filepath.Join(e.dir, name), append(data, '\n'), 0o644)
}

func (e *env) sleepUntil(t time.Time) bool {
	d := time.Until(t)
	if d <= 0 {
		return e.ctx.Err() == nil
	}
	select {
	case <-e.ctx.Done():
		return false
	case <-time.After(d):
		return true
	}
}

func (e *env) sleep(d time.Duration) bool { return e.sleepUntil(time.Now().Add(d)) }

// --- setup ----------------------------------------------------------------------

func (e *env) bin(name string) string { return filepath.Join(e.opts.BinDir, name) }

func (e *env) newReplica(i int, join bool) *replica {
	r := &replica{idx: i, id: fmt.Sprintf("r%d", i), dataDir: filepath.Join(e.dir, fmt.Sprintf("r%d", i)), join: join}
	r.name = r.id
	r.groups = e.raftGroups
	r.extra = e.serveArgs
	r.logPath = filepath.Join(e.dir, fmt.Sprintf("r%d.log", i))
	if slices.Contains(e.prev, i) {
		r.bin = e.opts.PrevBin
	}
	e.mu.Lock()
	e.replicas[i] = r
	e.mu.Unlock()
	return r
}

func (e *env) startReplica(r *replica) error {
	if err := os.MkdirAll(r.dataDir, 0o755); err != nil {
		return err
	}
	members := e.members
	if !slices.Contains(members, r.idx) {
		members = append(slices.Clone(members), r.idx)
	}
	bin := r.bin
	if bin == "" {
		bin = e.bin("kvrouter")
	}
	return r.start(r.argv(bin, members, e.cred), e.pids)
}

func (e *env) setup() error {
	e.event("setup", "network %s.0/24, %d replicas", subnet, len(e.members))
	if err := e.net.setup(e.ctx, len(e.members)); err != nil {
		return fmt.Errorf("network: %w", err)
	}
	for _, i := range e.members {
		if err := e.startReplica(e.newReplica(i, false)); err != nil {
			return err
		}
	}
	e.bgWG.Add(1)
	go e.monitor()
	if _, err := e.waitFor("raft ready on every replica", 90*time.Second, 200*time.Millisecond, func() bool {
		for _, i := range e.members {
			st, err := e.acc.getStatus(e.ctx, e.acc.url(i))
			if err != nil || !st.Ready {
				return false
			}
		}
		return true
	}); err != nil {
		return err
	}
	for j := 1; j <= 2; j++ {
		m := &mock{id: fmt.Sprintf("mock-%d", j), port: mockBase + j, registerEvery: e.registerEvery}
		m.name, m.logPath = m.id, filepath.Join(e.dir, m.id+".log")
		if err := m.start(m.argv(e.bin("kvmock"), e.members, e.cred), e.pids); err != nil {
			return err
		}
		e.mocks = append(e.mocks, m)
	}
	cfg, err := haproxyConfig(filepath.Join(e.opts.Root, "deploy", "haproxy", "haproxy.cfg"), e.members, e.haproxyCheckTLS)
	if err != nil {
		return err
	}
	cfgPath := filepath.Join(e.dir, "haproxy.cfg")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		return err
	}
	e.haproxy = &proc{name: "haproxy", logPath: filepath.Join(e.dir, "haproxy.log")}
	if err := e.haproxy.start([]string{e.opts.HAProxy, "-db", "-f", cfgPath}, e.pids); err != nil {
		return err
	}
	// Ledger workers.
	var natsURLs, regURLs []string
	for _, i := range e.members {
		natsURLs = append(natsURLs, fmt.Sprintf("nats://%s:%d", nodeIP(i), natsPort))
		regURLs = append(regURLs, e.acc.url(i))
	}
	bgCtx := e.bgCtx
	for j := 1; j <= e.opts.LedgerWorkers; j++ {
		w := newLedgerWorker(j, e.log, e.opts.LedgerEvery, e.iso, regURLs, e.acc, e.registerEvery)
		// Worker j starts on server j (mod 3), then the others in order.
		urls := append(slices.Clone(natsURLs[(j-1)%len(natsURLs):]), natsURLs[:(j-1)%len(natsURLs)]...)
		var tlsConf *tls.Config
		if e.cred != nil {
			if tlsConf, err = e.cred.workerTLS(w.id); err != nil {
				return fmt.Errorf("ledger worker %d: %w", j, err)
			}
		}
		if err := w.connect(urls, tlsConf); err != nil {
			return fmt.Errorf("ledger worker %d: %w", j, err)
		}
		first := make(chan error, 1)
		e.bgWG.Add(1)
		go func() { defer e.bgWG.Done(); w.register(bgCtx, first) }()
		if err := <-first; err != nil {
			return fmt.Errorf("ledger worker %d: registration: %w", j, err)
		}
		e.ledger = append(e.ledger, w)
	}
	if _, err := e.waitFor("every replica /ready and HAProxy sees all UP", 60*time.Second, 250*time.Millisecond, func() bool {
		if !e.allReady() {
			return false
		}
		hs, err := haproxyStatus(e.ctx)
		if err != nil {
			return false
		}
		for _, i := range e.members {
			if hs[fmt.Sprintf("r%d", i)] != "UP" {
				return false
			}
		}
		return true
	}); err != nil {
		return err
	}
	if _, err := e.waitFor("kvmock workers registered", 30*time.Second, 250*time.Millisecond, func() bool {
		st, err := e.acc.getStatus(e.ctx, e.acc.url(e.members[0]))
		if err != nil {
			return false
		}
		n := 0
		for _, w := range st.Workers {
			if w.Model == routeModel {
				n++
			}
		}
		return n == len(e.mocks)
	}); err != nil {
		return err
	}
	e.event("setup", "cluster ready: %d replicas, %d kvmock workers, %d ledger workers, HAProxy %s:%d", len(e.members), len(e.mocks), len(e.ledger), hostIP, lbPort)
	return nil
}

// haproxyCheckTLS is server i's health-check TLS: the replica port is
// HTTPS only off loopback, so HAProxy's checks (its own connections; the
// balanced traffic passes through as TCP) speak TLS, verify the chain
// against the run's CA and the certificate's name against node i's, so a
// check on rN passes only if rN answers.
func (e *env) haproxyCheckTLS(i int) string {
	if e.cred == nil {
		return ""
	}
	return fmt.Sprintf("check-ssl verify required ca-file %s verifyhost %s", e.cred.caFile(), nodeName(i))
}

// startWorkload starts the ledger publishers and the clients; the fault
// phase runs from now for the scenario's duration.
func (e *env) startWorkload() {
	e.start = time.Now()
	e.end = e.start.Add(e.opts.Duration)
	e.admin.start = e.start
	ledgerCtx, stopLedger := context.WithCancel(e.ctx)
	clientCtx, stopClients := context.WithCancel(e.ctx)
	e.stopLedger, e.stopClients, e.workloadCtx = stopLedger, stopClients, clientCtx
	for _, w := range e.ledger {
		e.ledgerWG.Add(1)
		go func() { defer e.ledgerWG.Done(); w.run(ledgerCtx) }()
	}
	for c := 0; c < e.routeClients; c++ {
		e.clientsWG.Add(1)
		go func() { defer e.clientsWG.Done(); routeClient(clientCtx, c, e.acc, e.route, 100*time.Millisecond) }()
	}
	refs := func() []replicaRef {
		e.mu.Lock()
		defer e.mu.Unlock()
		var out []replicaRef
		for _, i := range e.members {
			out = append(out, replicaRef{id: e.replicas[i].id, url: e.acc.url(i)})
		}
		return out
	}
	for c := 0; c < e.adminClients; c++ {
		e.clientsWG.Add(1)
		go func() {
			defer e.clientsWG.Done()
			adminClient(clientCtx, c, e.acc, refs, e.admin, 150*time.Millisecond)
		}()
	}
	e.event("workload", "started: %d route clients via HAProxy, %d admin clients, %d ledger workers (one event per %s each); fault phase %s",
		e.routeClients, e.adminClients, len(e.ledger), e.opts.LedgerEvery, e.opts.Duration)
}

// monitor polls every replica's status into status.jsonl (the run's Raft
// timeline) until the background context ends.
func (e *env) monitor() {
	defer e.bgWG.Done()
	f, err := os.Create(filepath.Join(e.dir, "status.jsonl"))
	if err != nil {
		return
	}
	defer f.Close()
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	last := map[int]string{}
	for {
		select {
		case <-e.bgCtx.Done():
			return
		case <-t.C:
		}
		for _, i := range e.replicaIdxs() {
			ctx, cancel := context.WithTimeout(e.bgCtx, 400*time.Millisecond)
			st, err := e.acc.getStatus(ctx, e.acc.url(i))
			cancel()
			line := map[string]any{"at": time.Now().Format("15:04:05.000"), "node": fmt.Sprintf("r%d", i)}
			key := "down"
			if err != nil {
				line["err"] = shortErr(err)
			} else {
				line["state"], line["leader"], line["term"], line["applied"], line["commit"], line["ready"], line["reason"] =
					st.State, st.LeaderID, st.Term, st.AppliedIndex, st.CommitIndex, st.Ready, st.ReadyReason
				key = fmt.Sprintf("%s/%s/%d/%v", st.State, st.LeaderID, st.Term, st.Ready)
				if len(st.RaftGroups) > 0 {
					// Each data group's leader as this replica sees it: the
					// timeline of a multi-group failover.
					var gs []string
					for _, g := range st.RaftGroups {
						gs = append(gs, fmt.Sprintf("g%d:%s/%s/%v", g.Group, g.State, g.LeaderID, g.Ready))
					}
					line["groups"] = gs
					key += " " + strings.Join(gs, " ")
				}
			}
			b, _ := json.Marshal(line)
			f.Write(append(b, '\n'))
			if key != last[i] {
				e.log.Info("replica state", "node", fmt.Sprintf("r%d", i), "state", key)
				last[i] = key
			}
		}
	}
}

func (e *env) replicaIdxs() []int {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []int
	for i := range e.replicas {
		out = append(out, i)
	}
	sort.Ints(out)
	return out
}

// waitFor polls cond until it holds (returns the time it took) or timeout.
// allReady reports whether every member answers /ready with 200.
func (e *env) allReady() bool {
	for _, i := range e.members {
		if e.acc.getReady(e.ctx, e.acc.url(i)) != 200 {
			return false
		}
	}
	return true
}

// measureReadyAfter waits (up to 60 s) until every member is ready and
// records ready_after_restart_s since t1 (NaN when they never all were).
func (e *env) measureReadyAfter(t1 time.Time, what string) {
	_, err := e.waitFor(what, 60*time.Second, 100*time.Millisecond, e.allReady)
	rs := time.Since(t1).Seconds()
	if err != nil {
		rs = math.NaN()
	}
	e.event("recovered", "%s: %.2fs after the restart", what, rs)
	e.measure("ready_after_restart_s", rs)
}

func (e *env) waitFor(what string, timeout, every time.Duration, cond func() bool) (time.Duration, error) {
	t0 := time.Now()
	for {
		if cond() {
			return time.Since(t0), nil
		}
		if e.ctx.Err() != nil {
			return time.Since(t0), e.ctx.Err()
		}
		if time.Since(t0) > timeout {
			return time.Since(t0), fmt.Errorf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(every)
	}
}

// statuses returns the status of every given replica that answers.
func (e *env) statuses(idxs []int) map[int]*status { return e.statusesOpt(idxs, true) }

// statusesOpt is statuses, without the digests when digest is false.
func (e *env) statusesOpt(idxs []int, digest bool) map[int]*status {
	out := map[int]*status{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, i := range idxs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(e.ctx, 800*time.Millisecond)
			defer cancel()
			if st, err := e.acc.getStatusOpt(ctx, e.acc.url(i), digest); err == nil {
				mu.Lock()
				out[i] = st
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return out
}

// leader finds the current leader among the members (waits up to 15 s for
// one that is ready).
func (e *env) leader() (int, error) {
	var idx int
	_, err := e.waitFor("a ready leader", 15*time.Second, 100*time.Millisecond, func() bool {
		for i, st := range e.statuses(e.members) {
			if st.State == "leader" && st.Ready {
				idx = i
				return true
			}
		}
		return false
	})
	return idx, err
}

// waitNewLeader measures the time from since until a replica other than
// old is a ready leader.
func (e *env) waitNewLeader(old int, since time.Time, timeout time.Duration) (float64, int, error) {
	var idx int
	var others []int
	for _, i := range e.members {
		if i != old {
			others = append(others, i)
		}
	}
	_, err := e.waitFor("a new leader", timeout, 50*time.Millisecond, func() bool {
		for i, st := range e.statuses(others) {
			if st.State == "leader" && st.Ready {
				idx = i
				return true
			}
		}
		return false
	})
	return time.Since(since).Seconds(), idx, err
}

func (e *env) others(i int) []int {
	var out []int
	for _, m := range e.members {
		if m != i {
			out = append(out, m)
		}
	}
	return out
}

// --- faults -----------------------------------------------------------------------

func (e *env) kill(i int) {
	r := e.replicas[i]
	pid := r.pid()
	r.kill()
	e.event("kill", "SIGKILL %s (pid %d)", r.id, pid)
}

func (e *env) restart(i int) error {
	r := e.replicas[i]
	if r.running() {
		return nil
	}
	if err := e.startReplica(r); err != nil {
		e.event("error", "restart %s: %v", r.id, err)
		return err
	}
	e.event("restart", "%s started again (pid %d)", r.id, r.pid())
	return nil
}

// --- the end: heal, drain, compare ------------------------------------------------------

// healAll undoes every fault: rules flushed, stopped processes continued,
// dead members restarted.
func (e *env) healAll() {
	for i := range e.net.created {
		if err := heal(e.ctx, i); err != nil {
			e.log.Warn("heal", "node", i, "err", err)
		}
	}
	for _, i := range e.members {
		r := e.replicas[i]
		r.mu.Lock()
		stopped := r.stopped && r.cmd != nil && !r.exited()
		r.mu.Unlock()
		if stopped {
			_ = r.signal(syscall.SIGCONT)
			e.event("heal", "SIGCONT %s", r.id)
		}
		if !r.running() {
			_ = e.restart(i)
		}
	}
	for name := range e.iso.since {
		e.iso.set(name, false)
	}
}

// finish stops the workload, drains and verifies. It fills e.res.
func (e *env) finish() {
	e.healAll()
	e.event("heal", "every fault undone; stopping clients")
	e.stopClients()
	e.clientsWG.Wait()
	e.stopLedger()
	e.ledgerWG.Wait()
	flushCtx, cancel := context.WithTimeout(e.ctx, 60*time.Second)
	var flushErrs []string
	for _, w := range e.ledger {
		if err := w.pub.Flush(flushCtx); err != nil {
			flushErrs = append(flushErrs, fmt.Sprintf("%s: %v", w.id, err))
		}
	}
	cancel()
	if len(flushErrs) > 0 {
		e.event("error", "ledger flush: %s", strings.Join(flushErrs, "; "))
	}
	e.metric("ledger_flush_errors", flushErrs)
	var sums []ledgerSummary
	for _, w := range e.ledger {
		sums = append(sums, w.summary())
	}
	e.writeJSON("ledger.json", sums)

	// Drain: every member ready, every ledger event consumed, one state.
	e.event("drain", "waiting for every replica to be ready, consume every ledger event and agree on one digest")
	var final map[int]*status
	drainT, err := e.waitFor("drain", 120*time.Second, 250*time.Millisecond, func() bool {
		sts := e.statuses(e.members)
		if len(sts) != len(e.members) {
			return false
		}
		var digest string
		var applied uint64
		for _, i := range e.members {
			st := sts[i]
			if !st.Ready || e.acc.getReady(e.ctx, e.acc.url(i)) != 200 {
				return false
			}
			if digest == "" {
				digest, applied = st.Digest, st.AppliedIndex
			} else if st.Digest != digest || st.AppliedIndex != applied {
				return false
			}
			for _, s := range sums {
				if cur, _, _, ok := rankOf(st, s.Worker); !ok || cur < s.LastAcked {
					return false
				}
			}
		}
		// The top-level digest and applied index are the control group's:
		// sharded, every data group must agree as well.
		if e.raftGroups > 1 && !groupsAgree(sts, e.members, e.raftGroups) {
			return false
		}
		final = sts
		return true
	})
	if err != nil {
		e.res.Error = "drain: " + err.Error()
		e.event("error", "drain did not converge: %v", err)
		final = e.statuses(e.members)
	} else {
		e.event("drain", "converged in %.1fs", drainT.Seconds())
	}
	e.metric("drain_s", drainT.Seconds())
	for i, st := range final {
		_ = os.WriteFile(filepath.Join(e.dir, fmt.Sprintf("final-status-r%d.json", i)), st.raw, 0o644)
	}
	e.compare(sums, final)

	// Route availability.
	total, okFirst, okRetry, failed, errs := e.route.snapshot()
	e.res.Availability = Ratio(okFirst+okRetry, total)
	e.res.AvailabilityNoRetry = Ratio(okFirst, total)
	e.metric("route_requests", total)
	e.metric("route_failed_first_attempt", total-okFirst)
	e.metric("route_failed_after_retry", failed)
	e.metric("route_errors", errs)
	e.route.mu.Lock()
	e.writeJSON("route-failures.json", e.route.failures)
	e.route.mu.Unlock()

	// Admin history.
	e.admin.mu.Lock()
	e.writeJSON("admin-history.json", e.admin.ops)
	e.admin.mu.Unlock()
	lin := checkLinearizable(e.admin, 30*time.Second, filepath.Join(e.dir, "admin-linearizability.html"))
	e.res.Linearizable = lin.Result
	e.metric("admin", lin)
	e.event("verify", "lost %d, duplicates %d, unexpected %d, digests equal %v, availability %.4f (no retry %.4f, %d requests), admin history %s (%d ops)",
		e.res.Lost, e.res.Duplicates, e.res.Unexpected, e.res.DigestsEqual, e.res.Availability, e.res.AvailabilityNoRetry, total, lin.Result, lin.Ops)
}

// groupOn is data group g's entry in st's raft_groups.
func groupOn(st *status, g int) (groupS, bool) {
	for _, gs := range st.RaftGroups {
		if gs.Group == g {
			return gs, true
		}
	}
	return groupS{}, false
}

// groupsAgree: every member reports every data group 1..groups with one
// digest and one applied index per group.
func groupsAgree(sts map[int]*status, members []int, groups int) bool {
	for g := 1; g <= groups; g++ {
		var digest string
		var applied uint64
		for k, i := range members {
			st, ok := sts[i]
			if !ok {
				return false
			}
			gs, ok := groupOn(st, g)
			if !ok || gs.Digest == "" {
				return false
			}
			if k == 0 {
				digest, applied = gs.Digest, gs.AppliedIndex
			} else if gs.Digest != digest || gs.AppliedIndex != applied {
				return false
			}
		}
	}
	return true
}

func firstKey(m map[string][]string) string {
	for k := range m {
		return k
	}
	return ""
}

// rankOf finds worker's rank 0 on a status: cursor, blocks, stale reason.
func rankOf(st *status, worker string) (cursor uint64, blocks int, stale string, ok bool) {
	for _, w := range st.Workers {
		if w.ID == worker {
			for _, r := range w.Ranks {
				if r.Rank == 0 {
					return r.LastEventID, r.Blocks, r.Stale, true
				}
			}
		}
	}
	return 0, 0, "", false
}

// compare checks the ledger against every replica's final state.
func (e *env) compare(sums []ledgerSummary, final map[int]*status) {
	type cell struct {
		Replica string `json:"replica"`
		Cursor  uint64 `json:"cursor"`
		Blocks  int    `json:"blocks"`
		Stale   string `json:"stale,omitempty"`
		Missing bool   `json:"missing,omitempty"`
	}
	type row struct {
		ledgerSummary
		Replicas []cell `json:"replicas"`
		Lost     int    `json:"lost"`
		Dups     int    `json:"duplicates"`
		Unexp    int    `json:"unexpected"`
	}
	var rows []row
	resyncs, ackIso, gapSkipped, gaveUp := 0, 0, 0, 0
	var gaveUpEx []string
	for _, s := range sums {
		rw := row{ledgerSummary: s}
		for _, i := range e.members {
			st, ok := final[i]
			c := cell{Replica: fmt.Sprintf("r%d", i)}
			if !ok {
				c.Missing = true
				rw.Replicas = append(rw.Replicas, c)
				rw.Unexp++
				rw.Lost = max(rw.Lost, s.Acked)
				continue
			}
			cur, blocks, stale, found := rankOf(st, s.Worker)
			c.Cursor, c.Blocks, c.Stale, c.Missing = cur, blocks, stale, !found
			rw.Replicas = append(rw.Replicas, c)
			if !found {
				rw.Unexp++
				rw.Lost = max(rw.Lost, s.Acked)
				continue
			}
			lost := 0
			if cur < s.LastAcked {
				lost = int(s.LastAcked - cur)
			}
			if blocks < s.HeldRange[0] {
				lost = max(lost, s.HeldRange[0]-blocks)
			}
			rw.Lost = max(rw.Lost, lost)
			if blocks > s.HeldRange[1] {
				rw.Dups = max(rw.Dups, blocks-s.HeldRange[1])
			}
			if cur > s.Published || stale != "" {
				rw.Unexp++
			}
		}
		// Replicas must agree with each other too.
		for _, c := range rw.Replicas[1:] {
			if c.Blocks != rw.Replicas[0].Blocks || c.Cursor != rw.Replicas[0].Cursor {
				rw.Unexp++
				break
			}
		}
		e.res.Lost += rw.Lost
		e.res.Duplicates += rw.Dups
		e.res.Unexpected += rw.Unexp
		resyncs += len(s.Resyncs)
		ackIso += s.AckViaIso
		gapSkipped += s.GapSkipped
		gaveUp += len(s.Failed)
		for id, why := range s.Failed {
			if len(gaveUpEx) < 3 {
				gaveUpEx = append(gaveUpEx, fmt.Sprintf("%s event %d: %s", s.Worker, id, why))
			}
		}
		rows = append(rows, rw)
	}
	e.writeJSON("ledger-check.json", rows)
	acked := 0
	for _, s := range sums {
		acked += s.Acked
	}
	e.metric("ledger_acked_events", acked)
	e.metric("ledger_resyncs", resyncs)
	e.metric("acks_via_isolated_server", ackIso)
	e.metric("acked_events_skipped_in_gaps", gapSkipped)
	e.metric("ledger_events_given_up", gaveUp)
	if len(gaveUpEx) > 0 {
		e.metric("ledger_events_given_up_examples", gaveUpEx)
	}

	digests := map[string][]string{}
	var dups, gaps uint64
	for _, i := range e.members {
		if st, ok := final[i]; ok {
			digests[st.Digest] = append(digests[st.Digest], st.NodeID)
			dups += st.FSM.Duplicates
			gaps += st.FSM.Gaps
		}
	}
	e.res.DigestsEqual = len(digests) == 1 && len(final) == len(e.members)
	e.metric("digests", digests)
	if e.raftGroups > 1 {
		// Per data group: its digest on every replica (a group missing on
		// a replica counts as a disagreement).
		perGroup := map[string]map[string][]string{}
		e.groupsEqual = map[int]bool{}
		for g := 1; g <= e.raftGroups; g++ {
			ds := map[string][]string{}
			for _, i := range e.members {
				st, ok := final[i]
				if !ok {
					continue
				}
				if gs, ok := groupOn(st, g); ok {
					ds[gs.Digest] = append(ds[gs.Digest], st.NodeID)
				}
			}
			_, blank := ds[""]
			equal := len(ds) == 1 && !blank && len(final) == len(e.members) && len(ds[firstKey(ds)]) == len(e.members)
			e.groupsEqual[g] = equal
			perGroup[fmt.Sprintf("g%d", g)] = ds
			if !equal {
				e.res.DigestsEqual = false
			}
		}
		e.metric("group_digests", perGroup)
	}
	e.metric("fsm_duplicates_skipped", dups)
	e.metric("fsm_gaps", gaps)
}

// --- teardown -----------------------------------------------------------------------

func (e *env) teardown() {
	if e.stopClients != nil {
		e.stopClients()
	}
	if e.stopLedger != nil {
		e.stopLedger()
	}
	e.clientsWG.Wait()
	e.ledgerWG.Wait()
	if e.stopBackground != nil {
		e.stopBackground()
	}
	for _, w := range e.ledger {
		if w.pub != nil {
			w.pub.Close()
		}
		if w.nc != nil {
			w.nc.Close()
		}
	}
	var wg sync.WaitGroup
	stop := func(p *proc) {
		defer wg.Done()
		p.mu.Lock()
		stopped := p.stopped && p.cmd != nil && !p.exited()
		p.mu.Unlock()
		if stopped {
			_ = p.signal(syscall.SIGCONT)
		}
		p.term(5 * time.Second)
	}
	for _, m := range e.mocks {
		wg.Add(1)
		go stop(&m.proc)
	}
	if e.haproxy != nil {
		wg.Add(1)
		go stop(e.haproxy)
	}
	wg.Wait()
	for _, r := range e.replicas {
		wg.Add(1)
		go stop(&r.proc)
	}
	wg.Wait()
	e.bgWG.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	e.net.teardown(ctx)
	e.tlMu.Lock()
	if e.tlFile != nil {
		e.tlFile.Close()
		e.tlFile = nil
	}
	e.tlMu.Unlock()
}
