package router

import (
	"cmp"
	"slices"
	"strings"
	"time"
)

// kv-pooled's queue price: what waiting at a worker over the admission line
// costs, in the cost function's units. The router learns, per worker, how
// long a block of prefill takes (booking to first token, for requests it
// expected to be admitted at once) and how long an output token takes
// (first token to finish); with the observed output length these give
// when each running request ends and so when a new request would be
// admitted. DESIGN.md ("The expected wait") explains the choice.

// DefaultPooledWaitWeight is off. The weight prices one second of expected
// wait for KV admission as the prefill blocks the worker computes in one
// second, times the weight: at 1 a wait and a prefill that delay the first
// token equally cost the same, the unit the cost function's prefill term
// already uses (scale·prefill blocks, the worker's queue before the first
// token). Measured on the wide grid and seed 002 (BENCHMARKS.md, "A queue
// price from the expected wait"), no weight raised the cache at long
// outputs without multiplying p99 TTFT elsewhere: at 1 the holders a
// request would wait on for seconds lose it (1,024-token outputs fall
// below kv); at 0.1 the cache goals are met there, and 256- and
// 64-token runs wait seconds for hits. 0 keeps kv-pooled as it was:
// workers over the admission line excluded, overflow priced by QueueWeight
// when overloaded. Opt in with PooledConfig.WaitWeight
// (kvbench sim --pooled-wait-weight).
const DefaultPooledWaitWeight = 0.0

// pooledRateWindow: a worker's rates weigh its last ~64 observations (a
// running mean whose count stops there), so they follow its batch as it
// changes; the fleet's rates, the fallback for a worker not yet observed,
// weigh the last pooledOutputWindow.
const pooledRateWindow = 64

// ratioMean estimates num/den over recent observations: the running means
// of both, each over the last ~window observations. A ratio of means, not
// a mean of ratios: a long prefill weighs by its blocks, and a short one's
// fixed step overhead does not dominate.
type ratioMean struct {
	n        int
	num, den float64
}

func (m *ratioMean) observe(num, den float64, window int) {
	if !(num >= 0 && den > 0) || !finite(num) || !finite(den) {
		return
	}
	m.n = min(m.n+1, window)
	m.num += (num - m.num) / float64(m.n)
	m.den += (den - m.den) / float64(m.n)
}

// ratio is num/den, false before the first observation.
func (m ratioMean) ratio() (float64, bool) {
	if m.n == 0 || m.den <= 0 {
		return 0, false
	}
	return m.num / m.den, true
}

// pooledRates is what the router observed of one worker's (or the fleet's)
// speed: seconds per block of prefill and seconds per output token.
type pooledRates struct {
	prefill ratioMean // seconds per prefill block (the cost's prefill units)
	decode  ratioMean // seconds per output token of one sequence
}

// pooledBooking is what the router remembers of a request it routed in
// kv-pooled mode until it ends, to observe its worker's rates.
type pooledBooking struct {
	worker   WorkerID
	booked   time.Time
	first    time.Time   // zero until PrefillDoneAt
	prefill  float64     // the cost's prefill blocks on the chosen worker at booking
	admitted bool        // the admission test said it starts at once: its TTFT is prefill, not a wait
	fill     float64     // the worker's fill at booking (pooledAdmissionLocked), NaN when not known (slo.go)
	sampled  fillSamples // the worker's fill samples at its first token (slo.go)
	predTPOT float64     // the TPOT the SLO rule predicted on the worker (seconds), NaN when none (slo.go)
}

// pooledWaitState is kv-pooled's rate estimates, per worker and fleet-wide,
// and the bookings they learn from. Guarded by Router.mu.
type pooledWaitState struct {
	own     map[string]pooledBooking
	workers map[WorkerID]*pooledRates
	fleet   pooledRates
	// waiting counts the bookings in own that the admission test did not
	// let start at once and that have no first token yet: requests this
	// router knowingly sent to wait for KV blocks.
	waiting int
	// With an SLO (slo.go): the TPOT observed against the fill at booking,
	// fleet-wide, and each candidate's fill in the last decision.
	tpot    linearFit
	decided []sloDecided
	samples map[WorkerID]*fillSamples
	// tpotErr is the TPOT line's recent errors: each finished request's
	// TPOT less the TPOT predicted for it where it was booked.
	tpotErr residuals
}

// waitingForAdmission reports whether b is one of the bookings counted in
// waiting.
func (b pooledBooking) waitingForAdmission() bool { return !b.admitted && b.first.IsZero() }

// drop forgets id's booking, keeping waiting in step.
func (s *pooledWaitState) drop(id string) (pooledBooking, bool) {
	b, ok := s.own[id]
	if ok {
		if b.waitingForAdmission() {
			s.waiting--
		}
		delete(s.own, id)
	}
	return b, ok
}

func (s *pooledWaitState) rates(w WorkerID) *pooledRates {
	if s.workers == nil {
		s.workers = make(map[WorkerID]*pooledRates)
	}
	p := s.workers[w]
	if p == nil {
		p = &pooledRates{}
		s.workers[w] = p
	}
	return p
}

// secondsPerBlock and secondsPerToken are w's estimates, the fleet's for a
// worker not observed yet; false when nothing was observed.
func (s *pooledWaitState) secondsPerBlock(w WorkerID) (float64, bool) {
	if p := s.workers[w]; p != nil {
		if v, ok := p.prefill.ratio(); ok {
			return v, true
		}
	}
	return s.fleet.prefill.ratio()
}

func (s *pooledWaitState) secondsPerToken(w WorkerID) (float64, bool) {
	if p := s.workers[w]; p != nil {
		if v, ok := p.decode.ratio(); ok {
			return v, true
		}
	}
	return s.fleet.decode.ratio()
}

// book remembers a kv-pooled booking; prefill is the cost's prefill blocks
// on the chosen worker, admitted whether the admission test let it start
// at once.
func (s *pooledWaitState) book(id string, w WorkerID, now time.Time, prefill float64, admitted bool) {
	if s.own == nil {
		s.own = make(map[string]pooledBooking)
	}
	s.drop(id)
	d := s.decidedOf(w)
	b := pooledBooking{worker: w, booked: now, prefill: prefill, admitted: admitted, fill: d.fill, predTPOT: d.tpot}
	if b.waitingForAdmission() {
		s.waiting++
	}
	s.own[id] = b
}

// firstToken observes the prefill rate: booking to first token over the
// prefill blocks, for a request admitted at once (a wait for KV blocks is
// not prefill time). A time before the booking is ignored.
func (s *pooledWaitState) firstToken(id string, now time.Time) {
	b, ok := s.own[id]
	if !ok || !b.first.IsZero() || now.Before(b.booked) {
		return
	}
	if b.waitingForAdmission() {
		s.waiting--
	}
	b.first = now
	b.sampled = s.samplesOf(b.worker)
	s.own[id] = b
	if b.admitted && b.prefill > 0 {
		secs := now.Sub(b.booked).Seconds()
		s.rates(b.worker).prefill.observe(secs, b.prefill, pooledRateWindow)
		s.fleet.prefill.observe(secs, b.prefill, pooledOutputWindow)
	}
}

// finished observes the decode rate (first token to finish over the output
// tokens of one sequence) and forgets the booking.
func (s *pooledWaitState) finished(id string, outputTokens int, now time.Time) {
	b, ok := s.drop(id)
	if !ok || b.first.IsZero() || outputTokens <= 0 || now.Before(b.first) {
		return
	}
	s.observeTPOT(b, outputTokens, now)
	secs := now.Sub(b.first).Seconds()
	s.rates(b.worker).decode.observe(secs, float64(outputTokens), pooledRateWindow)
	s.fleet.decode.observe(secs, float64(outputTokens), pooledOutputWindow)
}

func (s *pooledWaitState) forget(id string) { s.drop(id) }

// pendingFree is one running request as the expected wait sees it.
type pendingFree struct {
	id    string
	start time.Time // its first token (the booking when unknown)
	freed float64   // blocks its end takes off the admission test
}

// aloneBlocksLocked counts r's prompt blocks that no other request on w
// holds: what r's end frees on w. a.mu must be held.
func (a *ActiveLoad) aloneBlocksLocked(r *activeRequest, w WorkerID) int {
	alone := 0
	for _, h := range r.hashes {
		if i := holderIndex(a.holders[h], w); i >= 0 && a.holders[h][i].n == 1 {
			alone++
		}
	}
	return alone
}

// runningFrees fills dst with w's requests whose decode has started: when
// it started and how many blocks its end takes off kv-pooled's admission
// test (its prompt blocks no other request on w holds, and what the test
// charged for its output: share × reserve per sequence, or with output
// blocks tracked max(booked output blocks, reserve per sequence)).
func (a *ActiveLoad) runningFrees(w WorkerID, reserve, share float64, tracked bool, dst []pendingFree) []pendingFree {
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
		out := share * reserve * float64(r.seqs)
		if tracked {
			out = max(float64(r.out.Blocks), reserve*float64(r.seqs))
		}
		start := r.firstToken
		if start.IsZero() {
			start = r.added
		}
		dst = append(dst, pendingFree{id: r.id, start: start, freed: float64(alone) + out})
	}
	return dst
}

// expectedWait is how long, in seconds from now, a request over blocks
// past w's admission line waits until running requests end and free them:
// each running request ends decode seconds after its start (the observed
// output length at w's observed decode rate; one past it is expected to end
// now), earliest first. When all of them together free too little, the
// wait adds one whole decode (a request not yet running must run through
// it first). It sorts frees.
func expectedWait(frees []pendingFree, over, decode float64, now time.Time) float64 {
	if over <= 0 {
		return 0
	}
	remaining := func(f pendingFree) float64 { return max(0, decode-now.Sub(f.start).Seconds()) }
	slices.SortFunc(frees, func(x, y pendingFree) int {
		if c := cmp.Compare(remaining(x), remaining(y)); c != 0 {
			return c
		}
		return strings.Compare(x.id, y.id)
	})
	freed, last := 0.0, 0.0
	for _, f := range frees {
		freed += f.freed
		last = remaining(f)
		if freed >= over {
			return last
		}
	}
	return last + decode
}

// waitPrice is a wait of wait seconds in the cost's units: the prefill
// blocks the worker would compute meanwhile (seconds per block observed),
// times the prefill load scale the cost gives its prefill term and the
// wait weight.
func waitPrice(wait, secondsPerBlock, scale, weight float64) float64 {
	if wait <= 0 || secondsPerBlock <= 0 {
		return 0
	}
	return weight * scale * wait / secondsPerBlock
}
