// Package sim runs a workload through N simulated engines routed by the real
// router, in virtual time: a discrete-event loop with no goroutines and no
// clock, so a run is a pure function of its inputs.
//
// The router sees what it sees in production: Route when a request arrives,
// PrefillDone at its first token, Free when it finishes, and (in kv mode) an
// index fed by the engines' KV events, each delivered EventDelay after the
// engine emitted it. With Router.TrackOutputBlocks the engines report each
// output block a request starts and the router hears Generated then (the
// proxy calls it per streamed read; it books only at block boundaries, so
// per block is the same).
//
// With Routers > 1 the fleet is routed by several routers, as kvrouter's
// replicas route it behind an L4 balancer: request k goes to router
// k mod Routers, every router reads the one event-fed index, and each keeps
// its own load view: its own bookings at once, the other routers' bookings,
// first tokens and frees SyncDelay later, as replica sync delivers them.
package sim

import (
	"container/heap"
	"errors"
	"fmt"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/internal/peerpolicy"
	"github.com/kvrouter/kvrouter/internal/warmup"
	"github.com/kvrouter/kvrouter/router"
)

// Config describes one simulation run: one policy over one workload.
type Config struct {
	Workers  int
	KVBlocks []int // per worker
	// Engine is the template for every engine; CapacityBlocks comes from
	// KVBlocks and EngineHashSeed is derived per worker.
	Engine     engine.Config
	Router     router.Config // Mode selects the policy
	EventDelay time.Duration
	// Routers is the number of routers (0 or 1: one, with no sync at all).
	Routers int
	// SyncDelay is the lag of replica sync between routers: router j sees
	// router i's booking, first token and free SyncDelay after router i
	// did (0: at the same instant, before anything else is routed).
	SyncDelay time.Duration
	// SyncFreeExtra delays first tokens and frees beyond SyncDelay: the
	// other routers keep a finished request's load that much longer
	// (phantom load). Never negative, so a free cannot overtake its booking.
	SyncFreeExtra time.Duration
	Seed          uint64 // router tie-breaks and sampling
	// OSLHint sends every request's output length as its expected output
	// (nvext.agent_hints.osl, router.Request.ExpectedOutputTokens), as a
	// client that knows it would; off, the router is told nothing.
	OSLHint bool
	// SessionAffinity binds a session (a trace's session_id) to the worker
	// its first turn went to, and sends its later turns there through any
	// router, as kvrouter's --router-session-affinity-ttl-secs does (hard
	// mode): the binding is shared by every router at once (replicated
	// state, not replica sync), so it has no lag; its commit (~3 ms on a
	// first turn, BENCHMARKS.md) is not simulated. A turn whose bound
	// worker refuses it (busy) is routed as usual and the session rebound.
	SessionAffinity bool
	// Progress, when set, is called after every finished request.
	Progress func()
	// Peer, when set, routes instead of the router (peer.go): another
	// project's scheduler, fed each worker's metrics as scraped every
	// ScrapeInterval (0: read at every decision).
	Peer           PeerPicker
	ScrapeInterval time.Duration
	// Remove, when set, removes a worker mid-run; Add adds the last one
	// mid-run (fleet.go). At most one of them.
	Remove *Removal
	Add    *Addition
	// WarmUp, with Add, steers a share of new and duplicated prefixes to
	// the joining worker until it is warm (internal/warmup; fleet.go).
	WarmUp *warmup.Policy
}

// ErrConfig marks an impossible simulation.
var ErrConfig = errors.New("invalid simulation")

// RequestResult is what happened to one request.
type RequestResult struct {
	Worker       int // -1 if never routed
	Sent         time.Duration
	FirstToken   time.Duration
	Finished     time.Duration
	CachedTokens int
	Done         bool
	Err          string // routing or engine rejection; "" when fine
	Preemptions  int
}

// Result is one run's outcome.
type Result struct {
	Policy   string
	Requests []RequestResult // by workload request index
	// Preemptions over all engines.
	Preemptions uint64
	// IndexErrors counts KV events the router's index rejected.
	IndexErrors int
	// EventsDelivered counts KV events applied to the router's index.
	EventsDelivered int
	// End is the virtual time the last request finished.
	End time.Duration
	// Removal is what Config.Remove cost (nil without one, or when no
	// request arrived after its time).
	Removal *RemovalResult
	// Addition is how the fleet took Config.Add's worker (nil without).
	Addition *AdditionResult
}

// usesIndex reports whether a mode reads the event-fed index. Modes this
// harness does not know (added to the router later) get events, to be safe.
func usesIndex(m router.Mode) bool {
	switch m {
	case router.ModeRoundRobin, router.ModeRandom, router.ModeLeastLoaded, router.ModeLoadAware, router.ModeKVApprox:
		return false
	}
	return true
}

// epoch anchors virtual time for the router, which speaks time.Time.
var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// WorkerID names worker i of n for the router and the engines ("w0"…, zero
// padded so that the router's sorted order is the numeric order).
func WorkerID(i, n int) string {
	width := len(fmt.Sprint(max(n-1, 0)))
	return fmt.Sprintf("w%0*d", width, i)
}

// Run simulates w under cfg.
func Run(w *workload.Workload, cfg Config) (*Result, error) {
	if cfg.Workers <= 0 || len(cfg.KVBlocks) != cfg.Workers {
		return nil, fmt.Errorf("%d workers with %d capacities: %w", cfg.Workers, len(cfg.KVBlocks), ErrConfig)
	}
	if cfg.Routers < 0 || cfg.SyncDelay < 0 || cfg.SyncFreeExtra < 0 {
		return nil, fmt.Errorf("%d routers, sync delay %v + %v: %w", cfg.Routers, cfg.SyncDelay, cfg.SyncFreeExtra, ErrConfig)
	}
	if cfg.Router.BlockSize != w.BlockSize || cfg.Engine.BlockSize != w.BlockSize {
		return nil, fmt.Errorf("block sizes differ: workload %d, router %d, engine %d: %w",
			w.BlockSize, cfg.Router.BlockSize, cfg.Engine.BlockSize, ErrConfig)
	}
	if err := checkRemoval(cfg); err != nil {
		return nil, err
	}
	// The plan reads the index whatever the policy, as kvrouter's replicas
	// index every worker's events in every mode.
	planIndex := cfg.Remove != nil && cfg.Remove.Choose == ChoosePlan
	s := &state{w: w, cfg: cfg, feed: cfg.Peer == nil && (usesIndex(cfg.Router.Mode) || planIndex), removed: -1, addedAt: -1, warm: warmState{at: -1}}
	if err := s.build(); err != nil {
		return nil, err
	}
	if cfg.Peer != nil {
		s.scrape() // the scraper's first read, before any request
		s.nextScrape = cfg.ScrapeInterval
	}
	s.start()
	s.loop()
	return s.finish(), nil
}

type state struct {
	w    *workload.Workload
	cfg  Config
	feed bool // deliver KV events to the index

	engines  []*engine.Engine
	ids      []router.WorkerID
	byWorker map[router.WorkerID]int
	next     []time.Duration
	busy     []bool // next is valid
	dirty    []bool // touched this instant: refresh next, drain events
	index    *router.Index
	rts      []*router.Router // one per router; requests go round-robin
	owner    []int            // per request: the router that routed it
	syncs    syncHeap         // load-view updates on their way to the other routers
	routed   int              // requests routed so far (the balancer's counter)

	byID     map[string]int
	res      []RequestResult
	arrivals timeHeap // request indices
	deliver  eventHeap
	seq      uint64 // insertion order, for deterministic ties

	pods       []peerpolicy.Pod // a peer's view of the workers, as last scraped
	nextScrape time.Duration

	removed   int // the removed worker (Config.Remove), -1 before
	removedAt time.Duration
	addedAt   time.Duration // when Config.Add's worker joined; -1 before
	infos     []router.WorkerInfo
	warm      warmState               // Config.WarmUp
	bound     map[int]router.WorkerID // session → its worker (SessionAffinity)

	issued    int // closed loop: next request to send
	finished  int
	preempts  uint64
	idxErrs   int
	delivered int
	now       time.Duration
}

func (s *state) build() error {
	n := s.cfg.Workers
	s.engines = make([]*engine.Engine, n)
	s.ids = make([]router.WorkerID, n)
	s.byWorker = make(map[router.WorkerID]int, n)
	s.next = make([]time.Duration, n)
	s.busy = make([]bool, n)
	s.dirty = make([]bool, n)
	s.index = router.NewIndex(s.w.BlockSize)
	infos := make([]router.WorkerInfo, n)
	for i := range n {
		id := WorkerID(i, n)
		ec := s.cfg.Engine
		ec.CapacityBlocks = s.cfg.KVBlocks[i]
		ec.ReportOutputBlocks = s.cfg.Router.TrackOutputBlocks
		if ec.EngineHashSeed != 0 {
			// Distinct opaque names per worker, like engines without a
			// shared PYTHONHASHSEED.
			ec.EngineHashSeed += uint64(i)
		}
		e, err := engine.New(id, ec)
		if err != nil {
			return fmt.Errorf("worker %s: %w", id, err)
		}
		s.engines[i] = e
		s.ids[i] = router.WorkerID(id)
		s.byWorker[s.ids[i]] = i
		s.index.AddWorker(s.ids[i])
		infos[i] = router.WorkerInfo{ID: s.ids[i], TotalBlocks: s.cfg.KVBlocks[i], MaxBatchedTokens: e.Config().MaxBatchedTokens}
	}
	s.infos = infos
	s.rts = make([]*router.Router, max(s.cfg.Routers, 1))
	for k := range s.rts {
		// Router 0 keeps the single-router seed, so one router is exactly
		// the run it always was; the others tie-break differently, as
		// replicas seeded apart do.
		rt, err := router.New(s.cfg.Router, s.index, s.cfg.Seed+uint64(k)*0x9e3779b9)
		if err != nil {
			return err
		}
		rt.SetWorkers(s.withoutJoiner(infos))
		s.rts[k] = rt
	}
	s.byID = make(map[string]int, len(s.w.Requests))
	s.res = make([]RequestResult, len(s.w.Requests))
	s.owner = make([]int, len(s.w.Requests))
	for i, r := range s.w.Requests {
		s.byID[r.ID] = i
		s.res[i].Worker = -1
	}
	return nil
}

// start queues the first arrivals: C clients' first requests, or every
// open-loop request (an arrival process, a trace's rows) and every
// session's first turn.
func (s *state) start() {
	switch {
	case s.w.Kind == workload.Synthetic && s.w.OpenLoop:
		for i, r := range s.w.Requests {
			s.push(r.At, i)
		}
		s.issued = len(s.w.Requests)
	case s.w.Kind == workload.Synthetic:
		for s.issued < s.w.Concurrency && s.issued < len(s.w.Requests) {
			s.push(0, s.issued)
			s.issued++
		}
	case s.w.Kind == workload.Trace:
		for i, r := range s.w.Requests {
			if r.Session == workload.NoSession || s.w.Sessions[r.Session][0] == i {
				s.push(r.At, i)
			}
		}
	}
}

func (s *state) push(at time.Duration, i int) {
	s.seq++
	heap.Push(&s.arrivals, timed{at: at, seq: s.seq, i: i})
}

func (s *state) loop() {
	for s.finished < len(s.res) && s.step() {
	}
}

// step advances to the next instant something happens and handles it;
// false when nothing is left to happen (unfinished requests are stuck).
func (s *state) step() bool {
	{
		t, ok := s.nextTime()
		if !ok {
			return false
		}
		s.now = t
		// Same-instant order: events become visible, other routers'
		// load reaches each router, engines finish steps (the router sees
		// Free before it routes the next request), then arrivals are routed
		// and submitted, then due steps start.
		for len(s.syncs) > 0 && s.syncs[0].at <= t {
			s.applySync(heap.Pop(&s.syncs).(syncMsg))
		}
		for len(s.deliver) > 0 && s.deliver[0].at <= t {
			d := heap.Pop(&s.deliver).(delivery)
			if d.worker == s.removed {
				continue // its cache left with it
			}
			s.delivered++
			if err := s.index.Apply(s.ids[d.worker], d.kv); err != nil {
				s.idxErrs++
			}
		}
		for i, e := range s.engines {
			if s.busy[i] && s.next[i] <= t {
				s.handle(i, e.Advance(t))
				s.dirty[i] = true
			}
		}
		for len(s.arrivals) > 0 && s.arrivals[0].at <= t {
			a := heap.Pop(&s.arrivals).(timed)
			s.send(a.i)
		}
		for i, e := range s.engines {
			if !s.dirty[i] {
				continue
			}
			s.dirty[i] = false
			s.next[i], s.busy[i] = e.NextEventTime()
			s.drain(i)
		}
		s.afterStep()
	}
	return true
}

func (s *state) nextTime() (time.Duration, bool) {
	var t time.Duration
	ok := false
	if len(s.arrivals) > 0 {
		t, ok = s.arrivals[0].at, true
	}
	if len(s.deliver) > 0 && (!ok || s.deliver[0].at < t) {
		t, ok = s.deliver[0].at, true
	}
	if len(s.syncs) > 0 && (!ok || s.syncs[0].at < t) {
		t, ok = s.syncs[0].at, true
	}
	for i := range s.engines {
		if s.busy[i] && (!ok || s.next[i] < t) {
			t, ok = s.next[i], true
		}
	}
	// Scrapes happen only while something else is still to happen: a
	// fleet with nothing left to do is done (or stuck), not scraped forever.
	if sc, due := s.peerScrapeDue(); ok && due && sc < t {
		t = sc
	}
	return t, ok
}

// drain moves engine i's KV events into the delivery queue (or drops them
// when the policy does not read the index).
func (s *state) drain(i int) {
	evs := s.engines[i].DrainEvents()
	if !s.feed {
		return
	}
	for _, ev := range evs {
		s.seq++
		heap.Push(&s.deliver, delivery{at: ev.At + s.cfg.EventDelay, seq: s.seq, worker: i, kv: ev.KV})
	}
}

// send routes request i and submits it to the chosen engine.
func (s *state) send(i int) {
	r := &s.w.Requests[i]
	rr := &s.res[i]
	rr.Sent = s.now
	s.removalDue()
	s.additionDue()
	if s.cfg.Peer != nil {
		s.sendByPeer(i)
		return
	}
	k := s.routed % len(s.rts)
	s.routed++
	s.owner[i] = k
	req := router.Request{ID: r.ID, Hashes: r.Hashes, Tokens: r.PromptTokens}
	if s.cfg.OSLHint {
		req.ExpectedOutputTokens = r.OutputTokens
	}
	d, err := s.route(k, r, req)
	if err == nil && (!s.cfg.SessionAffinity || r.Session == workload.NoSession) {
		d, err = s.warmUp(k, req, d) // a session's turn goes where its binding says
	}
	if err != nil {
		s.fail(i, fmt.Sprintf("route: %v", err))
		return
	}
	// What replica sync announces: the booking as Route made it.
	s.announce(k, syncMsg{kind: syncBook, booking: router.Booking{
		ID: r.ID, Origin: fmt.Sprint(k), Worker: d.Worker, Hashes: d.ActiveHashes,
		PrefillTokens: max(r.PromptTokens-d.Overlap*s.w.BlockSize, 0),
	}})
	wi := s.byWorker[d.Worker]
	rr.Worker = wi
	err = s.engines[wi].Submit(s.now, engine.Request{
		ID: r.ID, NumTokens: r.PromptTokens, BlockHashes: r.Hashes, OutputTokens: r.OutputTokens,
	})
	if err != nil {
		s.rts[k].Free(r.ID)
		s.announce(k, syncMsg{kind: syncFree, id: r.ID})
		s.fail(i, fmt.Sprintf("submit: %v", err))
		return
	}
	s.dirty[wi] = true
}

// route decides request r on router k: by its session's binding when
// SessionAffinity is on and the session is bound (only the bound worker
// is a candidate), else as the router decides; a session's turn then
// binds (or rebinds) it to the worker chosen.
func (s *state) route(k int, r *workload.Request, req router.Request) (router.Decision, error) {
	now := epoch.Add(s.now)
	if !s.cfg.SessionAffinity || r.Session == workload.NoSession {
		return s.rts[k].Route(req, now)
	}
	if w, ok := s.bound[r.Session]; ok {
		pinned := req
		for _, id := range s.ids {
			if id != w {
				pinned.Exclude = append(pinned.Exclude, id)
			}
		}
		if d, err := s.rts[k].Route(pinned, now); err == nil {
			return d, nil
		}
	}
	d, err := s.rts[k].Route(req, now)
	if err == nil {
		if s.bound == nil {
			s.bound = make(map[int]router.WorkerID)
		}
		s.bound[r.Session] = d.Worker
	}
	return d, err
}

// sendByPeer routes request i by the peer and submits it.
func (s *state) sendByPeer(i int) {
	r := &s.w.Requests[i]
	id, err := s.peerRoute(i)
	if err != nil {
		s.fail(i, fmt.Sprintf("route: %v", err))
		return
	}
	wi := s.byWorker[id]
	s.res[i].Worker = wi
	if err := s.engines[wi].Submit(s.now, engine.Request{
		ID: r.ID, NumTokens: r.PromptTokens, BlockHashes: r.Hashes, OutputTokens: r.OutputTokens,
	}); err != nil {
		s.fail(i, fmt.Sprintf("submit: %v", err))
		return
	}
	s.dirty[wi] = true
}

// fail ends request i with an error at now (the client sees it at once).
func (s *state) fail(i int, msg string) {
	s.res[i].Err = msg
	s.complete(i)
}

func (s *state) handle(wi int, outs []engine.Output) {
	for _, o := range outs {
		i, ok := s.byID[o.RequestID]
		if !ok {
			continue
		}
		rr := &s.res[i]
		switch o.Kind {
		case engine.FirstToken:
			rr.FirstToken = o.At
			rr.CachedTokens = o.CachedTokens
			if s.cfg.Peer != nil {
				continue
			}
			s.rts[s.owner[i]].PrefillDoneAt(o.RequestID, epoch.Add(s.now))
			s.announce(s.owner[i], syncMsg{kind: syncPrefillDone, id: o.RequestID})
		case engine.OutputBlock:
			if s.cfg.Peer != nil {
				continue
			}
			// Only the routing replica hears the stream; the others get
			// the new block through replica sync (Syncer.Output).
			if p, ok := s.rts[s.owner[i]].Generated(o.RequestID, o.OutputTokens); ok {
				s.announce(s.owner[i], syncMsg{kind: syncOutput, id: o.RequestID, output: p})
			}
		case engine.Preempted:
			rr.Preemptions++
			s.preempts++
		case engine.Finished:
			if rr.FirstToken == 0 && rr.CachedTokens == 0 {
				rr.FirstToken, rr.CachedTokens = o.At, o.CachedTokens
			}
			rr.Finished = o.At
			rr.Done = true
			if s.cfg.Peer != nil {
				s.complete(i)
				continue
			}
			// Only the routing replica learns the output length
			// (kv-pooled's decode reserve); the others hear a free.
			s.rts[s.owner[i]].FinishedAt(o.RequestID, o.OutputTokens, epoch.Add(s.now))
			s.announce(s.owner[i], syncMsg{kind: syncFree, id: o.RequestID})
			s.complete(i)
		}
	}
}

// complete records the end of request i and lets its client (closed loop)
// or its session's next turn go.
func (s *state) complete(i int) {
	s.finished++
	if s.cfg.Progress != nil {
		s.cfg.Progress()
	}
	switch s.w.Kind {
	case workload.Synthetic:
		if s.issued < len(s.w.Requests) {
			s.push(s.now, s.issued)
			s.issued++
		}
	case workload.Trace:
		if nxt := s.w.Requests[i].NextTurn; nxt >= 0 {
			s.push(max(s.w.Requests[nxt].At, s.now+s.w.Requests[nxt].Think), nxt)
		}
	}
}

func (s *state) finish() *Result {
	res := &Result{
		Policy:          string(s.cfg.Router.Mode),
		Requests:        s.res,
		Preemptions:     s.preempts,
		IndexErrors:     s.idxErrs,
		EventsDelivered: s.delivered,
		Removal:         s.removalResult(),
		Addition:        s.additionResult(),
	}
	for i := range s.res {
		rr := &s.res[i]
		if !rr.Done && rr.Err == "" {
			rr.Err = "did not complete"
		}
		if rr.Done {
			res.End = max(res.End, rr.Finished)
		}
	}
	return res
}

type timed struct {
	at  time.Duration
	seq uint64
	i   int
}

type timeHeap []timed

func (h timeHeap) Len() int { return len(h) }
func (h timeHeap) Less(a, b int) bool {
	if h[a].at != h[b].at {
		return h[a].at < h[b].at
	}
	return h[a].seq < h[b].seq
}
func (h timeHeap) Swap(a, b int) { h[a], h[b] = h[b], h[a] }
func (h *timeHeap) Push(x any)   { *h = append(*h, x.(timed)) }
func (h *timeHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

type delivery struct {
	at     time.Duration
	seq    uint64
	worker int
	kv     router.KVEvent
}

type eventHeap []delivery

func (h eventHeap) Len() int { return len(h) }
func (h eventHeap) Less(a, b int) bool {
	if h[a].at != h[b].at {
		return h[a].at < h[b].at
	}
	return h[a].seq < h[b].seq
}
func (h eventHeap) Swap(a, b int) { h[a], h[b] = h[b], h[a] }
func (h *eventHeap) Push(x any)   { *h = append(*h, x.(delivery)) }
func (h *eventHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}
