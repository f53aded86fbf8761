package router

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"time"
)

// WorkerInfo is what the router knows of a worker besides its cache.
type WorkerInfo struct {
	ID               WorkerID
	TotalBlocks      int // KV cache capacity in blocks (for the decode threshold)
	MaxBatchedTokens int // max tokens per step (for the prefill fraction threshold)
}

// WorkerCost is one row of a routing decision's cost table.
type WorkerCost struct {
	Worker              WorkerID
	Overlap             int     // cached prefix blocks
	HostOverlap         int     // blocks past Overlap held in the host tier (TierOverlap)
	DiskOverlap         int     // blocks past those held in the disk and external tiers
	TierCredit          float64 // host weight·HostOverlap + disk weight·DiskOverlap, in blocks
	ActivePrefillTokens int     // before this request
	ActiveBlocks        int     // before this request
	NewBlocks           int     // blocks this request adds to the worker's active set
	ActiveRequests      int     // sequences decoding before this request
	PrefillBlocks       float64 // (active prefill + isl)/bs − credit·decay·overlap, ≥ 0
	DecodeBlocks        float64 // active + new blocks
	RequestBlocks       float64 // decode active-request weight · active requests
	CreditDecay         float64 // the factor on the overlap credit (1: none; Config.OverlapCreditDecay)
	Cost                float64 // scale·prefill + decode + requests (+ Pooled)
	Pooled              float64 // kv-pooled's placement terms, included in Cost
	Busy                bool
	// BusyReason, when set, says why the row is busy; the router leaves
	// it empty and records the cause (why) instead, rendered by Reason
	// only when a decision log or /debug/route asks: a decision over a
	// fleet of busy workers formats nothing.
	BusyReason string
	why        busyWhy
}

// busyKind is why a row is busy.
type busyKind uint8

const (
	notBusy busyKind = iota
	busyExcluded
	busyDecodeBlocks  // n active blocks > x of m total
	busyPrefillTokens // n active prefill tokens > m
	busyPrefillFrac   // n active prefill tokens > x of m batched
	busyAdmission     // kv-pooled: x blocks over the admission line
	busySLO           // kv-pooled: predicted TTFT x s and TPOT y s miss the SLO (m, n ns)
	busySLOMargin     // kv-pooled: predicted TPOT x s plus observed error y s misses n ns while kv's pick misses
	busySLOSlower     // kv-pooled: predicted TTFT x s later than kv's pick's y s while kv's pick misses the TPOT limit
)

// busyWhy is a busy row's cause with the figures its reason prints,
// recorded on the decision path without formatting (Reason renders it).
type busyWhy struct {
	kind busyKind
	x, y float64
	m, n int64
}

// Reason says why the row is busy ("" when it is not): BusyReason when
// set, else the recorded cause, rendered now.
func (c WorkerCost) Reason() string {
	if c.BusyReason != "" {
		return c.BusyReason
	}
	return c.why.String()
}

// String renders the cause as the router used to format it on the
// decision path.
func (w busyWhy) String() string {
	switch w.kind {
	case busyExcluded:
		return "excluded by the caller"
	case busyDecodeBlocks:
		return fmt.Sprintf("active decode blocks %d > %.3f of %d", w.n, w.x, w.m)
	case busyPrefillTokens:
		return fmt.Sprintf("active prefill tokens %d > %d", w.n, w.m)
	case busyPrefillFrac:
		return fmt.Sprintf("active prefill tokens %d > %.3f of %d batched", w.n, w.x, w.m)
	case busyAdmission:
		return fmt.Sprintf("kv-pooled: would wait for KV admission (%.0f blocks over) while another worker can start it now", w.x)
	case busySLO:
		return fmt.Sprintf("kv-pooled: predicted TTFT %.0f ms, TPOT %.1f ms miss the SLO (%v, %v) while another worker meets it",
			w.x*1e3, w.y*1e3, time.Duration(w.m), time.Duration(w.n))
	case busySLOMargin:
		return fmt.Sprintf("kv-pooled: predicted TPOT %.1f ms with %.1f ms of observed error misses the SLO (%v) while kv's pick is predicted to miss it and another worker meets it with that error",
			w.x*1e3, w.y*1e3, time.Duration(w.n))
	case busySLOSlower:
		return fmt.Sprintf("kv-pooled: predicted TTFT %.0f ms, later than kv's pick's %.0f ms, while kv's pick is predicted to miss the TPOT limit: a departure must not cost the request its first token",
			w.x*1e3, w.y*1e3)
	}
	return ""
}

// setBusy marks the row busy for why.
func (c *WorkerCost) setBusy(why busyWhy) { c.Busy, c.why = true, why }

// costInput is what the cost of one worker needs.
type costInput struct {
	isl       int // prompt tokens
	overlap   int // cached blocks
	host      int // lower-tier blocks past overlap: host, then disk (TierOverlap)
	disk      int
	load      WorkerLoad
	newBlocks int
	// minActivePrefill is the least active prefill tokens among the
	// eligible workers: the floor the overlap credit decay measures a
	// worker's excess backlog from (Config.OverlapCreditDecay).
	minActivePrefill int
}

// costTerms is one worker's cost, term by term.
type costTerms struct {
	prefill, decode, requests, decay, tierCredit, cost float64
}

// computeTerms applies Dynamo's cost function to one worker:
//
//	cost = scale·max(0, (active prefill + isl)/bs − credit·decay·overlap
//	                    − host weight·host − disk weight·disk)
//	     + active blocks + new blocks
//	     + request weight·active requests
//
// host and disk are the blocks the worker holds in its offload tiers past
// its device prefix (Index.FindTieredMatches); their weights are not
// decayed, as in Dynamo's DefaultWorkerScorer::worker_logit.
//
// decay = 1/(1 + d·(excess/bs)/⌈isl/bs⌉), excess = the worker's active
// prefill tokens above the least loaded eligible worker's: a cache-rich
// worker with a prefill backlog earns less credit for its cache, and one at
// the load floor keeps all of it. Dynamo applies it only when prefill tokens
// are tracked; so do we, and also not for an empty prompt (Dynamo would
// divide by zero blocks).
func computeTerms(cfg *Config, in costInput) costTerms {
	p := newCostPlan(cfg, in.isl)
	return p.terms(in.overlap, in.host, in.disk, &in.load, in.newBlocks, in.minActivePrefill)
}

// costPlan is what computeTerms derives from the configuration and the
// prompt alone, once per decision instead of once per worker.
type costPlan struct {
	cfg       *Config
	isl       float64
	bs        float64
	invBs     float64 // 1/bs when bs is a power of two (perBlock), else 0
	reqBlocks float64
	decay     bool // the overlap credit decays (Config.OverlapCreditDecay, tracked prefill, a non-empty prompt)
}

func newCostPlan(cfg *Config, isl int) costPlan {
	reqBlocks := (isl + cfg.BlockSize - 1) / cfg.BlockSize
	p := costPlan{cfg: cfg, isl: float64(isl), bs: float64(cfg.BlockSize), reqBlocks: float64(reqBlocks),
		decay: cfg.TrackPrefillTokens && cfg.OverlapCreditDecay > 0 && reqBlocks > 0}
	if bs := cfg.BlockSize; bs > 0 && bs&(bs-1) == 0 {
		p.invBs = 1 / p.bs
	}
	return p
}

// perBlock is x/bs. For a power-of-two block size (every engine's) it
// multiplies by 1/bs instead: 2^-k is exact, and x/2^k and x·2^-k are the
// same real number rounded once by the same rule, so the bits are the
// division's (TestCostPerBlockIsDivision) at a fraction of its latency,
// which a decision paid once per worker.
func (p *costPlan) perBlock(x float64) float64 {
	if p.invBs != 0 {
		return x * p.invBs
	}
	return x / p.bs
}

// terms is computeTerms for one worker: the same operations in the same
// order, so the same bits.
func (p *costPlan) terms(overlap, host, disk int, load *WorkerLoad, newBlocks, minActivePrefill int) costTerms {
	// Scalars, and one composite literal at the end: a costTerms built
	// field by field lives on the stack and is copied out 16 bytes at a
	// time over 8-byte stores (a store-forwarding stall per pair, a
	// seventh of a 64-worker decision); the literal returns in registers.
	cfg := p.cfg
	active := 0.0
	if cfg.TrackPrefillTokens {
		active = float64(load.ActivePrefillTokens)
	}
	decay := 1.0
	if p.decay {
		excess := p.perBlock(float64(max(load.ActivePrefillTokens-minActivePrefill, 0)))
		decay = 1 / (1 + cfg.OverlapCreditDecay*excess/p.reqBlocks)
	}
	tierCredit := cfg.HostCacheHitWeight*float64(host) + cfg.DiskCacheHitWeight*float64(disk)
	prefill := p.perBlock(active+p.isl) - (cfg.OverlapCredit*decay*float64(overlap) + tierCredit)
	if prefill < 0 {
		prefill = 0
	}
	decode := float64(load.ActiveBlocks + newBlocks)
	requests := cfg.DecodeActiveRequestWeight * float64(load.Requests)
	cost := cfg.PrefillLoadScale*prefill + decode + requests
	return costTerms{prefill: prefill, decode: decode, requests: requests, decay: decay, tierCredit: tierCredit, cost: cost}
}

// computeCost is computeTerms for callers that need only the three sums.
func computeCost(cfg *Config, in costInput) (prefill, decode, cost float64) {
	t := computeTerms(cfg, in)
	return t.prefill, t.decode, t.cost
}

// minActivePrefill is the least active prefill tokens among rows[candidates]
// (0 without candidates).
func minActivePrefill(loads []LoadRow, candidates []int) int {
	if len(candidates) == 0 {
		return 0
	}
	least := loads[candidates[0]].ActivePrefillTokens
	for _, i := range candidates[1:] {
		least = min(least, loads[i].ActivePrefillTokens)
	}
	return least
}

// Formula renders a row the way Dynamo logs it: "5.188 = 1.5 * 2.125 + 2.000".
// A request term (Config.DecodeActiveRequestWeight) adds "+ requests 3.000",
// a decayed credit "(credit decay 0.500)", kv-pooled rows their placement
// terms: "… + 1.000 + pooled 12.500", lower-tier hits "(host 3, disk 1
// blocks: credit 2.500)".
func (c WorkerCost) Formula(scale float64) string {
	s := fmt.Sprintf("%.3f = %.1f * %.3f + %.3f", c.Cost, scale, c.PrefillBlocks, c.DecodeBlocks)
	if c.RequestBlocks != 0 {
		s += fmt.Sprintf(" + requests %.3f", c.RequestBlocks)
	}
	if c.Pooled != 0 {
		s += fmt.Sprintf(" + pooled %.3f", c.Pooled)
	}
	if c.CreditDecay != 0 && c.CreditDecay != 1 {
		s += fmt.Sprintf(" (credit decay %.3f)", c.CreditDecay)
	}
	if c.HostOverlap != 0 || c.DiskOverlap != 0 {
		s += fmt.Sprintf(" (host %d, disk %d blocks: credit %.3f)", c.HostOverlap, c.DiskOverlap, c.TierCredit)
	}
	return s
}

// busyCheck says why a worker is busy under t (kind notBusy when it is
// not), without formatting: Reason renders it. A fraction of a capacity
// the worker did not register does not apply to it (capacity.go);
// CapacityGaps reports that, so the skip is never silent.
func busyCheck(t *Thresholds, w WorkerInfo, load WorkerLoad) busyWhy {
	if v := t.ActiveDecodeBlocks; v != nil && w.TotalBlocks > 0 &&
		float64(load.ActiveBlocks) > *v*float64(w.TotalBlocks) {
		return busyWhy{kind: busyDecodeBlocks, n: int64(load.ActiveBlocks), x: *v, m: int64(w.TotalBlocks)}
	}
	if v := t.ActivePrefillTokens; v != nil && int64(load.ActivePrefillTokens) > *v {
		return busyWhy{kind: busyPrefillTokens, n: int64(load.ActivePrefillTokens), m: *v}
	}
	if v := t.ActivePrefillTokensFrac; v != nil && w.MaxBatchedTokens > 0 &&
		float64(load.ActivePrefillTokens) > *v*float64(w.MaxBatchedTokens) {
		return busyWhy{kind: busyPrefillFrac, n: int64(load.ActivePrefillTokens), x: *v, m: int64(w.MaxBatchedTokens)}
	}
	return busyWhy{}
}

// pickByCost chooses among rows (all non-busy). Temperature 0: lowest cost,
// ties broken at random. Above 0: softmax over range-normalised costs,
// p ∝ exp(−(c − cmin)/((cmax − cmin)·T)).
func pickByCost(rows []WorkerCost, temperature float64, rng *rand.Rand) int {
	return pickCost(rows, nil, temperature, rng, nil)
}

// pickCost is pickByCost over rows[idx[0]], rows[idx[1]], … (every row
// when idx is nil), returning a position in idx, with the same draws from
// rng; weights is scratch for the softmax (grown as needed). It allocates
// nothing when weights has room.
func pickCost(rows []WorkerCost, idx []int, temperature float64, rng *rand.Rand, weights *[]float64) int {
	n := len(rows)
	if idx != nil {
		n = len(idx)
	}
	if n == 0 {
		return -1
	}
	at := func(k int) float64 {
		if idx != nil {
			return rows[idx[k]].Cost
		}
		return rows[k].Cost
	}
	lo, hi := math.Inf(1), math.Inf(-1)
	for k := range n {
		c := at(k)
		lo = min(lo, c)
		hi = max(hi, c)
	}
	if temperature <= 0 || hi == lo {
		// Reservoir-sample among the minima: one pass, uniform tie-break.
		pick, ties := -1, 0
		for k := range n {
			if at(k) == lo {
				ties++
				if rng.IntN(ties) == 0 {
					pick = k
				}
			}
		}
		return pick
	}
	span := (hi - lo) * temperature
	total := 0.0
	var ws []float64
	if weights != nil {
		ws = slices.Grow((*weights)[:0], n)[:n]
		*weights = ws
	} else {
		ws = make([]float64, n)
	}
	for k := range n {
		ws[k] = math.Exp(-(at(k) - lo) / span)
		total += ws[k]
	}
	x := rng.Float64() * total
	for k, w := range ws {
		if x < w {
			return k
		}
		x -= w
	}
	return n - 1
}
