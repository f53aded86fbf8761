package api

import (
	"math"
	"slices"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/warmup"
	"github.com/kvrouter/kvrouter/router"
)

// Scale-up and scale-down advice for autoscalers (issue 29 item 4;
// DESIGN.md, "Scaling advice"): per model, the fleet's load against its
// busy thresholds and what one worker more or less would change, as
// metrics KEDA's Prometheus scaler or an HPA on external metrics reads.

// scaleTarget is the utilization desired_workers aims at: 1 is every
// worker at its busy threshold (new requests then wait or are refused), so
// the advice keeps a fifth of headroom for bursts and for the time a new
// worker takes to start and warm.
const scaleTarget = 0.8

// ScaleAdvice is one model's advice.
type ScaleAdvice struct {
	Model string `json:"model"`
	// Workers are the routable workers (drained ones excluded); BusyWorkers
	// those at or over a busy threshold now.
	Workers     int `json:"workers"`
	BusyWorkers int `json:"busy_workers"`
	// Utilization is the mean over the routable workers of each one's
	// load over its busy threshold (the largest ratio among the
	// thresholds set; without any, its active KV blocks over its
	// capacity): 1 = every worker at its threshold.
	Utilization float64 `json:"utilization"`
	// DesiredWorkers is ceil(Workers × Utilization / 0.8), at least 1
	// while there are workers.
	DesiredWorkers int `json:"desired_workers"`
	// ScaleUpGoodputGain and ScaleDownGoodputLoss are the fractions of
	// the current demand one worker more would serve in addition, and one
	// worker fewer would no longer serve, with the demand spread evenly
	// and each worker serving up to its threshold.
	ScaleUpGoodputGain   float64 `json:"scale_up_goodput_gain"`
	ScaleDownGoodputLoss float64 `json:"scale_down_goodput_loss"`
	// ScaleDownHitRateLoss is the hit rate the fleet would lose with its
	// cheapest worker (the fleet plan's first of the model); null without
	// traffic in the window.
	ScaleDownHitRateLoss *float64 `json:"scale_down_hit_rate_loss"`
}

// served is the fraction of a demand of n×u workers' worth that m
// workers serve, each up to its threshold.
func served(m, n int, u float64) float64 {
	demand := float64(n) * u
	if demand <= 0 {
		return 1
	}
	return min(1, float64(m)/demand)
}

// adviseModel is one model's advice from its routable workers and their
// loads; plan supplies the cheapest worker's hit-rate loss.
func adviseModel(model string, t router.Thresholds, ws []router.WorkerInfo, loads []router.WorkerLoad, plan []PlanWorker) ScaleAdvice {
	a := ScaleAdvice{Model: model, Workers: len(ws)}
	var sum float64
	for i, w := range ws {
		u := warmup.WorkerUtilization(t, w, loads[i])
		if math.IsInf(u, 1) {
			u = 1e6 // a zero threshold with load: far past any target, still a number for Prometheus
		}
		if u >= 1 {
			a.BusyWorkers++
		}
		sum += u
	}
	n := len(ws)
	if n > 0 {
		a.Utilization = sum / float64(n)
		a.DesiredWorkers = max(1, int(math.Ceil(sum/scaleTarget-1e-9)))
		now := served(n, n, a.Utilization)
		a.ScaleUpGoodputGain = served(n+1, n, a.Utilization) - now
		a.ScaleDownGoodputLoss = now - served(n-1, n, a.Utilization)
	}
	for _, p := range plan {
		if p.Model == model && !p.Drained {
			a.ScaleDownHitRateLoss = p.HitRateLoss
			break
		}
	}
	return a
}

// scaleAdvice is every served model's advice, from its router's candidate
// set (undrained workers) and load (every replica's bookings, replica
// sync), sorted by model.
func (s *Server) scaleAdvice(plan []PlanWorker) []ScaleAdvice {
	out := []ScaleAdvice{}
	for _, m := range s.rep.Models() {
		rt, ok := s.rep.Router(m)
		if !ok {
			continue
		}
		ws := rt.Workers()
		loads := make([]router.WorkerLoad, len(ws))
		for i, w := range ws {
			loads[i] = rt.Load().Load(w.ID)
		}
		out = append(out, adviseModel(m, rt.Config().Thresholds, ws, loads, plan))
	}
	slices.SortFunc(out, func(a, b ScaleAdvice) int {
		switch {
		case a.Model < b.Model:
			return -1
		case a.Model > b.Model:
			return 1
		}
		return 0
	})
	return out
}

var (
	descFleetWorkers = prometheus.NewDesc("kvrouter_fleet_workers",
		"Routable workers of the model (drained ones excluded).", []string{"model"}, nil)
	descFleetBusy = prometheus.NewDesc("kvrouter_fleet_busy_workers",
		"Workers of the model at or over a busy threshold now.", []string{"model"}, nil)
	descFleetUtil = prometheus.NewDesc("kvrouter_fleet_utilization",
		"Mean load of the model's workers over their busy thresholds (without thresholds: active KV blocks over capacity); 1 = every worker at its threshold.",
		[]string{"model"}, nil)
	descFleetDesired = prometheus.NewDesc("kvrouter_fleet_desired_workers",
		"Workers the model needs to run at 0.8 utilization: ceil(workers × utilization / 0.8), at least 1 (for KEDA / HPA: AverageValue target 1).",
		[]string{"model"}, nil)
	descFleetUpGain = prometheus.NewDesc("kvrouter_fleet_scale_up_goodput_gain",
		"Fraction of the model's current demand one more worker would serve in addition (0 while the fleet is under its thresholds).",
		[]string{"model"}, nil)
	descFleetDownLoss = prometheus.NewDesc("kvrouter_fleet_scale_down_goodput_loss",
		"Fraction of the model's current demand one worker fewer would no longer serve within the thresholds.",
		[]string{"model"}, nil)
	descFleetDownHits = prometheus.NewDesc("kvrouter_fleet_scale_down_hit_rate_loss",
		"Hit rate (fraction of prompt tokens) the fleet would lose with its cheapest worker (GET /fleet/plan); absent without traffic.",
		[]string{"model"}, nil)
)

// collectScaling sends every model's advice (fleetCollector.Collect).
func collectScaling(ch chan<- prometheus.Metric, advice []ScaleAdvice) {
	for _, a := range advice {
		g := func(d *prometheus.Desc, v float64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, a.Model)
		}
		g(descFleetWorkers, float64(a.Workers))
		g(descFleetBusy, float64(a.BusyWorkers))
		g(descFleetUtil, a.Utilization)
		g(descFleetDesired, float64(a.DesiredWorkers))
		g(descFleetUpGain, a.ScaleUpGoodputGain)
		g(descFleetDownLoss, a.ScaleDownGoodputLoss)
		if a.ScaleDownHitRateLoss != nil {
			g(descFleetDownHits, *a.ScaleDownHitRateLoss)
		}
	}
}

// scalingDescs are collectScaling's descriptors (fleetCollector.Describe).
var scalingDescs = []*prometheus.Desc{descFleetWorkers, descFleetBusy, descFleetUtil, descFleetDesired,
	descFleetUpGain, descFleetDownLoss, descFleetDownHits}
