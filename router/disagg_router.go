package router

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"
)

// DisaggConfig configures disaggregated routing for one model.
type DisaggConfig struct {
	Mode     DisaggMode
	KV       ModelKV
	Timing   StepTiming
	Topology Topology
	// InterferenceWeight: see DisaggPlanner.
	InterferenceWeight float64
	// TransferRetries is how many times a failed transfer is restarted
	// before the request falls back to aggregated on its decode worker.
	TransferRetries int
}

// Validate checks the configuration.
func (c DisaggConfig) Validate() error {
	pl := DisaggPlanner{Mode: c.Mode, KV: c.KV, Timing: c.Timing, InterferenceWeight: c.InterferenceWeight}
	if err := pl.Validate(); err != nil {
		return err
	}
	if err := c.Topology.Validate(); err != nil {
		return err
	}
	if c.TransferRetries < 0 {
		return fmt.Errorf("transfer retries %d must not be negative: %w", c.TransferRetries, ErrInvalidConfig)
	}
	return nil
}

// Errors of the disaggregated lifecycle.
var (
	ErrUnknownRequest = errors.New("request not in flight")
	ErrWrongStage     = errors.New("request is not in that stage")
)

// DisaggDecision is a plan with the three cost tables it was made from.
type DisaggDecision struct {
	DisaggPlan
	// Prefill is the prefill router's decision (full cost with overlap)
	// over prefill-capable workers; PrefillErr when none could be chosen.
	Prefill    Decision
	PrefillErr error
	// Decode is the decode router's decision (Dynamo's decode parameters:
	// no overlap credit, no prefill tracking) over decode-capable workers.
	Decode Decision
	// Aggregated re-costs Decode's rows with the full cost function: the
	// worker an aggregated request goes to.
	Aggregated Decision
}

// Explain renders the three tables, the two estimates and the choice.
func (d DisaggDecision) Explain() string {
	var b strings.Builder
	if d.PrefillErr == nil && len(d.Prefill.Rows) > 0 {
		b.WriteString("prefill router:\n")
		b.WriteString(d.Prefill.Explain())
	} else if d.PrefillErr != nil {
		fmt.Fprintf(&b, "prefill router: %v\n", d.PrefillErr)
	}
	b.WriteString("decode router:\n")
	b.WriteString(d.Decode.Explain())
	b.WriteString("aggregated (full cost on decode-capable workers):\n")
	b.WriteString(d.Aggregated.Explain())
	b.WriteString(d.DisaggPlan.Explain())
	return b.String()
}

// DisaggStats are counters for metrics.
type DisaggStats struct {
	Aggregated, Disaggregated uint64 // routing decisions by outcome
	// Fallbacks: the mode asked for disaggregation and the request went
	// aggregated at routing time (no prefill worker, no link).
	Fallbacks uint64
	// TransferRetries restarted a failed transfer; TransferFallbacks and
	// PrefillFallbacks moved a request to aggregated after its transfer or
	// its remote prefill failed.
	TransferRetries, TransferFallbacks, PrefillFallbacks uint64
	// Transfers completed, their bytes and their duration as observed
	// (prefill done → transfer done) and as the plan estimated it.
	Transfers               uint64
	TransferBytes           uint64
	TransferSeconds         float64
	TransferEstimateSeconds float64
	// Sums of the estimated TTFT of each side over decisions (the
	// disaggregated sum over decisions where it could be estimated).
	EstimatedAggSeconds    float64
	EstimatedDisaggSeconds float64
	EstimatedDisagg        uint64
	// InFlightTransfers: requests between PrefillDone and TransferDone.
	InFlightTransfers int
}

type disaggStage uint8

const (
	stagePrefill  disaggStage = iota + 1 // prefilling (on the prefill worker, or aggregated on the decode worker)
	stageTransfer                        // KV moving to the decode worker
	stageDecode                          // decoding
)

type disaggReq struct {
	req      Request
	plan     DisaggPlan
	stage    disaggStage
	linkKey  string
	bytes    int64
	attempts int
	xferAt   time.Time
	added    time.Time
}

// DisaggRouter routes one model's requests in two stages: a prefill worker
// by the full cost function with overlap (the prefill router), a decode
// worker by load alone (the decode router, DecodeConfig), and per mode
// decides between that and aggregated serving on a decode-capable worker.
// It books both stages, models the transfer links, and never loses a
// request between the stages: a failed transfer is retried, then served
// aggregated on its decode worker. Safe for concurrent use.
type DisaggRouter struct {
	// mu guards every field below except prefill and decode, which
	// NewDisaggRouter sets once and which lock themselves. Holding it across
	// a whole plan-and-book (or stage change) keeps the two routers'
	// bookings, the request stages and the link models consistent with
	// each other. Lock order: mu, then the routers' own locks.
	mu      sync.Mutex
	base    Config
	cfg     DisaggConfig
	prefill *Router
	decode  *Router
	roles   map[WorkerID]Role
	info    map[WorkerID]WorkerInfo
	links   map[string]*LinkState
	reqs    map[string]*disaggReq
	decodes map[WorkerID]int // sequences decoding, per worker
	rng     *rand.Rand
	stats   DisaggStats
}

// NewDisaggRouter returns a router for base (the aggregated routing
// configuration; the decode router uses DecodeConfig(base)) reading cache
// overlap from index.
func NewDisaggRouter(base Config, index OverlapSource, cfg DisaggConfig, seed uint64) (*DisaggRouter, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	pr, err := New(base, index, seed)
	if err != nil {
		return nil, err
	}
	dr, err := New(DecodeConfig(base), index, seed^0x5bd1e995)
	if err != nil {
		return nil, err
	}
	return &DisaggRouter{
		base: base, cfg: cfg, prefill: pr, decode: dr,
		roles: map[WorkerID]Role{}, info: map[WorkerID]WorkerInfo{},
		links: map[string]*LinkState{}, reqs: map[string]*disaggReq{}, decodes: map[WorkerID]int{},
		rng: rand.New(rand.NewPCG(seed, seed^0x2545f4914f6cdd1d)),
	}, nil
}

// Routers returns the prefill and the decode router (their load views
// feed metrics; their configs the debug endpoint).
func (d *DisaggRouter) Routers() (prefill, decode *Router) { return d.prefill, d.decode }

// Mode returns the disaggregation mode.
func (d *DisaggRouter) Mode() DisaggMode {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.cfg.Mode
}

// SetMode switches the mode (requests in flight keep their plan).
func (d *DisaggRouter) SetMode(m DisaggMode) error {
	if _, err := ParseDisaggMode(string(m)); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.cfg.Mode = m
	return nil
}

// SetBaseConfig replaces the aggregated routing configuration (a replicated
// threshold or knob change); the decode router takes DecodeConfig of it.
func (d *DisaggRouter) SetBaseConfig(base Config) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.prefill.SetConfig(base); err != nil {
		return err
	}
	if err := d.decode.SetConfig(DecodeConfig(base)); err != nil {
		return err
	}
	d.base = base
	return nil
}

// SetWorkers replaces the workers and their roles. Remove an unhealthy
// prefill worker here and requests fall back to aggregated.
func (d *DisaggRouter) SetWorkers(ws []RoleWorker) {
	p, dc := SplitByRole(ws)
	d.mu.Lock()
	defer d.mu.Unlock()
	d.prefill.SetWorkers(p)
	d.decode.SetWorkers(dc)
	clear(d.roles)
	clear(d.info)
	for _, w := range ws {
		role := w.Role
		if role == "" {
			role = RoleBoth
		}
		d.roles[w.ID], d.info[w.ID] = role, w.WorkerInfo
	}
}

// Workers returns the workers and their roles, sorted by id.
func (d *DisaggRouter) Workers() []RoleWorker {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]RoleWorker, 0, len(d.roles))
	for id, r := range d.roles {
		out = append(out, RoleWorker{WorkerInfo: d.info[id], Role: r})
	}
	slices.SortFunc(out, func(a, b RoleWorker) int { return strings.Compare(string(a.ID), string(b.ID)) })
	return out
}

// Stats returns the counters.
func (d *DisaggRouter) Stats() DisaggStats {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.stats
	for _, r := range d.reqs {
		if r.stage == stageTransfer {
			s.InFlightTransfers++
		}
	}
	return s
}

// StageLimits restricts the workers each stage of a plan may choose (a
// session's binding, a pinned prefix's holders): nil = any worker of the
// stage. A stage whose allowed workers are all busy or excluded is
// unavailable: a limited decode stage fails the plan (as a busy bound
// worker answers busy), a limited prefill stage makes it aggregated on the
// decode worker.
type StageLimits struct {
	Prefill, Decode []WorkerID
}

// limit is req with every worker of rt outside only excluded (nil only:
// req unchanged).
func limit(req Request, rt *Router, only []WorkerID) Request {
	if only == nil {
		return req
	}
	ex := slices.Clone(req.Exclude)
	for _, w := range rt.Workers() {
		if !slices.Contains(only, w.ID) && !slices.Contains(ex, w.ID) {
			ex = append(ex, w.ID)
		}
	}
	req.Exclude = ex
	return req
}

// Plan decides without booking (for /debug/route).
func (d *DisaggRouter) Plan(req Request, now time.Time) (DisaggDecision, error) {
	return d.PlanWithin(req, StageLimits{}, now)
}

// PlanWithin is Plan with each stage limited to lim's workers.
func (d *DisaggRouter) PlanWithin(req Request, lim StageLimits, now time.Time) (DisaggDecision, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	dd, _, err := d.planLocked(req, lim, now)
	return dd, err
}

// Route decides and books: the prefill worker's prompt load and the decode
// worker's blocks when disaggregated, the worker's prompt load and blocks
// when aggregated. The caller then reports PrefillDone, TransferDone (or
// TransferFailed) and Free.
func (d *DisaggRouter) Route(req Request, now time.Time) (DisaggDecision, error) {
	return d.RouteWithin(req, StageLimits{}, now)
}

// RouteWithin is Route with each stage limited to lim's workers (a
// session's binding, a pinned prefix's holders).
func (d *DisaggRouter) RouteWithin(req Request, lim StageLimits, now time.Time) (DisaggDecision, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	dd, key, err := d.planLocked(req, lim, now)
	if err != nil {
		return dd, err
	}
	d.freeLocked(req.ID)
	r := &disaggReq{req: req, plan: dd.DisaggPlan, stage: stagePrefill, added: now}
	p := dd.DisaggPlan
	if p.DisaggOK {
		d.stats.EstimatedDisaggSeconds += p.Disagg.Total.Seconds()
		d.stats.EstimatedDisagg++
	}
	d.stats.EstimatedAggSeconds += p.Agg.Total.Seconds()
	if p.Fallback {
		d.stats.Fallbacks++
	}
	active := d.base.ActiveHashes(req)
	if p.Disaggregated {
		d.stats.Disaggregated++
		r.linkKey, r.bytes = key, p.Disagg.TransferBytes
		// The prefill stage is one sequence (one token); the decode stage
		// decodes all of them (n, times the prompts of a batch).
		d.prefill.Load().Add(Booking{ID: req.ID, Worker: p.PrefillWorker, Hashes: active, PrefillTokens: p.Disagg.PrefillTokens, Added: now})
		d.decode.Load().Add(Booking{ID: req.ID, Worker: p.DecodeWorker, Hashes: active, PrefillDone: true, Sequences: req.Sequences, Added: now})
	} else {
		d.stats.Aggregated++
		d.decode.Load().Add(Booking{ID: req.ID, Worker: p.DecodeWorker, Hashes: active, PrefillTokens: p.Agg.PrefillTokens, Sequences: req.Sequences, Added: now})
	}
	d.reqs[req.ID] = r
	return dd, nil
}

// planLocked: d.mu must be held. key is the link state's key of the disaggregated plan.
func (d *DisaggRouter) planLocked(req Request, lim StageLimits, now time.Time) (DisaggDecision, string, error) {
	d.expireLocked(now)
	var dd DisaggDecision
	dec, err := d.decode.Decide(limit(req, d.decode, lim.Decode), now)
	dd.Decode = dec
	if err != nil {
		return dd, "", fmt.Errorf("no decode-capable worker for %s: %w", req.ID, err)
	}
	preq := limit(req, d.prefill, lim.Prefill)
	pdec, perr := d.prefill.Decide(preq, now)
	if perr == nil && pdec.Worker == dec.Worker {
		// A "both" worker chosen for both stages: prefill elsewhere or not
		// at all (aggregated on it is the other plan).
		req2 := preq
		req2.Exclude = append(slices.Clone(preq.Exclude), dec.Worker)
		pdec, perr = d.prefill.Decide(req2, now)
	}
	dd.Prefill, dd.PrefillErr = pdec, perr
	dd.Aggregated = d.aggregatedLocked(req, dec)

	bs := d.base.BlockSize
	in := PlanInput{Tokens: req.Tokens}
	in.Decode = d.planWorkerLocked(dec, dec.Worker, bs, req.Tokens, now)
	in.Aggregated = d.planWorkerLocked(dd.Aggregated, dd.Aggregated.Worker, bs, req.Tokens, now)
	key := ""
	if perr != nil {
		in.PrefillUnavailable = perr.Error()
	} else {
		in.Prefill = d.planWorkerLocked(pdec, pdec.Worker, bs, req.Tokens, now)
		if name, link, ok := d.cfg.Topology.LinkFor(pdec.Worker, dec.Worker); ok {
			key = name
			if link.PerPair {
				key = name + "\x00" + string(pdec.Worker) + "\x00" + string(dec.Worker)
			}
			ls := d.linkLocked(key, link)
			ls.Advance(now) // completions the router has not been told of stay modelled as done
			var ahead []int64
			for _, r := range d.reqs {
				if r.plan.Disaggregated && r.stage == stagePrefill && r.linkKey == key {
					ahead = append(ahead, r.bytes)
				}
			}
			slices.Sort(ahead)
			in.Link = &PlanLink{Name: name, Link: link, InFlight: ls.InFlight(),
				Estimate: func(bytes int64, after time.Duration) time.Duration {
					return ls.Estimate(now, bytes, after, ahead)
				}}
		}
	}
	pl := DisaggPlanner{Mode: d.cfg.Mode, KV: d.cfg.KV, Timing: d.cfg.Timing, InterferenceWeight: d.cfg.InterferenceWeight}
	plan, err := pl.Plan(in)
	dd.DisaggPlan = plan
	if err != nil {
		return dd, "", err
	}
	if !plan.Disaggregated {
		key = ""
	}
	return dd, key, nil
}

// aggregatedLocked re-costs the decode router's rows with the full cost
// function (overlap credit, prefill tracking) and picks as --disagg off
// would route. d.mu must be held.
func (d *DisaggRouter) aggregatedLocked(req Request, dec Decision) Decision {
	cfg := d.base
	out := Decision{Mode: cfg.Mode, Scale: cfg.PrefillLoadScale, Rows: slices.Clone(dec.Rows)}
	var cands []WorkerCost
	var idx []int
	for i := range out.Rows {
		r := &out.Rows[i]
		if d.roles[r.Worker] == RoleBoth {
			// Its disaggregated prefills are booked on the prefill router.
			r.ActivePrefillTokens += d.prefill.Load().Load(r.Worker).ActivePrefillTokens
		}
		load := WorkerLoad{ActivePrefillTokens: r.ActivePrefillTokens, ActiveBlocks: r.ActiveBlocks, Requests: r.ActiveRequests}
		r.PrefillBlocks, r.DecodeBlocks, r.Cost = computeCost(&cfg, costInput{isl: req.Tokens, overlap: r.Overlap, load: load, newBlocks: r.NewBlocks})
		if !r.Busy {
			cands = append(cands, *r)
			idx = append(idx, i)
		}
	}
	if len(cands) == 0 {
		out.Worker, out.Overlap = dec.Worker, dec.Overlap
		return out
	}
	var pick int
	switch cfg.Mode {
	case ModeKV, ModeKVApprox, ModeKVPooled, ModeLoadAware:
		pick = idx[pickByCost(cands, cfg.Temperature, d.rng)]
	default:
		// round-robin, random, least-loaded: the decode router already
		// chose by that policy.
		pick = slices.IndexFunc(out.Rows, func(r WorkerCost) bool { return r.Worker == dec.Worker })
	}
	out.Worker, out.Overlap = out.Rows[pick].Worker, out.Rows[pick].Overlap
	return out
}

// planWorkerLocked describes worker w from its row in dec. d.mu must be held.
func (d *DisaggRouter) planWorkerLocked(dec Decision, w WorkerID, bs, tokens int, now time.Time) *PlanWorker {
	pw := &PlanWorker{Worker: w}
	for _, r := range dec.Rows {
		if r.Worker == w {
			pw.CachedTokens = min(r.Overlap*bs, tokens)
			pw.QueuedPrefillTokens = r.ActivePrefillTokens
			if tb := d.info[w].TotalBlocks; tb > 0 {
				pw.Fill = min(float64(r.ActiveBlocks)/float64(tb), 1)
			}
			break
		}
	}
	for _, r := range d.reqs {
		if !r.plan.Disaggregated || r.plan.DecodeWorker != w {
			continue
		}
		e := r.plan.Disagg
		switch r.stage {
		case stagePrefill:
			pw.IncomingKV = append(pw.IncomingKV, r.added.Add(e.QueueWait+e.Prefill+e.Transfer).Sub(now))
		case stageTransfer:
			pw.IncomingKV = append(pw.IncomingKV, r.xferAt.Add(e.Transfer).Sub(now))
		}
	}
	slices.Sort(pw.IncomingKV)
	switch d.roles[w] {
	case RoleBoth:
		// Its load is split between the two routers.
		pw.QueuedPrefillTokens = d.prefill.Load().Load(w).ActivePrefillTokens + d.decode.Load().Load(w).ActivePrefillTokens
		pw.DecodeSeqs = d.decodes[w]
	case RoleDecode:
		pw.DecodeSeqs = d.decodes[w]
	case RolePrefill:
		pw.Fill = 0
	}
	return pw
}

// linkLocked returns the link state under key, made anew when there is
// none or its link is no longer l.
// d.mu must be held.
func (d *DisaggRouter) linkLocked(key string, l Link) *LinkState {
	ls := d.links[key]
	if ls == nil || ls.Link() != l {
		ls = NewLinkState(l)
		d.links[key] = ls
	}
	return ls
}

// PrefillDone records that the prefill stage ended at now: disaggregated,
// the prefill worker's prompt load is released and the transfer starts;
// aggregated, this is the first token. The plan is returned.
func (d *DisaggRouter) PrefillDone(id string, now time.Time) (DisaggPlan, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	r := d.reqs[id]
	if r == nil {
		return DisaggPlan{}, fmt.Errorf("prefill done for %s: %w", id, ErrUnknownRequest)
	}
	if r.stage != stagePrefill {
		return r.plan, fmt.Errorf("prefill done for %s: %w", id, ErrWrongStage)
	}
	if r.plan.Disaggregated {
		d.prefill.PrefillDone(id)
		r.stage, r.xferAt = stageTransfer, now
		if ls := d.links[r.linkKey]; ls != nil {
			ls.Start(id, r.bytes, now)
		}
		return r.plan, nil
	}
	d.decode.PrefillDone(id)
	r.stage = stageDecode
	d.decodes[r.plan.DecodeWorker]++
	return r.plan, nil
}

// TransferDone records that the KV reached the decode worker: the prefill
// worker's booking is freed and the request decodes.
func (d *DisaggRouter) TransferDone(id string, now time.Time) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	r := d.reqs[id]
	if r == nil {
		return fmt.Errorf("transfer done for %s: %w", id, ErrUnknownRequest)
	}
	if r.stage != stageTransfer {
		return fmt.Errorf("transfer done for %s: %w", id, ErrWrongStage)
	}
	if ls := d.links[r.linkKey]; ls != nil {
		ls.Cancel(id, now)
	}
	d.prefill.Free(id)
	r.stage = stageDecode
	d.decodes[r.plan.DecodeWorker]++
	d.stats.Transfers++
	d.stats.TransferBytes += uint64(r.bytes)
	d.stats.TransferSeconds += now.Sub(r.xferAt).Seconds()
	d.stats.TransferEstimateSeconds += r.plan.Disagg.Transfer.Seconds()
	return nil
}

// RecoveryAction says what the caller must do after a failure.
type RecoveryAction uint8

// Recovery actions.
const (
	// RecoverRetryTransfer: start the KV transfer again (same workers).
	RecoverRetryTransfer RecoveryAction = iota + 1
	// RecoverAggregate: send the whole request to Recovery.Worker, which
	// prefills it itself (its decode worker; the booking has been moved).
	RecoverAggregate
)

func (a RecoveryAction) String() string {
	switch a {
	case RecoverRetryTransfer:
		return "retry-transfer"
	case RecoverAggregate:
		return "aggregate"
	}
	return fmt.Sprintf("action(%d)", uint8(a))
}

// Recovery is the way forward for a request whose stage failed. Reason is
// meant for a warning log line.
type Recovery struct {
	Action  RecoveryAction
	Worker  WorkerID
	Attempt int
	Reason  string
}

// TransferFailed handles a failed KV transfer: it is restarted up to
// TransferRetries times, then the request is served aggregated on its
// decode worker (prompt recomputed there). The request is never dropped.
func (d *DisaggRouter) TransferFailed(id string, now time.Time, cause error) (Recovery, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	r := d.reqs[id]
	if r == nil {
		return Recovery{}, fmt.Errorf("transfer failed for %s: %w", id, ErrUnknownRequest)
	}
	if r.stage != stageTransfer {
		return Recovery{}, fmt.Errorf("transfer failed for %s: %w", id, ErrWrongStage)
	}
	r.attempts++
	ls := d.links[r.linkKey]
	if r.attempts <= d.cfg.TransferRetries {
		d.stats.TransferRetries++
		if ls != nil {
			ls.Start(id, r.bytes, now)
		}
		r.xferAt = now
		return Recovery{Action: RecoverRetryTransfer, Worker: r.plan.DecodeWorker, Attempt: r.attempts,
			Reason: fmt.Sprintf("KV transfer of %s from %s to %s failed (%v): retry %d of %d",
				id, r.plan.PrefillWorker, r.plan.DecodeWorker, cause, r.attempts, d.cfg.TransferRetries)}, nil
	}
	if ls != nil {
		ls.Cancel(id, now)
	}
	d.stats.TransferFallbacks++
	reason := fmt.Sprintf("KV transfer of %s from %s to %s failed %d times (last: %v): serving it aggregated on %s",
		id, r.plan.PrefillWorker, r.plan.DecodeWorker, r.attempts, cause, r.plan.DecodeWorker)
	d.toAggregatedLocked(r, now, reason)
	return Recovery{Action: RecoverAggregate, Worker: r.plan.DecodeWorker, Attempt: r.attempts, Reason: reason}, nil
}

// PrefillFailed handles a failed remote prefill (the prefill worker died or
// refused): the request is served aggregated on its decode worker.
func (d *DisaggRouter) PrefillFailed(id string, now time.Time, cause error) (Recovery, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	r := d.reqs[id]
	if r == nil {
		return Recovery{}, fmt.Errorf("prefill failed for %s: %w", id, ErrUnknownRequest)
	}
	if r.stage != stagePrefill || !r.plan.Disaggregated {
		return Recovery{}, fmt.Errorf("prefill failed for %s (not a remote prefill): %w", id, ErrWrongStage)
	}
	d.stats.PrefillFallbacks++
	reason := fmt.Sprintf("remote prefill of %s on %s failed (%v): serving it aggregated on %s",
		id, r.plan.PrefillWorker, cause, r.plan.DecodeWorker)
	d.toAggregatedLocked(r, now, reason)
	return Recovery{Action: RecoverAggregate, Worker: r.plan.DecodeWorker, Reason: reason}, nil
}

// toAggregatedLocked moves a disaggregated request to its decode worker,
// which will prefill the part of the prompt it does not hold.
// d.mu must be held.
func (d *DisaggRouter) toAggregatedLocked(r *disaggReq, now time.Time, reason string) {
	d.prefill.Free(r.req.ID)
	p := &r.plan
	p.Disaggregated, p.Fallback, p.Reason = false, true, reason
	p.Agg = TTFTEstimate{Worker: p.DecodeWorker, PrefillTokens: uncached(r.req.Tokens, r.req.Tokens-p.Disagg.TransferTokens)}
	p.PrefillWorker = ""
	d.decode.Load().Add(Booking{ID: r.req.ID, Worker: p.DecodeWorker, Hashes: d.base.ActiveHashes(r.req), PrefillTokens: p.Agg.PrefillTokens,
		Sequences: r.req.Sequences, Added: now})
	r.stage, r.linkKey, r.bytes = stagePrefill, "", 0
}

// Free ends a request (finished, failed or cancelled) and releases both
// bookings and its transfer. Unknown ids are ignored.
func (d *DisaggRouter) Free(id string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.freeLocked(id)
}

// freeLocked: d.mu must be held.
func (d *DisaggRouter) freeLocked(id string) {
	r := d.reqs[id]
	if r == nil {
		return
	}
	if r.stage == stageTransfer {
		if ls := d.links[r.linkKey]; ls != nil {
			ls.Cancel(id, ls.now)
		}
	}
	if r.stage == stageDecode {
		w := r.plan.DecodeWorker
		if d.decodes[w]--; d.decodes[w] <= 0 {
			delete(d.decodes, w)
		}
	}
	d.prefill.Free(id)
	d.decode.Free(id)
	delete(d.reqs, id)
}

// expireLocked drops requests older than the request expiry: a lost Free
// must not pin a booking or a modelled transfer forever. d.mu must be held.
func (d *DisaggRouter) expireLocked(now time.Time) {
	exp := d.base.RequestExpiry
	if exp <= 0 {
		return
	}
	var gone []string
	for id, r := range d.reqs {
		if now.Sub(r.added) > exp {
			gone = append(gone, id)
		}
	}
	for _, id := range gone {
		d.freeLocked(id)
	}
}

// InFlight is the number of requests the router tracks.
func (d *DisaggRouter) InFlight() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.reqs)
}
