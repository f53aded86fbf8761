// Package cluster runs the Raft node of a kvrouter replica: hashicorp/raft
// with raft-boltdb/v2 (fsync on) as log and stable store, file snapshots, a
// TCP transport, formation (resume / join / bootstrap), leader forwarding of
// writes over HTTP, readiness ("knows a leader and is caught up"), leadership
// notifications for the leader-only ingest consumer, and graceful leadership
// transfer on shutdown. See DESIGN.md.
package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	"go.etcd.io/bbolt"
)

// Node is one Raft member. All methods are safe for concurrent use.
type Node struct {
	cfg    Config
	log    *slog.Logger
	sm     StateMachine
	fsm    *fsmAdapter
	raft   *raft.Raft
	trans  *raft.NetworkTransport
	store  *raftboltdb.BoltStore
	logs   raft.LogStore // the bolt store behind a small read cache
	snaps  *raft.FileSnapshotStore
	m      *metrics
	client *http.Client

	hadState bool // data dir held Raft state when the node was opened

	notifyCh chan bool
	haltCh   chan struct{} // the state machine halted (noteHalt → haltLoop)
	obsCh    chan raft.Observation
	observer *raft.Observer

	closing      chan struct{}
	shutdownOnce sync.Once
	shutdownErr  error
	wg           sync.WaitGroup

	// leaderReadyTerm is the term in which this node, as leader, completed
	// its barrier (so its FSM holds every entry of earlier terms).
	leaderReadyTerm atomic.Uint64

	// leadMu serialises starting and stopping leader runs (and with them the
	// OnLeadership callbacks). Lock order: leadMu, then mu.
	leadMu sync.Mutex

	mu         sync.Mutex // guards the fields below
	rd         readiness
	lastLeader string // last non-empty leader observed (metrics)
	leaderFns  []func(context.Context)
	callbacks  []func(bool)
	lead       *leaderRun // non-nil while leading (after the barrier)
}

// readiness is the follower's catch-up state for the current leader epoch.
type readiness struct {
	epoch       uint64 // bumped on every leader change
	leaderID    string
	since       time.Time // when this node first saw leaderID
	targeted    bool
	target      uint64 // the leader's commit index, learned once per epoch
	fsmTargeted bool
	fsmTarget   uint64 // last command entry at or below target (0: none known)
	fetching    bool   // a leader commit-index request is in flight
	lastFetch   time.Time
	fetchErr    string
	ready       bool // latched until the leader changes
}

type leaderRun struct {
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

func (lr *leaderRun) start(fn func(context.Context)) {
	lr.wg.Add(1)
	go func() {
		defer lr.wg.Done()
		fn(lr.ctx)
	}()
}

// boltOptions is the only place the Raft store is configured: NoSync must
// stay false (every log append is fsynced before it is acknowledged).
func boltOptions(path string) raftboltdb.Options {
	return raftboltdb.Options{
		Path:   path,
		NoSync: false,
		// Fail instead of hanging when another process (or a not yet closed
		// node in the same process) holds the file lock.
		BoltOptions: &bbolt.Options{Timeout: 3 * time.Second},
	}
}

// New opens the stores under cfg.DataDir, binds the Raft transport and
// starts Raft. It does not form a cluster: call Form.
func New(cfg Config, sm StateMachine) (_ *Node, err error) {
	if sm == nil {
		return nil, errors.New("cluster: nil state machine")
	}
	cfg, err = cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	n := &Node{
		cfg:      cfg,
		log:      cfg.Logger.With("node", cfg.NodeID),
		sm:       sm,
		notifyCh: make(chan bool, 8),
		haltCh:   make(chan struct{}, 1),
		obsCh:    make(chan raft.Observation, 64),
		closing:  make(chan struct{}),
	}
	var cleanup []func()
	defer func() {
		if err != nil {
			for i := len(cleanup) - 1; i >= 0; i-- {
				cleanup[i]()
			}
		}
	}()

	if err := os.MkdirAll(cfg.DataDir, 0o755); err != nil {
		return nil, fmt.Errorf("cluster: data dir: %w", err)
	}
	hl := NewHCLogger(n.log, "raft").(*hclogAdapter)

	n.store, err = raftboltdb.New(boltOptions(filepath.Join(cfg.DataDir, "raft.db")))
	if err != nil {
		return nil, fmt.Errorf("cluster: open raft.db: %w", err)
	}
	cleanup = append(cleanup, func() { n.store.Close() })
	n.logs, err = raft.NewLogCache(256, n.store)
	if err != nil {
		return nil, fmt.Errorf("cluster: log cache: %w", err)
	}
	n.snaps, err = raft.NewFileSnapshotStoreWithLogger(cfg.DataDir, cfg.SnapshotRetain, hl.Named("snapshot"))
	if err != nil {
		return nil, fmt.Errorf("cluster: snapshot store: %w", err)
	}
	n.hadState, err = raft.HasExistingState(n.logs, n.store, n.snaps)
	if err != nil {
		return nil, fmt.Errorf("cluster: inspect existing state: %w", err)
	}
	n.trans, err = newTransport(&cfg, hl)
	if err != nil {
		return nil, fmt.Errorf("cluster: %w", err)
	}
	cleanup = append(cleanup, func() { n.trans.Close() })

	rc := raft.DefaultConfig()
	rc.LocalID = raft.ServerID(cfg.NodeID)
	rc.HeartbeatTimeout = cfg.HeartbeatTimeout
	rc.ElectionTimeout = cfg.ElectionTimeout
	rc.LeaderLeaseTimeout = cfg.LeaderLeaseTimeout
	rc.CommitTimeout = cfg.CommitTimeout
	rc.MaxAppendEntries = cfg.MaxAppendEntries
	rc.SnapshotThreshold = cfg.SnapshotThreshold
	rc.SnapshotInterval = cfg.SnapshotInterval
	rc.TrailingLogs = cfg.TrailingLogs
	rc.NotifyCh = n.notifyCh
	rc.Logger = hl
	rc.NoLegacyTelemetry = true
	// Concurrent applies (forwarded writes, the ingest consumer) share
	// AppendEntries and fsyncs. Apply's timeout only ever bounded enqueueing.
	rc.BatchApplyCh = true
	// A removed node stays up without campaigning, so it can be re-added
	// (e.g. after an address change) without a restart.
	rc.ShutdownOnRemove = false
	if err := raft.ValidateConfig(rc); err != nil {
		return nil, fmt.Errorf("cluster: raft config: %w", err)
	}

	// The gauges read n.raft; they are registered once it exists.
	n.m = newMetrics(n)
	n.fsm = &fsmAdapter{sm: sm, m: n.m, onHalt: n.noteHalt}
	n.raft, err = raft.NewRaft(rc, n.fsm, n.logs, n.store, n.snaps, n.trans)
	if err != nil {
		return nil, fmt.Errorf("cluster: start raft: %w", err)
	}
	cleanup = append(cleanup, func() { n.raft.Shutdown().Error() })
	if err := n.m.register(cfg.Registry); err != nil {
		return nil, fmt.Errorf("cluster: %w", err)
	}

	dial := cfg.Dial
	if dial == nil {
		dial = (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	}
	n.client = &http.Client{Transport: &http.Transport{
		DialContext:         dial,
		MaxIdleConnsPerHost: 16,
		IdleConnTimeout:     90 * time.Second,
	}}

	n.observer = raft.NewObserver(n.obsCh, false, func(o *raft.Observation) bool {
		_, ok := o.Data.(raft.LeaderObservation)
		return ok
	})
	n.raft.RegisterObserver(n.observer)

	n.wg.Add(3)
	go n.leadershipLoop()
	go n.observeLoop()
	go n.haltLoop()
	n.log.Info("raft node started", "raft_addr", cfg.AdvertiseAddr, "data_dir", cfg.DataDir, "existing_state", n.hadState)
	return n, nil
}

// Form makes this node a cluster member, following one rule for every start:
//  1. the data dir already held Raft state: resume (nothing to do);
//  2. Join targets given: ask them to add this node as a voter, retrying with
//     backoff; after Config.JoinAttempts failed rounds fall through to 3 if
//     this node is in Peers, else keep retrying until ctx ends;
//  3. Peers given (and this node among them): bootstrap the full expected
//     set — every node given the same Peers writes the same configuration;
//  4. neither: bootstrap a single-node cluster.
//
// It returns once the node is a member (or has bootstrapped); readiness
// follows when a leader is known and the node has caught up.
func (n *Node) Form(ctx context.Context) error {
	if n.hadState {
		n.log.Info("resuming from existing raft state")
		return nil
	}
	cfg := &n.cfg
	if len(cfg.Join) > 0 {
		backoff := 100 * time.Millisecond
		for attempt := 1; ; attempt++ {
			err := n.joinOnce(ctx)
			if err == nil {
				return nil
			}
			if cfg.selfInPeers() && attempt >= cfg.JoinAttempts {
				n.log.Info("join failed, bootstrapping from peers", "attempts", attempt, "err", err)
				break
			}
			n.log.Info("join failed, retrying", "attempt", attempt, "backoff", backoff, "err", err)
			select {
			case <-ctx.Done():
				return fmt.Errorf("cluster: join: %w (last error: %v)", ctx.Err(), err)
			case <-n.closing:
				return ErrShutdown
			case <-time.After(backoff):
			}
			backoff = min(backoff*2, 2*time.Second)
		}
	}
	var servers []raft.Server
	switch {
	case len(cfg.Peers) > 0 && !cfg.selfInPeers():
		return fmt.Errorf("cluster: node %q is not in peers and no join target accepted it", cfg.NodeID)
	case len(cfg.Peers) > 0:
		for _, p := range cfg.Peers {
			servers = append(servers, raft.Server{Suffrage: raft.Voter, ID: raft.ServerID(p.ID), Address: raft.ServerAddress(p.RaftAddr)})
		}
	default:
		servers = []raft.Server{{Suffrage: raft.Voter, ID: raft.ServerID(cfg.NodeID), Address: raft.ServerAddress(cfg.AdvertiseAddr)}}
	}
	err := n.raft.BootstrapCluster(raft.Configuration{Servers: servers}).Error()
	if errors.Is(err, raft.ErrCantBootstrap) {
		// State arrived meanwhile (a peer that bootstrapped first replicated
		// to us); that is the same cluster.
		n.log.Info("bootstrap skipped: raft state already present")
		return nil
	}
	if err != nil {
		return fmt.Errorf("cluster: bootstrap: %w", err)
	}
	n.log.Info("bootstrapped cluster", "servers", len(servers))
	return nil
}

// ID returns this node's Raft server id.
func (n *Node) ID() string { return n.cfg.NodeID }

// RaftAddr returns the advertised Raft address.
func (n *Node) RaftAddr() string { return n.cfg.AdvertiseAddr }

// HTTPAddr returns the advertised HTTP address (Config.HTTPAddr).
func (n *Node) HTTPAddr() string { return n.cfg.HTTPAddr }

// IsLeader reports whether this node is the Raft leader right now.
func (n *Node) IsLeader() bool { return n.raft.State() == raft.Leader }

// Term returns the current Raft term.
func (n *Node) Term() uint64 { return n.raft.CurrentTerm() }

// Leader returns the current leader's id and Raft address ("" when unknown).
func (n *Node) Leader() (id, raftAddr string) {
	addr, sid := n.raft.LeaderWithID()
	return string(sid), string(addr)
}

// StateMachine returns the replicated state machine this node applies into.
func (n *Node) StateMachine() StateMachine { return n.sm }

// SnapshotsRestored counts snapshots restored into the FSM since New (on
// start from local disk, or installed from the leader).
func (n *Node) SnapshotsRestored() uint64 { return n.fsm.restores.Load() }

// Snapshot forces a snapshot now (normally raft takes them by threshold).
func (n *Node) Snapshot() error {
	return n.raft.Snapshot().Error()
}

// Barrier blocks until every entry before it is applied to this leader's
// FSM; it fails on followers.
// LinearizableRead returns once this node's state machine reflects every
// write committed before the call (the read-index protocol): the leader
// confirms its leadership with a quorum and takes its commit index; a
// follower asks the leader for it. Then both wait until they applied it.
// Reads after it are linearizable with all writes.
func (n *Node) LinearizableRead(ctx context.Context) error {
	var idx uint64
	if n.raft.State() == raft.Leader {
		if err := n.raft.VerifyLeader().Error(); err != nil {
			return mapRaftError(err)
		}
		idx = n.raft.CommitIndex()
	} else {
		_, sid := n.raft.LeaderWithID()
		if sid == "" {
			return ErrNoLeader
		}
		var err error
		if n.cfg.LeaderHTTP == nil {
			return fmt.Errorf("read index from leader %s: no HTTP address lookup: %w", sid, ErrNoLeader)
		}
		if idx, err = n.leaderCommitIndex(string(sid)); err != nil {
			return fmt.Errorf("read index from leader %s: %v: %w", sid, err, ErrNoLeader)
		}
	}
	// raft's applied index moves when entries are handed to the state
	// machine's goroutine, before they are applied: wait for it, then for
	// the state machine itself to reach the last command at or below idx
	// (no-op and configuration entries never reach it).
	wait := func(applied func() uint64, target uint64) error {
		for applied() < target {
			if err := n.sm.Halted(); err != nil {
				return fmt.Errorf("waiting to apply up to %d: state machine %w", target, err)
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("waiting to apply up to %d: %w", target, ctx.Err())
			case <-n.closing:
				return ErrShutdown
			case <-time.After(2 * time.Millisecond):
			}
		}
		return nil
	}
	if err := wait(n.raft.AppliedIndex, idx); err != nil {
		return err
	}
	return wait(n.sm.AppliedIndex, n.lastCommandAtOrBelow(idx))
}

func (n *Node) Barrier(ctx context.Context) error {
	return mapRaftError(waitFuture(ctx, n.raft.Barrier(n.cfg.ApplyTimeout)))
}

func (n *Node) isClosing() bool {
	select {
	case <-n.closing:
		return true
	default:
		return false
	}
}

// waitFuture waits for f or ctx; ctx ending first yields ErrOutcomeUnknown.
func waitFuture(ctx context.Context, f raft.Future) error {
	if ctx.Done() == nil {
		return f.Error()
	}
	done := make(chan error, 1)
	go func() { done <- f.Error() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("%w: %w", ErrOutcomeUnknown, ctx.Err())
	}
}

// Apply proposes cmd and returns the FSM's response. On the leader it calls
// raft.Apply; on a follower it forwards cmd to the leader's HTTP address.
//
// Errors: ErrNoLeader — not applied, safe to retry; ErrOutcomeUnknown — the
// entry may still commit (leadership lost, ctx ended, forwarding broke after
// sending); *RejectedError — committed, and the FSM returned a domain error.
func (n *Node) Apply(ctx context.Context, cmd []byte) (any, error) {
	if n.isClosing() {
		return nil, ErrShutdown
	}
	if n.raft.State() == raft.Leader {
		resp, err := n.applyLeader(ctx, cmd)
		if !errors.Is(err, raft.ErrNotLeader) {
			return resp, err
		}
		// Lost leadership before the entry was enqueued: forward instead.
	}
	return n.forwardApply(ctx, cmd)
}

// applyLeader runs cmd through raft on this (leader) node.
func (n *Node) applyLeader(ctx context.Context, cmd []byte) (any, error) {
	timeout := n.cfg.ApplyTimeout
	if dl, ok := ctx.Deadline(); ok {
		timeout = max(min(timeout, time.Until(dl)), time.Millisecond)
	}
	start := time.Now()
	f := n.raft.Apply(cmd, timeout)
	if err := waitFuture(ctx, f); err != nil {
		return nil, fmt.Errorf("apply: %w", mapRaftError(err))
	}
	n.m.applySeconds.Observe(time.Since(start).Seconds())
	resp := f.Response()
	if e := n.responseError(resp); e != nil {
		return nil, &RejectedError{Message: e.Error(), Err: e}
	}
	return resp, nil
}

// responseError is the domain error in an FSM response, if any.
func (n *Node) responseError(resp any) error {
	if e, ok := resp.(error); ok {
		return e
	}
	if n.cfg.ResponseError != nil {
		return n.cfg.ResponseError(resp)
	}
	return nil
}

// ApplyLocal is raft.Apply for the leader-only ingest consumer: no
// forwarding, no context. The future's Error maps raft errors like Apply
// (raft.ErrLeadershipLost also satisfies ErrOutcomeUnknown; raft.ErrNotLeader
// also ErrNoLeader) and records kvrouter_raft_apply_seconds on success. The
// FSM response, possibly an error value, is in Response().
func (n *Node) ApplyLocal(cmd []byte, timeout time.Duration) raft.ApplyFuture {
	return &timedFuture{ApplyFuture: n.raft.Apply(cmd, timeout), start: time.Now(), m: n.m}
}

type timedFuture struct {
	raft.ApplyFuture
	start time.Time
	m     *metrics
	once  sync.Once
}

func (f *timedFuture) Error() error {
	err := f.ApplyFuture.Error()
	f.once.Do(func() {
		if err == nil {
			f.m.applySeconds.Observe(time.Since(f.start).Seconds())
		}
	})
	return mapRaftError(err)
}

// Join adds (id, raftAddr) as a voter. Idempotent: the same id at the same
// address is already a voter → nil; the same id at a new address is removed
// and re-added; another id at this address is removed first. Followers
// forward to the leader.
func (n *Node) Join(ctx context.Context, id, raftAddr string) error {
	if id == "" || raftAddr == "" {
		return errors.New("cluster: join needs node_id and raft_addr")
	}
	if n.raft.State() != raft.Leader {
		return n.forwardAdmin(ctx, "/cluster/join", joinRequest{NodeID: id, RaftAddr: raftAddr})
	}
	return n.addVoter(ctx, raft.ServerID(id), raft.ServerAddress(raftAddr))
}

func (n *Node) addVoter(ctx context.Context, id raft.ServerID, addr raft.ServerAddress) error {
	cf := n.raft.GetConfiguration()
	if err := waitFuture(ctx, cf); err != nil {
		return fmt.Errorf("join %s: read configuration: %w", id, mapRaftError(err))
	}
	for _, s := range cf.Configuration().Servers {
		if s.ID == id && s.Address == addr {
			if s.Suffrage == raft.Voter {
				n.log.Info("join: already a voter", "id", id, "addr", addr)
				return nil
			}
			continue // a non-voter: AddVoter promotes it
		}
		if s.ID == id || s.Address == addr {
			n.log.Info("join: removing stale entry", "id", s.ID, "addr", s.Address)
			if err := waitFuture(ctx, n.raft.RemoveServer(s.ID, 0, n.cfg.ApplyTimeout)); err != nil {
				return fmt.Errorf("join %s: remove stale %s: %w", id, s.ID, mapRaftError(err))
			}
		}
	}
	if err := waitFuture(ctx, n.raft.AddVoter(id, addr, 0, n.cfg.ApplyTimeout)); err != nil {
		return fmt.Errorf("join %s: add voter: %w", id, mapRaftError(err))
	}
	n.log.Info("join: added voter", "id", id, "addr", addr)
	return nil
}

// Remove takes id out of the configuration. Followers forward to the leader.
func (n *Node) Remove(ctx context.Context, id string) error {
	if id == "" {
		return errors.New("cluster: remove needs node_id")
	}
	if n.raft.State() != raft.Leader {
		return n.forwardAdmin(ctx, "/cluster/remove", removeRequest{NodeID: id})
	}
	if err := waitFuture(ctx, n.raft.RemoveServer(raft.ServerID(id), 0, n.cfg.ApplyTimeout)); err != nil {
		return fmt.Errorf("remove %s: %w", id, mapRaftError(err))
	}
	n.log.Info("removed server", "id", id)
	return nil
}

// OnLeadership registers fn, called with true after this node becomes leader
// and its barrier completed (the FSM holds every earlier entry), and with
// false when it loses leadership or shuts down. Calls alternate, start with
// true, and never overlap. Registered while leading: fn(true) at once.
func (n *Node) OnLeadership(fn func(isLeader bool)) {
	n.leadMu.Lock()
	defer n.leadMu.Unlock()
	n.mu.Lock()
	n.callbacks = append(n.callbacks, fn)
	leading := n.lead != nil
	n.mu.Unlock()
	if leading {
		fn(true)
	}
}

// WhileLeader runs fn in a new goroutine each time this node gains
// leadership (after the barrier), with a context cancelled when leadership
// is lost or the node shuts down. The next run starts only after fn returned,
// so at most one instance runs; fn must return promptly once ctx is done
// (losing leadership waits for it). Meant for the ingest consumer.
func (n *Node) WhileLeader(fn func(ctx context.Context)) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.leaderFns = append(n.leaderFns, fn)
	if n.lead != nil {
		n.lead.start(fn)
	}
}

func (n *Node) leadershipLoop() {
	defer n.wg.Done()
	for {
		select {
		case <-n.closing:
			return
		case isLeader := <-n.notifyCh:
			if !isLeader {
				n.leaderReadyTerm.Store(0)
				n.stopLeading()
				continue
			}
			term := n.raft.CurrentTerm()
			if err := n.raft.Barrier(n.cfg.BarrierTimeout).Error(); err != nil {
				n.log.Warn("leader barrier failed", "term", term, "err", err)
				continue
			}
			if n.raft.State() != raft.Leader || n.raft.CurrentTerm() != term {
				continue // already lost; the false notification is queued
			}
			n.leaderReadyTerm.Store(term)
			n.log.Info("leading", "term", term)
			n.startLeading()
		}
	}
}

func (n *Node) startLeading() {
	n.leadMu.Lock()
	defer n.leadMu.Unlock()
	n.mu.Lock()
	if n.lead != nil || n.isClosing() {
		n.mu.Unlock()
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	run := &leaderRun{ctx: ctx, cancel: cancel}
	n.lead = run
	fns := slices.Clone(n.leaderFns)
	cbs := slices.Clone(n.callbacks)
	for _, fn := range fns {
		run.start(fn)
	}
	n.mu.Unlock()
	for _, cb := range cbs {
		cb(true)
	}
}

func (n *Node) stopLeading() {
	n.leadMu.Lock()
	defer n.leadMu.Unlock()
	n.mu.Lock()
	run := n.lead
	n.lead = nil
	cbs := slices.Clone(n.callbacks)
	n.mu.Unlock()
	if run == nil {
		return
	}
	run.cancel()
	run.wg.Wait()
	n.log.Info("stopped leading")
	for _, cb := range cbs {
		cb(false)
	}
}

func (n *Node) observeLoop() {
	defer n.wg.Done()
	for {
		select {
		case <-n.closing:
			return
		case o := <-n.obsCh:
			lo, ok := o.Data.(raft.LeaderObservation)
			if !ok {
				continue
			}
			id := string(lo.LeaderID)
			n.mu.Lock()
			if id != "" && id != n.lastLeader {
				n.m.leaderChanges.Inc()
				n.log.Info("leader observed", "leader_id", id, "leader_addr", lo.LeaderAddr)
			}
			n.lastLeader = id
			n.noteLeaderLocked(id)
			n.mu.Unlock()
		}
	}
}

// noteLeaderLocked starts a new readiness epoch when the leader changes and
// starts learning the new leader's commit index. mu must be held.
func (n *Node) noteLeaderLocked(id string) {
	if id == n.rd.leaderID {
		return
	}
	n.rd = readiness{epoch: n.rd.epoch + 1, leaderID: id, since: time.Now()}
	if id != "" && id != n.cfg.NodeID && n.cfg.LeaderHTTP != nil {
		n.fetchTargetLocked()
	}
}

// fetchTargetLocked asks the leader for its commit index in the background
// (at most one request in flight, retried no faster than every 100ms).
// mu must be held.
func (n *Node) fetchTargetLocked() {
	rd := &n.rd
	if rd.fetching || time.Since(rd.lastFetch) < 100*time.Millisecond {
		return
	}
	rd.fetching, rd.lastFetch = true, time.Now()
	epoch, leader := rd.epoch, rd.leaderID
	go func() {
		idx, err := n.leaderCommitIndex(leader)
		n.mu.Lock()
		defer n.mu.Unlock()
		if n.rd.epoch != epoch {
			return
		}
		n.rd.fetching = false
		if err != nil {
			n.rd.fetchErr = err.Error()
			return
		}
		// The leader's value is authoritative; the local one is a floor.
		n.rd.target, n.rd.targeted, n.rd.fetchErr = max(idx, n.raft.CommitIndex()), true, ""
	}()
}

// Ready reports whether this node may serve: it knows a leader and its state
// machine has caught up with that leader's commit index as of when the
// leader became known.
//
//   - The leader: ready once its post-election barrier completed (its FSM
//     holds every entry of earlier terms).
//   - A follower asks the leader (GET /cluster/commit over LeaderHTTP) for its
//     commit index once per leader epoch, then is ready when raft's applied
//     index and the FSM's reach it (the FSM target is the last command entry
//     at or below it: no-ops never reach the FSM). Without LeaderHTTP it
//     falls back to its own commit index after the first successful contact
//     from the leader, which can be early while a far-behind follower is
//     still receiving batches.
//
// Ready is latched until the leader changes, so steady replication lag under
// load does not flap it. It never blocks on Raft or the network.
func (n *Node) Ready() (bool, string) {
	if n.isClosing() {
		return false, "shut down"
	}
	if err := n.sm.Halted(); err != nil {
		return false, "state machine " + err.Error()
	}
	_, sid := n.raft.LeaderWithID()
	id := string(sid)
	n.mu.Lock()
	defer n.mu.Unlock()
	n.noteLeaderLocked(id)
	rd := &n.rd
	switch {
	case id == "":
		return false, "no leader"
	case rd.ready:
		return true, "ok"
	case id == n.cfg.NodeID:
		if n.leaderReadyTermIsCurrent() {
			rd.ready = true
			return true, "ok"
		}
		return false, "leader: barrier pending"
	}
	if !rd.targeted {
		if n.cfg.LeaderHTTP != nil {
			n.fetchTargetLocked()
			if rd.fetchErr != "" {
				return false, "waiting for the commit index of leader " + id + ": " + rd.fetchErr
			}
			return false, "waiting for the commit index of leader " + id
		}
		if !n.raft.LastContact().After(rd.since) {
			return false, "waiting for first contact from leader " + id
		}
		rd.target, rd.targeted = n.raft.CommitIndex(), true
	}
	if ra := n.raft.AppliedIndex(); ra < rd.target {
		return false, fmt.Sprintf("catching up: applied %d of %d", ra, rd.target)
	}
	if !rd.fsmTargeted {
		rd.fsmTarget, rd.fsmTargeted = n.lastCommandAtOrBelow(rd.target), true
	}
	if fa := n.sm.AppliedIndex(); fa < rd.fsmTarget {
		return false, fmt.Sprintf("catching up: applied %d of %d", fa, rd.fsmTarget)
	}
	rd.ready = true
	return true, "ok"
}

// leaderReadyTermIsCurrent: this node leads and finished its barrier in
// this term.
func (n *Node) leaderReadyTermIsCurrent() bool {
	return n.raft.State() == raft.Leader && n.leaderReadyTerm.Load() == n.raft.CurrentTerm()
}

// lastCommandAtOrBelow finds the newest LogCommand entry <= idx, looking back
// a bounded distance. 0 when none is found or the log is compacted there (a
// snapshot then covers it, and raft's applied index accounts for it).
func (n *Node) lastCommandAtOrBelow(idx uint64) uint64 {
	var l raft.Log
	for i, steps := idx, 0; i > 0 && steps < 256; i, steps = i-1, steps+1 {
		if err := n.logs.GetLog(i, &l); err != nil {
			return 0
		}
		if l.Type == raft.LogCommand {
			return i
		}
	}
	return 0
}

// noteHalt is told (on raft's FSM goroutine) when the state machine halts
// or resumes. A halt is an operator's problem: the replica needs a newer
// build. A halted leader would keep proposing entries it cannot apply and
// answer reads it cannot serve, so haltLoop hands leadership away.
func (n *Node) noteHalt(err error) {
	if err == nil {
		n.log.Info("state machine resumed applying (restored a snapshot)")
		return
	}
	n.log.Error("state machine halted: this replica applies nothing more and is not ready until restarted with a build that knows the entry",
		"err", err, "applied_index", n.sm.AppliedIndex())
	select {
	case n.haltCh <- struct{}{}:
	default: // one pending notice is enough
	}
}

// haltLoop transfers leadership away from this node when its state machine
// halted while it leads (off the FSM goroutine: the transfer waits for
// raft's main loop).
func (n *Node) haltLoop() {
	defer n.wg.Done()
	for {
		select {
		case <-n.closing:
			return
		case <-n.haltCh:
		}
		if n.sm.Halted() == nil || n.raft.State() != raft.Leader || !n.hasOtherVoters() {
			continue
		}
		if err := n.raft.LeadershipTransfer().Error(); err != nil {
			n.log.Warn("halted leader: leadership transfer failed", "err", err)
			continue
		}
		n.log.Info("halted leader: leadership transferred")
	}
}

// PeerStatus is one server of the Raft configuration.
type PeerStatus struct {
	ID       string `json:"id"`
	RaftAddr string `json:"raft_addr"`
	Suffrage string `json:"suffrage"`
	Leader   bool   `json:"leader"`
}

// Status is this node's view of the cluster (GET /cluster/status).
type Status struct {
	NodeID            string       `json:"node_id"`
	RaftAddr          string       `json:"raft_addr"`
	State             string       `json:"state"` // leader, follower, candidate, shutdown
	LeaderID          string       `json:"leader_id"`
	LeaderAddr        string       `json:"leader_addr"`
	Term              uint64       `json:"term"`
	AppliedIndex      uint64       `json:"applied_index"` // the FSM's
	RaftAppliedIndex  uint64       `json:"raft_applied_index"`
	CommitIndex       uint64       `json:"commit_index"`
	LastLogIndex      uint64       `json:"last_log_index"`
	LastSnapshotIndex uint64       `json:"last_snapshot_index"`
	SnapshotsRestored uint64       `json:"snapshots_restored"`
	Peers             []PeerStatus `json:"peers"`
	Ready             bool         `json:"ready"`
	ReadyReason       string       `json:"ready_reason"`
	Digest            string       `json:"digest"`
	PID               int          `json:"pid"`
	// Halted is why the state machine stopped applying ("" while it
	// applies): see StateMachine.Halted.
	Halted string `json:"halted,omitempty"`
}

// Status gathers Status. Reading the configuration can wait behind a
// snapshot install on a follower, so peers are given up after a second.
func (n *Node) Status() Status {
	leaderAddr, leaderID := n.raft.LeaderWithID()
	ready, reason := n.Ready()
	st := Status{
		NodeID:            n.cfg.NodeID,
		RaftAddr:          n.cfg.AdvertiseAddr,
		State:             strings.ToLower(n.raft.State().String()),
		LeaderID:          string(leaderID),
		LeaderAddr:        string(leaderAddr),
		Term:              n.raft.CurrentTerm(),
		AppliedIndex:      n.sm.AppliedIndex(),
		RaftAppliedIndex:  n.raft.AppliedIndex(),
		CommitIndex:       n.raft.CommitIndex(),
		LastLogIndex:      n.raft.LastIndex(),
		SnapshotsRestored: n.fsm.restores.Load(),
		Ready:             ready,
		ReadyReason:       reason,
		Digest:            n.sm.Digest(),
		PID:               os.Getpid(),
	}
	if err := n.sm.Halted(); err != nil {
		st.Halted = err.Error()
	}
	if metas, err := n.snaps.List(); err == nil && len(metas) > 0 {
		st.LastSnapshotIndex = metas[0].Index
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	cf := n.raft.GetConfiguration()
	if err := waitFuture(ctx, cf); err == nil {
		for _, s := range cf.Configuration().Servers {
			st.Peers = append(st.Peers, PeerStatus{
				ID:       string(s.ID),
				RaftAddr: string(s.Address),
				Suffrage: strings.ToLower(s.Suffrage.String()),
				Leader:   s.ID == leaderID,
			})
		}
	}
	return st
}

// Stats returns raft's own statistics map (may block briefly).
func (n *Node) Stats() map[string]string { return n.raft.Stats() }

// Shutdown stops the node: if leader, it first hands leadership to the most
// up-to-date follower (bounded by ctx), so the cluster does not wait an
// election timeout; then it stops leader runs, Raft, the transport and the
// stores. Safe to call more than once.
func (n *Node) Shutdown(ctx context.Context) error {
	n.shutdownOnce.Do(func() { n.shutdownErr = n.shutdown(ctx) })
	return n.shutdownErr
}

func (n *Node) shutdown(ctx context.Context) error {
	if n.raft.State() == raft.Leader && n.hasOtherVoters() {
		start := time.Now()
		if err := waitFuture(ctx, n.raft.LeadershipTransfer()); err != nil {
			n.log.Warn("leadership transfer failed", "err", err)
		} else {
			n.log.Info("leadership transferred", "took", time.Since(start))
		}
	}
	n.mu.Lock()
	close(n.closing)
	n.mu.Unlock()
	n.stopLeading()

	var errs []error
	if err := n.raft.Shutdown().Error(); err != nil {
		errs = append(errs, fmt.Errorf("raft shutdown: %w", err))
	}
	n.raft.DeregisterObserver(n.observer)
	n.wg.Wait()
	if err := n.store.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close raft.db: %w", err))
	}
	if t, ok := n.client.Transport.(*http.Transport); ok {
		t.CloseIdleConnections()
	}
	n.m.unregister()
	n.log.Info("raft node stopped")
	return errors.Join(errs...)
}

func (n *Node) hasOtherVoters() bool {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	cf := n.raft.GetConfiguration()
	if waitFuture(ctx, cf) != nil {
		return true // let LeadershipTransfer decide
	}
	for _, s := range cf.Configuration().Servers {
		if s.Suffrage == raft.Voter && string(s.ID) != n.cfg.NodeID {
			return true
		}
	}
	return false
}
