package sim

import (
	"math/rand/v2"
	"time"

	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/internal/warmup"
	"github.com/kvrouter/kvrouter/router"
)

// The warm-up of an added worker (Config.WarmUp, issue 29 item 3): the
// rule of internal/warmup, the one the live router's
// --router-warmup-share applies, steers a share of new and duplicated
// prefixes to the worker an add event brought in, while the fleet has
// headroom, until its own hit rate over the last warmWindow reaches the
// fleet's before it joined. One worker warms at a time: a later add
// event hands the warm-up to its worker.

// warmWindow is how far back the joiner's own hit rate is read to decide
// it is warm, and warmMinRequests how many of its requests that needs.
const (
	warmWindow      = time.Minute
	warmMinRequests = 5
)

// warmState is the warm-up's progress.
type warmState struct {
	worker   int     // the warming worker; -1: none
	rec      int     // its add event's index in fleetState.records
	baseline float64 // the fleet's cached ratio in the PlanWindow before it joined
	rng      *rand.Rand
	// held is what each worker's engine holds, fed with the engines'
	// KV events at once (no delivery delay, whatever the policy reads;
	// nil without an add event): RequestResult.HeldTokens, the fleet's
	// best prefix for a request when it was routed, for the warm-up
	// judged like with like (warmLike, dip.go's warm_comparable_s).
	held    *router.Index
	overlap []router.Overlap // scratch of noteHeld
}

// initHeld starts the held index (with an add event only).
func (w *warmState) initHeld(s *state) {
	if s.cfg.added() == 0 {
		return
	}
	w.held = router.NewIndex(s.w.BlockSize)
	for i := range s.cfg.Workers {
		w.held.AddWorker(s.ids[i])
	}
}

// applyHeld feeds worker wi's KV events to the held index.
func (w *warmState) applyHeld(s *state, wi int, evs []engine.Event) {
	if w.held == nil {
		return
	}
	for _, ev := range evs {
		_ = w.held.Apply(s.ids[wi], ev.KV) // the same events the router's index takes
	}
}

// joined and left keep the held index's workers.
func (w *warmState) joined(s *state, wi int) {
	if w.held != nil {
		w.held.AddWorker(s.ids[wi])
	}
}

func (w *warmState) left(s *state, wi int) {
	if w.held != nil {
		w.held.RemoveWorker(s.ids[wi])
	}
}

// noteHeld records in request i's result the prompt tokens of the longest
// prefix of it some present worker holds now, as it is routed.
func (w *warmState) noteHeld(s *state, i int) {
	if w.held == nil {
		return
	}
	r := &s.w.Requests[i]
	w.overlap = w.held.FindMatches(r.Hashes, w.overlap[:0])
	best := 0
	for _, o := range w.overlap {
		if wi, ok := s.byWorker[o.Worker]; ok && !s.fleet.gone[wi] {
			best = max(best, o.Blocks)
		}
	}
	s.res[i].HeldTokens = min(best*s.w.BlockSize, r.PromptTokens)
}

// start hands the warm-up to worker wi, added by the event recorded at
// rec (nothing without Config.WarmUp).
func (w *warmState) start(s *state, wi, rec int) {
	if (s.cfg.WarmUp == nil && !s.cfg.ShadowWarmUp) || wi < 0 {
		return
	}
	if w.rng == nil {
		w.rng = rand.New(rand.NewPCG(s.cfg.Seed, 0x3a4e0f))
	}
	w.worker, w.rec = wi, rec
	var cached, prompt int64
	for i, rr := range s.res {
		if rr.Worker >= 0 && rr.FirstToken > 0 && rr.Sent >= s.now-PlanWindow && rr.Sent < s.now {
			cached += int64(rr.CachedTokens)
			prompt += int64(s.w.Requests[i].PromptTokens)
		}
	}
	w.baseline = 0
	if prompt > 0 {
		w.baseline = float64(cached) / float64(prompt)
	}
}

// steer applies the warm-up to the decision d router k made for req:
// the decision itself, or one routed to the warming worker only.
func (w *warmState) steer(s *state, k, i int, req router.Request, d router.Decision) (router.Decision, error) {
	if (s.cfg.WarmUp == nil && !s.cfg.ShadowWarmUp) || w.worker < 0 {
		return d, nil
	}
	if !s.fleet.routable(w.worker) {
		w.worker = -1 // removed while warming
		return d, nil
	}
	if s.cfg.ShadowWarmUp && w.filled(s) && w.warmLike(s) || !s.cfg.ShadowWarmUp && w.warm(s) {
		s.fleet.records[w.rec].WarmUpEnd = s.now
		w.worker = -1
		return d, nil
	}
	if s.cfg.ShadowWarmUp {
		return w.shadowWarm(s, k, i, req, d), nil
	}
	rt := s.rts[k]
	util := warmup.Utilization(rt.Config().Thresholds, rt.Workers(), rt.Load().Load)
	id := s.ids[w.worker]
	if !warmup.Steer(d.Rows, d.Worker, id, util, w.rng.Float64(), *s.cfg.WarmUp) {
		return d, nil
	}
	rt.Free(req.ID)
	if d2, err := routeTo(s, k, id, req); err == nil {
		s.fleet.records[w.rec].Steered++
		return d2, nil
	}
	return rt.Route(req, epoch.Add(s.now)) // the joiner refused it after all: as decided first
}

// warm: the warming worker's requests whose first token came within the
// last warmWindow were served from its cache at least as well as the
// fleet's were before it joined.
func (w *warmState) warm(s *state) bool {
	var cached, prompt int64
	n := 0
	for i, rr := range s.res {
		if rr.Worker == w.worker && rr.FirstToken > 0 && rr.FirstToken >= s.now-warmWindow {
			cached += int64(rr.CachedTokens)
			prompt += int64(s.w.Requests[i].PromptTokens)
			n++
		}
	}
	return n >= warmMinRequests && prompt > 0 && float64(cached)/float64(prompt) >= w.baseline
}

// copyRoom (shadow warm-up): the copies sent so far carried less than the
// warming worker's capacity in blocks (more would evict what they copied).
func (w *warmState) copyRoom(s *state) bool {
	return s.fleet.records[w.rec].ShadowPromptTokens/int64(s.w.BlockSize) < int64(s.capacity(w.worker))
}

// filled (shadow warm-up): the warming worker holds as many blocks as the
// other workers hold on average (by the index), or the copies sent carried
// its capacity's worth.
func (w *warmState) filled(s *state) bool {
	held, _ := s.index.CacheCounts(s.ids[w.worker])
	var others, n int
	for wi, id := range s.ids {
		if wi != w.worker && s.fleet.routable(wi) {
			h, _ := s.index.CacheCounts(id)
			others += h
			n++
		}
	}
	return (n > 0 && held*n >= others) || !w.copyRoom(s)
}

// warmLike (shadow warm-up): like warm, judged like with like (as dip.go's
// warm_comparable_s): over the requests whose first token came within the
// last warmWindow, the warming worker's cached share of the tokens some
// worker held when they were routed reached the other workers'. A worker
// given new conversations on purpose is warm when their later turns hit
// there as they do elsewhere, though their first turns never can. Why not
// warm (its ratio over every token against the fleet's before it joined):
// new content keeps the fleet's ratio low (0.46 on the seed-002 shape
// against 0.74 like with like), so three copy hits in five requests ended
// the warm-up 2.1–5.3 s after the event, and the misses kv then sent the
// idle worker (their holders busier) kept it under the others' share for
// 20–30 s in 3 seeds of 10 (kvbench sim, BENCHMARKS.md).
func (w *warmState) warmLike(s *state) bool {
	if w.held == nil {
		return false
	}
	var mine, others [2]int64 // cached, held
	n := 0
	for _, rr := range s.res {
		if rr.Worker < 0 || rr.FirstToken == 0 || rr.FirstToken < s.now-warmWindow {
			continue
		}
		c, h := int64(min(rr.CachedTokens, rr.HeldTokens)), int64(rr.HeldTokens)
		if h == 0 {
			continue // nothing to hit: new content tells nothing
		}
		if rr.Worker == w.worker {
			mine[0], mine[1] = mine[0]+c, mine[1]+h
			n++
		} else {
			others[0], others[1] = others[0]+c, others[1]+h
		}
	}
	return n >= warmMinRequests && mine[1] > 0 && others[1] > 0 &&
		float64(mine[0])/float64(mine[1]) >= float64(others[0])/float64(others[1])
}
