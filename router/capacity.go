package router

import "fmt"

// Capacity-relative settings and the capacities they are relative to.
//
// Four settings measure a worker's load against a capacity it registered:
// the queue threshold and the prefill-fraction busy threshold against its
// max batched tokens, the decode-blocks busy threshold and kv-pooled's
// admission rule against its KV blocks. A worker that registered 0 (a
// static --workers entry without capacity, a bridge that could not read
// the engine's metrics) has no such capacity, and no number can stand in
// for it without being a guess: blocks depend on the GPU's memory and the
// model, the step budget on the engine's version and flags. So the rule
// (DESIGN.md, "Workers without capacity") is that the setting does not
// apply to that worker — it is never busy, and never over the queue
// threshold, by that criterion — and the gap is reported, never silent:
// CapacityGaps names each setting that lost its meaning for a worker, and
// the replica logs it once, shows it in /cluster/status and sets
// kvrouter_worker_capacity_missing.

// The capacity names, as workers register them (the registration JSON).
const (
	CapacityTotalBlocks      = "total_kv_blocks"
	CapacityMaxBatchedTokens = "max_num_batched_tokens"
)

// The capacity-relative settings, by their flag names.
const (
	SettingQueueThreshold      = "router-queue-threshold"
	SettingDecodeBlocksFrac    = "active-decode-blocks-threshold"
	SettingPrefillTokensFrac   = "active-prefill-tokens-threshold-frac"
	SettingPooledAdmission     = "router-mode=kv-pooled admission"
	fallbackNeverOverThreshold = "not applied to this worker: it never counts as over the threshold, and since requests queue only while every worker is over it, the queue does not form while this worker is registered"
	fallbackNeverBusy          = "not applied to this worker: it is never busy by this threshold"
	fallbackPooledNoAdmission  = "kv-pooled's KV admission rule and capacity-weighted homes are off for every decision this worker is a candidate in (equal weights, no admission)"
)

// CapacityGap is one capacity-relative setting that cannot apply to a
// worker because the worker registered no capacity for it.
type CapacityGap struct {
	Setting  string `json:"setting"`  // the flag (Setting*)
	Missing  string `json:"missing"`  // the capacity (Capacity*)
	Fallback string `json:"fallback"` // the rule applied instead
}

// String is the gap as one log line's message.
func (g CapacityGap) String() string {
	return fmt.Sprintf("--%s needs the worker's %s, which it did not register: %s", g.Setting, g.Missing, g.Fallback)
}

// MissingCapacity lists the capacities w did not register (0 = unknown),
// whatever the settings: a status field even before a setting needs them.
func MissingCapacity(w WorkerInfo) []string {
	var out []string
	if w.TotalBlocks <= 0 {
		out = append(out, CapacityTotalBlocks)
	}
	if w.MaxBatchedTokens <= 0 {
		out = append(out, CapacityMaxBatchedTokens)
	}
	return out
}

// CapacityGaps lists the settings of cfg that lose their meaning for w
// because w registered no capacity for them; empty when every setting in
// use has what it needs.
func CapacityGaps(cfg Config, w WorkerInfo) []CapacityGap {
	var out []CapacityGap
	noBatched, noBlocks := w.MaxBatchedTokens <= 0, w.TotalBlocks <= 0
	if cfg.QueueThreshold != nil && noBatched {
		out = append(out, CapacityGap{SettingQueueThreshold, CapacityMaxBatchedTokens, fallbackNeverOverThreshold})
	}
	if cfg.Thresholds.ActiveDecodeBlocks != nil && noBlocks {
		out = append(out, CapacityGap{SettingDecodeBlocksFrac, CapacityTotalBlocks, fallbackNeverBusy})
	}
	if cfg.Thresholds.ActivePrefillTokensFrac != nil && noBatched {
		out = append(out, CapacityGap{SettingPrefillTokensFrac, CapacityMaxBatchedTokens, fallbackNeverBusy})
	}
	if cfg.Mode == ModeKVPooled && noBlocks {
		out = append(out, CapacityGap{SettingPooledAdmission, CapacityTotalBlocks, fallbackPooledNoAdmission})
	}
	return out
}

// CapacityGaps is CapacityGaps for each of the router's workers that has
// any, under its current configuration.
func (r *Router) CapacityGaps() map[WorkerID][]CapacityGap {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[WorkerID][]CapacityGap{}
	for _, w := range r.workers {
		if gs := CapacityGaps(r.cfg, w); len(gs) > 0 {
			out[w.ID] = gs
		}
	}
	return out
}

// overQueueThreshold: w's active prefill exceeds q of its max batched
// tokens. A worker without that capacity is never over it (the rule above):
// the old max(capacity, 1) made --router-queue-threshold 0.5 mean "half a
// prefill token", so one waiting prompt anywhere queued everything.
func overQueueThreshold(q float64, w WorkerInfo, load WorkerLoad) bool {
	if w.MaxBatchedTokens <= 0 {
		return false
	}
	return float64(load.ActivePrefillTokens) > q*float64(w.MaxBatchedTokens)
}
