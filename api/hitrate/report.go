package hitrate

import (
	"cmp"
	"slices"
	"time"
)

// Report is every model's rates over every window, as /cluster/status
// shows them.
type Report struct {
	Windows []string      `json:"windows"`
	Note    string        `json:"note"`
	Models  []ModelReport `json:"models"`
}

// ModelReport is one model's rates: fleet-wide, then per worker.
type ModelReport struct {
	Model string `json:"model"`
	// FleetBlocks is the reachable cache's capacity: the sum of the
	// registered workers' total_kv_blocks. HistoryBlocks is the distinct
	// blocks the available cache holds, at most HistoryBound.
	FleetBlocks   int            `json:"fleet_kv_blocks"`
	HistoryBlocks int            `json:"history_blocks"`
	HistoryBound  int            `json:"history_bound_blocks"`
	Windows       []Rates        `json:"windows"`
	Workers       []WorkerReport `json:"workers"`
}

// WorkerReport is one worker's captured and delivered rates.
type WorkerReport struct {
	Worker  string  `json:"worker"`
	Windows []Rates `json:"windows"`
}

// Rates are one window's fractions of the prompt tokens (null: nothing to
// divide; available and reachable are absent per worker, where they have
// no meaning).
type Rates struct {
	Window       string   `json:"window"`
	Requests     int64    `json:"requests"`
	PromptTokens int64    `json:"prompt_tokens"`
	Available    *float64 `json:"available,omitempty"`
	Reachable    *float64 `json:"reachable,omitempty"`
	Captured     *float64 `json:"captured"`
	// Delivered is over the requests whose answer carried usage
	// (DeliveredRequests of Requests), by the engines' own prompt tokens.
	Delivered         *float64 `json:"delivered"`
	DeliveredRequests int64    `json:"delivered_requests"`
	Gaps              []Gap    `json:"gaps"`
}

// Gap is a difference between two neighbouring rates worth naming, with
// its usual cause.
type Gap struct {
	Between string  `json:"between"` // e.g. "available-reachable"
	Points  float64 `json:"points"`  // the difference in percentage points
	Cause   string  `json:"cause"`   // capacity, placement, prediction_drift, engine_flags, under_prediction
	Why     string  `json:"why"`
}

// The gap rules' thresholds.
const (
	// GapPoints is the smallest difference named (5 percentage points):
	// smaller ones are within what the windows' request mix moves.
	GapPoints = 5.0
	// Delivered at or below EngineOffBelow while captured is at least
	// EngineOffCaptured means the engines cache nothing or do not say so.
	EngineOffBelow    = 0.02
	EngineOffCaptured = 0.10
)

// The causes.
const (
	CauseCapacity        = "capacity"
	CausePlacement       = "placement"
	CausePredictionDrift = "prediction_drift"
	CauseEngineFlags     = "engine_flags"
	CauseUnderPrediction = "under_prediction"
)

// Gaps names the gaps of r worth naming, each with its usual cause. Rates
// it lacks (a worker's available and reachable, delivered without usage)
// leave their gaps out.
func Gaps(r Rates) []Gap {
	out := []Gap{}
	pts := func(a, b *float64) (float64, bool) {
		if a == nil || b == nil {
			return 0, false
		}
		return (*a - *b) * 100, true
	}
	if d, ok := pts(r.Available, r.Reachable); ok && d >= GapPoints {
		out = append(out, Gap{"available-reachable", d, CauseCapacity,
			"the fleet's KV capacity cannot hold this traffic's reuse: blocks are evicted before they are used again even by one pooled LRU cache of all workers (more or larger workers, or a larger gpu-memory-utilization, close it)"})
	}
	if d, ok := pts(r.Reachable, r.Captured); ok && d >= GapPoints {
		out = append(out, Gap{"reachable-captured", d, CausePlacement,
			"routing sent requests away from the workers holding their prefixes, or spread copies of a prefix that take the room of others (load or busy thresholds outweighing overlap: try --router-mode kv-pooled or a higher --router-prefill-load-scale)"})
	}
	if r.Captured != nil && r.Delivered != nil && *r.Delivered <= EngineOffBelow && *r.Captured >= EngineOffCaptured {
		d, _ := pts(r.Captured, r.Delivered)
		out = append(out, Gap{"captured-delivered", d, CauseEngineFlags,
			"the engines report (almost) no cached tokens while the router predicts many: prefix caching is off (vLLM --enable-prefix-caching; SGLang without --disable-radix-cache) or the engine does not report cached tokens (vLLM --enable-prompt-tokens-details)"})
	} else if d, ok := pts(r.Captured, r.Delivered); ok && d >= GapPoints {
		out = append(out, Gap{"captured-delivered", d, CausePredictionDrift,
			"the router predicts blocks the engines no longer hold: KV events lost or late (see stale workers and events missing), evictions between routing and prefill, or a tokenizer, chat template or block size that differs from the engine's"})
	} else if ok && -d >= GapPoints {
		out = append(out, Gap{"delivered-captured", -d, CauseUnderPrediction,
			"the engines hit more than the router predicted: the index misses blocks the engines hold (KV events not arriving from these workers) — routing is blind to that cache"})
	}
	return out
}

// Note is the report's fixed explanation of what each number is.
const Note = "fractions of prompt tokens: available = an unbounded pooled cache (blocks seen before within history_bound_blocks), reachable = one pooled LRU of fleet_kv_blocks, both fleet-wide per model; captured = the router's predicted cached tokens on the chosen worker; delivered = the engines' reported cached tokens (usage.prompt_tokens_details.cached_tokens); a prompt cached whole still computes its last block. This replica's requests only."

// Snapshot reports every model's rates at now.
func (t *Tracker) Snapshot(now time.Time) Report {
	rep := Report{Note: Note, Models: []ModelReport{}}
	for _, w := range t.cfg.Windows {
		rep.Windows = append(rep.Windows, w.Name)
	}
	b := now.UnixNano() / int64(t.cfg.Bucket)

	byModel := map[string]*ModelReport{}
	get := func(name string) *ModelReport {
		if m, ok := byModel[name]; ok {
			return m
		}
		m := &ModelReport{Model: name, HistoryBound: t.cfg.MaxBlocks, Workers: []WorkerReport{}}
		byModel[name] = m
		return m
	}
	t.mu.Lock()
	models := make(map[string]*model, len(t.models))
	for k, v := range t.models {
		models[k] = v
	}
	t.mu.Unlock()
	for name, m := range models {
		mr := get(name)
		m.mu.Lock()
		mr.FleetBlocks, mr.HistoryBlocks, mr.HistoryBound = m.capBlks, m.cache.size(), m.cache.max
		m.mu.Unlock()
	}

	t.smu.Lock()
	for k, r := range t.series {
		if r.newest <= b-t.span {
			continue
		}
		mr := get(k.model)
		rates := make([]Rates, len(t.cfg.Windows))
		for i, w := range t.cfg.Windows {
			n := int64((w.Span + t.cfg.Bucket - 1) / t.cfg.Bucket)
			rates[i] = ratesOf(w.Name, r.window(b, n), k.worker == "")
		}
		if k.worker == "" {
			mr.Windows = rates
		} else {
			mr.Workers = append(mr.Workers, WorkerReport{Worker: k.worker, Windows: rates})
		}
	}
	t.smu.Unlock()

	for _, mr := range byModel {
		if mr.Windows == nil { // no request served within the windows
			for _, w := range t.cfg.Windows {
				mr.Windows = append(mr.Windows, ratesOf(w.Name, sums{}, true))
			}
		}
		slices.SortFunc(mr.Workers, func(a, b WorkerReport) int { return cmp.Compare(a.Worker, b.Worker) })
		rep.Models = append(rep.Models, *mr)
	}
	slices.SortFunc(rep.Models, func(a, b ModelReport) int { return cmp.Compare(a.Model, b.Model) })
	return rep
}

// ratesOf turns a window's sums into rates; fleet says whether available
// and reachable belong (the model's aggregate) or not (a worker).
func ratesOf(window string, s sums, fleet bool) Rates {
	frac := func(n, d int64) *float64 {
		if d <= 0 {
			return nil
		}
		v := float64(n) / float64(d)
		return &v
	}
	r := Rates{Window: window, Requests: s.Requests, PromptTokens: s.PromptTokens,
		Captured: frac(s.Captured, s.PromptTokens), Delivered: frac(s.EngineCached, s.ReportedPrmpt),
		DeliveredRequests: s.Reported}
	if fleet {
		r.Available, r.Reachable = frac(s.Available, s.PromptTokens), frac(s.Reachable, s.PromptTokens)
	}
	r.Gaps = Gaps(r)
	return r
}
