// Package fleetplan is what a worker's removal would cost the fleet's
// cache (issue 29 item 1): the one cost model GET /fleet/plan ranks by
// (api/fleet.go) and kvbench sim's "remove the plan's cheapest worker"
// fleet event chooses by. Pure arithmetic: the callers gather the inputs
// (the replicated index's held and unique counts, the hit rates).
package fleetplan

import (
	"cmp"
	"slices"
	"strings"
	"time"
)

// Horizon is the time over which a removal's loss is counted: the hits on
// a worker's unique blocks that would become prefill instead (the issue's
// verification looks 5 minutes past a removal).
const Horizon = 5 * time.Minute

// ColdWeight is what one unique cached token nobody hit within the window
// adds to the cost: a tenth of a lost hit. It orders workers the traffic
// has not told apart (an idle fleet) by what they alone hold, without
// letting a large cold cache outweigh hot traffic.
const ColdWeight = 0.1

// Worker is one worker's inputs.
type Worker struct {
	ID        string
	BlockSize int
	// HeldBlocks and UniqueBlocks: blocks it holds in the index, and those
	// no other worker holds.
	HeldBlocks, UniqueBlocks int
	// CachedTokensPerS: cached prompt tokens served from it per second
	// recently (the router's captured hits on its ranks).
	CachedTokensPerS float64
}

// Cost is a worker's expected loss if it left now.
type Cost struct {
	// RecomputeTokensPerS is the prefill the fleet would take on per
	// second: its recent cached tokens times the share of its blocks no
	// other worker holds (hits on blocks others hold are served
	// elsewhere; hits are assumed spread evenly over its blocks, as the
	// index counts holders per block, not hits).
	RecomputeTokensPerS float64
	// UniqueFraction is UniqueBlocks / HeldBlocks (0 with nothing held).
	UniqueFraction float64
	// Removal is the expected cached tokens lost over Horizon plus
	// ColdWeight per unique cached token: the ranking key.
	Removal float64
}

// Of is w's cost.
func Of(w Worker) Cost {
	var c Cost
	if w.HeldBlocks > 0 {
		c.UniqueFraction = float64(w.UniqueBlocks) / float64(w.HeldBlocks)
	}
	c.RecomputeTokensPerS = w.CachedTokensPerS * c.UniqueFraction
	c.Removal = c.RecomputeTokensPerS*Horizon.Seconds() + ColdWeight*float64(w.UniqueBlocks*w.BlockSize)
	return c
}

// Rank returns the indexes of ws from the cheapest to remove to the
// dearest, ties by id.
func Rank(ws []Worker) []int {
	costs := make([]float64, len(ws))
	order := make([]int, len(ws))
	for i, w := range ws {
		costs[i], order[i] = Of(w).Removal, i
	}
	slices.SortFunc(order, func(a, b int) int {
		return cmp.Or(cmp.Compare(costs[a], costs[b]), strings.Compare(ws[a].ID, ws[b].ID))
	})
	return order
}
