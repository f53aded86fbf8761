package eventbus

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/internal/msgpackread"
	"github.com/kvrouter/kvrouter/internal/poll"
)

// batchOf returns the events first..first+n-1 of worker rank 0, stored
// events of one block each.
func batchOf(worker string, first uint64, n int) []WireEvent {
	evs := make([]WireEvent, n)
	for i := range evs {
		evs[i] = storedEvent(first+uint64(i), first+uint64(i))
		evs[i].Worker = worker
	}
	return evs
}

func mustEncodeBatch(t testing.TB, evs []WireEvent) []byte {
	t.Helper()
	b, err := EncodeBatch(evs)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// rawBatch is a batch message built by hand from encoded members (the
// encoder refuses what CheckBatch refuses; the decoder must see it too).
func rawBatch(t testing.TB, evs ...WireEvent) []byte {
	t.Helper()
	b := appendArrayHeader(nil, len(evs))
	for _, ev := range evs {
		b = append(b, mustEncode(t, ev)...)
	}
	return b
}

func TestBusBatchRoundTrip(t *testing.T) {
	for _, n := range []int{1, 2, 15, 16, 300} {
		evs := batchOf("w1", 7, n)
		evs[0].Kind, evs[0].Blocks, evs[0].HasParent = KindCleared, nil, false
		data := mustEncodeBatch(t, evs)
		if !IsBatch(data) {
			t.Fatalf("n=%d: not recognised as a batch", n)
		}
		got, err := DecodeBatch(data)
		if err != nil {
			t.Fatalf("n=%d: %v", n, err)
		}
		if !reflect.DeepEqual(got, evs) {
			t.Fatalf("n=%d: round trip changed the events", n)
		}
		// The members share one worker string: the events slice, the
		// worker name and one block slice per stored member.
		allocs := testing.AllocsPerRun(20, func() { _, _ = DecodeBatch(data) })
		if want := float64(2 + n - 1); allocs > want {
			t.Errorf("n=%d: %.0f allocations, want ≤ %.0f", n, allocs, want)
		}
	}
	if IsBatch(mustEncode(t, storedEvent(1, 1))) {
		t.Fatal("a single event is taken for a batch")
	}
}

func TestBusBatchDecodeRejects(t *testing.T) {
	ok := mustEncode(t, batchOf("w1", 1, 1)[0])
	tiny := []byte{0x80} // an empty map: decodable alone, too small for a batch member
	many := func(n int, member []byte) []byte {
		b := []byte{msgpackread.Array32, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}
		for range n {
			b = append(b, member...)
		}
		return b
	}
	for _, c := range []struct {
		name string
		data []byte
		want string
	}{
		{"empty payload", nil, "unexpected end"},
		{"a single event", ok, "not a batch"},
		{"empty batch", []byte{0x90}, "empty batch"},
		{"too many members", many(MaxBatchEvents+1, ok), "max 4096"},
		{"count beyond the bytes", []byte{msgpackread.Array32, 0, 0, 0x0f, 0xff, 0x80}, "events in 1 bytes"},
		{"members too small to be valid", many(3, tiny), "events in 3 bytes"},
		{"member not a map", append([]byte{0x92}, append(ok, 0x01)...), "event 1: not a map"},
		{"member with an unknown key", append([]byte{0x91}, mustEncodeMap(t, map[string]any{"w": "w1", "i": 1, "k": 1, "zz": 1})...), `event 0: unknown key "zz"`},
		{"member cut short", append([]byte{0x92}, append(ok, ok[:len(ok)-1]...)...), "event 1"},
		{"trailing bytes", append(append([]byte{0x91}, ok...), 0xc0), "1 trailing bytes"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := DecodeBatch(c.data)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want %q", err, c.want)
			}
			if !strings.HasPrefix(err.Error(), ErrUndecodable.Error()) {
				t.Fatalf("err = %v, not ErrUndecodable", err)
			}
		})
	}
}

func mustEncodeMap(t testing.TB, m map[string]any) []byte {
	t.Helper()
	var buf bytes.Buffer
	b := []byte{msgpackread.FixMapMin | byte(len(m))}
	for k, v := range m {
		b = append(b, msgpackread.FixStrMin|byte(len(k)))
		b = append(b, k...)
		switch v := v.(type) {
		case int:
			b = append(b, byte(v))
		case string:
			b = append(b, msgpackread.FixStrMin|byte(len(v)))
			b = append(b, v...)
		}
	}
	buf.Write(b)
	return buf.Bytes()
}

func TestBusCheckBatch(t *testing.T) {
	mod := func(f func(evs []WireEvent)) []WireEvent {
		evs := batchOf("w1", 5, 4)
		f(evs)
		return evs
	}
	for _, c := range []struct {
		name string
		evs  []WireEvent
		ok   bool
	}{
		{"contiguous", batchOf("w1", 5, 4), true},
		{"one event", batchOf("w1", 1, 1), true},
		{"none", nil, false},
		{"another worker", mod(func(evs []WireEvent) { evs[2].Worker = "w2" }), false},
		{"another rank", mod(func(evs []WireEvent) { evs[3].DPRank = 1 }), false},
		{"a hole", mod(func(evs []WireEvent) { evs[2].EventID++; evs[3].EventID++ }), false},
		{"reordered", mod(func(evs []WireEvent) { evs[1].EventID, evs[2].EventID = evs[2].EventID, evs[1].EventID }), false},
		{"a repeated id", mod(func(evs []WireEvent) { evs[1].EventID = evs[0].EventID }), false},
		{"from id 0", batchOf("w1", 0, 2), false},
		{"past the last id", batchOf("w1", 1<<64-1, 2), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := CheckBatch(c.evs)
			if c.ok != (err == nil) {
				t.Fatalf("CheckBatch = %v, want ok %v", err, c.ok)
			}
			if err != nil && ReasonOf(err) != ReasonBadBatch {
				t.Fatalf("reason %q, want %q", ReasonOf(err), ReasonBadBatch)
			}
			// The encoder refuses what the consumer refuses whole.
			if _, eerr := EncodeBatch(c.evs); (eerr == nil) != c.ok {
				t.Fatalf("EncodeBatch err %v, want ok %v", eerr, c.ok)
			}
		})
	}
}

func TestBusBatchMsgID(t *testing.T) {
	if got := BatchMsgID("w:x", 2, 10, 17); got != "w:x:2:10-17" {
		t.Fatalf("BatchMsgID = %q", got)
	}
	for _, id := range []string{"w:0:1-4", "w:0:1-5", "w:1:1-4", "w:0:1", "w:0:14", "x:0:1-4", "w:0:1-4 ", "w:0:01-4"} {
		if got, want := isBatchMsgID(id, "w", 0, 1, 4), id == BatchMsgID("w", 0, 1, 4); got != want {
			t.Errorf("isBatchMsgID(%q) = %v, want %v", id, got, want)
		}
		if isMsgID(id, "w", 0, 1) && strings.Contains(id, "-") {
			t.Errorf("%q is both a batch and a single event id", id)
		}
	}
}

// members splits a batch's bytes into its members' bytes with the generic
// skipper (not the batch decoder).
func members(data []byte) ([][]byte, bool) {
	r := msgpackread.New(data, nil)
	n, ok, err := r.ArrayHeader()
	if !ok || err != nil {
		return nil, false
	}
	var out [][]byte
	for range n {
		from := r.Offset()
		if err := r.Skip(); err != nil {
			return nil, false
		}
		out = append(out, data[from:r.Offset()])
	}
	return out, r.Left() == 0
}

// FuzzDecodeBatch: the batch decoder against the single-event decoder. A
// batch that decodes is exactly its members decoded alone; an event that
// decodes alone (and is large enough to be valid) decodes as a batch of
// one to the same event; and what the consumer refuses whole, the encoder
// refuses.
func FuzzDecodeBatch(f *testing.F) {
	for _, evs := range [][]WireEvent{batchOf("w1", 1, 1), batchOf("w1", 3, 3), batchOf("engine-a.pod/7", 1<<40, 17)} {
		f.Add(mustEncodeBatch(f, evs))
	}
	for _, ev := range sampleEvents() {
		f.Add(mustEncode(f, ev))
	}
	f.Add(rawBatch(f, storedEvent(1, 1), storedEvent(3, 3)))
	f.Add([]byte{0x90})
	f.Add([]byte{0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, data []byte) {
		evs, err := DecodeBatch(data)
		if err == nil {
			parts, ok := members(data)
			if !ok || len(parts) != len(evs) || len(evs) == 0 || len(evs) > MaxBatchEvents {
				t.Fatalf("decoded %d events, members %d (ok %v)", len(evs), len(parts), ok)
			}
			for i, p := range parts {
				alone, err := Decode(p)
				if err != nil {
					t.Fatalf("member %d decodes in a batch, alone: %v", i, err)
				}
				if !reflect.DeepEqual(alone, evs[i]) {
					t.Fatalf("member %d: batch %+v, alone %+v", i, evs[i], alone)
				}
			}
			if CheckBatch(evs) == nil {
				again, err := EncodeBatch(evs)
				if err != nil {
					t.Fatalf("encode a checked batch: %v", err)
				}
				if back, err := DecodeBatch(again); err != nil || !reflect.DeepEqual(back, evs) {
					t.Fatalf("re-encoded batch: %v", err)
				}
			}
		}
		if ev, err := Decode(data); err == nil {
			one := append([]byte{0x91}, data...)
			got, berr := DecodeBatch(one)
			switch {
			case len(data) >= minBatchMemberBytes && berr != nil:
				t.Fatalf("an event that decodes alone does not as a batch of one: %v", berr)
			case berr == nil && (len(got) != 1 || !reflect.DeepEqual(got[0], ev)):
				t.Fatalf("batch of one: %+v, alone %+v", got, ev)
			}
			if Validate(&ev, 0) == nil && len(data) < minBatchMemberBytes {
				t.Fatalf("a valid event of %d bytes, below minBatchMemberBytes", len(data))
			}
		}
	})
}

// TestBusConsumerBatches: the consumer applies batch messages event by
// event, in order, among single-event messages; refuses a whole message
// that is not one worker rank's contiguous run or does not match its
// subject or Nats-Msg-Id; applies the valid members of a batch with an
// invalid one (counting that one by reason) and acks the message; leaves
// the state machine's gap and duplicate rules to work per event.
func TestBusConsumerBatches(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	_, js := connect(t, s.ClientURL(), "t", log)
	ensureStream(t, js, 1)
	var rejMu sync.Mutex
	var rejs []string
	c, err := NewConsumer(context.Background(), js, ConsumerConfig{Logger: log, Validator: fakeValidator{},
		OnReject: func(r Rejection) {
			rejMu.Lock()
			defer rejMu.Unlock()
			id := "-"
			if r.Event != nil {
				id = r.Event.MsgID()
			}
			rejs = append(rejs, string(r.Reason)+" "+id)
		}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	pub := func(subject, msgID string, data []byte) {
		t.Helper()
		m := &nats.Msg{Subject: subject, Data: data, Header: nats.Header{}}
		if msgID != "" {
			m.Header.Set(jetstream.MsgIDHeader, msgID)
		}
		if _, err := js.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	batch := func(evs []WireEvent) {
		pub(EventSubject("w1"), BatchMsgID("w1", 0, evs[0].EventID, evs[len(evs)-1].EventID), mustEncodeBatch(t, evs))
	}
	single := func(ev WireEvent) { pub(EventSubject(ev.Worker), ev.MsgID(), mustEncode(t, ev)) }

	batch(batchOf("w1", 1, 4))                                                                 // 1-4 applied
	single(batchOf("w1", 5, 1)[0])                                                             // 5 applied
	withBad := batchOf("w1", 6, 4)                                                             // 6, 8, 9 applied; 7 refused
	withBad[1].Kind = 9                                                                        // bad_kind
	batch(withBad)                                                                             //
	batch(batchOf("w1", 3, 2))                                                                 // 3-4 again (another message id): duplicates, skipped per event
	batch(batchOf("w1", 12, 2))                                                                // 12-13 after 9: a gap, applied
	mixed := batchOf("w1", 20, 3)                                                              //
	mixed[2].Worker = "w2"                                                                     //
	pub(EventSubject("w1"), "", rawBatch(t, mixed...))                                         // bad_batch ×3
	pub(EventSubject("w1"), "", rawBatch(t, batchOf("w1", 30, 1)[0], batchOf("w1", 32, 1)[0])) // bad_batch ×2 (hole)
	pub(EventSubject("w2"), "", mustEncodeBatch(t, batchOf("w1", 40, 2)))                      // subject_mismatch ×2
	pub(EventSubject("w1"), "w1:0:50-52", mustEncodeBatch(t, batchOf("w1", 50, 2)))            // msg_id_mismatch ×2
	pub(EventSubject("ghost"), "", mustEncodeBatch(t, batchOf("ghost", 1, 3)))                 // unknown_worker ×3
	pub(EventSubject("w1"), "", []byte{0x90})                                                  // undecodable ×1
	sizes := batchOf("w1", 14, 2)                                                              // 14 refused, 15 applied
	sizes[0].BlockSize = 32                                                                    // block_size_mismatch
	batch(sizes)

	a := newFakeApplier()
	runConsumer(t, c, a)
	want := []string{"w1:0:1", "w1:0:2", "w1:0:3", "w1:0:4", "w1:0:5", "w1:0:6", "w1:0:8", "w1:0:9",
		"w1:0:12", "w1:0:13", "w1:0:15"}
	waitApplied(t, a, len(want))
	waitStreamEmpty(t, js) // acked or terminated, each message
	a.mu.Lock()
	if a.dups != 2 {
		t.Errorf("%d duplicates skipped, want 2 (events 3 and 4)", a.dups)
	}
	wantGaps := []string{"w1: 8 after 6", "w1: 12 after 9", "w1: 15 after 13"}
	if !reflect.DeepEqual(a.gaps, wantGaps) {
		t.Errorf("gaps %v, want %v", a.gaps, wantGaps)
	}
	a.dups, a.gaps = 0, nil
	a.mu.Unlock()
	a.check(t, want, false)
	for r, n := range map[Reason]float64{ReasonBadKind: 1, ReasonBadBatch: 5, ReasonSubjectMismatch: 2,
		ReasonMsgIDMismatch: 2, ReasonUnknownWorker: 3, ReasonUndecodable: 1, ReasonBlockSizeMismatch: 1} {
		if got := rejected(t, c, r); got != n {
			t.Errorf("rejected{%s} = %v, want %v", r, got, n)
		}
	}
	rejMu.Lock()
	defer rejMu.Unlock()
	if len(rejs) != 15 {
		t.Errorf("OnReject saw %d: %v", len(rejs), rejs)
	}
	if rejs[0] != "bad_kind w1:0:7" {
		t.Errorf("first rejection %q, want the batch's bad member", rejs[0])
	}
}

// TestBusPublisherBatching: a batching publisher sends full batches of
// maxEvents, cuts at maxBytes and at a caller-chosen id that does not
// continue the batch, sends a batch of one in the single-event form, and
// reports every event's ack once, in id order; the consumer applies each
// event once, in order.
func TestBusPublisherBatching(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	nc, js := connect(t, s.ClientURL(), "t", log)
	ensureStream(t, js, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Every event of "by bytes" has this size (ids and hashes of one width).
	oneEv := storedEvent(1, 200)
	oneEv.Worker = "w-by-bytes"
	one := len(mustEncode(t, oneEv))
	for _, c := range []struct {
		name      string
		events    int
		maxEvents int
		maxBytes  int
		wantMsgs  int
		restartAt uint64 // publish id restartAt+10 here (a caller-chosen id)
	}{
		{name: "by count", events: 100, maxEvents: 8, wantMsgs: 13},
		{name: "by bytes", events: 30, maxEvents: 64, maxBytes: 3 * one, wantMsgs: 10},
		{name: "off", events: 20, maxEvents: 1, wantMsgs: 20},
		{name: "new run", events: 20, maxEvents: 8, restartAt: 5, wantMsgs: 3}, // 1-4 | 15-22 | 23-30
	} {
		t.Run(c.name, func(t *testing.T) {
			worker := "w-" + strings.ReplaceAll(c.name, " ", "-")
			var mu sync.Mutex
			var acks []uint64
			var seqs = map[uint64]bool{}
			var errs atomic.Int64
			p, err := NewPublisher(nc, worker, 0, WithPublisherLogger(log), WithWindow(256),
				WithBatching(c.maxEvents, c.maxBytes, time.Hour), // only full batches and Flush send
				WithOnAck(func(a PublishAck) {
					mu.Lock()
					defer mu.Unlock()
					acks = append(acks, a.EventID)
					seqs[a.Sequence] = true
				}),
				WithOnError(func(uint64, error) { errs.Add(1) }))
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			before := streamMsgs(t, js)
			var want []uint64
			id := uint64(0)
			for i := range c.events {
				ev := storedEvent(0, uint64(i+200))
				if c.restartAt != 0 && uint64(i) == c.restartAt-1 {
					id = c.restartAt + 10
				} else if id != 0 {
					id++
				}
				ev.EventID = id
				got, err := p.PublishAsync(ctx, ev)
				if err != nil {
					t.Fatal(err)
				}
				if id != 0 && got != id {
					t.Fatalf("event id %d, asked %d", got, id)
				}
				want = append(want, got)
			}
			if err := p.Flush(ctx); err != nil {
				t.Fatal(err)
			}
			mu.Lock()
			defer mu.Unlock()
			if !reflect.DeepEqual(acks, want) {
				t.Fatalf("acks %v, want %v", acks, want)
			}
			if n := streamMsgs(t, js) - before; n != uint64(c.wantMsgs) || len(seqs) != c.wantMsgs {
				t.Errorf("%d events in %d messages (%d ack sequences), want %d", c.events, n, len(seqs), c.wantMsgs)
			}
			if st := p.Stats(); st.Acked != uint64(c.events) || st.Published != uint64(c.events) || st.InFlight != 0 || errs.Load() != 0 {
				t.Errorf("stats %+v, %d errors", st, errs.Load())
			}
		})
	}
	// Every event of every case reaches the applier once, in order (the
	// "new run" case has its gap).
	c, err := NewConsumer(ctx, js, ConsumerConfig{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	a := newFakeApplier()
	runConsumer(t, c, a)
	waitApplied(t, a, 100+30+20+20)
	waitStreamEmpty(t, js)
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.dups != 0 || len(a.gaps) != 1 || a.gaps[0] != "w-new-run: 15 after 4" {
		t.Errorf("dups %d, gaps %v", a.dups, a.gaps)
	}
}

// TestBusPublisherBatchingLinger: a batch that does not fill up is sent
// after the linger, by itself (no Flush), and a batching publisher's
// Close reports what it never sent as failed.
func TestBusPublisherBatchingLinger(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	nc, js := connect(t, s.ClientURL(), "t", log)
	ensureStream(t, js, 1)
	var acked atomic.Int64
	p, err := NewPublisher(nc, "w1", 0, WithPublisherLogger(log), WithBatching(100, 0, 20*time.Millisecond),
		WithOnAck(func(PublishAck) { acked.Add(1) }))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		if _, err := p.PublishAsync(t.Context(), storedEvent(0, uint64(i+1))); err != nil {
			t.Fatal(err)
		}
	}
	poll.Until(t, 10*time.Second, 5*time.Millisecond, func() error {
		if n := acked.Load(); n != 5 {
			return fmt.Errorf("%d of 5 acked", n)
		}
		return nil
	})
	if n := streamMsgs(t, js); n != 1 {
		t.Errorf("%d messages, want one batch", n)
	}
	// Publish waits for its batch's linger and ack, and reports its own id.
	ack, err := p.Publish(t.Context(), storedEvent(0, 6))
	if err != nil || ack.EventID != 6 || ack.Sequence != 2 {
		t.Errorf("Publish: %+v, %v; want event 6 in message 2", ack, err)
	}
	p.Close()

	var failed atomic.Int64
	q, err := NewPublisher(nc, "w2", 0, WithPublisherLogger(log), WithBatching(100, 0, time.Hour),
		WithOnError(func(uint64, error) { failed.Add(1) }))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if _, err := q.PublishAsync(t.Context(), storedEvent(0, uint64(i+1))); err != nil {
			t.Fatal(err)
		}
	}
	q.Close()
	if n := failed.Load(); n != 3 {
		t.Errorf("Close reported %d unsent events, want 3", n)
	}
}

// TestBusPublisherBatchRetry: a batch message that finds no stream is
// re-sent whole with its Nats-Msg-Id (worker:rank:first-last) once the
// stream exists; the acks come per event and in order, and the stream
// holds each batch once.
func TestBusPublisherBatchRetry(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	nc, js := connect(t, s.ClientURL(), "t", log)
	ledger := &ackLedger{}
	p, err := NewPublisher(nc, "w1", 0, WithBatching(2, 0, time.Hour),
		WithRetryBackoff(10*time.Millisecond, 50*time.Millisecond),
		WithOnAck(ledger.onAck("w1", 0)), WithOnError(ledger.onError), WithPublisherLogger(log))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// Publish from a goroutine: once the first batch's re-send has begun,
	// new sends wait for it (order), and it succeeds only after the stream
	// below exists, so a loaded machine could otherwise block here.
	published := make(chan error, 1)
	go func() {
		for i := 1; i <= 4; i++ {
			if _, err := p.PublishAsync(ctx, storedEvent(0, uint64(i))); err != nil {
				published <- err
				return
			}
		}
		published <- nil
	}()
	poll.Until(t, 10*time.Second, 5*time.Millisecond, func() error {
		if p.Stats().Retries == 0 {
			return errors.New("no re-send yet")
		}
		return nil
	})
	ensureStream(t, js, 1)
	if err := <-published; err != nil {
		t.Fatal(err)
	}
	if err := p.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	want := []string{"w1:0:1", "w1:0:2", "w1:0:3", "w1:0:4"}
	if got := ledger.ids(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("acked %v, want %v (errors %v)", got, want, ledger.errs)
	}
	str, err := js.Stream(ctx, StreamName)
	if err != nil {
		t.Fatal(err)
	}
	for seq, id := range map[uint64]string{1: "w1:0:1-2", 2: "w1:0:3-4"} {
		m, err := str.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		if got := m.Header.Get(jetstream.MsgIDHeader); got != id {
			t.Errorf("message %d has Nats-Msg-Id %q, want %q", seq, got, id)
		}
	}
	if n := streamMsgs(t, js); n != 2 {
		t.Fatalf("stream holds %d messages, want 2", n)
	}
}

// TestBusPublisherPublishBatchAsync: an engine's event batch goes as one
// message without WithBatching; a window smaller than the batch cuts it
// (the open part is sent when the window fills) instead of blocking.
func TestBusPublisherPublishBatchAsync(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	nc, js := connect(t, s.ClientURL(), "t", log)
	ensureStream(t, js, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, c := range []struct {
		worker   string
		window   int
		wantMsgs uint64
	}{{"w-wide", 64, 1 + 1}, {"w-narrow", 2, 3 + 1}} {
		ledger := &ackLedger{}
		p, err := NewPublisher(nc, c.worker, 0, WithWindow(c.window), WithPublisherLogger(log),
			WithOnAck(ledger.onAck(c.worker, 0)), WithOnError(ledger.onError))
		if err != nil {
			t.Fatal(err)
		}
		before := streamMsgs(t, js)
		evs := batchOf("", 1, 5)
		for i := range evs {
			evs[i].EventID = 0 // the publisher's next ids
		}
		last, err := p.PublishBatchAsync(ctx, evs)
		if err != nil || last != 5 {
			t.Fatalf("%s: PublishBatchAsync = %d, %v", c.worker, last, err)
		}
		if _, err := p.PublishAsync(ctx, storedEvent(0, 6)); err != nil { // then a single event, alone
			t.Fatal(err)
		}
		if err := p.Flush(ctx); err != nil {
			t.Fatal(err)
		}
		p.Close()
		var want []string
		for id := uint64(1); id <= 6; id++ {
			want = append(want, MsgID(c.worker, 0, id))
		}
		if got := ledger.ids(); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("%s: acked %v, want %v (errors %v)", c.worker, got, want, ledger.errs)
		}
		if n := streamMsgs(t, js) - before; n != c.wantMsgs {
			t.Errorf("%s: %d messages, want %d", c.worker, n, c.wantMsgs)
		}
	}
}

// TestBusConsumerBatchAcrossEntries: a batch message whose events span
// several applier calls (the entry byte cap) is acked only after the call
// holding its last event committed: when that call fails, the message
// comes back whole, and the events the earlier calls committed are skipped
// as duplicates.
func TestBusConsumerBatchAcrossEntries(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	_, js := connect(t, s.ClientURL(), "t", log)
	ensureStream(t, js, 1)
	const limit = 3 * (10 + 8) // three one-block events per entry
	c, err := NewConsumer(context.Background(), js, ConsumerConfig{Logger: log, EntryBytes: entrySize,
		MaxEntryBytes: limit, RetryBackoff: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	evs := batchOf("w1", 1, 8) // entries: 1-3, 4-6, 7-8
	m := &nats.Msg{Subject: EventSubject("w1"), Data: mustEncodeBatch(t, evs), Header: nats.Header{}}
	m.Header.Set(jetstream.MsgIDHeader, BatchMsgID("w1", 0, 1, 8))
	if _, err := js.PublishMsg(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	a := newFakeApplier()
	var calls [][2]uint64
	var failed atomic.Bool
	var mu sync.Mutex
	a.fail = func(batch []WireEvent) error {
		mu.Lock()
		defer mu.Unlock()
		calls = append(calls, [2]uint64{batch[0].EventID, batch[len(batch)-1].EventID})
		if batch[0].EventID == 7 && !failed.Swap(true) {
			// The message must not be acked yet: the first two entries
			// committed, the third did not.
			if n := streamMsgs(t, js); n != 1 {
				t.Errorf("stream holds %d messages before the last entry committed, want 1", n)
			}
			return fmt.Errorf("no quorum")
		}
		return nil
	}
	runConsumer(t, c, a)
	waitApplied(t, a, 8)
	waitStreamEmpty(t, js)
	mu.Lock()
	defer mu.Unlock()
	want := [][2]uint64{{1, 3}, {4, 6}, {7, 8}, {1, 3}, {4, 6}, {7, 8}}
	if !reflect.DeepEqual(calls, want) {
		t.Errorf("applier calls %v, want %v", calls, want)
	}
	a.mu.Lock()
	dups := a.dups
	a.mu.Unlock()
	if dups != 6 {
		t.Errorf("%d duplicates skipped, want 6 (events 1-6 again)", dups)
	}
}

// BenchmarkBusDecodeBatch: 64 stored events of 32 blocks (kvbench ingest's
// default message) decoded as one batch message and as 64 single-event
// messages; ns/op and allocs/op are per 64 events.
func BenchmarkBusDecodeBatch(b *testing.B) {
	evs := make([]WireEvent, 64)
	singles := make([][]byte, len(evs))
	for i := range evs {
		ev := WireEvent{Worker: "ingest-0a1b2c3d-7", EventID: 123456 + uint64(i), Kind: KindStored, BlockSize: 16, HasParent: true, Parent: 1 << 60}
		for j := range 32 {
			h := uint64(i*32+j+1) * 0x9e3779b97f4a7c15
			ev.Blocks = append(ev.Blocks, WireBlock{Engine: h, Content: h})
		}
		evs[i] = ev
		singles[i] = mustEncode(b, ev)
	}
	batch := mustEncodeBatch(b, evs)
	b.Run("form=batch", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(batch)))
		for b.Loop() {
			if _, err := DecodeBatch(batch); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("form=single", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(batch)))
		for b.Loop() {
			for _, s := range singles {
				if _, err := Decode(s); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
}
