package cluster_test

import (
	"context"
	"errors"
	"maps"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/cluster/clustertest"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// realFSMOptions wires the real fsm the way the composition layer will:
// leader HTTP addresses come from the FSM's node registry (each leader
// registers itself on gaining leadership, followers register through it),
// domain errors come out of *fsm.ApplyResult, and forwarded results decode
// back into *fsm.ApplyResult.
func realFSMOptions(t *testing.T) clustertest.Options {
	return clustertest.Options{
		NewFSM: func(int) cluster.StateMachine {
			f, err := fsm.NewFSM(router.DefaultConfig())
			if err != nil {
				t.Fatalf("fsm.NewFSM: %v", err)
			}
			return f
		},
		Configure: func(_ int, c *cluster.Config, sm cluster.StateMachine) {
			f := sm.(*fsm.FSM)
			c.LeaderHTTP = func(id string) string {
				rec, _ := f.Node(id)
				return rec.HTTPAddr
			}
			c.ResponseError = fsm.ResponseError
			c.DecodeResult = fsm.DecodeResult
			c.ForwardErrors = fsm.ForwardErrors()
		},
		OnNode: func(_ int, n *cluster.Node) {
			// Leader: make our HTTP address known so followers can forward.
			n.WhileLeader(func(ctx context.Context) { registerSelf(ctx, n) })
		},
	}
}

// registerSelf records n's addresses in the FSM's node registry, retrying
// until it commits or leadership ends.
func registerSelf(ctx context.Context, n *cluster.Node) {
	cmd, err := fsm.EncodeRegisterNode(fsm.RegisterNode{NodeID: n.ID(), RaftAddr: n.RaftAddr(), HTTPAddr: n.HTTPAddr()})
	if err != nil {
		panic(err)
	}
	for ctx.Err() == nil {
		if _, err := n.Apply(ctx, cmd); err == nil {
			return
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// registerAll registers every running member through whoever leads
// (followers forward once the leader registered itself).
func registerAll(t *testing.T, c *clustertest.Cluster) {
	t.Helper()
	for _, m := range c.Running() {
		poll.Until(t, 20*time.Second, 20*time.Millisecond, func() error {
			n := m.Node()
			cmd, err := fsm.EncodeRegisterNode(fsm.RegisterNode{NodeID: n.ID(), RaftAddr: n.RaftAddr(), HTTPAddr: n.HTTPAddr()})
			if err != nil {
				t.Fatal(err)
			}
			_, err = n.Apply(ctxT(t, 5*time.Second), cmd)
			return err
		})
	}
}

func routerDefault() router.Config { return router.DefaultConfig() }

func kvBatch(t *testing.T, worker string, firstID uint64, events, blocksPerEvent int) []byte {
	t.Helper()
	return kvBatchB(t, worker, firstID, events, blocksPerEvent)
}

// kvBatchB encodes events KV store events of worker rank 0 with ids from
// firstID, each storing blocksPerEvent fresh blocks.
func kvBatchB(t testing.TB, worker string, firstID uint64, events, blocksPerEvent int) []byte {
	evs := make([]fsm.KVBatchEvent, events)
	for i := range evs {
		id := firstID + uint64(i)
		blocks := make([]router.StoredBlock, blocksPerEvent)
		for j := range blocks {
			h := id*1000 + uint64(j) + 1
			blocks[j] = router.StoredBlock{EngineHash: h, ContentHash: h * 7919}
		}
		evs[i] = fsm.KVBatchEvent{Worker: worker, DPRank: 0, EventID: id, Event: router.KVEvent{Kind: router.EventStored, Blocks: blocks}}
	}
	cmd, err := fsm.EncodeKVBatch(evs)
	if err != nil {
		t.Fatal(err)
	}
	return cmd
}

// TestClusterRealFSM runs the real state machine through formation,
// forwarding, snapshot install of a wiped follower, and a full restart.
func TestClusterRealFSM(t *testing.T) {
	c := clustertest.New(t, 3, realFSMOptions(t))
	l := c.WaitLeader()
	registerAll(t, c)
	f := followerOf(c, l)

	reg, err := fsm.EncodeRegisterWorker(fsm.RegisterWorker{ID: "w1", DPRanks: 1, Address: "http://w1", Model: "m", TotalBlocks: 1000})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.ApplyVia(f.Node, reg); err != nil {
		t.Fatalf("register worker via follower: %v", err)
	}

	// KV batches: forwarded from a follower, and ApplyLocal on the leader
	// (the ingest consumer's path). Re-applying a batch is a no-op.
	var next uint64 = 1
	for i := 0; i < 40; i++ {
		cmd := kvBatch(t, "w1", next, 8, 2)
		next += 8
		// A retry after an unknown outcome may find the batch applied:
		// applied + duplicates always covers the 8 events exactly.
		if i%2 == 0 {
			res, err := c.ApplyVia(f.Node, cmd)
			if err != nil {
				t.Fatalf("forwarded batch %d: %v", i, err)
			}
			if r := res.(*fsm.ApplyResult); r.Applied+r.Duplicates != 8 {
				t.Fatalf("forwarded batch %d: %+v", i, r)
			}
			continue
		}
		res, err := clustertest.Retry(t, func(context.Context) (any, error) {
			fut := c.WaitLeader().Node().ApplyLocal(cmd, 5*time.Second)
			if err := fut.Error(); err != nil {
				return nil, err
			}
			return fut.Response(), nil
		})
		if err != nil {
			t.Fatalf("ApplyLocal batch %d: %v", i, err)
		}
		if r := res.(*fsm.ApplyResult); r.Applied+r.Duplicates != 8 {
			t.Fatalf("local batch %d: %+v", i, r)
		}
	}
	dup, err := c.ApplyVia(func() *cluster.Node { return c.WaitLeader().Node() }, kvBatch(t, "w1", 1, 8, 2))
	if err != nil || dup.(*fsm.ApplyResult).Duplicates != 8 {
		t.Fatalf("re-applied batch: %v %+v", err, dup)
	}

	// A domain error (unknown worker) crosses forwarding as its sentinel.
	bad, _ := fsm.EncodeDeregisterWorker(fsm.DeregisterWorker{ID: "nope"})
	_, err = c.ApplyVia(f.Node, bad)
	var rej *cluster.RejectedError
	if !errors.Is(err, fsm.ErrUnknownWorker) || !errors.As(err, &rej) {
		t.Fatalf("deregister unknown worker via follower: %v, want a RejectedError matching fsm.ErrUnknownWorker", err)
	}

	d := c.WaitConverged()
	if err := l.Node().Snapshot(); err != nil {
		t.Logf("snapshot: %v", err)
	}
	c.Wipe(f.Index)
	poll.Until(t, 20*time.Second, 20*time.Millisecond, func() error {
		if f.Node().SnapshotsRestored() == 0 {
			return errors.New("wiped follower got no snapshot")
		}
		return nil
	})
	if got := c.WaitConverged(); got != d {
		t.Fatalf("after wipe digest %s, want %s", got, d)
	}

	cursors := l.FSM().(*fsm.FSM).Cursors()
	for _, m := range c.Members() {
		c.Stop(m.Index)
	}
	for _, m := range c.Members() {
		c.Start(m.Index)
	}
	c.WaitLeader()
	// The digest covers the node registry and applied index, which change
	// when the new leader registers its new HTTP address; the KV state must
	// come back exactly.
	c.WaitConverged()
	for _, m := range c.Members() {
		if got := m.FSM().(*fsm.FSM).Cursors(); !maps.Equal(got, cursors) {
			t.Fatalf("%s cursors after restart %v, want %v", m.ID, got, cursors)
		}
	}
	// Followers forward again once the new leader re-registered itself
	// (every start has a new HTTP address in the harness).
	nf := followerOf(c, c.WaitLeader())
	if _, err := c.ApplyVia(nf.Node, kvBatch(t, "w1", next, 4, 1)); err != nil {
		t.Fatalf("forward after restart: %v", err)
	}
	c.WaitConverged()
}
