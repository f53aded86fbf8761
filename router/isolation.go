package router

import (
	"math"
	"slices"
	"time"
)

// Tenant isolation (api/tenant: Ledger.Isolation and ReservedWorkers,
// kvrouter serve --tenant-isolation): a tenant over its share is kept off
// the workers reserved for the others, and waits while every other worker
// is full; a tenant under its share goes to a reserved worker while one
// has room. The tenant ledger decides who and how many; these are the load
// questions it asks the router.

// WorkerIDs appends the candidate workers' ids, sorted, to dst.
func (r *Router) WorkerIDs(dst []WorkerID) []WorkerID {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, w := range r.workers {
		dst = append(dst, w.ID)
	}
	return dst
}

// ShouldQueueExcept is ShouldQueueWithin over the workers that neither
// except nor req.Exclude names: it waits unless one of them has room for
// the request within share of the admission window. With none of them
// left it waits too (the workers left are all someone else's). Without a
// queue threshold nothing waits.
func (r *Router) ShouldQueueExcept(share float64, req Request, except []WorkerID) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	q := r.cfg.QueueThreshold
	if q == nil || len(r.workers) == 0 {
		return false
	}
	var overlaps []int
	if share < 1 {
		overlaps = r.overlapsLocked(req.Hashes)
	}
	f := *q * max(share, 0)
	for i, w := range r.workers {
		if slices.Contains(except, w.ID) || slices.Contains(req.Exclude, w.ID) {
			continue
		}
		l := r.load.Load(w.ID)
		if share >= 1 {
			if !overQueueThreshold(*q, w, l) {
				return false
			}
			continue
		}
		tokens := max(req.Tokens-overlaps[i]*r.cfg.BlockSize, 0)
		if w.MaxBatchedTokens <= 0 || l.ActivePrefillTokens == 0 || float64(l.ActivePrefillTokens+tokens) <= f*float64(w.MaxBatchedTokens) {
			return false
		}
	}
	return true
}

// FirstTokenOrder appends to dst the workers (among those req does not
// exclude) a request of a tenant under its share should not go to while
// tenant isolation reserves workers: every worker whose predicted time to
// req's first token (the latency guard's prediction: the worker's prefill
// queue with req, less the prefix it caches, plus the expected KV wait;
// GuardRatio.TTFT·Idle) is above the quickest one's, and, when a reserved
// worker is among the quickest, the unreserved ones tied with it (a
// reserved worker runs no step of an over-share tenant, whose chunks the
// prediction does not see). A worker without a prediction (a KV wait not
// priced yet) counts as slower; with none predicted, nothing is added.
//
// Why not "a reserved worker while one has room" (the rule before,
// kvbench sim 2026-12-06): two workers of three held the steady tenant's
// load, and its slow requests all waited behind its own prefills on one
// of them (the kv cost weighs a worker's KV blocks, not its prefill queue)
// while the flood's worker, kept quick by the guard, had none queued.
func (r *Router) FirstTokenOrder(req Request, reserved []WorkerID, now time.Time, dst []WorkerID) []WorkerID {
	r.mu.Lock()
	defer r.mu.Unlock()
	ratios := r.guardRatiosLocked(req, now)
	best := math.Inf(1)
	for _, g := range ratios {
		if t := g.TTFT * g.Idle; t < best {
			best = t
		}
	}
	if math.IsInf(best, 1) {
		return dst
	}
	reservedQuickest := false
	for _, g := range ratios {
		if g.TTFT*g.Idle <= best && slices.Contains(reserved, g.Worker) {
			reservedQuickest = true
		}
	}
	for _, g := range ratios {
		if !(g.TTFT*g.Idle <= best) || (reservedQuickest && !slices.Contains(reserved, g.Worker)) {
			dst = append(dst, g.Worker)
		}
	}
	return dst
}
