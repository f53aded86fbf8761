//go:build chaos

package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	"go.etcd.io/bbolt"
)

// D1: a worker drain racing a leader failover (issue 29). Each round
// drains kvmock mock-1 through a follower (POST /workers/drain) and
// SIGKILLs the leader — unsharded, the leader of the group that owns the
// worker — either at once (odd rounds: the drain is pending, the next
// leader must complete it) or as soon as a follower has applied the old
// leader's completion (even rounds, polled every 20 ms: the completion is
// committed, the old leader may not have applied it or heard its answer,
// and the next leader must not complete it again). The old leader
// proposes it 3.0-3.5 s after the drain applied, once the worker was idle
// for the replica's 3 s grace. The leader comes back 4 s after the kill. A round ends when
// no replica lists mock-1 any more; the harness then registers it again
// (with the registration it had) for the next round.
//
// The workers renew their leases only every quietRenewal (100 s): a
// kvmock renewing after its drain completed registers again, undrained
// (replica DESIGN.md, "Draining workers"), which would blur both what
// "deregistered" means and which registration a completion removed. The
// harness re-registers mock-1 itself, at a known time.
//
// Checked: each round the worker is deregistered on every replica; no
// replica routes to it after applying the drain (kvrouter_routed_total
// of each replica process, sampled only between two status reads that
// both show it drained); the worker receives nothing once no replica
// lists it (its /stats); and, from every replica's Raft log read after
// the run, the drain completed exactly once per round (a completion that
// removed the worker, counted by replaying mock-1's commands with the
// FSM's rule: a completion applies only while the worker is registered
// and drained) and every replica's log says the same.

const d1Worker = "mock-1"

// d2Groups: D2 runs D1 on a sharded index (--raft-groups 3), where the
// drain lives in the worker's data group and its leader need not lead
// the control group.
const d2Groups = 3

// d1MaxDuration: two rounds take ~24 s (a round: the drain, a failover
// of ~2 s, the next leader's 3 s idle grace, the restart, the worker
// registered again); 30 s holds two. A longer DURATION is cut to this so
// the short tier grows by ~40 s, not by DURATION.
const d1MaxDuration = 30 * time.Second

// d1Round is one drain and its failover.
type d1Round struct {
	N         int                `json:"round"`
	Group     int                `json:"group"` // the group that owns the worker (0: the control group, unsharded)
	Via       string             `json:"drained_via"`
	Killed    string             `json:"leader_killed"`
	KillAfter float64            `json:"kill_after_commit_s"`
	Raced     bool               `json:"killed_as_completion_committed"` // a racing round's kill came when a follower had applied the completion
	Commit    time.Time          `json:"commit_at"`                      // the drain's answer: applied on Via, so committed
	Drained   map[string]float64 `json:"drained_seen_s"`
	Gone      map[string]float64 `json:"deregistered_seen_s"`
	GoneAll   float64            `json:"deregistered_everywhere_s"`
	// WorkerRequests: the worker's own request count when no replica
	// listed it, and again just before the harness registered it again.
	WorkerRequestsGone  int64  `json:"worker_requests_at_deregistration"`
	WorkerRequestsAfter int64  `json:"worker_requests_before_reregistration"`
	Err                 string `json:"error,omitempty"`
}

func d1Nemesis(e *env) error {
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 16))
	reg, err := e.d1Registration()
	if err != nil {
		return err
	}
	watch := newRoutedWatch(e, d1Worker)
	defer watch.stop()
	var rounds []*d1Round
	defer func() { e.writeJSON("drain-rounds.json", rounds) }()
	for n := 1; ; n++ {
		// A round needs ~12 s: drain, failover, the next leader's grace.
		if time.Until(e.end) < 12*time.Second || !e.sleep(time.Second) {
			break
		}
		rd := &d1Round{N: n, Drained: map[string]float64{}, Gone: map[string]float64{}}
		rounds = append(rounds, rd)
		if err := e.d1Round(rd, rng, watch, reg, n%2 == 0); err != nil {
			rd.Err = err.Error()
			e.event("error", "drain round %d: %v", n, err)
			if e.ctx.Err() != nil {
				return e.ctx.Err()
			}
		}
	}
	e.tlMu.Lock()
	e.d1 = rounds
	e.tlMu.Unlock()
	e.d1Routed = watch.violations()
	return nil
}

// d1Round runs one drain; racing: kill the leader at the old leader's
// completion instead of at once.
func (e *env) d1Round(rd *d1Round, rng *rand.Rand, watch *routedWatch, reg string, racing bool) error {
	if _, err := e.waitFor(d1Worker+" registered and undrained on every replica", 15*time.Second, 100*time.Millisecond, func() bool {
		sts := e.statusesOpt(e.members, false)
		for _, i := range e.members {
			w, ok := workerIn(sts[i], d1Worker)
			if !ok || w.Drained {
				return false
			}
		}
		return len(sts) == len(e.members)
	}); err != nil {
		return err
	}
	g, l, err := e.d1OwnerLeader()
	if err != nil {
		return err
	}
	rd.Group = g
	fol := e.others(l)
	via := fol[rng.IntN(len(fol))]
	rd.Via, rd.Killed = fmt.Sprintf("r%d", via), fmt.Sprintf("r%d", l)
	watch.begin(rd.N)
	defer watch.end()
	ctx, cancel := context.WithTimeout(e.ctx, 10*time.Second)
	code, body, err := e.acc.post(ctx, e.acc.url(via), "/workers/drain", fmt.Sprintf(`{"id":%q}`, d1Worker))
	cancel()
	rd.Commit = time.Now()
	if err != nil || code != http.StatusAccepted {
		return fmt.Errorf("POST /workers/drain via r%d: %d %s %v", via, code, body, err)
	}
	e.event("drain", "round %d: %s (group %d) drained via r%d; the group's leader r%d to be killed %s", rd.N, d1Worker, g, via, l,
		map[bool]string{false: "at once (drain pending)", true: "as the completion commits"}[racing])
	seen := e.d1Follow(rd)
	if racing {
		// The old leader proposes the completion 3.0-3.5 s after the
		// drain applied (its idle grace); a follower that no longer lists
		// the worker has applied it: kill the leader then, before it
		// answered its own proposal or applied it, most likely.
		_, err := e.waitFor("a follower applying the completion", 10*time.Second, 20*time.Millisecond, func() bool {
			for _, st := range e.statusesOpt(fol, false) {
				if _, ok := workerIn(st, d1Worker); !ok && st.Ready {
					return true
				}
			}
			return false
		})
		rd.Raced = err == nil
	}
	rd.KillAfter = round3(time.Since(rd.Commit).Seconds())
	t0 := time.Now()
	e.kill(l)
	var join func()
	if e.raftGroups > 1 {
		join = e.groupFailover(l, []int{g}, t0)
	} else {
		f := e.failover(l, t0, fmt.Sprintf("drain round %d: leader r%d killed", rd.N, l))
		join = func() { f() }
	}
	e.sleepUntil(t0.Add(4 * time.Second))
	if e.restart(l) == nil {
		watch.started(rd.N, l, e.replicas[l].pid())
	}
	join()
	gone := seen()
	if len(rd.Gone) < len(e.members) {
		return fmt.Errorf("%s not deregistered on every replica 25 s after the drain: gone on %v", d1Worker, gone)
	}
	rd.WorkerRequestsGone = mockRequests(e.ctx, d1Worker)
	e.event("drain", "round %d: %s deregistered on every replica %.2fs after the drain (seen drained after %v; gone after %v)",
		rd.N, d1Worker, rd.GoneAll, rd.Drained, rd.Gone)
	// Nothing may reach it while no replica lists it.
	e.sleep(time.Second)
	rd.WorkerRequestsAfter = mockRequests(e.ctx, d1Worker)
	return e.d1Register(reg)
}

// d1OwnerLeader is the group that owns the worker (its registration and
// drain: the control group unsharded, its data group sharded) and the
// replica leading that group.
func (e *env) d1OwnerLeader() (group, leader int, err error) {
	if e.raftGroups <= 1 {
		l, err := e.leader()
		return 0, l, err
	}
	_, err = e.waitFor("the worker's group and a whole cluster", 15*time.Second, 100*time.Millisecond, func() bool {
		leads, whole := e.groupLeaders()
		if !whole {
			return false
		}
		st, ok := e.statusesOpt(e.members, false)[e.members[0]]
		if !ok {
			return false
		}
		w, ok := workerIn(st, d1Worker)
		if !ok || w.RaftGroup < 1 {
			return false
		}
		group, leader = w.RaftGroup, leads[w.RaftGroup]
		return true
	})
	return group, leader, err
}

// d1Follow polls every replica until each has shown the worker drained
// and then no longer listed it (25 s at most), in the background; the
// returned func waits for it.
func (e *env) d1Follow(rd *d1Round) func() []string {
	done := make(chan []string, 1)
	var mu sync.Mutex
	go func() {
		_, _ = e.waitFor(d1Worker+" deregistered on every replica", 25*time.Second, 50*time.Millisecond, func() bool {
			sts := e.statusesOpt(e.members, false)
			mu.Lock()
			defer mu.Unlock()
			for i, st := range sts {
				name := fmt.Sprintf("r%d", i)
				at := time.Since(rd.Commit).Seconds()
				w, ok := workerIn(st, d1Worker)
				if _, seen := rd.Drained[name]; !seen && ok && w.Drained {
					rd.Drained[name] = round3(at)
				}
				// Ready: a replica just restarted answers before it
				// replayed its log, without any worker.
				if _, seen := rd.Gone[name]; !seen && !ok && st.Ready {
					rd.Gone[name] = round3(at)
					rd.GoneAll = math.Max(rd.GoneAll, round3(at))
				}
			}
			return len(rd.Gone) == len(e.members)
		})
		mu.Lock()
		defer mu.Unlock()
		var gone []string
		for r := range rd.Gone {
			gone = append(gone, r)
		}
		slices.Sort(gone)
		done <- gone
	}()
	return func() []string { return <-done }
}

func round3(x float64) float64 { return math.Round(x*1000) / 1000 }

// workerIn is worker id's entry in st (false when st is nil or lacks it).
func workerIn(st *status, id string) (statusWorker, bool) {
	if st == nil {
		return statusWorker{}, false
	}
	for _, w := range st.Workers {
		if w.ID == id {
			return w, true
		}
	}
	return statusWorker{}, false
}

// d1Registration is mock-1's registration as the replicas hold it, as a
// POST /workers/register body.
func (e *env) d1Registration() (string, error) {
	st, err := e.acc.getStatus(e.ctx, e.acc.url(e.members[0]))
	if err != nil {
		return "", err
	}
	w, ok := workerIn(st, d1Worker)
	if !ok {
		return "", fmt.Errorf("%s not registered", d1Worker)
	}
	return fmt.Sprintf(`{"id":%q,"url":%q,"model":%q,"block_size":%d,"total_kv_blocks":%d,"max_num_batched_tokens":%d}`,
		w.ID, w.URL, w.Model, w.BlockSize, w.TotalBlocks, w.MaxBatchedTokens), nil
}

// d1Register registers mock-1 again for the next round.
func (e *env) d1Register(body string) error {
	ctx, cancel := context.WithTimeout(e.ctx, 10*time.Second)
	defer cancel()
	code, msg, err := e.acc.post(ctx, e.acc.url(e.members[0]), "/workers/register", body)
	if err != nil || code/100 != 2 {
		return fmt.Errorf("registering %s again: %d %s %v", d1Worker, code, msg, err)
	}
	e.event("drain", "%s registered again by the harness", d1Worker)
	return nil
}

// mockRequests is a kvmock's own count of the requests it was sent
// (chat and completions; -1 when it does not answer).
func mockRequests(ctx context.Context, id string) int64 {
	var port int
	if _, err := fmt.Sscanf(id, "mock-%d", &port); err != nil {
		return -1
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://%s:%d/stats", hostIP, mockBase+port), nil)
	resp, err := statsClient.Do(req)
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	var doc struct {
		Requests struct {
			Chat        int64 `json:"chat"`
			Completions int64 `json:"completions"`
		} `json:"requests"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
		return -1
	}
	return doc.Requests.Chat + doc.Requests.Completions
}

// --- routing decisions while drained ---------------------------------------------------

// routedWatch samples, per replica, kvrouter_routed_total{worker} between
// two /cluster/status reads. A sample whose two reads both show the
// worker drained, from the same process, brackets a moment when that
// replica had applied the drain: its routing decisions for the worker
// between the first and the last such sample of a round (and process)
// must not move. A restarted replica is a new process and starts a new
// series (its counter starts at 0).
type routedWatch struct {
	e      *env
	worker string
	mu     sync.Mutex
	round  int // 0: between rounds
	// series: round/replica/pid → the counter's first and last value
	// while drained.
	series map[string]*[2]float64
	// restarted: series (keys) of replica processes started during a
	// round, after its drain committed: every routing decision of theirs
	// to the worker came after the commit, so their counter must still
	// be 0 when they first show the drain (a replica that routed from
	// its log before replaying the drain would not be).
	restarted map[string]bool
	cancel    context.CancelFunc
	done      chan struct{}
}

func newRoutedWatch(e *env, worker string) *routedWatch {
	ctx, cancel := context.WithCancel(e.ctx)
	w := &routedWatch{e: e, worker: worker, series: map[string]*[2]float64{}, restarted: map[string]bool{}, cancel: cancel, done: make(chan struct{})}
	go w.run(ctx)
	return w
}

func (w *routedWatch) begin(round int) { w.mu.Lock(); w.round = round; w.mu.Unlock() }
func (w *routedWatch) end()            { w.mu.Lock(); w.round = 0; w.mu.Unlock() }
func (w *routedWatch) stop()           { w.cancel(); <-w.done }

// started notes replica i's new process (pid), started during round.
func (w *routedWatch) started(round, i, pid int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.restarted[seriesKey(round, i, pid)] = true
}

func seriesKey(round, i, pid int) string { return fmt.Sprintf("round %d r%d pid %d", round, i, pid) }

func (w *routedWatch) run(ctx context.Context) {
	defer close(w.done)
	var wg sync.WaitGroup
	for _, i := range w.e.members {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				w.mu.Lock()
				round := w.round
				w.mu.Unlock()
				if round > 0 {
					w.sample(ctx, round, i)
				}
				select {
				case <-ctx.Done():
				case <-time.After(50 * time.Millisecond):
				}
			}
		}()
	}
	wg.Wait()
}

func (w *routedWatch) sample(ctx context.Context, round, i int) {
	base := w.e.acc.url(i)
	read := func() (*status, bool) {
		c, cancel := context.WithTimeout(ctx, 800*time.Millisecond)
		defer cancel()
		st, err := w.e.acc.getStatusOpt(c, base, false)
		if err != nil {
			return nil, false
		}
		x, ok := workerIn(st, w.worker)
		return st, ok && x.Drained
	}
	s1, d1 := read()
	if !d1 {
		return
	}
	n, err := w.routed(ctx, base)
	if err != nil {
		return
	}
	s2, d2 := read()
	if !d2 || s1.PID != s2.PID {
		return
	}
	key := seriesKey(round, i, s1.PID)
	w.mu.Lock()
	defer w.mu.Unlock()
	if s, ok := w.series[key]; ok {
		s[1] = n
	} else {
		w.series[key] = &[2]float64{n, n}
	}
}

// routed reads the replica's kvrouter_routed_total for the worker (0
// when it never routed there).
func (w *routedWatch) routed(ctx context.Context, base string) (float64, error) {
	c, cancel := context.WithTimeout(ctx, 800*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(c, http.MethodGet, base+"/metrics", nil)
	w.e.acc.authorize(req)
	resp, err := w.e.acc.status.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("/metrics: %d", resp.StatusCode)
	}
	prefix := fmt.Sprintf(`kvrouter_routed_total{model=%q,worker=%q} `, routeModel, w.worker)
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), prefix); ok {
			return strconv.ParseFloat(v, 64)
		}
	}
	return 0, sc.Err()
}

// violations: per series with more than one sample, the decisions made
// while drained (the counter's growth); and the number of series.
func (w *routedWatch) violations() d1Routed {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := d1Routed{PerSeries: map[string]float64{}}
	for k, s := range w.series {
		out.Series++
		out.PerSeries[k] = s[1] - s[0]
		out.Total += s[1] - s[0]
		if w.restarted[k] {
			out.RestartedSeries++
			out.BeforeReplay += s[0]
		}
	}
	return out
}

type d1Routed struct {
	Series    int                `json:"series"`
	Total     float64            `json:"routed_while_drained"`
	PerSeries map[string]float64 `json:"per_series"`
	// RestartedSeries, BeforeReplay: series of processes started after a
	// drain committed, and their decisions for the worker before they
	// first showed the drain.
	RestartedSeries int     `json:"restarted_series"`
	BeforeReplay    float64 `json:"routed_by_restarted_before_drain_seen"`
}

// --- the Raft-applied history -----------------------------------------------------------

// d1ReadHistories is every group's history of the worker on one replica
// summed: sharded, a registration again may be placed in another data
// group than the one before (groups: the data groups, 0 unsharded).
func d1ReadHistories(dir, replica string, groups int, upTo map[int]uint64) drainHistory {
	h := d1ReadHistory(dir, "raft", replica, upTo[0])
	h.Group = 0
	for g := 1; g <= groups; g++ {
		x := d1ReadHistory(dir, fmt.Sprintf("raft-g%d", g), replica, upTo[g])
		h.Drains += x.Drains
		h.Completed += x.Completed
		h.Refused += x.Refused
		h.Proposed += x.Proposed
		h.OtherGone += x.OtherGone
		h.Registered = h.Registered || x.Registered
		if x.Err != "" {
			h.Err = strings.TrimPrefix(h.Err+"; ", "; ") + fmt.Sprintf("group %d: %s", g, x.Err)
		}
	}
	return h
}

// d1ReadHistory reads one group's raft.db of a replica (its process
// stopped; sub: "raft" for the control group, "raft-g<g>" for data group
// g) up to index upTo and replays the worker's commands (drainHistory).
func d1ReadHistory(dir, sub, replica string, upTo uint64) drainHistory {
	h := drainHistory{Replica: replica}
	path := filepath.Join(dir, sub, "raft.db") // cluster.Config.DataDir of the group
	if _, err := os.Stat(path); err != nil {
		h.Err = err.Error() // New would create an empty one
		return h
	}
	store, err := raftboltdb.New(raftboltdb.Options{Path: path,
		BoltOptions: &bbolt.Options{Timeout: 5 * time.Second}}) // not ReadOnly: New creates its buckets
	if err != nil {
		h.Err = err.Error()
		return h
	}
	defer store.Close()
	first, err := store.FirstIndex()
	var last uint64
	if err == nil {
		last, err = store.LastIndex()
	}
	if err != nil {
		h.Err = err.Error()
		return h
	}
	var logs []*raft.Log
	for idx := first; idx <= min(last, upTo) && idx > 0; idx++ {
		l := new(raft.Log)
		if err := store.GetLog(idx, l); err != nil {
			h.Err = fmt.Sprintf("index %d: %v", idx, err)
			return h
		}
		logs = append(logs, l)
	}
	h = replayDrains(d1Worker, logs)
	h.Replica, h.FirstIndex, h.LastIndex = replica, first, last
	return h
}

// --- the check ----------------------------------------------------------------------------

func d1Check(e *env) {
	e.tlMu.Lock()
	rounds := e.d1
	e.tlMu.Unlock()
	e.publishMeasures()
	fo := e.measured("failover_s")
	if e.raftGroups > 1 {
		fo = e.measured("group_failover_s")
		e.res.Require("groups_without_new_leader", float64(len(e.measured("groups_without_new_leader"))), "==", 0, "")
	}
	e.res.FailoverP99 = Percentile(fo, 99)
	e.res.Require("failover_p99_s", e.res.FailoverP99, "<=", 5, "kill of the drain group's leader to a ready new leader of that group")
	e.requireAvailability(0.995, 0.97)
	ok, racing := 0, 0
	var gone []float64
	var atWorker int64
	for _, rd := range rounds {
		if rd.Err == "" {
			ok++
			gone = append(gone, rd.GoneAll)
			if rd.Raced {
				racing++
			}
			if rd.WorkerRequestsGone < 0 || rd.WorkerRequestsAfter < 0 {
				atWorker = -1
			} else if atWorker >= 0 {
				atWorker += rd.WorkerRequestsAfter - rd.WorkerRequestsGone
			}
		}
	}
	e.metric("drain_rounds", rounds)
	e.metric("drain_deregistered_everywhere_s", gone)
	e.metric("drain_routed", e.d1Routed)
	e.res.Require("drain_rounds_completed", float64(ok), ">=", 2, "rounds whose worker was deregistered on every replica (one drain pending at the kill, one racing the completion)")
	e.res.Require("drain_rounds_failed", float64(len(rounds)-ok), "==", 0, "rounds that did not complete (error in drain-rounds.json)")
	e.res.Require("drain_racing_rounds", float64(racing), ">=", 1, "rounds whose leader was killed as soon as a follower had applied its completion")
	e.res.Require("drain_deregistered_max_s", Percentile(gone, 100), "<=", 20, "drain commit to no replica listing the worker")
	e.res.Require("drain_routed_while_drained", e.d1Routed.Total, "==", 0, "routing decisions to the worker by a replica that had applied the drain (kvrouter_routed_total)")
	e.res.Require("drain_routed_series", float64(e.d1Routed.Series), ">=", float64(len(e.members)), "(round, replica process) series sampled while drained")
	e.res.Require("drain_routed_by_restarted_replica", e.d1Routed.BeforeReplay, "==", 0,
		fmt.Sprintf("decisions for the worker by a replica restarted after the drain committed, before it showed the drain (%d such processes sampled)", e.d1Routed.RestartedSeries))
	e.res.Require("drain_worker_requests_after_deregistration", float64(atWorker), "==", 0, "requests the worker got while no replica listed it (its /stats)")

	// The Raft-applied history: stop the replicas (the check has what it
	// needs from them), then read each one's log up to the index they all
	// applied. Every replica's final status must list the worker as the
	// replayed rules predict (registered again after the last round).
	sts := e.statusesOpt(e.members, false)
	upTo := map[int]uint64{} // per group: the index every replica applied
	present := 0
	for g := 0; g <= max(e.raftGroups, 0); g++ {
		upTo[g] = math.MaxUint64
	}
	for _, i := range e.members {
		st, ok := sts[i]
		if !ok {
			clear(upTo)
			break
		}
		upTo[0] = min(upTo[0], st.AppliedIndex)
		for _, gs := range st.RaftGroups {
			upTo[gs.Group] = min(upTo[gs.Group], gs.AppliedIndex)
		}
		if w, ok := workerIn(st, d1Worker); ok && !w.Drained {
			present++
		}
	}
	for _, i := range e.members {
		e.replicas[i].term(10 * time.Second)
	}
	var hs []drainHistory
	agree := true
	for _, i := range e.members {
		h := d1ReadHistories(e.replicas[i].dataDir, e.replicas[i].id, e.raftGroups, upTo)
		hs = append(hs, h)
		if h.Err != "" || h.Drains != hs[0].Drains || h.Completed != hs[0].Completed || h.Proposed != hs[0].Proposed || h.Registered != hs[0].Registered {
			agree = false
		}
	}
	e.writeJSON("drain-history.json", hs)
	e.metric("drain_history", hs)
	e.event("verify", "drain history (Raft logs up to %v): %+v", upTo, hs)
	var errs []string
	for _, h := range hs {
		if h.Err != "" {
			errs = append(errs, h.Replica+": "+h.Err)
		}
	}
	e.res.RequireTrue("drain_history_readable", len(errs) == 0 && upTo[0] > 0, strings.Join(errs, "; "))
	e.res.RequireTrue("drain_history_agrees", agree, "every replica's log: the same drains and completions")
	if len(hs) > 0 {
		h := hs[0]
		e.res.Require("drain_history_drains", float64(h.Drains), "==", float64(ok), "drains in the log = completed rounds")
		e.res.Require("drain_history_completed_once", float64(h.Completed), "==", float64(h.Drains), "completions applied while it was drained: exactly one per drain (duplicates are completions_refused)")
		e.res.Require("drain_history_other_deregistrations", float64(h.OtherGone), "==", 0, "the worker removed by anything but a completion")
		e.res.RequireTrue("drain_history_matches_status", h.Registered && present == len(e.members),
			fmt.Sprintf("the log's rules say registered at the end: %v; replicas listing it undrained: %d", h.Registered, present))
		e.metric("drain_completions_refused", h.Refused)
	}
}
