package zmqbridge

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// TestBridgeThroughEventBus runs the bridge with the real publishers into
// an embedded single-node event bus and applies what the leader's
// consumer delivers to an index; then asks the bridge for a resync over
// NATS and checks the republished state.
func TestBridgeThroughEventBus(t *testing.T) {
	log := testLogger(t)
	srv, err := eventbus.StartServer(eventbus.ServerConfig{Name: "bridge-test", StoreDir: t.TempDir(), Logger: log, Security: eventbus.Security{Insecure: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	nc, err := eventbus.Connect(srv.ClientURL(), "bridge-test", log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := eventbus.EnsureStream(ctx, js, eventbus.StreamOptions{}); err != nil {
		t.Fatal(err)
	}

	ix := router.NewIndex(16)
	id := router.WorkerKey("vllm-nats", 0)
	ix.AddWorker(id)
	var mu sync.Mutex
	var applied []eventbus.WireEvent
	var applyErrs []error
	cons, err := eventbus.NewConsumer(ctx, js, eventbus.ConsumerConfig{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	consDone := make(chan struct{})
	go func() {
		defer close(consDone)
		_ = cons.Run(ctx, eventbus.ApplierFunc(func(_ context.Context, evs []eventbus.WireEvent) error {
			mu.Lock()
			defer mu.Unlock()
			for _, ev := range evs {
				applied = append(applied, ev)
				if err := ix.Apply(ev.WorkerID(), ev.KVEvent()); err != nil {
					applyErrs = append(applyErrs, err)
				}
			}
			return nil
		}))
	}()

	eng := startFakeEngine(t, engineOpts{topic: "", newReplay: true, model: "m", blocks: 100})
	m := newCacheModel(t, "vllm", 1)
	eng.publish(m.batch(false), false)
	b, err := New(Config{BlockSize: 16, Publishers: NATSPublishers(nc, log), NATS: nc, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	bctx, bcancel := context.WithCancel(ctx)
	bdone := make(chan struct{})
	go func() {
		defer close(bdone)
		_ = b.Run(bctx, []WorkerSpec{{ID: "vllm-nats", URL: eng.url(), Events: eng.pubAddr, Replay: eng.rtrAddr}})
	}()
	contents := func() map[uint64]bool {
		mu.Lock()
		defer mu.Unlock()
		out := map[uint64]bool{}
		for _, blk := range ix.WorkerBlocks(id) {
			out[blk.ContentHash] = true
		}
		return out
	}
	converge := func(what string) {
		t.Helper()
		poll.Until(t, 20*time.Second, 10*time.Millisecond, func() error {
			if err := sameSet(contents(), m.contents()); err != nil {
				return fmt.Errorf("%s: %w", what, err)
			}
			return nil
		})
	}
	converge("catch-up")
	eng.waitSubscribed(t)
	for i := range 6 {
		eng.publish(m.batch(i%2 == 1), i == 2)
	}
	converge("live with a gap")

	// The cluster asks for a resync: the bridge republishes its state.
	mu.Lock()
	before := len(applied)
	mu.Unlock()
	rep, err := eventbus.RequestResync(ctx, nc, eventbus.ResyncRequest{Worker: "vllm-nats", LastEventID: 1, Reason: "test"})
	if err != nil || !rep.Accepted || rep.NextEventID == 0 {
		t.Fatalf("resync: %+v %v", rep, err)
	}
	poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error {
		mu.Lock()
		defer mu.Unlock()
		for _, ev := range applied[before:] {
			if ev.Kind == eventbus.KindCleared && ev.EventID >= rep.NextEventID {
				return nil
			}
		}
		return fmt.Errorf("no cleared event at or after id %d", rep.NextEventID)
	})
	converge("after resync")
	if rep, _ := eventbus.RequestResync(ctx, nc, eventbus.ResyncRequest{Worker: "vllm-nats", DPRank: 3}); rep.Accepted {
		t.Fatal("resync of a rank the worker does not have was accepted")
	}

	bcancel()
	<-bdone
	mu.Lock()
	defer mu.Unlock()
	if len(applyErrs) > 0 {
		t.Fatalf("index rejected events: %v", applyErrs)
	}
	for i := 1; i < len(applied); i++ {
		if applied[i].EventID != applied[i-1].EventID+1 {
			t.Fatalf("event ids %d then %d", applied[i-1].EventID, applied[i].EventID)
		}
	}
	if applied[0].Kind != eventbus.KindCleared {
		t.Fatalf("first event %+v", applied[0])
	}
	cancel()
	<-consDone
}
