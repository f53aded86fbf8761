package eventbus

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/router"
)

// SyncOp is a replica-sync operation. The numbers are on the wire: append
// only.
type SyncOp uint8

// Replica-sync operations.
const (
	SyncAdd         SyncOp = 1 // a request was routed to a worker
	SyncPrefillDone SyncOp = 2 // its prefill finished (first token); also carries output progress (Syncer.Output)
	SyncFree        SyncOp = 3 // it finished
	SyncFull        SyncOp = 4 // the sender's whole active set (repairs losses)
	// SyncTenants is the sender's tenants' usage (tenant fairness,
	// SyncMsg.Tenants), absolute, so a lost message is repaired by the
	// next. Added after the first release: an older replica reads the
	// message (its sequence number counts, so no gap) and applies nothing,
	// counting it undecodable.
	SyncTenants SyncOp = 5
)

func (o SyncOp) String() string {
	switch o {
	case SyncAdd:
		return "add"
	case SyncPrefillDone:
		return "prefill_done"
	case SyncFree:
		return "free"
	case SyncFull:
		return "full"
	case SyncTenants:
		return "tenants"
	}
	return fmt.Sprintf("op(%d)", uint8(o))
}

// ActiveRequest is one request a replica routed and has not seen finish.
type ActiveRequest struct {
	Request     string          `msgpack:"q"`
	Worker      router.WorkerID `msgpack:"w"`
	Hashes      []uint64        `msgpack:"h,omitempty"` // the prompt's block (sequence) hashes
	ISL         int             `msgpack:"n,omitempty"` // prompt tokens
	Overlap     int             `msgpack:"o,omitempty"` // blocks the worker had cached
	PrefillDone bool            `msgpack:"d,omitempty"`
	// Sequences is OpenAI's n (router.Booking.Sequences); 0 means 1. Added
	// after the first release under a new key: an older peer skips the key
	// (and books one sequence, as it always did), and a message from an
	// older peer decodes to 0.
	Sequences int `msgpack:"k,omitempty"`
	// Output progress (Dynamo's --router-track-output-blocks,
	// router.OutputProgress): the output blocks booked so far, and the
	// tokens per sequence and expected output their decay derives from.
	// New keys: an older peer skips them (and counts no output blocks, as
	// it always did); a message without them means none.
	OutputBlocks   int `msgpack:"ob,omitempty"`
	Generated      int `msgpack:"g,omitempty"`
	ExpectedOutput int `msgpack:"x,omitempty"`
}

// Progress is r's output progress, within the limits below.
func (r ActiveRequest) Progress() router.OutputProgress {
	return clampOutput(router.OutputProgress{Blocks: r.OutputBlocks, Generated: r.Generated, Expected: r.ExpectedOutput})
}

// Limits on a peer's output progress: no kvrouter replica announces more
// (a million blocks is beyond any context length), so a larger value must
// not grow a worker's load without bound.
const (
	MaxSyncOutputBlocks = 1 << 20
	MaxSyncOutputTokens = 1 << 30
)

// clampOutput keeps received progress within the limits (negative: 0).
func clampOutput(o router.OutputProgress) router.OutputProgress {
	return router.OutputProgress{Blocks: min(max(o.Blocks, 0), MaxSyncOutputBlocks),
		Generated: min(max(o.Generated, 0), MaxSyncOutputTokens), Expected: min(max(o.Expected, 0), MaxSyncOutputTokens)}
}

// MaxSyncSequences caps the sequences a peer's message can book: api caps n
// at the same number, so a larger value is not from a kvrouter replica and
// must not inflate a worker's request count without bound.
const MaxSyncSequences = 1024

// clampSequences keeps a received count in [0, MaxSyncSequences] (0 and
// negative mean one sequence).
func clampSequences(n int) int { return min(max(n, 0), MaxSyncSequences) }

// SyncMsg is one replica-sync message on kv.sync.<model>. Seq counts the
// sender's messages (one sequence per Epoch, i.e. per process start), so a
// receiver detects losses; a SyncFull carries the whole active set.
type SyncMsg struct {
	Replica string          `msgpack:"r"`
	Epoch   uint64          `msgpack:"e"`
	Seq     uint64          `msgpack:"s"`
	Op      SyncOp          `msgpack:"op"`
	Request string          `msgpack:"q,omitempty"`
	Worker  router.WorkerID `msgpack:"w,omitempty"`
	Hashes  []uint64        `msgpack:"h,omitempty"`
	ISL     int             `msgpack:"n,omitempty"`
	Overlap int             `msgpack:"o,omitempty"`
	Full    []ActiveRequest `msgpack:"f,omitempty"`
	// Sequences of a SyncAdd (ActiveRequest.Sequences; same key, same
	// compatibility).
	Sequences int `msgpack:"k,omitempty"`
	// Output progress of a SyncPrefillDone (ActiveRequest's keys, same
	// compatibility): a first token is implied by any output, so an older
	// peer reads the message as the prefill-done it may already have seen,
	// which changes nothing, and skips the keys.
	OutputBlocks   int `msgpack:"ob,omitempty"`
	Generated      int `msgpack:"g,omitempty"`
	ExpectedOutput int `msgpack:"x,omitempty"`
	// Tenants of a SyncTenants, in format TenantsVersion. A receiver
	// applies only the version it knows (TenantUsageVersion): a later
	// format must take a new version number, and older receivers then
	// ignore it rather than misread it.
	Tenants        []TenantUsage `msgpack:"tu,omitempty"`
	TenantsVersion uint8         `msgpack:"tv,omitempty"`
}

// TenantUsageVersion is the format of SyncMsg.Tenants this build writes
// and reads.
const TenantUsageVersion = 1

// TenantUsage is one tenant's state on the sending replica (api's
// TenantLedger): the tokens it charged the tenant since it started (and
// the floor the tenant was lifted to, both only grow within an epoch), and
// the tenant's requests waiting there (Class: the highest class among
// them) and in flight.
type TenantUsage struct {
	Model    string `msgpack:"m"`
	Tenant   string `msgpack:"t"`
	Tokens   uint64 `msgpack:"u,omitempty"`
	Lift     uint64 `msgpack:"f,omitempty"`
	Waiting  int    `msgpack:"w,omitempty"`
	Class    uint32 `msgpack:"c,omitempty"`
	Inflight int    `msgpack:"i,omitempty"`
}

// Limits on a peer's tenant usage: no kvrouter replica sends more (api
// caps tenants per model at 1024 by default, ids at 64 bytes), so larger
// values are not from one and must neither grow the receiver's ledger
// without bound nor overflow its sums.
const (
	MaxSyncTenants      = 1 << 14
	MaxSyncTenantID     = 256
	MaxSyncTenantTokens = 1 << 50 // ~10^15 tokens: sums of a thousand replicas stay far below 2^64
	MaxSyncTenantCount  = 1 << 20 // waiting or in-flight requests
)

// clampTenants drops malformed entries (no model or tenant, ids too long)
// and clamps the counts, keeping at most MaxSyncTenants.
func clampTenants(in []TenantUsage) []TenantUsage {
	out := make([]TenantUsage, 0, min(len(in), MaxSyncTenants))
	for _, u := range in {
		if len(out) == MaxSyncTenants {
			break
		}
		if u.Model == "" || u.Tenant == "" || len(u.Model) > MaxSyncTenantID || len(u.Tenant) > MaxSyncTenantID {
			continue
		}
		u.Tokens, u.Lift = min(u.Tokens, MaxSyncTenantTokens), min(u.Lift, MaxSyncTenantTokens)
		u.Waiting, u.Inflight = min(max(u.Waiting, 0), MaxSyncTenantCount), min(max(u.Inflight, 0), MaxSyncTenantCount)
		out = append(out, u)
	}
	return out
}

// TenantSink is the optional part of a LoadSink that takes other
// replicas' tenant usage (the Syncer finds it by type assertion). A
// replica's usage is replaced whole by each message; DropReplica drops it
// with the replica's load.
type TenantSink interface {
	TenantsRemote(replica string, usage []TenantUsage)
}

// LoadSink receives other replicas' load, in the order each replica sent
// it. The Syncer calls it from one goroutine at a time; it must not block
// and must not call the Syncer.
type LoadSink interface {
	// AddRemote: replica routed req.
	AddRemote(replica string, req ActiveRequest)
	// PrefillDoneRemote: the prefill of replica's request finished.
	PrefillDoneRemote(replica, request string)
	// OutputRemote: replica's request generated output: out is its
	// absolute progress (router.ActiveLoad.SetOutput).
	OutputRemote(replica, request string, out router.OutputProgress)
	// FreeRemote: replica's request finished.
	FreeRemote(replica, request string)
	// ReplaceReplica: replica's active set is exactly active (a snapshot;
	// nil after a restart of that replica).
	ReplaceReplica(replica string, active []ActiveRequest)
	// DropReplica: replica went silent; forget all its load.
	DropReplica(replica string)
}

// Clock is the time source of the Syncer (a fake one in tests).
type Clock interface {
	Now() time.Time
	NewTicker(d time.Duration) Ticker
}

// Ticker is Clock's ticker.
type Ticker interface {
	C() <-chan time.Time
	Stop()
}

// SystemClock is the real clock.
type SystemClock struct{}

// Now is time.Now.
func (SystemClock) Now() time.Time { return time.Now() }

// NewTicker wraps time.NewTicker.
func (SystemClock) NewTicker(d time.Duration) Ticker { return realTicker{time.NewTicker(d)} }

type realTicker struct{ t *time.Ticker }

func (r realTicker) C() <-chan time.Time { return r.t.C }
func (r realTicker) Stop()               { r.t.Stop() }

// SyncConfig configures a Syncer. Zero fields take the defaults.
type SyncConfig struct {
	Replica      string        // this replica's id (required)
	Model        string        // "" = "all"
	FullInterval time.Duration // full snapshot period (default 1s)
	ExpireAfter  time.Duration // a replica silent this long is dropped (default 3s)
	// SweepInterval is how often expiry is checked (default ExpireAfter/6).
	SweepInterval time.Duration
	// Tenants, when set, is this replica's tenant usage, published every
	// TenantInterval when it changed and every FullInterval regardless
	// (default 100 ms): the sync lag of tenant fairness.
	Tenants        func() []TenantUsage
	TenantInterval time.Duration
	// TenantsChanged, when set, asks for a publication now (a tenant
	// started waiting somewhere): at most one per TenantNudgeGap (default
	// 5 ms) beyond the interval's.
	TenantsChanged <-chan struct{}
	TenantNudgeGap time.Duration
	Clock          Clock // default SystemClock
	Registerer     prometheus.Registerer
	Logger         *slog.Logger
}

// SyncStats are a Syncer's counters.
type SyncStats struct {
	Sent, Received uint64
	Gaps           uint64 // detected holes in another replica's sequence
	Undecodable    uint64
	Expired        uint64 // replicas dropped for silence
	Replicas       int    // replicas currently heard from
}

type remoteState struct {
	epoch    uint64
	lastSeq  uint64
	lastSeen time.Time
}

// Syncer shares this replica's transient load (requests routed, prefills
// done, requests finished) with the other replicas over NATS core, and
// feeds theirs into a LoadSink. It is fire-and-forget like Dynamo's, but
// with sequence numbers, a full snapshot every FullInterval that repairs any
// loss, and expiry of silent replicas, so a view is wrong for seconds at
// most.
type Syncer struct {
	nc      *nats.Conn
	cfg     SyncConfig
	subject string
	epoch   uint64
	sink    LoadSink
	clock   Clock
	log     *slog.Logger

	// lmu guards the local side: seq, active, and publishing (so messages
	// leave in seq order).
	lmu    sync.Mutex
	seq    uint64
	active map[string]*ActiveRequest
	// wbuf is reused for every message written by hand (appendSyncMsg):
	// publishes are serialised by lmu anyway, and nats.Conn.Publish copies
	// the bytes into its write buffer before it returns.
	wbuf []byte

	// rmu guards the remote side and serialises calls into the sink.
	rmu     sync.Mutex
	remotes map[string]*remoteState

	sent, received, gaps, undecodable, expired atomic.Uint64
	lastReceived                               atomic.Int64 // unix nanoseconds of the newest message delivered (0: none)
	mGaps, mExpired, mReceived                 prometheus.Counter
}

// NewSyncer returns a syncer for cfg.Model on nc that feeds sink. Call Run to
// start receiving and the periodic snapshots; Add, PrefillDone and Free work
// (and publish) at any time.
func NewSyncer(nc *nats.Conn, cfg SyncConfig, sink LoadSink) (*Syncer, error) {
	if cfg.Replica == "" {
		return nil, errors.New("syncer: Replica is required")
	}
	if sink == nil {
		return nil, errors.New("syncer: sink is required")
	}
	if cfg.FullInterval <= 0 {
		cfg.FullInterval = time.Second
	}
	if cfg.ExpireAfter <= 0 {
		cfg.ExpireAfter = 3 * time.Second
	}
	if cfg.SweepInterval <= 0 {
		cfg.SweepInterval = cfg.ExpireAfter / 6
	}
	if cfg.TenantInterval <= 0 {
		cfg.TenantInterval = 100 * time.Millisecond
	}
	if cfg.TenantNudgeGap <= 0 {
		cfg.TenantNudgeGap = 5 * time.Millisecond
	}
	if cfg.Clock == nil {
		cfg.Clock = SystemClock{}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	s := &Syncer{
		nc:      nc,
		cfg:     cfg,
		subject: SyncSubject(cfg.Model),
		epoch:   rand.Uint64() | 1, // never 0
		sink:    sink,
		clock:   cfg.Clock,
		log:     cfg.Logger.With("component", "replica-sync", "replica", cfg.Replica, "model", cfg.Model),
		active:  map[string]*ActiveRequest{},
		remotes: map[string]*remoteState{},
		mGaps: prometheus.NewCounter(prometheus.CounterOpts{Namespace: "kvrouter", Subsystem: "sync", Name: "gaps_total",
			Help: "Holes detected in other replicas' load-sync sequences (repaired by the next snapshot)."}),
		mExpired: prometheus.NewCounter(prometheus.CounterOpts{Namespace: "kvrouter", Subsystem: "sync", Name: "replicas_expired_total",
			Help: "Replicas whose load was dropped after silence."}),
		mReceived: prometheus.NewCounter(prometheus.CounterOpts{Namespace: "kvrouter", Subsystem: "sync", Name: "messages_received_total",
			Help: "Load-sync messages received from other replicas."}),
	}
	if cfg.Registerer != nil {
		s.mGaps = register(cfg.Registerer, s.mGaps)
		s.mExpired = register(cfg.Registerer, s.mExpired)
		s.mReceived = register(cfg.Registerer, s.mReceived)
	}
	return s, nil
}

// Run receives other replicas' messages, publishes a full snapshot every
// FullInterval and expires silent replicas, until ctx is cancelled.
func (s *Syncer) Run(ctx context.Context) error {
	sub, err := s.nc.Subscribe(s.subject, s.handle)
	if err != nil {
		return fmt.Errorf("syncer subscribe %s: %w", s.subject, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	_ = sub.SetPendingLimits(-1, 64<<20)
	// Make sure the server knows of our interest before announcing
	// ourselves, so peers' answers are not lost.
	fctx, cancel := context.WithTimeout(ctx, 5*time.Second) // FlushWithContext needs a deadline
	err = s.nc.FlushWithContext(fctx)
	cancel()
	if err != nil && ctx.Err() == nil {
		s.log.Warn("flush after subscribe failed", "err", err)
	}
	s.publishFull()
	tick := s.clock.NewTicker(s.cfg.SweepInterval)
	defer tick.Stop()
	var tenantTick <-chan time.Time // nil (never) without tenants
	if s.cfg.Tenants != nil {
		tt := s.clock.NewTicker(s.cfg.TenantInterval)
		defer tt.Stop()
		tenantTick = tt.C()
	}
	lastFull := s.clock.Now()
	var lastTenants []TenantUsage
	var lastTenantsAt time.Time
	publishTenants := func(now time.Time, force bool) {
		u := s.cfg.Tenants()
		if !force && slices.Equal(u, lastTenants) && now.Sub(lastTenantsAt) < s.cfg.FullInterval {
			return
		}
		if err := s.PublishTenants(u); err != nil {
			s.log.Debug("publish tenant usage failed", "err", err)
			return
		}
		lastTenants, lastTenantsAt = u, now
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case now := <-tenantTick:
			publishTenants(now, false)
		case <-s.cfg.TenantsChanged: // nil without tenants: never
			if now := s.clock.Now(); now.Sub(lastTenantsAt) >= s.cfg.TenantNudgeGap {
				publishTenants(now, true)
			}
		case <-tick.C():
			now := s.clock.Now()
			if now.Sub(lastFull) >= s.cfg.FullInterval {
				lastFull = now
				s.publishFull()
			}
			s.sweep(now)
		}
	}
}

// Add records and announces a request this replica routed. A request id
// already active is replaced.
func (s *Syncer) Add(req ActiveRequest) error {
	s.lmu.Lock()
	defer s.lmu.Unlock()
	r := req
	r.Hashes = slices.Clone(req.Hashes)
	s.active[req.Request] = &r
	return s.publishLocked(SyncMsg{Op: SyncAdd, Request: req.Request, Worker: req.Worker,
		Hashes: req.Hashes, ISL: req.ISL, Overlap: req.Overlap, Sequences: req.Sequences})
}

// PrefillDone announces that a request's prefill finished.
func (s *Syncer) PrefillDone(request string) error {
	s.lmu.Lock()
	defer s.lmu.Unlock()
	if r, ok := s.active[request]; ok {
		r.PrefillDone = true
	}
	return s.publishLocked(SyncMsg{Op: SyncPrefillDone, Request: request})
}

// Output announces a request's output progress (Dynamo's
// --router-track-output-blocks): the caller sends it when a new output
// block appears (router.Router.Generated reports true), so the message
// rate is at most one per output block per request, never one per token.
// The progress is absolute, so a lost message is repaired by the next one
// or the next snapshot. It rides on SyncPrefillDone (see SyncMsg).
func (s *Syncer) Output(request string, o router.OutputProgress) error {
	s.lmu.Lock()
	defer s.lmu.Unlock()
	if r, ok := s.active[request]; ok {
		r.PrefillDone = true
		r.OutputBlocks, r.Generated, r.ExpectedOutput = o.Blocks, o.Generated, o.Expected
	}
	return s.publishLocked(SyncMsg{Op: SyncPrefillDone, Request: request,
		OutputBlocks: o.Blocks, Generated: o.Generated, ExpectedOutput: o.Expected})
}

// Free announces that a request finished.
func (s *Syncer) Free(request string) error {
	s.lmu.Lock()
	defer s.lmu.Unlock()
	delete(s.active, request)
	return s.publishLocked(SyncMsg{Op: SyncFree, Request: request})
}

// PublishTenants announces this replica's tenant usage (Run does it every
// TenantInterval when SyncConfig.Tenants is set).
func (s *Syncer) PublishTenants(u []TenantUsage) error {
	s.lmu.Lock()
	defer s.lmu.Unlock()
	return s.publishLocked(SyncMsg{Op: SyncTenants, Tenants: u, TenantsVersion: TenantUsageVersion})
}

// Active returns this replica's active set, sorted by request id.
func (s *Syncer) Active() []ActiveRequest {
	s.lmu.Lock()
	defer s.lmu.Unlock()
	return s.activeLocked()
}

// activeLocked: lmu must be held.
func (s *Syncer) activeLocked() []ActiveRequest {
	out := make([]ActiveRequest, 0, len(s.active))
	for _, r := range s.active {
		out = append(out, *r)
	}
	slices.SortFunc(out, func(a, b ActiveRequest) int { return strings.Compare(a.Request, b.Request) })
	return out
}

func (s *Syncer) publishFull() {
	s.lmu.Lock()
	defer s.lmu.Unlock()
	if err := s.publishLocked(SyncMsg{Op: SyncFull, Full: s.activeLocked()}); err != nil {
		s.log.Warn("publish load snapshot failed", "err", err)
	}
}

// maxKeptSyncBuf bounds the buffer a Syncer keeps between messages: an add
// of 8,192 blocks (a 128k-token prompt at 16 tokens a block) needs ≈ 74 KiB;
// one of a larger prompt allocates its own.
const maxKeptSyncBuf = 128 << 10

// publishLocked: lmu must be held (seq order = wire order).
func (s *Syncer) publishLocked(m SyncMsg) error {
	s.seq++
	m.Replica, m.Epoch, m.Seq = s.cfg.Replica, s.epoch, s.seq
	data, ok := appendSyncMsg(s.wbuf[:0], &m)
	if ok {
		if cap(data) <= maxKeptSyncBuf {
			s.wbuf = data
		}
	} else {
		mc := m // escapes to the library; m itself stays on the stack
		var err error
		if data, err = msgpack.Marshal(&mc); err != nil {
			return fmt.Errorf("sync %s: %w", m.Op, err)
		}
	}
	if err := s.nc.Publish(s.subject, data); err != nil {
		// The sequence has a hole now; receivers count it and the next
		// snapshot repairs their view.
		return fmt.Errorf("sync %s: %w", m.Op, err)
	}
	s.sent.Add(1)
	return nil
}

// decodeSync decodes a replica-sync message after checking its shape, so no
// declared length can make the decoder allocate more than the message holds.
func decodeSync(data []byte, m *SyncMsg) error {
	if err := checkMsgpack(data); err != nil {
		return err
	}
	return msgpack.Unmarshal(data, m)
}

func (s *Syncer) handle(msg *nats.Msg) {
	var m SyncMsg
	if err := decodeSync(msg.Data, &m); err != nil || m.Replica == "" || m.Seq == 0 {
		s.undecodable.Add(1)
		return
	}
	if m.Replica == s.cfg.Replica {
		return // our own (or a misconfigured twin's)
	}
	s.deliver(m, s.clock.Now())
}

// deliver applies one message from another replica.
func (s *Syncer) deliver(m SyncMsg, now time.Time) {
	s.rmu.Lock()
	defer s.rmu.Unlock()
	s.received.Add(1)
	s.lastReceived.Store(now.UnixNano())
	s.mReceived.Inc()
	st, known := s.remotes[m.Replica]
	switch {
	case !known:
		st = &remoteState{epoch: m.Epoch}
		s.remotes[m.Replica] = st
		if m.Op != SyncFull && m.Seq != 1 {
			s.gap(m, 0) // joined mid-stream: history missing until the snapshot
		}
	case st.epoch != m.Epoch:
		// The replica restarted: its old requests are gone with it.
		s.log.Info("replica restarted", "peer", m.Replica)
		s.sink.ReplaceReplica(m.Replica, nil)
		*st = remoteState{epoch: m.Epoch}
		if m.Op != SyncFull && m.Seq != 1 {
			s.gap(m, 0)
		}
	case m.Seq <= st.lastSeq:
		st.lastSeen = now
		return // duplicate or stale
	case m.Seq != st.lastSeq+1:
		s.gap(m, st.lastSeq)
	}
	st.lastSeq, st.lastSeen = m.Seq, now
	switch m.Op {
	case SyncAdd:
		s.sink.AddRemote(m.Replica, ActiveRequest{Request: m.Request, Worker: m.Worker, Hashes: m.Hashes, ISL: m.ISL, Overlap: m.Overlap,
			Sequences: clampSequences(m.Sequences)})
	case SyncPrefillDone:
		s.sink.PrefillDoneRemote(m.Replica, m.Request)
		if m.OutputBlocks > 0 {
			s.sink.OutputRemote(m.Replica, m.Request,
				clampOutput(router.OutputProgress{Blocks: m.OutputBlocks, Generated: m.Generated, Expected: m.ExpectedOutput}))
		}
	case SyncFree:
		s.sink.FreeRemote(m.Replica, m.Request)
	case SyncFull:
		for i := range m.Full {
			f := &m.Full[i]
			f.Sequences = clampSequences(f.Sequences)
			o := f.Progress()
			f.OutputBlocks, f.Generated, f.ExpectedOutput = o.Blocks, o.Generated, o.Expected
		}
		s.sink.ReplaceReplica(m.Replica, m.Full)
	case SyncTenants:
		ts, ok := s.sink.(TenantSink)
		if !ok || m.TenantsVersion != TenantUsageVersion {
			return // fairness off here, or a format this build does not read
		}
		ts.TenantsRemote(m.Replica, clampTenants(m.Tenants))
	default:
		s.undecodable.Add(1)
	}
}

// gap: rmu must be held.
func (s *Syncer) gap(m SyncMsg, last uint64) {
	s.gaps.Add(1)
	s.mGaps.Inc()
	s.log.Debug("replica-sync gap", "peer", m.Replica, "last_seq", last, "seq", m.Seq)
}

// sweep drops replicas silent for longer than ExpireAfter.
func (s *Syncer) sweep(now time.Time) {
	s.rmu.Lock()
	defer s.rmu.Unlock()
	for r, st := range s.remotes {
		if now.Sub(st.lastSeen) > s.cfg.ExpireAfter {
			delete(s.remotes, r)
			s.expired.Add(1)
			s.mExpired.Inc()
			s.log.Info("replica silent; dropping its load", "peer", r, "silent_for", now.Sub(st.lastSeen))
			s.sink.DropReplica(r)
		}
	}
}

// LastReceived is when the newest message from another replica was
// delivered; false when none has been (a single replica, or none heard
// yet). The decision log records its age: how stale the other replicas'
// load in a decision could be.
func (s *Syncer) LastReceived() (time.Time, bool) {
	ns := s.lastReceived.Load()
	if ns == 0 {
		return time.Time{}, false
	}
	return time.Unix(0, ns), true
}

// Stats returns the syncer's counters.
func (s *Syncer) Stats() SyncStats {
	s.rmu.Lock()
	n := len(s.remotes)
	s.rmu.Unlock()
	return SyncStats{
		Sent: s.sent.Load(), Received: s.received.Load(), Gaps: s.gaps.Load(),
		Undecodable: s.undecodable.Load(), Expired: s.expired.Load(), Replicas: n,
	}
}
