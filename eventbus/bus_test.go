package eventbus

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/pki"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// The durability settings DESIGN.md §5 relies on.
func TestBusServerSettings(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	jsc := s.JetStreamConfig()
	if jsc == nil || !jsc.SyncAlways {
		t.Fatalf("JetStream config %+v: SyncAlways must be on", jsc)
	}
	if !s.NATS().JetStreamEnabled() {
		t.Fatal("JetStream off")
	}
	_, js := connect(t, s.ClientURL(), "settings", log)
	ensureStream(t, js, 1)
	ensureStream(t, js, 1) // idempotent
	ctx := context.Background()
	st, err := js.Stream(ctx, StreamName)
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	if cfg.Storage != jetstream.FileStorage || cfg.Replicas != 1 || cfg.Duplicates != 2*time.Minute ||
		cfg.Retention != jetstream.WorkQueuePolicy || cfg.Discard != jetstream.DiscardNew ||
		len(cfg.Subjects) != 1 || cfg.Subjects[0] != EventSubjects {
		t.Fatalf("stream config %+v", cfg)
	}
	// An update goes through (create-or-update).
	if _, err := EnsureStream(ctx, js, StreamOptions{Replicas: 1, MaxAge: time.Hour}); err != nil {
		t.Fatal(err)
	}
	c, err := NewConsumer(ctx, js, ConsumerConfig{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	ci, err := js.Consumer(ctx, StreamName, DefaultDurable)
	if err != nil {
		t.Fatal(err)
	}
	cc := ci.CachedInfo().Config
	if cc.AckPolicy != jetstream.AckExplicitPolicy || cc.AckWait != 10*time.Second || cc.MaxAckPending < 1024 || cc.Durable != DefaultDurable {
		t.Fatalf("consumer config %+v", cc)
	}
	_ = c
	// Clustering without a name is refused, DontListen is never used.
	if _, err := StartServer(ServerConfig{StoreDir: t.TempDir(), ClusterPort: freePort(t), Security: Security{Insecure: true}}); err == nil {
		t.Fatal("cluster without names accepted")
	}
	if _, err := StartServer(ServerConfig{Name: "x", Security: Security{Insecure: true}}); err == nil {
		t.Fatal("no StoreDir accepted")
	}
}

// publishN publishes n events for each worker with async publishers and
// returns the acknowledged msg ids.
func publishN(t *testing.T, nc *nats.Conn, workers []string, n int, opts ...PublisherOption) []string {
	t.Helper()
	ledger := &ackLedger{}
	var pubs []*Publisher
	for _, w := range workers {
		p, err := NewPublisher(nc, w, 0, append([]PublisherOption{
			WithOnAck(ledger.onAck(w, 0)), WithOnError(ledger.onError),
			WithPublisherLogger(testLogger(t)), WithWindow(64)}, opts...)...)
		if err != nil {
			t.Fatal(err)
		}
		pubs = append(pubs, p)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := 1; i <= n; i++ {
		for _, p := range pubs {
			if _, err := p.PublishAsync(ctx, storedEvent(0, uint64(i))); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, p := range pubs {
		if err := p.Flush(ctx); err != nil {
			t.Fatal(err)
		}
		p.Close()
	}
	if len(ledger.errs) > 0 {
		t.Fatalf("publish errors: %v", ledger.errs)
	}
	if ooo := ledger.outOfOrder(); len(ooo) > 0 {
		t.Logf("stored out of publish order: %v", ooo)
	}
	ids := ledger.ids()
	if len(ids) != n*len(workers) {
		t.Fatalf("%d acks, want %d", len(ids), n*len(workers))
	}
	return ids
}

func waitApplied(t *testing.T, a *fakeApplier, n int) {
	t.Helper()
	poll.Until(t, 30*time.Second, 10*time.Millisecond, func() error {
		if got := a.applied(); got < n {
			return fmt.Errorf("%d of %d events applied", got, n)
		}
		return nil
	})
}

func streamMsgs(t *testing.T, js jetstream.JetStream) uint64 {
	t.Helper()
	st, err := js.Stream(context.Background(), StreamName)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return info.State.Msgs
}

func waitStreamEmpty(t *testing.T, js jetstream.JetStream) {
	t.Helper()
	poll.Until(t, 15*time.Second, 20*time.Millisecond, func() error {
		if n := streamMsgs(t, js); n != 0 {
			return fmt.Errorf("%d messages left in the stream", n)
		}
		return nil
	})
}

func TestBusSingleNodePublishConsume(t *testing.T) {
	for _, m := range bothModes(t) {
		t.Run(m.name, func(t *testing.T) { testBusSingleNodePublishConsume(t, m) })
	}
}

func testBusSingleNodePublishConsume(t *testing.T, m busMode) {
	log := testLogger(t)
	s := startSingleMode(t, log, m)
	nc, js := m.replica(t, s.ClientURL(), "single", log)
	ensureStream(t, js, 1)
	reg := prometheus.NewRegistry()
	c, err := NewConsumer(context.Background(), js, ConsumerConfig{Logger: log, Registerer: reg, MaxBatch: 100})
	if err != nil {
		t.Fatal(err)
	}
	a := newFakeApplier()
	runConsumer(t, c, a)

	ids := publishN(t, nc, []string{"w1", "w.2", "w3"}, 300)
	waitApplied(t, a, len(ids))
	waitStreamEmpty(t, js) // every applied event was acked (work queue)
	a.check(t, ids, false)
	// The metrics move just after the acks.
	poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
		if got := counterValue(t, c.Metrics().EventsApplied); got != float64(len(ids)) {
			return fmt.Errorf("events_applied_total %v, want %d", got, len(ids))
		}
		return nil
	})
	if counterValue(t, c.Metrics().Batches) < float64(len(ids))/100 {
		t.Fatalf("batches %v: batches larger than MaxBatch?", counterValue(t, c.Metrics().Batches))
	}
	mfs, err := reg.Gather()
	if err != nil || len(mfs) == 0 {
		t.Fatalf("registry: %v, %d families", err, len(mfs))
	}
}

func TestBusDuplicatesStoredOnce(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	nc, js := connect(t, s.ClientURL(), "t", log)
	ensureStream(t, js, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	// Two publishers of the same worker rank (a restarted worker repeating
	// itself) send the same event ids.
	p1, err := NewPublisher(nc, "w1", 2, WithPublisherLogger(log))
	if err != nil {
		t.Fatal(err)
	}
	defer p1.Close()
	p2, err := NewPublisher(nc, "w1", 2, WithPublisherLogger(log))
	if err != nil {
		t.Fatal(err)
	}
	defer p2.Close()
	for i := uint64(1); i <= 5; i++ {
		a1, err := p1.Publish(ctx, storedEvent(0, i))
		if err != nil || a1.Duplicate || a1.EventID != i {
			t.Fatalf("first publish %d: %+v %v", i, a1, err)
		}
		a2, err := p2.Publish(ctx, storedEvent(i, i))
		if err != nil || !a2.Duplicate || a2.Sequence != a1.Sequence {
			t.Fatalf("repeat %d: %+v %v (first %+v)", i, a2, err, a1)
		}
	}
	// A raw republish with the same Nats-Msg-Id is deduplicated too.
	ev := storedEvent(3, 3)
	ev.Worker, ev.DPRank = "w1", 2
	m := &nats.Msg{Subject: EventSubject("w1"), Data: mustEncode(t, ev), Header: nats.Header{}}
	m.Header.Set(jetstream.MsgIDHeader, MsgID("w1", 2, 3))
	if pa, err := js.PublishMsg(ctx, m); err != nil || !pa.Duplicate {
		t.Fatalf("raw duplicate: %+v %v", pa, err)
	}
	if n := streamMsgs(t, js); n != 5 {
		t.Fatalf("stream holds %d messages, want 5", n)
	}
	if st := p2.Stats(); st.Duplicates != 5 || st.Acked != 5 {
		t.Fatalf("p2 stats %+v", st)
	}

	c, err := NewConsumer(ctx, js, ConsumerConfig{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	a := newFakeApplier()
	runConsumer(t, c, a)
	waitApplied(t, a, 5)
	waitStreamEmpty(t, js)
	a.check(t, []string{"w1:2:1", "w1:2:2", "w1:2:3", "w1:2:4", "w1:2:5"}, false)
}

func TestBusApplierErrorRedelivers(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	nc, js := connect(t, s.ClientURL(), "t", log)
	ensureStream(t, js, 1)
	reg := prometheus.NewRegistry()
	c, err := NewConsumer(context.Background(), js, ConsumerConfig{Logger: log, Registerer: reg,
		MaxBatch: 64, RetryBackoff: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	a := newFakeApplier()
	var calls atomic.Int64
	a.fail = func([]WireEvent) error {
		// Refuse the first three batches and then every fifth one, like a
		// leader whose commits sometimes time out.
		if n := calls.Add(1); n <= 3 || n%5 == 0 {
			return errors.New("raft: apply timed out")
		}
		return nil
	}
	ids := publishN(t, nc, []string{"a", "b"}, 200)
	runConsumer(t, c, a)
	waitApplied(t, a, len(ids))
	waitStreamEmpty(t, js)
	a.check(t, ids, false) // exactly once and in order despite the redeliveries
	if got := counterValue(t, c.Metrics().ApplyErrors); got < 3 {
		t.Fatalf("apply_errors_total %v", got)
	}
}

type fakeValidator struct{}

func (fakeValidator) CheckWorker(worker string, blockSize int) error {
	if worker == "ghost" {
		return fmt.Errorf("check %s: %w", worker, router.ErrUnknownWorker)
	}
	if blockSize != 0 && blockSize != 16 {
		return &router.BlockSizeError{Worker: router.WorkerID(worker), Got: blockSize, Want: 16}
	}
	return nil
}

func TestBusInvalidMessagesTermed(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	nc, js := connect(t, s.ClientURL(), "t", log)
	ensureStream(t, js, 1)
	var rejections atomic.Int64
	c, err := NewConsumer(context.Background(), js, ConsumerConfig{Logger: log, Validator: fakeValidator{},
		OnReject: func(Rejection) { rejections.Add(1) }})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	raw := func(subject string, data []byte) {
		t.Helper()
		if _, err := js.Publish(ctx, subject, data); err != nil {
			t.Fatal(err)
		}
	}
	ev := func(worker string, mod func(*WireEvent)) []byte {
		e := storedEvent(1, 1)
		e.Worker = worker
		if mod != nil {
			mod(&e)
		}
		return mustEncode(t, e)
	}
	raw(EventSubject("junk"), []byte("definitely not msgpack"))
	raw(EventSubject("junk"), nil)
	raw(EventSubject("other"), ev("w1", nil))                                  // subject mismatch
	raw(EventSubject("w1"), ev("w1", func(e *WireEvent) { e.Kind = 9 }))       // bad kind
	raw(EventSubject("ghost"), ev("ghost", nil))                               // unknown worker
	raw(EventSubject("w1"), ev("w1", func(e *WireEvent) { e.BlockSize = 32 })) // size mismatch
	raw(EventSubject("w1"), ev("w1", func(e *WireEvent) { e.Blocks = make([]WireBlock, DefaultMaxBlocks+1) }))
	m := &nats.Msg{Subject: EventSubject("w1"), Data: ev("w1", nil), Header: nats.Header{}}
	m.Header.Set(jetstream.MsgIDHeader, "w1:0:999")
	if _, err := js.PublishMsg(ctx, m); err != nil {
		t.Fatal(err)
	}
	// Valid events behind the garbage are not blocked by it.
	ids := publishN(t, nc, []string{"w1"}, 20)

	a := newFakeApplier()
	runConsumer(t, c, a)
	waitApplied(t, a, len(ids))
	waitStreamEmpty(t, js) // the terminated ones are gone too
	a.check(t, ids, false)
	want := map[Reason]float64{ReasonUndecodable: 2, ReasonSubjectMismatch: 1, ReasonBadKind: 1, ReasonUnknownWorker: 1,
		ReasonBlockSizeMismatch: 1, ReasonTooManyBlocks: 1, ReasonMsgIDMismatch: 1}
	for r, n := range want {
		if got := rejected(t, c, r); got != n {
			t.Errorf("rejected{%s} = %v, want %v", r, got, n)
		}
	}
	if got := rejections.Load(); got != 8 {
		t.Errorf("OnReject saw %d, want 8", got)
	}
}

// A new leader's consumer resumes where the old one stopped: nothing lost,
// nothing applied twice, order kept, even though the old leader stopped in
// the middle of a batch it had fetched.
func TestBusConsumerHandover(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	nc, js := connect(t, s.ClientURL(), "t", log)
	ensureStream(t, js, 1)
	ids := publishN(t, nc, []string{"w1", "w2"}, 150)

	a := newFakeApplier()
	c1, err := NewConsumer(context.Background(), js, ConsumerConfig{Logger: log.With("leader", 1), MaxBatch: 50})
	if err != nil {
		t.Fatal(err)
	}
	// The first leader commits two batches, then loses leadership during
	// the third: its apply fails and it must not ack.
	var batches atomic.Int64
	lost := make(chan struct{})
	stop1 := runConsumer(t, c1, ApplierFunc(func(ctx context.Context, evs []WireEvent) error {
		if batches.Add(1) > 2 {
			select {
			case <-lost:
			default:
				close(lost)
			}
			return errors.New("raft: leadership lost")
		}
		return a.ApplyEvents(ctx, evs)
	}))
	select {
	case <-lost:
	case <-time.After(20 * time.Second):
		t.Fatal("first leader never reached its third batch")
	}
	stop1()
	if got := a.applied(); got == 0 || got >= len(ids) {
		t.Fatalf("first leader applied %d of %d", got, len(ids))
	}
	// The new leader on another connection.
	_, js2 := connect(t, s.ClientURL(), "t2", log)
	c2, err := NewConsumer(context.Background(), js2, ConsumerConfig{Logger: log.With("leader", 2), MaxBatch: 50})
	if err != nil {
		t.Fatal(err)
	}
	runConsumer(t, c2, a)
	waitApplied(t, a, len(ids))
	waitStreamEmpty(t, js)
	a.check(t, ids, false)
}

// Backpressure: with no stream to acknowledge, a full window blocks
// publishing (until ctx); once the stream exists the publisher re-sends with
// the same ids and everything is acknowledged exactly once.
//
// No stream yet, and a subscriber holds the first four sends: their acks
// come only when the test says (the ack timeout is a hang guard), so the
// window is full for certain when the fifth send is tried. Then the holder
// leaves and answers each as a server without the stream does (503, no
// responders). Without the holder the first "no responders" could come back
// before the fourth send, and a failed head blocks new sends until it is
// resolved (resend): the loop of four hung until its context (once in
// a make test on a loaded 2-core host).
func TestBusPublisherBackpressureAndRetry(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	nc, js := connect(t, s.ClientURL(), "t", log)
	hc, _ := connect(t, s.ClientURL(), "holder", log)
	held := make(chan *nats.Msg, 16)
	hold, err := hc.Subscribe(EventSubject("w1"), func(m *nats.Msg) { held <- m })
	if err != nil {
		t.Fatal(err)
	}
	if err := hc.Flush(); err != nil {
		t.Fatal(err)
	}
	ledger := &ackLedger{}
	p, err := NewPublisher(nc, "w1", 0, WithWindow(4), WithAckTimeout(time.Minute),
		WithRetryBackoff(10*time.Millisecond, 100*time.Millisecond),
		WithOnAck(ledger.onAck("w1", 0)), WithOnError(ledger.onError), WithPublisherLogger(log))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for i := 1; i <= 4; i++ {
		if _, err := p.PublishAsync(ctx, storedEvent(0, uint64(i))); err != nil {
			t.Fatal(err)
		}
	}
	short, cancelShort := context.WithTimeout(ctx, 200*time.Millisecond)
	_, err = p.PublishAsync(short, storedEvent(0, 5))
	cancelShort()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("publish into a full window: %v, want deadline exceeded", err)
	}
	var msgs []*nats.Msg
	for len(msgs) < 4 {
		select {
		case m := <-held:
			msgs = append(msgs, m)
		case <-ctx.Done():
			t.Fatalf("the holder got %d of the 4 sends", len(msgs))
		}
	}
	if err := hold.Unsubscribe(); err != nil {
		t.Fatal(err)
	}
	if err := hc.Flush(); err != nil {
		t.Fatal(err)
	}
	for _, m := range msgs {
		nr := nats.NewMsg(m.Reply)
		nr.Header.Set("Status", "503") // what the server sends when nobody listens
		if err := hc.PublishMsg(nr); err != nil {
			t.Fatal(err)
		}
	}
	poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error {
		if p.Stats().Retries == 0 {
			return errors.New("no re-send yet")
		}
		return nil
	})
	ensureStream(t, js, 1)
	if _, err := p.PublishAsync(ctx, storedEvent(0, 5)); err != nil {
		t.Fatal(err)
	}
	if err := p.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	got := ledger.ids()
	want := []string{"w1:0:1", "w1:0:2", "w1:0:3", "w1:0:4", "w1:0:5"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("acked %v, want %v (errors %v)", got, want, ledger.errs)
	}
	if n := streamMsgs(t, js); n != 5 {
		t.Fatalf("stream holds %d, want 5", n)
	}
	if st := p.Stats(); st.Failed != 0 || st.InFlight != 0 || p.NextEventID() != 6 {
		t.Fatalf("stats %+v next %d", st, p.NextEventID())
	}
}

// Close reports what was never acknowledged.
func TestBusPublisherClose(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	nc, _ := connect(t, s.ClientURL(), "t", log)
	// No stream, but a subscriber that never answers: the publishes stay in
	// flight (an ack timeout far away) until Close. Without it each fails at
	// once with "no responders", and a failure that lands before the next
	// PublishAsync blocks that call until the failed one is resolved — which
	// never happens here, so the test hung (1 run in about 30 under -race).
	sink, err := nc.Subscribe(EventSubject("w1"), func(*nats.Msg) {})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sink.Unsubscribe() }()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	ledger := &ackLedger{}
	p, err := NewPublisher(nc, "w1", 0, WithOnAck(ledger.onAck("w1", 0)), WithOnError(ledger.onError),
		WithRetryBackoff(5*time.Millisecond, 20*time.Millisecond), WithAckTimeout(time.Minute), WithPublisherLogger(log))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for i := 1; i <= 3; i++ {
		if _, err := p.PublishAsync(ctx, storedEvent(0, uint64(i))); err != nil {
			t.Fatal(err)
		}
	}
	p.Close()
	if len(ledger.errs) != 3 || len(ledger.ids()) != 0 || !errors.Is(ledger.errs[0], ErrPublisherClosed) {
		t.Fatalf("after close: acked %v, errors %v", ledger.ids(), ledger.errs)
	}
	if _, err := p.PublishAsync(ctx, storedEvent(0, 9)); !errors.Is(err, ErrPublisherClosed) {
		t.Fatalf("publish after close: %v", err)
	}
}

func TestBusCluster3(t *testing.T) {
	for _, m := range bothModes(t) {
		t.Run(m.name, func(t *testing.T) { testBusCluster3(t, m) })
	}
}

// In the secure mode the routes run over mutual TLS: the stream still
// replicates and survives the loss of a server.
func testBusCluster3(t *testing.T, m busMode) {
	servers := startClusterMode(t, 3, m)
	log := testLogger(t)
	nc1, js1 := m.replica(t, servers[0].ClientURL(), "n1", log)
	_, js2 := m.replica(t, servers[1].ClientURL(), "n2", log)
	ensureStream(t, js1, 3)
	st, err := js1.Stream(context.Background(), StreamName)
	if err != nil {
		t.Fatal(err)
	}
	if got := st.CachedInfo().Config.Replicas; got != 3 {
		t.Fatalf("replicas %d", got)
	}
	c, err := NewConsumer(context.Background(), js2, ConsumerConfig{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	a := newFakeApplier()
	runConsumer(t, c, a)
	ids := publishN(t, nc1, []string{"w1", "w2"}, 100)
	waitApplied(t, a, len(ids))

	// Lose one server: two of three still form a quorum for the stream.
	servers[2].Shutdown()
	ids = append(ids, publishN(t, nc1, []string{"w3"}, 100)...)
	waitApplied(t, a, len(ids))
	waitStreamEmpty(t, js1)
	a.check(t, ids, true) // a consumer leader change can lose acks: redelivered, skipped
}

func TestBusExternalURL(t *testing.T) {
	for _, m := range bothModes(t) {
		t.Run(m.name, func(t *testing.T) { testBusExternalURL(t, m) })
	}
}

func testBusExternalURL(t *testing.T, m busMode) {
	log := testLogger(t)
	s := startSingleMode(t, log, m)
	client := ClientSecurity{Insecure: true}
	if m.pki != nil {
		client = ClientSecurity{Bundle: m.pki.bundle(t, pki.Node("ext"))}
	}
	b, err := OpenBus(BusConfig{ExternalURL: s.ClientURL(), Client: client, ClientName: "ext", Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if b.Server() != nil {
		t.Fatal("external bus started a server")
	}
	ensureStream(t, b.JetStream(), 1)
	c, err := NewConsumer(context.Background(), b.JetStream(), ConsumerConfig{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	a := newFakeApplier()
	runConsumer(t, c, a)
	ids := publishN(t, b.Conn(), []string{"w1"}, 10)
	waitApplied(t, a, len(ids))
	a.check(t, ids, false)

	// And the embedded flavour of the same API.
	eb, err := OpenBus(BusConfig{Server: ServerConfig{Name: "emb", StoreDir: t.TempDir(), Security: m.security(t, "emb")}, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer eb.Close()
	if eb.Server() == nil || eb.ClientURL() != eb.Server().ClientURL() || !eb.Conn().IsConnected() {
		t.Fatal("embedded bus not up")
	}
	if eb.Server().Secure() != (m.pki != nil) {
		t.Fatalf("embedded server Secure() = %v in mode %s", eb.Server().Secure(), m.name)
	}
}

// A delivery that never reaches the leader (here: stolen by another client
// of the durable, as a consumer leader change or an abandoned fetch would
// lose it) is noticed by the jump in the consumer sequence; the consumer
// rewinds, and the events are still applied in order, exactly once.
func TestBusConsumerLostDelivery(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	nc, js := connect(t, s.ClientURL(), "t", log)
	ensureStream(t, js, 1)
	ids := publishN(t, nc, []string{"w1"}, 12)
	c, err := NewConsumer(context.Background(), js, ConsumerConfig{Logger: log, MaxBatch: 3})
	if err != nil {
		t.Fatal(err)
	}
	_, js2 := connect(t, s.ClientURL(), "thief", log)
	thief, err := js2.Consumer(context.Background(), StreamName, DefaultDurable)
	if err != nil {
		t.Fatal(err)
	}
	a := newFakeApplier()
	var stolen atomic.Int64
	runConsumer(t, c, ApplierFunc(func(ctx context.Context, evs []WireEvent) error {
		if err := a.ApplyEvents(ctx, evs); err != nil {
			return err
		}
		if stolen.Load() == 0 {
			b, err := thief.Fetch(1, jetstream.FetchMaxWait(time.Second))
			if err != nil {
				return nil
			}
			for range b.Messages() {
				stolen.Add(1) // never acked
			}
		}
		return nil
	}))
	waitApplied(t, a, len(ids))
	a.check(t, ids, false)
	if stolen.Load() != 1 {
		t.Fatalf("stole %d deliveries, want 1", stolen.Load())
	}
	if got := counterValue(t, c.Metrics().DeliveryGaps); got < 1 {
		t.Fatalf("delivery_gaps_total %v", got)
	}
	waitStreamEmpty(t, js)
}

// TestBusDialNoEcho: a connection from Bus.Dial with WithNoEcho gets other
// connections' messages but not its own (replica sync relies on it to skip
// decoding its own load messages), one without it gets its own, and Close
// closes both.
func TestBusDialNoEcho(t *testing.T) {
	log := testLogger(t)
	b, err := OpenBus(BusConfig{Server: ServerConfig{Name: "emb", StoreDir: t.TempDir(), Security: insecureMode.security(t, "emb")}, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	for _, tc := range []struct {
		name   string
		opts   []ConnectOption
		echoes bool
	}{
		{"no-echo", []ConnectOption{WithNoEcho()}, false},
		{"echo", nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nc, err := b.Dial(tc.name, tc.opts...)
			if err != nil {
				t.Fatal(err)
			}
			subject := "test.dial." + tc.name
			got := make(chan string, 16)
			sub, err := nc.Subscribe(subject, func(m *nats.Msg) { got <- string(m.Data) })
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = sub.Unsubscribe() }()
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			for i := range 3 {
				if err := nc.Publish(subject, []byte(fmt.Sprintf("own-%d", i))); err != nil {
					t.Fatal(err)
				}
			}
			// The server has routed our own messages (and queued any echo)
			// before it sees the marker from the other connection.
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			if err := b.Conn().Publish(subject, []byte("marker")); err != nil {
				t.Fatal(err)
			}
			var before []string
			deadline := time.After(10 * time.Second)
			for done := false; !done; {
				select {
				case m := <-got:
					if m == "marker" {
						done = true
					} else {
						before = append(before, m)
					}
				case <-deadline:
					t.Fatalf("marker from the other connection not received; got %v", before)
				}
			}
			if want := map[bool]int{true: 3, false: 0}[tc.echoes]; len(before) != want {
				t.Fatalf("own messages delivered back: %v, want %d", before, want)
			}
		})
	}
	b.Close()
	b.mu.Lock()
	n := len(b.extra)
	b.mu.Unlock()
	if n != 0 {
		t.Fatalf("Close left %d dialled connections tracked", n)
	}
}
