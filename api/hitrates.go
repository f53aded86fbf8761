package api

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api/decisionlog"
	"github.com/kvrouter/kvrouter/api/hitrate"
	"github.com/kvrouter/kvrouter/router"
)

// Hit rates explained (DESIGN.md, "Hit rates"): every aggregated request
// runs its prompt blocks through the model's two reference caches at its
// first routing decision (hitRouted) and adds the four numbers to the
// windows when its answer ends (hitDone). The computation is
// api/hitrate's; this file feeds it and exposes it.

// hitRequest is one request's hit-rate bookkeeping on its prepared.
type hitRequest struct {
	arrived  bool          // the prompt went through the reference caches
	reuse    hitrate.Reuse // what they held of it
	worker   string        // the current decision's worker
	captured int           // its predicted cached tokens
}

// newHitTracker builds the replica's tracker (nil when
// Config.HitRateMaxBlocks is negative) and registers its gauges.
func newHitTracker(cfg Config, rep Replica) *hitrate.Tracker {
	if cfg.HitRateMaxBlocks < 0 {
		return nil
	}
	t := hitrate.New(hitrate.Config{MaxBlocks: cfg.HitRateMaxBlocks}, func(model string) int { return fleetBlocks(rep, model) })
	cfg.Registry.MustRegister(&hitCollector{t: t})
	return t
}

// fleetBlocks is the reachable cache's capacity: the registered KV blocks
// of the model's workers (each data-parallel rank is a router worker with
// its own). Read at most once a second per model (hitrate.Config).
func fleetBlocks(rep Replica, model string) int {
	rt, ok := rep.Router(model)
	if !ok {
		return 0
	}
	n := 0
	for _, w := range rt.Workers() {
		n += max(w.TotalBlocks, 0)
	}
	return n
}

// hitRouted runs p's prompt through the reference caches at its first
// successful decision (a retry is the same request: its blocks count once)
// and remembers the decision's prediction for hitDone.
func (s *Server) hitRouted(p *prepared, d router.Decision, routeErr error, now time.Time) {
	if s.hits == nil || routeErr != nil {
		return
	}
	bs := p.rt.Config().BlockSize
	if !p.hit.arrived {
		p.hit.arrived = true
		p.hit.reuse = s.hits.Arrive(now, p.model, p.req.Hashes, p.req.Tokens, bs)
	}
	p.hit.worker = string(d.Worker)
	p.hit.captured = hitrate.Tokens(d.Overlap, bs, p.req.Tokens)
}

// hitDone adds a served request (a 2xx answer) to the windows. The engine's
// usage counts as reported when it named its prompt tokens; an engine that
// leaves prompt_tokens_details out reports 0 cached, which the gap rules
// name (engine flags).
func (s *Server) hitDone(p *prepared, o decisionlog.Outcome) {
	if s.hits == nil || !p.hit.arrived || p.hit.worker == "" || o.Status < 200 || o.Status > 299 {
		return
	}
	s.hits.Record(time.Now(), p.model, p.hit.worker, hitrate.Sample{PromptTokens: p.req.Tokens, Reuse: p.hit.reuse,
		Captured: p.hit.captured, Reported: o.PromptTokens > 0, EnginePrompt: o.PromptTokens, EngineCached: o.CachedTokens})
	p.hit.worker = ""
}

// addHitRates puts the hit_rates section into a /cluster/status document.
func (s *Server) addHitRates(doc any) {
	if m, ok := doc.(map[string]any); ok && s.hits != nil {
		m["hit_rates"] = s.hits.Snapshot(time.Now())
	}
}

// hitCollector exports the rates at scrape time. Cardinality: models ×
// windows × 2 fleet-wide series, plus models × workers served within the
// longest window × windows × 2; a worker's series go when it has served
// nothing for that long.
type hitCollector struct{ t *hitrate.Tracker }

var (
	descHitAvailable = prometheus.NewDesc("kvrouter_hit_rate_available",
		"Reuse available: the fraction of prompt tokens an unbounded pooled cache would have served on this replica's traffic (leading blocks whose chained hash was seen before, within the history bound), fleet-wide per model.",
		[]string{"model", "window"}, nil)
	descHitReachable = prometheus.NewDesc("kvrouter_hit_rate_reachable",
		"Reuse reachable: the fraction of prompt tokens one pooled LRU cache of the fleet's capacity (sum of total_kv_blocks) would have served on the same block stream, fleet-wide per model.",
		[]string{"model", "window"}, nil)
	descHitCaptured = prometheus.NewDesc("kvrouter_hit_rate_captured",
		"Reuse captured by routing: the router's predicted cached tokens on the chosen worker over prompt tokens; worker=\"\" is the model's whole fleet.",
		[]string{"model", "worker", "window"}, nil)
	descHitDelivered = prometheus.NewDesc("kvrouter_hit_rate_delivered",
		"Reuse delivered by the engines: reported cached tokens (usage.prompt_tokens_details.cached_tokens) over their reported prompt tokens; worker=\"\" is the model's whole fleet.",
		[]string{"model", "worker", "window"}, nil)
	descHitPrompt = prometheus.NewDesc("kvrouter_hit_rate_prompt_tokens",
		"Prompt tokens of the requests the hit rates of the window are computed over (how much to trust them).",
		[]string{"model", "window"}, nil)
	descHitFleet = prometheus.NewDesc("kvrouter_hit_rate_fleet_kv_blocks",
		"The reachable cache's capacity: the registered KV blocks of the model's workers.",
		[]string{"model"}, nil)
)

func (h *hitCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descHitAvailable, descHitReachable, descHitCaptured, descHitDelivered, descHitPrompt, descHitFleet} {
		ch <- d
	}
}

func (h *hitCollector) Collect(ch chan<- prometheus.Metric) {
	gauge := func(d *prometheus.Desc, v *float64, labels ...string) {
		if v != nil { // nothing to divide: no series rather than a made-up 0
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, *v, labels...)
		}
	}
	for _, m := range h.t.Snapshot(time.Now()).Models {
		ch <- prometheus.MustNewConstMetric(descHitFleet, prometheus.GaugeValue, float64(m.FleetBlocks), m.Model)
		for _, r := range m.Windows {
			ch <- prometheus.MustNewConstMetric(descHitPrompt, prometheus.GaugeValue, float64(r.PromptTokens), m.Model, r.Window)
			gauge(descHitAvailable, r.Available, m.Model, r.Window)
			gauge(descHitReachable, r.Reachable, m.Model, r.Window)
			gauge(descHitCaptured, r.Captured, m.Model, "", r.Window)
			gauge(descHitDelivered, r.Delivered, m.Model, "", r.Window)
		}
		for _, w := range m.Workers {
			for _, r := range w.Windows {
				gauge(descHitCaptured, r.Captured, m.Model, w.Worker, r.Window)
				gauge(descHitDelivered, r.Delivered, m.Model, w.Worker, r.Window)
			}
		}
	}
}
