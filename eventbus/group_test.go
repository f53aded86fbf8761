package eventbus

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/internal/poll"
)

func TestBusGroupStreamSubjects(t *testing.T) {
	cases := []struct {
		name    string
		group   int
		workers []string
		want    []string
	}{
		{"no workers", 1, nil, []string{"kv.unplaced.g1"}},
		{"empty list", 7, []string{}, []string{"kv.unplaced.g7"}},
		{"one", 2, []string{"w1"}, []string{"kv.events.w1"}},
		{"sorted", 2, []string{"w3", "w1", "w2"}, []string{"kv.events.w1", "kv.events.w2", "kv.events.w3"}},
		{"duplicates", 3, []string{"b", "a", "b", "a"}, []string{"kv.events.a", "kv.events.b"}},
		// Escaped names stay distinct subjects (SubjectToken is injective).
		{"escaped", 4, []string{"a.b", "a_b", "a b"}, []string{"kv.events.a_b", "kv.events.a~20b", "kv.events.a~2Eb"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			in := slices.Clone(tc.workers)
			got := GroupStreamSubjects(tc.group, tc.workers)
			if !slices.Equal(got, tc.want) {
				t.Errorf("GroupStreamSubjects(%d, %q) = %q, want %q", tc.group, tc.workers, got, tc.want)
			}
			if !slices.Equal(in, tc.workers) {
				t.Errorf("the workers slice was modified: %q", tc.workers)
			}
		})
	}
	for _, g := range []struct {
		group int
		want  string
	}{{1, "KV_EVENTS_G1"}, {12, "KV_EVENTS_G12"}} {
		if got := GroupStreamName(g.group); got != g.want {
			t.Errorf("GroupStreamName(%d) = %q, want %q", g.group, got, g.want)
		}
	}
}

func TestBusStreamConfigNameSubjects(t *testing.T) {
	def := StreamConfig(StreamOptions{})
	if def.Name != StreamName || !slices.Equal(def.Subjects, []string{EventSubjects}) {
		t.Fatalf("default stream %s %q, want %s [%s]", def.Name, def.Subjects, StreamName, EventSubjects)
	}
	subjects := GroupStreamSubjects(2, []string{"w1", "w2"})
	cfg := StreamConfig(StreamOptions{Name: GroupStreamName(2), Subjects: subjects})
	subjects[0] = "changed"
	if cfg.Name != "KV_EVENTS_G2" || !slices.Equal(cfg.Subjects, []string{"kv.events.w1", "kv.events.w2"}) {
		t.Fatalf("group stream %s %q", cfg.Name, cfg.Subjects)
	}
}

// streamLog records what one stream's consumer applied, in order. While
// gated it refuses every batch (as a replica that lost its quorum would),
// so events stay pending in the stream.
type streamLog struct {
	mu    sync.Mutex
	order []WireEvent    // applied, in apply order
	count map[string]int // msg id → times applied
	gated bool
}

func newStreamLog() *streamLog { return &streamLog{count: map[string]int{}} }

func (l *streamLog) ApplyEvents(_ context.Context, events []WireEvent) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.gated {
		return errors.New("gated")
	}
	for _, ev := range events {
		l.order = append(l.order, ev)
		l.count[ev.MsgID()]++
	}
	return nil
}

func (l *streamLog) setGate(on bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.gated = on
}

// distinct counts the distinct events applied.
func (l *streamLog) distinct() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.count)
}

// of counts the applied events of worker.
func (l *streamLog) of(worker string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, ev := range l.order {
		if ev.Worker == worker {
			n++
		}
	}
	return n
}

// outOfOrder lists the events applied after a higher id of their worker.
func (l *streamLog) outOfOrder() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	last := map[string]uint64{}
	for _, ev := range l.order {
		if ev.EventID <= last[ev.Worker] {
			out = append(out, fmt.Sprintf("%s after %d", ev.MsgID(), last[ev.Worker]))
		}
		last[ev.Worker] = ev.EventID
	}
	return out
}

// streamAcks records publisher acks with the stream that stored each.
type streamAcks struct {
	mu     sync.Mutex
	stream map[string]string // msg id → stream
	errs   []error
}

func (a *streamAcks) onAck(worker string) func(PublishAck) {
	return func(p PublishAck) {
		a.mu.Lock()
		defer a.mu.Unlock()
		a.stream[MsgID(worker, 0, p.EventID)] = p.Stream
	}
}

func (a *streamAcks) onError(id uint64, err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.errs = append(a.errs, fmt.Errorf("event %d: %w", id, err))
}

// publishLoop publishes worker's events until stop is closed, then flushes
// and closes; it returns the publisher (for its stats) and a channel closed
// when it is done.
func publishLoop(t *testing.T, nc *nats.Conn, worker string, acks *streamAcks, stop <-chan struct{}) (*Publisher, <-chan struct{}) {
	t.Helper()
	p, err := NewPublisher(nc, worker, 0, WithOnAck(acks.onAck(worker)), WithOnError(acks.onError),
		WithPublisherLogger(testLogger(t)), WithWindow(32))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer p.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		for i := uint64(1); ; i++ {
			select {
			case <-stop:
				if err := p.Flush(ctx); err != nil {
					t.Errorf("flush %s: %v", worker, err)
				}
				return
			default:
			}
			if _, err := p.PublishAsync(ctx, storedEvent(0, i)); err != nil {
				t.Errorf("publish %s: %v", worker, err)
				return
			}
		}
	}()
	return p, done
}

func ensureGroupStream(t *testing.T, js jetstream.JetStream, group int, workers ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := EnsureStream(ctx, js, StreamOptions{Name: GroupStreamName(group), Subjects: GroupStreamSubjects(group, workers)}); err != nil {
		t.Fatal(err)
	}
}

func groupConsumer(t *testing.T, js jetstream.JetStream, group int, reg prometheus.Registerer) *Consumer {
	t.Helper()
	c, err := NewConsumer(context.Background(), js, ConsumerConfig{
		Stream: GroupStreamName(group), Logger: testLogger(t).With("group", group),
		Registerer: reg, ConstLabels: prometheus.Labels{"group": fmt.Sprint(group)},
	})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func subjectMsgs(t *testing.T, js jetstream.JetStream, stream, subject string) uint64 {
	t.Helper()
	st, err := js.Stream(context.Background(), stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(context.Background(), jetstream.WithSubjectFilter(subject))
	if err != nil {
		t.Fatal(err)
	}
	return info.State.Subjects[subject]
}

// Two group streams with disjoint subject lists each hold only their
// workers' events; an empty group's stream (placeholder subject) takes a
// consumer; overlapping subjects are refused.
func TestBusGroupStreamsDisjoint(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	nc, js := connect(t, s.ClientURL(), "groups", log)
	ensureGroupStream(t, js, 1, "w1", "w2")
	ensureGroupStream(t, js, 2, "w3")
	ensureGroupStream(t, js, 3) // no workers yet
	ensureGroupStream(t, js, 3) // idempotent

	ctx := context.Background()
	for _, o := range []StreamOptions{
		{Name: GroupStreamName(3), Subjects: GroupStreamSubjects(3, []string{"w1"})}, // w1 is group 1's
		{}, // KV_EVENTS (kv.events.>) overlaps every group stream
	} {
		if _, err := EnsureStream(ctx, js, o); !errors.Is(err, ErrSubjectsOverlap) {
			t.Errorf("EnsureStream(%s %q): %v, want ErrSubjectsOverlap", o.Name, o.Subjects, err)
		}
	}

	reg := prometheus.NewRegistry()
	logs := map[int]*streamLog{}
	var stops []func()
	for g := 1; g <= 3; g++ {
		logs[g] = newStreamLog()
		stops = append(stops, runConsumer(t, groupConsumer(t, js, g, reg), logs[g]))
	}
	ids := publishN(t, nc, []string{"w1", "w2", "w3"}, 200)
	poll.Until(t, 30*time.Second, 10*time.Millisecond, func() error {
		if n := logs[1].distinct() + logs[2].distinct(); n < len(ids) {
			return fmt.Errorf("%d of %d events applied", n, len(ids))
		}
		return nil
	})
	for _, stop := range stops {
		stop() // the logs are read unlocked below
	}
	want := map[string]int{"w1": 1, "w2": 1, "w3": 2}
	for g := 1; g <= 3; g++ {
		l := logs[g]
		for id, n := range l.count {
			w, _, _ := strings.Cut(id, ":")
			if want[w] != g || n != 1 {
				t.Errorf("group %d applied %s %d times (its worker belongs to group %d)", g, id, n, want[w])
			}
		}
		if ooo := l.outOfOrder(); len(ooo) > 0 {
			t.Errorf("group %d out of order: %v", g, ooo)
		}
	}
	for _, id := range ids {
		if n := logs[1].count[id] + logs[2].count[id]; n != 1 {
			t.Errorf("acked event %s applied %d times", id, n)
		}
	}
	if got := len(logs[1].count) + len(logs[2].count) + len(logs[3].count); got != len(ids) {
		t.Errorf("%d distinct events applied, %d acked", got, len(ids))
	}
}

// Moving worker w from group 1's stream to group 2's while w's publisher
// keeps publishing, stream 1 holds w's events that are not consumed yet,
// and the consumers of both streams run: remove w's subject from stream 1,
// then add it to stream 2 (the other order is refused). Every acked event
// is applied once, by the consumer of the stream that acked it, each
// stream's in event-id order; the events published in the gap are
// re-sent by the publisher and land in stream 2.
func TestBusGroupStreamMove(t *testing.T) {
	log := testLogger(t)
	s := startSingle(t, log)
	_, js := connect(t, s.ClientURL(), "replica", log)
	pnc, _ := connect(t, s.ClientURL(), "worker", log)
	const w, x = "w", "x" // w moves; x stays in group 1
	ensureGroupStream(t, js, 1, w, x)
	ensureGroupStream(t, js, 2)

	reg := prometheus.NewRegistry()
	log1, log2 := newStreamLog(), newStreamLog()
	stop1 := runConsumer(t, groupConsumer(t, js, 1, reg), log1)
	stop2 := runConsumer(t, groupConsumer(t, js, 2, reg), log2)

	acks := &streamAcks{stream: map[string]string{}}
	stop := make(chan struct{})
	pw, wDone := publishLoop(t, pnc, w, acks, stop)
	_, xDone := publishLoop(t, pnc, x, acks, stop)
	stopped := false
	defer func() {
		if !stopped {
			close(stop)
			<-wDone
			<-xDone
		}
	}()

	waitFor := func(what string, cond func() bool) {
		t.Helper()
		poll.Until(t, 30*time.Second, 5*time.Millisecond, func() error {
			if !cond() {
				return errors.New(what)
			}
			return nil
		})
	}
	ctx := context.Background()
	s1, s2 := GroupStreamName(1), GroupStreamName(2)
	waitFor("w's events applied from stream 1", func() bool { return log1.of(w) >= 100 })

	// Stream 1's consumer stops committing, so w's events pile up there.
	log1.setGate(true)
	waitFor("w's events pending in stream 1", func() bool { return subjectMsgs(t, js, s1, EventSubject(w)) >= 20 })

	// Add before remove: refused, the two lists would overlap.
	if _, err := EnsureStream(ctx, js, StreamOptions{Name: s2, Subjects: GroupStreamSubjects(2, []string{w})}); !errors.Is(err, ErrSubjectsOverlap) {
		t.Fatalf("adding w to stream 2 while stream 1 has it: %v, want ErrSubjectsOverlap", err)
	}

	retries := pw.Stats().Retries
	ensureGroupStream(t, js, 1, x) // remove w: its events now find no stream
	pending := subjectMsgs(t, js, s1, EventSubject(w))
	if pending == 0 {
		t.Fatal("w's pending events left stream 1 with its subject")
	}
	// The gap: w's publisher gets no responders and re-sends. Once it does,
	// it sends nothing new until its in-flight events are resolved; the
	// flush (a PING) makes sure every first send before that was processed
	// by the server, so none can reach stream 2 behind a re-send.
	waitFor("w's publisher re-sending", func() bool { return pw.Stats().Retries > retries })
	if err := pnc.Flush(); err != nil {
		t.Fatal(err)
	}
	ensureGroupStream(t, js, 2, w) // add w
	log1.setGate(false)

	waitFor("w's events applied from stream 2", func() bool { return log2.of(w) >= 100 })
	close(stop)
	<-wDone
	<-xDone
	stopped = true

	acks.mu.Lock()
	defer acks.mu.Unlock()
	if len(acks.errs) > 0 {
		t.Fatalf("publish errors: %v", acks.errs)
	}
	waitFor("every acked event applied", func() bool { return log1.distinct()+log2.distinct() >= len(acks.stream) })
	stop1() // the logs are read unlocked below
	stop2()
	logs := map[string]*streamLog{s1: log1, s2: log2}
	for id, stream := range acks.stream {
		n1, n2 := log1.count[id], log2.count[id]
		if n1+n2 != 1 || logs[stream].count[id] != 1 {
			t.Errorf("event %s acked by %s: applied %d times from stream 1, %d from stream 2", id, stream, n1, n2)
		}
	}
	if got := len(log1.count) + len(log2.count); got != len(acks.stream) {
		t.Errorf("%d distinct events applied, %d acked", got, len(acks.stream))
	}
	for name, l := range logs {
		if ooo := l.outOfOrder(); len(ooo) > 0 {
			t.Errorf("%s applied out of event-id order: %v", name, ooo)
		}
	}
	// w's events are numbered from 1 without holes (none lost in the gap).
	for id := uint64(1); ; id++ {
		if _, ok := acks.stream[MsgID(w, 0, id)]; !ok {
			if int(id-1) != log1.of(w)+log2.of(w) {
				t.Errorf("w: ids 1..%d acked, %d applied", id-1, log1.of(w)+log2.of(w))
			}
			break
		}
	}
	if log2.of(x) != 0 {
		t.Errorf("x (group 1) applied from stream 2: %d events", log2.of(x))
	}
	if st := pw.Stats(); st.Retries == 0 || st.Failed != 0 {
		t.Errorf("w's publisher: %+v, want re-sends and no failures", st)
	}
	t.Logf("moved w: %d of its events applied from stream 1 (%d pending at the move), %d from stream 2; %d re-sends",
		log1.of(w), pending, log2.of(w), pw.Stats().Retries)

	// One registry, one series per group.
	for g, l := range map[string]*streamLog{"1": log1, "2": log2} {
		if got := gathered(t, reg, "kvrouter_eventbus_events_applied_total", "group", g); got != float64(len(l.order)) {
			t.Errorf("events_applied_total{group=%q} = %v, want %d", g, got, len(l.order))
		}
	}
	for _, name := range []string{s1, s2} {
		waitFor(name+" empty", func() bool {
			st, err := js.Stream(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			info, err := st.Info(ctx)
			return err == nil && info.State.Msgs == 0
		})
	}
}

// gathered is the value of the counter name whose label has value.
func gathered(t *testing.T, g prometheus.Gatherer, name, label, value string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == label && lp.GetValue() == value {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	t.Fatalf("no %s{%s=%q}", name, label, value)
	return 0
}

// The consumer's metric names, pinned: dashboards depend on them.
var consumerMetricNames = []string{
	"kvrouter_eventbus_ack_errors_total",
	"kvrouter_eventbus_apply_errors_total",
	"kvrouter_eventbus_batch_seconds",
	"kvrouter_eventbus_batches_total",
	"kvrouter_eventbus_delivery_gaps_total",
	"kvrouter_eventbus_events_applied_total",
	"kvrouter_eventbus_events_rejected_total",
	"kvrouter_eventbus_fetch_errors_total",
	"kvrouter_eventbus_split_batches_total",
}

// Several consumers' metrics in one registry: without ConstLabels names and
// labels are as always and consumers share the series; with them each has
// its own; mixing label names is refused rather than silently unregistered.
func TestBusConsumerMetricsRegistry(t *testing.T) {
	g1, g2 := prometheus.Labels{"group": "1"}, prometheus.Labels{"group": "2"}
	cases := []struct {
		name   string
		labels []prometheus.Labels // one consumer each, in order
		err    bool                // the last registration fails
		series int                 // series of batches_total
		labelz []string            // label names of batches_total
	}{
		{"one, no labels", []prometheus.Labels{nil}, false, 1, nil},
		{"two, no labels: shared", []prometheus.Labels{nil, nil}, false, 1, nil},
		{"two groups", []prometheus.Labels{g1, g2}, false, 2, []string{"group"}},
		{"same group twice: shared", []prometheus.Labels{g1, g1}, false, 1, []string{"group"}},
		{"no labels, then a group", []prometheus.Labels{nil, g1}, true, 1, nil},
		{"a group, then no labels", []prometheus.Labels{g2, nil}, true, 1, []string{"group"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			reg := prometheus.NewRegistry()
			var ms []*ConsumerMetrics
			for i, l := range tc.labels {
				m, err := newConsumerMetrics(reg, l)
				if last := i == len(tc.labels)-1; err != nil != (last && tc.err) {
					t.Fatalf("consumer %d (%v): err %v", i, l, err)
				}
				if err == nil {
					ms = append(ms, m)
				}
			}
			for i, m := range ms {
				m.Batches.Add(float64(i + 1))
			}
			mfs, err := reg.Gather()
			if err != nil {
				t.Fatal(err)
			}
			var names []string
			for _, mf := range mfs {
				names = append(names, mf.GetName())
				if mf.GetName() != "kvrouter_eventbus_batches_total" {
					continue
				}
				if len(mf.GetMetric()) != tc.series {
					t.Errorf("batches_total: %d series, want %d", len(mf.GetMetric()), tc.series)
				}
				var sum float64
				for _, m := range mf.GetMetric() {
					sum += m.GetCounter().GetValue()
					if got := labelNames(m); !slices.Equal(got, tc.labelz) {
						t.Errorf("batches_total labels %q, want %q", got, tc.labelz)
					}
				}
				if want := float64(len(ms) * (len(ms) + 1) / 2); sum != want {
					t.Errorf("batches_total sums to %v, want %v (an increment went to an unregistered metric)", sum, want)
				}
			}
			if !slices.Equal(names, consumerMetricNames) {
				t.Errorf("metric names %q, want %q", names, consumerMetricNames)
			}
			if tc.labelz == nil {
				for _, mf := range mfs {
					if mf.GetName() != "kvrouter_eventbus_events_rejected_total" {
						continue
					}
					for _, m := range mf.GetMetric() {
						if got := labelNames(m); !slices.Equal(got, []string{"reason"}) {
							t.Errorf("events_rejected_total labels %q, want [reason]", got)
						}
					}
				}
			}
		})
	}
}

func labelNames(m *dto.Metric) []string {
	var out []string
	for _, lp := range m.GetLabel() {
		out = append(out, lp.GetName())
	}
	return out
}
