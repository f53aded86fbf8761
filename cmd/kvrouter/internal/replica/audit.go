package replica

import (
	"log/slog"
	"sync"

	"github.com/kvrouter/kvrouter/router"
)

// cacheAudit compares, per worker, the cached tokens the router predicted
// from its index with those the engine reported. The seeds' worst failure —
// routing at random because the index does not match the engines — shows up
// here as a ratio far from 1: flagged in /cluster/status and logged once.
type cacheAudit struct {
	log *slog.Logger
	mu  sync.Mutex // guards per and its entries
	per map[router.WorkerID]*auditEntry
}

type auditEntry struct {
	requests            int
	predicted, reported int64
	flagged             bool
}

// Below this many requests with a prediction the ratio says little.
const auditMinRequests = 20

func newCacheAudit(log *slog.Logger) *cacheAudit {
	return &cacheAudit{log: log, per: map[router.WorkerID]*auditEntry{}}
}

func (a *cacheAudit) observe(w router.WorkerID, predicted, reported int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	e := a.per[w]
	if e == nil {
		e = &auditEntry{}
		a.per[w] = e
	}
	e.requests++
	e.predicted += int64(predicted)
	e.reported += int64(reported)
	drift := e.drifting()
	if drift && !e.flagged {
		a.log.Warn("router's predicted cache hits disagree with what the worker reports: check tokenizer, chat template, block size and KV events",
			"worker", w, "predicted_tokens", e.predicted, "reported_tokens", e.reported, "requests", e.requests)
	}
	e.flagged = drift
}

// drifting: enough evidence, and the engine reports under half or over
// twice what the index predicted.
func (e *auditEntry) drifting() bool {
	if e.requests < auditMinRequests || (e.predicted == 0 && e.reported == 0) {
		return false
	}
	return 2*e.reported < e.predicted || e.reported > 2*e.predicted+int64(e.requests)*16
}

// report is the per-worker audit for /cluster/status.
func (a *cacheAudit) report() map[string]any {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[string]any, len(a.per))
	for w, e := range a.per {
		ratio := 0.0
		if e.predicted > 0 {
			ratio = float64(e.reported) / float64(e.predicted)
		}
		out[string(w)] = map[string]any{"requests": e.requests, "predicted_cached_tokens": e.predicted,
			"reported_cached_tokens": e.reported, "reported_over_predicted": ratio, "drifting": e.flagged}
	}
	return out
}
