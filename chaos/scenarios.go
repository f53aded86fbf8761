//go:build chaos

package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

var scenarios = map[string]scenario{
	"T1": {nemesis: t1Nemesis, check: t1Check},
	"T2": {nemesis: t2Nemesis, check: t2Check},
	"T3": {nemesis: t3Nemesis, check: t3Check},
	"T4": {nemesis: t4Nemesis, check: t4Check, minDuration: 30 * time.Second}, // one isolation and its recovery
	"T5": {nemesis: t5Nemesis, check: t5Check},
	"T6": {nemesis: t6Nemesis, check: t6Check},
	// T7 needs a snapshot past the trailing logs, and raft checks for one
	// every 30-60 s (jittered SnapshotInterval): at least 80 s.
	"T7":  {nemesis: t7Nemesis, check: t7Check, ledgerEvery: 8 * time.Millisecond, minDuration: 80 * time.Second},
	"T8":  {nemesis: t8Nemesis, check: t8Check},
	"T11": {nemesis: t11Nemesis, check: t11Check},
	// G1 shards the index (issue 19): a control group and three data groups.
	"G1": {nemesis: g1Nemesis, check: g1Check, raftGroups: g1Groups},
	"S1": {nemesis: s1Nemesis, check: s1Check, selfTest: true},
	"U1": {nemesis: u1Nemesis, check: u1Check, prev: []int{3}, minDuration: 40 * time.Second},
	// D1: a worker drain racing a leader failover (drain.go, issue 29).
	// Renewals every 100 s: a kvmock renewing after its drain completed
	// would register again; the harness re-registers it between rounds.
	"D1": {nemesis: d1Nemesis, check: d1Check, maxDuration: d1MaxDuration, registerEvery: quietRenewal},
	// D2: D1 on a sharded index; the worker's data group leader is killed.
	"D2": {nemesis: d1Nemesis, check: d1Check, maxDuration: d1MaxDuration, registerEvery: quietRenewal, raftGroups: d2Groups},
	// A1: the security probes (probes.go), in a quiet window.
	"A1": {nemesis: a1Nemesis, check: a1Check, quiet: true},
	// AF1: sessions through HAProxy while the leader holding their
	// bindings is killed every 10 s (sessions.go, issue 28).
	"AF1": {nemesis: af1Nemesis, check: af1Check, serveArgs: afServeArgs, minDuration: afMinDuration},
}

func (e *env) measure(name string, v float64) {
	e.tlMu.Lock()
	defer e.tlMu.Unlock()
	if e.meas == nil {
		e.meas = map[string][]float64{}
	}
	e.meas[name] = append(e.meas[name], v)
}

func (e *env) measured(name string) []float64 {
	e.tlMu.Lock()
	defer e.tlMu.Unlock()
	return append([]float64(nil), e.meas[name]...)
}

// worst is the maximum of a measurement (NaN if never measured).
func (e *env) worst(name string) float64 {
	xs := e.measured(name)
	if len(xs) == 0 {
		return math.NaN()
	}
	m := xs[0]
	for _, x := range xs[1:] {
		m = math.Max(m, x)
	}
	return m
}

func (e *env) publishMeasures() {
	e.tlMu.Lock()
	defer e.tlMu.Unlock()
	for k, v := range e.meas {
		e.metric(k, v)
	}
}

// failover measures, in the background, the time from t0 until a replica
// other than old is a ready leader; join waits for it.
func (e *env) failover(old int, t0 time.Time, what string) (join func() float64) {
	ch := make(chan float64, 1)
	go func() {
		s, idx, err := e.waitNewLeader(old, t0, 30*time.Second)
		if err != nil {
			e.event("failover", "%s: no new ready leader after %.1fs: %v", what, s, err)
		} else {
			e.event("failover", "%s: r%d is a ready leader %.2fs after the fault", what, idx, s)
		}
		e.measure("failover_s", s)
		ch <- s
	}()
	return func() float64 { return <-ch }
}

// --- probes ----------------------------------------------------------------------

type probeOp struct {
	Call    time.Time
	Latency time.Duration
	OK      bool
	Err     string
}

// writeProbe posts busy-threshold writes to one replica every `every` until
// stop is closed; each waits at most 5 s.
func (e *env) writeProbe(i int, every time.Duration) (stop func() []probeOp) {
	ctx, cancel := context.WithCancel(e.ctx)
	var mu sync.Mutex
	var ops []probeOp
	done := make(chan struct{})
	go func() {
		defer close(done)
		n := int64(0)
		for ctx.Err() == nil {
			n++
			call := time.Now()
			cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
			err := probeWrite(cctx, e.acc, e.acc.url(i), n)
			ccancel()
			if ctx.Err() != nil {
				return
			}
			op := probeOp{Call: call, Latency: time.Since(call), OK: err == nil}
			if err != nil {
				op.Err = err.Error()
			}
			mu.Lock()
			ops = append(ops, op)
			mu.Unlock()
			select {
			case <-ctx.Done():
			case <-time.After(every):
			}
		}
	}()
	return func() []probeOp {
		cancel()
		<-done
		mu.Lock()
		defer mu.Unlock()
		return ops
	}
}

// probeWrite sets the ledger model's prefill-token threshold: a Raft write
// like the admin clients', on a field their register history does not track.
func probeWrite(ctx context.Context, acc *access, base string, n int64) error {
	return postThreshold(ctx, acc, base, fmt.Sprintf(`{"model":%q,"active_prefill_tokens_threshold":%d}`, ledgerModel, 900000+n))
}

// probeSummary: writes called in [from, to): successes, and the slowest
// failure (seconds).
func probeSummary(ops []probeOp, from, to time.Time) (calls, ok int, slowestFail float64, errs map[string]int) {
	errs = map[string]int{}
	for _, op := range ops {
		if op.Call.Before(from) || !op.Call.Before(to) {
			continue
		}
		calls++
		if op.OK {
			ok++
			continue
		}
		slowestFail = math.Max(slowestFail, op.Latency.Seconds())
		errs[firstN(op.Err, 90)]++
	}
	return
}

// untilReady measures the time from t0 until replica i's /ready answers
// want (in the background).
func (e *env) untilReady(i int, want int, t0 time.Time, timeout time.Duration) func() float64 {
	ch := make(chan float64, 1)
	go func() {
		_, err := e.waitFor(fmt.Sprintf("r%d /ready %d", i, want), timeout, 100*time.Millisecond, func() bool {
			ctx, cancel := context.WithTimeout(e.ctx, 500*time.Millisecond)
			defer cancel()
			return e.acc.getReady(ctx, e.acc.url(i)) == want
		})
		if err != nil {
			ch <- math.NaN()
			return
		}
		ch <- time.Since(t0).Seconds()
	}()
	return func() float64 { return <-ch }
}

// untilHAProxy measures the time from t0 until HAProxy reports server rI
// with a status starting with want (UP, DOWN).
func (e *env) untilHAProxy(i int, want string, t0 time.Time, timeout time.Duration) func() float64 {
	ch := make(chan float64, 1)
	go func() {
		name := fmt.Sprintf("r%d", i)
		_, err := e.waitFor("HAProxy "+name+" "+want, timeout, 100*time.Millisecond, func() bool {
			hs, err := haproxyStatus(e.ctx)
			return err == nil && strings.HasPrefix(hs[name], want)
		})
		if err != nil {
			ch <- math.NaN()
			return
		}
		ch <- time.Since(t0).Seconds()
	}()
	return func() float64 { return <-ch }
}

// caughtUp measures the time from t0 until replica i is ready (raft) and
// has applied at least target.
func (e *env) caughtUp(i int, target uint64, t0 time.Time, timeout time.Duration) float64 {
	_, err := e.waitFor(fmt.Sprintf("r%d caught up to %d", i, target), timeout, 100*time.Millisecond, func() bool {
		st, err := e.acc.getStatus(e.ctx, e.acc.url(i))
		return err == nil && st.Ready && st.AppliedIndex >= target
	})
	if err != nil {
		return math.NaN()
	}
	return time.Since(t0).Seconds()
}

// commitIndexOfLeader returns the commit index a ready leader reports.
func (e *env) commitIndexOfLeader(exclude int) (uint64, int) {
	var idx int
	var commit uint64
	_, _ = e.waitFor("leader commit index", 10*time.Second, 100*time.Millisecond, func() bool {
		for i, st := range e.statuses(e.members) {
			if i != exclude && st.State == "leader" && st.Ready {
				idx, commit = i, st.CommitIndex
				return true
			}
		}
		return false
	})
	return commit, idx
}

func (e *env) requireAvailability(withRetry, noRetry float64) {
	if withRetry > 0 {
		e.res.Require("availability", e.res.Availability, ">=", withRetry, "route requests via HAProxy, one client retry")
	}
	if noRetry > 0 {
		e.res.Require("availability_no_retry", e.res.AvailabilityNoRetry, ">=", noRetry, "route requests via HAProxy, no retry")
	}
}

// --- T1: leader SIGKILL every 20 s, restarted 5 s later ------------------------------

func t1Nemesis(e *env) error {
	for at := e.start.Add(10 * time.Second); !at.Add(5 * time.Second).After(e.end); at = at.Add(20 * time.Second) {
		if !e.sleepUntil(at) {
			return e.ctx.Err()
		}
		l, err := e.leader()
		if err != nil {
			e.event("error", "no leader to kill: %v", err)
			continue
		}
		t0 := time.Now()
		e.kill(l)
		join := e.failover(l, t0, "leader r"+fmt.Sprint(l)+" killed")
		e.sleepUntil(t0.Add(5 * time.Second))
		_ = e.restart(l)
		join()
	}
	return nil
}

func t1Check(e *env) {
	fo := e.measured("failover_s")
	e.res.FailoverP99 = Percentile(fo, 99)
	e.publishMeasures()
	e.res.Require("leader_kills", float64(len(fo)), ">=", 1, "")
	e.res.Require("failover_p99_s", e.res.FailoverP99, "<=", 5, "kill to a ready new leader")
	e.requireAvailability(0.995, 0.97)
}

// --- T2: random replica kill, down 3-8 s -------------------------------------------------

func t2Nemesis(e *env) error {
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 2))
	for at := e.start.Add(8 * time.Second); !at.Add(8 * time.Second).After(e.end); at = at.Add(14 * time.Second) {
		if !e.sleepUntil(at) {
			return e.ctx.Err()
		}
		l, _ := e.leader()
		v := e.members[rng.IntN(len(e.members))]
		down := time.Duration(3000+rng.IntN(5001)) * time.Millisecond
		t0 := time.Now()
		e.kill(v)
		var join func() float64
		if v == l {
			join = e.failover(l, t0, "leader r"+fmt.Sprint(l)+" killed")
		}
		e.event("nemesis", "r%d down for %.1fs (leader: %v)", v, down.Seconds(), v == l)
		e.sleepUntil(t0.Add(down))
		_ = e.restart(v)
		if join != nil {
			join()
		}
	}
	return nil
}

func t2Check(e *env) {
	fo := e.measured("failover_s")
	e.res.FailoverP99 = Percentile(fo, 99)
	if len(fo) == 0 {
		e.res.FailoverP99 = 0
	}
	e.publishMeasures()
	if len(fo) > 0 {
		e.res.Require("failover_p99_s", e.res.FailoverP99, "<=", 5, "leader kills only")
	}
	e.requireAvailability(0.995, 0)
}

// --- T3: leader SIGSTOP 5 s every 30 s ------------------------------------------------------

func t3Nemesis(e *env) error {
	for at := e.start.Add(10 * time.Second); !at.Add(8 * time.Second).After(e.end); at = at.Add(30 * time.Second) {
		if !e.sleepUntil(at) {
			return e.ctx.Err()
		}
		l, err := e.leader()
		if err != nil {
			e.event("error", "no leader to stop: %v", err)
			continue
		}
		r := e.replicas[l]
		t0 := time.Now()
		if err := r.signal(syscall.SIGSTOP); err != nil {
			return err
		}
		e.event("stop", "SIGSTOP leader r%d (pid %d) for 5s", l, r.pid())
		join := e.failover(l, t0, "leader r"+fmt.Sprint(l)+" stopped")
		e.sleepUntil(t0.Add(5 * time.Second))
		join()
		if err := r.signal(syscall.SIGCONT); err != nil {
			return err
		}
		t1 := time.Now()
		e.event("cont", "SIGCONT r%d", l)
		// On resume the old leader must learn it is deposed (a status
		// from itself saying it is not the leader).
		_, err = e.waitFor("old leader steps down", 15*time.Second, 50*time.Millisecond, func() bool {
			st, err := e.acc.getStatus(e.ctx, e.acc.url(l))
			return err == nil && st.State != "leader"
		})
		s := time.Since(t1).Seconds()
		if err != nil {
			s = math.NaN()
		}
		e.event("stepdown", "r%d no longer leader %.2fs after SIGCONT", l, s)
		e.measure("stepdown_s", s)
	}
	return nil
}

func t3Check(e *env) {
	fo := e.measured("failover_s")
	e.res.FailoverP99 = Percentile(fo, 99)
	e.publishMeasures()
	e.res.Require("leader_stops", float64(len(fo)), ">=", 1, "")
	e.res.Require("failover_p99_s", e.res.FailoverP99, "<=", 5, "SIGSTOP to a ready new leader")
	e.res.Require("stepdown_s", e.worst("stepdown_s"), "<=", 3, "old leader not leader any more after SIGCONT")
	e.res.RequireTrue("admin_linearizable", e.res.Linearizable == "Ok", "porcupine over /busy_threshold writes and reads: "+e.res.Linearizable)
}

// --- T4: leader isolated by iptables for 10 s -------------------------------------------------

func t4Nemesis(e *env) error {
	for at := e.start.Add(10 * time.Second); !at.Add(20 * time.Second).After(e.end); at = at.Add(25 * time.Second) {
		if !e.sleepUntil(at) {
			return e.ctx.Err()
		}
		l, err := e.leader()
		if err != nil {
			e.event("error", "no leader to isolate: %v", err)
			continue
		}
		name := fmt.Sprintf("r%d", l)
		stopProbe := e.writeProbe(l, 100*time.Millisecond)
		e.sleep(300 * time.Millisecond) // a few writes before, as a baseline
		if err := isolate(e.ctx, l, e.others(l)); err != nil {
			stopProbe()
			return err
		}
		t0 := time.Now()
		e.iso.set(name, true)
		attached := 0
		for _, w := range e.ledger {
			if w.nc.ConnectedServerName() == name {
				attached++
			}
		}
		e.measure("ledger_workers_on_isolated", float64(attached))
		e.event("isolate", "leader %s cut from %v (iptables DROP both ways)", name, e.others(l))
		ready := e.untilReady(l, 503, t0, 15*time.Second)
		ha := e.untilHAProxy(l, "DOWN", t0, 15*time.Second)
		join := e.failover(l, t0, "leader "+name+" isolated")
		e.sleepUntil(t0.Add(10 * time.Second))
		if err := heal(e.ctx, l); err != nil {
			stopProbe()
			return err
		}
		t1 := time.Now()
		e.iso.set(name, false)
		e.event("heal", "%s reconnected", name)
		ops := stopProbe()
		calls, ok, slowest, errs := probeSummary(ops, t0, t1)
		e.event("probe", "%d writes to %s while isolated: %d succeeded, slowest failure %.2fs, errors %v", calls, name, ok, slowest, errs)
		e.measure("isolated_write_successes", float64(ok))
		e.measure("isolated_write_fail_max_s", slowest)
		e.measure("isolated_writes", float64(calls))
		e.measure("majority_leader_s", join())
		r503, rha := ready(), ha()
		e.event("probe", "%s /ready 503 after %.2fs, HAProxy DOWN after %.2fs", name, r503, rha)
		e.measure("isolated_ready_503_s", r503)
		e.measure("haproxy_down_s", rha)
		commit, _ := e.commitIndexOfLeader(l)
		conv := e.caughtUp(l, commit, t1, 30*time.Second)
		e.event("converged", "%s ready and caught up to %d %.2fs after healing", name, commit, conv)
		e.measure("converge_after_heal_s", conv)
	}
	return nil
}

func t4Check(e *env) {
	fo := e.measured("majority_leader_s")
	e.res.FailoverP99 = Percentile(fo, 99)
	e.publishMeasures()
	e.res.Require("isolations", float64(len(fo)), ">=", 1, "")
	e.res.Require("isolated_writes", sum(e.measured("isolated_writes")), ">=", 1, "writes probed on the isolated leader")
	e.res.Require("isolated_write_successes", sum(e.measured("isolated_write_successes")), "==", 0, "writes the isolated leader accepted")
	e.res.Require("isolated_write_fail_max_s", e.worst("isolated_write_fail_max_s"), "<=", 1.5, "slowest failing write on the isolated leader")
	e.res.Require("ledger_workers_on_isolated", e.worst("ledger_workers_on_isolated"), ">=", 1, "publishers attached to the isolated replica's NATS (else the next check proves nothing)")
	e.res.Require("acks_via_isolated_server", asFloat(e.res.Metrics["acks_via_isolated_server"]), "==", 0, "stream acks through the isolated replica's NATS")
	e.res.Require("failover_p99_s", e.res.FailoverP99, "<=", 5, "majority has a ready leader")
	e.res.Require("isolated_ready_503_s", e.worst("isolated_ready_503_s"), "<=", 3, "")
	e.res.Require("haproxy_down_s", e.worst("haproxy_down_s"), "<=", 5, "")
	e.res.Require("converge_after_heal_s", e.worst("converge_after_heal_s"), "<=", 10, "")
}

func sum(xs []float64) float64 {
	s := 0.0
	for _, x := range xs {
		s += x
	}
	return s
}

func asFloat(v any) float64 {
	switch x := v.(type) {
	case int:
		return float64(x)
	case float64:
		return x
	case uint64:
		return float64(x)
	}
	return math.NaN()
}

// --- T5: two of three killed for 20 s ----------------------------------------------------------

func t5Nemesis(e *env) error {
	at := e.start.Add(10 * time.Second)
	down := 20 * time.Second
	if room := e.end.Sub(at) - 10*time.Second; room < down {
		down = max(room, 5*time.Second)
	}
	if !e.sleepUntil(at) {
		return e.ctx.Err()
	}
	l, err := e.leader()
	if err != nil {
		return err
	}
	victims := []int{l}
	survivor := 0
	for _, i := range e.members {
		if i != l && len(victims) < 2 {
			victims = append(victims, i)
		} else if i != l {
			survivor = i
		}
	}
	stopProbe := e.writeProbe(survivor, 200*time.Millisecond)
	t0 := time.Now()
	for _, v := range victims {
		e.kill(v)
	}
	e.event("nemesis", "r%d (leader) and r%d killed for %s; r%d survives alone", victims[0], victims[1], down, survivor)
	notReady := e.untilReady(survivor, 503, t0, 15*time.Second)
	// The survivor must stay unready the whole time.
	readyWhileAlone := 0
	for time.Since(t0) < down-500*time.Millisecond {
		if e.acc.getReady(e.ctx, e.acc.url(survivor)) == 200 && time.Since(t0) > 3*time.Second {
			readyWhileAlone++
		}
		if !e.sleep(250 * time.Millisecond) {
			break
		}
	}
	e.sleepUntil(t0.Add(down))
	t1 := time.Now()
	for _, v := range victims {
		_ = e.restart(v)
	}
	ops := stopProbe()
	calls, ok, slowest, errs := probeSummary(ops, t0.Add(2*time.Second), t1)
	e.event("probe", "%d writes to the lone r%d: %d succeeded, slowest failure %.2fs, errors %v", calls, survivor, ok, slowest, errs)
	e.measure("survivor_writes", float64(calls))
	e.measure("survivor_write_successes", float64(ok))
	e.measure("survivor_write_fail_max_s", slowest)
	e.measure("survivor_not_ready_s", notReady())
	e.measure("survivor_ready_while_alone", float64(readyWhileAlone))
	e.measureReadyAfter(t1, "every replica ready after the restart")
	fo, _, _ := e.waitNewLeader(0, t1, 30*time.Second)
	e.measure("failover_s", fo)
	return nil
}

func t5Check(e *env) {
	e.res.FailoverP99 = Percentile(e.measured("failover_s"), 99)
	e.publishMeasures()
	e.res.Require("survivor_writes", sum(e.measured("survivor_writes")), ">=", 1, "")
	e.res.Require("survivor_write_successes", sum(e.measured("survivor_write_successes")), "==", 0, "a lone replica must not accept writes")
	e.res.Require("survivor_write_fail_max_s", e.worst("survivor_write_fail_max_s"), "<=", 1.5, "writes fail fast")
	e.res.Require("survivor_not_ready_s", e.worst("survivor_not_ready_s"), "<=", 3, "")
	e.res.Require("survivor_ready_while_alone", sum(e.measured("survivor_ready_while_alone")), "==", 0, "")
	e.res.Require("ready_after_restart_s", e.worst("ready_after_restart_s"), "<=", 10, "")
}

// --- T6: all three SIGKILLed mid-load ------------------------------------------------------

func t6Nemesis(e *env) error {
	at := e.start.Add(max(e.opts.Duration/2, 10*time.Second))
	if !e.sleepUntil(at) {
		return e.ctx.Err()
	}
	var wg sync.WaitGroup
	for _, i := range e.members {
		wg.Add(1)
		go func() { defer wg.Done(); e.replicas[i].kill() }()
	}
	wg.Wait()
	e.event("kill", "SIGKILL every replica at once")
	e.sleep(2 * time.Second)
	t1 := time.Now()
	for _, i := range e.members {
		_ = e.restart(i)
	}
	join := e.failover(0, t1, "full restart")
	e.measureReadyAfter(t1, "every replica /ready 200 after the full restart")
	join()
	return nil
}

func t6Check(e *env) {
	e.res.FailoverP99 = Percentile(e.measured("failover_s"), 99)
	e.publishMeasures()
	e.res.Require("ready_after_restart_s", e.worst("ready_after_restart_s"), "<=", 10, "all three /ready 200 after the full restart")
}

// --- T7: wiped follower and a new fourth replica catch up by snapshot ----------------------------

// t7SnapshotWait bounds the wait for the first leader snapshot: raft's
// first check comes at most 60 s after the start (SnapshotInterval 30 s of
// cluster.DefaultConfig plus up to 30 s of jitter), plus a margin for a
// slow machine.
const t7SnapshotWait = 75 * time.Second

func t7Nemesis(e *env) error {
	// A follower from scratch only needs a snapshot once the leader has
	// compacted its log: wait for a snapshot past the trailing logs (2048,
	// cluster.DefaultConfig): then entry 1 is gone from every log. Admin
	// writes of another field (one Raft entry each) fill the log faster.
	pumpCtx, stopPump := context.WithCancel(e.ctx)
	var pumpWG sync.WaitGroup
	var pumped atomic.Int64
	for g := 0; g < 4; g++ {
		pumpWG.Add(1)
		go func() {
			defer pumpWG.Done()
			for n := 0; pumpCtx.Err() == nil; n++ {
				i := e.members[(g+n)%len(e.members)]
				body := fmt.Sprintf(`{"model":%q,"active_prefill_tokens_threshold":%d}`, ledgerModel, 1000+n)
				req, _ := http.NewRequestWithContext(pumpCtx, http.MethodPost, e.acc.url(i)+"/busy_threshold", strings.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				if resp, err := e.acc.adminDo(req); err == nil {
					resp.Body.Close()
					pumped.Add(1)
				}
			}
		}()
	}
	// The snapshot is the scenario's precondition, not a figure under test:
	// wait for it as long as raft may take, even past the fault phase.
	// Each replica checks SnapshotInterval (30 s) plus a random jitter of
	// up to another 30 s after its start, so the leader's first check can
	// come ~57 s into the workload; bounding the wait by the fault phase
	// (D - 25 s = 55 s at 80 s) could miss it, and then the follower caught
	// up from the log and wiped_snapshots_restored failed although nothing
	// was wrong.
	var snapIdx uint64
	_, err := e.waitFor("a leader snapshot past the trailing logs", max(e.end.Sub(time.Now())-25*time.Second, t7SnapshotWait), time.Second, func() bool {
		for _, st := range e.statuses(e.members) {
			if st.State == "leader" && st.LastSnapshotIndex > 2048+16 {
				snapIdx = st.LastSnapshotIndex
				return true
			}
		}
		return false
	})
	stopPump()
	pumpWG.Wait()
	e.metric("log_pump_writes", pumped.Load())
	if err != nil {
		e.event("nemesis", "no leader snapshot past the trailing logs yet; wiping anyway (catch-up may use the log)")
	} else {
		e.event("nemesis", "leader snapshot at index %d", snapIdx)
	}
	l, err := e.leader()
	if err != nil {
		return err
	}
	f := e.others(l)[0]
	r := e.replicas[f]
	r.kill()
	if err := os.RemoveAll(r.dataDir); err != nil {
		return err
	}
	e.event("wipe", "r%d killed and its data dir removed", f)
	t0 := time.Now()
	if err := e.restart(f); err != nil {
		return err
	}
	commit, _ := e.commitIndexOfLeader(f)
	s := e.caughtUp(f, commit, t0, 60*time.Second)
	st, _ := e.acc.getStatus(e.ctx, e.acc.url(f))
	restored := uint64(0)
	if st != nil {
		restored = st.SnapshotsRestored
	}
	e.event("caught-up", "wiped r%d caught up to %d in %.2fs (snapshots restored: %d)", f, commit, s, restored)
	e.measure("wiped_catchup_s", s)
	e.measure("wiped_snapshots_restored", float64(restored))

	// A new fourth replica joins.
	if err := e.net.addNode(e.ctx, 4); err != nil {
		return err
	}
	n := e.newReplica(4, true)
	t1 := time.Now()
	if err := e.startReplica(n); err != nil {
		return err
	}
	e.mu.Lock()
	e.members = append(e.members, 4)
	e.mu.Unlock()
	e.event("join", "r4 started with --join")
	commit, _ = e.commitIndexOfLeader(4)
	s = e.caughtUp(4, commit, t1, 60*time.Second)
	st, _ = e.acc.getStatus(e.ctx, e.acc.url(4))
	restored = 0
	if st != nil {
		restored = st.SnapshotsRestored
	}
	e.event("caught-up", "new r4 caught up to %d in %.2fs (snapshots restored: %d)", commit, s, restored)
	e.measure("new_catchup_s", s)
	e.measure("new_snapshots_restored", float64(restored))
	e.measure("leader_snapshot_index", float64(snapIdx))
	return nil
}

func t7Check(e *env) {
	e.res.FailoverP99 = 0
	e.publishMeasures()
	e.res.Require("leader_snapshot_index", e.worst("leader_snapshot_index"), ">=", 2048+17,
		"precondition: the leader compacted its log before the wipe (else the catch-up cannot need a snapshot)")
	e.res.Require("wiped_catchup_s", e.worst("wiped_catchup_s"), "<=", 10, "")
	e.res.Require("wiped_snapshots_restored", e.worst("wiped_snapshots_restored"), ">=", 1, "caught up by snapshot")
	e.res.Require("new_catchup_s", e.worst("new_catchup_s"), "<=", 10, "")
	e.res.Require("new_snapshots_restored", e.worst("new_snapshots_restored"), ">=", 1, "caught up by snapshot")
}

// --- T8: rolling SIGTERM restart, leader last ------------------------------------------------

func t8Nemesis(e *env) error {
	if !e.sleepUntil(e.start.Add(8 * time.Second)) {
		return e.ctx.Err()
	}
	l, err := e.leader()
	if err != nil {
		return err
	}
	order := append(e.others(l), l)
	for _, i := range order {
		r := e.replicas[i]
		t0 := time.Now()
		var join func() float64
		if i == l {
			join = e.failover(l, t0, "leader r"+fmt.Sprint(l)+" SIGTERM")
		}
		pid := r.pid()
		graceful := r.term(20 * time.Second)
		e.event("term", "r%d (pid %d) stopped by SIGTERM in %.2fs (graceful: %v)", i, pid, time.Since(t0).Seconds(), graceful)
		e.measure("stop_s", time.Since(t0).Seconds())
		if !graceful {
			e.measure("ungraceful_stops", 1)
		}
		if err := e.restart(i); err != nil {
			return err
		}
		// Back: the replica answers /ready 200, then HAProxy has it UP.
		t1 := time.Now()
		ready := e.untilReady(i, 200, t1, 60*time.Second)()
		back := e.untilHAProxy(i, "UP", t1, 60*time.Second)()
		if math.IsNaN(ready) || math.IsNaN(back) {
			e.event("error", "r%d not back (ready after %.2fs, HAProxy UP after %.2fs)", i, ready, back)
		} else {
			e.event("up", "r%d ready %.2fs and UP in HAProxy %.2fs after its restart", i, ready, back)
			e.measure("back_ready_s", ready)
		}
		if join != nil {
			join()
		}
		e.sleep(2 * time.Second)
	}
	return nil
}

func t8Check(e *env) {
	e.res.FailoverP99 = Percentile(e.measured("failover_s"), 99)
	e.publishMeasures()
	failed := asFloat(e.res.Metrics["route_failed_first_attempt"])
	e.res.Require("route_failed_requests", failed, "==", 0, "no retry, through HAProxy, during the rolling restart")
	e.res.Require("ungraceful_stops", sum(e.measured("ungraceful_stops")), "==", 0, "replicas that needed SIGKILL after 20 s")
	e.res.Require("failover_p99_s", e.res.FailoverP99, "<=", 5, "leader handover on SIGTERM")
}

// --- T11: replica-sync traffic of one replica cut for 30 s ------------------------------------

func t11Nemesis(e *env) error {
	at := e.start.Add(10 * time.Second)
	cut := 30 * time.Second
	if room := e.end.Sub(at) - 10*time.Second; room < cut {
		cut = max(room, 5*time.Second)
	}
	if !e.sleepUntil(at) {
		return e.ctx.Err()
	}
	l, err := e.leader()
	if err != nil {
		return err
	}
	v := e.others(l)[0]
	if err := cutPort(e.ctx, v, e.others(v), routePort); err != nil {
		return err
	}
	t0 := time.Now()
	e.event("cut", "NATS route traffic (replica sync, JetStream replication) of follower r%d cut for %s", v, cut)
	// The cut is effective when the victim hears no other replica.
	_, err = e.waitFor("victim hears no replica", 15*time.Second, 250*time.Millisecond, func() bool {
		return syncPeers(e, v) == 0
	})
	if err != nil {
		e.event("error", "r%d still hears other replicas: the cut did not take", v)
		e.measure("cut_effective", 0)
	} else {
		e.event("probe", "r%d hears no replica %.1fs after the cut", v, time.Since(t0).Seconds())
		e.measure("cut_effective", 1)
	}
	e.sleepUntil(t0.Add(cut))
	if err := heal(e.ctx, v); err != nil {
		return err
	}
	t1 := time.Now()
	e.event("heal", "r%d routes restored", v)
	_, err = e.waitFor("replica sync restored", 30*time.Second, 250*time.Millisecond, func() bool {
		for _, i := range e.members {
			if syncPeers(e, i) != len(e.members)-1 {
				return false
			}
		}
		return true
	})
	s := time.Since(t1).Seconds()
	if err != nil {
		s = math.NaN()
	}
	e.event("recovered", "every replica hears every other %.2fs after healing", s)
	e.measure("sync_restored_s", s)
	return nil
}

func syncPeers(e *env, i int) int {
	st, err := e.acc.getStatus(e.ctx, e.acc.url(i))
	if err != nil {
		return -1
	}
	var doc struct {
		Sync struct {
			Replicas int `json:"Replicas"`
		} `json:"replica_sync"`
	}
	if err := json.Unmarshal(st.raw, &doc); err != nil {
		return -1
	}
	return doc.Sync.Replicas
}

func t11Check(e *env) {
	e.res.FailoverP99 = 0
	e.publishMeasures()
	e.res.Require("cut_effective", e.worst("cut_effective"), "==", 1, "the victim stopped hearing the others")
	e.res.Require("sync_restored_s", e.worst("sync_restored_s"), "<=", 10, "")
	e.requireAvailability(0.995, 0)
}

// --- G1: the leaders of several Raft groups killed at once (issue 19) --------------------

// g1Groups is G1's --raft-groups: one data group per replica, so the
// round-robin spread gives every replica one and the control group's
// leader a second.
const g1Groups = 3

// groupLeaders reads, from the members that answer (without digests),
// which replica leads each group: 0 the control group, 1..G the data
// groups. whole reports whether the cluster is intact: every member
// answers and is ready in every group, and every group has exactly one
// leader.
func (e *env) groupLeaders() (leads map[int]int, whole bool) {
	sts := e.statusesOpt(e.members, false)
	leads = map[int]int{}
	count := map[int]int{}
	whole = len(sts) == len(e.members)
	for i, st := range sts {
		if !st.Ready || len(st.RaftGroups) != e.raftGroups {
			whole = false
		}
		if st.State == "leader" {
			leads[0] = i
			count[0]++
		}
		for _, g := range st.RaftGroups {
			if !g.Ready {
				whole = false
			}
			if g.State == "leader" {
				leads[g.Group] = i
				count[g.Group]++
			}
		}
	}
	for g := 0; g <= e.raftGroups; g++ {
		if count[g] != 1 {
			whole = false
		}
	}
	return leads, whole
}

// g1Nemesis kills, every 10 s from 10 s on, the replica that leads the
// most Raft groups (control and data), so each kill takes several groups'
// leaders at the same moment; the victim is restarted 5 s later. Only one
// replica is down at a time: two of three would take every group's quorum.
// The spread (data group g preferred on the sorted ids' g mod 3) leaves one
// replica leading the control group and a data group; after a kill the
// survivors may hold three groups until the spread hands one back, which
// the next kill then takes.
func g1Nemesis(e *env) error {
	// Precondition: every data group owns workers (placement puts each new
	// worker in the group with the fewest) and the leaders are spread.
	var leads map[int]int
	minWorkers := 0
	_, err := e.waitFor("every data group owns a worker and leaders on two replicas or more", 20*time.Second, 250*time.Millisecond, func() bool {
		var whole bool
		leads, whole = e.groupLeaders()
		if !whole {
			return false
		}
		st, err := e.acc.getStatusOpt(e.ctx, e.acc.url(e.members[0]), false)
		if err != nil || len(st.RaftGroups) != g1Groups {
			return false
		}
		minWorkers = math.MaxInt
		for _, g := range st.RaftGroups {
			minWorkers = min(minWorkers, g.Workers)
		}
		return minWorkers > 0 && len(distinct(leads)) >= 2
	})
	if err != nil {
		e.event("error", "precondition: %v (leaders %v)", err, leads)
	}
	e.measure("min_group_workers", float64(minWorkers))
	e.event("nemesis", "group leaders before the first kill: %s", describeLeads(leads))
	for at := e.start.Add(10 * time.Second); !at.Add(5 * time.Second).After(e.end); at = at.Add(10 * time.Second) {
		if !e.sleepUntil(at) {
			return e.ctx.Err()
		}
		// The previous victim must be back in every group first: the
		// failover measured is then of a whole cluster's.
		var whole bool
		if _, err := e.waitFor("every replica ready in every group, one leader each", 15*time.Second, 100*time.Millisecond, func() bool {
			leads, whole = e.groupLeaders()
			return whole
		}); err != nil {
			e.event("error", "no kill at %.0fs: the cluster is not whole (leaders %s)", time.Since(e.start).Seconds(), describeLeads(leads))
			e.measure("skipped_kills", 1)
			continue
		}
		v, led := mostLeading(leads)
		t0 := time.Now()
		e.kill(v)
		e.event("nemesis", "r%d led groups %v (%s): all lost their leader at once", v, led, describeLeads(leads))
		e.measure("groups_lost_per_kill", float64(len(led)))
		e.measure("leader_replicas_at_kill", float64(len(distinct(leads))))
		join := e.groupFailover(v, led, t0)
		e.sleepUntil(t0.Add(5 * time.Second))
		_ = e.restart(v)
		join()
	}
	return nil
}

// distinct is the set of replicas in leads.
func distinct(leads map[int]int) map[int]bool {
	out := map[int]bool{}
	for _, i := range leads {
		out[i] = true
	}
	return out
}

// mostLeading is the replica leading the most groups, ties broken in favour
// of the control group's leader (its loss takes registrations, placement
// and the data group it leads at once), then the lowest index; and the
// groups it leads, sorted.
func mostLeading(leads map[int]int) (int, []int) {
	per := map[int][]int{}
	for g, i := range leads {
		per[i] = append(per[i], g)
	}
	best := -1
	for i, gs := range per {
		switch {
		case best < 0, len(gs) > len(per[best]):
			best = i
		case len(gs) == len(per[best]):
			if leads[0] == i || (leads[0] != best && i < best) {
				best = i
			}
		}
	}
	gs := per[best]
	sort.Ints(gs)
	return best, gs
}

func describeLeads(leads map[int]int) string {
	var parts []string
	for g := 0; g <= g1Groups; g++ {
		name := fmt.Sprintf("g%d", g)
		if g == 0 {
			name = "control"
		}
		if i, ok := leads[g]; ok {
			parts = append(parts, fmt.Sprintf("%s r%d", name, i))
		} else {
			parts = append(parts, name+" none")
		}
	}
	return strings.Join(parts, ", ")
}

// groupFailover measures, in the background, per group in lost the time
// from t0 until a replica other than old leads it and is ready in it
// (group 0: the control group, read from the top-level state as T1 reads
// it); join waits until every group has one or 30 s have passed.
func (e *env) groupFailover(old int, lost []int, t0 time.Time) (join func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		others := e.others(old)
		pending := map[int]bool{}
		for _, g := range lost {
			pending[g] = true
		}
		for len(pending) > 0 && time.Since(t0) < 30*time.Second && e.ctx.Err() == nil {
			for i, st := range e.statusesOpt(others, false) {
				found := map[int]bool{}
				if st.State == "leader" && st.Ready {
					found[0] = true
				}
				for _, g := range st.RaftGroups {
					if g.State == "leader" && g.Ready {
						found[g.Group] = true
					}
				}
				for g := range found {
					if !pending[g] {
						continue
					}
					delete(pending, g)
					s := time.Since(t0).Seconds()
					e.event("failover", "group %d: r%d is its ready leader %.2fs after r%d was killed", g, i, s, old)
					e.measure("group_failover_s", s)
					e.measure(fmt.Sprintf("g%d_failover_s", g), s)
				}
			}
			time.Sleep(50 * time.Millisecond)
		}
		for g := range pending {
			e.event("failover", "group %d: no ready leader %.1fs after r%d was killed", g, time.Since(t0).Seconds(), old)
			e.measure("groups_without_new_leader", 1)
		}
	}()
	return func() { <-done }
}

func g1Check(e *env) {
	fo := e.measured("group_failover_s")
	e.res.FailoverP99 = Percentile(fo, 99)
	// One figure per group and kill; with fewer than 100, p99 is the max.
	e.metric("group_failover_max_s", Percentile(fo, 100))
	e.metric("group_failover_p50_s", Percentile(fo, 50))
	e.metric("group_failovers", len(fo))
	multi := 0
	for _, n := range e.measured("groups_lost_per_kill") {
		if n >= 2 {
			multi++
		}
	}
	e.metric("kills_of_several_group_leaders", multi)
	e.publishMeasures()
	e.res.Require("min_group_workers", e.worst("min_group_workers"), ">=", 1, "every data group owns a worker before the first kill")
	e.res.Require("leader_kills", float64(len(e.measured("groups_lost_per_kill"))), ">=", 2, "")
	e.res.Require("kills_of_several_group_leaders", float64(multi), ">=", 1, "kills that took two or more groups' leaders at once")
	e.res.Require("skipped_kills", sum(e.measured("skipped_kills")), "==", 0, "kills skipped because the cluster was not whole 15 s after the last restart")
	e.res.Require("groups_without_new_leader", sum(e.measured("groups_without_new_leader")), "==", 0, "groups with no ready leader 30 s after a kill")
	e.res.Require("group_failover_max_s", Percentile(fo, 100), "<=", 5, "per group, kill to a ready new leader")
	for g := 1; g <= e.raftGroups; g++ {
		e.res.RequireTrue(fmt.Sprintf("g%d_digests_equal", g), e.groupsEqual[g], "data group's digest on every replica after heal and drain")
	}
	e.requireAvailability(0.995, 0.97)
}

// --- S1: the checker's self-test -------------------------------------------------------------

// s1Nemesis injects what the ledger check must catch: ledger-1 (which
// refuses resyncs) is deregistered for a while, so its acknowledged events
// are rejected and its blocks dropped (a loss); ledger-2 publishes one
// replayed store behind the ledger's back (a duplicate).
func s1Nemesis(e *env) error {
	if len(e.ledger) < 2 {
		return fmt.Errorf("self-test needs two ledger workers")
	}
	e.ledger[0].noResync = true
	if !e.sleepUntil(e.start.Add(8 * time.Second)) {
		return e.ctx.Err()
	}
	body := fmt.Sprintf(`{"id":%q}`, e.ledger[0].id)
	req, _ := http.NewRequestWithContext(e.ctx, http.MethodPost, e.acc.url(e.members[0])+"/workers/deregister", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := e.acc.adminDo(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	e.event("inject", "deregistered %s (HTTP %d): its blocks and cursor are dropped, its events rejected until it renews", e.ledger[0].id, resp.StatusCode)
	if err := e.ledger[1].injectReplay(e.ctx); err != nil {
		return err
	}
	e.event("inject", "%s published a replay of its first store outside the ledger", e.ledger[1].id)
	return nil
}

func s1Check(e *env) {
	e.publishMeasures()
	e.res.Require("lost_detected", float64(e.res.Lost), ">=", 1, "the injected loss must be reported")
	e.res.Require("duplicates_detected", float64(e.res.Duplicates), ">=", 1, "the injected replay must be reported")
}

// --- U1: rolling upgrade from the previous release under load ---------------------------

// u1Nemesis: r3 runs the previous release's kvrouter from the start, beside
// two replicas of this build, while ledger events, admin writes and routed
// requests flow. Throughout, the replicas' digests are compared whenever
// two of them hold the same applied index. Half-way r3 is stopped by
// SIGTERM and started again on this build (one step of a rolling upgrade):
// it must come back ready and agree; the common checks then find nothing
// lost and every digest equal.
//
// What it upgrades across is PREV_REF (chaos/run.sh): by default 27008e8,
// the last build before snapshot format 2, the halt-on-unknown-command
// policy, the clock bounds and format 3 (fsm/DESIGN.md), i.e. every fsm
// change since. That build predates TLS, so with it U1 runs the whole
// cluster without TLS and authentication (runScenario: hasTLSFlags; the
// result's metrics say so): members that speak Raft only over mutual TLS
// and one that cannot are no cluster. 2e93e6a, the first landed build with
// the TLS flags, is no substitute yet: the fsm has not changed since it, so
// an upgrade from it would test a restart, not an upgrade. Once the fsm
// changes after a TLS build, PREV_REF=<that build> runs U1 secure with no
// change here.
func u1Nemesis(e *env) error {
	const i = 3
	sampled := e.sampleDigests(200 * time.Millisecond)
	// Let the old release lead for a while too: a SIGTERMed leader hands
	// leadership to a follower, which may be r3 (at most three tries).
	if !e.sleepUntil(e.start.Add(e.opts.Duration / 6)) {
		return e.ctx.Err()
	}
	for try := 0; try < 3; try++ {
		l, err := e.leader()
		if err != nil || l == i {
			break
		}
		e.replicas[l].term(20 * time.Second)
		e.event("term", "leader r%d stopped by SIGTERM so that another replica leads", l)
		if err := e.restart(l); err != nil {
			return err
		}
		e.untilReady(l, 200, time.Now(), 60*time.Second)()
	}
	if l, err := e.leader(); err == nil {
		e.event("leader", "r%d leads (r%d runs the previous release)", l, i)
		if l == i {
			e.measure("previous_release_led", 1)
		}
	}
	if !e.sleepUntil(e.start.Add(e.opts.Duration / 2)) {
		return e.ctx.Err()
	}
	r := e.replicas[i]
	t0 := time.Now()
	pid := r.pid()
	graceful := r.term(20 * time.Second)
	e.event("term", "r%d (previous release, pid %d) stopped by SIGTERM in %.2fs (graceful: %v)", i, pid, time.Since(t0).Seconds(), graceful)
	r.bin = "" // this build from now on
	if err := e.restart(i); err != nil {
		return err
	}
	ready := e.untilReady(i, 200, time.Now(), 60*time.Second)()
	if math.IsNaN(ready) {
		e.event("error", "r%d not ready on this build after 60 s", i)
	} else {
		e.event("up", "r%d ready on this build %.2fs after its restart", i, ready)
		e.measure("upgraded_ready_s", ready)
	}
	if !e.sleepUntil(e.end) {
		return e.ctx.Err()
	}
	compared, mismatched := sampled()
	e.event("verify", "digests of two replicas compared at %d applied indexes, %d disagreed", compared, mismatched)
	e.measure("digest_comparisons", float64(compared))
	e.measure("digest_mismatches", float64(mismatched))
	return nil
}

func u1Check(e *env) {
	e.metric("previous_release_led", sum(e.measured("previous_release_led")) > 0)
	e.publishMeasures()
	e.res.Require("digest_mismatches", sum(e.measured("digest_mismatches")), "==", 0, "replicas (of both releases) with different digests at the same applied index")
	e.res.Require("digest_comparisons", sum(e.measured("digest_comparisons")), ">=", 1, "applied indexes at which two replicas' digests were compared")
	e.res.Require("upgraded_ready_s", e.worst("upgraded_ready_s"), "<=", 30, "the upgraded replica ready on this build after its restart")
}

// sampleDigests polls every replica's status until the fault phase ends
// and compares digests of equal applied indexes across replicas. A status
// reads the applied index before it computes the digest, so a sample counts
// only when a second status right after reports the same applied index:
// the first one's digest was then of that index (the second's may already
// be of a later one). The returned function waits for the
// sampler and returns how many indexes were compared and how many of them
// disagreed (each disagreement is logged).
func (e *env) sampleDigests(every time.Duration) func() (compared, mismatched int) {
	done := make(chan struct{})
	seen := map[uint64]struct {
		digest string
		from   int
	}{}
	compared, mismatched := 0, 0
	go func() {
		defer close(done)
		for time.Now().Before(e.end) && e.ctx.Err() == nil {
			for _, i := range e.replicaIdxs() {
				a, err := e.acc.getStatus(e.ctx, e.acc.url(i))
				if err != nil || a.Digest == "" {
					continue
				}
				b, err := e.acc.getStatus(e.ctx, e.acc.url(i))
				if err != nil || b.AppliedIndex != a.AppliedIndex {
					continue
				}
				prev, ok := seen[a.AppliedIndex]
				switch {
				case !ok:
					seen[a.AppliedIndex] = struct {
						digest string
						from   int
					}{a.Digest, i}
				case prev.from == i:
				default:
					compared++
					if prev.digest != a.Digest {
						mismatched++
						e.event("error", "applied index %d: r%d digest %s, r%d digest %s", a.AppliedIndex, prev.from, prev.digest, i, a.Digest)
					}
				}
			}
			e.sleep(every)
		}
	}()
	return func() (int, int) {
		<-done
		return compared, mismatched
	}
}
