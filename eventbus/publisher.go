package eventbus

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// ErrPublisherClosed is returned (and reported through OnError) for events
// that were not acknowledged before Close.
var ErrPublisherClosed = errors.New("publisher closed")

// PublishAck says the stream has durably stored an event (or already had it:
// Duplicate). Only acknowledged events are guaranteed to reach the index.
// The events of one batch message share its Stream, Sequence and Duplicate.
type PublishAck struct {
	EventID   uint64
	Stream    string
	Sequence  uint64 // stream sequence of the event's message
	Duplicate bool   // the stream had this Nats-Msg-Id already
}

// PublisherStats are cumulative counters of one publisher.
type PublisherStats struct {
	Published  uint64 // events handed to the stream (first attempt of their message)
	Acked      uint64 // acknowledged (including duplicates)
	Duplicates uint64 // acknowledged as duplicates
	Retries    uint64 // re-sends with the same Nats-Msg-Id
	Failed     uint64 // given up (permanent error or Close)
	InFlight   int    // events accepted, not yet acknowledged (an open batch included)
}

type publisherOptions struct {
	window     int
	ackTimeout time.Duration
	backoffMin time.Duration
	backoffMax time.Duration
	nextID     uint64
	onAck      func(PublishAck)
	onError    func(eventID uint64, err error)
	logger     *slog.Logger

	// Batching (WithBatching): at most batchEvents events (1: every event
	// alone, in the single-event form) and batchBytes bytes per message,
	// each message sent at the latest batchLinger after its first event.
	batchEvents int
	batchBytes  int
	batchLinger time.Duration

	// compact: events in the compact hash form (WithCompactHashes).
	compact bool
}

// Batching defaults (WithBatching with zero values).
const (
	DefaultBatchBytes  = 512 << 10 // under NATS's default 1 MiB max_payload
	DefaultBatchLinger = time.Millisecond
)

// PublisherOption configures NewPublisher.
type PublisherOption func(*publisherOptions)

// WithWindow bounds the events in flight (sent, not yet acknowledged);
// Publish and PublishAsync block while it is full. Default 256.
func WithWindow(n int) PublisherOption {
	return func(o *publisherOptions) {
		if n > 0 {
			o.window = n
		}
	}
}

// WithAckTimeout bounds one attempt's wait for the stream's ack (default 5s);
// after it the event is re-sent with the same Nats-Msg-Id.
func WithAckTimeout(d time.Duration) PublisherOption {
	return func(o *publisherOptions) {
		if d > 0 {
			o.ackTimeout = d
		}
	}
}

// WithRetryBackoff sets the wait between re-sends: it starts at min and
// doubles up to max (defaults 50ms, 2s), with jitter.
func WithRetryBackoff(min, max time.Duration) PublisherOption {
	return func(o *publisherOptions) {
		if min > 0 {
			o.backoffMin = min
		}
		if max >= o.backoffMin {
			o.backoffMax = max
		}
	}
}

// WithNextEventID sets the id the publisher assigns next (default 1), e.g.
// to continue after a restart.
func WithNextEventID(id uint64) PublisherOption {
	return func(o *publisherOptions) {
		if id > 0 {
			o.nextID = id
		}
	}
}

// FreshEventIDBase is a first event id for a worker that does not persist
// its counter: ids continue above any id it used before a restart (its
// nanosecond clock), so the state machine never skips them as duplicates.
// Start such a worker with a Cleared event: the jump in ids is a gap, and a
// Cleared event is exactly the resync that closes it.
func FreshEventIDBase(now time.Time) uint64 { return uint64(now.UnixNano()) }

// WithOnAck reports every acknowledged event, in publish order, from the
// publisher's goroutine: a ledger records exactly these ids. The callback
// must not block for long and must not call the publisher.
func WithOnAck(fn func(PublishAck)) PublisherOption {
	return func(o *publisherOptions) { o.onAck = fn }
}

// WithOnError reports events the publisher gave up on (a permanent stream
// error, or Close before the ack). Same goroutine rules as WithOnAck.
func WithOnError(fn func(eventID uint64, err error)) PublisherOption {
	return func(o *publisherOptions) { o.onError = fn }
}

// WithBatching coalesces consecutive events into batch messages (the
// batch form, DecodeBatch): up to maxEvents events (at most MaxBatchEvents)
// and maxBytes bytes of encoded events per message (default
// DefaultBatchBytes), a message sent when it is full or linger after its
// first event (default DefaultBatchLinger), whichever comes first; Flush
// sends an open batch at once. Events with caller-chosen ids that do not
// continue the open batch start a new one. A batch of one event goes in
// the single-event form. maxEvents ≤ 1 (the default) sends every event
// alone, as publishers always did.
//
// Acks stay per event: OnAck reports every event of an acknowledged batch,
// in id order (Sequence is the stream sequence of its message); a failed
// batch is reported through OnError event by event. WithWindow still
// counts events. Consumers of builds before batches refuse batch messages
// as undecodable: turn batching on only once every replica knows them.
func WithBatching(maxEvents, maxBytes int, linger time.Duration) PublisherOption {
	return func(o *publisherOptions) {
		o.batchEvents = min(max(maxEvents, 1), MaxBatchEvents)
		o.batchBytes = maxBytes
		if maxBytes <= 0 {
			o.batchBytes = DefaultBatchBytes
		}
		o.batchLinger = linger
		if linger <= 0 {
			o.batchLinger = DefaultBatchLinger
		}
	}
}

// WithCompactHashes makes the publisher encode events with their hashes
// in the compact form (EncodeCompact, compactwire.go): about half the bytes
// of a stored event's message, which the stream and its routes pay for on
// every replica. Consumers of builds before the compact form refuse such
// events as undecodable: turn it on only once every replica knows it.
func WithCompactHashes() PublisherOption {
	return func(o *publisherOptions) { o.compact = true }
}

// WithPublisherLogger sets the logger (default slog.Default()).
func WithPublisherLogger(l *slog.Logger) PublisherOption {
	return func(o *publisherOptions) { o.logger = l }
}

// Publisher publishes one worker rank's KV events into KV_EVENTS: it assigns
// event ids, deduplicates retries through Nats-Msg-Id, bounds what is in
// flight and reports acknowledgements in order.
//
// Ordering: events are sent in event-id order and acknowledged in that
// order. After a failed send no new event goes out until every event then
// in flight is resolved, failed ones re-sent in order. Only events already
// in flight behind a lost one can reach the stream before its re-send (the
// stream came back between the two sends), so the stream can, rarely and
// only after a failure, hold a worker's events out of order. The state
// machine's per-worker gap rule catches that (see DESIGN.md).
type Publisher struct {
	js      jetstream.JetStream
	worker  string
	dpRank  uint32
	subject string
	opts    publisherOptions
	log     *slog.Logger

	sem    chan struct{}   // one token per event in flight
	wake   chan struct{}   // cap 1: something was queued
	done   chan struct{}   // closed by Close
	base   context.Context // cancelled by Close: aborts a re-send in progress
	cancel context.CancelFunc
	closed atomic.Bool
	wg     sync.WaitGroup

	// mu serialises sends so the wire order is the event-id order; it
	// guards the fields below.
	mu       sync.Mutex
	next     uint64
	queue    []*pending    // in flight, in send order
	inflight int           // events in queue and open
	blocked  chan struct{} // non-nil while the head is being re-sent; closed when done
	empty    chan struct{} // non-nil while a Flush waits; closed when queue and open drain
	open     openBatch     // events not yet sent (WithBatching)

	published, acked, dups, retries, failed atomic.Uint64
}

// pending is one message in flight: the events first..last.
type pending struct {
	first, last uint64
	msg         *nats.Msg
	paf         jetstream.PubAckFuture // nil: the first send failed, re-send (or sendErr)
	sendErr     error                  // a permanent error of the first send
	done        chan struct{}          // closed when ack or err is set
	ack         PublishAck             // the message's (EventID is last's)
	err         error
}

func (pd *pending) events() int { return int(pd.last - pd.first + 1) }

// label names the message's events in logs.
func (pd *pending) label() string {
	if pd.first == pd.last {
		return fmt.Sprint(pd.first)
	}
	return fmt.Sprintf("%d-%d", pd.first, pd.last)
}

// openBatch collects events until a batch message is sealed: their
// encodings, after headerRoom bytes kept for the array header, so that the
// buffer becomes the message's data without a copy (the next batch gets a
// new buffer: a sent message's data is kept for its re-sends).
type openBatch struct {
	pd    *pending // nil while empty; first and last set
	buf   []byte
	size  int // the last sealed buffer's length: the next one's capacity
	timer *time.Timer
	gen   uint64 // counts sealed batches: a linger timer seals only its own
}

// headerRoom is the room kept before a batch's members for its array header
// (array16: 3 bytes).
const headerRoom = 3

// NewPublisher returns a publisher for rank dpRank of worker on nc. It
// creates its own JetStream context (and so its own ack subscription).
func NewPublisher(nc *nats.Conn, worker string, dpRank uint32, opts ...PublisherOption) (*Publisher, error) {
	o := publisherOptions{
		window:      256,
		ackTimeout:  5 * time.Second,
		backoffMin:  50 * time.Millisecond,
		backoffMax:  2 * time.Second,
		nextID:      1,
		batchEvents: 1,
		batchBytes:  DefaultBatchBytes,
		batchLinger: DefaultBatchLinger,
	}
	for _, fn := range opts {
		fn(&o)
	}
	if o.logger == nil {
		o.logger = slog.Default()
	}
	probe := WireEvent{Worker: worker, DPRank: dpRank, EventID: 1, Kind: KindCleared}
	if err := Validate(&probe, 0); err != nil {
		return nil, fmt.Errorf("new publisher: %w", err)
	}
	js, err := jetstream.New(nc,
		jetstream.WithPublishAsyncMaxPending(o.window+16),
		jetstream.WithPublishAsyncTimeout(o.ackTimeout),
	)
	if err != nil {
		return nil, fmt.Errorf("new publisher: %w", err)
	}
	p := &Publisher{
		js:      js,
		worker:  worker,
		dpRank:  dpRank,
		subject: EventSubject(worker),
		opts:    o,
		log:     o.logger.With("component", "publisher", "worker", worker, "dp_rank", dpRank),
		sem:     make(chan struct{}, o.window),
		wake:    make(chan struct{}, 1),
		done:    make(chan struct{}),
		next:    o.nextID,
	}
	p.base, p.cancel = context.WithCancel(context.Background())
	p.wg.Add(1)
	go p.ackLoop()
	return p, nil
}

// NextEventID is the id the next event without one will get.
func (p *Publisher) NextEventID() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.next
}

// Publish sends ev and waits for the stream's acknowledgement, re-sending
// with the same Nats-Msg-Id on timeouts and missing responders. Worker and
// DPRank are the publisher's; EventID 0 means "assign the next id". It
// blocks while the window is full. If ctx ends first, the event may still
// be acknowledged later (reported through OnAck); the error says so. With
// WithBatching it also waits for its batch to be sent (at most the linger).
func (p *Publisher) Publish(ctx context.Context, ev WireEvent) (PublishAck, error) {
	pd, id, err := p.send(ctx, ev, false)
	if err != nil {
		return PublishAck{}, err
	}
	select {
	case <-pd.done:
		if pd.err != nil {
			return PublishAck{}, pd.err
		}
		a := pd.ack
		a.EventID = id
		return a, nil
	case <-ctx.Done():
		return PublishAck{EventID: id}, fmt.Errorf("event %d sent, ack outstanding: %w", id, ctx.Err())
	}
}

// PublishAsync sends ev without waiting for the acknowledgement and returns
// its event id; OnAck reports the ack. It blocks (respecting ctx) while the
// window is full or a failed send is being repeated: that is the
// backpressure of a stream that does not acknowledge.
func (p *Publisher) PublishAsync(ctx context.Context, ev WireEvent) (uint64, error) {
	_, id, err := p.send(ctx, ev, false)
	if err != nil {
		return 0, err
	}
	return id, nil
}

// PublishBatchAsync sends evs, consecutive events of the publisher's rank
// (EventID 0: the next id), in one batch message — as an engine's own event
// batch (vLLM's KVEventBatch) — whatever WithBatching says: a message is cut
// only past MaxBatchEvents events or the batch byte cap (WithBatching's, or
// DefaultBatchBytes), or where a caller-chosen id breaks the run. It
// returns the last event's id; OnAck reports each event. Events already
// accepted when an error ends it (ctx, Close) are sent. Only replicas that
// know batch messages accept them (DESIGN.md, "Batch messages").
func (p *Publisher) PublishBatchAsync(ctx context.Context, evs []WireEvent) (uint64, error) {
	var last uint64
	var err error
	for _, ev := range evs {
		if _, last, err = p.send(ctx, ev, true); err != nil {
			break
		}
	}
	p.mu.Lock()
	if p.blocked == nil && !p.closed.Load() {
		p.seal(0)
	}
	p.mu.Unlock()
	return last, err
}

// send adds ev to the open batch and seals the batch when it is full (at
// once without batching; hold: only at MaxBatchEvents, the caller seals).
// It returns the message that will carry ev. A full window first sends the
// open batch: its events are what the window waits for.
func (p *Publisher) send(ctx context.Context, ev WireEvent, hold bool) (*pending, uint64, error) {
	select {
	case p.sem <- struct{}{}:
	default:
		p.mu.Lock()
		if p.blocked == nil && !p.closed.Load() {
			p.seal(0)
		}
		p.mu.Unlock()
		select {
		case p.sem <- struct{}{}:
		case <-ctx.Done():
			return nil, 0, ctx.Err()
		case <-p.done:
			return nil, 0, ErrPublisherClosed
		}
	}
	release := true
	defer func() {
		if release {
			<-p.sem
		}
	}()
	p.mu.Lock()
	for p.blocked != nil {
		b := p.blocked
		p.mu.Unlock()
		select {
		case <-b:
		case <-ctx.Done():
			return nil, 0, ctx.Err()
		case <-p.done:
			return nil, 0, ErrPublisherClosed
		}
		p.mu.Lock()
	}
	defer p.mu.Unlock()
	if p.closed.Load() {
		return nil, 0, ErrPublisherClosed
	}
	ev.Worker, ev.DPRank = p.worker, p.dpRank
	if ev.EventID == 0 {
		ev.EventID = p.next
	}
	if err := Validate(&ev, 0); err != nil {
		return nil, 0, fmt.Errorf("publish: %w", err)
	}
	encode := Encode
	if p.opts.compact {
		encode = EncodeCompact
	}
	data, err := encode(&ev)
	if err != nil {
		return nil, 0, err
	}
	if o := p.open.pd; o != nil && (ev.EventID != o.last+1 || len(p.open.buf)-headerRoom+len(data) > p.opts.batchBytes) {
		p.seal(0)
	}
	if p.open.pd == nil {
		p.open.pd = &pending{first: ev.EventID, done: make(chan struct{})}
		p.open.buf = make([]byte, headerRoom, max(p.open.size, headerRoom+len(data)))
		if p.opts.batchEvents > 1 {
			gen := p.open.gen
			p.open.timer = time.AfterFunc(p.opts.batchLinger, func() { p.linger(gen) })
		}
	}
	pd := p.open.pd
	pd.last = ev.EventID
	p.open.buf = append(p.open.buf, data...)
	p.inflight++
	if ev.EventID >= p.next {
		p.next = ev.EventID + 1
	}
	limit := p.opts.batchEvents
	if hold {
		limit = MaxBatchEvents
	}
	if pd.events() >= limit {
		if err := p.seal(ev.EventID); err != nil {
			// Sent alone and refused for good: not in flight, the id
			// not used (as before batches).
			p.inflight--
			if p.next == ev.EventID+1 {
				p.next = ev.EventID
			}
			return nil, 0, err
		}
	}
	release = false // the ack loop returns the token
	return pd, ev.EventID, nil
}

// linger seals the open batch when its linger ends, unless it was sealed
// already (gen moved on) or a re-send blocks new sends: resolve seals it
// when the block lifts.
func (p *Publisher) linger(gen uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.open.gen == gen && p.open.pd != nil && p.blocked == nil && !p.closed.Load() {
		p.seal(0)
	}
}

// seal sends the open batch as one message (a single event in the
// single-event form) and queues it for the ack loop. A permanent error of
// the first send is returned, without queueing, when the message is the
// one event own alone (send reports it to its caller); otherwise the
// message is queued with the error and the ack loop reports it. Called
// with mu held.
func (p *Publisher) seal(own uint64) error {
	pd := p.open.pd
	if pd == nil {
		return nil
	}
	if p.open.timer != nil {
		p.open.timer.Stop()
		p.open.timer = nil
	}
	p.open.pd = nil
	p.open.gen++
	n := pd.events()
	buf := p.open.buf
	p.open.buf, p.open.size = nil, len(buf)
	var data []byte
	var id string
	if n == 1 {
		data = buf[headerRoom:]
		id = MsgID(p.worker, p.dpRank, pd.first)
	} else {
		var h [headerRoom]byte
		hdr := appendArrayHeader(h[:0], n)
		start := headerRoom - len(hdr)
		copy(buf[start:], hdr)
		data = buf[start:]
		id = BatchMsgID(p.worker, p.dpRank, pd.first, pd.last)
	}
	msg := &nats.Msg{Subject: p.subject, Data: data, Header: nats.Header{}}
	msg.Header.Set(jetstream.MsgIDHeader, id)
	pd.msg = msg
	// No library-side retry: it would re-send this message later, behind
	// messages sent after it. Re-sends are ours, in order (ackLoop).
	paf, err := p.js.PublishMsgAsync(msg, jetstream.WithRetryAttempts(0))
	if err != nil && !transientJSError(err) {
		err = fmt.Errorf("publish %s: %w", id, err)
		if n == 1 && pd.first == own {
			return err
		}
		pd.sendErr = err
	}
	pd.paf = paf
	p.queue = append(p.queue, pd)
	p.published.Add(uint64(n))
	select {
	case p.wake <- struct{}{}:
	default:
	}
	return nil
}

// ackLoop resolves in-flight events in send order.
func (p *Publisher) ackLoop() {
	defer p.wg.Done()
	recovering := false // the previous head needed a re-send, which worked
	for {
		p.mu.Lock()
		var head *pending
		if len(p.queue) > 0 {
			head = p.queue[0]
		}
		p.mu.Unlock()
		if head == nil {
			recovering = false
			select {
			case <-p.wake:
				continue
			case <-p.done:
				return
			}
		}
		ack, err := p.await(head)
		if err != nil && transientJSError(err) {
			ack, err = p.resend(head, err, recovering)
			recovering = err == nil
		}
		if errors.Is(err, ErrPublisherClosed) {
			return // Close fails what is left
		}
		p.resolve(head, ack, err)
	}
}

func (p *Publisher) await(pd *pending) (*jetstream.PubAck, error) {
	if pd.sendErr != nil {
		return nil, pd.sendErr
	}
	if pd.paf == nil {
		return nil, nats.ErrTimeout // first send failed: treat like a lost one
	}
	select {
	case a := <-pd.paf.Ok():
		return a, nil
	case err := <-pd.paf.Err():
		return nil, err
	case <-p.done:
		return nil, ErrPublisherClosed
	}
}

// resend repeats the head synchronously with its Nats-Msg-Id until the
// stream answers, the error is permanent or the publisher closes.
//
// From the first failure until everything then in flight is resolved, no new
// event is sent (resolve lifts the block when the queue is empty): a new
// event must not reach the stream before an older one whose fate is
// unknown. When the previous head was just re-sent successfully (the stream
// is back), the first attempt goes out without waiting.
func (p *Publisher) resend(pd *pending, cause error, immediate bool) (*jetstream.PubAck, error) {
	p.mu.Lock()
	if p.blocked == nil {
		p.blocked = make(chan struct{})
	}
	p.mu.Unlock()
	backoff := p.opts.backoffMin
	for attempt := 1; ; attempt++ {
		if attempt%20 == 1 && !(immediate && attempt == 1) {
			p.log.Warn("re-sending events", "event_ids", pd.label(), "attempt", attempt, "err", cause)
		}
		if !(immediate && attempt == 1) {
			wait := backoff/2 + rand.N(backoff/2+1)
			select {
			case <-time.After(wait):
			case <-p.done:
				return nil, ErrPublisherClosed
			}
			backoff = min(2*backoff, p.opts.backoffMax)
		}
		p.retries.Add(1)
		ctx, cancel := context.WithTimeout(p.base, p.opts.ackTimeout)
		ack, err := p.js.PublishMsg(ctx, pd.msg)
		cancel()
		if err == nil {
			return ack, nil
		}
		if p.closed.Load() {
			return nil, ErrPublisherClosed
		}
		if !transientJSError(err) {
			return nil, err
		}
		cause = err
	}
}

func (p *Publisher) resolve(pd *pending, a *jetstream.PubAck, err error) {
	n := pd.events()
	if err == nil && a != nil {
		pd.ack = PublishAck{EventID: pd.last, Stream: a.Stream, Sequence: a.Sequence, Duplicate: a.Duplicate}
		p.acked.Add(uint64(n))
		if a.Duplicate {
			p.dups.Add(uint64(n))
		}
	} else {
		if err == nil {
			err = errors.New("empty ack")
		}
		if errors.Is(err, pd.sendErr) {
			pd.err = err
		} else {
			pd.err = fmt.Errorf("publish %s: %w", pd.msg.Header.Get(jetstream.MsgIDHeader), err)
		}
		p.failed.Add(uint64(n))
		p.log.Error("events not published", "event_ids", pd.label(), "err", err)
	}
	// Report first, then let Publish and Flush return: a caller that
	// returns from Flush sees every callback of what it flushed.
	for id := pd.first; ; id++ {
		if pd.err == nil {
			if p.opts.onAck != nil {
				a := pd.ack
				a.EventID = id
				p.opts.onAck(a)
			}
		} else if p.opts.onError != nil {
			p.opts.onError(id, pd.err)
		}
		if id == pd.last {
			break
		}
	}
	p.mu.Lock()
	if len(p.queue) > 0 && p.queue[0] == pd {
		p.queue[0] = nil
		p.queue = p.queue[1:]
		p.inflight -= n
	}
	if len(p.queue) == 0 {
		if p.blocked != nil {
			close(p.blocked)
			p.blocked = nil
			// Events that lingered behind the block go now.
			if !p.closed.Load() {
				p.seal(0)
			}
		}
	}
	if len(p.queue) == 0 && p.open.pd == nil && p.empty != nil {
		close(p.empty)
		p.empty = nil
	}
	p.mu.Unlock()
	close(pd.done)
	for range n {
		<-p.sem
	}
}

// Flush sends the open batch and waits until every event sent so far is
// acknowledged or given up.
func (p *Publisher) Flush(ctx context.Context) error {
	p.mu.Lock()
	if p.blocked == nil {
		p.seal(0)
	}
	if len(p.queue) == 0 && p.open.pd == nil {
		p.mu.Unlock()
		return nil
	}
	if p.empty == nil {
		p.empty = make(chan struct{})
	}
	ch := p.empty
	p.mu.Unlock()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("flush: %d events in flight: %w", p.Stats().InFlight, ctx.Err())
	case <-p.done:
		return ErrPublisherClosed
	}
}

// Close stops the publisher. Events not yet acknowledged are reported
// through OnError with ErrPublisherClosed: they may or may not be in the
// stream (a ledger counts them as unknown). Call Flush first to wait.
func (p *Publisher) Close() {
	if p.closed.Swap(true) {
		return
	}
	close(p.done)
	p.cancel()
	p.wg.Wait()
	p.mu.Lock()
	left := p.queue
	p.queue = nil
	if o := p.open.pd; o != nil { // never sent
		if p.open.timer != nil {
			p.open.timer.Stop()
		}
		p.open.pd = nil
		left = append(left, o)
	}
	p.inflight = 0
	if p.empty != nil {
		close(p.empty)
		p.empty = nil
	}
	p.mu.Unlock()
	for _, pd := range left {
		pd.err = fmt.Errorf("events %s: %w", pd.label(), ErrPublisherClosed)
		p.failed.Add(uint64(pd.events()))
		close(pd.done)
		if p.opts.onError != nil {
			for id := pd.first; ; id++ {
				p.opts.onError(id, pd.err)
				if id == pd.last {
					break
				}
			}
		}
	}
	p.js.CleanupPublisher()
}

// Stats returns the publisher's counters.
func (p *Publisher) Stats() PublisherStats {
	p.mu.Lock()
	inflight := p.inflight
	p.mu.Unlock()
	return PublisherStats{
		Published:  p.published.Load(),
		Acked:      p.acked.Load(),
		Duplicates: p.dups.Load(),
		Retries:    p.retries.Load(),
		Failed:     p.failed.Load(),
		InFlight:   inflight,
	}
}
