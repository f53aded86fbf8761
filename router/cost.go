package router

import (
	"fmt"
	"math"
	"math/rand/v2"
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
	BusyReason          string
}

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
	var t costTerms
	bs := float64(cfg.BlockSize)
	active := 0.0
	if cfg.TrackPrefillTokens {
		active = float64(in.load.ActivePrefillTokens)
	}
	t.decay = 1
	if reqBlocks := (in.isl + cfg.BlockSize - 1) / cfg.BlockSize; cfg.TrackPrefillTokens && cfg.OverlapCreditDecay > 0 && reqBlocks > 0 {
		excess := float64(max(in.load.ActivePrefillTokens-in.minActivePrefill, 0)) / bs
		t.decay = 1 / (1 + cfg.OverlapCreditDecay*excess/float64(reqBlocks))
	}
	t.tierCredit = cfg.HostCacheHitWeight*float64(in.host) + cfg.DiskCacheHitWeight*float64(in.disk)
	t.prefill = (active+float64(in.isl))/bs - (cfg.OverlapCredit*t.decay*float64(in.overlap) + t.tierCredit)
	if t.prefill < 0 {
		t.prefill = 0
	}
	t.decode = float64(in.load.ActiveBlocks + in.newBlocks)
	t.requests = cfg.DecodeActiveRequestWeight * float64(in.load.Requests)
	t.cost = cfg.PrefillLoadScale*t.prefill + t.decode + t.requests
	return t
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

// busyReason says why a worker is busy under t, or "" when it is not. A
// fraction of a capacity the worker did not register does not apply to it
// (capacity.go); CapacityGaps reports that, so the skip is never silent.
func busyReason(t *Thresholds, w WorkerInfo, load WorkerLoad) string {
	if v := t.ActiveDecodeBlocks; v != nil && w.TotalBlocks > 0 &&
		float64(load.ActiveBlocks) > *v*float64(w.TotalBlocks) {
		return fmt.Sprintf("active decode blocks %d > %.3f of %d", load.ActiveBlocks, *v, w.TotalBlocks)
	}
	if v := t.ActivePrefillTokens; v != nil && int64(load.ActivePrefillTokens) > *v {
		return fmt.Sprintf("active prefill tokens %d > %d", load.ActivePrefillTokens, *v)
	}
	if v := t.ActivePrefillTokensFrac; v != nil && w.MaxBatchedTokens > 0 &&
		float64(load.ActivePrefillTokens) > *v*float64(w.MaxBatchedTokens) {
		return fmt.Sprintf("active prefill tokens %d > %.3f of %d batched", load.ActivePrefillTokens, *v, w.MaxBatchedTokens)
	}
	return ""
}

// pickByCost chooses among rows (all non-busy). Temperature 0: lowest cost,
// ties broken at random. Above 0: softmax over range-normalised costs,
// p ∝ exp(−(c − cmin)/((cmax − cmin)·T)).
func pickByCost(rows []WorkerCost, temperature float64, rng *rand.Rand) int {
	if len(rows) == 0 {
		return -1
	}
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, r := range rows {
		lo = min(lo, r.Cost)
		hi = max(hi, r.Cost)
	}
	if temperature <= 0 || hi == lo {
		// Reservoir-sample among the minima: one pass, uniform tie-break.
		pick, n := -1, 0
		for i, r := range rows {
			if r.Cost == lo {
				n++
				if rng.IntN(n) == 0 {
					pick = i
				}
			}
		}
		return pick
	}
	span := (hi - lo) * temperature
	total := 0.0
	weights := make([]float64, len(rows))
	for i, r := range rows {
		weights[i] = math.Exp(-(r.Cost - lo) / span)
		total += weights[i]
	}
	x := rng.Float64() * total
	for i, w := range weights {
		if x < w {
			return i
		}
		x -= w
	}
	return len(rows) - 1
}
