// Package clustertest is an in-process harness for cluster.Node: real
// raft-boltdb stores in t.TempDir(), real TCP transports on 127.0.0.1, a
// controllable network (Partition, Isolate, Heal), Restart, Wipe, AddNode,
// and polling helpers (never sleep to synchronise). Options.TLS runs every
// member with a node certificate of a test CA: mutual TLS on Raft and
// HTTPS with client certificates on the cluster endpoints. Options.Groups
// runs several Raft groups per member, as a sharded replica does: one
// cluster.Node per group, all behind the member's one HTTP server and one
// Prometheus registry.
package clustertest

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/internal/pki"
	"github.com/kvrouter/kvrouter/internal/poll"
)

// Formation selects how New forms the initial members.
type Formation int

const (
	// FormPeers: every initial member bootstraps the same full peer set.
	FormPeers Formation = iota
	// FormJoin: member 0 bootstraps alone; the others join it over HTTP.
	FormJoin
)

// Options tune a harness cluster. Zero values take the defaults below.
type Options struct {
	Formation Formation
	// Raft timing; defaults are production's 1s / 1s / 500ms / 5ms: on a
	// loaded 2-core host under -race shorter leases make leaders step down
	// spuriously (the harness retries idempotent writes when it happens).
	HeartbeatTimeout   time.Duration
	ElectionTimeout    time.Duration
	LeaderLeaseTimeout time.Duration
	CommitTimeout      time.Duration
	// Snapshots; defaults 64 entries, checked every 200ms, keeping 16 trailing
	// entries, so snapshot install is exercised by any test writing a few
	// hundred entries.
	SnapshotThreshold uint64
	SnapshotInterval  time.Duration
	TrailingLogs      uint64
	// NewFSM builds member i's state machine on every start (once per
	// group). Default: NewFSM().
	NewFSM func(i int) cluster.StateMachine
	// Configure may adjust member i's config just before cluster.New; sm is
	// the state machine NewFSM built for this start. With Groups > 1 it is
	// called once per group (c.PathPrefix and c.Group tell which).
	Configure func(i int, c *cluster.Config, sm cluster.StateMachine)
	// OnNode is called with each new node after cluster.New and before Form
	// (register OnLeadership / WhileLeader hooks here: they survive restarts).
	// With Groups > 1: once per group, n.Group() tells which.
	OnNode func(i int, n *cluster.Node)
	// Groups is how many Raft groups every member runs (default 1). Group g
	// has its own node, Raft port and data dir (GroupRaftAddr, GroupDataDir;
	// group 0's are RaftAddr and DataDir), PathPrefix GroupPrefix(g) on the
	// member's one HTTP server, and, with Groups > 1, Config.Group
	// strconv.Itoa(g) on the member's one registry: a registry takes a
	// metric name either with the group label or without it, never both
	// (cluster DESIGN.md "Several groups in one process"). Member.Node,
	// WaitLeader, WaitConverged, ApplyN, … are group 0's.
	Groups int
	// LogLevel for per-node logs into t.Log; default Info. Quiet drops them.
	LogLevel slog.Level
	Quiet    bool
	// FormTimeout bounds Form on each start; default 30s.
	FormTimeout time.Duration
	// TLS gives every member a node certificate (pki.Node(ID), host
	// 127.0.0.1) of a CA the harness creates (Cluster.CA): Raft runs over
	// mutual TLS, HTTP over HTTPS (cluster.HTTPServerTLS) and HTTPURL is
	// https://.
	TLS bool
}

func (o *Options) defaults() {
	def := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	def(&o.HeartbeatTimeout, time.Second)
	def(&o.ElectionTimeout, time.Second)
	def(&o.LeaderLeaseTimeout, 500*time.Millisecond)
	def(&o.CommitTimeout, 5*time.Millisecond)
	def(&o.SnapshotInterval, 200*time.Millisecond)
	def(&o.FormTimeout, 30*time.Second)
	if o.SnapshotThreshold == 0 {
		o.SnapshotThreshold = 64
	}
	if o.TrailingLogs == 0 {
		o.TrailingLogs = 16
	}
	if o.Groups < 1 {
		o.Groups = 1
	}
	if o.NewFSM == nil {
		o.NewFSM = func(int) cluster.StateMachine { return NewFSM() }
	}
}

// Member is one slot of the cluster (one replica process); it keeps its
// id, Raft addresses and data dirs across restarts.
type Member struct {
	Index    int
	ID       string
	RaftAddr string // group 0's
	DataDir  string // group 0's; group g > 0 lives in DataDir/g<g>

	raftAddrs []string // per group; [0] is RaftAddr. Written before the member is shared.

	c       *Cluster
	mu      sync.Mutex      // guards the fields below
	nodes   []*cluster.Node // per group; nil while stopped
	fsms    []cluster.StateMachine
	reg     *prometheus.Registry
	httpURL string
	srv     *http.Server
	bundle  *pki.Bundle // TLS mode: this member's certificate, kept across restarts
}

// Bundle is the member's TLS material (nil without Options.TLS).
func (m *Member) Bundle() *pki.Bundle { return m.bundle }

// Node is the running node of group 0, nil while stopped.
func (m *Member) Node() *cluster.Node { return m.GroupNode(0) }

// GroupNode is the running node of group g, nil while stopped.
func (m *Member) GroupNode(g int) *cluster.Node {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.nodes == nil {
		return nil
	}
	return m.nodes[g]
}

// FSM is group 0's state machine (the last one when stopped).
func (m *Member) FSM() cluster.StateMachine { return m.GroupFSM(0) }

// GroupFSM is group g's state machine (the last one when stopped; nil
// before the first start).
func (m *Member) GroupFSM(g int) cluster.StateMachine {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.fsms == nil {
		return nil
	}
	return m.fsms[g]
}

// GroupRaftAddr is group g's Raft address.
func (m *Member) GroupRaftAddr(g int) string { return m.raftAddrs[g] }

// GroupDataDir is group g's data dir.
func (m *Member) GroupDataDir(g int) string {
	if g == 0 {
		return m.DataDir
	}
	return filepath.Join(m.DataDir, "g"+strconv.Itoa(g))
}

// GroupPrefix is group g's cluster.Config.PathPrefix in the harness:
// "/cluster" for group 0, "/cluster/g<g>" for the others (the layout of a
// sharded replica).
func GroupPrefix(g int) string {
	if g == 0 {
		return cluster.DefaultPathPrefix
	}
	return cluster.DefaultPathPrefix + "/g" + strconv.Itoa(g)
}

// Registry is the running member's Prometheus registry (every group's).
func (m *Member) Registry() *prometheus.Registry {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.reg
}

// HTTPURL is the base URL of the member's cluster HTTP handler ("" when stopped).
func (m *Member) HTTPURL() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.httpURL
}

// Running reports whether the member has a live node.
func (m *Member) Running() bool { return m.Node() != nil }

// Cluster is a set of in-process members.
type Cluster struct {
	T    testing.TB
	Net  *Network
	opts Options
	base string
	logs *testLogSink
	ca   *pki.CA // TLS mode only

	// mu guards members (AddNode appends while other goroutines read
	// them).
	mu      sync.Mutex
	members []*Member
}

// Groups is Options.Groups: the Raft groups every member runs.
func (c *Cluster) Groups() int { return c.opts.Groups }

// New starts n members and waits until they have formed (not for a leader).
func New(t testing.TB, n int, opts Options) *Cluster {
	t.Helper()
	opts.defaults()
	c := &Cluster{T: t, Net: NewNetwork(), opts: opts, base: t.TempDir(), logs: &testLogSink{t: t}}
	if opts.TLS {
		ca, err := pki.NewCA(pki.CAOptions{Name: "clustertest CA"})
		if err != nil {
			t.Fatalf("test CA: %v", err)
		}
		c.ca = ca
	}
	// Cleanups run last-in first-out: stop the log sink after the nodes.
	t.Cleanup(c.logs.close)
	t.Cleanup(c.shutdownAll)

	for i := 0; i < n; i++ {
		c.members = append(c.members, c.newMember())
	}
	if opts.Formation == FormPeers {
		peers := make([][]cluster.Peer, opts.Groups)
		for g := range peers {
			for _, m := range c.members {
				peers[g] = append(peers[g], cluster.Peer{ID: m.ID, RaftAddr: m.GroupRaftAddr(g)})
			}
		}
		for _, m := range c.members {
			c.startOrFail(m, startOpts{peers: peers})
		}
		return c
	}
	m0 := c.members[0]
	alone := make([][]cluster.Peer, opts.Groups)
	for g := range alone {
		alone[g] = []cluster.Peer{{ID: m0.ID, RaftAddr: m0.GroupRaftAddr(g)}}
	}
	c.startOrFail(m0, startOpts{peers: alone})
	for _, m := range c.members[1:] {
		c.startOrFail(m, startOpts{join: []string{m0.HTTPURL()}})
	}
	return c
}

func (c *Cluster) newMember() *Member {
	c.mu.Lock()
	defer c.mu.Unlock()
	i := len(c.members)
	m := &Member{
		Index:   i,
		ID:      fmt.Sprintf("n%d", i),
		DataDir: filepath.Join(c.base, fmt.Sprintf("n%d", i)),
		c:       c,
	}
	for range c.opts.Groups {
		addr := c.freeRaftAddr(m.raftAddrs)
		m.raftAddrs = append(m.raftAddrs, addr)
		c.Net.Register(addr, i)
	}
	m.RaftAddr = m.raftAddrs[0]
	if c.ca != nil {
		m.bundle = c.Issue(pki.Node(m.ID))
	}
	return m
}

// CA is the harness's test CA (nil without Options.TLS): tests mint
// certificates from it for strangers, workers and non-members.
func (c *Cluster) CA() *pki.CA { return c.ca }

// Issue returns a bundle for id from the harness CA (host 127.0.0.1).
func (c *Cluster) Issue(id pki.Identity) *pki.Bundle {
	c.T.Helper()
	return IssueBundle(c.T, c.ca, id)
}

// IssueBundle issues a certificate for id (host 127.0.0.1) from ca and
// returns it as a bundle trusting ca.
func IssueBundle(t testing.TB, ca *pki.CA, id pki.Identity) *pki.Bundle {
	t.Helper()
	if ca == nil {
		t.Fatal("clustertest: no CA (Options.TLS is off)")
	}
	kp, err := ca.Issue(pki.Request{Identity: id, Hosts: []string{"127.0.0.1"}})
	if err != nil {
		t.Fatalf("issue %s: %v", id, err)
	}
	b, err := pki.NewBundle(ca.CertPEM(), kp)
	if err != nil {
		t.Fatalf("bundle %s: %v", id, err)
	}
	return b
}

// HTTPClient is an HTTP client presenting b's certificate (nil b: none)
// and trusting the harness CA, for tests calling members' endpoints as
// some peer would.
func (c *Cluster) HTTPClient(b *pki.Bundle) *http.Client {
	var cfg *tls.Config
	switch {
	case b != nil:
		cfg = b.ClientTLS(nil)
	case c.ca != nil:
		cfg = pki.TrustOnlyTLS(c.ca.Pool(), nil)
	}
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: cfg}}
}

// listenHTTP binds a member's HTTP port on 127.0.0.1:0, never on a port
// freeAddr reserved for a stopped member's Raft transport (the kernel may
// hand a released port out again, and the member would then fail to bind
// its Raft port for as long as this listener lives).
func (c *Cluster) listenHTTP() (net.Listener, error) {
	for range 10 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		addr := ln.Addr().String()
		if !slices.ContainsFunc(c.Members(), func(m *Member) bool { return slices.Contains(m.raftAddrs, addr) }) {
			return ln, nil
		}
		ln.Close()
	}
	return nil, errors.New("clustertest: no free HTTP port")
}

// freeRaftAddr is freeAddr, but never an address another member already
// has: a port released by freeAddr can be handed out again (tests of other
// packages bind ports at the same time), and two members with one address
// fail to bootstrap ("found duplicate address in configuration"; seen once
// in a full -race run). mine are the addresses the new member already has
// (its other groups'). c.mu must be held.
func (c *Cluster) freeRaftAddr(mine []string) string {
	for range 20 {
		addr := freeAddr(c.T)
		taken := slices.Contains(mine, addr) ||
			slices.ContainsFunc(c.members, func(m *Member) bool { return slices.Contains(m.raftAddrs, addr) })
		if !taken {
			return addr
		}
	}
	c.T.Fatalf("clustertest: no distinct free port for a Raft address")
	return ""
}

// freeAddr reserves a 127.0.0.1 port by binding and releasing it.
func freeAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("free port: %v", err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// Members returns all slots, running or not.
func (c *Cluster) Members() []*Member {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.members)
}

// M returns member i.
func (c *Cluster) M(i int) *Member { return c.Members()[i] }

// Running returns the members with a live node.
func (c *Cluster) Running() []*Member {
	var out []*Member
	for _, m := range c.Members() {
		if m.Running() {
			out = append(out, m)
		}
	}
	return out
}

type startOpts struct {
	peers [][]cluster.Peer // per group; nil: none
	join  []string
}

func (c *Cluster) startOrFail(m *Member, so startOpts) {
	c.T.Helper()
	if err := c.start(m, so); err != nil {
		c.T.Fatalf("start %s: %v", m.ID, err)
	}
}

func (c *Cluster) start(m *Member, so startOpts) error {
	if m.Running() {
		return fmt.Errorf("%s already running", m.ID)
	}
	ln, err := c.listenHTTP()
	if err != nil {
		return err
	}
	httpURL := "http://" + ln.Addr().String()
	c.Net.Register(ln.Addr().String(), m.Index)
	if m.bundle != nil {
		ln = tls.NewListener(ln, cluster.HTTPServerTLS(m.bundle))
		httpURL = "https://" + ln.Addr().String()
	}

	reg := prometheus.NewRegistry()
	var (
		nodes []*cluster.Node
		fsms  []cluster.StateMachine
	)
	stopAll := func() {
		ln.Close()
		for _, n := range nodes {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_ = n.Shutdown(ctx)
			cancel()
		}
	}
	for g := range c.opts.Groups {
		node, sm, err := c.newNode(m, g, httpURL, reg, so)
		if err != nil {
			stopAll()
			return fmt.Errorf("group %d: %w", g, err)
		}
		nodes, fsms = append(nodes, node), append(fsms, sm)
	}
	// One server for every group, as a replica has: each group's handler
	// under its own prefix (the longest pattern wins, so "/cluster/" never
	// sees "/cluster/g1/…"). One group keeps serving the handler bare.
	var h http.Handler = nodes[0].Handler()
	if len(nodes) > 1 {
		mux := http.NewServeMux()
		for _, n := range nodes {
			mux.Handle(n.PathPrefix()+"/", n.Handler())
		}
		h = mux
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln)

	m.mu.Lock()
	m.nodes, m.fsms, m.reg, m.httpURL, m.srv = nodes, fsms, reg, httpURL, srv
	m.mu.Unlock()

	for g, node := range nodes {
		ctx, cancel := context.WithTimeout(context.Background(), c.opts.FormTimeout)
		err := node.Form(ctx)
		cancel()
		if err != nil {
			c.stop(m)
			return fmt.Errorf("group %d: form: %w", g, err)
		}
	}
	return nil
}

// newNode builds member m's node of group g (not formed, not served).
func (c *Cluster) newNode(m *Member, g int, httpURL string, reg *prometheus.Registry, so startOpts) (*cluster.Node, cluster.StateMachine, error) {
	sm := c.opts.NewFSM(m.Index)
	cfg := cluster.Config{
		NodeID:             m.ID,
		RaftAddr:           m.GroupRaftAddr(g),
		DataDir:            m.GroupDataDir(g),
		HTTPAddr:           httpURL,
		Join:               so.join,
		LeaderHTTP:         c.httpOf,
		SnapshotThreshold:  c.opts.SnapshotThreshold,
		SnapshotInterval:   c.opts.SnapshotInterval,
		TrailingLogs:       c.opts.TrailingLogs,
		HeartbeatTimeout:   c.opts.HeartbeatTimeout,
		ElectionTimeout:    c.opts.ElectionTimeout,
		LeaderLeaseTimeout: c.opts.LeaderLeaseTimeout,
		CommitTimeout:      c.opts.CommitTimeout,
		BarrierTimeout:     10 * time.Second,
		Dial:               c.Net.Dialer(m.Index),
		Logger:             c.logs.logger(c.opts),
		Registry:           reg,
		TLS:                m.bundle,
		PathPrefix:         GroupPrefix(g),
	}
	if so.peers != nil {
		cfg.Peers = so.peers[g]
	}
	if c.opts.Groups > 1 {
		cfg.Group = strconv.Itoa(g)
	}
	if _, ok := sm.(*FSM); ok {
		cfg.DecodeResult = DecodeCount
		cfg.ForwardErrors = []error{ErrRejected}
	}
	if c.opts.Configure != nil {
		c.opts.Configure(m.Index, &cfg, sm)
	}

	// The Raft port was released by a previous run or by freeAddr; another
	// process may briefly hold it, so retry binding for a short while.
	deadline := time.Now().Add(5 * time.Second)
	for {
		node, err := cluster.New(cfg, sm)
		if err == nil {
			if c.opts.OnNode != nil {
				c.opts.OnNode(m.Index, node)
			}
			return node, sm, nil
		}
		if time.Now().After(deadline) || !strings.Contains(err.Error(), "address already in use") {
			return nil, nil, err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// DecodeCount decodes FSM's forwarded response (a JSON number) to uint64.
func DecodeCount(_ []byte, raw []byte) (any, error) {
	var v uint64
	if err := json.Unmarshal(raw, &v); err != nil {
		return nil, err
	}
	return v, nil
}

// httpOf is the harness's LeaderHTTP: the node registry of a real replica.
func (c *Cluster) httpOf(id string) string {
	for _, m := range c.Members() {
		if m.ID == id {
			return m.HTTPURL()
		}
	}
	return ""
}

// Stop shuts member i down gracefully (leadership transfer if leader).
func (c *Cluster) Stop(i int) {
	c.T.Helper()
	if err := c.stop(c.M(i)); err != nil {
		c.T.Errorf("stop n%d: %v", i, err)
	}
}

func (c *Cluster) stop(m *Member) error {
	m.mu.Lock()
	nodes, srv := m.nodes, m.srv
	m.nodes, m.srv, m.httpURL = nil, nil, ""
	m.mu.Unlock()
	if nodes == nil {
		return nil
	}
	srv.Close()
	var errs []error
	for g, node := range nodes {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := node.Shutdown(ctx); err != nil {
			errs = append(errs, fmt.Errorf("group %d: %w", g, err))
		}
		cancel()
	}
	return errors.Join(errs...)
}

// Start starts stopped member i from its data dir; with no Raft state it
// joins the running members.
func (c *Cluster) Start(i int) {
	c.T.Helper()
	m := c.M(i)
	c.startOrFail(m, startOpts{join: c.joinTargets(m)})
}

// Restart stops and starts member i on the same data dir.
func (c *Cluster) Restart(i int) {
	c.T.Helper()
	c.Stop(i)
	c.Start(i)
}

// Wipe stops member i, deletes its data dir and starts it again; it rejoins
// the running members with the same id and address.
func (c *Cluster) Wipe(i int) {
	c.T.Helper()
	m := c.M(i)
	c.Stop(i)
	if err := os.RemoveAll(m.DataDir); err != nil {
		c.T.Fatalf("wipe n%d: %v", i, err)
	}
	c.startOrFail(m, startOpts{join: c.joinTargets(m)})
}

// AddNode starts a new member that joins the running ones.
func (c *Cluster) AddNode() *Member {
	c.T.Helper()
	m := c.newMember()
	c.mu.Lock()
	c.members = append(c.members, m)
	c.mu.Unlock()
	c.startOrFail(m, startOpts{join: c.joinTargets(m)})
	return m
}

// AddNodeVia starts a new member that joins through member via only (a
// follower, to exercise forwarding of the join).
func (c *Cluster) AddNodeVia(via int) *Member {
	c.T.Helper()
	m := c.newMember()
	c.mu.Lock()
	c.members = append(c.members, m)
	c.mu.Unlock()
	c.startOrFail(m, startOpts{join: []string{c.M(via).HTTPURL()}})
	return m
}

func (c *Cluster) joinTargets(self *Member) []string {
	var out []string
	for _, m := range c.Running() {
		if m != self {
			out = append(out, m.HTTPURL())
		}
	}
	return out
}

func (c *Cluster) shutdownAll() {
	var wg sync.WaitGroup
	for _, m := range c.Members() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := c.stop(m); err != nil {
				c.T.Logf("shutdown %s: %v", m.ID, err)
			}
		}()
	}
	wg.Wait()
}

// Partition cuts every link between members of different groups; members
// in no group keep their links.
func (c *Cluster) Partition(groups ...[]int) {
	for gi, g := range groups {
		for _, hj := range groups[gi+1:] {
			for _, a := range g {
				for _, b := range hj {
					c.Net.SetLink(a, b, false)
				}
			}
		}
	}
}

// Isolate cuts member i off from every other member.
func (c *Cluster) Isolate(i int) {
	for _, m := range c.Members() {
		if m.Index != i {
			c.Net.SetLink(i, m.Index, false)
		}
	}
}

// Heal restores every link.
func (c *Cluster) Heal() { c.Net.HealAll() }

// WaitLeader waits until one of the given members (default: all running)
// leads and is ready (its barrier completed), and returns it. With several
// self-declared leaders (a stale one in a minority) it waits for the one of
// the highest term among them to be unique. Group 0's: see WaitGroupLeader.
func (c *Cluster) WaitLeader(among ...int) *Member {
	c.T.Helper()
	return c.WaitGroupLeader(0, among...)
}

// WaitGroupLeader is WaitLeader for group g: the member whose group-g node
// leads (m.GroupNode(g)).
func (c *Cluster) WaitGroupLeader(g int, among ...int) *Member {
	c.T.Helper()
	var leader *Member
	poll.Until(c.T, 20*time.Second, 20*time.Millisecond, func() error {
		leader = nil
		var best uint64
		for _, m := range c.pick(among) {
			n := m.GroupNode(g)
			if n == nil || !n.IsLeader() {
				continue
			}
			if ok, _ := n.Ready(); !ok {
				continue
			}
			if t := n.Term(); leader == nil || t > best {
				leader, best = m, t
			}
		}
		if leader == nil {
			return errors.New("no ready leader")
		}
		return nil
	})
	return leader
}

func (c *Cluster) pick(among []int) []*Member {
	if len(among) == 0 {
		return c.Running()
	}
	var out []*Member
	for _, i := range among {
		if m := c.M(i); m.Running() {
			out = append(out, m)
		}
	}
	return out
}

// WaitConverged waits until the given running members (default: all) have
// equal FSM digests and applied indexes, all at least the leader's commit
// index as seen by that member's raft, and returns the digest. Group 0's:
// see WaitGroupConverged.
func (c *Cluster) WaitConverged(among ...int) string {
	c.T.Helper()
	return c.WaitGroupConverged(0, among...)
}

// WaitGroupConverged is WaitConverged for group g.
func (c *Cluster) WaitGroupConverged(g int, among ...int) string {
	c.T.Helper()
	var digest string
	poll.Until(c.T, 30*time.Second, 20*time.Millisecond, func() error {
		ms := c.pick(among)
		if len(ms) == 0 {
			return errors.New("no running members")
		}
		var first cluster.Status
		for i, m := range ms {
			n := m.GroupNode(g)
			if n == nil {
				return fmt.Errorf("%s stopped", m.ID)
			}
			st := n.Status()
			if st.RaftAppliedIndex < st.CommitIndex {
				return fmt.Errorf("%s: raft applied %d < commit %d", m.ID, st.RaftAppliedIndex, st.CommitIndex)
			}
			if i == 0 {
				first = st
				continue
			}
			if st.Digest != first.Digest || st.AppliedIndex != first.AppliedIndex {
				return fmt.Errorf("%s digest %s applied %d; %s digest %s applied %d",
					first.NodeID, first.Digest, first.AppliedIndex, st.NodeID, st.Digest, st.AppliedIndex)
			}
		}
		digest = first.Digest
		return nil
	})
	return digest
}

// ApplyN applies n distinct commands through the current leader and
// returns the last response.
func (c *Cluster) ApplyN(prefix string, n int) any {
	c.T.Helper()
	var last any
	for i := 0; i < n; i++ {
		cmd := []byte(fmt.Sprintf("%s-%d", prefix, i))
		var err error
		last, err = c.ApplyVia(func() *cluster.Node { return c.WaitLeader().Node() }, cmd)
		if err != nil {
			c.T.Fatalf("apply %s: %v", cmd, err)
		}
	}
	return last
}

// ApplyVia applies cmd through the node pick returns (asked again on every
// attempt), retrying ErrNoLeader and ErrOutcomeUnknown for up to 20s: the
// command must be idempotent (FSM and the real FSM's KV batches are). Other
// errors (e.g. *cluster.RejectedError) return at once.
func (c *Cluster) ApplyVia(pick func() *cluster.Node, cmd []byte) (any, error) {
	c.T.Helper()
	return Retry(c.T, func(ctx context.Context) (any, error) {
		n := pick()
		if n == nil {
			return nil, cluster.ErrNoLeader
		}
		return n.Apply(ctx, cmd)
	})
}

// Retry runs op (with a 5s context per attempt) until it succeeds or fails
// with an error other than ErrNoLeader / ErrOutcomeUnknown, for up to 20s.
// Leadership can move at any time on a loaded test host; idempotent
// operations are simply retried, as production callers do.
func Retry[T any](t testing.TB, op func(ctx context.Context) (T, error)) (T, error) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		v, err := op(ctx)
		cancel()
		retryable := errors.Is(err, cluster.ErrNoLeader) || errors.Is(err, cluster.ErrOutcomeUnknown)
		if !retryable || time.Now().After(deadline) {
			return v, err
		}
		t.Logf("retrying after: %v", err)
		time.Sleep(50 * time.Millisecond)
	}
}

// NewTestLogger returns a slog logger writing into t.Log until the test's
// cleanup runs.
func NewTestLogger(t testing.TB) *slog.Logger {
	s := &testLogSink{t: t}
	t.Cleanup(s.close)
	return s.logger(Options{})
}

// testLogSink sends per-node slog output into t.Log until closed (t.Log
// after the test has finished panics, and Raft goroutines may still log).
type testLogSink struct {
	t      testing.TB
	mu     sync.Mutex // guards closed, and orders writes against close
	closed bool
}

func (s *testLogSink) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
}

func (s *testLogSink) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.closed {
		s.t.Log(strings.TrimRight(string(p), "\n"))
	}
	return len(p), nil
}

func (s *testLogSink) logger(o Options) *slog.Logger {
	if o.Quiet {
		return slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelError + 100}))
	}
	return slog.New(slog.NewTextHandler(s, &slog.HandlerOptions{Level: o.LogLevel}))
}
