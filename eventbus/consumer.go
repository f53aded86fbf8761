package eventbus

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/router"
)

// Applier commits a batch of valid events, in stream order. The cluster
// implements it with one raft.Apply of a batch command (ConsumerConfig's
// EntryBytes and MaxEntryBytes bound its size: a larger fetched batch
// comes as several calls, in order). nil means committed
// (the messages are acked after it returns); any error means "not committed
// or unknown" (ErrLeadershipLost, a timeout): nothing is acked and the
// events come back, so applying must be idempotent per
// (worker, dp_rank, event_id).
type Applier interface {
	ApplyEvents(ctx context.Context, events []WireEvent) error
}

// ApplierFunc adapts a function to Applier.
type ApplierFunc func(ctx context.Context, events []WireEvent) error

// ApplyEvents calls f.
func (f ApplierFunc) ApplyEvents(ctx context.Context, events []WireEvent) error {
	return f(ctx, events)
}

// Validator checks an event's worker against the replicated registry before
// it is proposed. worker is the router's id (router.WorkerKey of the event's
// worker and dp rank); blockSize is the stored event's block size (0 = not
// reported, and always 0 for removed and cleared events). Errors wrapping
// router.ErrUnknownWorker or router.ErrBlockSizeMismatch are counted under
// their own reasons; any other error as "rejected".
type Validator interface {
	CheckWorker(worker string, blockSize int) error
}

// Rejection describes one event the consumer terminated.
type Rejection struct {
	Reason    Reason
	Err       error
	Subject   string
	StreamSeq uint64
	Event     *WireEvent // nil when undecodable
}

// ConsumerConfig configures the leader's consumer. Zero fields take the
// defaults.
type ConsumerConfig struct {
	// Stream is the stream consumed (default KV_EVENTS; a data group's is
	// GroupStreamName(k)). Everything the consumer asks of JetStream names
	// this stream.
	Stream  string
	Durable string // default "kv-apply"

	MaxBatch  int           // messages per batch (default 1024)
	BatchWait time.Duration // how long a batch collects after its first message (default 5ms)
	IdleWait  time.Duration // one long poll while the stream is empty (default 1s)

	AckWait       time.Duration // redelivery after this without an ack (default 10s)
	MaxAckPending int           // default 65536
	// FileState keeps the durable's state (deliveries, acks) in files, as
	// builds before issue 31 item 3 did, instead of in memory
	// (DurableConfig): for a rolling upgrade from such a build, whose
	// leaders fail to update a durable whose state is in memory. Changing
	// it re-creates the durable (replaceOtherStorage).
	FileState bool

	// RetryBackoff is the first pause after a failed apply or fetch; it
	// doubles up to 1s (default 50ms).
	RetryBackoff time.Duration

	MaxBlocks int       // Validate's cap (default DefaultMaxBlocks)
	Validator Validator // optional

	// EntryBytes and MaxEntryBytes bound what one ApplyEvents call
	// carries, so that one Raft entry stays bounded in bytes: the valid
	// events of a fetched batch go to the applier in consecutive runs whose
	// EntryBytes add up to at most MaxEntryBytes, each run acked once it is
	// committed, the next applied only then. An event whose EntryBytes
	// alone exceed MaxEntryBytes could never be committed: it is refused
	// (ReasonTooLarge). EntryBytes must bound from above what an event adds
	// to the applier's entry (the applier's fixed overhead left out of
	// MaxEntryBytes). Either unset: one call per fetched batch.
	EntryBytes    func(*WireEvent) int
	MaxEntryBytes int
	// SpreadFrom, if set, is the NATS server name of the replica running
	// the consumer (the Raft group's leader): Run moves the stream's and the
	// consumer's NATS leadership off it, onto the other servers (leaders.go),
	// when it starts and then every SpreadEvery (default 30s). Empty: leave
	// NATS's leaders where they are (an external NATS, tests).
	SpreadFrom  string
	SpreadEvery time.Duration
	// OnReject, if set, sees every terminated event (the cluster may mark
	// its worker stale at once instead of waiting for the gap).
	OnReject func(Rejection)

	// Registerer receives the consumer's metrics (nil: not registered).
	// Consumers with equal ConstLabels on one registry share their metrics.
	Registerer prometheus.Registerer
	// ConstLabels are added to every metric the consumer registers, e.g.
	// {"group": "2"} for one consumer per data group in one process, so
	// each has its own series. Nil: names and labels as always. Consumers
	// on one registry must all set the same label names (Prometheus refuses
	// a name registered with different label names: NewConsumer fails).
	ConstLabels prometheus.Labels
	Logger      *slog.Logger
}

func (c ConsumerConfig) withDefaults() ConsumerConfig {
	if c.Stream == "" {
		c.Stream = StreamName
	}
	if c.Durable == "" {
		c.Durable = DefaultDurable
	}
	if c.MaxBatch <= 0 {
		c.MaxBatch = 1024
	}
	if c.BatchWait <= 0 {
		c.BatchWait = 5 * time.Millisecond
	}
	if c.IdleWait <= 0 {
		c.IdleWait = time.Second
	}
	if c.AckWait <= 0 {
		c.AckWait = 10 * time.Second
	}
	if c.MaxAckPending <= 0 {
		c.MaxAckPending = 65536
	}
	if c.SpreadEvery <= 0 {
		c.SpreadEvery = 30 * time.Second
	}
	if c.RetryBackoff <= 0 {
		c.RetryBackoff = 50 * time.Millisecond
	}
	if c.MaxBlocks <= 0 {
		c.MaxBlocks = DefaultMaxBlocks
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// ConsumerMetrics are the consumer's Prometheus metrics.
type ConsumerMetrics struct {
	Batches       prometheus.Counter     // batches committed
	EventsApplied prometheus.Counter     // events committed
	BatchSeconds  prometheus.Histogram   // first message fetched → acks sent
	Rejected      *prometheus.CounterVec // terminated events by reason
	ApplyErrors   prometheus.Counter     // batches the applier refused (redelivered)
	// SplitBatches counts fetched batches applied as more than one run
	// (ConsumerConfig.MaxEntryBytes); Batches counts every run.
	SplitBatches prometheus.Counter
	FetchErrors  prometheus.Counter
	AckErrors    prometheus.Counter // acks that failed to send (the events come back, harmlessly)
	// DeliveryGaps counts fetched batches whose consumer sequence did not
	// continue the previous one: a delivery was lost (a consumer leader
	// change, a fetch abandoned at its deadline), so the batch was dropped
	// and the consumer rewound to keep stream order.
	DeliveryGaps prometheus.Counter
}

func newConsumerMetrics(reg prometheus.Registerer, labels prometheus.Labels) (*ConsumerMetrics, error) {
	m := &ConsumerMetrics{
		Batches: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "kvrouter", Subsystem: "eventbus", Name: "batches_total", ConstLabels: labels,
			Help: "KV event batches committed through the applier and acked (one per Raft entry: a fetched batch larger than the entry cap counts once per entry)."}),
		SplitBatches: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "kvrouter", Subsystem: "eventbus", Name: "split_batches_total", ConstLabels: labels,
			Help: "Fetched batches split into several Raft entries because their events exceeded the entry byte cap."}),
		EventsApplied: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "kvrouter", Subsystem: "eventbus", Name: "events_applied_total", ConstLabels: labels,
			Help: "KV events committed through the applier and acked."}),
		BatchSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "kvrouter", Subsystem: "eventbus", Name: "batch_seconds", ConstLabels: labels,
			Help:    "Time from a batch's fetch to its acks, including the commit.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14)}),
		Rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "kvrouter", Subsystem: "eventbus", Name: "events_rejected_total", ConstLabels: labels,
			Help: "KV events terminated without being applied, by reason."}, []string{"reason"}),
		ApplyErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "kvrouter", Subsystem: "eventbus", Name: "apply_errors_total", ConstLabels: labels,
			Help: "Batches the applier did not commit (left for redelivery)."}),
		FetchErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "kvrouter", Subsystem: "eventbus", Name: "fetch_errors_total", ConstLabels: labels,
			Help: "Failed fetches from the KV event stream."}),
		DeliveryGaps: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "kvrouter", Subsystem: "eventbus", Name: "delivery_gaps_total", ConstLabels: labels,
			Help: "Fetched batches dropped and re-fetched because a delivery before them was lost."}),
		AckErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "kvrouter", Subsystem: "eventbus", Name: "ack_errors_total", ConstLabels: labels,
			Help: "Acks that could not be sent (those events are redelivered and skipped as duplicates)."}),
	}
	for _, r := range AllReasons {
		m.Rejected.WithLabelValues(string(r))
	}
	if reg == nil {
		return m, nil
	}
	var errs []error
	m.Batches = registerInto(reg, m.Batches, &errs)
	m.EventsApplied = registerInto(reg, m.EventsApplied, &errs)
	m.BatchSeconds = registerInto(reg, m.BatchSeconds, &errs)
	m.Rejected = registerInto(reg, m.Rejected, &errs)
	m.ApplyErrors = registerInto(reg, m.ApplyErrors, &errs)
	m.SplitBatches = registerInto(reg, m.SplitBatches, &errs)
	m.FetchErrors = registerInto(reg, m.FetchErrors, &errs)
	m.AckErrors = registerInto(reg, m.AckErrors, &errs)
	m.DeliveryGaps = registerInto(reg, m.DeliveryGaps, &errs)
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("register consumer metrics: %w", err)
	}
	return m, nil
}

// register registers c, or returns the collector already registered under
// its name and labels (a second consumer on the same registry shares the
// metrics). Other failures leave c unregistered.
func register[C prometheus.Collector](reg prometheus.Registerer, c C) C {
	c, _ = registerShared(reg, c)
	return c
}

// registerShared is register that also returns a failure other than
// "already registered" (e.g. the name registered with other label names).
func registerShared[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	err := reg.Register(c)
	if err == nil {
		return c, nil
	}
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing, nil
		}
	}
	return c, err
}

// registerInto is registerShared collecting the error into errs.
func registerInto[C prometheus.Collector](reg prometheus.Registerer, c C, errs *[]error) C {
	c, err := registerShared(reg, c)
	if err != nil {
		*errs = append(*errs, err)
	}
	return c
}

// Consumer is the durable pull consumer that moves KV events from the stream
// into the Raft log. Exactly one Run should be active in the cluster, on the
// Raft leader.
type Consumer struct {
	js      jetstream.JetStream
	cfg     ConsumerConfig
	log     *slog.Logger
	metrics *ConsumerMetrics
	limiter *logLimiter

	mu   sync.Mutex // guards cons
	cons jetstream.Consumer

	// Delivery-sequence tracking, used only by Run's goroutine.
	nextDseq uint64 // the consumer sequence the next delivery must carry; 0 = unknown
	rewound  bool   // nothing delivered since the last rewind
	ackLost  bool   // a batch's acks were not confirmed: rewind before the next fetch

	// When to check the NATS leaders next, and the moves asked for in a
	// row (leaders.go); used only by Run's goroutine.
	spreadNext  time.Time
	spreadTries int
}

// NewConsumer creates (or updates) the durable consumer on the stream, which
// must exist (EnsureStream).
func NewConsumer(ctx context.Context, js jetstream.JetStream, cfg ConsumerConfig) (*Consumer, error) {
	cfg = cfg.withDefaults()
	metrics, err := newConsumerMetrics(cfg.Registerer, cfg.ConstLabels)
	if err != nil {
		return nil, fmt.Errorf("consumer %s on %s: %w", cfg.Durable, cfg.Stream, err)
	}
	c := &Consumer{
		js:      js,
		cfg:     cfg,
		log:     cfg.Logger.With("component", "kv-consumer", "stream", cfg.Stream, "durable", cfg.Durable),
		metrics: metrics,
		limiter: newLogLimiter(10 * time.Second),
	}
	if _, err := c.consumer(ctx, true); err != nil {
		return nil, err
	}
	return c, nil
}

// Metrics returns the consumer's metrics.
func (c *Consumer) Metrics() *ConsumerMetrics { return c.metrics }

// DurableConfig is the durable consumer's JetStream configuration.
//
// Its state (delivered and ack floor) is kept in memory (MemoryStorage;
// ConsumerConfig.FileState keeps it in files, for rolling upgrades),
// replicated like the stream but without a file-backed NATS Raft WAL: a
// write and an fsync on every replica for every delivery and ack the
// consumer's Raft group replicates (issue 31 item 3). Nothing durable
// depends on it: with work-queue retention an acked event is deleted from
// the stream (whose store stays SyncAlways), so the stream itself holds
// exactly the events not known to be committed. A consumer whose state is
// lost (every NATS server restarted at once) starts again at the stream's
// first event, i.e. redelivers what the stream still holds, which the
// state machine applies or skips as duplicates, as after any rewind.
func (c *Consumer) DurableConfig() jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:       c.cfg.Durable,
		Description:   "kvrouter leader: KV events into the Raft log",
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       c.cfg.AckWait,
		MaxDeliver:    -1,
		MaxAckPending: c.cfg.MaxAckPending,
		// kv.events.> on every stream, not the stream's subject list: a
		// worker moved to another group's stream leaves its stored events
		// here, and they must still be delivered (NATS no longer requires
		// a filter to be a subset of the stream's subjects). It also skips
		// a group stream's placeholder subject.
		FilterSubject: EventSubjects,
		MemoryStorage: !c.cfg.FileState,
	}
}

func (c *Consumer) consumer(ctx context.Context, refresh bool) (jetstream.Consumer, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cons != nil && !refresh {
		return c.cons, nil
	}
	backoff := c.cfg.RetryBackoff
	for {
		actx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := c.replaceOtherStorage(actx)
		var cons jetstream.Consumer
		if err == nil {
			cons, err = c.js.CreateOrUpdateConsumer(actx, c.cfg.Stream, c.DurableConfig())
		}
		cancel()
		if err == nil {
			c.cons = cons
			return cons, nil
		}
		if !transientJSError(err) || ctx.Err() != nil {
			return nil, fmt.Errorf("consumer %s on %s: %w", c.cfg.Durable, c.cfg.Stream, err)
		}
		if !sleepCtx(ctx, backoff) {
			return nil, fmt.Errorf("consumer %s on %s: %w (last error: %v)", c.cfg.Durable, c.cfg.Stream, ctx.Err(), err)
		}
		backoff = min(2*backoff, time.Second)
	}
}

// replaceOtherStorage deletes the durable if it exists with its state in
// the other storage than DurableConfig's: NATS refuses to change a
// consumer's storage type in an update ("storage type can not be
// updated"), so a durable of an earlier build (file state) would stop the
// ingest. The new durable delivers from the stream's first event: the
// events the stream still holds come again, and the state machine skips
// those it applied (DurableConfig).
func (c *Consumer) replaceOtherStorage(ctx context.Context) error {
	old, err := c.js.Consumer(ctx, c.cfg.Stream, c.cfg.Durable)
	if err != nil {
		// Not found: created below. Any other failure (a timeout, an
		// external NATS whose credentials allow creating the consumer but
		// not reading it): the update below decides, and is retried.
		return nil
	}
	want := c.DurableConfig().MemoryStorage
	if old.CachedInfo().Config.MemoryStorage == want {
		return nil
	}
	c.log.Info("re-creating the durable consumer with its state in the other storage; the stream's unacked events are delivered again",
		"memory_storage", want)
	if err := c.js.DeleteConsumer(ctx, c.cfg.Stream, c.cfg.Durable); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return err
	}
	return nil
}

// Run moves events from the stream to applier until ctx is cancelled (the
// caller cancels it when this replica loses the Raft leadership), then
// returns nil; it returns an error only if the consumer cannot be set up.
//
// Each round fetches up to MaxBatch messages, waiting at most BatchWait
// after the first; decodes and validates each message's events (one, or a
// batch message's several; invalid ones are counted and their messages
// terminated, so they never block the stream); hands the valid events, in
// stream order, to applier; and acks a message only after applier
// returned nil for all its valid events. On an
// error nothing is acked: the consumer is rewound to its ack floor so
// JetStream redelivers the batch, first and in order, after a pause.
//
// Run first resets the consumer to its ack floor, so whatever a previous
// leader fetched but never acked is redelivered now and in stream order,
// not after AckWait and behind newer events. It also rewinds when a
// delivery was lost or a batch's acks were not confirmed (see DESIGN.md).
// At most one Run per Consumer at a time.
func (c *Consumer) Run(ctx context.Context, applier Applier) error {
	cons, err := c.consumer(ctx, false)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	if err := c.reset(ctx); err != nil && ctx.Err() == nil {
		// An old server without the reset API: unacked events of the
		// previous leader come back after AckWait instead.
		c.log.Warn("reset consumer to ack floor failed", "err", err)
	}
	c.log.Info("consuming KV events")
	defer c.log.Info("stopped consuming KV events")
	backoff := c.cfg.RetryBackoff
	busy := false
	for ctx.Err() == nil {
		c.maybeSpread(ctx)
		if c.ackLost {
			// Redeliver the possibly unacked events now (the state machine
			// skips them) rather than after AckWait behind newer ones.
			c.ackLost = false
			if err := c.reset(ctx); err != nil && ctx.Err() == nil {
				c.log.Warn("reset consumer after lost acks failed", "err", err)
			}
		}
		msgs, err := c.fetch(ctx, cons, busy)
		if ctx.Err() != nil {
			nakAll(msgs)
			return nil
		}
		if err != nil {
			c.metrics.FetchErrors.Inc()
			if ok, n := c.limiter.allow("fetch"); ok {
				c.log.Warn("fetch KV events failed", "err", err, "suppressed", n)
			}
			if errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, jetstream.ErrStreamNotFound) {
				if fresh, cerr := c.consumer(ctx, true); cerr == nil {
					cons = fresh
				}
			}
			c.rewind(ctx, msgs)
			if !sleepCtx(ctx, backoff) {
				return nil
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		busy = len(msgs) > 0
		if !busy {
			continue
		}
		if c.log.Enabled(ctx, slog.LevelDebug) {
			first, _ := msgs[0].Metadata()
			last, _ := msgs[len(msgs)-1].Metadata()
			if first != nil && last != nil {
				c.log.Debug("fetched", "msgs", len(msgs), "dseq", first.Sequence.Consumer, "dseq_last", last.Sequence.Consumer,
					"sseq", first.Sequence.Stream, "sseq_last", last.Sequence.Stream, "expect", c.nextDseq)
			}
		}
		if !c.inSequence(msgs) {
			c.metrics.DeliveryGaps.Inc()
			if ok, n := c.limiter.allow("gap"); ok {
				c.log.Warn("lost a delivery before this batch; re-fetching from the ack floor", "suppressed", n)
			}
			c.rewind(ctx, msgs)
			continue
		}
		if c.process(ctx, msgs, applier) {
			backoff = c.cfg.RetryBackoff
			continue
		}
		busy = true // the rewound batch is waiting
		if !sleepCtx(ctx, backoff) {
			return nil
		}
		backoff = min(2*backoff, time.Second)
	}
	return nil
}

// fetch returns the next batch. While the stream is busy one request
// collects up to MaxBatch messages for at most BatchWait; when it was idle,
// a long poll of IdleWait waits for the first message (and returns as soon
// as it arrives), then a short request collects the rest of the batch.
func (c *Consumer) fetch(ctx context.Context, cons jetstream.Consumer, busy bool) ([]jetstream.Msg, error) {
	var msgs []jetstream.Msg
	if !busy {
		ictx, cancel := context.WithTimeout(ctx, c.cfg.IdleWait)
		b, err := cons.Fetch(1, jetstream.FetchContext(ictx))
		if err != nil {
			cancel()
			return nil, err
		}
		for m := range b.Messages() {
			msgs = append(msgs, m)
		}
		err = b.Error()
		cancel()
		if err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
			return msgs, err
		}
		if len(msgs) == 0 || c.cfg.MaxBatch == 1 {
			return msgs, nil
		}
	}
	b, err := cons.Fetch(c.cfg.MaxBatch-len(msgs), jetstream.FetchMaxWait(c.cfg.BatchWait))
	if err != nil {
		return msgs, err
	}
	for m := range b.Messages() {
		msgs = append(msgs, m)
	}
	return msgs, b.Error()
}

// badEvent is a refused message (ev nil when undecodable, else its first
// event) or a refused member of a batch message whose other members are
// applied (member true: the message is acked, not terminated).
type badEvent struct {
	m      jetstream.Msg
	ev     WireEvent
	hasEv  bool
	err    error
	member bool
}

// msgEnd is a message with at least one valid event: it is acked once the
// run holding its last valid event (index last in the batch's events) has
// committed.
type msgEnd struct {
	m    jetstream.Msg
	last int
}

// process handles one fetched batch; it reports whether the batch is done
// with (applied and acked, or nothing valid in it). The valid events go to
// the applier in runs that fit MaxEntryBytes (splitRuns), in order; a
// message is acked once the run holding its last valid event committed
// (a batch message's events may span runs), and a run is applied only
// after the one before it committed. If a run fails, the batch is rewound:
// what earlier runs committed comes back and the state machine skips it.
// Invalid messages are terminated, and invalid members of batch messages
// counted, after the last run committed, so a batch that is rewound is
// re-examined whole (and no late Term races the rewind).
func (c *Consumer) process(ctx context.Context, msgs []jetstream.Msg, applier Applier) bool {
	start := time.Now()
	events := make([]WireEvent, 0, len(msgs))
	ends := make([]msgEnd, 0, len(msgs))
	var sizes []int
	var bad []badEvent
	for _, m := range msgs {
		n := len(events)
		events, sizes, bad = c.checkMsg(m, events, sizes, bad)
		if len(events) > n {
			ends = append(ends, msgEnd{m: m, last: len(events) - 1})
		}
	}
	if len(events) == 0 {
		c.rejectAll(bad)
		return true
	}
	runs := []int{len(events)}
	if c.bounded() {
		runs = splitRuns(sizes, c.cfg.MaxEntryBytes)
	}
	from, acked := 0, 0
	done := make([]jetstream.Msg, 0, len(ends))
	for i, to := range runs {
		if err := applier.ApplyEvents(ctx, events[from:to]); err != nil {
			c.metrics.ApplyErrors.Inc()
			if ctx.Err() == nil {
				if ok, n := c.limiter.allow("apply"); ok {
					c.log.Warn("apply KV event batch failed; left for redelivery", "events", to-from,
						"entry", i+1, "entries", len(runs), "err", err, "suppressed", n)
				}
			}
			c.rewind(ctx, msgs)
			return false
		}
		done = done[:0]
		for acked < len(ends) && ends[acked].last < to {
			done = append(done, ends[acked].m)
			acked++
		}
		if len(done) > 0 {
			c.ackAll(ctx, done)
		}
		c.metrics.Batches.Inc()
		c.metrics.EventsApplied.Add(float64(to - from))
		from = to
	}
	c.rejectAll(bad)
	if len(runs) > 1 {
		c.metrics.SplitBatches.Inc()
	}
	c.metrics.BatchSeconds.Observe(time.Since(start).Seconds())
	return true
}

// rejectAll terminates the refused messages and reports every refused
// event; a message with valid members is acked with them, not terminated.
func (c *Consumer) rejectAll(bad []badEvent) {
	var last jetstream.Msg
	for _, b := range bad {
		c.reject(b, b.m != last && !b.member)
		last = b.m
	}
}

// bounded reports whether applier calls are bounded in bytes.
func (c *Consumer) bounded() bool { return c.cfg.EntryBytes != nil && c.cfg.MaxEntryBytes > 0 }

// splitRuns cuts events of the given sizes, in order, into consecutive runs
// whose sizes add up to at most limit, greedily (each run as long as it can
// be), and returns each run's end index. A size above limit (check refuses
// such events) gets a run of its own rather than a panic or a loop.
func splitRuns(sizes []int, limit int) []int {
	var ends []int
	sum := 0
	for i, n := range sizes {
		if i > 0 && sum+n > limit {
			ends = append(ends, i)
			sum = 0
		}
		sum += n
	}
	if len(sizes) > 0 {
		ends = append(ends, len(sizes))
	}
	return ends
}

// checkMsg decodes and checks one message, single event or batch, and
// appends its valid events (with their EntryBytes, 0 when unbounded) and
// its refusals. A batch is refused whole when it is undecodable, its
// members are not one worker rank's contiguous ids (bad_batch), its worker
// name is bad, or its subject or Nats-Msg-Id do not match: nothing in it
// can be trusted then. Otherwise each member is checked as a single event
// would be (Validate, the entry cap, the Validator): the invalid ones are
// refused by reason, the valid ones applied, as if the worker had sent
// them one per message.
func (c *Consumer) checkMsg(m jetstream.Msg, events []WireEvent, sizes []int, bad []badEvent) ([]WireEvent, []int, []badEvent) {
	data := m.Data()
	if !IsBatch(data) {
		ev, err := Decode(data)
		if err != nil {
			return events, sizes, append(bad, badEvent{m: m, err: &InvalidEventError{Reason: ReasonUndecodable, Detail: err.Error(), Err: err}})
		}
		if err := Validate(&ev, c.cfg.MaxBlocks); err != nil {
			return events, sizes, append(bad, badEvent{m: m, ev: ev, hasEv: true, err: err})
		}
		if subj := m.Subject(); !isEventSubject(subj, ev.Worker) {
			return events, sizes, append(bad, badEvent{m: m, ev: ev, hasEv: true, err: invalid(ReasonSubjectMismatch, "%s on subject %s", ev.MsgID(), subj)})
		}
		if id := m.Headers().Get(jetstream.MsgIDHeader); id != "" && !isMsgID(id, ev.Worker, ev.DPRank, ev.EventID) {
			return events, sizes, append(bad, badEvent{m: m, ev: ev, hasEv: true, err: invalid(ReasonMsgIDMismatch, "%s with Nats-Msg-Id %q", ev.MsgID(), id)})
		}
		size, err := c.checkEvent(&ev)
		if err != nil {
			return events, sizes, append(bad, badEvent{m: m, ev: ev, hasEv: true, err: err})
		}
		if c.bounded() {
			sizes = append(sizes, size)
		}
		return append(events, ev), sizes, bad
	}
	evs, err := DecodeBatch(data)
	if err != nil {
		return events, sizes, append(bad, badEvent{m: m, err: &InvalidEventError{Reason: ReasonUndecodable, Detail: err.Error(), Err: err}})
	}
	whole := func(err error) []badEvent {
		for i := range evs {
			bad = append(bad, badEvent{m: m, ev: evs[i], hasEv: true, err: err})
		}
		return bad
	}
	if err := CheckBatch(evs); err != nil {
		return events, sizes, whole(err)
	}
	first, last := &evs[0], &evs[len(evs)-1]
	if err := validateWorker(first); err != nil {
		return events, sizes, whole(err)
	}
	if subj := m.Subject(); !isEventSubject(subj, first.Worker) {
		return events, sizes, whole(invalid(ReasonSubjectMismatch, "%s..%d on subject %s", first.MsgID(), last.EventID, subj))
	}
	if id := m.Headers().Get(jetstream.MsgIDHeader); id != "" && !isBatchMsgID(id, first.Worker, first.DPRank, first.EventID, last.EventID) {
		return events, sizes, whole(invalid(ReasonMsgIDMismatch, "%s..%d with Nats-Msg-Id %q", first.MsgID(), last.EventID, id))
	}
	nvalid := 0
	for i := range evs {
		ev := &evs[i]
		err := Validate(ev, c.cfg.MaxBlocks)
		size := 0
		if err == nil {
			size, err = c.checkEvent(ev)
		}
		if err != nil {
			bad = append(bad, badEvent{m: m, ev: *ev, hasEv: true, err: err})
			continue
		}
		nvalid++
		events = append(events, *ev)
		if c.bounded() {
			sizes = append(sizes, size)
		}
	}
	if nvalid > 0 {
		// The message is acked with its valid members: its refused
		// members are counted, not terminated.
		for i := len(bad) - 1; i >= 0 && bad[i].m == m; i-- {
			bad[i].member = true
		}
	}
	return events, sizes, bad
}

// checkEvent checks a decoded, Validate-d event against the entry cap and
// the Validator, and returns its EntryBytes (0 when unbounded).
func (c *Consumer) checkEvent(ev *WireEvent) (int, error) {
	size := 0
	if c.bounded() {
		size = c.cfg.EntryBytes(ev)
		if size > c.cfg.MaxEntryBytes {
			// No entry could hold it: refuse it now rather than have every
			// later batch fail behind it (a worker's KV state is lost for
			// this event: the gap marks it stale, a resync repairs it).
			return size, invalid(ReasonTooLarge, "%s: %d blocks, %d removed: %d bytes in an entry, cap %d",
				ev.MsgID(), len(ev.Blocks), len(ev.Removed), size, c.cfg.MaxEntryBytes)
		}
	}
	if c.cfg.Validator != nil {
		bs := 0
		if ev.Kind == KindStored {
			bs = ev.BlockSize
		}
		if err := c.cfg.Validator.CheckWorker(string(ev.WorkerID()), bs); err != nil {
			r := ReasonRejected
			switch {
			case errors.Is(err, router.ErrUnknownWorker):
				r = ReasonUnknownWorker
			case errors.Is(err, router.ErrBlockSizeMismatch):
				r = ReasonBlockSizeMismatch
			}
			return size, &InvalidEventError{Reason: r, Detail: ev.MsgID() + ": " + err.Error(), Err: err}
		}
	}
	return size, nil
}

// reject counts, logs and reports one refused event (or undecodable
// message), and terminates its message when term is set (once per refused
// message; a batch message with valid members is acked instead), so it is
// never redelivered.
func (c *Consumer) reject(b badEvent, term bool) {
	m, err := b.m, b.err
	r := ReasonOf(err)
	if r == "" {
		r = ReasonRejected
	}
	c.metrics.Rejected.WithLabelValues(string(r)).Inc()
	var seq uint64
	if md, merr := m.Metadata(); merr == nil {
		seq = md.Sequence.Stream
	}
	if ok, n := c.limiter.allow("reject:" + string(r)); ok {
		level := slog.LevelWarn
		if r == ReasonTooLarge {
			level = slog.LevelError // a valid worker event the cluster can never hold
		}
		c.log.Log(context.Background(), level, "rejected KV event", "reason", r, "subject", m.Subject(), "stream_seq", seq, "err", err, "suppressed", n)
	}
	if c.cfg.OnReject != nil {
		rej := Rejection{Reason: r, Err: err, Subject: m.Subject(), StreamSeq: seq}
		if b.hasEv {
			ev := b.ev
			rej.Event = &ev
		}
		c.cfg.OnReject(rej)
	}
	if term {
		if terr := m.TermWithReason(string(r)); terr != nil {
			c.metrics.AckErrors.Inc()
		}
	}
}

// ackAll acks a committed batch: fire-and-forget acks for all but the last,
// which is acked synchronously so the batch's acks are known to have reached
// the server (they travel in order on one connection). A lost ack costs a
// redelivery that the state machine skips as a duplicate.
func (c *Consumer) ackAll(ctx context.Context, msgs []jetstream.Msg) {
	for _, m := range msgs[:len(msgs)-1] {
		if err := m.Ack(); err != nil {
			c.metrics.AckErrors.Inc()
		}
	}
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer cancel()
	if err := msgs[len(msgs)-1].DoubleAck(actx); err != nil {
		c.ackLost = true
		c.metrics.AckErrors.Inc()
		if ok, n := c.limiter.allow("ack"); ok {
			c.log.Warn("ack of committed batch not confirmed; it will be redelivered and skipped", "err", err, "suppressed", n)
		}
	}
}

// inSequence checks that msgs continue the consumer's delivery sequence.
// The consumer numbers every delivery (redeliveries included) 1, 2, 3…
// from its last reset, and only this Run fetches from it, so a jump means a
// delivery never reached us: it would come back only after AckWait, behind
// newer events. Right after a rewind the first delivery is accepted as it
// comes, so a wrong assumption cannot loop.
func (c *Consumer) inSequence(msgs []jetstream.Msg) bool {
	for _, m := range msgs {
		md, err := m.Metadata()
		if err != nil {
			c.nextDseq = 0
			continue
		}
		d := md.Sequence.Consumer
		if c.nextDseq != 0 && d != c.nextDseq && !c.rewound {
			return false
		}
		c.rewound = false
		c.nextDseq = d + 1
	}
	return true
}

// reset moves the consumer back to its ack floor: everything delivered and
// not acked is delivered again, first and in stream order.
func (c *Consumer) reset(ctx context.Context) error {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := c.js.ResetConsumer(rctx, c.cfg.Stream, c.cfg.Durable); err != nil {
		c.nextDseq, c.rewound = 0, false
		return err
	}
	c.nextDseq, c.rewound = 1, true
	return nil
}

// rewind gives back a batch that was fetched but not committed, so that it
// is delivered again, first and in stream order. It resets the consumer to
// its ack floor (a synchronous request, so the next fetch cannot overtake
// it; naks travel on a different queue inside the server than pull
// requests and could). Without the reset API it falls back to naks. With
// ctx cancelled (leadership lost) it only naks: the next leader's Run
// resets.
func (c *Consumer) rewind(ctx context.Context, msgs []jetstream.Msg) {
	if len(msgs) == 0 {
		return
	}
	if ctx.Err() == nil {
		err := c.reset(ctx)
		if err == nil {
			return
		}
		if ok, n := c.limiter.allow("reset"); ok {
			c.log.Warn("reset consumer to ack floor failed; nak'ing instead", "err", err, "suppressed", n)
		}
	}
	nakAll(msgs)
}

// nakAll asks for immediate redelivery.
func nakAll(msgs []jetstream.Msg) {
	for _, m := range msgs {
		_ = m.Nak()
	}
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// logLimiter lets one line per key through per interval and counts the rest.
type logLimiter struct {
	every time.Duration
	mu    sync.Mutex // guards last and supp
	last  map[string]time.Time
	supp  map[string]int
}

func newLogLimiter(every time.Duration) *logLimiter {
	return &logLimiter{every: every, last: map[string]time.Time{}, supp: map[string]int{}}
}

// allow reports whether to log now, and how many lines were suppressed since
// the last one.
func (l *logLimiter) allow(key string) (bool, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	if t, ok := l.last[key]; ok && now.Sub(t) < l.every {
		l.supp[key]++
		return false, 0
	}
	n := l.supp[key]
	l.last[key] = now
	l.supp[key] = 0
	return true, n
}
