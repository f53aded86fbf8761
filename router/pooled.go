package router

import (
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/zeebo/xxh3"
)

// kv-pooled: Dynamo's cost function plus placement that makes N worker
// caches behave like one pooled cache. DESIGN.md explains the terms; in
// short, for every candidate worker w:
//
//	cost_w = scale·prefill_w + decode_w             Dynamo's, with the effective overlap
//	       + EvictWeight·evicted_w·unique_w          what the request's new blocks destroy
//	       + CopyWeight·copied_w                     content another candidate holds (not when overloaded)
//	       + HomeWeight·fresh·rank_w/(N−1)           new content goes to its rendezvous home
//	       + QueueWeight·(overflow_w − min overflow)  only when the cluster is overloaded
//
// and a worker the request would wait on for KV admission (its pinned
// blocks plus a decode reserve from the observed output lengths: half of
// one per running request, the expected peak, and a whole one for the new
// request) leaves the candidate set while some other worker can admit it
// at once (unless the cluster is overloaded). Every input is replicated
// (index, worker registry) or synced (ActiveLoad), except the observed
// output length, which each replica learns from the requests it finishes:
// replicas with the same state, load and mean output make the same
// decision, up to the rng's tie-break as in kv.

// Defaults of PooledConfig. They are prices in Dynamo's cost units (one
// block of prefill or decode) and one load fraction, set from the policy's
// reasoning (router/DESIGN.md), not fitted to a benchmark; kvbench sim's
// --pooled-* flags sweep them (BENCHMARKS.md, "Sensitivity").
const (
	// DefaultPooledEvictWeight prices one evicted block that no other
	// worker holds: the block will be recomputed later, and the recompute
	// evicts in turn.
	DefaultPooledEvictWeight = 8.0
	// DefaultPooledHomeWeight prices placing fresh content (blocks no
	// candidate holds) one rank further from its rendezvous home, per
	// fresh block and per 1/(N−1) of the ranking: the home vs the
	// last-ranked worker differ by one block per fresh block.
	DefaultPooledHomeWeight = 1.0
	// DefaultPooledOverloaded: when the in-flight requests' blocks exceed
	// this fraction of the candidates' total capacity, waiting for KV
	// admission is inevitable somewhere; kv-pooled then stops excluding
	// workers that would queue and weighs their overflow instead.
	DefaultPooledOverloaded = 0.8
	// DefaultPooledQueueWeight prices one block of admission overflow
	// beyond the least-overflowing candidate, in the overloaded regime.
	DefaultPooledQueueWeight = 0.5

	// pooledOutputWindow: the observed mean output length weighs the last
	// ~1,024 finished requests (a running mean whose count stops there),
	// so it follows a workload that changes.
	pooledOutputWindow = 1024
	pooledTieBreak     = 1e-6

	// pooledRunningReserveShare is the part of its decode reserve a
	// running request adds to the admission test when output blocks are
	// not tracked. With k requests running on a worker at progress spread
	// uniformly over their output of R blocks, the worker's occupancy
	// peaks just before the oldest ends: that one holds R, each other one
	// R·(1 − (p_max − p_i)), the new request R·(1 − p_max); in
	// expectation (k/2 + 1)·R, i.e. R/2 per running request plus R for
	// the new one (DESIGN.md works the sum). Not a tuned weight: it
	// follows from the output lengths the router observes.
	pooledRunningReserveShare = 0.5

	// pooledParitySteps is what the TTFT-parity rule (pooledNoSlowerLocked)
	// adds to a holder's expected wait, in engine steps of one output token
	// at the worker's observed rate: a running request frees its blocks at
	// the end of a step and the waiting one starts in the next, while the
	// expected end is continuous. Not tuned: the engine's granularity.
	pooledParitySteps = 2
)

// PooledConfig holds kv-pooled's settings; a nil field takes its default.
type PooledConfig struct {
	EvictWeight *float64 // DefaultPooledEvictWeight
	HomeWeight  *float64 // DefaultPooledHomeWeight
	Overloaded  *float64 // DefaultPooledOverloaded
	QueueWeight *float64 // DefaultPooledQueueWeight
	// OutputTokens is the output length the decode reserve plans for.
	// Nil: the mean the router observed (Router.Finished), and one block's
	// worth of tokens before the first observation.
	OutputTokens *float64
	// CopyWeight prices one block of content the request would recompute
	// on a worker while another candidate holds it, when the fleet is not
	// overloaded. Nil: the evict weight.
	CopyWeight *float64
	// WaitWeight prices a second of expected wait for KV admission as the
	// prefill blocks the worker computes in a second, times this weight
	// (wait.go). Nil: DefaultPooledWaitWeight; 0: no wait price (workers
	// over the admission line excluded, overflow priced by QueueWeight).
	WaitWeight *float64
}

// Validate rejects negative, NaN and infinite settings.
func (p PooledConfig) Validate() error {
	for _, f := range []struct {
		name string
		v    *float64
	}{{"evict weight", p.EvictWeight}, {"home weight", p.HomeWeight}, {"overloaded fraction", p.Overloaded},
		{"queue weight", p.QueueWeight}, {"output tokens", p.OutputTokens}, {"copy weight", p.CopyWeight},
		{"wait weight", p.WaitWeight}} {
		if f.v != nil && (!finite(*f.v) || *f.v < 0) {
			return fmt.Errorf("kv-pooled %s %v must be finite and non-negative: %w", f.name, *f.v, ErrInvalidConfig)
		}
	}
	return nil
}

func orDefault[T any](p *T, d T) T {
	if p == nil {
		return d
	}
	return *p
}

// CacheStats is the optional part of an OverlapSource that kv-pooled reads
// when the source offers it (Index does): how many blocks a worker holds
// and how many of those no other worker holds. Without it kv-pooled treats
// every worker as full of unique content.
type CacheStats interface {
	CacheCounts(w WorkerID) (held, unique int)
}

// pooledScratch is kv-pooled's per-decision scratch, reused across decisions.
type pooledScratch struct {
	eff    []int       // per worker: effective overlap
	terms  []costTerms // per worker (candidates only): the cost terms at the effective overlap, shared by the price and the admission rules
	over   []float64   // per candidate: admission overflow in blocks
	fill   []float64   // per candidate: fill with every expected output, the request placed there (pooledAdmissionLocked)
	held   []float64   // per candidate: the same before the request
	scores []rendezvousScore
	ranks  []int // per candidate
	kept   []int
	out    []trackedOutput // per candidate, when output blocks are tracked
	wait   []float64       // per candidate: the wait price (cost units)
	frees  []pendingFree
	admit  []bool // per worker: the admission test lets the request start at once
	// With an SLO (slo.go), per candidate: predicted TTFT and TPOT in
	// seconds, and whether both meet it.
	ttft, tpot []float64
	meets      []bool
	running    []runningSeq
	sloKept    []int
	// kv's rows and admission flags, kept while the placement's pick is
	// judged (pooledSLOPickLocked).
	saved   []WorkerCost
	kvAdmit []bool
	// noSlower, per candidate: the request is expected to get its first
	// token at this worker over the admission line no later than at the
	// fastest worker that starts it at once (pooledNoSlowerLocked).
	noSlower []bool
}

// pooledOutputs is the observed output length (Router.Finished).
type pooledOutputs struct {
	n    int
	mean float64
}

func (o *pooledOutputs) observe(tokens int) {
	o.n = min(o.n+1, pooledOutputWindow)
	o.mean += (float64(tokens) - o.mean) / float64(o.n)
}

type rendezvousScore struct {
	score float64
	j     int // candidate position
}

// pooledReserveLocked is the KV room, in blocks, a request's output takes
// beyond its prompt's full blocks (which the load view counts): the
// expected output tokens plus the partial last prompt block, half a block
// on average. r.mu must be held.
func (r *Router) pooledReserveLocked() float64 {
	bs := float64(r.cfg.BlockSize)
	out := bs // one block's worth until the first observation
	if r.outputs.n > 0 {
		out = r.outputs.mean
	}
	out = orDefault(r.cfg.Pooled.OutputTokens, out)
	return (out + (bs-1)/2) / bs
}

// trackedOutput is what output-block tracking booked on one worker, for
// the admission rule: pinned is the worker's active blocks without the
// decay toward the expected output (prompt blocks and output blocks, whole:
// an engine frees none of them before the request ends), and covered the
// part of the decode reserve they already stand for, Σ over the worker's
// requests of min(output blocks booked, reserve × sequences).
type trackedOutput struct {
	pinned  int
	covered float64
}

// trackedOutputs fills dst, parallel to candidates (positions in workers),
// with each candidate's trackedOutput for a decode reserve of reserve
// blocks per sequence; false when no request has output blocks booked
// (tracking off, here and on every peer), so the reserve stays as it was.
// The sum is kept exact whatever the map's order (whole blocks, and the
// sequences whose reserve is used up), so replicas agree to the bit.
func (a *ActiveLoad) trackedOutputs(workers []WorkerInfo, candidates []int, reserve float64, dst []trackedOutput) ([]trackedOutput, bool) {
	dst = dst[:0]
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.tracked == 0 {
		return dst, false
	}
	for _, i := range candidates {
		var t trackedOutput
		if wl := a.workers[workers[i].ID]; wl != nil {
			t.pinned = wl.blocks + wl.outBlocks
			blocks, seqs := 0, 0
			for r := range wl.tracked {
				if float64(r.out.Blocks) < reserve*float64(r.seqs) {
					blocks += r.out.Blocks
				} else {
					seqs += r.seqs
				}
			}
			t.covered = float64(blocks) + reserve*float64(seqs)
		}
		dst = append(dst, t)
	}
	return dst, true
}

// pooledCostsLocked rewrites the cost of every candidate row for kv-pooled
// and returns the candidates left (a subslice of candidates): with an SLO,
// pooledSLOLocked; without one, pooledPlaceLocked. r.mu must be held, with
// r.loads and r.overlaps filled for req.
func (r *Router) pooledCostsLocked(req Request, rows []WorkerCost, candidates []int, now time.Time) []int {
	if r.cfg.SLO.Set() {
		return r.pooledSLOLocked(req, rows, candidates, now)
	}
	return r.pooledPlaceLocked(req, rows, candidates, now)
}

// pooledPlaceLocked rewrites the cost of every candidate row for kv-pooled
// and returns the candidates left after the admission rule (a subslice of
// candidates). r.mu must be held, with r.loads and r.overlaps filled for req.
func (r *Router) pooledPlaceLocked(req Request, rows []WorkerCost, candidates []int, now time.Time) []int {
	ps := &r.pooled
	pc := &r.cfg.Pooled
	evictWeight := orDefault(pc.EvictWeight, DefaultPooledEvictWeight)
	homeWeight := orDefault(pc.HomeWeight, DefaultPooledHomeWeight)
	queueWeight := orDefault(pc.QueueWeight, DefaultPooledQueueWeight)
	n := len(req.Hashes)

	lo, hi := r.pooledOverlapsLocked(req, candidates)

	// The rendezvous key is the first block not every candidate holds: a
	// system prompt cached everywhere does not send every conversation to
	// the same home.
	key := uint64(0)
	if n > 0 {
		key = req.Hashes[min(lo, n-1)]
	}
	ranks := r.pooledRanksLocked(key, candidates)
	fresh := float64(n - hi) // blocks no candidate holds
	rankDen := float64(max(len(candidates)-1, 1))

	// Admission: would the request wait for KV blocks on the worker? Only
	// with every candidate's capacity known (registered TotalBlocks).
	// With output blocks tracked (Config.TrackOutputBlocks, or a peer's
	// SetOutput) the load already holds the output generated so far: the
	// reserve then covers only the expected output not yet booked, per
	// request (a request past the mean reserves nothing more, one that
	// just started its whole reserve), and the pinned blocks are counted
	// whole, without the decay toward the expected output, which prices
	// how soon they free, not whether they are held now.
	reserve := r.pooledReserveLocked()
	tracked, demand, capacity, minOver := r.pooledAdmissionLocked(candidates, reserve)
	known := r.capacitiesKnownLocked(candidates)
	overloaded := demand > orDefault(pc.Overloaded, DefaultPooledOverloaded)*capacity
	strict := known && minOver <= 0 && !overloaded
	queued := known && !strict
	ps.admit = slices.Grow(ps.admit[:0], len(r.workers))[:len(r.workers)]
	clear(ps.admit)
	for j, i := range candidates {
		ps.admit[i] = !known || ps.over[j] <= 0
	}
	// The queue price replaces the exclusion and the per-block overflow
	// price when every candidate's wait can be estimated.
	priced := known && r.pooledWaitsLocked(candidates, reserve, tracked, now)
	minWait := math.Inf(1)
	for j := range candidates {
		if priced {
			minWait = min(minWait, ps.wait[j])
		}
	}

	if strict && !priced {
		r.pooledNoSlowerLocked(req, candidates, reserve, tracked, now)
	}

	copyWeight := orDefault(pc.CopyWeight, evictWeight)
	if !strict && !priced {
		copyWeight = 0
	}
	stats, _ := r.index.(CacheStats)
	ps.kept = ps.kept[:0]
	for j, i := range candidates {
		w := r.workers[i]
		row := &rows[i]
		o := ps.eff[i]
		t := &ps.terms[i]
		row.PrefillBlocks, row.DecodeBlocks = t.prefill, t.decode
		cost := t.cost

		// Eviction: the blocks this request stores on w beyond w's free
		// room evict w's least recently used blocks; content also held
		// elsewhere is cheap to lose, so weigh by w's unique fraction.
		evict := float64(n - o)
		if stats != nil {
			held, unique := stats.CacheCounts(w.ID)
			if known {
				evict = max(0, evict-max(float64(w.TotalBlocks-held), 0))
			}
			evict = pooledEvictPrice(evict, held, unique, r.pinnedLocked(w.ID))
		}
		// A copy: blocks w would recompute that another candidate holds.
		// It takes as many blocks of the fleet's capacity as new content
		// does, and one of the two copies will sit idle until it ages out
		// (DESIGN.md). When the fleet is overloaded copies are how a hot
		// prefix spreads its load (and waiting is priced instead), so
		// they cost nothing there.
		copied := float64(hi - o)
		extra := evictWeight*evict + copyWeight*copied + homeWeight*fresh*float64(ranks[j])/rankDen
		// Exact ties go to the better-ranked worker, not to the rng: replicas
		// agree even on ties.
		extra += pooledTieBreak * float64(ranks[j])
		switch {
		case priced:
			extra += ps.wait[j] - minWait
		case queued:
			extra += queueWeight * (ps.over[j] - minOver)
		}
		row.Pooled = extra
		row.Cost = cost + extra
		if strict && !priced && ps.over[j] > 0 && !ps.noSlower[j] {
			row.setBusy(busyWhy{kind: busyAdmission, x: ps.over[j]})
			continue
		}
		ps.kept = append(ps.kept, i)
	}
	return ps.kept
}

// pooledEvictPrice is the price, in blocks at the evict weight, of evicting
// evict blocks from a worker holding held blocks, unique of them held by no
// other worker, pinned of them under a prefix pin. Without pins the
// victims are w's least recently used blocks, weighed by w's unique
// fraction (content also held elsewhere is cheap to lose). Pinned blocks
// are held and not evictable: the victims come from the unpinned blocks,
// weighed by their unique fraction (the pinned ones counted unique, the
// conservative side: no per-block lookup on the decision path), and any
// eviction beyond the unpinned blocks would take pinned ones, priced whole,
// never as free whoever else holds them.
func pooledEvictPrice(evict float64, held, unique, pinned int) float64 {
	pinned = min(max(pinned, 0), held)
	if pinned == 0 {
		if held > 0 {
			evict *= float64(unique) / float64(held)
		}
		return evict
	}
	unpinned := held - pinned
	victims := min(evict, float64(unpinned))
	price := evict - victims // into the pinned blocks: whole
	if unpinned > 0 {
		price += victims * float64(max(unique-pinned, 0)) / float64(unpinned)
	}
	return price
}

// pinnedLocked is the number of blocks pinned on w (0 without pins). r.mu
// must be held.
func (r *Router) pinnedLocked(w WorkerID) int {
	if r.pinnedBlocks == nil {
		return 0
	}
	return r.pinnedBlocks(w)
}

// pooledOverlapsLocked fills ps.eff (parallel to r.workers) with each
// candidate's effective overlap: cached (index) or being computed right now
// by an in-flight request on the same worker (synced load), so a burst of
// requests for new content lands on one worker, not on all of them; and
// ps.terms with each candidate's cost terms at that overlap (Dynamo's cost
// without the credit decay's floor), computed once for the price, the
// TTFT-parity rule and the SLO's TTFT. It returns the least and the
// deepest among the candidates. r.mu must be held, r.overlaps filled for
// req.
func (r *Router) pooledOverlapsLocked(req Request, candidates []int) (lo, hi int) {
	ps := &r.pooled
	ps.eff = growClear(ps.eff, len(r.workers))
	ps.terms = slices.Grow(ps.terms[:0], len(r.workers))[:len(r.workers)]
	r.load.inflightPrefix(r.pos, req.Hashes, ps.eff)
	plan := newCostPlan(&r.cfg, req.Tokens)
	lo, hi = len(req.Hashes), 0
	for _, i := range candidates {
		ps.eff[i] = max(ps.eff[i], r.overlaps[i])
		lo, hi = min(lo, ps.eff[i]), max(hi, ps.eff[i])
		l := &r.loads[i]
		ps.terms[i] = plan.terms(ps.eff[i], 0, 0, &l.WorkerLoad, l.NewBlocks, 0)
	}
	return lo, hi
}

// pooledAdmissionLocked fills ps.out (when output blocks are tracked),
// ps.over (each candidate's admission overflow in blocks, parallel to
// candidates), ps.fill (each candidate's fill once every request on it,
// the new one included, holds its expected output, a fraction of its
// capacity; 0 where the capacity is unknown) and ps.held (the same without
// the new request), and returns whether output
// blocks are tracked, the fleet's demand and capacity (the overload line)
// and the least overflow. r.mu must be held, r.loads filled.
func (r *Router) pooledAdmissionLocked(candidates []int, reserve float64) (tracked bool, demand, capacity, minOver float64) {
	ps := &r.pooled
	ps.out, tracked = r.load.trackedOutputs(r.workers, candidates, reserve, ps.out)
	ps.over, ps.fill, ps.held = ps.over[:0], ps.fill[:0], ps.held[:0]
	minOver = math.Inf(1)
	for j, i := range candidates {
		l := r.loads[i]
		total := float64(r.workers[i].TotalBlocks)
		pinned, pending := float64(l.ActiveBlocks), reserve*float64(l.Requests)
		if tracked {
			pinned, pending = float64(ps.out[j].pinned), pending-ps.out[j].covered
		}
		// The overload line counts every in-flight output at its full
		// length: what the fleet must hold before these requests end.
		demand += pinned + pending
		f, h := 0.0, 0.0
		if total > 0 {
			f, h = (pinned+pending+float64(l.NewBlocks)+reserve)/total, (pinned+pending)/total
		}
		ps.fill, ps.held = append(ps.fill, f), append(ps.held, h)
		if !tracked {
			// Admission on w plans for the expected peak instead: the
			// running requests are on average half way through their
			// output and free all of it when they end, before the new
			// request's output has grown (pooledRunningReserveShare).
			pending *= pooledRunningReserveShare
		}
		capacity += total
		o := pinned + float64(l.NewBlocks) + pending + reserve - total
		ps.over = append(ps.over, o)
		minOver = min(minOver, o)
	}
	return tracked, demand, capacity, minOver
}

// capacitiesKnownLocked: every candidate registered its KV capacity.
// Without it the admission rule and capacity-weighted homes are off
// (CapacityGaps reports it for the worker that lacks it).
// r.mu must be held.
func (r *Router) capacitiesKnownLocked(candidates []int) bool {
	for _, i := range candidates {
		if r.workers[i].TotalBlocks <= 0 {
			return false
		}
	}
	return true
}

// pooledRanksLocked ranks the candidates by weighted rendezvous hashing of
// key (rank 0 is the key's home): worker w scores −ln(u_w)/TotalBlocks_w
// with u_w uniform from hash(key, w), lowest first, so a key's home is w
// with probability proportional to w's capacity (equal weights when some
// capacity is unknown) and removing a worker only moves the keys it was
// home to. r.mu must be held.
func (r *Router) pooledRanksLocked(key uint64, candidates []int) []int {
	ps := &r.pooled
	ps.scores = ps.scores[:0]
	known := r.capacitiesKnownLocked(candidates)
	for j, i := range candidates {
		w := r.workers[i]
		h := xxh3.HashSeed([]byte(w.ID), key)
		u := (float64(h>>11) + 0.5) / (1 << 53)
		weight := 1.0
		if known {
			weight = float64(w.TotalBlocks)
		}
		ps.scores = append(ps.scores, rendezvousScore{-math.Log(u) / weight, j})
	}
	slices.SortFunc(ps.scores, func(a, b rendezvousScore) int {
		switch {
		case a.score < b.score:
			return -1
		case a.score > b.score:
			return 1
		}
		return a.j - b.j
	})
	ps.ranks = slices.Grow(ps.ranks[:0], len(candidates))[:len(candidates)]
	for rank, s := range ps.scores {
		ps.ranks[s.j] = rank
	}
	return ps.ranks
}

// inflightPrefix raises depth[i] to the number of leading hashes that
// in-flight requests on worker i hold (pos maps workers to i).
func (a *ActiveLoad) inflightPrefix(pos map[WorkerID]int, hashes []uint64, depth []int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for j, h := range hashes {
		if !a.mayHold(h) {
			return
		}
		advanced := false
		for _, hd := range a.holders[h] {
			if i, ok := pos[hd.worker]; ok && depth[i] == j {
				depth[i] = j + 1
				advanced = true
			}
		}
		if !advanced {
			return
		}
	}
}

// pooledWaitsLocked fills ps.wait, parallel to candidates, with the price
// of each candidate's expected wait for KV admission (0 where the request
// fits now) and reports whether every wait could be estimated: the wait
// weight is on, the output length was observed (or configured), and a
// prefill and a decode rate are known for every candidate over the line.
// r.mu must be held, ps.over filled.
func (r *Router) pooledWaitsLocked(candidates []int, reserve float64, tracked bool, now time.Time) bool {
	ps := &r.pooled
	pc := &r.cfg.Pooled
	weight := orDefault(pc.WaitWeight, DefaultPooledWaitWeight)
	if weight <= 0 || (r.outputs.n == 0 && pc.OutputTokens == nil) {
		return false
	}
	outTokens := orDefault(pc.OutputTokens, r.outputs.mean)
	ps.wait = ps.wait[:0]
	for j, i := range candidates {
		if ps.over[j] <= 0 {
			ps.wait = append(ps.wait, 0)
			continue
		}
		w := r.workers[i].ID
		spb, okB := r.wait.secondsPerBlock(w)
		spt, okT := r.wait.secondsPerToken(w)
		if !okB || !okT {
			return false
		}
		ps.frees = r.load.runningFrees(w, reserve, pooledRunningReserveShare, tracked, ps.frees)
		wait := expectedWait(ps.frees, ps.over[j], outTokens*spt, now)
		ps.wait = append(ps.wait, waitPrice(wait, spb, r.cfg.PrefillLoadScale, weight))
	}
	return true
}

// pooledNoSlowerLocked fills ps.noSlower, parallel to candidates: whether a
// candidate over the admission line is expected to give the request its
// first token no later than the fastest candidate that starts it at once:
// its expected wait, pooledParitySteps engine steps and its own prefill
// against the other's prefill (each the cost's prefill blocks at the
// worker's observed seconds per block).
// Such a holder keeps its place among the candidates in the strict regime:
// waiting for it costs the request nothing in expectation, and spilling
// would write a copy that evicts content elsewhere. It is TTFT parity for
// the request itself, not a price: no weight, and the copy and eviction
// prices never buy a longer wait (that exchange rate is WaitWeight's). All
// false while a rate or the output length is unobserved (before the first
// requests end), so the rule starts as plain exclusion, and while a
// request this router sent to wait for KV blocks has not started.
// r.mu must be held, ps.over and ps.eff filled.
func (r *Router) pooledNoSlowerLocked(req Request, candidates []int, reserve float64, tracked bool, now time.Time) {
	ps := &r.pooled
	ps.noSlower = slices.Grow(ps.noSlower[:0], len(candidates))[:len(candidates)]
	clear(ps.noSlower)
	// One wait at a time: while a request this router sent over the line
	// still waits for its first token, the fleet is queueing somewhere and
	// "the fastest worker starts it now" no longer describes what the
	// request would meet (the overloaded 3-worker seed-002 cell: p50 TTFT
	// up 5–20 % with the rule applied regardless).
	if r.wait.waiting > 0 {
		return
	}
	// When running requests end is what the router observed, whatever
	// output length the reserve is configured to plan for: a configured
	// length below the real one would make every holder look about to
	// free its blocks.
	if r.outputs.n == 0 {
		return
	}
	outTokens := r.outputs.mean
	prefillSeconds := func(i int) (float64, bool) {
		spb, ok := r.wait.secondsPerBlock(r.workers[i].ID)
		if !ok {
			return 0, false
		}
		return ps.terms[i].prefill * spb, true
	}
	fastest := math.Inf(1)
	for j, i := range candidates {
		if ps.over[j] > 0 {
			continue
		}
		t, ok := prefillSeconds(i)
		if !ok {
			return
		}
		fastest = min(fastest, t)
	}
	for j, i := range candidates {
		if ps.over[j] <= 0 {
			continue
		}
		w := r.workers[i].ID
		spt, ok := r.wait.secondsPerToken(w)
		if !ok {
			continue
		}
		t, ok := prefillSeconds(i)
		// The wait is the costly part (every running request's blocks);
		// a worker whose own prefill and steps already lose is done
		// without it, so only the prefix's holders pay for it.
		if !ok || pooledParitySteps*spt+t > fastest {
			continue
		}
		ps.frees = r.load.runningFrees(w, reserve, pooledRunningReserveShare, tracked, ps.frees)
		wait := expectedWait(ps.frees, ps.over[j], outTokens*spt, now)
		ps.noSlower[j] = wait+pooledParitySteps*spt+t <= fastest
	}
}
