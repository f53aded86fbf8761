package eventbus

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/eventbus/internal/bustest"
	"github.com/kvrouter/kvrouter/internal/poll"
)

// testLogger writes slog lines into t.Log (shown only on failure).
func testLogger(t testing.TB) *slog.Logger { return bustest.Logger(t) }

// freePort reserves a port by listening on :0 and closing it.
func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return port
}

// startSingle starts an insecure single server (the tests that are about
// the stream, not about security).
func startSingle(t testing.TB, log *slog.Logger) *Server {
	return startSingleMode(t, log, insecureMode)
}

func startSingleMode(t testing.TB, log *slog.Logger, m busMode) *Server {
	t.Helper()
	s, err := StartServer(ServerConfig{Name: "single", StoreDir: t.TempDir(), Logger: log, Security: m.security(t, "single")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Shutdown)
	return s
}

// startCluster starts n insecure clustered servers on pre-allocated ports,
// each with its own store directory and logger.
func startCluster(t testing.TB, n int) []*Server { return startClusterMode(t, n, insecureMode) }

func startClusterMode(t testing.TB, n int, m busMode) []*Server {
	t.Helper()
	cports := make([]int, n)
	routes := make([]string, n)
	for i := range cports {
		cports[i] = freePort(t)
		routes[i] = fmt.Sprintf("nats-route://127.0.0.1:%d", cports[i])
	}
	servers := make([]*Server, n)
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			name := fmt.Sprintf("n%d", i+1)
			servers[i], errs[i] = StartServer(ServerConfig{
				Name: name, Port: freePort(t),
				ClusterName: "kvtest", ClusterPort: cports[i], Routes: routes,
				StoreDir: t.TempDir(), Logger: testLogger(t).With("node", name),
				Security: m.security(t, name),
			})
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("server %d: %v", i+1, err)
		}
		t.Cleanup(servers[i].Shutdown)
	}
	poll.Until(t, 20*time.Second, 20*time.Millisecond, func() error {
		for _, s := range servers {
			if got := s.NATS().NumRoutes(); got < n-1 {
				return fmt.Errorf("%s has %d routes", s.Name(), got)
			}
		}
		return nil
	})
	return servers
}

// connect opens a plain connection: a replica's on an insecure server.
func connect(t testing.TB, url, name string, log *slog.Logger) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	return connectWith(t, url, name, log)
}

func connectWith(t testing.TB, url, name string, log *slog.Logger, opts ...ConnectOption) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := Connect(url, name, log, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

func ensureStream(t testing.TB, js jetstream.JetStream, replicas int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := EnsureStream(ctx, js, StreamOptions{Replicas: replicas}); err != nil {
		t.Fatal(err)
	}
}

// fakeApplier models the state machine's idempotence: per worker rank a
// cursor; an event at or below it is a duplicate and skipped, the next one is
// applied, a later one is applied too but recorded as a gap. fail, when set,
// may refuse a whole batch first.
type fakeApplier struct {
	mu      sync.Mutex
	count   map[string]int    // msg id → times applied
	cursor  map[string]uint64 // worker key → last applied event id
	gaps    []string
	dups    int
	total   int
	batches int
	fail    func(batch []WireEvent) error
}

func newFakeApplier() *fakeApplier {
	return &fakeApplier{count: map[string]int{}, cursor: map[string]uint64{}}
}

func (a *fakeApplier) ApplyEvents(_ context.Context, events []WireEvent) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.fail != nil {
		if err := a.fail(events); err != nil {
			return err
		}
	}
	a.batches++
	for i := range events {
		ev := &events[i]
		// Dedupe by message id, not by a cursor: this layer promises every
		// acknowledged event is delivered (at least once); the order can
		// break when a stream server is lost mid-publish (a re-sent event
		// lands behind later ones). Reordering is recorded, and the state
		// machine's gap rule (stale, then resync) is what repairs it.
		k := string(ev.WorkerID())
		if a.count[ev.MsgID()] > 0 {
			a.dups++
			continue
		}
		if cur := a.cursor[k]; ev.EventID != cur+1 {
			a.gaps = append(a.gaps, fmt.Sprintf("%s: %d after %d", k, ev.EventID, cur))
		}
		a.cursor[k] = max(a.cursor[k], ev.EventID)
		a.count[ev.MsgID()]++
		a.total++
	}
	return nil
}

func (a *fakeApplier) applied() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.total
}

// check: every id in want applied exactly once, nothing else, no gaps (so
// in order); duplicate deliveries only if allowDups.
func (a *fakeApplier) check(t testing.TB, want []string, allowDups bool) {
	t.Helper()
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, id := range want {
		if a.count[id] != 1 {
			t.Errorf("event %s applied %d times, want 1", id, a.count[id])
		}
	}
	if len(a.count) != len(want) {
		t.Errorf("%d distinct events applied, want %d", len(a.count), len(want))
	}
	if len(a.gaps) > 0 {
		if !allowDups {
			t.Errorf("events applied out of order: %v", a.gaps)
		}
		t.Logf("events delivered out of order (a server was lost mid-publish): %v", a.gaps)
	}
	if a.dups > 0 {
		if !allowDups {
			t.Errorf("%d duplicate deliveries", a.dups)
		}
		t.Logf("%d duplicate deliveries skipped", a.dups)
	}
}

// runConsumer runs c until the test ends (or the returned cancel).
func runConsumer(t testing.TB, c *Consumer, a Applier) (cancel func()) {
	t.Helper()
	ctx, cancelCtx := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx, a) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancelCtx()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("consumer run: %v", err)
				}
			case <-time.After(10 * time.Second):
				t.Errorf("consumer did not stop")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// ackLedger collects publisher acks.
type ackLedger struct {
	mu    sync.Mutex
	acked []string
	seq   map[string]uint64 // msg id → stream sequence
	dups  int
	errs  []error
}

func (l *ackLedger) onAck(worker string, dp uint32) func(PublishAck) {
	return func(a PublishAck) {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.acked = append(l.acked, MsgID(worker, dp, a.EventID))
		if l.seq == nil {
			l.seq = map[string]uint64{}
		}
		l.seq[MsgID(worker, dp, a.EventID)] = a.Sequence
		if a.Duplicate {
			l.dups++
		}
	}
}

func (l *ackLedger) onError(_ uint64, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errs = append(l.errs, err)
}

// outOfOrder lists events the stream stored after a later event of the
// same publisher (acks arrive in publish order).
func (l *ackLedger) outOfOrder() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	last := map[string]uint64{}
	for _, id := range l.acked {
		w := id[:strings.LastIndexByte(id, ':')]
		if l.seq[id] < last[w] {
			out = append(out, fmt.Sprintf("%s@%d<%d", id, l.seq[id], last[w]))
		}
		last[w] = max(last[w], l.seq[id])
	}
	return out
}

func (l *ackLedger) ids() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.acked...)
}

func counterValue(t testing.TB, c prometheus.Collector) float64 {
	t.Helper()
	ch := make(chan prometheus.Metric, 64)
	c.Collect(ch)
	close(ch)
	var sum float64
	for m := range ch {
		var d dto.Metric
		if err := m.Write(&d); err != nil {
			t.Fatal(err)
		}
		switch {
		case d.Counter != nil:
			sum += d.Counter.GetValue()
		case d.Histogram != nil:
			sum += float64(d.Histogram.GetSampleCount())
		}
	}
	return sum
}

func rejected(t testing.TB, c *Consumer, r Reason) float64 {
	return counterValue(t, c.Metrics().Rejected.WithLabelValues(string(r)))
}

func storedEvent(id uint64, blocks ...uint64) WireEvent {
	ev := WireEvent{EventID: id, Kind: KindStored, BlockSize: 16}
	for _, b := range blocks {
		ev.Blocks = append(ev.Blocks, WireBlock{Engine: b, Content: b * 31})
	}
	if len(blocks) > 0 && id > 1 {
		ev.HasParent, ev.Parent = true, blocks[0]-1
	}
	return ev
}

func mustEncode(t testing.TB, ev WireEvent) []byte {
	t.Helper()
	b, err := Encode(&ev)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
