// Package warmup is the rule that sends a joining worker some traffic on
// purpose so its cache fills before it is needed (issue 29 item 3): with
// cache-aware routing a new worker, holding nothing, wins only requests
// whose prefix no worker holds, and warms slowly; cache-blind routing
// warms it fast but pays for it in hit rate everywhere. Steer sends it a
// share of the requests whose prefix is new (no worker holds any of it)
// or duplicated (two workers or more hold some of it: the hot ones), while
// the fleet has headroom; never a prefix only one worker holds (moving it
// would cost that worker's hits and the fleet a recompute for nothing).
//
// Pure: the caller draws the random number, measures the utilization and
// says which worker is warming (kvbench sim's --warmup-share today; the
// live proxy is not wired yet).
package warmup

import (
	"math"

	"github.com/kvrouter/kvrouter/router"
)

// Policy is the rule's two knobs.
type Policy struct {
	// Share is the fraction of eligible requests sent to the warming
	// worker (0..1).
	Share float64
	// Headroom is the fleet utilization (load over the busy thresholds,
	// api's scaling advice) under which steering is allowed: a busy fleet
	// has no time for deliberate recomputes.
	Headroom float64
}

// DefaultHeadroom is the scaling advice's target utilization.
const DefaultHeadroom = 0.8

// Steer reports whether a request the router decided with rows (its cost
// table) and sent to chosen should go to the warming worker instead.
// draw is a uniform number in [0,1).
func Steer(rows []router.WorkerCost, chosen, warming router.WorkerID, utilization, draw float64, p Policy) bool {
	if chosen == warming || draw >= p.Share || utilization >= p.Headroom {
		return false
	}
	present, holders := false, 0
	for _, r := range rows {
		if r.Worker == warming {
			if r.Busy {
				return false
			}
			present = true
		}
		if r.Overlap > 0 {
			holders++
		}
	}
	return present && holders != 1
}

// WorkerUtilization is w's load over its busy threshold: the largest
// ratio among the thresholds set (those Route refuses a worker by), or,
// with none, its active KV blocks over its capacity; 0 when nothing can
// be measured.
func WorkerUtilization(t router.Thresholds, w router.WorkerInfo, load router.WorkerLoad) float64 {
	u, set := 0.0, false
	if v := t.ActiveDecodeBlocks; v != nil && w.TotalBlocks > 0 {
		set = true
		u = max(u, ratio(float64(load.ActiveBlocks), *v*float64(w.TotalBlocks)))
	}
	if v := t.ActivePrefillTokens; v != nil {
		set = true
		u = max(u, ratio(float64(load.ActivePrefillTokens), float64(*v)))
	}
	if v := t.ActivePrefillTokensFrac; v != nil && w.MaxBatchedTokens > 0 {
		set = true
		u = max(u, ratio(float64(load.ActivePrefillTokens), *v*float64(w.MaxBatchedTokens)))
	}
	if !set && w.TotalBlocks > 0 {
		u = float64(load.ActiveBlocks) / float64(w.TotalBlocks)
	}
	return u
}

// ratio is n/d, with a zero threshold meaning busy at any load.
func ratio(n, d float64) float64 {
	switch {
	case d > 0:
		return n / d
	case n > 0:
		return math.Inf(1)
	}
	return 1 // a threshold of 0: busy even idle
}

// Utilization is the mean WorkerUtilization of ws, load giving each
// one's load (0 with no worker; a zero threshold's infinity counts as 1).
func Utilization(t router.Thresholds, ws []router.WorkerInfo, load func(router.WorkerID) router.WorkerLoad) float64 {
	if len(ws) == 0 {
		return 0
	}
	var sum float64
	for _, w := range ws {
		sum += min(WorkerUtilization(t, w, load(w.ID)), 1e6)
	}
	return sum / float64(len(ws))
}
