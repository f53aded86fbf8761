// Package disagg is kvbench disagg's simulator: prefill workers, decode
// workers and a shared KV transfer link in virtual time, routed by the real
// router.DisaggRouter in mode off, always or auto.
//
// Workers are step-level models of a vLLM engine (the engine package's
// timing profile, chunked prefill under a per-step token budget, FCFS
// admission while the KV cache has room, no preemption) with an unbounded
// prefix cache. A prefill worker runs a request's prompt, holds its KV
// until the transfer ends, and hands it to the link; the link is
// router.LinkState (fair share among concurrent transfers); the decode
// worker admits the request when its KV has arrived and produces the first
// token at the end of its next step. Aggregated requests prefill and decode
// on one decode worker, their prefill steps mixed with its decodes.
package disagg

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/stats"
	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/router"
)

// epoch anchors virtual time for the router, which speaks time.Time.
var epoch = time.Date(2026, 10, 7, 0, 0, 0, 0, time.UTC)

// Config is one simulation.
type Config struct {
	Mode    router.DisaggMode
	Profile engine.Profile
	Link    router.Link
	KV      router.ModelKV

	PromptTokens, OutputTokens int
	Requests, Concurrency      int

	PrefillWorkers, DecodeWorkers int
	MaxBatchedTokens, MaxRunning  int
	KVCapacityTokens              int // per worker
	BlockSize                     int

	// PrefixGroups > 0: request i starts with group i mod PrefixGroups's
	// PrefixTokens-token prefix (prefix reuse); 0 = unique prompts.
	PrefixGroups, PrefixTokens int

	// FailEvery > 0: every FailEvery-th transfer completion fails
	// (retried TransferRetries times, then served aggregated).
	FailEvery       int
	TransferRetries int

	InterferenceWeight float64
	// ThinkTime > 0: each client waits an exponentially distributed time of
	// this mean before each request (the first one too), which breaks the
	// lockstep of a closed loop; 0 = send at once.
	ThinkTime time.Duration
	Seed      uint64
}

// Validate checks the configuration.
func (c *Config) Validate() error {
	switch {
	case c.PromptTokens < 1 || c.OutputTokens < 1:
		return fmt.Errorf("prompt %d and output %d tokens must be positive", c.PromptTokens, c.OutputTokens)
	case c.Requests < 1 || c.Concurrency < 1:
		return fmt.Errorf("requests %d and concurrency %d must be positive", c.Requests, c.Concurrency)
	case c.PrefillWorkers < 0 || c.DecodeWorkers < 1:
		return fmt.Errorf("need at least one decode worker and no negative prefill workers (%d, %d)", c.PrefillWorkers, c.DecodeWorkers)
	case c.MaxBatchedTokens < 1 || c.MaxRunning < 1 || c.BlockSize < 1:
		return fmt.Errorf("max batched tokens %d, max running %d and block size %d must be positive", c.MaxBatchedTokens, c.MaxRunning, c.BlockSize)
	case c.PromptTokens+c.OutputTokens > c.KVCapacityTokens:
		return fmt.Errorf("a request needs %d KV tokens, a worker holds %d", c.PromptTokens+c.OutputTokens, c.KVCapacityTokens)
	case c.PrefixGroups < 0 || c.PrefixTokens < 0 || c.PrefixTokens > c.PromptTokens:
		return fmt.Errorf("prefix groups %d and prefix tokens %d (of %d) out of range", c.PrefixGroups, c.PrefixTokens, c.PromptTokens)
	case c.ThinkTime < 0:
		return fmt.Errorf("think time %v must not be negative", c.ThinkTime)
	case c.FailEvery < 0 || c.TransferRetries < 0:
		return fmt.Errorf("fail-every %d and transfer retries %d must not be negative", c.FailEvery, c.TransferRetries)
	}
	if err := c.Link.Validate(); err != nil {
		return err
	}
	return c.KV.Validate()
}

// Result is one simulation's figures.
type Result struct {
	Mode      string          `json:"mode"`
	Requests  int             `json:"requests"`
	Completed int             `json:"completed"`
	TTFT      stats.Quantiles `json:"ttft_ms"`
	E2E       stats.Quantiles `json:"e2e_ms"`
	// ITL is each request's mean time between output tokens.
	ITL stats.Quantiles `json:"itl_ms"`
	// Routing outcomes, as the router counted them.
	Disaggregated     int `json:"disaggregated"`
	Aggregated        int `json:"aggregated"`
	Fallbacks         int `json:"fallbacks"`
	TransferRetries   int `json:"transfer_retries"`
	TransferFallbacks int `json:"transfer_fallbacks"`
	// Transfers as the link saw them: duration from start to last byte and
	// each transfer's bytes ÷ duration.
	Transfers        int             `json:"transfers"`
	TransferMs       stats.Quantiles `json:"transfer_ms"`
	TransferMBpsMean float64         `json:"transfer_mbps_mean"`
	PeakTransfers    int             `json:"peak_concurrent_transfers"`
	// EstimateErrP50 is the median of |estimated − actual TTFT| ÷ actual
	// over the chosen plans.
	EstimateErrP50 float64 `json:"estimate_error_p50"`
	VirtualSeconds float64 `json:"virtual_seconds"`
}

type request struct {
	id       string
	hashes   []uint64
	arrival  time.Duration
	first    time.Duration
	finish   time.Duration
	estimate time.Duration
	plan     router.DisaggPlan
	prefillW *worker
	decodeW  *worker
	bytes    int64
}

type seq struct {
	r         *request
	prefill   int // tokens to compute here
	computed  int
	decoding  bool
	out       int // tokens generated here
	target    int // 0: prefill only (remote prefill)
	kv        int // KV tokens reserved here
	firstHere bool
}

type item struct {
	s *seq
	n int
}

type worker struct {
	id      router.WorkerID
	role    router.Role
	running []*seq
	waiting []*seq
	busy    bool
	end     time.Duration
	batch   []item
	kvUsed  int
	held    map[string]int // remote prefills' KV awaiting transfer
	cache   map[uint64]struct{}
}

func (w *worker) cachedTokens(hashes []uint64, bs, prompt int) int {
	n := 0
	for _, h := range hashes {
		if _, ok := w.cache[h]; !ok {
			break
		}
		n++
	}
	return min(n*bs, prompt-1)
}

type simulation struct {
	cfg       Config
	rt        *router.DisaggRouter
	workers   []*worker
	byID      map[router.WorkerID]*worker
	link      *router.LinkState
	reqs      map[string]*request
	done      []*request
	next      int
	now       time.Duration
	xferDone  int
	xferMs    []float64
	xferMBps  []float64
	estErr    []float64
	pending   int             // clients whose request ended at this instant
	thinking  []time.Duration // think time: when waiting clients send, sorted
	rng       *rand.Rand
	prefixSet [][]uint64
}

// FindMatches makes the workers' caches the router's overlap source (KV
// events applied at once).
func (s *simulation) FindMatches(seq []uint64, dst []router.Overlap) []router.Overlap {
	dst = dst[:0]
	if len(seq) == 0 {
		return dst
	}
	for _, w := range s.workers {
		n := 0
		for _, h := range seq {
			if _, ok := w.cache[h]; !ok {
				break
			}
			n++
		}
		if n > 0 {
			dst = append(dst, router.Overlap{Worker: w.id, Blocks: n})
		}
	}
	return dst
}

// Run simulates cfg and returns its figures.
func Run(cfg Config) (Result, error) {
	if err := cfg.Validate(); err != nil {
		return Result{}, err
	}
	s := &simulation{cfg: cfg, byID: map[router.WorkerID]*worker{}, reqs: map[string]*request{}, link: router.NewLinkState(cfg.Link)}
	base := router.DefaultConfig()
	base.BlockSize = cfg.BlockSize
	base.RequestExpiry = 0 // virtual hours of queueing on a slow link must not expire bookings
	prof := cfg.Profile
	dc := router.DisaggConfig{
		Mode: cfg.Mode, KV: cfg.KV,
		Timing:             router.StepTiming{PrefillMs: prof.PrefillMs, DecodeMs: prof.DecodeMs, StepMs: prof.StepMs, MaxBatchedTokens: cfg.MaxBatchedTokens},
		Topology:           router.SingleLink("link", cfg.Link),
		InterferenceWeight: cfg.InterferenceWeight,
		TransferRetries:    cfg.TransferRetries,
	}
	rt, err := router.NewDisaggRouter(base, s, dc, cfg.Seed)
	if err != nil {
		return Result{}, err
	}
	s.rt = rt
	var ws []router.RoleWorker
	add := func(name string, role router.Role) {
		w := &worker{id: router.WorkerID(name), role: role, held: map[string]int{}, cache: map[uint64]struct{}{}}
		s.workers = append(s.workers, w)
		s.byID[w.id] = w
		ws = append(ws, router.RoleWorker{WorkerInfo: router.WorkerInfo{ID: w.id, TotalBlocks: cfg.KVCapacityTokens / cfg.BlockSize, MaxBatchedTokens: cfg.MaxBatchedTokens}, Role: role})
	}
	for i := range cfg.PrefillWorkers {
		add(fmt.Sprintf("prefill-%d", i), router.RolePrefill)
	}
	for i := range cfg.DecodeWorkers {
		add(fmt.Sprintf("decode-%d", i), router.RoleDecode)
	}
	rt.SetWorkers(ws)
	for g := range cfg.PrefixGroups {
		s.prefixSet = append(s.prefixSet, chain(uint64(g)+1<<40, cfg.Seed, cfg.PrefixTokens/cfg.BlockSize, 0, nil))
	}
	s.rng = rand.New(rand.NewPCG(cfg.Seed, 0x6469736167677365))
	s.pending = min(cfg.Concurrency, cfg.Requests)
	if err := s.issuePending(); err != nil {
		return Result{}, err
	}
	s.startIdle()
	for len(s.done) < cfg.Requests {
		t, ok := s.nextEvent()
		if !ok {
			return Result{}, fmt.Errorf("simulation stalled at %v with %d of %d requests done", s.now, len(s.done), cfg.Requests)
		}
		s.now = t
		for _, d := range s.link.Advance(epoch.Add(t)) {
			if err := s.transferDone(d); err != nil {
				return Result{}, err
			}
		}
		for _, w := range s.workers {
			if w.busy && w.end == t {
				if err := s.finishStep(w); err != nil {
					return Result{}, err
				}
			}
		}
		if err := s.issuePending(); err != nil {
			return Result{}, err
		}
		for len(s.thinking) > 0 && s.thinking[0] <= t {
			s.thinking = s.thinking[1:]
			if err := s.issue(); err != nil {
				return Result{}, err
			}
		}
		s.startIdle()
	}
	return s.result(), nil
}

// chain returns n chained block hashes: a shared prefix (salt) or a
// request's unique blocks continuing from parent.
func chain(id, seed uint64, n int, parent uint64, dst []uint64) []uint64 {
	for j := range n {
		parent = router.ChainHash(parent, id*0x9e3779b97f4a7c15^seed<<20^uint64(j)*0xc2b2ae3d27d4eb4f)
		dst = append(dst, parent)
	}
	return dst
}

func (s *simulation) nextEvent() (time.Duration, bool) {
	t, ok := time.Duration(math.MaxInt64), false
	for _, w := range s.workers {
		if w.busy && w.end < t {
			t, ok = w.end, true
		}
	}
	if len(s.thinking) > 0 && s.thinking[0] < t {
		t, ok = s.thinking[0], true
	}
	if at, has := s.link.NextEvent(); has {
		if d := at.Sub(epoch); d < t {
			t, ok = d, true
		}
	}
	return max(t, s.now), ok
}

// issue sends the next request, if any.
func (s *simulation) issue() error {
	if s.next >= s.cfg.Requests {
		return nil
	}
	i := s.next
	s.next++
	cfg := &s.cfg
	r := &request{id: fmt.Sprintf("r%06d", i), arrival: s.now}
	nblocks := cfg.PromptTokens / cfg.BlockSize
	r.hashes = make([]uint64, 0, nblocks)
	var parent uint64
	if cfg.PrefixGroups > 0 {
		r.hashes = append(r.hashes, s.prefixSet[i%cfg.PrefixGroups]...)
		if len(r.hashes) > 0 {
			parent = r.hashes[len(r.hashes)-1]
		}
	}
	r.hashes = chain(uint64(i)+1, cfg.Seed, nblocks-len(r.hashes), parent, r.hashes)
	dd, err := s.rt.Route(router.Request{ID: r.id, Hashes: r.hashes, Tokens: cfg.PromptTokens}, epoch.Add(s.now))
	if err != nil {
		return fmt.Errorf("route %s: %w", r.id, err)
	}
	s.reqs[r.id] = r
	r.plan, r.estimate = dd.DisaggPlan, dd.Estimate
	if dd.Disaggregated {
		r.prefillW, r.decodeW, r.bytes = s.byID[dd.PrefillWorker], s.byID[dd.DecodeWorker], dd.Disagg.TransferBytes
		p := r.prefillW
		p.waiting = append(p.waiting, &seq{r: r, prefill: cfg.PromptTokens - p.cachedTokens(r.hashes, cfg.BlockSize, cfg.PromptTokens), kv: cfg.PromptTokens})
		return nil
	}
	r.decodeW = s.byID[dd.DecodeWorker]
	s.submitAggregated(r)
	return nil
}

func (s *simulation) submitAggregated(r *request) {
	cfg := &s.cfg
	w := r.decodeW
	w.waiting = append(w.waiting, &seq{r: r, prefill: cfg.PromptTokens - w.cachedTokens(r.hashes, cfg.BlockSize, cfg.PromptTokens),
		target: cfg.OutputTokens, kv: cfg.PromptTokens + cfg.OutputTokens, firstHere: true})
}

func (s *simulation) startIdle() {
	for _, w := range s.workers {
		if !w.busy {
			s.startStep(w)
		}
	}
}

// startStep schedules one step on w: running sequences first (a decode
// token each, or their next prefill chunk), then waiting ones FCFS while
// the budget, the running limit and the KV cache allow.
func (s *simulation) startStep(w *worker) {
	cfg := &s.cfg
	budget := cfg.MaxBatchedTokens
	w.batch = w.batch[:0]
	for _, q := range w.running {
		if budget <= 0 {
			break
		}
		n := 1
		if !q.decoding {
			n = min(q.prefill-q.computed, budget)
		}
		w.batch = append(w.batch, item{q, n})
		budget -= n
	}
	for len(w.waiting) > 0 && budget > 0 && len(w.running) < cfg.MaxRunning {
		q := w.waiting[0]
		if w.kvUsed+q.kv > cfg.KVCapacityTokens {
			break
		}
		w.waiting = w.waiting[1:]
		w.kvUsed += q.kv
		w.running = append(w.running, q)
		n := 1
		if !q.decoding {
			n = min(q.prefill-q.computed, budget)
		}
		w.batch = append(w.batch, item{q, n})
		budget -= n
	}
	if len(w.batch) == 0 {
		return
	}
	prefill, decodes := 0, 0
	for _, it := range w.batch {
		if it.s.decoding {
			decodes++
		} else {
			prefill += it.n
		}
	}
	ms := s.cfg.Profile.StepMs(prefill, decodes, float64(w.kvUsed)/float64(cfg.KVCapacityTokens))
	w.busy, w.end = true, s.now+max(time.Duration(math.Round(ms*1e6)), 1)
}

// finishStep completes w's step. Its milestones reach the router in the
// order a worker reports them at one instant: remote prefills done and
// first tokens before finishes, so that a request sent when another ends
// is routed on the whole state.
func (s *simulation) finishStep(w *worker) error {
	w.busy = false
	var finished bool
	var ends []*request
	for _, it := range w.batch {
		q := it.s
		if !q.decoding {
			q.computed += it.n
			if q.computed < q.prefill {
				continue
			}
			for _, h := range q.r.hashes {
				w.cache[h] = struct{}{}
			}
			if q.target == 0 { // remote prefill: hold the KV, start the transfer
				w.held[q.r.id] = q.kv
				q.out = -1 // marks it for removal from running
				finished = true
				if err := s.prefillDone(q.r); err != nil {
					return err
				}
				continue
			}
			q.decoding = true
		}
		q.out++
		if q.out == 1 && q.firstHere {
			if err := s.firstToken(q.r); err != nil {
				return err
			}
		}
		if q.out >= q.target {
			w.kvUsed -= q.kv
			q.out = -1
			finished = true
			ends = append(ends, q.r)
		}
	}
	if finished {
		w.running = slices.DeleteFunc(w.running, func(q *seq) bool { return q.out < 0 })
	}
	for _, r := range ends {
		s.finish(r)
	}
	return nil
}

func (s *simulation) prefillDone(r *request) error {
	if _, err := s.rt.PrefillDone(r.id, epoch.Add(s.now)); err != nil {
		return err
	}
	s.link.Start(r.id, r.bytes, epoch.Add(s.now))
	return nil
}

var errInjected = errors.New("injected transfer failure")

func (s *simulation) transferDone(d router.TransferDone) error {
	r := s.reqs[d.ID]
	if r == nil {
		return fmt.Errorf("transfer of unknown request %s", d.ID)
	}
	s.xferDone++
	now := epoch.Add(s.now)
	if s.cfg.FailEvery > 0 && s.xferDone%s.cfg.FailEvery == 0 {
		rec, err := s.rt.TransferFailed(r.id, now, errInjected)
		if err != nil {
			return err
		}
		switch rec.Action {
		case router.RecoverRetryTransfer:
			s.link.Start(r.id, r.bytes, now)
		case router.RecoverAggregate:
			// Loud in a deployment (rec.Reason is the warning); counted here.
			s.release(r)
			r.prefillW, r.plan.Disaggregated = nil, false
			s.submitAggregated(r)
		}
		return nil
	}
	if dur := d.Duration(); dur > 0 {
		s.xferMs = append(s.xferMs, float64(dur)/1e6)
		s.xferMBps = append(s.xferMBps, float64(d.Bytes)/dur.Seconds()/1e6)
	}
	if err := s.rt.TransferDone(r.id, now); err != nil {
		return err
	}
	s.release(r)
	dw := r.decodeW
	for _, h := range r.hashes {
		dw.cache[h] = struct{}{}
	}
	dw.waiting = append(dw.waiting, &seq{r: r, decoding: true, target: s.cfg.OutputTokens,
		kv: s.cfg.PromptTokens + s.cfg.OutputTokens, firstHere: true})
	return nil
}

// release frees the prefill worker's copy of r's KV.
func (s *simulation) release(r *request) {
	if p := r.prefillW; p != nil {
		p.kvUsed -= p.held[r.id]
		delete(p.held, r.id)
	}
}

func (s *simulation) firstToken(r *request) error {
	r.first = s.now
	if !r.plan.Disaggregated {
		if _, err := s.rt.PrefillDone(r.id, epoch.Add(s.now)); err != nil {
			return err
		}
	}
	ttft := (r.first - r.arrival).Seconds()
	if ttft > 0 {
		s.estErr = append(s.estErr, math.Abs(r.estimate.Seconds()-ttft)/ttft)
	}
	return nil
}

// finish ends r; its client sends the next request once every milestone
// of this instant has reached the router (Run calls issuePending).
func (s *simulation) finish(r *request) {
	r.finish = s.now
	s.rt.Free(r.id)
	delete(s.reqs, r.id)
	s.done = append(s.done, r)
	s.pending++
}

func (s *simulation) issuePending() error {
	for ; s.pending > 0; s.pending-- {
		if s.cfg.ThinkTime > 0 {
			at := s.now + time.Duration(s.rng.ExpFloat64()*float64(s.cfg.ThinkTime))
			i, _ := slices.BinarySearch(s.thinking, at)
			s.thinking = slices.Insert(s.thinking, i, at)
			continue
		}
		if err := s.issue(); err != nil {
			return err
		}
	}
	return nil
}

func (s *simulation) result() Result {
	st := s.rt.Stats()
	res := Result{
		Mode: string(s.cfg.Mode), Requests: s.cfg.Requests, Completed: len(s.done),
		Disaggregated: int(st.Disaggregated), Aggregated: int(st.Aggregated), Fallbacks: int(st.Fallbacks),
		TransferRetries: int(st.TransferRetries), TransferFallbacks: int(st.TransferFallbacks),
		Transfers: len(s.xferMs), TransferMs: stats.WithMean(s.xferMs), PeakTransfers: s.link.Peak(),
	}
	var ttft, e2e, itl []float64
	for _, r := range s.done {
		ttft = append(ttft, float64(r.first-r.arrival)/1e6)
		e2e = append(e2e, float64(r.finish-r.arrival)/1e6)
		if s.cfg.OutputTokens > 1 {
			itl = append(itl, float64(r.finish-r.first)/1e6/float64(s.cfg.OutputTokens-1))
		}
	}
	res.TTFT, res.E2E, res.ITL = stats.WithMean(ttft), stats.WithMean(e2e), stats.WithMean(itl)
	res.TransferMBpsMean = stats.Mean(s.xferMBps)
	res.EstimateErrP50 = stats.Percentile(s.estErr, 50)
	res.VirtualSeconds = s.now.Seconds()
	return res
}
