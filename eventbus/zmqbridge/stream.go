package zmqbridge

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/router"
)

// Replayer asks an engine's replay socket for the batches it still buffers.
type Replayer interface {
	// Replay requests every buffered batch from sequence number from on
	// and calls fn with each, in order, until the engine's end marker. An
	// error from fn stops the replay and is returned.
	Replay(ctx context.Context, from uint64, fn func(Frame) error) error
}

// Sink publishes one worker rank's converted events, in order.
type Sink interface {
	Emit(ctx context.Context, evs []router.KVEvent) error
}

// StreamStats are one stream's cumulative counters.
type StreamStats struct {
	Worker string `json:"worker"`
	DPRank uint32 `json:"dp_rank"`

	Batches          uint64 `json:"batches"`           // batches applied (live and replayed)
	Events           uint64 `json:"events"`            // engine events decoded
	MalformedFrames  uint64 `json:"malformed_frames"`  // ZMQ messages not of the wire format (dropped)
	MalformedBatches uint64 `json:"malformed_batches"` // payloads that did not decode (the batch is lost)
	MalformedEvents  uint64 `json:"malformed_events"`  // single events that did not decode (skipped)
	Duplicates       uint64 `json:"duplicates"`        // live batches already applied through a replay
	Gaps             uint64 `json:"gaps"`              // sequence gaps seen
	Replays          uint64 `json:"replays"`           // replay requests made
	ReplayedBatches  uint64 `json:"replayed_batches"`  // batches applied from replays
	ReplayFailures   uint64 `json:"replay_failures"`   // replay requests that failed (timeout, socket)
	ReplayMismatches uint64 `json:"replay_mismatches"` // replays that did not start where asked
	Restarts         uint64 `json:"restarts"`          // sequence went backwards: engine restarted
	Resyncs          uint64 `json:"resyncs"`           // the worker rank's blocks were cleared and rebuilt
	HistoryLost      uint64 `json:"history_lost"`      // resyncs that could not replay the engine's whole history
	Reconnects       uint64 `json:"reconnects"`        // SUB connection lost and made again
	DPRankMismatches uint64 `json:"dp_rank_mismatches"`
	PublishRejected  uint64 `json:"publish_rejected"` // events the publisher refused as invalid (bug)
	Republished      uint64 `json:"republished"`      // full-state republications (resync requests, rejections)
	Published        uint64 `json:"published"`        // router events handed to the publisher
	OversizedFrames  uint64 `json:"oversized_frames"` // connections dropped for a frame header over the cap
	ZMQPanics        uint64 `json:"zmq_panics"`       // panics recovered from zmq4 on this rank's sockets
	HaveSeq          bool   `json:"have_seq"`
	LastSeq          uint64 `json:"last_seq"` // last sequence number applied
	Blocks           int    `json:"blocks"`   // engine hashes held

	Converter ConverterStats `json:"converter"`
}

// StreamConfig configures a Stream.
type StreamConfig struct {
	Worker    string
	DPRank    uint32
	BlockSize int
	// MaxEntries bounds the engine→content mapping (0: DefaultMaxEntries).
	MaxEntries int
	// MaxEventBlocks splits longer events (0: DefaultMaxEventBlocks).
	MaxEventBlocks int
	// Replayer is nil when the engine has no replay endpoint: every gap
	// then costs a reset of the worker rank's blocks.
	Replayer Replayer
	Sink     Sink
	Logger   *slog.Logger
	// Schema reads the engine's array-shaped events ("": SchemaVLLM).
	Schema Schema
	// Group, when set, is the only KV cache group indexed; unset: chosen
	// from the events (see groups.go).
	Group GroupIndex
	// LowerTiers are the lower storage tiers whose events are published
	// with their tier (Converter.KeepTiers); the others are skipped as
	// other_medium. Empty: the device tier alone, as before tiers.
	LowerTiers []router.Tier
}

// Stream follows one engine publisher (one data-parallel rank): it checks
// sequence numbers, repairs gaps from the replay socket, decodes and
// converts batches and hands the router events to its sink. It is driven
// by one goroutine (HandleLive, Disconnected, Republish); Stats may be
// called from any.
//
// Sequence rules. The next sequence number applies. A gap asks the replay
// socket for everything from the last applied batch on: the first reply
// must be that batch, byte for byte, or the engine is not the one we were
// following (it restarted) or has dropped that part of its history; then
// the worker rank is resynced from scratch: its blocks are cleared and the
// engine's history replayed from sequence 0, as far as the engine still
// buffers it. A sequence number that goes backwards means the engine
// restarted: the same resync. Live batches that a replay already applied
// are skipped. After the SUB connection was lost, the next batch is
// verified the same way even without a gap.
type Stream struct {
	cfg  StreamConfig
	log  *slog.Logger
	conv *Converter
	tr   tracker

	st      streamCounters
	wire    WireCounters // the rank's SUB and replay sockets count into it
	statsMu sync.Mutex
	convSt  ConverterStats
	blocks  int

	logMu   sync.Mutex
	lastLog map[string]time.Time
}

type streamCounters struct {
	batches, events, malformedFrames, malformedBatches, malformedEvents atomic.Uint64
	duplicates, gaps, replays, replayedBatches, replayFailures          atomic.Uint64
	replayMismatches, restarts, resyncs, historyLost, reconnects        atomic.Uint64
	dpRankMismatches, publishRejected, republished, published           atomic.Uint64
	lastSeq                                                             atomic.Uint64
	haveSeq                                                             atomic.Bool
}

// tracker is the sequence state.
type tracker struct {
	started    bool
	next       uint64 // next sequence number expected
	haveLast   bool   // a batch was applied since the last reset
	lastDigest uint64 // xxh3 of the last applied payload
	dupActive  bool   // live batches in [dupFloor, next) were applied by a replay
	dupFloor   uint64
	suspect    bool // the connection was lost: verify before applying
}

type verdict int

const (
	vFirst verdict = iota
	vNext
	vGap
	vDuplicate
	vBackwards
)

func (t *tracker) classify(seq uint64) verdict {
	switch {
	case !t.started:
		return vFirst
	case seq == t.next:
		t.dupActive = false
		return vNext
	case seq > t.next:
		t.dupActive = false
		return vGap
	case t.dupActive && seq >= t.dupFloor:
		return vDuplicate
	}
	return vBackwards
}

func (t *tracker) applied(seq uint64, payload []byte) {
	t.started = true
	t.next = seq + 1
	t.haveLast = true
	t.lastDigest = xxh3.Hash(payload)
}

// NewStream returns a stream; call Start before anything else.
func NewStream(cfg StreamConfig) *Stream {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.MaxEventBlocks <= 0 {
		cfg.MaxEventBlocks = DefaultMaxEventBlocks
	}
	conv := NewConverter(cfg.BlockSize, cfg.MaxEntries)
	conv.KeepTiers(cfg.LowerTiers...)
	if g, ok := cfg.Group.Get(); ok {
		conv.FollowGroup(int64(g))
	}
	return &Stream{
		cfg:     cfg,
		log:     cfg.Logger.With("worker", cfg.Worker, "dp_rank", cfg.DPRank),
		conv:    conv,
		lastLog: map[string]time.Time{},
	}
}

// Start publishes the cleared event that opens the stream: the bridge
// knows nothing of the engine's cache yet.
func (s *Stream) Start(ctx context.Context) error {
	err := s.emit(ctx, s.conv.ResetAll())
	s.syncStats()
	return err
}

// CatchUp reads the engine's history from its replay socket before any
// live batch arrived, so a bridge started next to a running (or idle)
// engine learns its cache at once. A fresh engine replays nothing and the
// stream waits for its first batch. Live batches the replay covered are
// skipped when they arrive.
func (s *Stream) CatchUp(ctx context.Context) error {
	if s.cfg.Replayer == nil || s.tr.started {
		return nil
	}
	first, firstSeq := true, uint64(0)
	s.st.replays.Add(1)
	err := s.cfg.Replayer.Replay(ctx, 0, func(r Frame) error {
		if first {
			first, firstSeq = false, r.Seq
			s.tr = tracker{started: true, next: r.Seq}
		}
		if r.Seq != s.tr.next {
			return errNotInSeq
		}
		s.st.replayedBatches.Add(1)
		return s.apply(ctx, r)
	})
	defer s.syncStats()
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err != nil && !errors.Is(err, errNotInSeq) {
		s.st.replayFailures.Add(1)
		s.warnLimited("replay_failed", "catch-up replay failed; waiting for live batches", "err", err)
	}
	if first {
		return nil
	}
	if firstSeq != 0 {
		s.st.historyLost.Add(1)
		s.log.Warn("the engine's replay buffer no longer starts at 0: blocks stored before are not indexed until stored again",
			"replay_from", firstSeq)
	}
	s.log.Info("caught up with the engine's history", "batches", s.tr.next-firstSeq, "blocks", s.conv.Len())
	s.tr.dupActive, s.tr.dupFloor = true, firstSeq
	return nil
}

// Disconnected tells the stream its SUB connection was lost and made
// again, without checking now: the next batch is verified against the
// replay socket.
func (s *Stream) Disconnected() {
	s.st.reconnects.Add(1)
	s.tr.suspect = true
}

// Reconnected is called when the SUB connection was lost and made again.
// The engine may have restarted, or published batches meanwhile: the
// stream asks the replay socket at once for everything from the last batch
// it applied. The same engine replays that batch byte for byte and then
// what was missed; anything else (another history, nothing at all) is a
// restarted engine, and the worker rank is resynced from its new history.
// When the replay socket cannot be asked, the next live batch is verified
// instead.
func (s *Stream) Reconnected(ctx context.Context) error {
	s.st.reconnects.Add(1)
	defer s.syncStats()
	if s.cfg.Replayer == nil {
		s.tr.suspect = true
		return nil
	}
	if !s.tr.started {
		return s.CatchUp(ctx)
	}
	if !s.tr.haveLast {
		return nil // nothing applied since the last reset: nothing to verify
	}
	anchor := s.tr.next - 1
	verified := false
	s.st.replays.Add(1)
	err := s.cfg.Replayer.Replay(ctx, anchor, func(r Frame) error {
		if !verified {
			if r.Seq != anchor || xxh3.Hash(r.Payload) != s.tr.lastDigest {
				return errMismatch
			}
			verified = true
			return nil
		}
		if r.Seq != s.tr.next {
			return errNotInSeq
		}
		s.st.replayedBatches.Add(1)
		return s.apply(ctx, r)
	})
	if ctx.Err() != nil {
		return ctx.Err()
	}
	switch {
	case verified:
		s.tr.dupActive, s.tr.dupFloor = true, anchor+1
		return nil
	case err == nil || errors.Is(err, errMismatch):
		s.st.replayMismatches.Add(1)
		s.st.restarts.Add(1)
		s.st.resyncs.Add(1)
		s.log.Warn("the engine restarted while disconnected: resyncing the worker rank from its new history", "last_seq", anchor)
		if err := s.emit(ctx, s.conv.ResetAll()); err != nil {
			return err
		}
		s.tr = tracker{}
		return s.CatchUp(ctx)
	}
	s.st.replayFailures.Add(1)
	s.warnLimited("replay_failed", "cannot verify the engine after reconnecting; verifying with the next batch", "err", err)
	s.tr.suspect = true
	return nil
}

// Republish publishes the stream's whole state again (a cleared event and
// every block held), e.g. to answer a resync request.
func (s *Stream) Republish(ctx context.Context) error {
	s.st.republished.Add(1)
	err := s.emit(ctx, s.conv.Snapshot(s.cfg.MaxEventBlocks))
	s.syncStats()
	return err
}

// HandleLive processes one message of the SUB socket. It returns only
// errors that end the stream (ctx cancelled, sink closed); everything the
// engine gets wrong is counted, logged and repaired.
func (s *Stream) HandleLive(ctx context.Context, frames [][]byte) error {
	f, err := ParseLive(frames)
	if err != nil {
		s.st.malformedFrames.Add(1)
		s.warnLimited("malformed_frame", "dropping a malformed ZMQ message", "err", err)
		return nil
	}
	err = s.handle(ctx, f)
	s.syncStats()
	return err
}

func (s *Stream) handle(ctx context.Context, f Frame) error {
	v := s.tr.classify(f.Seq)
	if s.tr.suspect && v != vDuplicate {
		s.tr.suspect = false
		if v == vNext {
			v = vGap // verify that this is still the engine we followed
		}
	}
	switch v {
	case vNext:
		return s.apply(ctx, f)
	case vDuplicate:
		s.st.duplicates.Add(1)
		return nil
	case vFirst:
		if f.Seq == 0 {
			return s.apply(ctx, f)
		}
		return s.fromScratch(ctx, f, "the engine was running before the bridge: replaying its history")
	case vBackwards:
		s.st.restarts.Add(1)
		return s.fromScratch(ctx, f, fmt.Sprintf("sequence went back from %d to %d: the engine restarted", s.tr.next-1, f.Seq))
	}
	if f.Seq > s.tr.next {
		s.st.gaps.Add(1)
	}
	return s.recover(ctx, f)
}

var (
	errMismatch  = errors.New("replay does not start where asked")
	errNotInSeq  = errors.New("replay out of sequence")
	errStopEarly = errors.New("stop")
)

// recover closes a gap (or verifies after a reconnect) from the replay
// socket, starting at the last applied batch.
func (s *Stream) recover(ctx context.Context, f Frame) error {
	if s.cfg.Replayer == nil || !s.tr.haveLast {
		return s.fromScratch(ctx, f, fmt.Sprintf("gap before sequence %d (expected %d) and nothing to replay from", f.Seq, s.tr.next))
	}
	anchor := s.tr.next - 1
	verified := false
	s.st.replays.Add(1)
	err := s.cfg.Replayer.Replay(ctx, anchor, func(r Frame) error {
		if !verified {
			if r.Seq != anchor || xxh3.Hash(r.Payload) != s.tr.lastDigest {
				return errMismatch
			}
			verified = true
			return nil
		}
		if r.Seq != s.tr.next {
			return errNotInSeq
		}
		if r.Seq > f.Seq {
			return errStopEarly // caught up with the live message
		}
		s.st.replayedBatches.Add(1)
		return s.apply(ctx, r)
	})
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err != nil && !errors.Is(err, errStopEarly) {
		if errors.Is(err, errMismatch) {
			s.st.replayMismatches.Add(1)
		} else if !errors.Is(err, errNotInSeq) {
			s.st.replayFailures.Add(1)
			s.warnLimited("replay_failed", "replay request failed", "from", anchor, "err", err)
		}
	}
	if !verified {
		if err == nil {
			s.st.replayMismatches.Add(1) // the engine no longer has the anchor
		}
		return s.fromScratch(ctx, f, fmt.Sprintf("the engine's replay does not continue batch %d that the bridge applied (engine restarted, or its replay buffer overflowed)", anchor))
	}
	switch {
	case f.Seq < s.tr.next:
		s.st.duplicates.Add(1)
		s.tr.dupActive, s.tr.dupFloor = true, anchor+1
		return nil
	case f.Seq == s.tr.next:
		return s.apply(ctx, f)
	}
	return s.fromScratch(ctx, f, fmt.Sprintf("the replay ended at %d, before live batch %d", s.tr.next, f.Seq))
}

// fromScratch resyncs the worker rank: clear its blocks, then rebuild them
// from the engine's history as far as the replay socket still has it, and
// carry on with the live batch f.
func (s *Stream) fromScratch(ctx context.Context, f Frame, reason string) error {
	s.st.resyncs.Add(1)
	s.log.Warn("resyncing the worker rank from scratch", "reason", reason, "live_seq", f.Seq)
	if err := s.emit(ctx, s.conv.ResetAll()); err != nil {
		return err
	}
	s.tr = tracker{started: true, next: f.Seq}
	if f.Seq == 0 {
		return s.apply(ctx, f) // a fresh engine: nothing came before
	}
	if s.cfg.Replayer == nil {
		s.st.historyLost.Add(1)
		s.log.Warn("no replay endpoint: the index holds only the blocks stored from now on", "from_seq", f.Seq)
		return s.apply(ctx, f)
	}
	first, firstSeq := true, uint64(0)
	s.st.replays.Add(1)
	err := s.cfg.Replayer.Replay(ctx, 0, func(r Frame) error {
		if first {
			first, firstSeq = false, r.Seq
			s.tr.next = r.Seq
		}
		if r.Seq != s.tr.next {
			return errNotInSeq
		}
		if r.Seq > f.Seq {
			return errStopEarly
		}
		s.st.replayedBatches.Add(1)
		return s.apply(ctx, r)
	})
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err != nil && !errors.Is(err, errStopEarly) && !errors.Is(err, errNotInSeq) {
		s.st.replayFailures.Add(1)
		s.warnLimited("replay_failed", "replay request failed", "from", 0, "err", err)
	}
	if first {
		// Nothing replayed: the index holds what is stored from here on.
		s.st.historyLost.Add(1)
		s.log.Warn("the engine replayed nothing: the index holds only the blocks stored from now on", "from_seq", f.Seq)
		s.tr = tracker{started: true, next: f.Seq}
		return s.apply(ctx, f)
	}
	if firstSeq != 0 {
		s.st.historyLost.Add(1)
		s.log.Warn("the engine's replay buffer no longer starts at 0: blocks stored before are not indexed until stored again",
			"replay_from", firstSeq)
	}
	switch {
	case f.Seq < s.tr.next:
		s.st.duplicates.Add(1)
		s.tr.dupActive, s.tr.dupFloor = true, firstSeq
		return nil
	case f.Seq == s.tr.next:
		return s.apply(ctx, f)
	}
	// The replay broke off before the live batch: what lies between is
	// lost and may hold removals. Clear again and go on from f: the index
	// then holds a subset of the engine's blocks, never one it lacks.
	s.st.historyLost.Add(1)
	s.log.Warn("the replay broke off before the live batch: clearing again", "replayed_to", s.tr.next, "live_seq", f.Seq)
	if err := s.emit(ctx, s.conv.ResetAll()); err != nil {
		return err
	}
	s.tr = tracker{started: true, next: f.Seq}
	return s.apply(ctx, f)
}

// apply decodes, converts and publishes one batch and records its sequence
// number as applied.
func (s *Stream) apply(ctx context.Context, f Frame) error {
	s.tr.applied(f.Seq, f.Payload)
	s.st.batches.Add(1)
	s.st.lastSeq.Store(f.Seq)
	s.st.haveSeq.Store(true)
	b, err := DecodeBatchAs(f.Payload, s.cfg.Schema)
	if err != nil {
		s.st.malformedBatches.Add(1)
		s.warnLimited("malformed_batch", "dropping a batch that does not decode", "seq", f.Seq, "err", err)
		return nil
	}
	if b.HasDPRank && b.DPRank != int64(s.cfg.DPRank) {
		s.st.dpRankMismatches.Add(1)
		s.warnLimited("dp_rank", "batch names another data-parallel rank than this endpoint's; attributing it to the endpoint's rank",
			"batch_dp_rank", b.DPRank)
	}
	for _, bad := range b.Bad {
		if errors.Is(bad.Err, ErrUnknownLayout) {
			// Refused, not garbage: the engine sends a shape this worker's
			// schema does not have (another engine or version).
			s.conv.CountSkip(SkipUnknownLayout)
			s.errorLimited("unknown_layout", "REFUSED: an engine event does not have the layout of this worker's event schema; "+
				"set the worker's engine and engine_version (or event_schema) to the engine's",
				"seq", f.Seq, "schema", s.cfg.Schema, "err", bad)
			continue
		}
		s.st.malformedEvents.Add(1)
		s.warnLimited("malformed_event", "skipping an event that does not decode", "seq", f.Seq, "err", bad)
	}
	s.st.events.Add(uint64(len(b.Events)))
	var out []router.KVEvent
	for i := range b.Events {
		var err error
		out, err = s.conv.Convert(&b.Events[i], out)
		var se *SkipError
		if errors.As(err, &se) {
			if se.Reason == SkipUnknownGroup {
				s.errorLimited("unknown_group", "REFUSED: a hybrid model's KV events do not say which KV cache group is full attention; "+
					"nothing of this worker is indexed until its kv_cache_group names that group (or the engine sends kv_cache_spec_kind)",
					"err", se)
			} else if se.Reason == SkipBlockSizeMismatch {
				s.errorLimited("block_size", "REJECTED: the engine's KV block size differs from the router's; no block of this worker can ever match. Restart the engine with the router's block size (vLLM --block-size, SGLang --page-size) or fix --block-size",
					"err", se)
			} else if se.Reason != SkipOtherMedium && se.Reason != SkipOtherGroup {
				s.debugLimited(string(se.Reason), "engine event skipped", "seq", f.Seq, "err", se)
			}
		}
	}
	return s.emit(ctx, out)
}

// emit publishes evs; an event the publisher rejects as invalid (a bug,
// retrying cannot help) is answered by republishing the whole state.
func (s *Stream) emit(ctx context.Context, evs []router.KVEvent) error {
	if len(evs) == 0 {
		return nil
	}
	evs = Split(evs, s.cfg.MaxEventBlocks)
	err := s.cfg.Sink.Emit(ctx, evs)
	s.st.published.Add(uint64(len(evs)))
	if err == nil || !errors.Is(err, eventbus.ErrInvalidEvent) {
		return err
	}
	s.st.publishRejected.Add(1)
	s.log.Error("the publisher rejected a converted event; republishing the full state", "err", err)
	s.st.republished.Add(1)
	if err := s.cfg.Sink.Emit(ctx, s.conv.Snapshot(s.cfg.MaxEventBlocks)); err != nil {
		if errors.Is(err, eventbus.ErrInvalidEvent) {
			return fmt.Errorf("worker %s rank %d: full state rejected: %w", s.cfg.Worker, s.cfg.DPRank, err)
		}
		return err
	}
	return nil
}

func (s *Stream) syncStats() {
	cs := s.conv.Stats()
	n := s.conv.Len()
	s.statsMu.Lock()
	s.convSt, s.blocks = cs, n
	s.statsMu.Unlock()
}

// Wire is the counters the stream's ZMQ sockets report into.
func (s *Stream) Wire() *WireCounters { return &s.wire }

// Stats returns the stream's counters.
func (s *Stream) Stats() StreamStats {
	st := &s.st
	out := StreamStats{
		Worker: s.cfg.Worker, DPRank: s.cfg.DPRank,
		Batches: st.batches.Load(), Events: st.events.Load(), MalformedFrames: st.malformedFrames.Load(),
		MalformedBatches: st.malformedBatches.Load(), MalformedEvents: st.malformedEvents.Load(),
		Duplicates: st.duplicates.Load(), Gaps: st.gaps.Load(), Replays: st.replays.Load(),
		ReplayedBatches: st.replayedBatches.Load(), ReplayFailures: st.replayFailures.Load(),
		ReplayMismatches: st.replayMismatches.Load(), Restarts: st.restarts.Load(), Resyncs: st.resyncs.Load(),
		HistoryLost: st.historyLost.Load(), Reconnects: st.reconnects.Load(), DPRankMismatches: st.dpRankMismatches.Load(),
		PublishRejected: st.publishRejected.Load(), Republished: st.republished.Load(), Published: st.published.Load(),
		HaveSeq: st.haveSeq.Load(), LastSeq: st.lastSeq.Load(),
		OversizedFrames: s.wire.Oversized.Load(), ZMQPanics: s.wire.Panics.Load(),
	}
	s.statsMu.Lock()
	out.Converter, out.Blocks = s.convSt, s.blocks
	s.statsMu.Unlock()
	return out
}

const logEvery = 10 * time.Second

func (s *Stream) limited(key string) bool {
	s.logMu.Lock()
	defer s.logMu.Unlock()
	now := time.Now()
	if last, ok := s.lastLog[key]; ok && now.Sub(last) < logEvery {
		return false
	}
	s.lastLog[key] = now
	return true
}

func (s *Stream) warnLimited(key, msg string, args ...any) {
	if s.limited(key) {
		s.log.Warn(msg, args...)
	}
}

func (s *Stream) errorLimited(key, msg string, args ...any) {
	if s.limited(key) {
		s.log.Error(msg, args...)
	}
}

func (s *Stream) debugLimited(key, msg string, args ...any) {
	if s.limited(key) {
		s.log.Debug(msg, args...)
	}
}
