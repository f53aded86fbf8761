package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/internal/poll"
)

// freePorts reserves n distinct loopback ports (listen on :0, then close).
func freePorts(t *testing.T, n int) []int {
	t.Helper()
	var ls []net.Listener
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	for _, l := range ls {
		l.Close()
	}
	return ports
}

// testGroupPortStep and testMaxGroups: newTestCluster's Raft ports leave
// room for data groups (--raft-group-port-step testGroupPortStep, up to
// testMaxGroups groups) on ports it checked free, so sharded tests do not
// collide with the cluster's other random ports.
const testGroupPortStep, testMaxGroups = 7, 4

// freeRaftPorts reserves n Raft ports p whose p + g·testGroupPortStep
// (g ≤ testMaxGroups) are free too and none of avoid, holding every
// listener until all are chosen. They come from below the kernel's
// ephemeral range: a group port a test starts only later (a replica
// restarted with more groups) must not be taken meanwhile by the local
// end of some outgoing connection.
func freeRaftPorts(t *testing.T, n int, avoid []int) []int {
	t.Helper()
	var held []net.Listener
	defer func() {
		for _, l := range held {
			l.Close()
		}
	}()
	taken := map[int]bool{}
	for _, p := range avoid {
		taken[p] = true
	}
	low := 32768 // Linux's default start of the ephemeral range
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		fmt.Sscan(string(b), &low)
	}
	span := low - 10000 - testMaxGroups*testGroupPortStep
	if span < 1000 {
		t.Skipf("no room below the ephemeral port range (starts at %d) for Raft group ports", low)
	}
	var out []int
	for tries := 0; len(out) < n; tries++ {
		if tries > 1000 {
			t.Fatal("no free Raft ports with room for groups below the ephemeral range")
		}
		p := 10000 + rand.IntN(span)
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err != nil {
			continue
		}
		held = append(held, l)
		ok := !taken[p]
		for g := 1; ok && g <= testMaxGroups; g++ {
			q := p + g*testGroupPortStep
			if taken[q] {
				ok = false
				break
			}
			lq, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", q))
			if err != nil {
				ok = false
				break
			}
			held = append(held, lq)
		}
		if !ok {
			continue
		}
		for g := 0; g <= testMaxGroups; g++ {
			taken[p+g*testGroupPortStep] = true
		}
		out = append(out, p)
	}
	return out
}

// testReplica is one in-process replica that can be stopped and restarted
// on the same data dir.
type testReplica struct {
	t      *testing.T
	cfg    serveConfig
	cancel context.CancelFunc
	done   chan struct{}
}

func (r *testReplica) start() {
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel, r.done = cancel, make(chan struct{})
	log := slog.New(slog.NewTextHandler(testWriter{r.t, r.cfg.NodeID}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	go func() {
		defer close(r.done)
		if err := serve(ctx, r.cfg, log); err != nil {
			r.t.Logf("%s: serve: %v", r.cfg.NodeID, err)
		}
	}()
}

func (r *testReplica) stop() {
	r.cancel()
	<-r.done
}

func (r *testReplica) url() string { return "http://" + r.cfg.HTTPAddr }

type testWriter struct {
	t    *testing.T
	name string
}

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s: %s", w.name, strings.TrimSpace(string(p)))
	return len(p), nil
}

// newTestCluster starts three replicas; opts adjust each one's
// configuration before it starts.
func newTestCluster(t *testing.T, opts ...func(*serveConfig)) []*testReplica {
	t.Helper()
	ports := freePorts(t, 12)
	raftPorts := freeRaftPorts(t, 3, ports)
	dir := t.TempDir()
	var peers []cluster.Peer
	for i := range 3 {
		peers = append(peers, cluster.Peer{ID: fmt.Sprintf("r%d", i+1), RaftAddr: fmt.Sprintf("127.0.0.1:%d", raftPorts[i])})
	}
	var reps []*testReplica
	for i := range 3 {
		var routes []string
		for j := range 3 {
			if j != i {
				routes = append(routes, fmt.Sprintf("nats://127.0.0.1:%d", ports[4*j+3]))
			}
		}
		cfg, err := parseServe([]string{"--node-id", peers[i].ID, "--single-node=false"}, func(string) string { return "" }, io.Discard)
		if err == nil || !strings.Contains(err.Error(), "form the cluster") {
			t.Fatalf("want a formation error without peers, got %v", err)
		}
		cfg.Peers = peers
		cfg.DataDir = filepath.Join(dir, peers[i].ID)
		cfg.HTTPAddr = fmt.Sprintf("127.0.0.1:%d", ports[4*i])
		cfg.AdvertiseHTTP = "http://" + cfg.HTTPAddr
		cfg.RaftAddr = peers[i].RaftAddr
		cfg.NATSAddr = fmt.Sprintf("127.0.0.1:%d", ports[4*i+2])
		cfg.NATSClusterAddr = fmt.Sprintf("127.0.0.1:%d", ports[4*i+3])
		cfg.NATSRoutes = routes
		cfg.RaftGroupPortStep = testGroupPortStep
		for _, o := range opts {
			o(&cfg)
		}
		if err := cfg.finish(); err != nil {
			t.Fatal(err)
		}
		r := &testReplica{t: t, cfg: cfg}
		r.start()
		reps = append(reps, r)
	}
	t.Cleanup(func() {
		var wg sync.WaitGroup
		for _, r := range reps {
			wg.Add(1)
			go func() { defer wg.Done(); r.cancel(); <-r.done }()
		}
		wg.Wait()
	})
	return reps
}

type statusDoc struct {
	State    string `json:"state"`
	LeaderID string `json:"leader_id"`
	Digest   string `json:"digest"`
	NATS     string `json:"nats_url"`
	Groups   []struct {
		Group    int    `json:"group"`
		LeaderID string `json:"leader_id"`
		Digest   string `json:"digest"`
		Workers  int    `json:"workers"`
	} `json:"raft_groups"`
	Workers []struct {
		ID    string `json:"id"`
		Group int    `json:"raft_group"`
		Ranks []struct {
			Blocks      int    `json:"blocks"`
			LastEventID uint64 `json:"last_event_id"`
			Stale       string `json:"stale"`
		} `json:"ranks"`
	} `json:"workers"`
}

func status(base string) (statusDoc, error) {
	var s statusDoc
	resp, err := http.Get(base + "/cluster/status")
	if err != nil {
		return s, err
	}
	defer resp.Body.Close()
	return s, json.NewDecoder(resp.Body).Decode(&s)
}

func leaderOf(reps []*testReplica) (*testReplica, error) {
	for _, r := range reps {
		if s, err := status(r.url()); err == nil && s.State == "leader" {
			return r, nil
		}
	}
	return nil, fmt.Errorf("no leader")
}

// TestServeIngestSurvivesLeaderLoss is the event bus end to end, in process:
// three replicas (embedded NATS cluster + Raft), two workers publishing
// chained block events; the leader is stopped mid-stream and restarted.
// Every acknowledged event must be applied exactly once on every replica
// (block counts equal event counts) and the digests must agree.
func TestServeIngestSurvivesLeaderLoss(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas")
	}
	t.Parallel() // its own replicas, ports and workers; it mostly waits (elections, workers)
	ingestSurvivesLeaderLoss(t, 1)
}

// TestServeShardedIngestSurvivesLeaderLoss is the same with the index
// sharded across two data groups (issue 19): the two workers are placed
// one per group, the replica leading data group 1 is stopped mid-stream,
// and every group's digest must agree on every replica.
func TestServeShardedIngestSurvivesLeaderLoss(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas, three Raft groups each")
	}
	t.Parallel() // its own replicas, ports and workers; it mostly waits (elections, workers)
	ingestSurvivesLeaderLoss(t, 2)
}

func ingestSurvivesLeaderLoss(t *testing.T, groups int) {
	reps := newTestCluster(t, func(c *serveConfig) {
		c.RaftGroups = groups
	})
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(reps); return err })

	workers := []string{"w-a", "w-b"}
	registerTestWorkers(t, reps[1].url(), workers)

	// Linearizable admin: a threshold written through one replica is read
	// back at once from every other one (read index, not local state).
	for i, v := range []string{"0.61", "0.62", "0.63"} {
		body := `{"model":"kvmock","active_decode_blocks_threshold":` + v + `}`
		poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error { // the first may wait for node registration
			resp, err := http.Post(reps[i].url()+"/busy_threshold", "application/json", bytes.NewBufferString(body))
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			if resp.StatusCode != 200 {
				b, _ := io.ReadAll(resp.Body)
				return fmt.Errorf("set threshold via %s: %d %s", reps[i].cfg.NodeID, resp.StatusCode, b)
			}
			return nil
		})
		for _, r := range reps {
			resp, err := http.Get(r.url() + "/busy_threshold")
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if !strings.Contains(string(b), `"active_decode_blocks_threshold":`+v) {
				t.Fatalf("%s read %s right after %s was written via %s", r.cfg.NodeID, b, v, reps[i].cfg.NodeID)
			}
		}
	}

	// Each event stores one block under the previous one. A publish lost
	// with a stream server can be re-sent behind later events; the state
	// machine then sees a gap, marks the worker stale and asks it to
	// republish, which the ledger does, as kvmock would.
	l := newLedger(t, reps, workers)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	const first, total = 400, 800
	for _, w := range workers {
		l.publish(ctx, w, first)
	}
	old, err := leaderOf(reps)
	if err != nil {
		t.Fatal(err)
	}
	if groups > 1 {
		// Move w-a into w-b's group online, with its events in flight:
		// its old stream drains into the old group, its blocks are
		// handed over, and its later events flow into the new group.
		s, err := status(reps[0].url())
		if err != nil {
			t.Fatal(err)
		}
		to := 0
		for _, w := range s.Workers {
			if w.ID == "w-b" {
				to = w.Group
			}
		}
		moveWorker(t, reps[2].url(), "w-a", to)
		for _, w := range workers {
			l.publish(ctx, w, 100)
		}
		moveWorker(t, reps[1].url(), "w-a", 3-to) // and back, through another replica
		moveWorker(t, reps[0].url(), "w-a", to)
		if s, err = status(reps[0].url()); err != nil {
			t.Fatal(err)
		}
		if len(s.Groups) != groups {
			t.Fatalf("status lists %d raft groups, want %d", len(s.Groups), groups)
		}
		if s.Groups[0].Workers+s.Groups[1].Workers != 2 || s.Groups[0].Workers%2 != 0 {
			t.Fatalf("after the moves both workers should share one group: %+v", s.Groups)
		}
		for _, r := range reps {
			if r.cfg.NodeID == s.Groups[0].LeaderID {
				old = r
			}
		}
	}
	t.Logf("stopping leader %s mid-stream", old.cfg.NodeID)
	old.stop()
	for _, w := range workers {
		l.publish(ctx, w, total-l.sentOf(w))
	}
	l.flush(ctx)
	old.start()
	l.agree(reps, 60*time.Second)
	for _, w := range workers {
		if a := l.acked(w); a < total/2 {
			t.Errorf("%s: only %d of %d events acknowledged", w, a, total)
		}
	}
	if s, err := status(reps[0].url()); err != nil || len(s.Groups) != map[bool]int{true: groups}[groups > 1] {
		t.Fatalf("status lists %d raft groups (%v), want %d", len(s.Groups), err, groups)
	}
}

// registerTestWorkers registers workers through base (retrying while the
// cluster forms).
func registerTestWorkers(t *testing.T, base string, workers []string) {
	t.Helper()
	for _, w := range workers {
		body := fmt.Sprintf(`{"id":%q,"url":"http://127.0.0.1:1","model":"kvmock","block_size":16,"total_kv_blocks":100000}`, w)
		poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
			resp, err := http.Post(base+"/workers/register", "application/json", bytes.NewBufferString(body))
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			if resp.StatusCode != 200 {
				b, _ := io.ReadAll(resp.Body)
				return fmt.Errorf("register %s: %d %s", w, resp.StatusCode, b)
			}
			return nil
		})
	}
}

// moveWorker asks base to move worker into data group to and waits for it.
func moveWorker(t *testing.T, base, worker string, to int) {
	t.Helper()
	body := fmt.Sprintf(`{"id":%q,"group":%d}`, worker, to)
	resp, err := http.Post(base+"/workers/move", "application/json", bytes.NewBufferString(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("move %s to group %d: %d %s", worker, to, resp.StatusCode, b)
	}
	t.Logf("move: %s", b)
}
