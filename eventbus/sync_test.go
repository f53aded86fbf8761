package eventbus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// fakeClock moves only when told to.
type fakeClock struct {
	mu      sync.Mutex
	now     time.Time
	tickers []*fakeTicker
}

type fakeTicker struct {
	clk     *fakeClock
	c       chan time.Time
	d       time.Duration
	next    time.Time
	stopped bool
}

func newFakeClock() *fakeClock { return &fakeClock{now: time.Unix(1_700_000_000, 0)} }

func (f *fakeClock) Now() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.now
}

func (f *fakeClock) NewTicker(d time.Duration) Ticker {
	f.mu.Lock()
	defer f.mu.Unlock()
	t := &fakeTicker{clk: f, c: make(chan time.Time, 1), d: d, next: f.now.Add(d)}
	f.tickers = append(f.tickers, t)
	return t
}

func (t *fakeTicker) C() <-chan time.Time { return t.c }
func (t *fakeTicker) Stop() {
	t.clk.mu.Lock()
	t.stopped = true
	t.clk.mu.Unlock()
}

// Advance moves the clock and fires due tickers (dropping ticks nobody
// took, like time.Ticker).
func (f *fakeClock) Advance(d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now = f.now.Add(d)
	for _, t := range f.tickers {
		for !t.stopped && !t.next.After(f.now) {
			select {
			case t.c <- f.now:
			default:
			}
			t.next = t.next.Add(t.d)
		}
	}
}

// recSink records what a Syncer delivers: the remote load view.
type recSink struct {
	mu      sync.Mutex
	active  map[string]map[string]ActiveRequest // replica → request → state
	drops   []string
	replace int
}

func newRecSink() *recSink { return &recSink{active: map[string]map[string]ActiveRequest{}} }

func (s *recSink) AddRemote(replica string, req ActiveRequest) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.active[replica] == nil {
		s.active[replica] = map[string]ActiveRequest{}
	}
	s.active[replica][req.Request] = req
}

func (s *recSink) PrefillDoneRemote(replica, request string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r, ok := s.active[replica][request]; ok {
		r.PrefillDone = true
		s.active[replica][request] = r
	}
}

func (s *recSink) OutputRemote(replica, request string, out router.OutputProgress) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r, ok := s.active[replica][request]; ok && out.Blocks > r.OutputBlocks {
		r.OutputBlocks, r.Generated, r.ExpectedOutput = out.Blocks, out.Generated, out.Expected
		s.active[replica][request] = r
	}
}

func (s *recSink) FreeRemote(replica, request string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.active[replica], request)
}

func (s *recSink) ReplaceReplica(replica string, active []ActiveRequest) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.replace++
	m := map[string]ActiveRequest{}
	for _, r := range active {
		m[r.Request] = r
	}
	s.active[replica] = m
}

func (s *recSink) DropReplica(replica string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.active, replica)
	s.drops = append(s.drops, replica)
}

// view renders a replica's remote view as sorted "req@worker[xN][/done]"
// (xN: n sequences, when more than one).
func (s *recSink) view(replica string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, r := range s.active[replica] {
		v := r.Request + "@" + string(r.Worker)
		if r.Sequences > 1 {
			v += fmt.Sprintf("x%d", r.Sequences)
		}
		if r.PrefillDone {
			v += "/done"
		}
		out = append(out, v)
	}
	slices.Sort(out)
	return fmt.Sprint(out)
}

func (s *recSink) dropped() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.drops)
}

func startSyncer(t *testing.T, nc *nats.Conn, replica string, clk Clock, sink LoadSink) (*Syncer, context.CancelFunc) {
	t.Helper()
	s, err := NewSyncer(nc, SyncConfig{Replica: replica, Model: "llama", Clock: clk, Logger: testLogger(t)}, sink)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := s.Run(ctx); err != nil {
			t.Errorf("syncer %s: %v", replica, err)
		}
	}()
	stop := func() {
		cancel()
		<-done
	}
	t.Cleanup(stop)
	return s, stop
}

func TestBusReplicaSync(t *testing.T) {
	for _, m := range bothModes(t) {
		t.Run(m.name, func(t *testing.T) { testBusReplicaSync(t, m) })
	}
}

func testBusReplicaSync(t *testing.T, m busMode) {
	log := testLogger(t)
	srv := startSingleMode(t, log, m)
	ncA, _ := m.replica(t, srv.ClientURL(), "r1", log)
	ncB, _ := m.replica(t, srv.ClientURL(), "r2", log)
	clkA, clkB := newFakeClock(), newFakeClock()
	sinkA, sinkB := newRecSink(), newRecSink()
	a, stopA := startSyncer(t, ncA, "r1", clkA, sinkA)
	b, _ := startSyncer(t, ncB, "r2", clkB, sinkB)

	// Wait until each has seen the other's snapshot, so both subscriptions
	// are live (a snapshot sent before the peer subscribed is lost).
	poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
		a.publishFull()
		b.publishFull()
		if a.Stats().Replicas != 1 || b.Stats().Replicas != 1 {
			return fmt.Errorf("a %+v b %+v", a.Stats(), b.Stats())
		}
		return nil
	})
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(a.Add(ActiveRequest{Request: "q1", Worker: "w1", Hashes: []uint64{1, 2}, ISL: 40, Overlap: 1}))
	must(a.Add(ActiveRequest{Request: "q2", Worker: "w2", ISL: 8}))
	must(a.PrefillDone("q1"))
	must(a.Add(ActiveRequest{Request: "q3", Worker: "w1", Sequences: 3})) // n = 3
	must(a.Free("q2"))
	want := "[q1@w1/done q3@w1x3]"
	poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
		if got := sinkB.view("r1"); got != want {
			return fmt.Errorf("B's view of r1 %s, want %s", got, want)
		}
		return nil
	})
	// Nothing of our own comes back.
	if got := sinkA.view("r1"); got != "[]" {
		t.Fatalf("A sees itself: %s", got)
	}
	if st := b.Stats(); st.Gaps != 0 {
		t.Fatalf("gaps without loss: %+v", st)
	}

	// The periodic snapshot carries the full set.
	sinkB.mu.Lock()
	fullBefore := sinkB.replace
	sinkB.mu.Unlock()
	clkA.Advance(1100 * time.Millisecond)
	poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
		sinkB.mu.Lock()
		defer sinkB.mu.Unlock()
		if sinkB.replace <= fullBefore {
			return errors.New("no snapshot yet")
		}
		return nil
	})
	if got := sinkB.view("r1"); got != want {
		t.Fatalf("after snapshot %s, want %s", got, want)
	}

	// Expiry by B's clock: r1 stops; 2.9 s of silence is not enough, more
	// than 3 s is. sweep is what Run's ticker calls.
	stopA()
	last := clkB.Now()
	b.sweep(last.Add(2900 * time.Millisecond))
	if len(sinkB.dropped()) != 0 {
		t.Fatalf("dropped after 2.9s: %v", sinkB.dropped())
	}
	// Through the Run loop: advance B's clock past 3 s.
	poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
		if d := sinkB.dropped(); len(d) == 1 && d[0] == "r1" {
			return nil
		}
		clkB.Advance(250 * time.Millisecond)
		return fmt.Errorf("r1 not dropped (clock +%v)", clkB.Now().Sub(last))
	})
	if silent := clkB.Now().Sub(last); silent <= 3*time.Second {
		t.Fatalf("dropped after only %v", silent)
	}
	if got := sinkB.view("r1"); got != "[]" || b.Stats().Expired != 1 {
		t.Fatalf("after expiry %s %+v", got, b.Stats())
	}
}

// Sequence gaps are counted and the next snapshot repairs the view; a
// restarted replica (new epoch) loses its old load.
func TestBusReplicaSyncGapsAndRestart(t *testing.T) {
	sink := newRecSink()
	s, err := NewSyncer(nil, SyncConfig{Replica: "me", Clock: newFakeClock(), Logger: testLogger(t)}, sink)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Unix(0, 0)
	s.deliver(SyncMsg{Replica: "r1", Epoch: 7, Seq: 1, Op: SyncFull}, now)
	s.deliver(SyncMsg{Replica: "r1", Epoch: 7, Seq: 2, Op: SyncAdd, Request: "q1", Worker: "w1"}, now)
	// seq 3 (add q2) and 4 (free q1) are lost.
	s.deliver(SyncMsg{Replica: "r1", Epoch: 7, Seq: 5, Op: SyncAdd, Request: "q3", Worker: "w1"}, now)
	if st := s.Stats(); st.Gaps != 1 {
		t.Fatalf("gaps %d, want 1", st.Gaps)
	}
	if got := sink.view("r1"); got != "[q1@w1 q3@w1]" {
		t.Fatalf("view with a hole %s", got)
	}
	s.deliver(SyncMsg{Replica: "r1", Epoch: 7, Seq: 5, Op: SyncFree, Request: "q3"}, now) // duplicate seq: ignored
	s.deliver(SyncMsg{Replica: "r1", Epoch: 7, Seq: 6, Op: SyncFull, Full: []ActiveRequest{
		{Request: "q2", Worker: "w2"}, {Request: "q3", Worker: "w1"}}}, now)
	if got := sink.view("r1"); got != "[q2@w2 q3@w1]" {
		t.Fatalf("repaired view %s", got)
	}
	// Restart: a new epoch; the old requests vanish even before a snapshot.
	s.deliver(SyncMsg{Replica: "r1", Epoch: 8, Seq: 1, Op: SyncAdd, Request: "q9", Worker: "w3"}, now)
	if got := sink.view("r1"); got != "[q9@w3]" {
		t.Fatalf("after restart %s", got)
	}
	if st := s.Stats(); st.Gaps != 1 {
		t.Fatalf("gaps %d after clean restart, want 1", st.Gaps)
	}
	// Joining mid-stream counts as a gap until the snapshot.
	s.deliver(SyncMsg{Replica: "r2", Epoch: 1, Seq: 40, Op: SyncAdd, Request: "x", Worker: "w1"}, now)
	if st := s.Stats(); st.Gaps != 2 {
		t.Fatalf("gaps %d, want 2", st.Gaps)
	}
	// Wire round trip of a message.
	m := SyncMsg{Replica: "r1", Epoch: 3, Seq: 9, Op: SyncFull, Full: []ActiveRequest{{Request: "a", Worker: "w", Hashes: []uint64{1}, ISL: 4, Overlap: 1, PrefillDone: true}}}
	b, err := msgpack.Marshal(&m)
	if err != nil {
		t.Fatal(err)
	}
	var back SyncMsg
	if err := msgpack.Unmarshal(b, &back); err != nil || fmt.Sprint(back) != fmt.Sprint(m) {
		t.Fatalf("sync msg round trip: %v %+v", err, back)
	}
}

func TestBusResync(t *testing.T) {
	log := testLogger(t)
	srv := startSingle(t, log)
	nc, _ := connect(t, srv.ClientURL(), "t", log)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := RequestResync(ctx, nc, ResyncRequest{Worker: "w.1"}); !errors.Is(err, ErrNoResync) {
		t.Fatalf("no server: %v, want ErrNoResync", err)
	}
	got := make(chan ResyncRequest, 1)
	sub, err := ServeResync(nc, "w.1", log, func(req ResyncRequest) ResyncReply {
		got <- req
		return ResyncReply{Accepted: true, NextEventID: 42}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	rep, err := RequestResync(ctx, nc, ResyncRequest{Worker: "w.1", DPRank: 1, LastEventID: 17, Reason: "gap"})
	if err != nil || !rep.Accepted || rep.NextEventID != 42 {
		t.Fatalf("resync: %+v %v", rep, err)
	}
	if req := <-got; req.DPRank != 1 || req.LastEventID != 17 || req.Reason != "gap" {
		t.Fatalf("served %+v", req)
	}
	// A request for another worker on this subject is refused.
	data, _ := json.Marshal(ResyncRequest{Worker: "other"})
	msg, err := nc.RequestWithContext(ctx, ResyncSubject("w.1"), data)
	if err != nil {
		t.Fatal(err)
	}
	var bad ResyncReply
	if err := json.Unmarshal(msg.Data, &bad); err != nil || bad.Accepted || bad.Error == "" {
		t.Fatalf("foreign request: %+v %v", bad, err)
	}
}

// FuzzSyncHandle feeds arbitrary bytes to the replica-sync receiver, as if
// another replica (or anything on the subject) had published them: it must
// never panic, and whatever it cannot read is counted as undecodable
// instead of reaching the load sink.
func FuzzSyncHandle(f *testing.F) {
	for _, m := range []SyncMsg{
		{Replica: "r1", Epoch: 7, Seq: 1, Op: SyncFull, Full: []ActiveRequest{{Request: "q", Worker: "w#0", Hashes: []uint64{1, 2}, ISL: 32}}},
		{Replica: "r1", Epoch: 7, Seq: 2, Op: SyncAdd, Request: "q1|p", Worker: "w1", Hashes: []uint64{9}, ISL: 16, Overlap: 1},
		{Replica: "r2", Epoch: 1, Seq: 40, Op: SyncPrefillDone, Request: "x"},
		{Replica: "r2", Epoch: 1, Seq: 41, Op: SyncFree, Request: "x|d"},
		{Replica: "r3", Epoch: 2, Seq: 1, Op: SyncOp(99)},
		{Replica: "r4", Epoch: 2, Seq: 1, Op: SyncAdd, Request: "n", Worker: "w1", Sequences: 4},
		{Replica: "r4", Epoch: 2, Seq: 2, Op: SyncFull, Full: []ActiveRequest{{Request: "n", Worker: "w1", Sequences: 1 << 40}}},
		{Replica: "r4", Epoch: 2, Seq: 3, Op: SyncPrefillDone, Request: "n", OutputBlocks: 3, Generated: 41, ExpectedOutput: 64},
		{Replica: "r4", Epoch: 2, Seq: 4, Op: SyncPrefillDone, Request: "n", OutputBlocks: 1 << 40, Generated: -1, ExpectedOutput: 1 << 50},
		{Replica: "r5", Epoch: 2, Seq: 1, Op: SyncFull, Full: []ActiveRequest{{Request: "o", Worker: "w1", OutputBlocks: 1 << 40, Generated: 1 << 41, ExpectedOutput: -7}}},
		{Replica: "r6", Epoch: 2, Seq: 1, Op: SyncTenants, TenantsVersion: TenantUsageVersion,
			Tenants: []TenantUsage{{Model: "m", Tenant: "a", Tokens: 1 << 63, Lift: 7, Waiting: -1, Class: 3, Inflight: 1 << 40}, {Model: "", Tenant: "b"}}},
		{Replica: "r6", Epoch: 2, Seq: 2, Op: SyncTenants, TenantsVersion: 9, Tenants: []TenantUsage{{Model: "m", Tenant: "a"}}},
	} {
		b, err := msgpack.Marshal(&m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add([]byte{0xc1})
	f.Add([]byte("\x81\xa1f\xdd\x7f\xff\xff\xff")) // {f: array of 2^31-1}: once asked for ~170 GB
	f.Add([]byte("\x81\xa1h\xdd\x7f\xff\xff\xff"))
	f.Add([]byte(`{"replica":"r1","seq":1}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		ts := newTenantSink()
		sink := ts.recSink
		s, err := NewSyncer(nil, SyncConfig{Replica: "me", Clock: newFakeClock(), Logger: testLogger(t)}, ts)
		if err != nil {
			t.Fatal(err)
		}
		s.handle(&nats.Msg{Data: data})
		s.handle(&nats.Msg{Data: data}) // the same again: a duplicate
		st := s.Stats()
		for _, us := range ts.tenants {
			if len(us) > MaxSyncTenants {
				t.Fatalf("sink took %d tenants", len(us))
			}
			for _, u := range us {
				if u.Model == "" || u.Tenant == "" || len(u.Tenant) > MaxSyncTenantID || u.Tokens > MaxSyncTenantTokens || u.Lift > MaxSyncTenantTokens ||
					u.Waiting < 0 || u.Waiting > MaxSyncTenantCount || u.Inflight < 0 || u.Inflight > MaxSyncTenantCount {
					t.Fatalf("sink holds unclamped tenant usage %+v", u)
				}
			}
		}
		for _, reqs := range sink.active {
			for _, r := range reqs {
				if r.Sequences < 0 || r.Sequences > MaxSyncSequences {
					t.Fatalf("sink booked %d sequences for %q", r.Sequences, r.Request)
				}
				if o := r.Progress(); o.Blocks != r.OutputBlocks || o.Generated != r.Generated || o.Expected != r.ExpectedOutput {
					t.Fatalf("sink holds unclamped output progress %+v for %q", r, r.Request)
				}
			}
		}
		var m SyncMsg
		if decodeSync(data, &m) != nil || m.Replica == "" || m.Seq == 0 {
			if st.Received != 0 || st.Undecodable != 2 {
				t.Fatalf("undecodable message reached the sink: %+v", st)
			}
		}
	})
}

// syncMsgV1 and activeRequestV1 are the replica-sync message as peers
// before the sequence count (n > 1) encoded and decoded it: same keys,
// no "k".
type syncMsgV1 struct {
	Replica string            `msgpack:"r"`
	Epoch   uint64            `msgpack:"e"`
	Seq     uint64            `msgpack:"s"`
	Op      SyncOp            `msgpack:"op"`
	Request string            `msgpack:"q,omitempty"`
	Worker  router.WorkerID   `msgpack:"w,omitempty"`
	Hashes  []uint64          `msgpack:"h,omitempty"`
	ISL     int               `msgpack:"n,omitempty"`
	Overlap int               `msgpack:"o,omitempty"`
	Full    []activeRequestV1 `msgpack:"f,omitempty"`
}

type activeRequestV1 struct {
	Request     string          `msgpack:"q"`
	Worker      router.WorkerID `msgpack:"w"`
	Hashes      []uint64        `msgpack:"h,omitempty"`
	ISL         int             `msgpack:"n,omitempty"`
	Overlap     int             `msgpack:"o,omitempty"`
	PrefillDone bool            `msgpack:"d,omitempty"`
}

// A request with n > 1 reaches peers as n sequences; old and new peers read
// each other's messages (an old peer books one sequence, as before); a count
// no replica sends is clamped.
func TestSyncSequences(t *testing.T) {
	// New → old: the old decoder skips the new key.
	msg := SyncMsg{Replica: "r1", Epoch: 3, Seq: 2, Op: SyncAdd, Request: "q", Worker: "w1", Hashes: []uint64{7, 8}, ISL: 40, Overlap: 1, Sequences: 3}
	data, err := msgpack.Marshal(&msg)
	if err != nil {
		t.Fatal(err)
	}
	var old syncMsgV1
	if err := msgpack.Unmarshal(data, &old); err != nil {
		t.Fatalf("old peer cannot decode a new add: %v", err)
	}
	if want := (syncMsgV1{Replica: "r1", Epoch: 3, Seq: 2, Op: SyncAdd, Request: "q", Worker: "w1", Hashes: []uint64{7, 8}, ISL: 40, Overlap: 1}); fmt.Sprint(old) != fmt.Sprint(want) {
		t.Fatalf("old peer read %+v, want %+v", old, want)
	}
	full := SyncMsg{Replica: "r1", Epoch: 3, Seq: 3, Op: SyncFull, Full: []ActiveRequest{{Request: "q", Worker: "w1", ISL: 40, Sequences: 3}}}
	if data, err = msgpack.Marshal(&full); err != nil {
		t.Fatal(err)
	}
	if err := msgpack.Unmarshal(data, &old); err != nil || len(old.Full) != 1 || old.Full[0].ISL != 40 {
		t.Fatalf("old peer read a new snapshot as %+v (%v)", old, err)
	}
	// Old → new: no key, Sequences 0 (one sequence).
	if data, err = msgpack.Marshal(&syncMsgV1{Replica: "r1", Epoch: 3, Seq: 2, Op: SyncAdd, Request: "q", Worker: "w1", ISL: 40}); err != nil {
		t.Fatal(err)
	}
	var back SyncMsg
	if err := decodeSync(data, &back); err != nil || back.Sequences != 0 || back.ISL != 40 || back.Request != "q" {
		t.Fatalf("new peer read an old add as %+v (%v)", back, err)
	}

	// What the sink books, message by message.
	cases := []struct {
		name string
		msg  SyncMsg
		want string
	}{
		{"add n=3", SyncMsg{Op: SyncAdd, Request: "a", Worker: "w1", Sequences: 3}, "[a@w1x3]"},
		{"add from an old peer", SyncMsg{Op: SyncAdd, Request: "a", Worker: "w1"}, "[a@w1]"},
		{"add, count beyond any n", SyncMsg{Op: SyncAdd, Request: "a", Worker: "w1", Sequences: 1 << 40}, "[a@w1x1024]"},
		{"add, negative count", SyncMsg{Op: SyncAdd, Request: "a", Worker: "w1", Sequences: -5}, "[a@w1]"},
		{"snapshot", SyncMsg{Op: SyncFull, Full: []ActiveRequest{{Request: "a", Worker: "w1", Sequences: 2}, {Request: "b", Worker: "w2", Sequences: 5000}}}, "[a@w1x2 b@w2x1024]"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			sink := newRecSink()
			s, err := NewSyncer(nil, SyncConfig{Replica: "me", Clock: newFakeClock(), Logger: testLogger(t)}, sink)
			if err != nil {
				t.Fatal(err)
			}
			m := c.msg
			m.Replica, m.Epoch, m.Seq = "r1", 1, 1
			data, err := msgpack.Marshal(&m)
			if err != nil {
				t.Fatal(err)
			}
			s.handle(&nats.Msg{Data: data})
			if got := sink.view("r1"); got != c.want {
				t.Fatalf("booked %s, want %s", got, c.want)
			}
		})
	}
}

// TestSyncLastReceived: the time of the newest message from another
// replica, for the decision log's sync age; none before the first.
func TestSyncLastReceived(t *testing.T) {
	s, err := NewSyncer(nil, SyncConfig{Replica: "me", Clock: newFakeClock(), Logger: testLogger(t)}, newRecSink())
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := s.LastReceived(); ok {
		t.Fatal("a time before any message")
	}
	t1 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	s.deliver(SyncMsg{Replica: "r1", Epoch: 7, Seq: 1, Op: SyncFull}, t1)
	s.deliver(SyncMsg{Replica: "r2", Epoch: 3, Seq: 1, Op: SyncFull}, t1.Add(time.Second))
	if got, ok := s.LastReceived(); !ok || !got.Equal(t1.Add(time.Second)) {
		t.Fatalf("last received %v %v, want %v", got, ok, t1.Add(time.Second))
	}
}

// loadSink books other replicas' requests into a router load view, as the
// replica does (cmd/kvrouter/internal/replica: AddRemote and friends).
type loadSink struct{ load *router.ActiveLoad }

func (s loadSink) id(replica, request string) string { return replica + "/" + request }

func (s loadSink) AddRemote(replica string, req ActiveRequest) {
	s.load.Add(router.Booking{ID: s.id(replica, req.Request), Origin: replica, Worker: req.Worker, Hashes: req.Hashes,
		PrefillTokens: req.ISL, PrefillDone: req.PrefillDone, Sequences: req.Sequences, Output: req.Progress()})
}
func (s loadSink) PrefillDoneRemote(replica, request string) {
	s.load.PrefillDone(s.id(replica, request))
}
func (s loadSink) OutputRemote(replica, request string, out router.OutputProgress) {
	s.load.SetOutput(s.id(replica, request), out)
}
func (s loadSink) FreeRemote(replica, request string) { s.load.Free(s.id(replica, request)) }
func (s loadSink) ReplaceReplica(replica string, active []ActiveRequest) {
	s.DropReplica(replica)
	for _, a := range active {
		s.AddRemote(replica, a)
	}
}
func (s loadSink) DropReplica(replica string) { s.load.DropOrigin(replica) }

// A peer's load view grows by the output blocks a replica announces
// (output-block tracking), keeps them across a snapshot and releases them
// with the request.
func TestBusReplicaSyncOutputBlocks(t *testing.T) {
	for _, m := range bothModes(t) {
		t.Run(m.name, func(t *testing.T) { testBusReplicaSyncOutputBlocks(t, m) })
	}
}

func testBusReplicaSyncOutputBlocks(t *testing.T, m busMode) {
	log := testLogger(t)
	srv := startSingleMode(t, log, m)
	ncA, _ := m.replica(t, srv.ClientURL(), "r1", log)
	ncB, _ := m.replica(t, srv.ClientURL(), "r2", log)
	peer := loadSink{load: router.NewActiveLoad(0)}
	a, _ := startSyncer(t, ncA, "r1", newFakeClock(), newRecSink())
	b, _ := startSyncer(t, ncB, "r2", newFakeClock(), peer)
	poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
		a.publishFull()
		b.publishFull()
		if a.Stats().Replicas != 1 || b.Stats().Replicas != 1 {
			return fmt.Errorf("a %+v b %+v", a.Stats(), b.Stats())
		}
		return nil
	})
	blocksBecome := func(want int) {
		t.Helper()
		poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
			if got := peer.load.Load("w1").ActiveBlocks; got != want {
				return fmt.Errorf("peer sees %d active blocks on w1, want %d", got, want)
			}
			return nil
		})
	}
	if err := a.Add(ActiveRequest{Request: "q", Worker: "w1", Hashes: []uint64{1, 2}, ISL: 40}); err != nil {
		t.Fatal(err)
	}
	blocksBecome(2)
	// What router.Router.Generated reports for a 40-token prompt, block
	// size 16, expected output 640: blocks at 9, 25 and 41 tokens.
	for _, o := range []router.OutputProgress{{Blocks: 1, Generated: 9, Expected: 640}, {Blocks: 2, Generated: 25, Expected: 640},
		{Blocks: 3, Generated: 41, Expected: 640}} {
		if err := a.Output("q", o); err != nil {
			t.Fatal(err)
		}
	}
	blocksBecome(5) // 5 × (1 − 41/640) = 4.68 → 5
	if got := a.Active(); len(got) != 1 || got[0].Progress() != (router.OutputProgress{Blocks: 3, Generated: 41, Expected: 640}) || !got[0].PrefillDone {
		t.Fatalf("A's active set %+v", got)
	}
	// A snapshot replaces the peer's view of r1 and keeps the progress.
	a.publishFull()
	poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
		if bs := peer.load.Bookings("r1"); len(bs) != 1 || bs[0].Output.Blocks != 3 {
			return fmt.Errorf("peer's bookings of r1 %+v", bs)
		}
		return nil
	})
	blocksBecome(5)
	if err := a.Free("q"); err != nil {
		t.Fatal(err)
	}
	blocksBecome(0)
}

// Output progress rides on SyncPrefillDone under new keys: an older peer
// decodes it as the prefill-done it was, a message from an older peer
// carries no output, and values no replica sends are clamped.
func TestSyncOutputCompat(t *testing.T) {
	msg := SyncMsg{Replica: "r1", Epoch: 3, Seq: 2, Op: SyncPrefillDone, Request: "q", OutputBlocks: 2, Generated: 25, ExpectedOutput: 64}
	data, err := msgpack.Marshal(&msg)
	if err != nil {
		t.Fatal(err)
	}
	var old syncMsgV1
	if err := msgpack.Unmarshal(data, &old); err != nil || old.Op != SyncPrefillDone || old.Request != "q" {
		t.Fatalf("old peer read a progress message as %+v (%v)", old, err)
	}
	full := SyncMsg{Replica: "r1", Epoch: 3, Seq: 3, Op: SyncFull, Full: []ActiveRequest{{Request: "q", Worker: "w1", ISL: 40, OutputBlocks: 2}}}
	if data, err = msgpack.Marshal(&full); err != nil {
		t.Fatal(err)
	}
	if err := msgpack.Unmarshal(data, &old); err != nil || len(old.Full) != 1 || old.Full[0].ISL != 40 {
		t.Fatalf("old peer read a snapshot with progress as %+v (%v)", old, err)
	}
	if data, err = msgpack.Marshal(&syncMsgV1{Replica: "r1", Epoch: 3, Seq: 2, Op: SyncPrefillDone, Request: "q"}); err != nil {
		t.Fatal(err)
	}
	var back SyncMsg
	if err := decodeSync(data, &back); err != nil || back.OutputBlocks != 0 || back.Generated != 0 || back.ExpectedOutput != 0 {
		t.Fatalf("new peer read an old prefill-done as %+v (%v)", back, err)
	}

	cases := []struct {
		name string
		msgs []SyncMsg
		want router.OutputProgress
	}{
		{"prefill done without output", []SyncMsg{{Op: SyncPrefillDone, Request: "a"}}, router.OutputProgress{}},
		{"progress", []SyncMsg{{Op: SyncPrefillDone, Request: "a", OutputBlocks: 2, Generated: 25, ExpectedOutput: 64}},
			router.OutputProgress{Blocks: 2, Generated: 25, Expected: 64}},
		{"stale progress after newer", []SyncMsg{{Op: SyncPrefillDone, Request: "a", OutputBlocks: 3, Generated: 41},
			{Op: SyncPrefillDone, Request: "a", OutputBlocks: 1, Generated: 9}}, router.OutputProgress{Blocks: 3, Generated: 41}},
		{"beyond any context", []SyncMsg{{Op: SyncPrefillDone, Request: "a", OutputBlocks: 1 << 40, Generated: -4, ExpectedOutput: 1 << 50}},
			router.OutputProgress{Blocks: MaxSyncOutputBlocks, Expected: MaxSyncOutputTokens}},
		{"snapshot", []SyncMsg{{Op: SyncFull, Full: []ActiveRequest{{Request: "a", Worker: "w1", OutputBlocks: -3, Generated: 7, ExpectedOutput: 9}}}},
			router.OutputProgress{Generated: 7, Expected: 9}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			sink := newRecSink()
			s, err := NewSyncer(nil, SyncConfig{Replica: "me", Clock: newFakeClock(), Logger: testLogger(t)}, sink)
			if err != nil {
				t.Fatal(err)
			}
			msgs := append([]SyncMsg{{Op: SyncAdd, Request: "a", Worker: "w1"}}, c.msgs...)
			for i, m := range msgs {
				m.Replica, m.Epoch, m.Seq = "r1", 1, uint64(i+1)
				s.deliver(m, time.Unix(0, 0))
			}
			sink.mu.Lock()
			got := sink.active["r1"]["a"].Progress()
			sink.mu.Unlock()
			if got != c.want {
				t.Fatalf("peer holds %+v, want %+v", got, c.want)
			}
		})
	}
}
