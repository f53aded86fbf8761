package main

import (
	"fmt"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/router"
)

// disaggConfig is how `kvrouter serve` routes disaggregated prefill/decode
// (--disagg and its knobs). The planner needs three things the router does
// not observe: the model's KV bytes per token, the transfer link, and the
// workers' step times (an engine profile, as the simulator uses).
type disaggConfig struct {
	Mode        router.DisaggMode
	KV          router.ModelKV
	LinkMBps    float64 // MB/s (1e6 bytes) shared by concurrent transfers
	LinkPerPair bool    // each prefill/decode pair has its own link of that speed
	LinkMax     int     // transfers at once on the link (0 = no limit)
	LinkLatency time.Duration
	Profile     string  // engine profile of the workers' step times
	Speedup     float64 // divides the profile's step times (kvmock --speedup)
	Retries     int     // failed transfers restarted before serving aggregated
}

func disaggFlags(c *disaggConfig) []flagSpec {
	return []flagSpec{
		{names: []string{"disagg"}, env: []string{"KVROUTER_DISAGG"}, def: "off", usage: "disaggregated prefill/decode: off (aggregated on decode-capable workers), always (while a prefill worker is healthy), auto (per request, the lower estimated TTFT)", set: func(v string) error {
			m, err := router.ParseDisaggMode(v)
			c.Mode = m
			return err
		}},
		{names: []string{"disagg-kv-bytes-per-token"}, env: []string{"KVROUTER_DISAGG_KV_BYTES_PER_TOKEN"}, usage: "KV cache bytes per token as measured or known (overrides the model shape)", set: func(v string) error {
			var n int64
			if _, err := fmt.Sscan(v, &n); err != nil || n < 0 {
				return fmt.Errorf("bytes per token %q: want a non-negative integer", v)
			}
			c.KV.Given = n
			return nil
		}},
		{names: []string{"disagg-model-shape"}, env: []string{"KVROUTER_DISAGG_MODEL_SHAPE"}, def: "28,8,128,2", usage: "layers,kv-heads,head-dim,dtype-bytes of the model (KV bytes per token = product × 2); default Qwen3-0.6B = 114,688 B", set: func(v string) error {
			var l, h, d, b int
			if n, err := fmt.Sscanf(strings.ReplaceAll(v, " ", ""), "%d,%d,%d,%d", &l, &h, &d, &b); err != nil || n != 4 {
				return fmt.Errorf("model shape %q: want layers,kv-heads,head-dim,dtype-bytes", v)
			}
			c.KV.Layers, c.KV.KVHeads, c.KV.HeadDim, c.KV.DTypeBytes = l, h, d, b
			return nil
		}},
		{names: []string{"disagg-link-mbps"}, env: []string{"KVROUTER_DISAGG_LINK_MBPS"}, def: "104", usage: "prefill→decode KV transfer throughput in MB/s, shared fairly by concurrent transfers (seed 001: 104 on 1 GbE)", set: floatp(&c.LinkMBps)},
		{names: []string{"disagg-link-per-pair"}, env: []string{"KVROUTER_DISAGG_LINK_PER_PAIR"}, usage: "every prefill/decode pair has its own link of that speed (default: one shared link)", set: boolp(&c.LinkPerPair), bool: true},
		{names: []string{"disagg-link-max-transfers"}, env: []string{"KVROUTER_DISAGG_LINK_MAX_TRANSFERS"}, def: "0", usage: "transfers moving at once on a link (0 = no limit; later ones queue)", set: intp(&c.LinkMax)},
		{names: []string{"disagg-link-latency"}, env: []string{"KVROUTER_DISAGG_LINK_LATENCY"}, def: "0s", usage: "fixed cost per transfer before bytes flow", set: dur(&c.LinkLatency)},
		{names: []string{"disagg-profile"}, env: []string{"KVROUTER_DISAGG_PROFILE"}, def: engine.ProfileDynamoMocker, usage: "engine step-time profile the TTFT estimates use: " + strings.Join(engine.Profiles(), ", "), set: str(&c.Profile)},
		{names: []string{"disagg-speedup"}, env: []string{"KVROUTER_DISAGG_SPEEDUP"}, def: "1", usage: "divides the profile's step times (match the workers' kvmock --speedup)", set: floatp(&c.Speedup)},
		{names: []string{"disagg-transfer-retries"}, env: []string{"KVROUTER_DISAGG_TRANSFER_RETRIES"}, def: "1", usage: "failed KV transfers restarted before the request is served aggregated on its decode worker", set: intp(&c.Retries)},
	}
}

// routerConfig turns the flags into the router's configuration; errors
// name the flag.
func (c disaggConfig) routerConfig() (router.DisaggConfig, error) {
	prof, err := engine.LookupProfile(c.Profile)
	if err != nil {
		return router.DisaggConfig{}, fmt.Errorf("--disagg-profile: %w", err)
	}
	if c.Speedup <= 0 {
		return router.DisaggConfig{}, fmt.Errorf("--disagg-speedup %v must be positive", c.Speedup)
	}
	sp := c.Speedup
	link := router.Link{ThroughputBytesPerS: c.LinkMBps * 1e6 * sp, MaxConcurrent: c.LinkMax, Latency: time.Duration(float64(c.LinkLatency) / sp), PerPair: c.LinkPerPair}
	dc := router.DisaggConfig{
		Mode: c.Mode, KV: c.KV, TransferRetries: c.Retries,
		Timing: router.StepTiming{
			PrefillMs: func(n int) float64 { return prof.PrefillMs(n) / sp },
			DecodeMs:  func(f float64) float64 { return prof.DecodeMs(f) / sp },
			StepMs:    func(p, d int, f float64) float64 { return prof.StepMs(p, d, f) / sp },
		},
		Topology: router.SingleLink("link", link),
	}
	if err := dc.Validate(); err != nil {
		return router.DisaggConfig{}, fmt.Errorf("--disagg settings: %w", err)
	}
	return dc, nil
}

// Disagg returns the model's two-stage router when --disagg is not off
// (api.DisaggReplica), creating it on first use.
func (r *replica) Disagg(model string) (*router.DisaggRouter, bool) {
	if r.cfg.Disagg.Mode == "" || r.cfg.Disagg.Mode == router.DisaggOff {
		return nil, false
	}
	r.mu.RLock()
	d, ok := r.disagg[model]
	r.mu.RUnlock()
	if ok {
		return d, true
	}
	if !r.knownModel(model) {
		return nil, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if d, ok := r.disagg[model]; ok {
		return d, true
	}
	base := r.modelConfig(model)
	dc, err := r.cfg.Disagg.routerConfig()
	if err != nil {
		r.log.Error("disaggregated router", "model", model, "err", err)
		return nil, false
	}
	d, err = router.NewDisaggRouter(base, r.fsm.Overlaps(), dc, uint64(time.Now().UnixNano()))
	if err != nil {
		r.log.Error("disaggregated router", "model", model, "err", err)
		return nil, false
	}
	d.SetWorkers(r.fsm.RoleWorkers(model))
	r.disagg[model] = d
	return d, true
}

// decodeCapable drops prefill-only workers: an aggregated request must
// decode where it lands.
func decodeCapable(ws []router.RoleWorker) []router.WorkerInfo {
	out := make([]router.WorkerInfo, 0, len(ws))
	for _, w := range ws {
		if w.Role.Decodes() {
			out = append(out, w.WorkerInfo)
		}
	}
	return out
}

// stageLoad is the load tracker a replica-sync booking id belongs to: a
// disaggregated request's "|p" booking on the model's prefill router, its
// "|d" booking on the decode router, anything else on the model's router.
func (r *replica) stageLoad(model, request string, rt *router.Router) *router.ActiveLoad {
	if d, ok := r.Disagg(model); ok {
		pr, dc := d.Routers()
		switch {
		case strings.HasSuffix(request, api.PrefillBookingSuffix):
			return pr.Load()
		case strings.HasSuffix(request, api.DecodeBookingSuffix):
			return dc.Load()
		}
	}
	return rt.Load()
}
