package router

import "slices"

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
