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
	ActivePrefillTokens int     // before this request
	ActiveBlocks        int     // before this request
	NewBlocks           int     // blocks this request adds to the worker's active set
	PrefillBlocks       float64 // (active prefill + isl)/bs − credit·overlap, ≥ 0
	DecodeBlocks        float64 // active + new blocks
	Cost                float64 // scale·prefill + decode (+ Pooled)
	Pooled              float64 // kv-pooled's placement terms, included in Cost
	Busy                bool
	BusyReason          string
}

// costInput is what the cost of one worker needs.
type costInput struct {
	isl       int // prompt tokens
	overlap   int // cached blocks
	load      WorkerLoad
	newBlocks int
}

// computeCost applies Dynamo's cost function to one worker.
func computeCost(cfg *Config, in costInput) (prefill, decode, cost float64) {
	bs := float64(cfg.BlockSize)
	active := 0.0
	if cfg.TrackPrefillTokens {
		active = float64(in.load.ActivePrefillTokens)
	}
	prefill = (active+float64(in.isl))/bs - cfg.OverlapCredit*float64(in.overlap)
	if prefill < 0 {
		prefill = 0
	}
	decode = float64(in.load.ActiveBlocks + in.newBlocks)
	cost = cfg.PrefillLoadScale*prefill + decode
	return prefill, decode, cost
}

// Formula renders a row the way Dynamo logs it: "5.188 = 1.5 * 2.125 + 2.000".
// kv-pooled rows add their placement terms: "… + 1.000 + pooled 12.500".
func (c WorkerCost) Formula(scale float64) string {
	if c.Pooled != 0 {
		return fmt.Sprintf("%.3f = %.1f * %.3f + %.3f + pooled %.3f", c.Cost, scale, c.PrefillBlocks, c.DecodeBlocks, c.Pooled)
	}
	return fmt.Sprintf("%.3f = %.1f * %.3f + %.3f", c.Cost, scale, c.PrefillBlocks, c.DecodeBlocks)
}

// busyReason says why a worker is busy under t, or "" when it is not.
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
