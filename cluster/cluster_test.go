package cluster_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/cluster/clustertest"
	"github.com/kvrouter/kvrouter/internal/poll"
)

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func voters(t *testing.T, n *cluster.Node) []string {
	t.Helper()
	var ids []string
	for _, p := range n.Status().Peers {
		ids = append(ids, p.ID+"@"+p.RaftAddr+"/"+p.Suffrage)
	}
	slices.Sort(ids)
	return ids
}

// retryErr retries an idempotent admin operation across leadership changes.
func retryErr(t *testing.T, op func(ctx context.Context) error) error {
	_, err := clustertest.Retry(t, func(ctx context.Context) (struct{}, error) { return struct{}{}, op(ctx) })
	return err
}

func followerOf(c *clustertest.Cluster, leader *clustertest.Member) *clustertest.Member {
	for _, m := range c.Running() {
		if m != leader {
			return m
		}
	}
	return nil
}

func TestClusterFormPeers(t *testing.T) {
	c := clustertest.New(t, 3, clustertest.Options{})
	l := c.WaitLeader()
	if got := c.ApplyN("a", 10); got != uint64(10) {
		t.Fatalf("last response %v (%T), want 10", got, got)
	}
	d := c.WaitConverged()
	t.Logf("leader %s digest %s", l.ID, d)

	want := voters(t, l.Node())
	if len(want) != 3 {
		t.Fatalf("configuration %v", want)
	}
	for _, m := range c.Running() {
		n := m.Node()
		if got := voters(t, n); !slices.Equal(got, want) {
			t.Errorf("%s sees %v, leader sees %v", m.ID, got, want)
		}
		// Durability: every log append is fsynced.
		if cluster.BoltNoSync(n) || cluster.BoltOptionsNoSync() {
			t.Errorf("%s: raft-boltdb NoSync is on", m.ID)
		}
		poll.Until(t, 5*time.Second, 10*time.Millisecond, func() error {
			if ok, why := n.Ready(); !ok {
				return fmt.Errorf("%s not ready: %s", m.ID, why)
			}
			return nil
		})
		// State (what /cluster/status?view=cursors reports) agrees with
		// the full status.
		poll.Until(t, 5*time.Second, 10*time.Millisecond, func() error {
			leader, _ := n.Leader()
			if st, full := n.State(), n.StatusWithoutDigest().State; st != full || (st == "leader") != (leader == m.ID) {
				return fmt.Errorf("%s: State %q, status %q, leader %s", m.ID, st, full, leader)
			}
			return nil
		})
	}
}

func TestClusterFormJoin(t *testing.T) {
	c := clustertest.New(t, 3, clustertest.Options{Formation: clustertest.FormJoin})
	l := c.WaitLeader()
	if got := voters(t, l.Node()); len(got) != 3 {
		t.Fatalf("configuration after joins: %v", got)
	}
	c.ApplyN("j", 5)
	c.WaitConverged()
}

func TestClusterJoinIdempotent(t *testing.T) {
	c := clustertest.New(t, 3, clustertest.Options{})
	l := c.WaitLeader()
	f := followerOf(c, l)
	before := voters(t, l.Node())

	// The same id at the same address, twice, directly and via a follower.
	for i := 0; i < 2; i++ {
		if err := retryErr(t, func(ctx context.Context) error { return l.Node().Join(ctx, f.ID, f.RaftAddr) }); err != nil {
			t.Fatalf("join %d: %v", i, err)
		}
	}
	body, _ := json.Marshal(map[string]string{"node_id": f.ID, "raft_addr": f.RaftAddr})
	resp, err := http.Post(f.HTTPURL()+"/cluster/join", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("join via follower: HTTP %d", resp.StatusCode)
	}
	if got := voters(t, l.Node()); !slices.Equal(got, before) {
		t.Fatalf("configuration changed: %v → %v", before, got)
	}

	// A new voter, then the same id at a new address: one entry, new address.
	// (Four voters with three alive keep a quorum.)
	if err := retryErr(t, func(ctx context.Context) error { return f.Node().Join(ctx, "ghost", "127.0.0.1:1") }); err != nil {
		t.Fatalf("join ghost via follower: %v", err)
	}
	if err := retryErr(t, func(ctx context.Context) error { return l.Node().Join(ctx, "ghost", "127.0.0.1:2") }); err != nil {
		t.Fatalf("re-join ghost at a new address: %v", err)
	}
	got := voters(t, l.Node())
	if !slices.Contains(got, "ghost@127.0.0.1:2/voter") || slices.Contains(got, "ghost@127.0.0.1:1/voter") || len(got) != 4 {
		t.Fatalf("after address change: %v", got)
	}
	if err := retryErr(t, func(ctx context.Context) error { return f.Node().Remove(ctx, "ghost") }); err != nil {
		t.Fatalf("remove via follower: %v", err)
	}
	if got := voters(t, l.Node()); !slices.Equal(got, before) {
		t.Fatalf("after remove: %v, want %v", got, before)
	}
	c.ApplyN("after", 3)
	c.WaitConverged()
}

func TestClusterFollowerApplyForwards(t *testing.T) {
	c := clustertest.New(t, 3, clustertest.Options{})
	l := c.WaitLeader()
	f := followerOf(c, l)
	c.ApplyN("warm", 2)

	res, err := c.ApplyVia(f.Node, []byte("via-follower"))
	if err != nil {
		t.Fatalf("follower apply: %v", err)
	}
	if res != uint64(3) {
		t.Fatalf("forwarded response %v (%T), want 3", res, res)
	}

	// A domain error crosses forwarding and still matches its sentinel.
	_, err = c.ApplyVia(f.Node, []byte(clustertest.RejectPrefix+"x"))
	var rej *cluster.RejectedError
	if !errors.Is(err, clustertest.ErrRejected) || !errors.As(err, &rej) {
		t.Fatalf("forwarded rejection: %v", err)
	}
	_, err = c.ApplyVia(func() *cluster.Node { return c.WaitLeader().Node() }, []byte(clustertest.RejectPrefix+"y"))
	if !errors.Is(err, clustertest.ErrRejected) || !errors.As(err, &rej) {
		t.Fatalf("leader rejection: %v", err)
	}

	// A request already forwarded once is not forwarded again.
	req, _ := http.NewRequest(http.MethodPost, f.HTTPURL()+"/cluster/apply", strings.NewReader("loop"))
	req.Header.Set("X-Kvrouter-Forwarded-By", "someone")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("double-forwarded apply: HTTP %d, want 503", resp.StatusCode)
	}

	d := c.WaitConverged()
	if !strings.HasSuffix(d, "/3") {
		t.Fatalf("digest %s, want 3 accepted commands", d)
	}
}

func TestClusterIsolatedLeader(t *testing.T) {
	c := clustertest.New(t, 3, clustertest.Options{})
	l := c.WaitLeader()

	var runs, live atomic.Int32
	for _, m := range c.Running() {
		m.Node().WhileLeader(func(ctx context.Context) {
			runs.Add(1)
			live.Add(1)
			<-ctx.Done()
			live.Add(-1)
		})
	}
	poll.Until(t, 5*time.Second, 10*time.Millisecond, func() error {
		if live.Load() != 1 {
			return fmt.Errorf("%d WhileLeader runs live, want 1", live.Load())
		}
		return nil
	})
	c.ApplyN("pre", 5)
	c.WaitConverged()

	c.Isolate(l.Index)
	start := time.Now()
	// The claim is that the write fails on its own (the leader steps down
	// when its lease runs out) rather than hanging until the caller gives
	// up: its context (a hang guard, 60× the lease) must still be live when
	// the error comes. How fast is a benchmark's business.
	ctx := ctxT(t, 30*time.Second)
	_, err := l.Node().Apply(ctx, []byte("lost-write"))
	took := time.Since(start)
	if err == nil {
		t.Fatal("write on an isolated leader succeeded")
	}
	if !errors.Is(err, cluster.ErrOutcomeUnknown) && !errors.Is(err, cluster.ErrNoLeader) {
		t.Errorf("isolated write error %v, want ErrOutcomeUnknown or ErrNoLeader", err)
	}
	if ctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("isolated write failed only when its context ran out (%v): %v", took, err)
	}
	t.Logf("isolated write failed after %v: %v", took, err)

	var others []int
	for _, m := range c.Running() {
		if m != l {
			others = append(others, m.Index)
		}
	}
	nl := c.WaitLeader(others...)
	if nl == l {
		t.Fatal("isolated node still leads")
	}
	if _, err := c.ApplyVia(func() *cluster.Node { return c.WaitLeader(others...).Node() }, []byte("majority-write")); err != nil {
		t.Fatalf("majority write: %v", err)
	}
	poll.Until(t, 5*time.Second, 10*time.Millisecond, func() error {
		if ok, why := l.Node().Ready(); ok {
			return fmt.Errorf("isolated old leader still ready (%s)", why)
		}
		return nil
	})

	c.Heal()
	d := c.WaitConverged()
	if !strings.HasSuffix(d, "/6") {
		t.Fatalf("digest %s: want exactly the 5 pre-partition writes and the majority write", d)
	}
	if live.Load() != 1 || runs.Load() < 2 {
		t.Fatalf("WhileLeader: %d live, %d runs; want 1 live and a run per leadership", live.Load(), runs.Load())
	}
}

func TestClusterRestartFromDisk(t *testing.T) {
	c := clustertest.New(t, 3, clustertest.Options{})
	l := c.WaitLeader()
	c.ApplyN("r", 150) // > SnapshotThreshold: restarts restore a snapshot and replay the tail
	d := c.WaitConverged()

	f := followerOf(c, l)
	c.Restart(f.Index)
	if got := c.WaitConverged(); got != d {
		t.Fatalf("after follower restart digest %s, want %s", got, d)
	}

	for _, m := range c.Members() {
		c.Stop(m.Index)
	}
	for _, m := range c.Members() {
		c.Start(m.Index)
	}
	c.WaitLeader()
	if got := c.WaitConverged(); got != d {
		t.Fatalf("after full restart digest %s, want %s", got, d)
	}
	for _, m := range c.Members() {
		if m.FSM().(*clustertest.FSM).Count() != 150 {
			t.Fatalf("%s count %d after restart", m.ID, m.FSM().(*clustertest.FSM).Count())
		}
	}
	c.ApplyN("r2", 3)
	c.WaitConverged()
}

func TestClusterSnapshotInstall(t *testing.T) {
	c := clustertest.New(t, 3, clustertest.Options{})
	l := c.WaitLeader()
	c.ApplyN("s", 200)
	c.WaitConverged()
	if err := l.Node().Snapshot(); err != nil && !strings.Contains(err.Error(), "nothing new") {
		t.Fatalf("snapshot: %v", err)
	}
	if st := l.Node().Status(); st.LastSnapshotIndex == 0 {
		t.Fatalf("leader has no snapshot: %+v", st)
	}

	f := followerOf(c, l)
	c.Wipe(f.Index)
	m4 := c.AddNode()
	for _, m := range []*clustertest.Member{f, m4} {
		poll.Until(t, 20*time.Second, 20*time.Millisecond, func() error {
			if n := m.Node().SnapshotsRestored(); n == 0 {
				return fmt.Errorf("%s: no snapshot installed", m.ID)
			}
			return nil
		})
	}
	c.ApplyN("s2", 5)
	d := c.WaitConverged()
	if !strings.HasSuffix(d, "/205") {
		t.Fatalf("digest %s", d)
	}
	if got := voters(t, c.WaitLeader().Node()); len(got) != 4 {
		t.Fatalf("configuration %v, want 4 voters", got)
	}
	if v := counterValue(t, m4.Registry(), "kvrouter_raft_snapshots_total", "restored"); v < 1 {
		t.Fatalf("snapshots_total{op=restored} = %v on the new node", v)
	}
}

func TestClusterReady(t *testing.T) {
	var slowIdx atomic.Int32
	slowIdx.Store(-1)
	c := clustertest.New(t, 3, clustertest.Options{
		NewFSM: func(i int) cluster.StateMachine {
			f := clustertest.NewFSM()
			if int32(i) == slowIdx.Load() {
				f.SetApplyDelay(5 * time.Millisecond)
			}
			return f
		},
		// Keep the whole history in the log: catch-up replays entries.
		SnapshotThreshold: 100000,
		TrailingLogs:      100000,
	})
	l := c.WaitLeader()
	f := followerOf(c, l)
	c.Stop(f.Index)
	c.ApplyN("ready", 200)
	want := l.FSM().AppliedIndex()

	slowIdx.Store(int32(f.Index))
	c.Start(f.Index)
	n := f.Node()
	var sawCatchingUp bool
	var reasons []string
	poll.Until(t, 30*time.Second, 2*time.Millisecond, func() error {
		ok, why := n.Ready()
		if ok {
			return nil
		}
		if strings.HasPrefix(why, "catching up") {
			sawCatchingUp = true
		}
		if len(reasons) < 20 && (len(reasons) == 0 || reasons[len(reasons)-1] != why) {
			reasons = append(reasons, why)
		}
		return errors.New(why)
	})
	if got := n.StateMachine().AppliedIndex(); got < want {
		t.Fatalf("ready with FSM applied %d < leader's %d before the restart", got, want)
	}
	if !sawCatchingUp {
		t.Errorf("never reported catching up; reasons seen: %q", reasons)
	}
	t.Logf("readiness reasons: %q", reasons)

	// A follower cut off from everyone loses its leader and readiness.
	c.Isolate(f.Index)
	poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error {
		if ok, why := n.Ready(); ok || why != "no leader" {
			return fmt.Errorf("isolated follower: ready=%v %q", ok, why)
		}
		return nil
	})
	c.Heal()
	poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error {
		if ok, why := n.Ready(); !ok {
			return errors.New(why)
		}
		return nil
	})
}

func TestClusterShutdownTransfersLeadership(t *testing.T) {
	// The leader's own account of the hand-over: Shutdown logs "leadership
	// transferred" only when Raft's LeadershipTransfer succeeded (a new
	// leader elected on its TimeoutNow), so no timing is needed to tell a
	// transfer from an election after a heartbeat timeout.
	var transferred, transferFailed atomic.Int32
	c := clustertest.New(t, 3, clustertest.Options{
		Configure: func(_ int, cfg *cluster.Config, _ cluster.StateMachine) {
			cfg.Logger = slog.New(msgCounter{next: cfg.Logger.Handler(), count: map[string]*atomic.Int32{
				"leadership transferred":     &transferred,
				"leadership transfer failed": &transferFailed,
			}})
		},
	})
	l := c.WaitLeader()
	c.ApplyN("t", 3)

	var mu sync.Mutex
	var events []bool
	l.Node().OnLeadership(func(isLeader bool) {
		mu.Lock()
		events = append(events, isLeader)
		mu.Unlock()
	})

	start := time.Now()
	c.Stop(l.Index)
	var others []int
	for _, m := range c.Running() {
		others = append(others, m.Index)
	}
	nl := c.WaitLeader(others...)
	t.Logf("new leader %s %v after shutdown began", nl.ID, time.Since(start))
	if transferred.Load() != 1 || transferFailed.Load() != 0 {
		t.Errorf("shutdown logged %d transfers and %d failed ones, want one transfer", transferred.Load(), transferFailed.Load())
	}
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(events, []bool{true, false}) {
		t.Errorf("OnLeadership events %v, want [true false]", events)
	}
	if _, err := c.ApplyVia(func() *cluster.Node { return c.WaitLeader(others...).Node() }, []byte("after")); err != nil {
		t.Fatal(err)
	}
}

// TestClusterSingleNodeTCP runs the production transport path (no Dial
// hook): bootstrap alone, apply, metrics, reopen from disk.
func TestClusterSingleNodeTCP(t *testing.T) {
	dir := t.TempDir()
	addr := func() string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		return ln.Addr().String()
	}()
	open := func(reg *prometheus.Registry) (*cluster.Node, *clustertest.FSM) {
		fsm := clustertest.NewFSM()
		n, err := cluster.New(cluster.Config{
			NodeID:   "solo",
			RaftAddr: addr,
			DataDir:  dir,
			Registry: reg,
			Logger:   clustertest.NewTestLogger(t),
		}, fsm)
		if err != nil {
			t.Fatal(err)
		}
		if err := n.Form(ctxT(t, 10*time.Second)); err != nil {
			t.Fatal(err)
		}
		return n, fsm
	}
	reg := prometheus.NewRegistry()
	n, fsm := open(reg)
	poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error {
		if ok, why := n.Ready(); !ok {
			return errors.New(why)
		}
		return nil
	})
	for i := 0; i < 5; i++ {
		if _, err := n.Apply(ctxT(t, 5*time.Second), []byte(fmt.Sprint("solo-", i))); err != nil {
			t.Fatal(err)
		}
	}
	f := n.ApplyLocal([]byte("local"), time.Second)
	if err := f.Error(); err != nil || f.Response() != uint64(6) {
		t.Fatalf("ApplyLocal: %v %v", err, f.Response())
	}
	if cluster.BoltNoSync(n) {
		t.Fatal("NoSync on")
	}
	if v := gaugeValue(t, reg, "kvrouter_raft_state"); v != 2 {
		t.Errorf("kvrouter_raft_state %v, want 2 (leader)", v)
	}
	if v := gaugeValue(t, reg, "kvrouter_raft_applied_index"); v != float64(fsm.AppliedIndex()) {
		t.Errorf("applied index gauge %v, fsm %d", v, fsm.AppliedIndex())
	}
	for _, name := range []string{"kvrouter_raft_term", "kvrouter_raft_commit_index", "kvrouter_raft_apply_seconds", "kvrouter_raft_leader_changes_total", "kvrouter_raft_snapshots_total"} {
		if !hasMetric(t, reg, name) {
			t.Errorf("metric %s missing", name)
		}
	}
	st := n.Status()
	if st.State != "leader" || st.LeaderID != "solo" || len(st.Peers) != 1 {
		t.Errorf("status %+v", st)
	}
	digest := fsm.Digest()
	if err := n.Shutdown(ctxT(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	if hasMetric(t, reg, "kvrouter_raft_state") {
		t.Error("metrics still registered after Shutdown")
	}

	n2, fsm2 := open(reg) // same registry: works because Shutdown unregistered
	defer n2.Shutdown(context.Background())
	poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error {
		if fsm2.Digest() != digest {
			return fmt.Errorf("digest %s after reopen, want %s", fsm2.Digest(), digest)
		}
		return nil
	})
}

func gather(t *testing.T, reg *prometheus.Registry) map[string]*dto.MetricFamily {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*dto.MetricFamily{}
	for _, mf := range mfs {
		out[mf.GetName()] = mf
	}
	return out
}

func hasMetric(t *testing.T, reg *prometheus.Registry, name string) bool {
	_, ok := gather(t, reg)[name]
	return ok
}

func gaugeValue(t *testing.T, reg *prometheus.Registry, name string) float64 {
	mf, ok := gather(t, reg)[name]
	if !ok {
		t.Fatalf("metric %s missing", name)
	}
	return mf.GetMetric()[0].GetGauge().GetValue()
}

func counterValue(t *testing.T, reg *prometheus.Registry, name, op string) float64 {
	mf, ok := gather(t, reg)[name]
	if !ok {
		t.Fatalf("metric %s missing", name)
	}
	for _, m := range mf.GetMetric() {
		for _, lp := range m.GetLabel() {
			if lp.GetName() == "op" && lp.GetValue() == op {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

func TestClusterAuthToken(t *testing.T) {
	const token = "s3cret"
	c := clustertest.New(t, 3, clustertest.Options{
		Formation: clustertest.FormJoin, // joins must carry the token
		Configure: func(_ int, cfg *cluster.Config, _ cluster.StateMachine) { cfg.AuthToken = token },
	})
	l := c.WaitLeader()
	f := followerOf(c, l)
	if _, err := c.ApplyVia(f.Node, []byte("authed")); err != nil {
		t.Fatalf("forwarded apply with token: %v", err)
	}

	get := func(auth string) (*http.Response, map[string]any) {
		req, _ := http.NewRequest(http.MethodGet, f.HTTPURL()+"/cluster/status", nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var body map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&body)
		return resp, body
	}
	if resp, _ := get(""); resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("status without token: HTTP %d", resp.StatusCode)
	}
	if resp, _ := get("Bearer wrong"); resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("status with a wrong token: HTTP %d", resp.StatusCode)
	}
	resp, st := get("Bearer " + token)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status with token: HTTP %d", resp.StatusCode)
	}
	for _, k := range []string{"node_id", "state", "leader_id", "term", "applied_index", "commit_index", "peers", "digest", "pid", "ready"} {
		if _, ok := st[k]; !ok {
			t.Errorf("/cluster/status lacks %q: %v", k, st)
		}
	}
	if st["state"] != "follower" || st["leader_id"] != l.ID {
		t.Errorf("status %v", st)
	}
}

func TestClusterPartitionMinorityFollower(t *testing.T) {
	c := clustertest.New(t, 3, clustertest.Options{})
	l := c.WaitLeader()
	c.ApplyN("p", 3)
	var minority *clustertest.Member
	var majority []int
	for _, m := range c.Running() {
		if m != l && minority == nil {
			minority = m
			continue
		}
		majority = append(majority, m.Index)
	}
	c.Partition(majority, []int{minority.Index})

	// The cut-off follower cannot reach the leader: its writes fail as
	// "not applied", not "unknown".
	_, err := minority.Node().Apply(ctxT(t, 5*time.Second), []byte("minority"))
	if !errors.Is(err, cluster.ErrNoLeader) {
		t.Fatalf("minority write: %v, want ErrNoLeader", err)
	}
	// The majority keeps its leader and commits.
	if _, err := c.ApplyVia(func() *cluster.Node { return c.WaitLeader(majority...).Node() }, []byte("majority")); err != nil {
		t.Fatalf("majority write: %v", err)
	}
	c.Heal()
	if d := c.WaitConverged(); !strings.HasSuffix(d, "/4") {
		t.Fatalf("digest %s, want 4 commands", d)
	}
}

// msgCounter counts the records whose message is a key of count, and
// passes every record on to next.
type msgCounter struct {
	next  slog.Handler
	count map[string]*atomic.Int32
}

func (h msgCounter) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= slog.LevelInfo || h.next.Enabled(ctx, l)
}
func (h msgCounter) WithAttrs(as []slog.Attr) slog.Handler {
	return msgCounter{next: h.next.WithAttrs(as), count: h.count}
}
func (h msgCounter) WithGroup(g string) slog.Handler {
	return msgCounter{next: h.next.WithGroup(g), count: h.count}
}

func (h msgCounter) Handle(ctx context.Context, r slog.Record) error {
	if n := h.count[r.Message]; n != nil {
		n.Add(1)
	}
	if !h.next.Enabled(ctx, r.Level) {
		return nil
	}
	return h.next.Handle(ctx, r)
}
