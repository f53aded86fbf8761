package sim

import (
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/kvrouter/kvrouter/internal/fleetplan"
	"github.com/kvrouter/kvrouter/internal/warmup"
	"github.com/kvrouter/kvrouter/router"
)

// Fleet events (issue 29 item 5): a worker leaves the fleet mid-run, as a
// drain does it live — no new request goes there from the removal on,
// requests running there finish, and its cache is gone (its blocks leave
// the index at once; the events it still emits are dropped). The worker is
// chosen by the fleet plan (the cheapest to remove, internal/fleetplan, on
// the index and the hits the routers captured within PlanWindow), at
// random, or as the least loaded. What the fleet lost is measured on the
// requests sent within fleetplan.Horizon after the removal.

// Removal choices.
const (
	ChoosePlan        = "plan"
	ChooseRandom      = "random"
	ChooseLeastLoaded = "least-loaded"
)

// Choices lists the removal choices.
var Choices = []string{ChoosePlan, ChooseRandom, ChooseLeastLoaded}

// PlanWindow is how far back the plan's hits are counted (the replica's
// longest hit-rate window).
const PlanWindow = 10 * time.Minute

// dipBucket is the resolution of the dip's depth and duration.
const dipBucket = 10 * time.Second

// Removal removes a worker at At, chosen by Choose, or the one named
// Worker (Choose "worker").
type Removal struct {
	At     time.Duration
	Choose string
	Worker string
}

// ChooseWorker removes Removal.Worker.
const ChooseWorker = "worker"

// RemovalResult is what a removal cost.
type RemovalResult struct {
	Choose string        `json:"choose"`
	Worker string        `json:"worker"`
	At     time.Duration `json:"-"`
	AtS    float64       `json:"at_s"`
	// CachedTokensAfter and PromptTokensAfter sum the requests sent
	// within the horizon after the removal (their cached tokens as the
	// engines reported them).
	CachedTokensAfter int64   `json:"cached_tokens_after"`
	PromptTokensAfter int64   `json:"prompt_tokens_after"`
	HorizonS          float64 `json:"horizon_s"`
	// HitRateBefore is the cached fraction of the requests sent within
	// PlanWindow before the removal; HitRateDip the largest drop below it
	// over 10 s buckets after (percentage points as a fraction), and
	// HitRateDipS how long until a bucket is back at 95 % of it (the
	// horizon when none is).
	HitRateBefore float64 `json:"hit_rate_before"`
	HitRateDip    float64 `json:"hit_rate_dip"`
	HitRateDipS   float64 `json:"hit_rate_dip_s"`
	// TTFTBeforeMs is the mean TTFT before; TTFTPeakRatio the worst 10 s
	// bucket's mean over it after, TTFTDipS how long until a bucket is
	// back within 1.2× it.
	TTFTBeforeMs  float64 `json:"ttft_before_ms"`
	TTFTPeakRatio float64 `json:"ttft_peak_ratio"`
	TTFTDipS      float64 `json:"ttft_dip_s"`
}

// removalDue performs the removal once its time has come (from send,
// before the first request routed at or after it: only routing sees it).
func (s *state) removalDue() {
	r := s.cfg.Remove
	if r == nil || s.removed >= 0 || s.now < r.At {
		return
	}
	wi := s.chooseRemoval(r.Choose)
	s.removed = wi
	s.removedAt = s.now
	// Every router stops choosing it; bookings already there end with
	// their requests.
	var infos []router.WorkerInfo
	for _, w := range s.rts[0].Workers() {
		if w.ID != s.ids[wi] {
			infos = append(infos, w)
		}
	}
	for _, rt := range s.rts {
		rt.SetWorkers(infos)
	}
	s.index.RemoveWorker(s.ids[wi])
}

// chooseRemoval picks the worker to remove.
func (s *state) chooseRemoval(choose string) int {
	n := len(s.engines)
	switch choose {
	case ChooseWorker:
		return s.byWorker[router.WorkerID(s.cfg.Remove.Worker)]
	case ChooseRandom:
		rng := rand.New(rand.NewPCG(s.cfg.Seed, 0x5eed0f1ee7))
		return rng.IntN(n)
	case ChooseLeastLoaded:
		best, least := 0, math.MaxInt
		for i, id := range s.ids {
			if l := s.rts[0].Load().Load(id).Requests; l < least {
				best, least = i, l
			}
		}
		return best
	}
	// The plan: the cheapest to remove on what the index holds and the
	// hits the routers placed within the window.
	from := max(s.now-PlanWindow, 0)
	secs := (s.now - from).Seconds()
	cached := make([]float64, n)
	for _, rr := range s.res {
		if rr.Worker >= 0 && rr.FirstToken > 0 && rr.Sent >= from && rr.Sent < s.now {
			cached[rr.Worker] += float64(rr.CachedTokens)
		}
	}
	ws := make([]fleetplan.Worker, n)
	for i, id := range s.ids {
		held, unique := s.index.CacheCounts(id)
		ws[i] = fleetplan.Worker{ID: string(id), BlockSize: s.w.BlockSize, HeldBlocks: held, UniqueBlocks: unique}
		if secs > 0 {
			ws[i].CachedTokensPerS = cached[i] / secs
		}
	}
	return fleetplan.Rank(ws)[0]
}

// removalResult measures the removal on the finished run.
func (s *state) removalResult() *RemovalResult {
	if s.cfg.Remove == nil || s.removed < 0 {
		return nil
	}
	out := &RemovalResult{Choose: s.cfg.Remove.Choose, Worker: string(s.ids[s.removed]), At: s.removedAt, AtS: s.removedAt.Seconds(),
		HorizonS: fleetplan.Horizon.Seconds()}
	d := s.measureDips(s.removedAt, -1)
	out.CachedTokensAfter, out.PromptTokensAfter = d.cachedAfter, d.promptAfter
	out.HitRateBefore, out.HitRateDip, out.HitRateDipS = d.hitBefore, d.hitDip, d.hitDipS
	out.TTFTBeforeMs, out.TTFTPeakRatio, out.TTFTDipS = d.ttftBefore, d.ttftPeak, d.ttftDipS
	return out
}

// dips are the fleet's figures around an event at at: before it (within
// PlanWindow), and over the horizon after it in 10 s buckets.
type dips struct {
	cachedAfter, promptAfter   int64
	hitBefore, hitDip, hitDipS float64
	ttftBefore, ttftPeak       float64
	ttftDipS                   float64
	// Of the worker given to measureDips (-1: none): the share of the
	// requests after at sent to it, and when its own bucket hit rate first
	// reached the fleet's rate before at (the horizon if never).
	share, warmS float64
}

// measureDips measures the requests around at; worker, when ≥ 0, is the
// worker whose share and warm-up time to report.
func (s *state) measureDips(at time.Duration, worker int) dips {
	h := fleetplan.Horizon
	type sums struct {
		cached, prompt int64
		ttft           time.Duration
		n              int
	}
	var before, mine sums
	after := 0
	buckets := make([]sums, int(h/dipBucket))
	own := make([]sums, len(buckets))
	for i, rr := range s.res {
		if !rr.Done {
			continue
		}
		p := int64(s.w.Requests[i].PromptTokens)
		switch {
		case rr.Sent >= max(at-PlanWindow, 0) && rr.Sent < at:
			before.cached += int64(rr.CachedTokens)
			before.prompt += p
			before.ttft += rr.FirstToken - rr.Sent
			before.n++
		case rr.Sent >= at && rr.Sent < at+h:
			k := int((rr.Sent - at) / dipBucket)
			for _, b := range []*sums{&buckets[k], &mine} {
				if b == &mine && rr.Worker != worker {
					continue
				}
				b.cached += int64(rr.CachedTokens)
				b.prompt += p
				b.ttft += rr.FirstToken - rr.Sent
				b.n++
			}
			if rr.Worker == worker {
				o := &own[k]
				o.cached += int64(rr.CachedTokens)
				o.prompt += p
				o.n++
			}
			after++
		}
	}
	var d dips
	for _, b := range buckets {
		d.cachedAfter += b.cached
		d.promptAfter += b.prompt
	}
	if before.prompt > 0 {
		d.hitBefore = float64(before.cached) / float64(before.prompt)
	}
	if before.n > 0 {
		d.ttftBefore = float64(before.ttft.Microseconds()) / 1e3 / float64(before.n)
	}
	d.hitDipS, d.ttftDipS, d.warmS = h.Seconds(), h.Seconds(), h.Seconds()
	hitBack, ttftBack, warm := false, false, false
	for k, b := range buckets {
		if b.n == 0 || b.prompt == 0 {
			continue
		}
		rate := float64(b.cached) / float64(b.prompt)
		d.hitDip = max(d.hitDip, d.hitBefore-rate)
		if !hitBack && rate >= 0.95*d.hitBefore {
			hitBack, d.hitDipS = true, (time.Duration(k) * dipBucket).Seconds()
		}
		if d.ttftBefore > 0 {
			ttft := float64(b.ttft.Microseconds()) / 1e3 / float64(b.n)
			d.ttftPeak = max(d.ttftPeak, ttft/d.ttftBefore)
			if !ttftBack && ttft <= 1.2*d.ttftBefore {
				ttftBack, d.ttftDipS = true, (time.Duration(k) * dipBucket).Seconds()
			}
		}
		if o := own[k]; !warm && o.prompt > 0 && float64(o.cached)/float64(o.prompt) >= d.hitBefore {
			warm, d.warmS = true, (time.Duration(k) * dipBucket).Seconds()
		}
	}
	if after > 0 {
		d.share = float64(mine.n) / float64(after)
	}
	return d
}

// Addition adds a worker at At: the fleet's last worker is not routed to
// before (an idle engine with an empty cache), and every router takes it
// into its candidates from the first request routed at or after At.
type Addition struct {
	At time.Duration
}

// AdditionResult is how the fleet took the new worker.
type AdditionResult struct {
	Worker string  `json:"worker"`
	AtS    float64 `json:"at_s"`
	// Share is the fraction of the requests sent within the horizon after
	// the addition that went to it; WarmS when its own hit rate (10 s
	// buckets) first reached the fleet's before the addition (the horizon
	// when it never did).
	Share float64 `json:"share"`
	WarmS float64 `json:"warm_s"`
	// The fleet's hit rate and mean TTFT around the addition, as for a
	// removal.
	HitRateBefore float64 `json:"hit_rate_before"`
	HitRateDip    float64 `json:"hit_rate_dip"`
	HitRateDipS   float64 `json:"hit_rate_dip_s"`
	TTFTBeforeMs  float64 `json:"ttft_before_ms"`
	TTFTPeakRatio float64 `json:"ttft_peak_ratio"`
	TTFTDipS      float64 `json:"ttft_dip_s"`
	HorizonS      float64 `json:"horizon_s"`
	// Steered is how many requests the warm-up sent to it on purpose
	// (Config.WarmUp), and WarmUpEndS when it stopped (the joiner warm;
	// absent while it never was).
	Steered    int      `json:"steered,omitempty"`
	WarmUpEndS *float64 `json:"warm_up_end_s,omitempty"`
}

// withoutJoiner leaves the joining worker out of infos until it joins.
func (s *state) withoutJoiner(infos []router.WorkerInfo) []router.WorkerInfo {
	if s.cfg.Add == nil {
		return infos
	}
	return infos[:len(infos)-1]
}

// additionDue adds the joining worker once its time has come (from send).
func (s *state) additionDue() {
	a := s.cfg.Add
	if a == nil || s.addedAt >= 0 || s.now < a.At {
		return
	}
	s.addedAt = s.now
	for _, rt := range s.rts {
		rt.SetWorkers(s.infos)
	}
}

// additionResult measures the addition on the finished run.
func (s *state) additionResult() *AdditionResult {
	if s.cfg.Add == nil || s.addedAt < 0 {
		return nil
	}
	wi := len(s.engines) - 1
	d := s.measureDips(s.addedAt, wi)
	out := &AdditionResult{Worker: string(s.ids[wi]), AtS: s.addedAt.Seconds(), Share: d.share, WarmS: d.warmS,
		HitRateBefore: d.hitBefore, HitRateDip: d.hitDip, HitRateDipS: d.hitDipS,
		TTFTBeforeMs: d.ttftBefore, TTFTPeakRatio: d.ttftPeak, TTFTDipS: d.ttftDipS, HorizonS: fleetplan.Horizon.Seconds(),
		Steered: s.warm.steered}
	if s.warm.at >= 0 {
		end := (s.warm.at - s.addedAt).Seconds()
		out.WarmUpEndS = &end
	}
	return out
}

// checkRemoval refuses a removal the run cannot do.
func checkRemoval(cfg Config) error {
	if a := cfg.Add; a != nil {
		switch {
		case cfg.Remove != nil:
			return fmt.Errorf("one fleet event per run: a removal or an addition: %w", ErrConfig)
		case cfg.Peer != nil:
			return fmt.Errorf("fleet events need the router, not a peer: %w", ErrConfig)
		case cfg.Workers < 2:
			return fmt.Errorf("adding the only worker leaves none before it: %w", ErrConfig)
		case a.At < 0:
			return fmt.Errorf("addition at %v: %w", a.At, ErrConfig)
		}
	}
	if w := cfg.WarmUp; w != nil && (cfg.Add == nil || !(w.Share > 0 && w.Share <= 1) || !(w.Headroom > 0)) {
		return fmt.Errorf("warm-up %+v needs an addition, a share in (0,1] and a positive headroom: %w", *w, ErrConfig)
	}
	r := cfg.Remove
	if r == nil {
		return nil
	}
	switch {
	case cfg.Peer != nil:
		return fmt.Errorf("fleet events need the router, not a peer: %w", ErrConfig)
	case cfg.Workers < 2:
		return fmt.Errorf("removing one of %d workers leaves none: %w", cfg.Workers, ErrConfig)
	case r.At < 0:
		return fmt.Errorf("removal at %v: %w", r.At, ErrConfig)
	}
	for _, c := range Choices {
		if r.Choose == c {
			return nil
		}
	}
	if r.Choose == ChooseWorker {
		for i := range cfg.Workers {
			if WorkerID(i, cfg.Workers) == r.Worker {
				return nil
			}
		}
		return fmt.Errorf("no worker %q to remove: %w", r.Worker, ErrConfig)
	}
	return fmt.Errorf("removal choice %q: want one of %v: %w", r.Choose, Choices, ErrConfig)
}

// warmState is the warm-up's progress (Config.WarmUp).
type warmState struct {
	baseline float64       // the fleet's hit rate before the addition (-1: not measured yet)
	at       time.Duration // when the joiner was first found warm; -1 before
	steered  int           // requests sent to the joiner on purpose
	rng      *rand.Rand
}

// warmWindow is how far back the joiner's own hit rate is read to decide
// it is warm, and warmMinRequests how many of its requests that needs.
const (
	warmWindow      = time.Minute
	warmMinRequests = 5
)

// warmUp applies Config.WarmUp to a decision router k made for req: a
// share of new and duplicated prefixes goes to the joining worker while
// the fleet has headroom, until the joiner's own hit rate over the last
// minute reaches the fleet's before it joined.
func (s *state) warmUp(k int, req router.Request, d router.Decision) (router.Decision, error) {
	p := s.cfg.WarmUp
	if p == nil || s.addedAt < 0 || s.warm.at >= 0 {
		return d, nil
	}
	jw := len(s.ids) - 1
	if s.warm.rng == nil {
		s.warm.rng = rand.New(rand.NewPCG(s.cfg.Seed, 0x3a4e0f))
		s.warm.baseline = s.measureDips(s.addedAt, -1).hitBefore
	}
	if s.joinerWarm(jw) {
		s.warm.at = s.now
		return d, nil
	}
	rt := s.rts[k]
	util := warmup.Utilization(rt.Config().Thresholds, rt.Workers(), rt.Load().Load)
	if !warmup.Steer(d.Rows, d.Worker, s.ids[jw], util, s.warm.rng.Float64(), *p) {
		return d, nil
	}
	rt.Free(req.ID)
	steered := req
	steered.Exclude = nil
	for _, id := range s.ids[:jw] {
		steered.Exclude = append(steered.Exclude, id)
	}
	if d2, err := rt.Route(steered, epoch.Add(s.now)); err == nil {
		s.warm.steered++
		return d2, nil
	}
	return rt.Route(req, epoch.Add(s.now)) // the joiner refused it after all: as decided first
}

// joinerWarm: the joiner's requests whose first token came within the
// last warmWindow were served from its cache at least as well as the
// fleet's were before it joined.
func (s *state) joinerWarm(jw int) bool {
	var cached, prompt int64
	n := 0
	for i, rr := range s.res {
		if rr.Worker == jw && rr.FirstToken > 0 && rr.FirstToken >= s.now-warmWindow {
			cached += int64(rr.CachedTokens)
			prompt += int64(s.w.Requests[i].PromptTokens)
			n++
		}
	}
	return n >= warmMinRequests && prompt > 0 && float64(cached)/float64(prompt) >= s.warm.baseline
}
