package eventbus

import (
	"context"
	"testing"
	"time"
)

// TestBusConsumerStateInMemory: the durable keeps its state in memory
// (DurableConfig), and a durable an earlier build left with its state in
// files — which NATS refuses to update to memory — is replaced, its
// unacked events delivered again and applied, none lost; a second consumer
// start keeps the replacement (no re-creation each time).
func TestBusConsumerStateInMemory(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	nc, js := connect(t, s.ClientURL(), "t", log)
	ensureStream(t, js, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// The earlier build's durable: file state, with events waiting on it.
	old := (&Consumer{cfg: ConsumerConfig{}.withDefaults()}).DurableConfig()
	old.MemoryStorage = false
	if _, err := js.CreateOrUpdateConsumer(ctx, StreamName, old); err != nil {
		t.Fatal(err)
	}
	ids := publishN(t, nc, []string{"w1", "w2"}, 50)

	c, err := NewConsumer(ctx, js, ConsumerConfig{Logger: log})
	if err != nil {
		t.Fatalf("a durable with file state stops the consumer: %v", err)
	}
	info, err := js.Consumer(ctx, StreamName, DefaultDurable)
	if err != nil {
		t.Fatal(err)
	}
	if !info.CachedInfo().Config.MemoryStorage {
		t.Fatal("the durable's state is still in files")
	}
	created := info.CachedInfo().Created
	a := newFakeApplier()
	stop := runConsumer(t, c, a)
	waitApplied(t, a, len(ids))
	waitStreamEmpty(t, js)
	a.check(t, ids, false)
	stop()

	// A later leader's consumer finds the durable as it wants it.
	if _, err := NewConsumer(ctx, js, ConsumerConfig{Logger: log}); err != nil {
		t.Fatal(err)
	}
	info, err = js.Consumer(ctx, StreamName, DefaultDurable)
	if err != nil {
		t.Fatal(err)
	}
	if got := info.CachedInfo().Created; !got.Equal(created) {
		t.Fatalf("the durable was re-created (created %v, was %v)", got, created)
	}

	// FileState (a rolling upgrade from an earlier build) goes back to
	// file state, again without losing an event.
	more := publishN(t, nc, []string{"w3"}, 20)
	c, err = NewConsumer(ctx, js, ConsumerConfig{Logger: log, FileState: true})
	if err != nil {
		t.Fatal(err)
	}
	if info, err = js.Consumer(ctx, StreamName, DefaultDurable); err != nil || info.CachedInfo().Config.MemoryStorage {
		t.Fatalf("FileState: %+v, %v", info.CachedInfo().Config, err)
	}
	b := newFakeApplier()
	runConsumer(t, c, b)
	waitApplied(t, b, len(more))
	waitStreamEmpty(t, js)
	b.check(t, more, false)
}
