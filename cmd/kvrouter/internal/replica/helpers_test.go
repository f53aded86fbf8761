package replica

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/cluster/clustertest"
	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// testBus starts an embedded NATS server with JetStream (insecure: tests
// bind loopback only); it stops after everything the test started on it.
func testBus(t testing.TB, log *slog.Logger) *eventbus.Server {
	t.Helper()
	srv, err := eventbus.StartServer(eventbus.ServerConfig{Name: "test-bus", StoreDir: t.TempDir(), Logger: log,
		Security: eventbus.Security{Insecure: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	return srv
}

// busWithStream is testBus with the KV_EVENTS stream already there.
func busWithStream(t *testing.T, name string) *eventbus.Server {
	t.Helper()
	srv := testBus(t, clustertest.NewTestLogger(t))
	nc, err := eventbus.Connect(srv.ClientURL(), name+"-setup", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := eventbus.EnsureStream(t.Context(), js, eventbus.StreamOptions{}); err != nil {
		t.Fatal(err)
	}
	return srv
}

// testCluster is n replicas assembled as Run assembles them — real FSM,
// real cluster.Node, the replica over them, its leader duties handed to
// the node — but with the nodes from the cluster harness
// (cluster/clustertest: in-process, controllable network) and one shared
// test NATS server instead of an embedded one each. There is no API
// server: tests call the replica's methods.
type testCluster struct {
	*clustertest.Cluster
	Bus *eventbus.Server

	mu   sync.Mutex       // guards reps (members restart on the harness's goroutines)
	reps map[int]*replica // the running replica of each member
}

// model is the one model the test replicas serve.
const model = "m"

func newTestCluster(t testing.TB, n int) *testCluster { return newTestClusterWith(t, n, nil) }

// newTestClusterWith is newTestCluster with each replica's Config passed
// through configure first (nil: as is).
func newTestClusterWith(t testing.TB, n int, configure func(*Config)) *testCluster {
	t.Helper()
	return newTestClusterTLS(t, n, configure, false)
}

// newTestClusterTLS is newTestClusterWith with, when tlsOn, every member
// on a node certificate (mutual TLS on Raft, HTTPS between replicas) and
// forwarded writes vetted by checkForwarded, as Run configures a replica
// with TLS.
func newTestClusterTLS(t testing.TB, n int, configure func(*Config), tlsOn bool) *testCluster {
	t.Helper()
	log := clustertest.NewTestLogger(t) // closes last: after the nodes and the bus
	tc := &testCluster{Bus: testBus(t, log.With("component", "nats")), reps: map[int]*replica{}}
	var busMu sync.Mutex // guards buses
	var buses []*eventbus.Bus
	t.Cleanup(func() { // after the nodes stopped (cleanups run last in, first out)
		busMu.Lock()
		defer busMu.Unlock()
		for _, b := range buses {
			b.Close()
		}
	})
	ctx, cancel := context.WithCancel(context.Background())

	// The harness calls NewFSM, Configure and OnNode in this order for each
	// start of member i, on one goroutine.
	var fsms sync.Map      // member index → *fsm.FSM of its current start
	var advertise sync.Map // member index → the node's HTTP URL
	opts := clustertest.Options{
		NewFSM: func(i int) cluster.StateMachine {
			f, err := fsm.NewFSM(router.DefaultConfig())
			if err != nil {
				t.Fatalf("fsm.NewFSM: %v", err)
			}
			fsms.Store(i, f)
			return f
		},
		TLS: tlsOn,
		Configure: func(i int, c *cluster.Config, sm cluster.StateMachine) {
			overFSM(c, sm.(*fsm.FSM))
			if tlsOn {
				c.CheckForwarded = checkForwarded
			}
			advertise.Store(i, c.HTTPAddr)
		},
		OnNode: func(i int, node *cluster.Node) {
			f, _ := fsms.Load(i)
			url, _ := advertise.Load(i)
			cfg := Config{NodeID: node.ID(), AdvertiseHTTP: url.(string), Models: []string{model}, Router: router.DefaultConfig()}
			if configure != nil {
				configure(&cfg)
			}
			rlog := log.With("node", node.ID())
			bus, err := eventbus.OpenBus(eventbus.BusConfig{ExternalURL: tc.Bus.ClientURL(), ClientName: node.ID(),
				Client: eventbus.ClientSecurity{Insecure: true}, Logger: rlog})
			if err != nil {
				t.Fatalf("bus for %s: %v", node.ID(), err)
			}
			busMu.Lock()
			buses = append(buses, bus)
			busMu.Unlock()
			prompts, err := loadModels(cfg, rlog)
			if err != nil {
				t.Fatal(err)
			}
			r, err := assemble(cfg, rlog, parts{reg: prometheus.NewRegistry(), fsm: f.(*fsm.FSM), node: node, bus: bus, prompts: prompts})
			if err != nil {
				t.Fatalf("assemble %s: %v", node.ID(), err)
			}
			r.start(ctx)
			tc.mu.Lock()
			tc.reps[i] = r
			tc.mu.Unlock()
		},
	}
	tc.Cluster = clustertest.New(t, n, opts)
	t.Cleanup(cancel) // first: the replicas' background work, then the nodes
	return tc
}

// R is member i's running replica.
func (tc *testCluster) R(i int) *replica {
	tc.mu.Lock()
	defer tc.mu.Unlock()
	return tc.reps[i]
}

// follower is a running member that does not lead (its writes forward).
func (tc *testCluster) follower(leader *clustertest.Member) *replica {
	for _, m := range tc.Running() {
		if m != leader {
			return tc.R(m.Index)
		}
	}
	return tc.R(leader.Index)
}

// eachReplica checks fn on every running replica, naming the first that
// fails.
func (tc *testCluster) eachReplica(fn func(r *replica) error) error {
	for _, m := range tc.Running() {
		r := tc.R(m.Index)
		if err := fn(r); err != nil {
			return fmt.Errorf("%s: %w", r.cfg.NodeID, err)
		}
	}
	return nil
}

// propose writes cmd through r (forwarded to the leader when r follows),
// retrying while the cluster elects or the leader's HTTP address is not
// yet registered.
func propose(t *testing.T, r *replica, cmd []byte) {
	t.Helper()
	poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error { return r.propose(t.Context(), cmd) })
}

// registerWorker registers a worker of model through r as the API does.
func registerWorker(t *testing.T, r *replica, id string) {
	t.Helper()
	poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error {
		err := r.RegisterWorker(t.Context(), api.WorkerSpec{ID: id, URL: "http://127.0.0.1:1", Model: model,
			BlockSize: router.DefaultConfig().BlockSize, TotalBlocks: 1000})
		if errors.Is(err, api.ErrInvalid) {
			t.Fatalf("register %s: %v", id, err)
		}
		return err
	})
}

// kvStream is a JetStream client of the test bus named name and the KV
// events stream, once the leader created it (when it starts ingesting).
func kvStream(t *testing.T, tc *testCluster, name string) (jetstream.JetStream, jetstream.Stream) {
	t.Helper()
	nc, err := eventbus.Connect(tc.Bus.ClientURL(), name, clustertest.NewTestLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	var stream jetstream.Stream
	poll.Until(t, 20*time.Second, 20*time.Millisecond, func() error {
		stream, err = js.Stream(t.Context(), eventbus.StreamName)
		return err
	})
	return js, stream
}

// publisher is a worker's KV event publisher on the test bus.
func publisher(t *testing.T, tc *testCluster, worker string, opts ...eventbus.PublisherOption) *eventbus.Publisher {
	t.Helper()
	nc, err := eventbus.Connect(tc.Bus.ClientURL(), "worker-"+worker, clustertest.NewTestLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	p, err := eventbus.NewPublisher(nc, worker, 0, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// stored is a KV event storing one block, chained under the previous one
// (block i's hashes are i+1).
func stored(i int) eventbus.WireEvent {
	ev := eventbus.WireEvent{Kind: uint8(router.EventStored), BlockSize: router.DefaultConfig().BlockSize,
		Blocks: []eventbus.WireBlock{{Engine: uint64(i + 1), Content: uint64(i + 1)}}}
	if i > 0 {
		ev.HasParent, ev.Parent = true, uint64(i)
	}
	return ev
}
