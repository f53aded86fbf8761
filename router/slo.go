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
//	         recent requests' (mean fill over their decode, TPOT) pairs
//
// With TTFT alone judged, candidates predicted to miss it leave the
// candidate set while some candidate is predicted to meet it (the request's
// own queue is what the prediction sees), and among the rest the placement's
// pick stands when it holds more of the prompt than kv's pick (the cache the
// request uses now is TTFT capacity) or has more KV capacity (the cache it
// builds lives longer there), kv's pick otherwise (pooledTTFTPickLocked).
// With TPOT judged the placement's prefill lands in the decode steps of
// every request on the worker it picks, which neither the placement prices
// nor the fill line see, and kv's prefill term spreads: kv's pick stands
// unless a departure from it is predicted to meet the SLO with the margin
// the observed prediction errors give (the TPOT line's residuals at the
// SLO's attainment). Departures are the placement's pick, when kv's pick is
// predicted to meet the SLO, and kv's cost among the workers that meet it
// with that margin, when kv's pick is predicted to miss (a worker holding as
// much of the prompt as kv's pick needs no margin: moving there recomputes
// nothing kv's pick would not, and the recompute is what the margin covers
// beyond the line's error). With TTFT judged too, either departure must
// also be predicted to start the request no later than kv's pick
// (sloNoSlowerLocked): the time per token it protects or the cache it
// builds is not paid for in the request's own first token. When no candidate
// is predicted to meet it, or a prediction is not available yet, kv-pooled
// places among all of them, as without an SLO.

// SLO is a latency objective: a request meets it when its time to first
// token and its time per output token after the first are both within
// their limits; a zero limit does not judge that figure. The objective is
// met when a share Attainment of the requests meets it.
type SLO struct {
	TTFT time.Duration
	TPOT time.Duration
	// Attainment is the share of requests the objective asks to meet the
	// limits, in (0, 1); 0: DefaultSLOAttainment. kv-pooled departs from
	// kv's pick at the TPOT limit only where the prediction plus the
	// observed error at this quantile meets the limit.
	Attainment float64
}

// DefaultSLOAttainment is the share of requests an SLO asks to meet its
// limits when SLO.Attainment is zero (kvbench goodput's --attainment
// default).
const DefaultSLOAttainment = 0.9

// Set reports whether the SLO judges anything.
func (s SLO) Set() bool { return s.TTFT > 0 || s.TPOT > 0 }

// attainment is Attainment or its default.
func (s SLO) attainment() float64 {
	if s.Attainment == 0 {
		return DefaultSLOAttainment
	}
	return s.Attainment
}

// Validate rejects negative limits and an attainment outside [0, 1).
func (s SLO) Validate() error {
	if s.TTFT < 0 || s.TPOT < 0 {
		return fmt.Errorf("slo ttft %v, tpot %v: limits must not be negative: %w", s.TTFT, s.TPOT, ErrInvalidConfig)
	}
	if !(s.Attainment >= 0 && s.Attainment < 1) {
		return fmt.Errorf("slo attainment %v must be in [0, 1): %w", s.Attainment, ErrInvalidConfig)
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

// sloDecided is one candidate's fill and predicted TPOT in the last
// decision, for the booking that follows it (Route books with the lock
// still held).
type sloDecided struct {
	worker WorkerID
	fill   float64
	tpot   float64 // seconds, NaN when not predicted
}

// decidedOf is w's entry in the last decision, its figures NaN when it made
// none.
func (s *pooledWaitState) decidedOf(w WorkerID) sloDecided {
	for _, d := range s.decided {
		if d.worker == w {
			return d
		}
	}
	return sloDecided{worker: w, fill: math.NaN(), tpot: math.NaN()}
}

// residuals are the last window prediction errors (realised − predicted),
// kept in arrival order (ring) and sorted, for their quantiles.
type residuals struct {
	ring   []float64
	next   int // the oldest in ring once it is full
	sorted []float64
}

func (e *residuals) observe(x float64, window int) {
	if !finite(x) || window <= 0 {
		return
	}
	if len(e.ring) < window {
		e.ring = append(e.ring, x)
	} else {
		old := e.ring[e.next]
		e.ring[e.next] = x
		e.next = (e.next + 1) % window
		k, _ := slices.BinarySearch(e.sorted, old)
		e.sorted = slices.Delete(e.sorted, k, k+1)
	}
	k, _ := slices.BinarySearch(e.sorted, x)
	e.sorted = slices.Insert(e.sorted, k, x)
}

// quantile is the q-quantile of the errors (the least error at or above a
// share q of them), false until there are 1/(1 − q) of them: fewer cannot
// tell that quantile from the largest.
func (e residuals) quantile(q float64) (float64, bool) {
	n := len(e.sorted)
	if n == 0 || float64(n)*(1-q) < 1-1e-9 { // n < 1/(1 − q), up to rounding
		return 0, false
	}
	return e.sorted[min(n-1, max(0, int(math.Ceil(q*float64(n)))-1))], true
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
	tpot := now.Sub(b.first).Seconds() / float64(outputTokens-1)
	s.tpot.observe(x, tpot, pooledOutputWindow)
	if !math.IsNaN(b.predTPOT) {
		s.tpotErr.observe(tpot-b.predTPOT, pooledOutputWindow)
	}
}

// pooledSLOLocked is pooledCostsLocked with Config.SLO set. With TTFT
// alone judged, the candidates predicted to miss it leave while another is
// predicted to meet it, and among the rest the placement's pick stands when
// it holds more of the prompt than kv's or has more KV capacity
// (pooledTTFTPickLocked). With TPOT
// judged, kv's pick stands unless a departure is predicted
// to meet the SLO with margin (pooledSLOPickLocked). With every candidate
// predicted to miss, or a prediction not available yet, pooledPlaceLocked
// places among all of them, as without an SLO. r.mu must be held, with
// r.loads and r.overlaps filled for req.
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
		r.wait.decided = append(r.wait.decided, sloDecided{r.workers[i].ID, fill, math.NaN()})
	}
	slo := r.cfg.SLO
	// With TPOT judged on a fleet of one capacity, kv's pick, always
	// (pooledKVPickLocked). The predictions are still made where they can
	// be, so the TPOT line's error keeps being observed.
	uniform := slo.TPOT > 0 && known && r.sameCapacityLocked(candidates)
	if !known || !r.sloPredictLocked(req, candidates, now) {
		if uniform {
			return r.pooledKVPickLocked(candidates)
		}
		return r.pooledPlaceLocked(req, rows, candidates, now)
	}
	ps.meets = growClear(ps.meets, len(candidates))
	ps.sloKept = ps.sloKept[:0]
	for j, i := range candidates {
		ps.meets[j] = (slo.TTFT <= 0 || ps.ttft[j] <= slo.TTFT.Seconds()) && (slo.TPOT <= 0 || ps.tpot[j] <= slo.TPOT.Seconds())
		if ps.meets[j] {
			ps.sloKept = append(ps.sloKept, i)
		}
		if slo.TPOT > 0 {
			r.wait.decided[j].tpot = ps.tpot[j]
		}
	}
	if uniform {
		return r.pooledKVPickLocked(candidates)
	}
	if len(ps.sloKept) == 0 {
		return r.pooledPlaceLocked(req, rows, candidates, now)
	}
	if slo.TPOT > 0 {
		return r.pooledSLOPickLocked(req, rows, candidates, now)
	}
	return r.pooledTTFTPickLocked(req, rows, candidates, now)
}

// pooledKVPickLocked leaves kv's rows as computed and every candidate in:
// kv's decision, to the rng's draw, with the admission flags the booking
// records. kv-pooled decides so with TPOT judged on a fleet whose
// candidates all have one KV capacity: there the TPOT line's prediction
// error is as wide as the spread of its predictions across the workers
// (DESIGN.md, "Against an SLO": σ of the residual 3.8–4 ms, correlation
// 0.59), so "predicted to miss" mostly names the holder with a block or
// two more, every departure rule measured stayed 0.2–0.9 points of
// attainment under kv, and kv's cost over every candidate tied it.
// r.mu must be held, ps.over filled.
func (r *Router) pooledKVPickLocked(candidates []int) []int {
	ps := &r.pooled
	ps.admit = growClear(ps.admit, len(r.workers))
	for j, i := range candidates {
		ps.admit[i] = ps.over[j] <= 0
	}
	return candidates
}

// sameCapacityLocked: every candidate registered the same KV capacity.
// r.mu must be held.
func (r *Router) sameCapacityLocked(candidates []int) bool {
	for _, i := range candidates {
		if r.workers[i].TotalBlocks != r.workers[candidates[0]].TotalBlocks {
			return false
		}
	}
	return true
}

// pooledTTFTPickLocked decides with TTFT alone judged and some candidate
// predicted to meet it. The candidates predicted to miss leave (shown busy
// with both predictions); among the rest the placement's pick stands when
// it holds more of the prompt than kv's pick (kv's cost, lowest, among the
// same workers): a departure that computes fewer prefill blocks now, which
// is TTFT capacity the request itself uses. Any other departure is for the
// eviction, copy and home prices, a cache for later requests bought with
// the load balance of kv's cost, and that cache is worth its price only
// if it lives until it is used: it stands when the placement's pick has
// more KV capacity than kv's pick (an LRU of more blocks keeps content
// longer), and on workers of kv's pick's capacity or less kv's pick
// decides (on a uniform fleet nothing tells the workers' caches apart but
// their hashes: on 16 × 512 blocks at 512-token outputs 700 of 829
// departures held as much of the prompt as kv's pick, the working set
// exceeded the fleet, and the imbalance ended in preemptions). r.mu must
// be held, ps.meets, ps.ttft, ps.tpot, ps.over and ps.eff filled.
func (r *Router) pooledTTFTPickLocked(req Request, rows []WorkerCost, candidates []int, now time.Time) []int {
	ps := &r.pooled
	slo := r.cfg.SLO
	kept := candidates
	if len(ps.sloKept) < len(candidates) {
		kept = ps.sloKept
	}
	// kv's admission flags (what the booking records) and kv's pick among
	// kept, the first of the lowest costs.
	ps.kvAdmit = growClear(ps.kvAdmit, len(r.workers))
	for j, i := range candidates {
		ps.kvAdmit[i] = ps.over[j] <= 0
	}
	kv := kept[0]
	for _, i := range kept {
		if rows[i].Cost < rows[kv].Cost {
			kv = i
		}
	}
	ps.saved = append(ps.saved[:0], rows...)
	placed := r.pooledPlaceLocked(req, rows, kept, now)
	pick := -1
	for _, i := range placed {
		if pick < 0 || rows[i].Cost < rows[pick].Cost {
			pick = i
		}
	}
	if pick < 0 || (ps.eff[pick] <= ps.eff[kv] && r.workers[pick].TotalBlocks <= r.workers[kv].TotalBlocks) {
		// kv's cost among kept, as kv decides (its exact ties drawn by
		// the rng).
		copy(rows, ps.saved)
		ps.admit = growClear(ps.admit, len(r.workers))
		copy(ps.admit, ps.kvAdmit)
		placed = kept
	}
	for j, i := range candidates {
		if !ps.meets[j] {
			rows[i].setBusy(busyWhy{kind: busySLO, x: ps.ttft[j], y: ps.tpot[j], m: int64(slo.TTFT), n: int64(slo.TPOT)})
		}
	}
	return placed
}

// pooledSLOPickLocked decides with TPOT judged and some candidate
// predicted to meet the SLO. kv's pick (the rows as computed, lowest cost)
// stands unless a departure from it is safe: predicted to meet the TTFT
// limit and, with the TPOT line's observed error at the SLO's attainment
// added (sloSafeLocked), the TPOT limit. When kv's pick is predicted to
// meet the SLO the departure is the placement's pick (pooledPlaceLocked
// over every candidate); when it is predicted to miss, kv's cost among the
// safe candidates and those predicted to meet that hold as much of the
// prompt as kv's pick, the others shown busy. Either departure must also
// be predicted no slower to first token than kv's pick (sloNoSlowerLocked).
// Before the error is observed nothing is safe: kv's pick. r.mu must be
// held, ps.meets, ps.ttft and ps.tpot filled.
func (r *Router) pooledSLOPickLocked(req Request, rows []WorkerCost, candidates []int, now time.Time) []int {
	ps := &r.pooled
	slo := r.cfg.SLO
	// kv's admission flags (what the booking records) and kv's pick, the
	// first of the lowest costs: pickLocked breaks exact ties by the rng,
	// among candidates of one cost, so which of them is judged does not
	// matter when they are predicted alike.
	ps.admit = growClear(ps.admit, len(r.workers))
	ps.kvAdmit = growClear(ps.kvAdmit, len(r.workers))
	kv := 0
	for j, i := range candidates {
		ps.kvAdmit[i] = ps.over[j] <= 0
		if rows[i].Cost < rows[candidates[kv]].Cost {
			kv = j
		}
	}
	if !ps.meets[kv] {
		// kv's pick is predicted to miss: kv's cost among the candidates
		// predicted to meet the SLO with margin, and the ones predicted to
		// meet it that hold as much of the prompt as kv's pick (moving the
		// request there recomputes nothing kv's pick would not, so the
		// prefill the fill line does not see is not what the margin must
		// cover), if any.
		hold := ps.eff[candidates[kv]]
		ps.sloKept = ps.sloKept[:0]
		for j, i := range candidates {
			if (r.sloSafeLocked(j) || (ps.meets[j] && ps.eff[i] >= hold)) && r.sloNoSlowerLocked(j, kv) {
				ps.sloKept = append(ps.sloKept, i)
			}
		}
		copy(ps.admit, ps.kvAdmit)
		if len(ps.sloKept) == 0 {
			return candidates
		}
		margin, _ := r.wait.tpotErr.quantile(slo.attainment())
		for j, i := range candidates {
			switch {
			case !ps.meets[j]:
				rows[i].setBusy(busyWhy{kind: busySLO, x: ps.ttft[j], y: ps.tpot[j], m: int64(slo.TTFT), n: int64(slo.TPOT)})
			case !r.sloSafeLocked(j) && ps.eff[i] < hold:
				rows[i].setBusy(busyWhy{kind: busySLOMargin, x: ps.tpot[j], y: margin, n: int64(slo.TPOT)})
			case !r.sloNoSlowerLocked(j, kv):
				rows[i].setBusy(busyWhy{kind: busySLOSlower, x: ps.ttft[j], y: ps.ttft[kv]})
			}
		}
		return ps.sloKept
	}
	// kv's pick is predicted to meet: the placement's pick if it is safe.
	// The placement rewrites the rows and the admission flags (not the
	// predictions); kv's are kept to restore.
	ps.saved = append(ps.saved[:0], rows...)
	kept := r.pooledPlaceLocked(req, rows, candidates, now)
	pick := -1
	for _, i := range kept {
		if pick < 0 || rows[i].Cost < rows[pick].Cost {
			pick = i
		}
	}
	if j := slices.Index(candidates, pick); j >= 0 && r.sloSafeLocked(j) && r.sloNoSlowerLocked(j, kv) {
		return kept
	}
	// kv's pick, among every candidate as kv decides: marking the ones
	// predicted to miss busy would change which of kv's exact ties the rng
	// draws from (kv's costs are whole blocks, so ties are common), and
	// measured, drawing among all of them stayed closer to kv.
	copy(rows, ps.saved)
	copy(ps.admit, ps.kvAdmit)
	return candidates
}

// sloSafeLocked: candidate j (a position in the candidates ps.ttft and
// ps.tpot are parallel to) is predicted to meet the TTFT limit, and the
// TPOT limit with the error the TPOT line made at the SLO's attainment
// (the quantile of its recent residuals: a share Attainment of the
// requests it predicted finished at or under prediction + margin). False
// while the error is not observed. r.mu must be held.
func (r *Router) sloSafeLocked(j int) bool {
	ps := &r.pooled
	slo := r.cfg.SLO
	if slo.TTFT > 0 && ps.ttft[j] > slo.TTFT.Seconds() {
		return false
	}
	margin, ok := r.wait.tpotErr.quantile(slo.attainment())
	return ok && ps.tpot[j]+margin <= slo.TPOT.Seconds()
}

// sloNoSlowerLocked: candidate j is predicted to start the request no later
// than candidate kv (positions in the candidates ps.ttft is parallel to),
// or TTFT is not judged (no prediction to compare). With TPOT judged a
// departure from kv's pick is for the time per token (kv's pick predicted
// to miss) or for the placement's cache, and either must not be paid for
// in the request's own time to first token: kv's cost already weighs the
// prefill queue, so a departure to a worker predicted slower to start it
// is the one that queues behind the prefills there. On mixed capacities
// those were the departures to the larger worker (its low fill meets the
// TPOT limit, its queue of prefills is longer), and they made kv-pooled's
// p99 TTFT at kv's goodput rate 1.10–1.20 × kv's. Both sides are one
// model's predictions (the prefill blocks with the worker's queue at its
// observed rate, the KV wait), so a bias common to both cancels and they
// are compared as they are: no constant, no margin. r.mu must be held,
// ps.ttft filled.
func (r *Router) sloNoSlowerLocked(j, kv int) bool {
	ps := &r.pooled
	return r.cfg.SLO.TTFT <= 0 || j == kv || ps.ttft[j] <= ps.ttft[kv]
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
