// Package engine is a deterministic, virtual-time model of one vLLM worker:
// a paged KV cache with prefix caching and LRU eviction, vLLM v1's scheduler
// (max running sequences, a per-step token budget, chunked prefill, an FCFS
// waiting queue with newest-first preemption, or, opt-in, vLLM's priority
// policy) and a step-time model (Dynamo's
// mocker). It emits the KV events a real worker publishes, in our router's
// types, and reports cached tokens per request the way vLLM's usage does.
//
// Time is whatever the caller says it is: there are no goroutines and no
// clock. A driver submits requests at virtual times, asks NextEventTime for
// the end of the running step and calls Advance to collect outputs. Same
// inputs in the same order give the same outputs and events. An Engine is not
// safe for concurrent use.
//
// See DESIGN.md in this directory for the model and how it differs from vLLM.
package engine

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/kvrouter/kvrouter/internal/splitmix"
	"github.com/kvrouter/kvrouter/router"
)

// Errors. Callers use errors.Is.
var (
	ErrConfig    = errors.New("invalid engine config")
	ErrRequest   = errors.New("invalid request")
	ErrDuplicate = errors.New("request id already in flight")
	ErrTime      = errors.New("virtual time went backwards")
	ErrBusy      = errors.New("running requests hold KV blocks")
)

// Defaults (vLLM's).
const (
	DefaultMaxRunning       = 256
	DefaultMaxBatchedTokens = 8192
)

// Config describes one engine.
type Config struct {
	BlockSize        int // tokens per KV block (> 0)
	CapacityBlocks   int // KV blocks (> 0)
	MaxRunning       int // max running sequences; 0 = 256
	MaxBatchedTokens int // token budget per step; 0 = 8,192
	// MaxModelLen caps prompt + output tokens of one request; 0 = the whole
	// cache (CapacityBlocks·BlockSize). Larger than the cache is an error:
	// such a request could never run.
	MaxModelLen int
	Profile     string  // timing profile name; "" = dynamo-mocker
	Speedup     float64 // divides every step time; 0 = 1
	// EngineHashSeed: 0 = the engine names blocks by our content hash;
	// otherwise by a seeded bijection of it (a different, opaque hash, as a
	// real engine's would be).
	EngineHashSeed uint64
	// EventIDBase: the first event gets id EventIDBase+1 (lets a restarted
	// worker continue its id sequence).
	EventIDBase uint64
	// ReportOutputBlocks adds an OutputBlock output each time a request's
	// output starts a new KV block (what a router's output-block tracking
	// needs: one report per block, never one per token). Off: no such
	// outputs and no cost.
	ReportOutputBlocks bool
	// LowerTier, when set, is an offloading connector's lookup (vLLM's
	// OffloadingConnector, get_num_new_matched_tokens): whether a lower
	// tier (host memory) holds the block of content hash h. When a request
	// leaves the waiting queue, the blocks past its GPU prefix hit that the
	// lower tier holds contiguously are loaded instead of computed: they
	// get GPU blocks, are cached at once (stored events) and count as
	// cached tokens, as vLLM counts a connector's tokens in
	// num_cached_tokens. Loads take no time (engine/DESIGN.md). Not asked
	// for RemotePrefill requests. nil: no lower tier.
	LowerTier func(h uint64) bool
	// Scheduling is the waiting queue's policy (vLLM's
	// --scheduling-policy): "" or SchedulingFCFS (the default, as
	// before), SchedulingPriority (vLLM v1's "priority") or
	// SchedulingPriorityPreempt (that, plus preemption at MaxRunning).
	// See engine/DESIGN.md, "Priority scheduling".
	Scheduling string
}

// Scheduling policies (Config.Scheduling).
const (
	// SchedulingFCFS: arrival order; a block shortage preempts the newest
	// running request (vLLM's default "fcfs").
	SchedulingFCFS = "fcfs"
	// SchedulingPriority is vLLM v1's "priority" as merged
	// (vllm/v1/core/sched/scheduler.py, request_queue.py): the waiting
	// queue is ordered by (Request.Priority, arrival), lower first, a
	// preempted request rejoining it in that order; a block shortage
	// preempts the running request with the largest (priority, arrival).
	// A full running set (MaxRunning) stops admission whatever the
	// priorities.
	SchedulingPriority = "priority"
	// SchedulingPriorityPreempt adds what vLLM v0's priority policy did
	// and vLLM issue #40004's open pull requests add to v1: when the
	// running set is full, a waiting request of strictly lower priority
	// value than the largest running (priority, arrival) preempts it.
	SchedulingPriorityPreempt = "priority-preempt"
)

// Request is one generation request.
type Request struct {
	ID     string
	Tokens []uint32
	// NumTokens is the prompt length when Tokens is nil (then BlockHashes
	// must describe its full blocks). Ignored when Tokens is set.
	NumTokens int
	// BlockHashes are the prompt's full-block sequence (content) hashes,
	// router.SequenceHashes(Tokens, BlockSize, LoRA); computed when nil.
	BlockHashes  []uint64
	OutputTokens int // tokens to generate; 0 counts as 1
	LoRA         string
	// RemotePrefill: the prompt's KV is computed elsewhere and received
	// (disaggregated serving: vLLM's kv_transfer_params.do_remote_prefill
	// on a decode worker). When the request leaves the waiting queue the
	// engine pins its local prefix hit, allocates blocks for the rest of
	// the prompt without computing or caching them, and emits AwaitingKV;
	// the request then holds its blocks, outside the running set, until
	// KVReceived (or Cancel). See KVReceived.
	RemotePrefill bool
	// Priority is vLLM's request priority: lower is served first. Only
	// the priority policies (Config.Scheduling) read it.
	Priority int
}

// OutputKind says what happened to a request.
type OutputKind uint8

// Output kinds.
const (
	FirstToken OutputKind = iota + 1 // prefill done, first token sampled
	Finished                         // last token sampled, blocks freed
	Preempted                        // evicted from the running set, requeued for recompute
	// AwaitingKV: a RemotePrefill request was admitted and holds blocks
	// for its whole prompt; CachedTokens is its local prefix hit, so
	// PromptTokens-CachedTokens tokens' KV must be received. Call
	// KVReceived when they have arrived.
	AwaitingKV
	// OutputBlock (only with Config.ReportOutputBlocks): the token just
	// sampled starts a new KV block past the prompt's last (full or
	// partial) block, router.OutputBlocks' boundary rule; OutputTokens is
	// the tokens generated so far. Not sent for the last token (Finished
	// follows in the same step).
	OutputBlock
)

func (k OutputKind) String() string {
	switch k {
	case FirstToken:
		return "first-token"
	case Finished:
		return "finished"
	case Preempted:
		return "preempted"
	case AwaitingKV:
		return "awaiting-kv"
	case OutputBlock:
		return "output-block"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Output is one request milestone.
type Output struct {
	RequestID string
	Kind      OutputKind
	At        time.Duration
	// CachedTokens is the prefix-cache hit when the request was first
	// scheduled (vLLM's usage.prompt_tokens_details.cached_tokens); a
	// recompute after preemption does not change it. For a RemotePrefill
	// request it is every prompt token not computed here (local hit plus
	// received, less the last token, which is recomputed), as vLLM reports
	// for a request whose KV a connector loaded; in its AwaitingKV output
	// it is the local hit alone.
	CachedTokens int
	PromptTokens int
	OutputTokens int // tokens generated so far
}

// Event is one KV event with its per-engine id (monotonic, no gaps).
type Event struct {
	ID uint64
	At time.Duration
	KV router.KVEvent
}

// Stats is a snapshot of the engine.
type Stats struct {
	Now              time.Duration // latest virtual time the engine has seen
	Running, Waiting int           // requests
	AwaitingKV       int           // RemotePrefill requests holding blocks until KVReceived
	// Blocks: Used are held by running requests (pinned), Free are in the
	// free queue, Cached hold a content hash (pinned or free).
	CapacityBlocks, UsedBlocks, FreeBlocks, CachedBlocks int
	Fill                                                 float64 // UsedBlocks / CapacityBlocks (the decode model's p)
	// Totals since New.
	Submitted, Finished, Cancelled, Preemptions, Steps uint64
	PromptTokens, CachedTokens                         uint64 // of requests at their first schedule
	PrefillTokens, OutputTokens                        uint64 // prompt tokens computed (incl. recompute), tokens generated
	StoredBlocks, EvictedBlocks, Events                uint64
	BusyTime                                           time.Duration // sum of step times
	// ReceivedTokens are prompt tokens whose KV arrived by KVReceived (not
	// counting the local hits of those requests).
	ReceivedTokens uint64
	// LoadedTokens are prompt tokens loaded from the lower tier
	// (Config.LowerTier) instead of computed, at every admission
	// (a recompute after preemption loads again).
	LoadedTokens uint64
}

type seqState uint8

const (
	stWaiting seqState = iota
	stRunning
	stDone
	stAwaitingKV // RemotePrefill: admitted, holds blocks, waits for KVReceived
)

// seq is one request inside the engine.
type seq struct {
	id        string
	serial    uint64
	promptLen int
	target    int
	hashes    []uint64 // full-block content hashes known so far: prompt, then output blocks
	generated int      // tokens sampled so far
	computed  int      // tokens whose KV is computed (vLLM num_computed_tokens)
	blocks    []int32
	nStored   int // blocks[:nStored] are cached under hashes[:nStored]
	inDecode  bool
	cached    int // cached tokens at first schedule
	scheduled bool
	cancelled bool
	remote    bool // RemotePrefill and its KV not received yet
	// received: the prompt's KV arrived by KVReceived and nothing has been
	// recomputed since; its last-token step is not a prefill in the
	// timing (Dynamo's decode workers charge no prefill time).
	received bool
	state    seqState
	priority int // Request.Priority
}

func (s *seq) numTokens() int { return s.promptLen + s.generated }

type work struct {
	s      *seq
	n      int
	decode bool
}

// Engine is one simulated worker.
type Engine struct {
	id   string
	cfg  Config
	prof Profile
	pool *pool
	salt uint64

	now      time.Duration
	pending  bool // a step is due to start at startAt
	startAt  time.Duration
	inflight bool // a step runs until stepEnd
	stepEnd  time.Duration
	batch    []work

	running  []*seq
	waiting  []*seq
	awaiting []*seq // stAwaitingKV, in admission order
	byID     map[string]*seq
	serial   uint64

	outputs   []Output
	events    []Event
	nextEvent uint64
	hitBuf    []int32
	st        Stats

	// Prefix pins (Pin): content hash → pin, kept in "host memory" past
	// the block's eviction from the device (SGLang HiCache's PIN).
	// pinOrder lists the pinned hashes in pin order: expiry walks it,
	// never the map.
	pins     map[uint64]*enginePin
	pinOrder []uint64
}

// enginePin is one pinned block's expiry and the TTL a hit renews.
type enginePin struct {
	until, ttl time.Duration
}

// New validates cfg and returns an idle engine with an empty cache.
func New(id string, cfg Config) (*Engine, error) {
	if cfg.BlockSize <= 0 {
		return nil, fmt.Errorf("engine %s: block size %d: %w", id, cfg.BlockSize, ErrConfig)
	}
	if cfg.CapacityBlocks <= 0 {
		return nil, fmt.Errorf("engine %s: capacity %d blocks: %w", id, cfg.CapacityBlocks, ErrConfig)
	}
	if cfg.CapacityBlocks > math.MaxInt32-1 {
		return nil, fmt.Errorf("engine %s: capacity %d blocks is too large: %w", id, cfg.CapacityBlocks, ErrConfig)
	}
	if cfg.MaxRunning == 0 {
		cfg.MaxRunning = DefaultMaxRunning
	}
	if cfg.MaxRunning < 0 {
		return nil, fmt.Errorf("engine %s: max running %d: %w", id, cfg.MaxRunning, ErrConfig)
	}
	if cfg.MaxBatchedTokens == 0 {
		cfg.MaxBatchedTokens = DefaultMaxBatchedTokens
	}
	if cfg.MaxBatchedTokens < 0 {
		return nil, fmt.Errorf("engine %s: max batched tokens %d: %w", id, cfg.MaxBatchedTokens, ErrConfig)
	}
	capTokens := cfg.CapacityBlocks * cfg.BlockSize
	if cfg.MaxModelLen == 0 {
		cfg.MaxModelLen = capTokens
	}
	if cfg.MaxModelLen < 0 || cfg.MaxModelLen > capTokens {
		return nil, fmt.Errorf("engine %s: max model len %d tokens, KV cache holds %d (%d blocks of %d): %w",
			id, cfg.MaxModelLen, capTokens, cfg.CapacityBlocks, cfg.BlockSize, ErrConfig)
	}
	switch cfg.Scheduling {
	case "":
		cfg.Scheduling = SchedulingFCFS
	case SchedulingFCFS, SchedulingPriority, SchedulingPriorityPreempt:
	default:
		return nil, fmt.Errorf("engine %s: scheduling policy %q (want %s, %s or %s): %w",
			id, cfg.Scheduling, SchedulingFCFS, SchedulingPriority, SchedulingPriorityPreempt, ErrConfig)
	}
	if cfg.Speedup == 0 {
		cfg.Speedup = 1
	}
	if !(cfg.Speedup > 0) || math.IsInf(cfg.Speedup, 0) {
		return nil, fmt.Errorf("engine %s: speedup %v: %w", id, cfg.Speedup, ErrConfig)
	}
	prof, err := LookupProfile(cfg.Profile)
	if err != nil {
		return nil, err
	}
	cfg.Profile = prof.Name
	e := &Engine{
		id:        id,
		cfg:       cfg,
		prof:      prof,
		pool:      newPool(cfg.CapacityBlocks),
		salt:      splitmix.Mix(fnv64(id) ^ 0x6b766d6f636b2121),
		byID:      make(map[string]*seq),
		nextEvent: cfg.EventIDBase,
		pins:      make(map[uint64]*enginePin),
	}
	return e, nil
}

// ID returns the engine's id.
func (e *Engine) ID() string { return e.id }

// Config returns the configuration with defaults filled in.
func (e *Engine) Config() Config { return e.cfg }

// Profile returns the timing profile.
func (e *Engine) Profile() Profile { return e.prof }

// EngineHash is the engine's name for a block of content hash h.
func (e *Engine) EngineHash(h uint64) uint64 {
	if e.cfg.EngineHashSeed == 0 {
		return h
	}
	return splitmix.Mix(h ^ e.cfg.EngineHashSeed)
}

// Submit queues r at virtual time now (FCFS). It first runs every step that
// completes before now; their outputs wait for the next Advance.
func (e *Engine) Submit(now time.Duration, r Request) error {
	if now < e.now {
		return fmt.Errorf("engine %s: submit %s at %v, engine is at %v: %w", e.id, r.ID, now, e.now, ErrTime)
	}
	bs := e.cfg.BlockSize
	promptLen := len(r.Tokens)
	if r.Tokens == nil {
		promptLen = r.NumTokens
	}
	if promptLen <= 0 {
		return fmt.Errorf("engine %s: request %s: empty prompt: %w", e.id, r.ID, ErrRequest)
	}
	target := r.OutputTokens
	if target < 0 {
		return fmt.Errorf("engine %s: request %s: %d output tokens: %w", e.id, r.ID, target, ErrRequest)
	}
	if target == 0 {
		target = 1
	}
	if promptLen+target > e.cfg.MaxModelLen {
		return fmt.Errorf("engine %s: request %s: %d prompt + %d output tokens exceed max model len %d: %w",
			e.id, r.ID, promptLen, target, e.cfg.MaxModelLen, ErrRequest)
	}
	if r.Priority != 0 && e.cfg.Scheduling == SchedulingFCFS {
		// vLLM's input processing refuses it too ("Got priority … but
		// Priority scheduling is not enabled").
		return fmt.Errorf("engine %s: request %s: priority %d without a priority scheduling policy: %w",
			e.id, r.ID, r.Priority, ErrRequest)
	}
	maxBlocks := (promptLen + target + bs - 1) / bs
	var hashes []uint64
	switch {
	case r.BlockHashes != nil:
		if len(r.BlockHashes) != promptLen/bs {
			return fmt.Errorf("engine %s: request %s: %d block hashes for %d tokens of block size %d: %w",
				e.id, r.ID, len(r.BlockHashes), promptLen, bs, ErrRequest)
		}
		hashes = append(make([]uint64, 0, maxBlocks), r.BlockHashes...)
	case r.Tokens != nil:
		hashes = router.SequenceHashes(r.Tokens, bs, r.LoRA)
		hashes = slices.Grow(hashes, maxBlocks-len(hashes))
	case promptLen >= bs:
		return fmt.Errorf("engine %s: request %s: neither tokens nor block hashes: %w", e.id, r.ID, ErrRequest)
	}
	if _, ok := e.byID[r.ID]; ok {
		return fmt.Errorf("engine %s: request %s: %w", e.id, r.ID, ErrDuplicate)
	}
	e.advanceTo(now)
	e.expirePins(now)
	for _, h := range hashes { // refresh on hit (HiCache: a hit resets the pin's expiry)
		if p := e.pins[h]; p != nil {
			p.until = max(p.until, now+p.ttl)
		}
	}
	e.serial++
	s := &seq{
		id:        r.ID,
		serial:    e.serial,
		promptLen: promptLen,
		target:    target,
		hashes:    hashes,
		blocks:    make([]int32, 0, maxBlocks),
		remote:    r.RemotePrefill,
		state:     stWaiting,
		priority:  r.Priority,
	}
	e.byID[r.ID] = s
	e.enqueue(s)
	e.st.Submitted++
	if !e.pending && !e.inflight {
		e.pending, e.startAt = true, now
	}
	return nil
}

// NextEventTime returns when the running step completes (starting a step
// that is due, which may emit KV events); false when the engine is idle.
func (e *Engine) NextEventTime() (time.Duration, bool) {
	if e.pending {
		e.startStep(e.startAt)
	}
	if e.inflight {
		return e.stepEnd, true
	}
	return 0, false
}

// Advance runs every step that completes at or before now and returns the
// outputs produced since the last call, in order. A step due to start at
// exactly now is left to start later, so that requests submitted at now
// join it.
func (e *Engine) Advance(now time.Duration) []Output {
	e.advanceTo(now)
	out := e.outputs
	e.outputs = nil
	return out
}

// TakeOutputs returns the outputs produced since the last Advance or
// TakeOutputs without moving time. NextEventTime can produce outputs when
// it starts a step (Preempted, AwaitingKV); a real-time driver takes them
// at once rather than at the end of the step, or never if the engine then
// has nothing to run.
func (e *Engine) TakeOutputs() []Output {
	out := e.outputs
	e.outputs = nil
	return out
}

// KVReceived tells the engine that the KV of RemotePrefill request id's
// prompt has arrived (it got AwaitingKV). Like vLLM's scheduler when a KV
// connector finishes receiving: the prompt's full blocks are cached at now
// (stored events), all prompt tokens but the last count as computed, and
// the request joins the running set; its next step computes the last
// prompt token (a one-token prefill, as vLLM recomputes it to sample the
// first token). False when id is not awaiting its KV.
func (e *Engine) KVReceived(now time.Duration, id string) bool {
	e.advanceTo(now)
	s, ok := e.byID[id]
	if !ok || s.state != stAwaitingKV {
		return false
	}
	i := slices.Index(e.awaiting, s)
	e.awaiting = slices.Delete(e.awaiting, i, i+1)
	local := s.computed
	s.remote = false // a recompute after preemption uses the local cache
	s.received = true
	s.computed = s.promptLen - 1
	s.state = stRunning
	e.running = append(e.running, s)
	s.scheduled, s.cached = true, s.computed
	e.st.PromptTokens += uint64(s.promptLen)
	e.st.CachedTokens += uint64(s.cached)
	e.st.ReceivedTokens += uint64(s.promptLen - local)
	e.cacheFull(s, s.computed/e.cfg.BlockSize, e.now)
	if !e.pending && !e.inflight {
		e.pending, e.startAt = true, e.now
	}
	return true
}

// DrainEvents returns the KV events produced since the last call, in order.
func (e *Engine) DrainEvents() []Event {
	out := e.events
	e.events = nil
	return out
}

// Cancel aborts request id at virtual time now: a waiting request leaves the
// queue; a running one frees its blocks at the end of the current step (at
// once when no step runs) and produces no more outputs. False when id is not
// in flight (or already cancelled).
func (e *Engine) Cancel(now time.Duration, id string) bool {
	e.advanceTo(now)
	s, ok := e.byID[id]
	if !ok || s.cancelled {
		return false
	}
	switch {
	case s.state == stWaiting:
		i := slices.Index(e.waiting, s)
		e.waiting = slices.Delete(e.waiting, i, i+1)
		e.done(s)
		e.st.Cancelled++
	case s.state == stAwaitingKV:
		i := slices.Index(e.awaiting, s)
		e.awaiting = slices.Delete(e.awaiting, i, i+1)
		e.free(s)
		e.done(s)
		e.st.Cancelled++
		// Its blocks and running slot may let the waiting queue move.
		if len(e.waiting) > 0 && !e.pending && !e.inflight {
			e.pending, e.startAt = true, e.now
		}
	case !e.inflight:
		s.cancelled = true
		e.reapCancelled()
	default:
		s.cancelled = true
	}
	if len(e.running)+len(e.waiting) == 0 {
		e.pending = false
	}
	return true
}

// Pin pins the cached prefix of hashes (content hashes, the prompt's
// blocks in order) until now+ttl, as SGLang's HiCache pins a prefix
// (Dynamo's PIN): a pinned block evicted from the device is kept in host
// memory, and a later request past its device prefix loads it from there
// instead of computing it (counted cached, like Config.LowerTier's blocks;
// loads take no time, engine/DESIGN.md). Pins take no device blocks, so
// they never starve admission. A request hitting a pinned block renews its
// expiry to the request's time + ttl. Pinning stops at the first block not
// cached on the device or pinned, or when pins hold CapacityBlocks blocks
// (a host pool the device's size: HiCache's ratio 1). It returns the
// blocks newly pinned. Expired pins are dropped lazily (at the next Submit
// or Pin), as HiCache's eviction checks them.
func (e *Engine) Pin(now time.Duration, hashes []uint64, ttl time.Duration) int {
	e.expirePins(now)
	n := 0
	for _, h := range hashes {
		if p := e.pins[h]; p != nil {
			p.until, p.ttl = max(p.until, now+ttl), ttl
			continue
		}
		if _, ok := e.pool.lookup(h); !ok || len(e.pinOrder) >= e.pool.capacity() {
			break
		}
		e.pins[h] = &enginePin{until: now + ttl, ttl: ttl}
		e.pinOrder = append(e.pinOrder, h)
		n++
	}
	return n
}

// PinnedBlocks is the number of blocks pinned.
func (e *Engine) PinnedBlocks() int { return len(e.pinOrder) }

// pinned reports whether content hash h is pinned and not expired.
func (e *Engine) pinned(h uint64) bool {
	p := e.pins[h]
	return p != nil && p.until > e.now
}

// expirePins drops the pins due at now (pinOrder is walked, never the map).
func (e *Engine) expirePins(now time.Duration) {
	e.pinOrder = slices.DeleteFunc(e.pinOrder, func(h uint64) bool {
		if e.pins[h].until <= now {
			delete(e.pins, h)
			return true
		}
		return false
	})
}

// Clear drops every cached block and emits a cleared event, like vLLM's
// reset_prefix_cache, and drops every pin. As in vLLM, it fails (ErrBusy)
// while running requests hold blocks.
func (e *Engine) Clear(now time.Duration) error {
	e.advanceTo(now)
	clear(e.pins)
	e.pinOrder = e.pinOrder[:0]
	if u := e.pool.used(); u > 0 {
		return fmt.Errorf("engine %s: clear: %d blocks in use: %w", e.id, u, ErrBusy)
	}
	for b := range int32(e.pool.capacity()) {
		if e.pool.blocks[b].cached {
			e.pool.uncache(b)
		}
	}
	e.emit(e.now, router.KVEvent{Kind: router.EventCleared, BlockSize: e.cfg.BlockSize})
	return nil
}

// CachedBlocks returns every block the cache holds (running requests' and
// free ones), parents before children: the full state to republish on a
// resync.
func (e *Engine) CachedBlocks() []router.StoredBlock {
	idx := make([]int32, 0, e.pool.ncached)
	for b := range int32(e.pool.capacity()) {
		if e.pool.blocks[b].cached {
			idx = append(idx, b)
		}
	}
	slices.SortFunc(idx, func(a, b int32) int {
		if d := e.pool.blocks[a].depth - e.pool.blocks[b].depth; d != 0 {
			return int(d)
		}
		return int(a - b)
	})
	out := make([]router.StoredBlock, len(idx))
	for i, b := range idx {
		out[i] = router.StoredBlock{EngineHash: e.pool.blocks[b].ehash, ContentHash: e.pool.blocks[b].hash}
	}
	return out
}

// Stats returns a snapshot.
func (e *Engine) Stats() Stats {
	s := e.st
	s.Now = e.now
	s.Running = len(e.running)
	s.Waiting = len(e.waiting)
	s.AwaitingKV = len(e.awaiting)
	s.CapacityBlocks = e.pool.capacity()
	s.UsedBlocks = e.pool.used()
	s.FreeBlocks = e.pool.nfree
	s.CachedBlocks = e.pool.ncached
	s.Fill = float64(s.UsedBlocks) / float64(s.CapacityBlocks)
	return s
}

// advanceTo starts due steps and completes finished ones up to now.
func (e *Engine) advanceTo(now time.Duration) {
	for {
		if e.pending && e.startAt < now {
			e.startStep(e.startAt)
			continue
		}
		if e.inflight && e.stepEnd <= now {
			e.finishStep()
			continue
		}
		break
	}
	if now > e.now {
		e.now = now
	}
}

// startStep schedules one step at t (vLLM's Scheduler.schedule) and sets
// its completion time.
func (e *Engine) startStep(t time.Duration) {
	e.pending = false
	if !e.schedule(t) && len(e.batch) == 0 {
		// Everything running was preempted: schedule again from the queue.
		e.schedule(t)
	}
	if len(e.batch) == 0 {
		return
	}
	d := msToDuration(e.prof.PassMs(e.pass()), e.cfg.Speedup)
	e.inflight = true
	e.stepEnd = t + d
	e.st.Steps++
	e.st.BusyTime += d
	for _, w := range e.batch {
		if !w.decode {
			e.st.PrefillTokens += uint64(w.n)
		}
	}
}

// pass describes the scheduled batch for the timing model the way Dynamo's
// mocker does (lib/mocker/src/scheduler/vllm/core.rs, schedule_request and
// emit_ready_tokens): a request is a prefill when its chunk computes prompt
// tokens, counted by the prompt position before and after the chunk; it
// samples when the chunk reaches the end of its known tokens. Must run
// after schedule and before finishStep moves computed.
func (e *Engine) pass() Pass {
	x := Pass{Fill: float64(e.pool.used()) / float64(e.pool.capacity())}
	for _, w := range e.batch {
		s := w.s
		if s.computed+w.n >= s.numTokens() {
			x.Sampled++
		}
		if s.received {
			continue
		}
		before, after := min(s.computed, s.promptLen), min(s.computed+w.n, s.promptLen)
		if after > before {
			x.Prefills++
			x.ISL += after
			x.Prefix += before
		}
	}
	return x
}

// schedule fills e.batch; false when it preempted someone.
func (e *Engine) schedule(t time.Duration) bool {
	e.batch = e.batch[:0]
	budget := e.cfg.MaxBatchedTokens
	preempted := false
	// Running requests first, in the order they started: decode tokens and
	// the next chunks of partial prefills.
	for i := 0; i < len(e.running) && budget > 0; i++ {
		s := e.running[i]
		n := min(s.numTokens()-s.computed, budget)
		for !e.allocate(s, n, nil, 0, t, true) {
			v := e.victim()
			victim := e.running[v]
			if v < i {
				// Scheduled earlier in this step (only under a priority
				// policy): its work and budget are taken back.
				budget += e.unbatch(victim)
				i--
			}
			e.running = slices.Delete(e.running, v, v+1)
			e.preempt(victim, t)
			preempted = true
			if victim == s {
				s = nil
				break
			}
		}
		if s == nil {
			break
		}
		e.batch = append(e.batch, work{s: s, n: n, decode: s.inDecode})
		budget -= n
	}
	if preempted {
		return false
	}
	// Then waiting requests, FCFS, while they fit. Requests awaiting
	// their KV count against MaxRunning: they join the running set when it
	// arrives.
	for len(e.waiting) > 0 && budget > 0 {
		s := e.waiting[0]
		if len(e.running)+len(e.awaiting) >= e.cfg.MaxRunning {
			// Full. Only priority-preempt makes room, for a strictly
			// more urgent request than the least urgent running one.
			if e.cfg.Scheduling != SchedulingPriorityPreempt || len(e.running) == 0 {
				break
			}
			v := e.victim()
			victim := e.running[v]
			if s.priority >= victim.priority {
				break
			}
			budget += e.unbatch(victim)
			e.running = slices.Delete(e.running, v, v+1)
			e.preempt(victim, t)
			continue
		}
		hits := e.lookup(s)
		if s.remote {
			// vLLM's load_kv_async: blocks for the whole prompt now, no
			// compute and no caching until the KV has arrived.
			if !e.allocate(s, s.promptLen-len(hits)*e.cfg.BlockSize, hits, 0, t, false) {
				break
			}
			e.waiting[0] = nil
			e.waiting = e.waiting[1:]
			s.state = stAwaitingKV
			e.awaiting = append(e.awaiting, s)
			e.outputs = append(e.outputs, Output{
				RequestID: s.id, Kind: AwaitingKV, At: t,
				CachedTokens: len(hits) * e.cfg.BlockSize, PromptTokens: s.promptLen,
			})
			continue
		}
		loaded := e.lowerHits(s, len(hits))
		n := min(s.numTokens()-(len(hits)+loaded)*e.cfg.BlockSize, budget)
		if !e.allocate(s, n, hits, loaded, t, true) {
			break
		}
		e.st.LoadedTokens += uint64(loaded * e.cfg.BlockSize)
		e.waiting[0] = nil
		e.waiting = e.waiting[1:]
		s.state = stRunning
		e.running = append(e.running, s)
		if !s.scheduled {
			s.scheduled = true
			s.cached = (len(hits) + loaded) * e.cfg.BlockSize
			e.st.PromptTokens += uint64(s.promptLen)
			e.st.CachedTokens += uint64(s.cached)
		}
		e.batch = append(e.batch, work{s: s, n: n})
		budget -= n
	}
	return true
}

// lookup returns the blocks caching s's leading full blocks (vLLM's
// get_computed_blocks): at most numTokens-1 tokens, so that at least one
// token is computed.
func (e *Engine) lookup(s *seq) []int32 {
	maxHit := (s.numTokens() - 1) / e.cfg.BlockSize
	hits := e.hitBuf[:0]
	for i := range maxHit {
		b, ok := e.pool.lookup(e.hashAt(s, i))
		if !ok {
			break
		}
		hits = append(hits, b)
	}
	e.hitBuf = hits
	return hits
}

// lowerHits is how many of s's blocks from block gpu on the lower tier
// holds contiguously (Config.LowerTier), within lookup's bound.
func (e *Engine) lowerHits(s *seq, gpu int) int {
	if e.cfg.LowerTier == nil && len(e.pinOrder) == 0 {
		return 0
	}
	maxHit := (s.numTokens() - 1) / e.cfg.BlockSize
	n := 0
	for gpu+n < maxHit {
		h := e.hashAt(s, gpu+n)
		if !e.pinned(h) && (e.cfg.LowerTier == nil || !e.cfg.LowerTier(h)) {
			break
		}
		n++
	}
	return n
}

// allocate gives s the blocks for n more tokens (vLLM's allocate_slots).
// hits is non-nil for a request leaving the waiting queue: its cached prefix;
// the loaded blocks after it (lowerHits) get blocks here and count as
// computed, like a connector's loaded tokens.
// With cache, the newly full blocks are cached at once, as vLLM does at
// schedule time (without: a remote prefill, cached when its KV arrives).
// False (and nothing changed) when the free queue is too short.
func (e *Engine) allocate(s *seq, n int, hits []int32, loaded int, t time.Duration, cache bool) bool {
	bs := e.cfg.BlockSize
	base := s.computed
	have := len(s.blocks)
	fresh := s.state == stWaiting
	if fresh {
		base, have = (len(hits)+loaded)*bs, len(hits)
	}
	need := (base + n + bs - 1) / bs
	toAlloc := max(0, need-have)
	evictable := 0
	for _, b := range hits {
		if e.pool.blocks[b].ref == 0 {
			evictable++
		}
	}
	if toAlloc+evictable > e.pool.nfree {
		return false
	}
	if fresh {
		for _, b := range hits {
			e.pool.touch(b)
		}
		s.blocks = append(s.blocks[:0], hits...)
		s.computed, s.nStored = base, len(hits)
	}
	for range toAlloc {
		s.blocks = append(s.blocks, e.pool.take())
	}
	if ev := e.pool.takeEvicted(); ev != nil {
		e.st.EvictedBlocks += uint64(len(ev))
		e.emit(t, router.KVEvent{Kind: router.EventRemoved, Removed: ev, BlockSize: bs})
	}
	if cache {
		e.cacheFull(s, (base+n)/bs, t)
	}
	return true
}

// cacheFull caches s's blocks up to full (exclusive) and emits their stored
// event. A block whose content another block already caches is swapped for
// that block (vLLM v0's dedup), so that every cached block has one name and
// the chain parent of a stored block is always cached.
func (e *Engine) cacheFull(s *seq, full int, t time.Duration) {
	var ev router.KVEvent
	for i := s.nStored; i < full; i++ {
		h := e.hashAt(s, i)
		b := s.blocks[i]
		if x, ok := e.pool.lookup(h); ok {
			if x != b {
				e.pool.touch(x)
				s.blocks[i] = x
				e.pool.blocks[b].ref--
				e.pool.pushHead(b) // empty now: reuse it first
			}
			e.flushStored(&ev, t)
			continue
		}
		if ev.Blocks == nil {
			ev = router.KVEvent{Kind: router.EventStored, BlockSize: e.cfg.BlockSize,
				Blocks: make([]router.StoredBlock, 0, full-i)}
			if i > 0 {
				ev.HasParent, ev.Parent = true, e.pool.blocks[s.blocks[i-1]].ehash
			}
		}
		eh := e.EngineHash(h)
		e.pool.cache(b, h, eh, i)
		ev.Blocks = append(ev.Blocks, router.StoredBlock{EngineHash: eh, ContentHash: h})
	}
	e.flushStored(&ev, t)
	s.nStored = max(s.nStored, full)
}

func (e *Engine) flushStored(ev *router.KVEvent, t time.Duration) {
	if len(ev.Blocks) > 0 {
		e.st.StoredBlocks += uint64(len(ev.Blocks))
		e.emit(t, *ev)
	}
	*ev = router.KVEvent{}
}

// hashAt returns the content hash of s's block i, extending the known
// hashes past the prompt with unique output-block hashes (the model's output
// tokens are not simulated; their blocks can only hit for s itself, after a
// preemption). Block i must be full.
func (e *Engine) hashAt(s *seq, i int) uint64 {
	for len(s.hashes) <= i {
		j := uint64(len(s.hashes))
		var parent uint64
		if j > 0 {
			parent = s.hashes[j-1]
		}
		salt := splitmix.Mix(e.salt ^ s.serial*0x9e3779b97f4a7c15 ^ (j+1)*0xc2b2ae3d27d4eb4f)
		s.hashes = append(s.hashes, router.ChainHash(parent, salt))
	}
	return s.hashes[i]
}

// free releases s's blocks in reverse order, as vLLM does: the tail joins
// the free queue first and so is evicted before the prefix.
func (e *Engine) free(s *seq) {
	for i := len(s.blocks) - 1; i >= 0; i-- {
		e.pool.release(s.blocks[i])
	}
	s.blocks = s.blocks[:0]
	s.computed, s.nStored, s.inDecode, s.received = 0, 0, false, false
}

// preempt frees s and puts it back in the waiting queue (FCFS: at its
// head; a priority policy: in its (priority, arrival) place, as vLLM's
// PriorityRequestQueue.prepend_request does); it will be recomputed (with
// whatever prefix is still cached).
func (e *Engine) preempt(s *seq, t time.Duration) {
	e.free(s)
	s.state = stWaiting
	if e.cfg.Scheduling == SchedulingFCFS {
		e.waiting = slices.Insert(e.waiting, 0, s)
	} else {
		e.enqueue(s)
	}
	e.st.Preemptions++
	e.outputs = append(e.outputs, Output{
		RequestID: s.id, Kind: Preempted, At: t,
		CachedTokens: s.cached, PromptTokens: s.promptLen, OutputTokens: s.generated,
	})
}

// enqueue adds s to the waiting queue: last under FCFS; under a priority
// policy after every request of a smaller (priority, arrival), the order
// of vLLM's PriorityRequestQueue (a heap on the same key).
func (e *Engine) enqueue(s *seq) {
	if e.cfg.Scheduling == SchedulingFCFS {
		e.waiting = append(e.waiting, s)
		return
	}
	i, _ := slices.BinarySearchFunc(e.waiting, s, func(a, b *seq) int {
		if c := cmp.Compare(a.priority, b.priority); c != 0 {
			return c
		}
		return cmp.Compare(a.serial, b.serial)
	})
	e.waiting = slices.Insert(e.waiting, i, s)
}

// victim is the index in running of the request a block shortage (or, under
// SchedulingPriorityPreempt, a more urgent waiting request) preempts:
// the newest under FCFS; under a priority policy the one with the largest
// (priority, arrival), as vLLM's max(running, key=(priority,
// arrival_time)). running must not be empty.
func (e *Engine) victim() int {
	v := len(e.running) - 1
	if e.cfg.Scheduling == SchedulingFCFS {
		return v
	}
	for j, r := range e.running {
		w := e.running[v]
		if r.priority > w.priority || (r.priority == w.priority && r.serial > w.serial) {
			v = j
		}
	}
	return v
}

// unbatch takes s's work out of the step being scheduled and returns the
// tokens it had taken from the budget (0 when s was not scheduled yet).
func (e *Engine) unbatch(s *seq) int {
	j := slices.IndexFunc(e.batch, func(w work) bool { return w.s == s })
	if j < 0 {
		return 0
	}
	n := e.batch[j].n
	e.batch = slices.Delete(e.batch, j, j+1)
	return n
}

// finishStep completes the running step (vLLM's update_from_output).
func (e *Engine) finishStep() {
	t := e.stepEnd
	e.inflight = false
	finished := false
	for _, w := range e.batch {
		s := w.s
		if s.cancelled {
			continue
		}
		s.computed += w.n
		if s.computed < s.numTokens() {
			continue // a prefill chunk
		}
		s.inDecode = true
		s.generated++
		e.st.OutputTokens++
		if s.generated == 1 {
			e.outputs = append(e.outputs, Output{
				RequestID: s.id, Kind: FirstToken, At: t,
				CachedTokens: s.cached, PromptTokens: s.promptLen, OutputTokens: 1,
			})
		}
		// Token promptLen+generated−1 (0-based) opens a block when it is a
		// multiple of the block size.
		if e.cfg.ReportOutputBlocks && s.generated < s.target && (s.promptLen+s.generated-1)%e.cfg.BlockSize == 0 {
			e.outputs = append(e.outputs, Output{
				RequestID: s.id, Kind: OutputBlock, At: t,
				CachedTokens: s.cached, PromptTokens: s.promptLen, OutputTokens: s.generated,
			})
		}
		if s.generated >= s.target {
			e.free(s)
			e.done(s)
			e.st.Finished++
			finished = true
			e.outputs = append(e.outputs, Output{
				RequestID: s.id, Kind: Finished, At: t,
				CachedTokens: s.cached, PromptTokens: s.promptLen, OutputTokens: s.generated,
			})
		}
	}
	clear(e.batch)
	e.batch = e.batch[:0]
	if finished {
		e.running = slices.DeleteFunc(e.running, func(s *seq) bool { return s.state == stDone })
	}
	e.reapCancelled()
	if len(e.running)+len(e.waiting) > 0 {
		e.pending, e.startAt = true, t
	}
}

// reapCancelled frees cancelled running requests.
func (e *Engine) reapCancelled() {
	n := 0
	for _, s := range e.running {
		if s.cancelled {
			e.free(s)
			e.done(s)
			e.st.Cancelled++
			n++
		}
	}
	if n > 0 {
		e.running = slices.DeleteFunc(e.running, func(s *seq) bool { return s.state == stDone })
	}
}

func (e *Engine) done(s *seq) {
	s.state = stDone
	delete(e.byID, s.id)
}

func (e *Engine) emit(t time.Duration, kv router.KVEvent) {
	e.nextEvent++
	e.st.Events++
	e.events = append(e.events, Event{ID: e.nextEvent, At: t, KV: kv})
}

func fnv64(s string) uint64 {
	h := uint64(14695981039346656037)
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= 1099511628211
	}
	return h
}
