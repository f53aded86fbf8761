package router

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"
)

// kv-pooled against a latency objective (DESIGN.md, "Against an SLO").
// With Config.SLO set, kv-pooled predicts for every candidate the request's
// time to first token and the time per output token the worker will give
// once the request is placed there, from what the router observed:
//
//	TTFT_w = prefill_w · seconds per prefill block_w + expected wait_w
//	TPOT_w = the TPOT observed at w's fill, a least-squares line over the
//	         recent requests' (fill at booking, TPOT) pairs
//
// Candidates predicted to miss the SLO leave the candidate set while some
// candidate is predicted to meet it, and kv-pooled places the request among
// the rest as it does without an SLO (the cache placement is what a
// request predicted to meet its SLO can afford), except with TPOT judged:
// then kv's cost picks among the rest (the fleet is at its SLO line, and a
// placement's prefill slows every decode on the worker it picks, which kv's
// prefill term spreads and the placement prices do not see). When no candidate is
// predicted to meet it, or a prediction is not available yet, the request
// is routed by kv's cost: placement for the cache is what the fleet cannot
// afford then.

// SLO is a latency objective: a request meets it when its time to first
// token and its time per output token after the first are both within
// their limits; a zero limit does not judge that figure.
type SLO struct {
	TTFT time.Duration
	TPOT time.Duration
}

// Set reports whether the SLO judges anything.
func (s SLO) Set() bool { return s.TTFT > 0 || s.TPOT > 0 }

// Validate rejects negative limits.
func (s SLO) Validate() error {
	if s.TTFT < 0 || s.TPOT < 0 {
		return fmt.Errorf("slo ttft %v, tpot %v: limits must not be negative: %w", s.TTFT, s.TPOT, ErrInvalidConfig)
	}
	return nil
}

// linearFit is a least-squares line y = a + b·x over recent observations:
// running means of x, y, x², xy, each over the last ~window observations
// (the count stops there, as ratioMean's does).
type linearFit struct {
	n                int
	mx, my, mxx, mxy float64
}

func (f *linearFit) observe(x, y float64, window int) {
	if !finite(x) || !finite(y) || y < 0 {
		return
	}
	f.n = min(f.n+1, max(window, 1))
	k := float64(f.n)
	f.mx += (x - f.mx) / k
	f.my += (y - f.my) / k
	f.mxx += (x*x - f.mxx) / k
	f.mxy += (x*y - f.mxy) / k
}

// sloMinVariance is the least variance of x (fill fractions) a line is
// fitted through: below it the spread is rounding, not observation.
const sloMinVariance = 1e-9

// predict is the line at x, false until the observed x spread. A line
// that falls with x (noise, or a range too narrow to show the rise)
// predicts the mean: more load never makes a worker faster.
func (f linearFit) predict(x float64) (float64, bool) {
	if f.n < 2 {
		return 0, false
	}
	varX := f.mxx - f.mx*f.mx
	if !(varX > sloMinVariance) {
		return 0, false
	}
	b := max((f.mxy-f.mx*f.my)/varX, 0)
	return f.my + b*(x-f.mx), true
}

// sloDecided is one candidate's fill in the last decision, for the
// booking that follows it (Route books with the lock still held).
type sloDecided struct {
	worker WorkerID
	fill   float64
}

// decidedFill is w's fill in the last decision, NaN when it made none.
func (s *pooledWaitState) decidedFill(w WorkerID) float64 {
	for _, d := range s.decided {
		if d.worker == w {
			return d.fill
		}
	}
	return math.NaN()
}

// fillSamples accumulates a worker's fill as decisions see it: Poisson
// arrivals see time averages, so the mean between two snapshots is the
// worker's mean fill over that span.
type fillSamples struct {
	sum float64
	n   int
}

func (s *pooledWaitState) sample(w WorkerID, fill float64) {
	if s.samples == nil {
		s.samples = make(map[WorkerID]*fillSamples)
	}
	p := s.samples[w]
	if p == nil {
		p = &fillSamples{}
		s.samples[w] = p
	}
	p.sum += fill
	p.n++
}

func (s *pooledWaitState) samplesOf(w WorkerID) fillSamples {
	if p := s.samples[w]; p != nil {
		return *p
	}
	return fillSamples{}
}

// observeTPOT learns the TPOT at a fill: first token to finish over the
// output tokens after the first, against the worker's mean fill over that
// span (the decisions' samples), or its fill at booking when no decision
// sampled it meanwhile.
func (s *pooledWaitState) observeTPOT(b pooledBooking, outputTokens int, now time.Time) {
	if math.IsNaN(b.fill) || outputTokens <= 1 || b.first.IsZero() || now.Before(b.first) {
		return
	}
	x := b.fill
	if cur := s.samplesOf(b.worker); cur.n > b.sampled.n {
		x = (cur.sum - b.sampled.sum) / float64(cur.n-b.sampled.n)
	}
	s.tpot.observe(x, now.Sub(b.first).Seconds()/float64(outputTokens-1), pooledOutputWindow)
}

// pooledSLOLocked is pooledCostsLocked with Config.SLO set: the candidates
// predicted to miss the SLO leave while another is predicted to meet it,
// and pooledPlaceLocked places the request among the rest (kv's cost, the
// rows unchanged, when the SLO judges TPOT); with every
// candidate predicted to miss, or a prediction not available yet, among
// all of them, as without an SLO. r.mu must be held, with r.loads and
// r.overlaps filled for req.
func (r *Router) pooledSLOLocked(req Request, rows []WorkerCost, candidates []int, now time.Time) []int {
	ps := &r.pooled
	r.pooledOverlapsLocked(req, candidates)
	reserve := r.pooledReserveLocked()
	r.pooledAdmissionLocked(candidates, reserve)
	known := r.capacitiesKnownLocked(candidates)
	// Each candidate's fill, for the booking's TPOT observation, and a
	// sample of every candidate's fill before the request (the mean fill
	// a running request saw).
	r.wait.decided = r.wait.decided[:0]
	for j, i := range candidates {
		fill := math.NaN()
		if known {
			fill = ps.fill[j]
			r.wait.sample(r.workers[i].ID, ps.held[j])
		}
		r.wait.decided = append(r.wait.decided, sloDecided{r.workers[i].ID, fill})
	}
	if !known || !r.sloPredictLocked(req, candidates, now) {
		return r.pooledPlaceLocked(req, rows, candidates, now)
	}
	slo := r.cfg.SLO
	ps.meets = growClear(ps.meets, len(candidates))
	ps.sloKept = ps.sloKept[:0]
	for j, i := range candidates {
		ps.meets[j] = (slo.TTFT <= 0 || ps.ttft[j] <= slo.TTFT.Seconds()) && (slo.TPOT <= 0 || ps.tpot[j] <= slo.TPOT.Seconds())
		if ps.meets[j] {
			ps.sloKept = append(ps.sloKept, i)
		}
	}
	if len(ps.sloKept) == 0 || len(ps.sloKept) == len(candidates) {
		return r.pooledPlaceLocked(req, rows, candidates, now)
	}
	for j, i := range candidates {
		if !ps.meets[j] {
			rows[i].setBusy(busyWhy{kind: busySLO, x: ps.ttft[j], y: ps.tpot[j], m: int64(slo.TTFT), n: int64(slo.TPOT)})
		}
	}
	if slo.TPOT > 0 {
		// Some worker predicted to miss, others to meet, with TPOT judged:
		// the fleet is at its SLO line, and a placement's prefill lands in
		// the decode steps of every request running on the worker it
		// picks, which the placement prices do not see and kv's prefill
		// term spreads. kv's cost, the rows as computed, picks among the
		// workers predicted to meet.
		ps.admit = growClear(ps.admit, len(r.workers))
		for j, i := range candidates {
			ps.admit[i] = ps.over[j] <= 0
		}
		return ps.sloKept
	}
	return r.pooledPlaceLocked(req, rows, ps.sloKept, now)
}

// sloPredictLocked fills ps.ttft and ps.tpot (seconds, parallel to
// candidates) with each candidate's predicted TTFT and TPOT for req, and
// reports whether every figure the SLO judges could be predicted: the TPOT
// line needs two requests finished at different fills, the TTFT a prefill
// rate and, where the request would wait for KV blocks, a decode rate and
// an observed output length. r.mu must be held, ps.eff, ps.over and
// ps.fill filled.
func (r *Router) sloPredictLocked(req Request, candidates []int, now time.Time) bool {
	ps := &r.pooled
	slo := r.cfg.SLO
	ps.ttft, ps.tpot = growClear(ps.ttft, len(candidates)), growClear(ps.tpot, len(candidates))
	for j, i := range candidates {
		w := r.workers[i].ID
		if slo.TPOT > 0 {
			t, ok := r.wait.tpot.predict(ps.fill[j])
			if !ok {
				return false
			}
			ps.tpot[j] = t
		}
		if slo.TTFT > 0 {
			spb, ok := r.wait.secondsPerBlock(w)
			if !ok {
				return false
			}
			l := r.loads[i]
			prefill := ps.terms[i].prefill
			wait := 0.0
			total := float64(r.workers[i].TotalBlocks)
			if float64(l.ActiveBlocks+l.NewBlocks) > total || ps.over[j] > 0 {
				spt, ok := r.wait.secondsPerToken(w)
				if !ok || r.outputs.n == 0 {
					return false
				}
				ps.running = r.load.runningPrompts(w, ps.running)
				wait = engineWait(ps.running, float64(l.ActiveBlocks), float64(l.NewBlocks), total, r.outputs.mean*spt, spt, float64(r.cfg.BlockSize), now)
			}
			ps.ttft[j] = prefill*spb + wait
		}
	}
	return true
}

// growClear returns s with length n, every element zero.
func growClear[T any](s []T, n int) []T {
	s = slices.Grow(s[:0], n)[:n]
	clear(s)
	return s
}

// runningSeq is one running request as the engine's admission sees it.
type runningSeq struct {
	id    string
	start time.Time // its first token (the booking when unknown)
	alone float64   // prompt blocks no other request on the worker holds
	seqs  float64
	left  float64 // seconds of decode left (engineWait)
}

// runningPrompts fills dst with w's requests whose decode has started.
func (a *ActiveLoad) runningPrompts(w WorkerID, dst []runningSeq) []runningSeq {
	dst = dst[:0]
	a.mu.Lock()
	defer a.mu.Unlock()
	wl := a.workers[w]
	if wl == nil {
		return dst
	}
	for r := range wl.reqs {
		if !r.prefillDone {
			continue
		}
		alone := a.aloneBlocksLocked(r, w)
		start := r.firstToken
		if start.IsZero() {
			start = r.added
		}
		dst = append(dst, runningSeq{id: r.id, start: start, alone: float64(alone), seqs: float64(max(r.seqs, 1))})
	}
	return dst
}

// engineWait is how long, in seconds from now, a request needing need new
// blocks waits for an engine to admit it: an engine admits a prompt when
// its blocks fit beside what the running requests hold now, their prompts
// (prompts: the worker's pinned prompt blocks, waiting requests' included)
// and the output each has generated so far (its decode time so far at
// secondsPerToken, up to decode seconds, in blocks of bs tokens). Running
// requests end in order of expected end, freeing their prompt blocks and
// their output, while the others' outputs grow; when all of them ending
// is not enough, one more whole decode. It sorts running.
func engineWait(running []runningSeq, prompts, need, total, decode, secondsPerToken, bs float64, now time.Time) float64 {
	elapsed := func(s runningSeq) float64 { return now.Sub(s.start).Seconds() }
	for i := range running {
		running[i].left = max(0, decode-elapsed(running[i]))
	}
	slices.SortFunc(running, func(x, y runningSeq) int {
		if c := cmp.Compare(x.left, y.left); c != 0 {
			return c
		}
		return strings.Compare(x.id, y.id)
	})
	held := func(t float64, from int) float64 {
		u := prompts
		for j, s := range running {
			if j < from {
				u -= s.alone
				continue
			}
			u += s.seqs * min(elapsed(s)+t, decode) / (secondsPerToken * bs)
		}
		return u
	}
	if held(0, 0)+need <= total {
		return 0
	}
	last := 0.0
	for k, s := range running {
		last = s.left
		if held(last, k+1)+need <= total {
			return last
		}
	}
	return last + decode
}
