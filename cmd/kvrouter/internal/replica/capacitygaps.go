package replica

import (
	"log/slog"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/router"
)

// capacityGaps makes a worker without a capacity loud: each
// capacity-relative setting that does not apply to a registered worker
// because the worker gave no capacity for it (router/capacity.go) is
// warned about once per worker and setting, set as
// kvrouter_worker_capacity_missing=1 and listed in /cluster/status. It
// follows the replicated worker set and configuration, not the routers,
// which are created on first use: a gap is reported before any request.
type capacityGaps struct {
	log    *slog.Logger
	gauge  *prometheus.GaugeVec
	mu     sync.Mutex      // guards warned (the gauge locks on its own)
	warned map[gapKey]bool // gaps logged and set in the gauge, by worker and setting
}

type gapKey struct{ worker, setting, capacity string }

func newCapacityGaps(reg prometheus.Registerer, log *slog.Logger) *capacityGaps {
	g := &capacityGaps{log: log, warned: map[gapKey]bool{},
		gauge: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrouter_worker_capacity_missing",
			Help: "1 when a capacity-relative setting does not apply to a worker because the worker registered no capacity for it (router/DESIGN.md, Workers without capacity)."},
			[]string{"worker", "setting", "capacity"})}
	reg.MustRegister(g.gauge)
	return g
}

// workerGaps are w's gaps under its model's configuration cfg.
func workerGaps(cfg router.Config, w fsm.WorkerRecord) []router.CapacityGap {
	return router.CapacityGaps(cfg, workerInfo(w))
}

func workerInfo(w fsm.WorkerRecord) router.WorkerInfo {
	return router.WorkerInfo{ID: router.WorkerID(w.ID), TotalBlocks: w.TotalBlocks, MaxBatchedTokens: w.MaxBatchedTokens}
}

// check compares the gaps of workers (each under config(model)) with those
// already reported: a new gap is warned about and set, a closed one (the
// worker re-registered with its capacity, the setting was turned off, the
// worker left) is logged and cleared.
func (g *capacityGaps) check(workers []fsm.WorkerRecord, config func(model string) router.Config) {
	now := map[gapKey]router.CapacityGap{}
	for _, w := range workers {
		for _, gap := range workerGaps(config(w.Model), w) {
			now[gapKey{w.ID, gap.Setting, gap.Missing}] = gap
		}
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	for k, gap := range now {
		if g.warned[k] {
			continue
		}
		g.warned[k] = true
		g.gauge.WithLabelValues(k.worker, k.setting, k.capacity).Set(1)
		g.log.Warn("worker registered without the capacity a setting needs: "+gap.String(),
			"worker", k.worker, "setting", k.setting, "missing", k.capacity,
			"fix", "register the worker with it (kvmock and the bridge do; --workers id=URL;total_kv_blocks=N;max_num_batched_tokens=M)")
	}
	for k := range g.warned {
		if _, ok := now[k]; !ok {
			delete(g.warned, k)
			g.gauge.DeleteLabelValues(k.worker, k.setting, k.capacity)
			g.log.Info("capacity gap closed", "worker", k.worker, "setting", k.setting, "capacity", k.capacity)
		}
	}
}

// nonNil renders an empty list as [] in JSON, not null: a status reader
// tells "nothing missing" from "not reported".
func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}
