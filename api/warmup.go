package api

import (
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api/hitrate"
	"github.com/kvrouter/kvrouter/internal/warmup"
	"github.com/kvrouter/kvrouter/router"
)

// Warming up a joining worker (issue 29 item 3; DESIGN.md, "Warm-up"):
// with Config.WarmUpShare > 0 a worker that joins a model's candidate set
// after this server first saw the set is sent, on purpose, that share of
// the requests whose prefix is new or duplicated (internal/warmup.Steer)
// while the fleet is under 0.8 of its busy thresholds, until its captured
// hit rate over the last minute reaches its model's, or warmUpMax passed.
// Each replica decides alone (a routing hint, nothing replicated).

// warmUpMax bounds a worker's warm-up: one whose traffic never reaches
// the fleet's hit rate (a cold model, a tiny cache) stops being steered.
const warmUpMax = 10 * time.Minute

// warmCheckEvery is how often a warming worker's hit rate is compared
// with its model's (a hit-rate snapshot walks every series).
const warmCheckEvery = time.Second

// warmUps is the server's warm-up state. mu guards everything below it.
type warmUps struct {
	policy warmup.Policy

	mu      sync.Mutex
	rng     *rand.Rand
	models  map[string]bool                // models whose first candidate set was seen (its workers start warm)
	joined  map[router.WorkerID]time.Time  // warming workers: when first seen
	checked time.Time                      // last hit-rate comparison
	warmed  map[router.WorkerID]bool       // done warming (or there at the start)
	modelOf map[router.WorkerID]string     // the model whose candidate set a worker was last seen in
	steered *prometheus.CounterVec         // kvrouter_warmup_steered_total{worker}
	warmFor *prometheus.GaugeVec           // kvrouter_worker_warm_seconds{worker}
	warming *prometheus.GaugeVec           // kvrouter_worker_warming{worker}
	clock   func() time.Time               // time.Now; tests replace it
	hitRate func(now time.Time) hitFigures // the tracker's figures; nil: never warm by hit rate
}

// hitFigures are, from the hit-rate tracker's shortest window, each
// model's captured rate and each worker's.
type hitFigures struct {
	model  map[string]float64
	worker map[string]float64
}

func newWarmUps(cfg Config, s *Server) *warmUps {
	if cfg.WarmUpShare <= 0 && !cfg.WarmUpShadow {
		return nil
	}
	w := &warmUps{
		policy: warmup.Policy{Share: min(cfg.WarmUpShare, 1), Headroom: warmup.DefaultHeadroom},
		rng:    rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 0x3a4e0f)),
		models: map[string]bool{}, joined: map[router.WorkerID]time.Time{}, warmed: map[router.WorkerID]bool{},
		modelOf: map[router.WorkerID]string{},
		steered: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_warmup_steered_total",
			Help: "Requests this replica sent to a joining worker on purpose to warm its cache (--router-warmup-share)."}, []string{"worker"}),
		warmFor: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrouter_worker_warm_seconds",
			Help: "How long a joining worker took to reach its model's captured hit rate (or the warm-up's 10 min limit), from when this replica first saw it."}, []string{"worker"}),
		warming: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrouter_worker_warming",
			Help: "1 while a joining worker is being warmed up by this replica."}, []string{"worker"}),
		clock: time.Now,
	}
	if s.hits != nil {
		w.hitRate = func(now time.Time) hitFigures { return hitFiguresOf(s.hits.Snapshot(now)) }
	}
	cfg.Registry.MustRegister(w.steered, w.warmFor, w.warming)
	return w
}

// hitFiguresOf reads the captured rates of the report's shortest window.
func hitFiguresOf(rep hitrate.Report) hitFigures {
	f := hitFigures{model: map[string]float64{}, worker: map[string]float64{}}
	if len(rep.Windows) == 0 {
		return f
	}
	win := rep.Windows[0]
	for _, m := range rep.Models {
		for _, r := range m.Windows {
			if r.Window == win && r.Captured != nil {
				f.model[m.Model] = *r.Captured
			}
		}
		for _, wr := range m.Workers {
			for _, r := range wr.Windows {
				if r.Window == win && r.Captured != nil {
					f.worker[wr.Worker] = *r.Captured
				}
			}
		}
	}
	return f
}

// target is the model's warming worker now, if any (the one that joined
// first). It notes workers joining the candidate set and ends warm-ups.
func (w *warmUps) target(model string, ws []router.WorkerInfo, now time.Time) (router.WorkerID, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	first := !w.models[model]
	w.models[model] = true
	// A worker that left the candidate set forgets its state: one coming
	// back (registered again) starts with an empty index entry and warms
	// again. Workers of other models are not in ws: keep theirs.
	present := make(map[router.WorkerID]bool, len(ws))
	for _, x := range ws {
		present[x.ID] = true
	}
	for id := range w.joined {
		if !present[id] && w.modelOf[id] == model {
			delete(w.joined, id)
			w.warming.DeleteLabelValues(string(id))
		}
	}
	for id := range w.warmed {
		if !present[id] && w.modelOf[id] == model {
			delete(w.warmed, id)
		}
	}
	for _, x := range ws {
		w.modelOf[x.ID] = model
	}
	for _, x := range ws {
		if w.warmed[x.ID] {
			continue
		}
		if _, ok := w.joined[x.ID]; !ok {
			if first {
				w.warmed[x.ID] = true // there before us: not joining
				continue
			}
			w.joined[x.ID] = now
			w.warming.WithLabelValues(string(x.ID)).Set(1)
		}
	}
	var figs *hitFigures
	if w.hitRate != nil && now.Sub(w.checked) >= warmCheckEvery && len(w.joined) > 0 {
		w.checked = now
		f := w.hitRate(now)
		figs = &f
	}
	var best router.WorkerID
	var bestAt time.Time
	for _, x := range ws {
		at, ok := w.joined[x.ID]
		if !ok {
			continue
		}
		done := now.Sub(at) >= warmUpMax
		if figs != nil {
			if r, ok := figs.worker[string(x.ID)]; ok && r >= figs.model[model] && figs.model[model] > 0 {
				done = true
			}
		}
		if done {
			w.finishLocked(x.ID, now.Sub(at))
			continue
		}
		if best == "" || at.Before(bestAt) {
			best, bestAt = x.ID, at
		}
	}
	return best, best != ""
}

// finishLocked ends id's warm-up after d. w.mu must be held.
func (w *warmUps) finishLocked(id router.WorkerID, d time.Duration) {
	delete(w.joined, id)
	w.warmed[id] = true
	w.warming.WithLabelValues(string(id)).Set(0)
	w.warmFor.WithLabelValues(string(id)).Set(d.Seconds())
}

// draw is a uniform number in [0,1).
func (w *warmUps) draw() float64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.rng.Float64()
}

// warmUp applies the warm-up to the decision d Route just booked for p:
// when the rule says so, the booking is freed and the request routed
// again with every worker but the warming one excluded (as decided first
// if that fails). The decision to use is returned.
func (s *Server) warmUp(p *prepared, d router.Decision, now time.Time) (router.Decision, error) {
	w := s.warm
	if w == nil {
		return d, nil
	}
	ws := p.rt.Workers()
	target, ok := w.target(p.model, ws, w.clock())
	if !ok || d.Worker == target || slices.Contains(p.req.Exclude, target) {
		return d, nil
	}
	util := warmup.Utilization(p.rt.Config().Thresholds, ws, p.rt.Load().Load)
	if !warmup.Steer(d.Rows, d.Worker, target, util, w.draw(), w.policy) {
		return d, nil
	}
	p.rt.Free(p.req.ID)
	steered := p.req
	steered.Exclude = make([]router.WorkerID, 0, len(ws))
	for _, x := range ws {
		if x.ID != target {
			steered.Exclude = append(steered.Exclude, x.ID)
		}
	}
	if d2, err := p.rt.Route(steered, now); err == nil {
		w.steered.WithLabelValues(string(target)).Inc()
		return d2, nil
	}
	return p.rt.Route(p.req, now)
}
