package router

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/internal/splitmix"
)

// OverlapSource is the narrow read side of a prefix index: the router reads
// the replicated index through it without knowing who applies events.
type OverlapSource interface {
	FindMatches(seq []uint64, dst []Overlap) []Overlap
}

// Routing outcomes that are not a worker.
var (
	ErrNoWorkers = errors.New("no workers registered")
	ErrAllBusy   = errors.New("all workers are busy")
)

// Request is what the router needs of one LLM request.
type Request struct {
	ID       string
	Hashes   []uint64 // sequence hashes of the prompt's full blocks
	Tokens   int      // prompt length in tokens (isl)
	Priority int      // nvext.agent_hints.priority: higher goes first in the queue
	// Sequences is OpenAI's n: the sequences generated from the one prompt,
	// booked as n decoding requests sharing the prompt's blocks. 0 means 1.
	Sequences int
	// ExpectedOutputTokens is the output per sequence the client expects
	// (nvext.agent_hints.osl, Dynamo's expected_output_tokens); 0 is
	// unknown. With Config.TrackOutputBlocks the output blocks decay
	// toward it.
	ExpectedOutputTokens int
	// Exclude lists workers not to choose (a retry after a failed connection).
	Exclude []WorkerID
	// LatencySensitivity is Dynamo's nvext.agent_hints.latency_sensitivity:
	// while the request waits in the admission queue it counts as having
	// arrived this much earlier (Queue). 0: none; never negative.
	LatencySensitivity time.Duration
}

// Decision is a routing decision with its whole cost table.
type Decision struct {
	Mode    Mode
	Worker  WorkerID
	Overlap int // cached blocks on the chosen worker
	Rows    []WorkerCost
	Scale   float64
	// ActiveHashes are the block hashes Route booked as the request's
	// active blocks: the prompt's, or with Config.DistinctActiveBlocks ones
	// no other request shares. Replica sync must announce these.
	ActiveHashes []uint64
}

// Explain renders the decision as Dynamo logs it: one formula per worker,
// then the choice.
func (d Decision) Explain() string {
	var b strings.Builder
	for _, r := range d.Rows {
		fmt.Fprintf(&b, "Formula for worker_id=%s with %d cached blocks: %s", r.Worker, r.Overlap, r.Formula(d.Scale))
		if r.Busy {
			fmt.Fprintf(&b, " (busy: %s)", r.Reason())
		}
		b.WriteByte('\n')
	}
	for _, r := range d.Rows {
		if r.Worker == d.Worker {
			fmt.Fprintf(&b, "Selected worker: worker_id=%s, logit: %.3f, cached blocks: %d\n", r.Worker, r.Cost, r.Overlap)
		}
	}
	return b.String()
}

// Router makes routing decisions for one model. It owns the load view and,
// in kv-approx mode, its own predicted index; the event-fed index is read
// through an OverlapSource. Safe for concurrent use.
type Router struct {
	// mu guards every field below except index, load and predicted, which
	// New sets once and which are safe for concurrent use themselves. Route
	// decides and books in one critical section, so concurrent requests
	// through one Router see each other's bookings; the scratch slices are
	// reused across decisions under it. Lock order: DisaggRouter.mu, then
	// mu, then ActiveLoad.mu and Index.mu (taken inside decisions).
	mu      sync.Mutex
	cfg     Config
	index   OverlapSource
	load    *ActiveLoad
	workers []WorkerInfo     // sorted by id
	pos     map[WorkerID]int // worker → position in workers
	rng     *rand.Rand
	next    uint64 // round-robin position

	predicted *Index // kv-approx: blocks this router believes it placed
	preds     predictions
	// shared, when set, replaces the private predictions: kv-approx reads
	// the replicated ones and hands new ones to record (the replica proposes
	// them through Raft so every replica predicts alike).
	shared       OverlapSource
	sharedRecord func(w WorkerID, hashes []uint64, now time.Time)

	buf      []Overlap
	cands    []int           // the candidates of a decision (positions in workers)
	weights  []float64       // softmax scratch (pickCost)
	loads    []LoadRow       // per worker, parallel to workers, during a decision
	loadRows LoadRowsCache   // the workers' load entries (reset by SetWorkers)
	overlaps []int           // likewise
	tierBuf  []TierOverlap   // likewise, lower tiers (tiersLocked)
	hostHits []int           // parallel to workers: blocks past the device prefix in the host tier
	diskHits []int           // likewise, disk and external tiers
	pooled   pooledScratch   // kv-pooled, per decision (pooled.go)
	outputs  pooledOutputs   // kv-pooled: the output lengths seen (Finished)
	wait     pooledWaitState // kv-pooled: observed prefill and decode rates (wait.go)
	// pinnedBlocks, when set, says how many distinct blocks of this
	// router's model are pinned on a worker (prefix pins, replicated):
	// kv-pooled counts them as held and not evictable (pooled.go).
	pinnedBlocks func(w WorkerID) int
	guard        []GuardRatio // the latency guard's predictions (guard.go), reused
}

// New returns a router. index may be nil for modes that ignore the cache.
// seed makes tie-breaks and sampling reproducible.
func New(cfg Config, index OverlapSource, seed uint64) (*Router, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	r := &Router{
		cfg:       cfg,
		index:     index,
		load:      NewActiveLoad(cfg.RequestExpiry),
		rng:       rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		predicted: NewIndex(cfg.BlockSize),
		preds:     newPredictions(),
	}
	return r, nil
}

// Config returns the current configuration.
func (r *Router) Config() Config {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cfg
}

// SetConfig replaces the knobs (a /busy_threshold change, for instance).
// The block size cannot change: hashes already computed would be wrong.
func (r *Router) SetConfig(cfg Config) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if cfg.BlockSize != r.cfg.BlockSize {
		return fmt.Errorf("block size cannot change from %d to %d: %w", r.cfg.BlockSize, cfg.BlockSize, ErrInvalidConfig)
	}
	r.cfg = cfg
	return nil
}

// SetPinnedBlocks gives kv-pooled the prefix pins: f(w) is the number of
// distinct blocks pinned on w. It must be cheap and safe for concurrent
// use; nil: no pins.
func (r *Router) SetPinnedBlocks(f func(w WorkerID) int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pinnedBlocks = f
}

// Load is the router's load view, shared with replica sync.
func (r *Router) Load() *ActiveLoad { return r.load }

// SetWorkers replaces the candidate set.
func (r *Router) SetWorkers(ws []WorkerInfo) {
	ws = slices.Clone(ws)
	slices.SortFunc(ws, func(a, b WorkerInfo) int { return strings.Compare(string(a.ID), string(b.ID)) })
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, old := range r.workers {
		if _, ok := slices.BinarySearchFunc(ws, old.ID, cmpWorker); !ok {
			r.predicted.RemoveWorker(old.ID)
		}
	}
	for _, w := range ws {
		r.predicted.AddWorker(w.ID)
	}
	r.workers = ws
	r.loadRows.Reset()
	r.pos = make(map[WorkerID]int, len(ws))
	for i, w := range ws {
		r.pos[w.ID] = i
	}
}

func cmpWorker(w WorkerInfo, id WorkerID) int { return strings.Compare(string(w.ID), string(id)) }

// Workers returns the candidate set, sorted by id.
func (r *Router) Workers() []WorkerInfo {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.workers)
}

// Decide computes the cost table and picks a worker without booking load.
func (r *Router) Decide(req Request, now time.Time) (Decision, error) {
	return r.DecideInto(req, now, nil)
}

// DecideInto is Decide with the cost table written into rows' storage
// (grown when it is short): a caller that is done with a decision's rows
// before its next decision (no decision log keeps them) passes the last
// Decision's Rows back, and the decision allocates nothing.
func (r *Router) DecideInto(req Request, now time.Time, rows []WorkerCost) (Decision, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.decideLocked(req, now, rows)
}

// Route decides and books the request's load on the chosen worker; in
// kv-approx mode it also records the predicted blocks.
func (r *Router) Route(req Request, now time.Time) (Decision, error) {
	return r.RouteInto(req, now, nil)
}

// RouteInto is Route with the cost table written into rows' storage, as
// DecideInto.
func (r *Router) RouteInto(req Request, now time.Time, rows []WorkerCost) (Decision, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	d, err := r.decideLocked(req, now, rows)
	if err != nil {
		return d, err
	}
	if r.cfg.Mode == ModeKVPooled {
		i := r.pos[d.Worker]
		r.wait.book(req.ID, d.Worker, now, d.Rows[i].PrefillBlocks, r.pooled.admit[i])
	}
	r.guardLearnLocked(req, d, now) // Config.LearnLatency (guard.go)
	prefill := req.Tokens - d.Overlap*r.cfg.BlockSize
	r.load.Add(Booking{ID: req.ID, Worker: d.Worker, Hashes: d.ActiveHashes, PrefillTokens: prefill, Sequences: req.Sequences, Added: now,
		PromptTokens: req.Tokens, ExpectedOutput: req.ExpectedOutputTokens})
	if r.cfg.Mode == ModeKVApprox {
		if r.sharedRecord != nil {
			r.sharedRecord(d.Worker, req.Hashes, now)
		} else {
			r.predictLocked(d.Worker, req.Hashes, now)
		}
	}
	return d, nil
}

// UseSharedPredictions makes kv-approx mode read predictions from src and
// pass new ones to record instead of keeping them in this router. record is
// called with the router's lock held: it must not call back into the router.
func (r *Router) UseSharedPredictions(src OverlapSource, record func(w WorkerID, hashes []uint64, now time.Time)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.shared, r.sharedRecord = src, record
}

// PrefillDone records a request's first token.
func (r *Router) PrefillDone(id string) { r.load.PrefillDone(id) }

// PrefillDoneAt records a request's first token at now (the caller's
// clock): kv-pooled learns the worker's prefill rate from it and when the
// request's decode started.
func (r *Router) PrefillDoneAt(id string, now time.Time) {
	r.load.PrefillDoneAt(id, now)
	r.mu.Lock()
	r.wait.firstToken(id, now)
	r.mu.Unlock()
}

// Free ends a request.
func (r *Router) Free(id string) {
	r.load.Free(id)
	r.mu.Lock()
	r.wait.forget(id)
	r.mu.Unlock()
}

// Generated reports that request id has generated tokens output tokens so
// far (all its sequences). With Config.TrackOutputBlocks (Dynamo's
// --router-track-output-blocks) the worker's active blocks grow by one
// placeholder block per block boundary the output crosses, and the
// request's exclusive blocks decay toward its expected output; the new
// progress is returned with true when a block appeared, for replica sync
// to announce. Without the flag it does nothing.
func (r *Router) Generated(id string, tokens int) (OutputProgress, bool) {
	r.mu.Lock()
	track, bs := r.cfg.TrackOutputBlocks, r.cfg.BlockSize
	r.mu.Unlock()
	if !track {
		return OutputProgress{}, false
	}
	return r.load.Generated(id, tokens, bs)
}

// Finished ends a request that completed after generating outputTokens
// tokens: Free, and kv-pooled learns the output length its decode reserve
// plans for (PooledConfig.OutputTokens). A caller that does not know the
// count calls Free.
func (r *Router) Finished(id string, outputTokens int) {
	r.FinishedAt(id, outputTokens, time.Time{})
}

// FinishedAt is Finished at now (the caller's clock): kv-pooled also
// learns the worker's decode rate from the request's first token to now.
// A zero now is Finished.
func (r *Router) FinishedAt(id string, outputTokens int, now time.Time) {
	r.load.Free(id)
	r.mu.Lock()
	r.outputs.observe(max(outputTokens, 0))
	if now.IsZero() {
		r.wait.forget(id)
	} else {
		r.wait.finished(id, outputTokens, now)
	}
	r.mu.Unlock()
}

// ObservedOutputTokens is the mean output length Finished has seen (over
// its recent window) and how many requests it rests on (0: none yet).
func (r *Router) ObservedOutputTokens() (mean float64, n int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.outputs.mean, r.outputs.n
}

// decideLocked decides into rows' storage. r.mu must be held.
func (r *Router) decideLocked(req Request, now time.Time, rows []WorkerCost) (Decision, error) {
	cfg := &r.cfg
	d := Decision{Mode: cfg.Mode, Scale: cfg.PrefillLoadScale}
	if len(r.workers) == 0 {
		return d, ErrNoWorkers
	}
	for _, id := range r.load.Expire(now) {
		r.wait.forget(id)
	}
	r.expirePredictionsLocked(now)

	overlaps := r.overlapsLocked(req.Hashes)
	host, disk := r.tiersLocked(req.Hashes)
	d.ActiveHashes = r.activeHashesLocked(req)
	r.loads = r.load.RowsCached(r.workers, r.pos, d.ActiveHashes, r.loads, &r.loadRows)
	// Eligibility first: the credit decay's floor is the least loaded
	// eligible worker's backlog, so costs follow eligibility.
	candidates := r.cands[:0]
	if t := &cfg.Thresholds; len(req.Exclude) == 0 && t.ActiveDecodeBlocks == nil && t.ActivePrefillTokens == nil && t.ActivePrefillTokensFrac == nil {
		for i := range r.workers {
			candidates = append(candidates, i)
		}
	} else {
		for i := range r.workers {
			if r.busyLocked(req, &r.workers[i], &r.loads[i].WorkerLoad).kind == notBusy {
				candidates = append(candidates, i)
			}
		}
	}
	r.cands = candidates
	floor := minActivePrefill(r.loads, candidates)
	plan := newCostPlan(cfg, req.Tokens)
	d.Rows = slices.Grow(rows[:0], len(r.workers))[:len(r.workers)]
	next := 0 // candidates[next] is the next eligible worker
	for i := range r.workers {
		w, lr := &r.workers[i], &r.loads[i]
		h, k := 0, 0
		if host != nil {
			h, k = host[i], disk[i]
		}
		t := plan.terms(overlaps[i], h, k, &lr.WorkerLoad, lr.NewBlocks, floor)
		// Field by field into the caller's storage: a composite literal
		// here is built on the stack and copied, twice the writes.
		row := &d.Rows[i]
		row.Worker, row.Overlap, row.HostOverlap, row.DiskOverlap, row.TierCredit = w.ID, overlaps[i], h, k, t.tierCredit
		row.ActivePrefillTokens, row.ActiveBlocks, row.NewBlocks, row.ActiveRequests = lr.ActivePrefillTokens, lr.ActiveBlocks, lr.NewBlocks, lr.Requests
		row.PrefillBlocks, row.DecodeBlocks, row.RequestBlocks, row.CreditDecay, row.Cost = t.prefill, t.decode, t.requests, t.decay, t.cost
		// why field by field: a busyWhy{} literal is zeroed on the stack
		// and copied.
		row.Pooled, row.Busy, row.BusyReason = 0, false, ""
		row.why.kind, row.why.x, row.why.y, row.why.m, row.why.n = notBusy, 0, 0, 0, 0
		if next < len(candidates) && candidates[next] == i {
			next++
		} else {
			row.setBusy(r.busyLocked(req, w, &lr.WorkerLoad))
		}
	}
	if len(candidates) == 0 {
		return d, ErrAllBusy
	}
	if cfg.Mode == ModeKVPooled {
		candidates = r.pooledCostsLocked(req, d.Rows, candidates, now)
	}
	pick := r.pickLocked(d.Rows, candidates)
	d.Worker, d.Overlap = d.Rows[pick].Worker, d.Rows[pick].Overlap
	return d, nil
}

// busyLocked says why w is not a candidate for req (kind notBusy when it
// is): excluded by the caller, or over a busy threshold. r.mu must be held.
func (r *Router) busyLocked(req Request, w *WorkerInfo, load *WorkerLoad) busyWhy {
	if len(req.Exclude) > 0 && slices.Contains(req.Exclude, w.ID) {
		return busyWhy{kind: busyExcluded}
	}
	return busyCheck(&r.cfg.Thresholds, *w, *load)
}

// overlapsLocked reads cached prefix lengths from the index the mode uses.
// The result is parallel to r.workers and reused across decisions.
// r.mu must be held.
func (r *Router) overlapsLocked(hashes []uint64) []int {
	r.overlaps = slices.Grow(r.overlaps[:0], len(r.workers))[:len(r.workers)]
	clear(r.overlaps)
	var src OverlapSource
	switch r.cfg.Mode {
	case ModeKV, ModeKVPooled:
		src = r.index
	case ModeKVApprox:
		src = r.predicted
		if r.shared != nil {
			src = r.shared
		}
	default:
		return r.overlaps
	}
	if src == nil || len(hashes) == 0 {
		return r.overlaps
	}
	r.buf = src.FindMatches(hashes, r.buf)
	for _, o := range r.buf {
		if i, ok := r.pos[o.Worker]; ok {
			r.overlaps[i] = o.Blocks
		}
	}
	return r.overlaps
}

// tiersLocked reads, for the prompt hashes overlapsLocked just matched
// (its matches are in r.buf), how many blocks past each worker's device
// prefix it holds in the host and in the disk tiers. Only kv mode reads
// them (kv-pooled prices placement on the device tier; kv-approx predicts
// device blocks only), only with a weight to spend them on and an index
// that has tiers, so a fleet without offload tiers pays a nil check. The
// results are parallel to r.workers and reused; nil when tiers are not
// read or nothing was found in them. r.mu must be held.
func (r *Router) tiersLocked(hashes []uint64) (host, disk []int) {
	if r.cfg.Mode != ModeKV || (r.cfg.HostCacheHitWeight == 0 && r.cfg.DiskCacheHitWeight == 0) || len(hashes) == 0 {
		return nil, nil
	}
	src, ok := r.index.(TieredOverlapSource)
	if !ok {
		return nil, nil
	}
	r.tierBuf = src.FindTieredMatches(hashes, r.buf, r.tierBuf)
	if len(r.tierBuf) == 0 {
		return nil, nil // no tier hits: the cost reads 0 for every worker, as from zeroed rows
	}
	n := len(r.workers)
	r.hostHits, r.diskHits = slices.Grow(r.hostHits[:0], n)[:n], slices.Grow(r.diskHits[:0], n)[:n]
	clear(r.hostHits)
	clear(r.diskHits)
	for _, o := range r.tierBuf {
		if i, ok := r.pos[o.Worker]; ok {
			r.hostHits[i], r.diskHits[i] = o.Host, o.Disk
		}
	}
	return r.hostHits, r.diskHits
}

// pickLocked chooses a row among candidates according to the mode.
// r.mu must be held.
func (r *Router) pickLocked(rows []WorkerCost, candidates []int) int {
	switch r.cfg.Mode {
	case ModeRoundRobin:
		i := candidates[r.next%uint64(len(candidates))]
		r.next++
		return i
	case ModeRandom:
		return candidates[r.rng.IntN(len(candidates))]
	case ModePowerOfTwo:
		return r.powerOfTwoLocked(candidates)
	case ModeLeastLoaded:
		best, n := -1, 0
		for _, i := range candidates {
			switch {
			case best < 0 || r.loads[i].Requests < r.loads[best].Requests:
				best, n = i, 1
			case r.loads[i].Requests == r.loads[best].Requests:
				n++
				if r.rng.IntN(n) == 0 {
					best = i
				}
			}
		}
		return best
	}
	return candidates[pickCost(rows, candidates, r.cfg.Temperature, r.rng, &r.weights)]
}

// powerOfTwoLocked is Dynamo's power-of-two-choices: two distinct
// candidates drawn at random, the one with fewer requests in flight wins (a
// tie goes to the first drawn). One candidate is chosen alone. r.mu must be
// held.
func (r *Router) powerOfTwoLocked(candidates []int) int {
	if len(candidates) == 1 {
		return candidates[0]
	}
	a := r.rng.IntN(len(candidates))
	b := r.rng.IntN(len(candidates) - 1)
	if b >= a {
		b++ // distinct from a, uniform over the rest
	}
	i, j := candidates[a], candidates[b]
	if r.loads[j].Requests < r.loads[i].Requests {
		return j
	}
	return i
}

// activeHashesLocked returns the hashes req's active blocks are booked
// under. By default the prompt's: requests sharing a prefix on a worker
// share its blocks (Dynamo's --router-assume-kv-reuse). With
// Config.DistinctActiveBlocks (--no-router-assume-kv-reuse) every block of
// every request counts on its own, as when transferred KV is not
// deduplicated on the decode side: hashes derived from the request id, one
// per prompt block, so no two requests share one. r.mu must be held.
func (r *Router) activeHashesLocked(req Request) []uint64 { return r.cfg.ActiveHashes(req) }

// ActiveHashes are the hashes req's active blocks are booked under with c
// (Router.activeHashesLocked): every booking of a request, aggregated or
// disaggregated, local or announced to peers, uses these.
func (c Config) ActiveHashes(req Request) []uint64 {
	if !c.DistinctActiveBlocks || len(req.Hashes) == 0 {
		return req.Hashes
	}
	return distinctHashes(req.ID, len(req.Hashes))
}

// distinctHashes derives n hashes from id (FNV-1a of the id, then a
// splitmix64 sequence): the same id gives the same hashes on every replica,
// different ids collide with negligible probability.
func distinctHashes(id string, n int) []uint64 {
	seed := uint64(14695981039346656037)
	for i := 0; i < len(id); i++ {
		seed ^= uint64(id[i])
		seed *= 1099511628211
	}
	out := make([]uint64, n)
	for i := range out {
		seed += splitmix.Gamma
		out[i] = splitmix.Mix(seed)
	}
	return out
}

// ShouldQueue reports whether a new request should wait: a queue threshold
// is set and every worker's active prefill tokens exceed that fraction of its
// max batched tokens. A worker that registered no max batched tokens is
// never over it (capacity.go), so it keeps the queue from forming.
func (r *Router) ShouldQueue() bool { return r.ShouldQueueWithin(1, Request{}) }

// ShouldQueueWithin is ShouldQueue for a request that may fill only share
// (in (0, 1)) of each worker's admission window: it waits unless some
// worker has no prefill work at all or would stay, with the prompt tokens
// the request makes it compute added (its tokens less the prefix that
// worker caches, by the index the mode reads), within share × the
// threshold. A share of 1 (or more) is ShouldQueue itself. Tenant fairness
// (api/tenant: Ledger.Window) gives a tenant over its share, while others
// are active, only its share of the window, so the rest stays free for
// them: what a worker was given it serves first come, first served, and a
// batch the flood filled to the threshold is one the others wait behind.
// The request's own computation counts because the room left is what
// matters.
func (r *Router) ShouldQueueWithin(share float64, req Request) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	q := r.cfg.QueueThreshold
	if q == nil || len(r.workers) == 0 {
		return false
	}
	if share >= 1 {
		for _, w := range r.workers {
			if !overQueueThreshold(*q, w, r.load.Load(w.ID)) {
				return false
			}
		}
		return true
	}
	f := *q * max(share, 0)
	overlaps := r.overlapsLocked(req.Hashes)
	for i, w := range r.workers {
		l := r.load.Load(w.ID)
		tokens := max(req.Tokens-overlaps[i]*r.cfg.BlockSize, 0)
		if w.MaxBatchedTokens <= 0 || l.ActivePrefillTokens == 0 || float64(l.ActivePrefillTokens+tokens) <= f*float64(w.MaxBatchedTokens) {
			return false
		}
	}
	return true
}
