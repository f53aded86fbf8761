package replica

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/router"
)

// workerHealth makes the seeds' worst failure loud: a worker that is routed
// to in kv mode but publishes no KV events, so the router silently routes at
// random. It watches each rank's event cursor; a rank routed to whose cursor
// has not moved for the limit gets a warning, the metric
// kvrouter_worker_events_missing=1 and a flag in /cluster/status.
type workerHealth struct {
	limit   time.Duration
	log     *slog.Logger
	gauge   *prometheus.GaugeVec
	mu      sync.Mutex                    // guards the four maps below (the gauge locks on its own)
	routed  map[router.WorkerID]int       // requests routed since the cursor last moved
	cursor  map[router.WorkerID]uint64    // last cursor seen
	movedAt map[router.WorkerID]time.Time // when it last moved (or was first seen)
	flagged map[router.WorkerID]time.Time // missing since
}

func newWorkerHealth(limit time.Duration, reg prometheus.Registerer, log *slog.Logger) *workerHealth {
	h := &workerHealth{limit: limit, log: log,
		gauge: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrouter_worker_events_missing",
			Help: "1 when a worker routed to has published no KV events for --events-missing-after (routing to it is blind)."}, []string{"worker"}),
		routed: map[router.WorkerID]int{}, cursor: map[router.WorkerID]uint64{},
		movedAt: map[router.WorkerID]time.Time{}, flagged: map[router.WorkerID]time.Time{}}
	reg.MustRegister(h.gauge)
	return h
}

func (h *workerHealth) noteRouted(w router.WorkerID) {
	h.mu.Lock()
	h.routed[w]++
	h.mu.Unlock()
}

// missing returns the flagged ranks and how long their events are missing.
func (h *workerHealth) missing() map[router.WorkerID]time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make(map[router.WorkerID]time.Duration, len(h.flagged))
	for w := range h.flagged {
		out[w] = time.Since(h.movedAt[w])
	}
	return out
}

func (h *workerHealth) run(ctx context.Context, r *replica) {
	if m := r.cfg.Router.Mode; h.limit <= 0 || (m != router.ModeKV && m != router.ModeKVPooled) {
		return // only the event-fed modes depend on events
	}
	t := time.NewTicker(min(h.limit/4, healthCheckMax))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			h.check(now, r.cursors())
		}
	}
}

func (h *workerHealth) check(now time.Time, cursors map[fsm.RankKey]uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for key, c := range cursors {
		w := key.ID()
		if old, ok := h.cursor[w]; !ok || old != c {
			h.cursor[w], h.movedAt[w], h.routed[w] = c, now, 0
			if _, was := h.flagged[w]; was {
				delete(h.flagged, w)
				h.gauge.WithLabelValues(string(w)).Set(0)
				h.log.Info("worker publishes KV events again", "worker", w)
			}
		}
	}
	for w, n := range h.routed {
		if _, seen := h.movedAt[w]; !seen {
			h.movedAt[w] = now // routed before any event: start the clock
		}
		_, flagged := h.flagged[w]
		if n > 0 && !flagged && now.Sub(h.movedAt[w]) > h.limit {
			h.flagged[w] = now
			h.gauge.WithLabelValues(string(w)).Set(1)
			h.log.Warn("worker routed in kv mode publishes no KV events: its cache is invisible and routing to it is blind",
				"worker", w, "silent_for", now.Sub(h.movedAt[w]).Round(time.Second), "requests_routed", n,
				"check", "the worker's --kv-events-config, the event bus connection, and the block size")
		}
	}
}
