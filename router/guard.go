package router

import (
	"fmt"
	"math"
	"slices"
	"time"
)

// The latency guard (api/tenant's Config.LatencyGuard, kvrouter serve
// --tenant-latency-guard): which workers a request of a tenant over its fair
// share must not be placed on, because a fresh request there is predicted to
// get its first token, or its next tokens, more than a factor F slower than
// on an idle worker. The fair queue orders what a router releases and the
// engine serves what it was given; a tenant over its share that keeps every
// worker saturated makes the others' requests ride its steps (its decode
// batch at a full cache, its prefill chunks), whatever the order. The guard
// keeps that capacity idle on purpose, an operator's trade of throughput for
// the other tenants' latency.
//
// The prediction is kv-pooled's SLO rule's (slo.go), over the same load
// view and the same learned rates, judged against its value on an idle
// worker instead of an absolute limit:
//
//	TTFT_w = prefill_w · seconds per prefill block_w + expected KV wait_w
//	         idle: the request's own prefill blocks (no queue, no wait)
//	TPOT_w = the TPOT line at w's fill before the request (slo.go)
//	         idle: the line at fill 0
//
// The TTFT ratio needs no rate while the request would not wait for KV
// blocks (the rate cancels); a worker where it would wait and the rates to
// price that wait are not observed yet is judged over the factor. The TPOT
// ratio is judged once the line is fitted (two requests finished at
// different fills, Config.LearnLatency teaching it in every mode) and its
// value at fill 0 is positive; before that the TTFT ratio alone judges.
// An idle worker is never over the factor: both ratios are 1 there.

// ValidateLatencyGuard refuses a guard factor that is not 0 (off) or a
// finite number of at least 1 (below 1 even an idle worker would be over it).
func ValidateLatencyGuard(f float64) error {
	if f == 0 {
		return nil
	}
	if !finite(f) || f < 1 {
		return fmt.Errorf("latency guard factor %v: want 0 (off) or a finite factor of at least 1 (a fresh request's predicted TTFT and TPOT on a worker, over their values on an idle worker): %w", f, ErrInvalidConfig)
	}
	return nil
}

// GuardRatio is one worker's latency-guard prediction: a fresh request's
// predicted TTFT and TPOT there, each over its value on an idle worker (NaN
// when not predicted).
type GuardRatio struct {
	Worker WorkerID
	TTFT   float64
	TPOT   float64
	// Idle is the TTFT ratio's denominator: the request's own prefill
	// blocks there on an idle worker (its prompt less the prefix that
	// worker caches). TTFT·Idle is the predicted TTFT in prefill blocks'
	// worth of time, comparable between workers (FirstTokenOrder).
	Idle float64
}

// Over reports whether the worker is over factor: its TTFT ratio is (a NaN
// TTFT ratio, a KV wait not priced yet, counts as over), or its TPOT ratio
// is when predicted.
func (g GuardRatio) Over(factor float64) bool {
	return !(g.TTFT <= factor) || g.TPOT > factor
}

// OverFirstToken reports whether the worker's TTFT ratio is over factor
// (NaN counts as over), whatever its TPOT ratio: FirstTokenGuard's test.
func (g GuardRatio) OverFirstToken(factor float64) bool {
	return !(g.TTFT <= factor)
}

// LatencyGuard appends to dst the workers (among those req does not
// exclude) on which a fresh request like req is predicted over factor
// (GuardRatio.Over): a request of a tenant over its share goes to none of
// them. hold reports that every worker not excluded is one (the request
// waits in the queue); with no worker left to judge it is false (routing
// fails on its own). A factor of 0 is off: nothing.
func (r *Router) LatencyGuard(req Request, factor float64, now time.Time, dst []WorkerID) (out []WorkerID, hold bool) {
	return r.latencyGuard(req, factor, now, dst, GuardRatio.Over)
}

// FirstTokenGuard is LatencyGuard judging the TTFT ratio alone
// (GuardRatio.OverFirstToken). Tenant isolation's unreserved workers are
// judged so (api/tenant, Ledger.Isolation): the under-share tenants' requests go
// there only when one is the quickest to a first token (FirstTokenOrder),
// so what must stay short there is the prefill queue an over-share
// tenant's request leaves in front of them; the TPOT line, fitted over
// the fleet, reads any fill above zero as over at a factor of 1, and held
// the over-share tenant to one request per worker, running or not
// (kvbench sim, 2026-12-06: its throughput while both sent 3–4 requests/s
// against 14–18 judged on the TTFT alone, for no lower steady tail).
func (r *Router) FirstTokenGuard(req Request, factor float64, now time.Time, dst []WorkerID) (out []WorkerID, hold bool) {
	return r.latencyGuard(req, factor, now, dst, GuardRatio.OverFirstToken)
}

func (r *Router) latencyGuard(req Request, factor float64, now time.Time, dst []WorkerID, over func(GuardRatio, float64) bool) (out []WorkerID, hold bool) {
	out = dst
	if factor <= 0 {
		return out, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	ratios := r.guardRatiosLocked(req, now)
	for _, g := range ratios {
		if over(g, factor) {
			out = append(out, g.Worker)
		}
	}
	return out, len(ratios) > 0 && len(out)-len(dst) == len(ratios)
}

// GuardRatios is every worker's (not excluded by req) latency-guard
// prediction for a fresh request like req (tests and diagnostics).
func (r *Router) GuardRatios(req Request, now time.Time) []GuardRatio {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.guardRatiosLocked(req, now))
}

// guardRatiosLocked computes the predictions into r.guard. r.mu must be held.
func (r *Router) guardRatiosLocked(req Request, now time.Time) []GuardRatio {
	r.guard = r.guard[:0]
	if len(r.workers) == 0 {
		return r.guard
	}
	r.loads = r.load.RowsCached(r.workers, r.pos, r.activeHashesLocked(req), r.loads, &r.loadRows)
	r.overlapsLocked(req.Hashes)
	cands := r.cands[:0]
	for i, w := range r.workers {
		if !slices.Contains(req.Exclude, w.ID) {
			cands = append(cands, i)
		}
	}
	r.cands = cands
	if len(cands) == 0 {
		return r.guard
	}
	ps := &r.pooled
	r.pooledOverlapsLocked(req, cands)
	reserve := r.pooledReserveLocked()
	r.pooledAdmissionLocked(cands, reserve)
	known := r.capacitiesKnownLocked(cands)
	idleTPOT, line := r.wait.tpot.predict(0)
	line = line && known && idleTPOT > 0
	plan := newCostPlan(&r.cfg, req.Tokens)
	bs := float64(r.cfg.BlockSize)
	for j, i := range cands {
		w := r.workers[i].ID
		l := r.loads[i]
		// Idle: the same prompt, the same cached prefix, no queue.
		idle := max(plan.terms(ps.eff[i], 0, 0, &WorkerLoad{}, 0, 0).prefill, 1)
		g := GuardRatio{Worker: w, TTFT: math.NaN(), TPOT: math.NaN(), Idle: idle}
		prefill := max(ps.terms[i].prefill, idle)
		total := float64(r.workers[i].TotalBlocks)
		if total > 0 && (float64(l.ActiveBlocks+l.NewBlocks) > total || ps.over[j] > 0) {
			// The request would wait for KV blocks: priced as the SLO
			// rule prices it, when the rates are observed.
			spb, okB := r.wait.secondsPerBlock(w)
			spt, okT := r.wait.secondsPerToken(w)
			if okB && okT && spb > 0 && r.outputs.n > 0 {
				ps.running = r.load.runningPrompts(w, ps.running)
				wait := engineWait(ps.running, float64(l.ActiveBlocks), float64(l.NewBlocks), total, r.outputs.mean*spt, spt, bs, now)
				g.TTFT = (prefill*spb + wait) / (idle * spb)
			}
		} else {
			g.TTFT = prefill / idle // the rate cancels
		}
		if line {
			if t, ok := r.wait.tpot.predict(ps.held[j]); ok {
				g.TPOT = t / idleTPOT
			}
		}
		r.guard = append(r.guard, g)
	}
	return r.guard
}

// guardLearnLocked, with Config.LearnLatency, makes the booking of req on
// d.Worker teach the SLO rule's rates whatever the mode: the prefill rate
// (a request admitted at once), the decode rate and the TPOT line against
// the fill at booking, with every worker's fill sampled as kv-pooled's SLO
// rule samples it. kv-pooled books its own requests (and, with an SLO,
// fills and samples them); this adds what is missing. r.mu must be held,
// d just decided for req.
func (r *Router) guardLearnLocked(req Request, d Decision, now time.Time) {
	if !r.cfg.LearnLatency {
		return
	}
	sloSampled := r.cfg.Mode == ModeKVPooled && r.cfg.SLO.Set()
	if sloSampled {
		return
	}
	cands := r.cands[:0]
	for i := range r.workers {
		cands = append(cands, i)
	}
	r.cands = cands
	ps := &r.pooled
	r.pooledAdmissionLocked(cands, r.pooledReserveLocked())
	if !r.capacitiesKnownLocked(cands) {
		return
	}
	chosen := r.pos[d.Worker]
	for _, i := range cands {
		r.wait.sample(r.workers[i].ID, ps.held[i])
	}
	r.wait.decided = append(r.wait.decided[:0], sloDecided{worker: d.Worker, fill: ps.fill[chosen], tpot: math.NaN()})
	if r.cfg.Mode == ModeKVPooled {
		// Booked already, its fill unknown without an SLO: set it.
		if b, ok := r.wait.own[req.ID]; ok {
			b.fill = ps.fill[chosen]
			r.wait.own[req.ID] = b
		}
		return
	}
	r.wait.book(req.ID, d.Worker, now, d.Rows[chosen].PrefillBlocks, ps.over[chosen] <= 0)
}
