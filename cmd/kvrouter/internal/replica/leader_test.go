package replica

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/cluster/clustertest"
	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// The leader's duties, in process: three replicas over the cluster
// harness and one NATS server, no API server, no sleeps.

// TestReplicaLeaderTicksLeaseExpiry: a worker registered with a short
// lease disappears from every replica once the lease passes, because the
// leader stamped its clock into the log (tick); the replicas agree.
func TestReplicaLeaderTicksLeaseExpiry(t *testing.T) {
	tc := newTestCluster(t, 3)
	leader := tc.WaitLeader()
	const lease = 2 * time.Second
	cmd, err := fsm.EncodeRegisterWorker(fsm.RegisterWorker{ID: "leased", DPRanks: 1, Address: "http://127.0.0.1:1",
		Model: model, BlockSize: router.DefaultConfig().BlockSize, TotalBlocks: 1000, LeaseUntil: time.Now().Add(lease).UnixNano()})
	if err != nil {
		t.Fatal(err)
	}
	propose(t, tc.follower(leader), cmd)
	poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
		return tc.eachReplica(func(r *replica) error {
			if _, ok := r.fsm.Worker("leased"); !ok {
				return errors.New("worker not registered yet")
			}
			return nil
		})
	})
	// The lease passes; the next tick (every tickEvery) expires it everywhere.
	poll.Until(t, lease+10*tickEvery+10*time.Second, 50*time.Millisecond, func() error {
		return tc.eachReplica(func(r *replica) error {
			if _, ok := r.fsm.Worker("leased"); ok {
				return errors.New("leased worker still registered")
			}
			return nil
		})
	})
	tc.WaitConverged()
}

// TestReplicaIngestAppliesAndAcks: KV events a worker publishes reach every
// replica's index through the leader's consumer, and the consumer acks a
// stream message only once its batch is committed: whenever the durable
// consumer's ack floor covers an event, some replica (the leader that
// committed it) has already applied it. Events published one per message
// and as batch messages (eventbus.WithBatching: a message holds several
// events, and is acked only once its last event is committed).
func TestReplicaIngestAppliesAndAcks(t *testing.T) {
	for _, c := range []struct {
		name string
		opts []eventbus.PublisherOption
	}{
		{"single", nil},
		{"batches", []eventbus.PublisherOption{eventbus.WithBatching(16, 0, 5*time.Millisecond)}},
	} {
		t.Run(c.name, func(t *testing.T) { testReplicaIngestAppliesAndAcks(t, c.opts...) })
	}
}

func testReplicaIngestAppliesAndAcks(t *testing.T, opts ...eventbus.PublisherOption) {
	tc := newTestCluster(t, 3)
	leader := tc.WaitLeader()
	registerWorker(t, tc.follower(leader), "w")

	var mu sync.Mutex // guards acked and eventAt
	var acked uint64
	// stream sequence → the highest event id its message holds (acks come
	// in id order); the stream drops what the consumer acked
	eventAt := map[uint64]uint64{}
	pub := publisher(t, tc, "w", append(opts, eventbus.WithOnAck(func(a eventbus.PublishAck) {
		mu.Lock()
		acked = max(acked, a.EventID)
		eventAt[a.Sequence] = a.EventID
		mu.Unlock()
	}))...)
	_, stream := kvStream(t, tc, "observer")

	const events = 300
	for i := range events {
		if _, err := pub.PublishAsync(t.Context(), stored(i)); err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
	}
	if err := pub.Flush(t.Context()); err != nil {
		t.Fatal(err)
	}
	key := fsm.RankKey{Worker: "w", DPRank: 0}
	// maxApplied is the highest event id of w any replica has applied.
	maxApplied := func() uint64 {
		var most uint64
		for _, m := range tc.Running() {
			most = max(most, tc.R(m.Index).fsm.Cursors()[key])
		}
		return most
	}
	checks := 0
	poll.Until(t, 60*time.Second, 10*time.Millisecond, func() error {
		// Ack after commit: read the ack floor first, then the replicas.
		cons, err := stream.Consumer(t.Context(), eventbus.DefaultDurable)
		if err != nil {
			return err
		}
		info, err := cons.Info(t.Context())
		if err != nil {
			return err
		}
		floor := info.AckFloor.Stream
		mu.Lock()
		a := acked
		id, known := eventAt[floor] // floor 0: nothing acked yet
		mu.Unlock()
		if known {
			if applied := maxApplied(); applied < id {
				t.Fatalf("stream message %d (event %d) acked, but no replica applied past event %d", floor, id, applied)
			}
			checks++
		}
		if a != events {
			return fmt.Errorf("%d of %d events stored in the stream", a, events)
		}
		if info.NumPending > 0 || info.NumAckPending > 0 {
			return fmt.Errorf("consumer: %d pending, %d awaiting ack", info.NumPending, info.NumAckPending)
		}
		return tc.eachReplica(func(r *replica) error {
			if c, held := r.fsm.Cursors()[key], r.fsm.Index().Held(key.ID()); c != events || held != events {
				return fmt.Errorf("applied up to event %d holding %d blocks, want %d", c, held, events)
			}
			return nil
		})
	})
	if checks == 0 {
		t.Fatal("the ack floor was never seen above zero")
	}
	mu.Lock()
	msgs := len(eventAt)
	mu.Unlock()
	if batched := len(opts) > 0; batched != (msgs < events) {
		t.Errorf("%d events in %d stream messages (batching %v)", events, msgs, batched)
	}
	tc.WaitConverged()
}

// TestReplicaResyncReachesWorker: an event after a gap marks the worker's
// rank stale on every replica; the leader clears the rank through Raft and
// asks the worker over the bus to republish; the worker's next event is
// then its new baseline.
func TestReplicaResyncReachesWorker(t *testing.T) {
	tc := newTestCluster(t, 3)
	leader := tc.WaitLeader()
	registerWorker(t, tc.follower(leader), "w")

	nc, err := eventbus.Connect(tc.Bus.ClientURL(), "worker-w-resync", clustertest.NewTestLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	requests := make(chan eventbus.ResyncRequest, 8)
	sub, err := eventbus.ServeResync(nc, "w", clustertest.NewTestLogger(t), func(req eventbus.ResyncRequest) eventbus.ResyncReply {
		requests <- req
		return eventbus.ResyncReply{Accepted: true, NextEventID: 6}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })

	// Event 5 first: events 1 to 4 never came.
	pub := publisher(t, tc, "w", eventbus.WithNextEventID(5))
	if _, err := pub.Publish(t.Context(), stored(0)); err != nil {
		t.Fatal(err)
	}
	var got eventbus.ResyncRequest
	poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error {
		select {
		case got = <-requests:
			return nil
		default:
			return errors.New("no resync request reached the worker")
		}
	})
	if got.Worker != "w" || got.DPRank != 0 || !strings.Contains(got.Reason, "gap from 0 to 5") {
		t.Fatalf("resync request %+v, want worker w rank 0 for the gap from 0 to 5", got)
	}
	key := fsm.RankKey{Worker: "w", DPRank: 0}
	// The request follows the committed clear: no replica keeps the stale
	// mark or the block stored after the gap.
	poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
		return tc.eachReplica(func(r *replica) error {
			if s, stale := r.fsm.Stale()[key]; stale {
				return fmt.Errorf("still stale: %s", s.Reason)
			}
			if held := r.fsm.Index().Held(key.ID()); held != 0 {
				return fmt.Errorf("%d blocks after the resync", held)
			}
			return nil
		})
	})
	// The worker republishes from its next id: a baseline, no new gap.
	if _, err := pub.Publish(t.Context(), stored(0)); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 20*time.Second, 20*time.Millisecond, func() error {
		return tc.eachReplica(func(r *replica) error {
			if _, stale := r.fsm.Stale()[key]; stale {
				return errors.New("stale again after the resync")
			}
			if held := r.fsm.Index().Held(key.ID()); held != 1 {
				return fmt.Errorf("%d blocks, want the republished one", held)
			}
			return nil
		})
	})
	select {
	case again := <-requests:
		t.Fatalf("a second resync request %+v: the republished event should have been the baseline", again)
	default:
	}
	tc.WaitConverged()
}

// TestReplicaIngestBatchMembers: batch messages go through the real state
// machine event by event. A batch with an invalid last member has its
// valid members applied and is acked (the invalid one counted, not
// applied); a later batch repeating an applied event has that one skipped
// as a duplicate and the rest applied: no gap, nothing stale, every replica
// holds exactly the valid events' blocks, and the stream is drained.
func TestReplicaIngestBatchMembers(t *testing.T) {
	tc := newTestCluster(t, 3)
	leader := tc.WaitLeader()
	registerWorker(t, tc.follower(leader), "w")
	js, stream := kvStream(t, tc, "raw-publisher")
	event := func(id uint64) eventbus.WireEvent {
		ev := stored(int(id) - 1)
		ev.Worker, ev.EventID = "w", id
		return ev
	}
	publish := func(evs ...eventbus.WireEvent) {
		t.Helper()
		data, err := eventbus.EncodeBatch(evs)
		if err != nil {
			t.Fatal(err)
		}
		msg := &nats.Msg{Subject: eventbus.EventSubject("w"), Data: data, Header: nats.Header{}}
		msg.Header.Set(jetstream.MsgIDHeader, eventbus.BatchMsgID("w", 0, evs[0].EventID, evs[len(evs)-1].EventID))
		if _, err := js.PublishMsg(t.Context(), msg); err != nil {
			t.Fatal(err)
		}
	}
	bad := event(3)
	bad.Kind = 9
	publish(event(1), event(2), bad)      // 1, 2 applied; 3 refused (bad_kind)
	publish(event(2), event(3), event(4)) // 2 skipped (duplicate); 3, 4 applied
	key := fsm.RankKey{Worker: "w", DPRank: 0}
	poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error {
		cons, err := stream.Consumer(t.Context(), eventbus.DefaultDurable)
		if err != nil {
			return err
		}
		info, err := cons.Info(t.Context())
		if err != nil {
			return err
		}
		if info.NumPending > 0 || info.NumAckPending > 0 {
			return fmt.Errorf("consumer: %d pending, %d awaiting ack", info.NumPending, info.NumAckPending)
		}
		return tc.eachReplica(func(r *replica) error {
			if s, stale := r.fsm.Stale()[key]; stale {
				return fmt.Errorf("stale: %s", s.Reason)
			}
			if c, held := r.fsm.Cursors()[key], r.fsm.Index().Held(key.ID()); c != 4 || held != 4 {
				return fmt.Errorf("applied up to event %d holding %d blocks, want 4 and 4", c, held)
			}
			return nil
		})
	})
	tc.WaitConverged()
	// The cursors view (what kvbench ingest polls) says what the full
	// status says.
	if err := tc.eachReplica(func(r *replica) error {
		cs := r.CursorStatus()
		if len(cs.Workers) != 1 || cs.Workers[0].ID != "w" || len(cs.Workers[0].Ranks) != 1 {
			return fmt.Errorf("cursors view %+v, want worker w with one rank", cs)
		}
		if got := cs.Workers[0].Ranks[0]; got != (api.CursorRank{Rank: 0, Blocks: 4, LastEventID: 4}) {
			return fmt.Errorf("cursors view rank %+v, want event 4 and 4 blocks", got)
		}
		full := r.Status(false)["workers"].([]map[string]any)[0]["ranks"].([]map[string]any)[0]
		if full["last_event_id"] != cs.Workers[0].Ranks[0].LastEventID || full["blocks"] != cs.Workers[0].Ranks[0].Blocks {
			return fmt.Errorf("cursors view %+v, full status %v", cs.Workers[0].Ranks[0], full)
		}
		if cs.NodeID != r.node.ID() || cs.AppliedIndex == 0 || cs.State == "" {
			return fmt.Errorf("cursors view header %+v", cs)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}
