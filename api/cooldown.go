package api

import (
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/router"
)

// cooldown remembers workers whose connection just failed, so the next
// requests do not try them first while their registration (a lease of
// minutes) still lists them: a dead prefill worker would otherwise cost
// every disaggregated request a failed prefill before its fallback, and a
// blackholed worker a connect timeout per request.
type cooldown struct {
	mu     sync.Mutex // guards until (period is set once)
	period time.Duration
	until  map[router.WorkerID]time.Time
}

func newCooldown(d time.Duration) *cooldown {
	return &cooldown{period: d, until: map[router.WorkerID]time.Time{}}
}

// fail starts w's cool-down.
func (c *cooldown) fail(w router.WorkerID, now time.Time) {
	if c.period <= 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.until[w] = now.Add(c.period)
}

// cooling reports whether any worker may be cooling down: when none is,
// exclude would return nil whatever the candidates, and the caller need
// not list them (a copy of the model's worker list per request).
func (c *cooldown) cooling() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.until) > 0
}

// exclude returns the cooling workers among candidates, unless that would
// leave none: with every worker failing, trying one again beats refusing.
func (c *cooldown) exclude(candidates []router.WorkerID, now time.Time) []router.WorkerID {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []router.WorkerID
	for _, w := range candidates {
		until, ok := c.until[w]
		switch {
		case !ok:
		case now.After(until):
			delete(c.until, w)
		default:
			out = append(out, w)
		}
	}
	if len(out) == len(candidates) {
		return nil
	}
	return out
}

// excludeDisagg is the exclusion list of a two-stage request: every cooling
// prefill-only worker (none left means the request is served aggregated,
// which is the fallback wanted when no prefill worker is healthy), and the
// cooling decode-capable workers unless that would leave none.
func (c *cooldown) excludeDisagg(ws []router.RoleWorker, now time.Time) []router.WorkerID {
	var prefillOnly, decoders []router.WorkerID
	for _, w := range ws {
		if w.Role.Decodes() {
			decoders = append(decoders, w.ID)
		} else {
			prefillOnly = append(prefillOnly, w.ID)
		}
	}
	out := c.exclude(decoders, now)
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, w := range prefillOnly {
		if until, ok := c.until[w]; ok && now.Before(until) {
			out = append(out, w)
		}
	}
	return out
}

func workerIDs(ws []router.WorkerInfo) []router.WorkerID {
	out := make([]router.WorkerID, len(ws))
	for i, w := range ws {
		out[i] = w.ID
	}
	return out
}
