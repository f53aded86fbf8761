package zmqbridge

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/eventbus/registrar"
	"github.com/kvrouter/kvrouter/router"
)

// WorkerSpec is one engine the bridge follows: its OpenAI URL (what the
// router routes to) and its KV event sockets. It is also the body of the
// bridge's POST /workers/register and an entry of its config file.
type WorkerSpec struct {
	ID  string `json:"id"`
	URL string `json:"url"` // OpenAI base URL, e.g. http://gpu0:8000
	// Model is the served model name; empty: the first of GET <url>/v1/models.
	Model string `json:"model,omitempty"`
	// Events is the engine's PUB socket (tcp://gpu0:5557); rank r of a
	// data-parallel engine publishes at its port + r.
	Events string `json:"events"`
	// Replay is the engine's ROUTER replay socket (tcp://gpu0:5558);
	// empty: no replay, every gap resets the worker rank's blocks.
	Replay string `json:"replay,omitempty"`
	Topic  string `json:"topic,omitempty"` // the engine's kv-events topic ("" = all)
	// DPRanks is the number of data-parallel ranks (default 1).
	DPRanks int `json:"dp_ranks,omitempty"`
	// TotalBlocks is the KV capacity per rank in blocks; 0: read it from
	// the engine's metrics.
	TotalBlocks int `json:"total_kv_blocks,omitempty"`
	// MaxBatchedTokens is the engine's per-step token budget (vLLM
	// --max-num-batched-tokens, SGLang --chunked-prefill-size). Neither
	// engine exports it in /metrics (ParseMetrics), so it is never
	// discovered: 0 registers the worker without it, and the router's
	// settings relative to it do not apply to the worker (the bridge
	// warns, and the router's /cluster/status lists them).
	MaxBatchedTokens int    `json:"max_num_batched_tokens,omitempty"`
	MetricsURL       string `json:"metrics_url,omitempty"` // default <url>/metrics
	// Engine ("vllm", "sglang"; "": read as vLLM, as before these fields
	// existed) and EngineVersion (its release, e.g. "0.5.18") choose how
	// array-shaped events are read by position (SchemaFor); EventSchema
	// names a Schema outright (builds no release number describes).
	Engine        string `json:"engine,omitempty"`
	EngineVersion string `json:"engine_version,omitempty"`
	EventSchema   Schema `json:"event_schema,omitempty"`
	// KVCacheGroup is the KV cache group to index (a hybrid model's
	// full-attention group); absent: chosen from the events.
	KVCacheGroup GroupIndex `json:"kv_cache_group,omitzero"`
}

// MaxDPRanks bounds WorkerSpec.DPRanks.
const MaxDPRanks = 1024

// Normalize fills defaults and checks the spec.
func (w *WorkerSpec) Normalize() error {
	w.ID = strings.TrimSpace(w.ID)
	// Trim spaces and trailing slashes until neither is left ("http://a/ /"
	// → "http://a"), so normalising twice changes nothing.
	for u := ""; u != w.URL; {
		u = w.URL
		w.URL = strings.TrimRight(strings.TrimSpace(w.URL), "/")
	}
	if w.DPRanks == 0 {
		w.DPRanks = 1
	}
	var errs []error
	probe := eventbus.WireEvent{Worker: w.ID, EventID: 1, Kind: eventbus.KindCleared}
	if err := eventbus.Validate(&probe, 0); err != nil || strings.Contains(w.ID, "#") {
		errs = append(errs, fmt.Errorf("worker id %q: must be non-empty, printable, at most %d bytes, without '#'", w.ID, eventbus.MaxWorkerNameLen))
	}
	if (!strings.HasPrefix(w.URL, "http://") && !strings.HasPrefix(w.URL, "https://")) || strings.ContainsAny(w.URL, " \t\r\n") {
		errs = append(errs, fmt.Errorf("worker %s: url %q: want the engine's http(s):// OpenAI base URL", w.ID, w.URL))
	}
	if err := CheckEndpoint(w.Events); err != nil {
		errs = append(errs, fmt.Errorf("worker %s: events: %w", w.ID, err))
	}
	if w.Replay != "" {
		if err := CheckEndpoint(w.Replay); err != nil {
			errs = append(errs, fmt.Errorf("worker %s: replay: %w", w.ID, err))
		}
	}
	if w.DPRanks < 1 || w.DPRanks > MaxDPRanks {
		errs = append(errs, fmt.Errorf("worker %s: dp_ranks %d outside [1,%d]", w.ID, w.DPRanks, MaxDPRanks))
	}
	if w.TotalBlocks < 0 || w.MaxBatchedTokens < 0 {
		errs = append(errs, fmt.Errorf("worker %s: sizes must not be negative", w.ID))
	}
	w.Engine = strings.ToLower(strings.TrimSpace(w.Engine))
	w.EngineVersion = strings.TrimSpace(w.EngineVersion)
	w.EventSchema = Schema(strings.ToLower(strings.TrimSpace(string(w.EventSchema))))
	if _, err := w.Schema(); err != nil {
		errs = append(errs, fmt.Errorf("worker %s: %w", w.ID, err))
	}
	if g, ok := w.KVCacheGroup.Get(); ok && (g < 0 || g > MaxKVCacheGroup) {
		errs = append(errs, fmt.Errorf("worker %s: kv_cache_group %d outside [0,%d]", w.ID, g, MaxKVCacheGroup))
	}
	return errors.Join(errs...)
}

// Schema is the event schema the spec's engine fields select.
func (w *WorkerSpec) Schema() (Schema, error) {
	return SchemaFor(w.Engine, w.EngineVersion, w.EventSchema)
}

// MaxKVCacheGroup bounds WorkerSpec.KVCacheGroup (vLLM's group_idx).
const MaxKVCacheGroup = math.MaxInt32

// GroupIndex is an optional KV cache group index: the zero value is "not
// set" (JSON null or absent), so a spec stays comparable and "absent"
// keeps today's behaviour.
type GroupIndex struct {
	set bool
	n   int
}

// Group returns a set GroupIndex.
func Group(n int) GroupIndex { return GroupIndex{set: true, n: n} }

// Get returns the index and whether it is set.
func (g GroupIndex) Get() (int, bool) { return g.n, g.set }

// IsZero reports an unset index (for omitzero).
func (g GroupIndex) IsZero() bool { return !g.set }

// MarshalJSON writes the number, or null when unset.
func (g GroupIndex) MarshalJSON() ([]byte, error) {
	if !g.set {
		return []byte("null"), nil
	}
	return strconv.AppendInt(nil, int64(g.n), 10), nil
}

// UnmarshalJSON reads a number or null.
func (g *GroupIndex) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		*g = GroupIndex{}
		return nil
	}
	var n int
	if err := json.Unmarshal(b, &n); err != nil {
		return fmt.Errorf("kv_cache_group: %w", err)
	}
	*g = Group(n)
	return nil
}

// Publisher is what the bridge needs of *eventbus.Publisher.
type Publisher interface {
	// PublishAsync sends ev (EventID 0: the next id) without waiting for
	// the stream's ack; it blocks while the publisher's window is full.
	PublishAsync(ctx context.Context, ev eventbus.WireEvent) (uint64, error)
	NextEventID() uint64
	Flush(ctx context.Context) error
	Close()
}

// PublisherFactory opens the publisher of one worker rank.
type PublisherFactory func(worker string, dpRank uint32) (Publisher, error)

// NATSPublishers publishes through eventbus publishers on nc. Event ids
// start at eventbus.FreshEventIDBase (the bridge keeps no counter across
// restarts) and every stream starts with a cleared event, as the event
// bus's design asks of such workers.
func NATSPublishers(nc *nats.Conn, log *slog.Logger, opts ...eventbus.PublisherOption) PublisherFactory {
	return func(worker string, rank uint32) (Publisher, error) {
		o := append([]eventbus.PublisherOption{
			eventbus.WithNextEventID(eventbus.FreshEventIDBase(time.Now())),
			eventbus.WithPublisherLogger(log),
		}, opts...)
		return eventbus.NewPublisher(nc, worker, rank, o...)
	}
}

// BatchPublisher is the optional part of a Publisher that sends several
// events in one batch message (*eventbus.Publisher has it).
type BatchPublisher interface {
	PublishBatchAsync(ctx context.Context, evs []eventbus.WireEvent) (uint64, error)
}

// publisherSink adapts a Publisher to a Stream's Sink.
type publisherSink struct {
	pub    Publisher
	worker string
	rank   uint32
	batch  bool // Config.BatchMessages
}

// Emit publishes one engine event batch: as one batch message with
// Config.BatchMessages (when the publisher can), else one message per event.
func (p *publisherSink) Emit(ctx context.Context, evs []router.KVEvent) error {
	if bp, ok := p.pub.(BatchPublisher); ok && p.batch && len(evs) > 1 {
		wire := make([]eventbus.WireEvent, len(evs))
		for i, kv := range evs {
			wire[i] = eventbus.FromKVEvent(p.worker, p.rank, 0, kv)
		}
		_, err := bp.PublishBatchAsync(ctx, wire)
		return err
	}
	for _, kv := range evs {
		if _, err := p.pub.PublishAsync(ctx, eventbus.FromKVEvent(p.worker, p.rank, 0, kv)); err != nil {
			return err
		}
	}
	return nil
}

// Config configures a Bridge.
type Config struct {
	// BlockSize is the router's tokens per block; events of another size
	// are rejected.
	BlockSize int
	// Publishers opens each worker rank's publisher (required).
	Publishers PublisherFactory
	// NATS, when set, serves the workers' resync requests: the bridge
	// republishes a rank's whole state instead of having it dropped.
	NATS *nats.Conn
	// Register lists kvrouter replica base URLs to register the workers
	// with (empty: the workers are registered some other way).
	Register         []string
	AdminToken       string        // bearer token of the replicas' /workers endpoints
	RegisterInterval time.Duration // lease renewal (default 30s)
	// ReplayTimeout bounds one replay request (default 30s).
	ReplayTimeout time.Duration
	// MaxEntries bounds each rank's engine→content mapping.
	MaxEntries int
	// QueueSize is the SUB messages buffered per rank (default 1024).
	QueueSize int
	// MaxMessageBytes caps one ZMQ message from an engine, all frames
	// (default DefaultMaxMessageBytes): a frame header declaring more drops
	// the connection before anything is allocated.
	MaxMessageBytes int64
	// InsecureAPI lets the HTTP API accept register/deregister requests
	// without a token from other hosts; see CheckAPIListen.
	InsecureAPI bool
	// HTTPClient talks to engines and replicas (default 5s timeout).
	HTTPClient *http.Client
	Logger     *slog.Logger
	// LowerTiers are the offload tiers whose events are published with
	// their tier (StreamConfig.LowerTiers); empty: skipped.
	LowerTiers []router.Tier
	// BatchMessages forwards each engine event batch (vLLM's KVEventBatch,
	// after conversion) as one batch message (eventbus's batch form) instead
	// of one message per event. Every replica must know batch messages.
	BatchMessages bool
}

// Bridge follows the KV events of vLLM and SGLang workers over ZMQ and
// publishes them, converted to the router's hashes, into the event bus. One
// bridge can serve one worker (a sidecar) or many.
type Bridge struct {
	cfg Config
	log *slog.Logger

	mu      sync.Mutex
	ctx     context.Context // set by Run
	workers map[string]*worker
	wg      sync.WaitGroup
}

// New returns a bridge; Run starts it.
func New(cfg Config) (*Bridge, error) {
	if cfg.BlockSize <= 0 || cfg.BlockSize > eventbus.MaxBlockSize {
		return nil, fmt.Errorf("bridge: block size %d outside [1,%d]", cfg.BlockSize, eventbus.MaxBlockSize)
	}
	if cfg.Publishers == nil {
		return nil, errors.New("bridge: no publisher factory")
	}
	if cfg.RegisterInterval <= 0 {
		cfg.RegisterInterval = 30 * time.Second
	}
	if cfg.QueueSize <= 0 {
		cfg.QueueSize = 1024
	}
	if cfg.MaxMessageBytes < 0 {
		return nil, fmt.Errorf("bridge: max message bytes %d", cfg.MaxMessageBytes)
	}
	if cfg.MaxMessageBytes == 0 {
		cfg.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if cfg.HTTPClient == nil {
		cfg.HTTPClient = &http.Client{Timeout: 5 * time.Second}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	for i, u := range cfg.Register {
		cfg.Register[i] = strings.TrimRight(u, "/")
	}
	return &Bridge{cfg: cfg, log: cfg.Logger.With("component", "zmqbridge"), workers: map[string]*worker{}}, nil
}

// Run follows specs (and workers added later with Add) until ctx ends,
// then stops every worker, flushing its publishers.
func (b *Bridge) Run(ctx context.Context, specs []WorkerSpec) error {
	b.mu.Lock()
	if b.ctx != nil {
		b.mu.Unlock()
		return errors.New("bridge: already running")
	}
	b.ctx = ctx
	b.mu.Unlock()
	var errs []error
	for _, s := range specs {
		if err := b.Add(s); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		b.stopAll()
		return err
	}
	<-ctx.Done()
	b.stopAll()
	return nil
}

func (b *Bridge) stopAll() {
	b.mu.Lock()
	ws := make([]*worker, 0, len(b.workers))
	for _, w := range b.workers {
		ws = append(ws, w)
	}
	b.mu.Unlock()
	for _, w := range ws {
		w.cancel()
	}
	b.wg.Wait()
}

// ErrExists is returned by Add for a worker id already followed with
// another spec.
var ErrExists = errors.New("worker already bridged with another spec")

// Add starts following a worker. Adding the same spec again is a no-op.
func (b *Bridge) Add(spec WorkerSpec) error {
	if err := spec.Normalize(); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ctx == nil {
		return errors.New("bridge: not running")
	}
	if b.ctx.Err() != nil {
		return b.ctx.Err()
	}
	if old, ok := b.workers[spec.ID]; ok {
		if old.spec == spec {
			return nil
		}
		return fmt.Errorf("%w: %s", ErrExists, spec.ID)
	}
	ctx, cancel := context.WithCancel(b.ctx)
	w := &worker{b: b, spec: spec, cancel: cancel, done: make(chan struct{}), state: "starting",
		log: b.log.With("worker", spec.ID)}
	b.workers[spec.ID] = w
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		defer close(w.done)
		w.run(ctx)
	}()
	return nil
}

// Remove stops following a worker; with deregister it also deregisters it
// from the replicas (it leaves the fleet).
func (b *Bridge) Remove(ctx context.Context, id string, deregister bool) error {
	b.mu.Lock()
	w, ok := b.workers[id]
	if ok {
		delete(b.workers, id)
	}
	b.mu.Unlock()
	if !ok {
		return fmt.Errorf("worker %q is not bridged", id)
	}
	w.cancel()
	<-w.done
	if deregister && len(b.cfg.Register) > 0 {
		return registrar.New(b.registrarConfig(registrar.Spec{ID: id}, w.log)).Deregister(ctx)
	}
	return nil
}

// WorkerStatus is one worker's state in Status.
type WorkerStatus struct {
	Spec        WorkerSpec `json:"spec"`
	State       string     `json:"state"`
	Error       string     `json:"error,omitempty"`
	Model       string     `json:"model,omitempty"`
	Engine      string     `json:"engine,omitempty"`
	TotalBlocks int        `json:"total_kv_blocks"`
	// MaxBatchedTokens as registered (the spec's; 0: not known) and the
	// capacities the registration lacks (router.Capacity* names), so the
	// bridge's /status says what the router cannot use.
	MaxBatchedTokens int           `json:"max_num_batched_tokens"`
	CapacityMissing  []string      `json:"capacity_missing"`
	Registered       bool          `json:"registered"`
	RegisterErr      string        `json:"register_error,omitempty"`
	Ranks            []StreamStats `json:"ranks"`
}

// Status lists every worker's state and counters, sorted by id.
func (b *Bridge) Status() []WorkerStatus {
	b.mu.Lock()
	ws := make([]*worker, 0, len(b.workers))
	for _, w := range b.workers {
		ws = append(ws, w)
	}
	b.mu.Unlock()
	sort.Slice(ws, func(i, j int) bool { return ws[i].spec.ID < ws[j].spec.ID })
	out := make([]WorkerStatus, 0, len(ws))
	for _, w := range ws {
		out = append(out, w.status())
	}
	return out
}

// worker is one followed engine.
type worker struct {
	b      *Bridge
	spec   WorkerSpec
	cancel context.CancelFunc
	done   chan struct{}
	log    *slog.Logger

	mu          sync.Mutex
	state, err  string
	model       string
	engine      string
	totalBlocks int
	reg         *registrar.Registrar
	ranks       []*rank
}

type rank struct {
	stream *Stream
	pub    Publisher
	resync chan struct{}
}

func (w *worker) setState(state, err string) {
	w.mu.Lock()
	w.state, w.err = state, err
	w.mu.Unlock()
}

func (w *worker) status() WorkerStatus {
	w.mu.Lock()
	st := WorkerStatus{Spec: w.spec, State: w.state, Error: w.err, Model: w.model, Engine: w.engine, TotalBlocks: w.totalBlocks,
		MaxBatchedTokens: w.spec.MaxBatchedTokens, CapacityMissing: missingCapacity(w.totalBlocks, w.spec.MaxBatchedTokens)}
	reg, ranks := w.reg, append([]*rank(nil), w.ranks...)
	w.mu.Unlock()
	if reg != nil {
		rs := reg.Stats()
		st.Registered, st.RegisterErr = rs.Registered, rs.LastError
	}
	for _, r := range ranks {
		st.Ranks = append(st.Ranks, r.stream.Stats())
	}
	return st
}

// run: learn the model and capacity, register, then follow every rank.
func (w *worker) run(ctx context.Context) {
	cfg := w.b.cfg
	spec := w.spec
	model := spec.Model
	for model == "" {
		w.setState("waiting for the engine's /v1/models", "")
		m, err := ProbeModel(ctx, cfg.HTTPClient, spec.URL)
		if err == nil {
			model = m
			break
		}
		w.setState("waiting for the engine's /v1/models", err.Error())
		if !sleepCtx(ctx, 2*time.Second) {
			return
		}
	}
	metricsURL := spec.MetricsURL
	if metricsURL == "" {
		metricsURL = spec.URL + "/metrics"
	}
	total := spec.TotalBlocks
	probe := func() bool { // false: refuse this worker
		if spec.TotalBlocks > 0 && w.engineKnown() {
			return true
		}
		info, err := ProbeMetrics(ctx, cfg.HTTPClient, metricsURL, cfg.BlockSize)
		if err != nil {
			w.log.Debug("engine metrics not readable", "url", metricsURL, "err", err)
			return true
		}
		if info.BlockSize > 0 && info.BlockSize != cfg.BlockSize {
			msg := fmt.Sprintf("REJECTED: the engine reports KV block size %d, the router uses %d: no block could ever match. "+
				"Start the engine with the router's block size (vLLM --block-size, SGLang --page-size) or change the router's", info.BlockSize, cfg.BlockSize)
			w.log.Error(msg)
			w.setState("rejected", msg)
			return false
		}
		if !info.Prefix {
			w.log.Error("the engine reports prefix caching disabled: it caches nothing for the router to find (vLLM: drop --no-enable-prefix-caching)")
		}
		w.mu.Lock()
		w.engine = info.Engine
		if spec.TotalBlocks == 0 && info.TotalBlocks > 0 {
			total = info.TotalBlocks
			w.totalBlocks = total
		}
		w.mu.Unlock()
		return true
	}
	w.mu.Lock()
	w.model, w.totalBlocks = model, total
	w.mu.Unlock()
	w.setState("probing the engine's metrics", "")
	if !probe() {
		return
	}
	w.warnCapacity(metricsURL)
	if len(cfg.Register) > 0 {
		reg := registrar.New(w.b.registrarConfig(registrar.Spec{ID: spec.ID, URL: spec.URL, Model: model,
			BlockSize: cfg.BlockSize, TotalBlocks: total, MaxBatchedTokens: spec.MaxBatchedTokens, DPRanks: spec.DPRanks}, w.log))
		w.mu.Lock()
		w.reg = reg
		w.mu.Unlock()
		rejected := make(chan struct{})
		regCtx, regCancel := context.WithCancel(ctx)
		defer regCancel()
		go reg.Run(regCtx, func() {
			if total == 0 || !w.engineKnown() {
				before := total
				if !probe() {
					// Stop renewing: the lease runs out and the cluster
					// stops routing to an engine whose blocks never match.
					regCancel()
					select {
					case <-rejected:
					default:
						close(rejected)
					}
					return
				}
				reg.SetTotalBlocks(total)
				if before == 0 && total > 0 {
					w.log.Info("KV capacity read from the engine's metrics", "total_kv_blocks", total)
				}
			}
		})
		w.setState("registering", "")
		select {
		case <-reg.Registered():
		case <-rejected:
			return
		case <-ctx.Done():
			return
		}
	}
	w.follow(ctx)
}

// missingCapacity names the capacities a registration lacks, as the
// router names them (router.CapacityTotalBlocks, …); never nil.
func missingCapacity(totalBlocks, maxBatched int) []string {
	out := []string{}
	if totalBlocks <= 0 {
		out = append(out, "total_kv_blocks")
	}
	if maxBatched <= 0 {
		out = append(out, "max_num_batched_tokens")
	}
	return out
}

// warnCapacity says, once per worker, which capacity the worker registers
// without and what the router loses for it (router/capacity.go): a worker
// without capacity is never silently wrong.
func (w *worker) warnCapacity(metricsURL string) {
	w.mu.Lock()
	total := w.totalBlocks
	w.mu.Unlock()
	if total <= 0 {
		w.log.Warn("KV capacity unknown: the engine's metrics gave no vllm:cache_config_info num_gpu_blocks nor sglang:num_pages / max_total_num_tokens "+
			"(retried before each registration); until then the router's --active-decode-blocks-threshold and kv-pooled admission do not apply to this worker. "+
			"Give total_kv_blocks (--total-kv-blocks) to fix it", "metrics_url", metricsURL)
	}
	if w.spec.MaxBatchedTokens <= 0 {
		w.log.Warn("max_num_batched_tokens unknown: neither vLLM nor SGLang exports it in /metrics, so the router's --router-queue-threshold and " +
			"--active-prefill-tokens-threshold-frac do not apply to this worker. Give the engine's value (vLLM --max-num-batched-tokens, " +
			"SGLang --chunked-prefill-size) as max_num_batched_tokens (--max-batched-tokens)")
	}
}

func (w *worker) engineKnown() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.engine != ""
}

// follow runs one goroutine per rank until ctx ends.
func (w *worker) follow(ctx context.Context) {
	cfg := w.b.cfg
	spec := w.spec
	ranks := make([]*rank, 0, spec.DPRanks)
	defer func() {
		for _, r := range ranks {
			fctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			if err := r.pub.Flush(fctx); err != nil {
				w.log.Warn("events not acknowledged at shutdown", "dp_rank", r.stream.cfg.DPRank, "err", err)
			}
			cancel()
			r.pub.Close()
		}
	}()
	for i := range spec.DPRanks {
		replayEP, _ := OffsetEndpoint(spec.Replay, i)
		pub, err := cfg.Publishers(spec.ID, uint32(i))
		if err != nil {
			w.log.Error("cannot open the event publisher", "dp_rank", i, "err", err)
			w.setState("failed", err.Error())
			return
		}
		var rep Replayer
		var zrep *ZMQReplayer
		if replayEP != "" {
			zrep = &ZMQReplayer{Endpoint: replayEP, Timeout: cfg.ReplayTimeout, MaxMessageBytes: cfg.MaxMessageBytes}
			rep = zrep
		}
		schema, _ := spec.Schema() // checked by Normalize
		st := NewStream(StreamConfig{Worker: spec.ID, DPRank: uint32(i), BlockSize: cfg.BlockSize, MaxEntries: cfg.MaxEntries,
			Replayer: rep, Sink: &publisherSink{pub: pub, worker: spec.ID, rank: uint32(i), batch: w.b.cfg.BatchMessages}, Logger: w.b.log,
			Schema: schema, Group: spec.KVCacheGroup, LowerTiers: cfg.LowerTiers})
		if zrep != nil {
			zrep.Counters = st.Wire() // before the stream's first replay: Start runs later, in followRank
		}
		ranks = append(ranks, &rank{stream: st, pub: pub, resync: make(chan struct{}, 1)})
	}
	w.mu.Lock()
	w.ranks = ranks
	w.mu.Unlock()
	if cfg.NATS != nil {
		sub, err := eventbus.ServeResync(cfg.NATS, spec.ID, w.log, func(req eventbus.ResyncRequest) eventbus.ResyncReply {
			if int(req.DPRank) >= len(ranks) {
				return eventbus.ResyncReply{Error: fmt.Sprintf("worker %s has %d ranks", spec.ID, len(ranks))}
			}
			r := ranks[req.DPRank]
			next := r.pub.NextEventID()
			select {
			case r.resync <- struct{}{}:
			default: // one is pending already
			}
			return eventbus.ResyncReply{Accepted: true, NextEventID: next}
		})
		if err != nil {
			w.log.Warn("cannot serve resync requests; the cluster will drop this worker's blocks instead", "err", err)
		} else {
			defer func() { _ = sub.Unsubscribe() }()
		}
	}
	w.setState("running", "")
	var wg sync.WaitGroup
	errc := make(chan error, len(ranks))
	for i, r := range ranks {
		events, _ := OffsetEndpoint(spec.Events, i)
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := w.followRank(ctx, r, events); err != nil && ctx.Err() == nil {
				errc <- fmt.Errorf("rank %d: %w", i, err)
			}
		}()
	}
	wg.Wait()
	close(errc)
	if err := <-errc; err != nil {
		w.log.Error("worker stopped", "err", err)
		w.setState("failed", err.Error())
	}
}

func (w *worker) followRank(ctx context.Context, r *rank, endpoint string) error {
	if err := r.stream.Start(ctx); err != nil {
		return err
	}
	in := make(chan Message, w.b.cfg.QueueSize)
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	sub := &Subscriber{Endpoint: endpoint, Topic: w.spec.Topic, Logger: w.log.With("dp_rank", r.stream.cfg.DPRank),
		MaxMessageBytes: w.b.cfg.MaxMessageBytes, Counters: r.stream.Wire()}
	done := make(chan struct{})
	go func() {
		defer close(done)
		sub.Run(sctx, in)
	}()
	defer func() { cancel(); <-done }()
	if err := r.stream.CatchUp(ctx); err != nil {
		return err
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case m := <-in:
			if m.Reconnected {
				if err := r.stream.Reconnected(ctx); err != nil {
					return err
				}
				continue
			}
			if err := r.stream.HandleLive(ctx, m.Frames); err != nil {
				return err
			}
		case <-r.resync:
			if err := r.stream.Republish(ctx); err != nil {
				return err
			}
		}
	}
}
