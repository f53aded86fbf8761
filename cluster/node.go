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
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
)

// Node is one Raft member. All methods are safe for concurrent use.
type Node struct {
	cfg    Config
	log    *slog.Logger
	sm     StateMachine
	fsm    *fsmAdapter
	raft   *raft.Raft
	trans  *raft.NetworkTransport
	store  *raftStore
	logs   raft.LogStore // the bolt store behind a small read cache
	snaps  *raft.FileSnapshotStore
	m      *metrics
	client *http.Client // forwarding and commit-index requests (to members)
	dial   func(ctx context.Context, network, addr string) (net.Conn, error)
	gate   *peerGate // who may speak Raft and call /cluster/ (tls.go)

	// refusedRaft and refusedHTTP count peers refused for want of a member
	// certificate (kvrouter_cluster_peer_refusals_total).
	refusedRaft atomic.Uint64
	refusedHTTP atomic.Uint64

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
		log:      cfg.nodeLogger(),
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

	n.store, err = openRaftStore(filepath.Join(cfg.DataDir, "raft.db"))
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
	n.dial = cfg.Dial
	if n.dial == nil {
		n.dial = (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	}
	n.gate = newPeerGate(&cfg)
	n.trans, err = newTransport(&cfg, hl, n.gate, func() { n.refusedRaft.Add(1) })
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
	// From now on the gate reads raft's configuration; until here it
	// refused every peer.
	n.gate.rf.Store(n.raft)
	if err := n.m.register(cfg.Registry); err != nil {
		return nil, fmt.Errorf("cluster: %w", err)
	}

	n.client = &http.Client{Transport: n.httpTransport(n.gate.members())}

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

// ID returns this node's Raft server id.
func (n *Node) ID() string { return n.cfg.NodeID }

// RaftAddr returns the advertised Raft address.
func (n *Node) RaftAddr() string { return n.cfg.AdvertiseAddr }

// Group returns Config.Group ("" for a process's only group).
func (n *Node) Group() string { return n.cfg.Group }

// HTTPAddr returns the advertised HTTP address (Config.HTTPAddr).
func (n *Node) HTTPAddr() string { return n.cfg.HTTPAddr }

// IsLeader reports whether this node is the Raft leader right now.
func (n *Node) IsLeader() bool { return n.raft.State() == raft.Leader }

// State is this node's Raft state in lower case ("leader", "follower",
// "candidate", "shutdown"), as in Status, without Status's configuration
// read through the Raft loop.
func (n *Node) State() string { return strings.ToLower(n.raft.State().String()) }

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
