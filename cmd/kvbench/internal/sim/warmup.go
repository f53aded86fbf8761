package sim

import (
	"math/rand/v2"
	"time"

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
	if w.warm(s) && (!s.cfg.ShadowWarmUp || w.filled(s)) {
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
