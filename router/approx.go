package router

import "time"

// predictions remember when each (worker, block) the router predicted in
// kv-approx mode expires. Entries are kept in time order (the TTL is one
// constant, so appending keeps the order); a refreshed block leaves a stale
// entry behind that expiry recognises by its outdated time.
type predictions struct {
	until map[predKey]time.Time
	queue []predEntry
}

type predKey struct {
	worker WorkerID
	hash   uint64
}

type predEntry struct {
	key   predKey
	until time.Time
}

func newPredictions() predictions {
	return predictions{until: make(map[predKey]time.Time)}
}

// predictLocked records that w will hold hashes until now+TTL.
// r.mu must be held.
func (r *Router) predictLocked(w WorkerID, hashes []uint64, now time.Time) {
	if len(hashes) == 0 {
		return
	}
	until := now.Add(r.cfg.ApproxTTL)
	blocks := make([]StoredBlock, len(hashes))
	for i, h := range hashes {
		blocks[i] = StoredBlock{EngineHash: h, ContentHash: h}
		k := predKey{w, h}
		r.preds.until[k] = until
		r.preds.queue = append(r.preds.queue, predEntry{k, until})
	}
	// Predictions need no parent: the router placed the whole chain itself.
	_ = r.predicted.Apply(w, KVEvent{Kind: EventStored, Blocks: blocks})
}

// expirePredictionsLocked drops predicted blocks whose TTL has passed.
// r.mu must be held.
func (r *Router) expirePredictionsLocked(now time.Time) {
	q := r.preds.queue
	n := 0
	for n < len(q) && !q[n].until.After(now) {
		e := q[n]
		if until, ok := r.preds.until[e.key]; ok && until.Equal(e.until) {
			delete(r.preds.until, e.key)
			_ = r.predicted.Apply(e.key.worker, KVEvent{Kind: EventRemoved, Removed: []uint64{e.key.hash}})
		}
		n++
	}
	if n > 0 {
		r.preds.queue = q[n:]
	}
}

// Predicted is the index of predicted blocks (kv-approx), for inspection.
func (r *Router) Predicted() *Index { return r.predicted }
