package replica

import (
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/router"
)

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
	dc, err := r.cfg.Disagg.RouterConfig()
	if err != nil {
		r.log.Error("disaggregated router", "model", model, "err", err)
		return nil, false
	}
	d, err = router.NewDisaggRouter(base, r.overlaps(), dc, uint64(time.Now().UnixNano()))
	if err != nil {
		r.log.Error("disaggregated router", "model", model, "err", err)
		return nil, false
	}
	d.SetWorkers(r.undrained(r.roleWorkers(model)))
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
