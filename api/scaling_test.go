package api

import (
	"math"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/router"
)

func approx(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

// TestAPIScaleAdvice: utilization against each threshold (and KV
// occupancy without any), busy workers, the desired count at 0.8, and
// what one worker more or less would serve.
func TestAPIScaleAdvice(t *testing.T) {
	w := func(id string) router.WorkerInfo {
		return router.WorkerInfo{ID: router.WorkerID(id), TotalBlocks: 1000, MaxBatchedTokens: 2000}
	}
	ld := func(blocks, prefill int) router.WorkerLoad {
		return router.WorkerLoad{ActiveBlocks: blocks, ActivePrefillTokens: prefill}
	}
	f := func(v float64) *float64 { return &v }
	i := func(v int64) *int64 { return &v }
	for _, tc := range []struct {
		name             string
		th               router.Thresholds
		ws               []router.WorkerInfo
		loads            []router.WorkerLoad
		util             float64
		busy, desired    int
		upGain, downLoss float64
	}{
		{"no workers", router.Thresholds{}, nil, nil, 0, 0, 0, 0, 0},
		{"idle, occupancy", router.Thresholds{}, []router.WorkerInfo{w("a"), w("b")}, []router.WorkerLoad{ld(0, 0), ld(0, 0)}, 0, 0, 1, 0, 0},
		// Occupancy 0.4 and 0.8: 1.2 workers' worth at 0.8 → 2; one fewer serves 1/1.2.
		{"occupancy", router.Thresholds{}, []router.WorkerInfo{w("a"), w("b")}, []router.WorkerLoad{ld(400, 0), ld(800, 0)}, 0.6, 0, 2, 0, 1 - 1/1.2},
		// Decode threshold 0.5: 600/500 = 1.2 and 200/500 = 0.4; a prefill threshold of 100 tokens: 50/100.
		{"largest ratio", router.Thresholds{ActiveDecodeBlocks: f(0.5), ActivePrefillTokens: i(100)},
			[]router.WorkerInfo{w("a"), w("b")}, []router.WorkerLoad{ld(600, 0), ld(200, 50)}, 0.85, 1, 3, 0, 1 - 1/1.7},
		// Prefill fraction 0.5 of 2000: 3000/1000 = 3 on both: demand 6 workers' worth for 2.
		{"overloaded", router.Thresholds{ActivePrefillTokensFrac: f(0.5)},
			[]router.WorkerInfo{w("a"), w("b")}, []router.WorkerLoad{ld(0, 3000), ld(0, 3000)}, 3, 2, 8, 3.0/6 - 2.0/6, 2.0/6 - 1.0/6},
		{"zero threshold", router.Thresholds{ActivePrefillTokens: i(0)}, []router.WorkerInfo{w("a")}, []router.WorkerLoad{ld(0, 0)}, 1, 1, 2, 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := adviseModel("m", tc.th, tc.ws, tc.loads, nil)
			if !approx(a.Utilization, tc.util) || a.BusyWorkers != tc.busy || a.DesiredWorkers != tc.desired ||
				!approx(a.ScaleUpGoodputGain, tc.upGain) || !approx(a.ScaleDownGoodputLoss, tc.downLoss) || a.Workers != len(tc.ws) {
				t.Fatalf("%+v, want util %v busy %d desired %d gain %v loss %v", a, tc.util, tc.busy, tc.desired, tc.upGain, tc.downLoss)
			}
		})
	}
	loss := 0.25
	plan := []PlanWorker{{Worker: "x", Model: "other"}, {Worker: "d", Model: "m", Drained: true}, {Worker: "c", Model: "m", HitRateLoss: &loss}}
	if a := adviseModel("m", router.Thresholds{}, nil, nil, plan); a.ScaleDownHitRateLoss == nil || *a.ScaleDownHitRateLoss != 0.25 {
		t.Fatalf("cheapest undrained worker's hit-rate loss: %+v", a.ScaleDownHitRateLoss)
	}
}

// TestAPIScaleAdviceMetrics: the advice reaches /fleet/plan and the
// kvrouter_fleet_* gauges from the routers' candidates and load.
func TestAPIScaleAdviceMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	s, rep := newFleetServer(t, Config{Registry: reg})
	rep.addWorker("m", "w1", "http://127.0.0.1:9001")
	rep.addWorker("m", "w2", "http://127.0.0.1:9002")
	rt, _ := rep.Router("m")
	rt.Load().Add(router.Booking{ID: "r1", Worker: "w1", Hashes: make([]uint64, 500), Sequences: 1, Added: time.Now()})
	plan, ok := s.fleetPlan(time.Now())
	if !ok || len(plan.Scaling) != 1 || plan.Scaling[0].Workers != 2 || plan.Scaling[0].Utilization <= 0 {
		t.Fatalf("scaling %+v", plan.Scaling)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) == 1 && m.GetLabel()[0].GetName() == "model" {
				got[mf.GetName()] = m.GetGauge().GetValue()
			}
		}
	}
	if got["kvrouter_fleet_workers"] != 2 || !approx(got["kvrouter_fleet_utilization"], plan.Scaling[0].Utilization) ||
		got["kvrouter_fleet_desired_workers"] != float64(plan.Scaling[0].DesiredWorkers) {
		t.Fatalf("metrics %v, advice %+v", got, plan.Scaling[0])
	}
	if _, ok := got["kvrouter_fleet_scale_down_hit_rate_loss"]; ok {
		t.Fatal("a hit-rate loss without traffic")
	}
}
