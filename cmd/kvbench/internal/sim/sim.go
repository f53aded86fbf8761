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
	// Progress, when set, is called after every finished request.
	Progress func()
	// Peer, when set, routes instead of the router (peer.go): another
	// project's scheduler, fed each worker's metrics as scraped every
	// ScrapeInterval (0: read at every decision).
	Peer           PeerPicker
	ScrapeInterval time.Duration

	// Affinity binds sessions to workers (affinity.go); the zero value is off.
	Affinity Affinity
	// Pins: the agent session trees whose root is a multiple of PinEvery
	// (0: none) carry nvext.cache_control with PinTTL: each of their turns
	// pins its prompt on its engine when it ends (Dynamo's router pins
	// after the answer; the engine keeps pinned blocks as SGLang's HiCache
	// does, engine.Pin), and the routers price the pinned blocks as not
	// evictable (router.SetPinnedBlocks). Sessions are steered by Affinity,
	// as pins steer a prefix to its holder.
	PinTTL   time.Duration
	PinEvery int
	// Events change the fleet during the run (fleet.go), in time order.
	Events []FleetEvent
	// WarmUp steers a share of new and duplicated prefixes to a worker
	// an event added until it is warm (internal/warmup; warmup.go); nil:
	// off.
	WarmUp *warmup.Policy
	// Tenants tags requests with tenants and runs tenant fairness in the
	// routers' admission queues (tenants.go; needs Router.QueueThreshold).
	Tenants Tenants
	// ShadowWarmUp warms a worker an add event brought in by shadow
	// prefills of the duplicated prefixes it lacks (shadow.go) instead of
	// steering requests there; not with WarmUp.
	ShadowWarmUp bool
	// Shadow bounds shadow prefills (drain-shadow events, ShadowWarmUp);
	// the zero value takes the defaults.
	Shadow ShadowPolicy
	// IDSlots is the number of worker ids the width of WorkerID is sized
	// for (0: Workers plus the workers Events add). A run without events
	// compared with one with them gives the same value, so both name the
	// workers alike.
	IDSlots int
}

// ErrConfig marks an impossible simulation.
var ErrConfig = errors.New("invalid simulation")

// RequestResult is what happened to one request.
type RequestResult struct {
	Worker int // -1 if never routed
	Sent   time.Duration
	// Routed is when a router routed it (after its wait in the router's
	// admission queue, Config.Router.QueueThreshold).
	Routed       time.Duration
	FirstToken   time.Duration
	Finished     time.Duration
	CachedTokens int
	Done         bool
	Err          string // routing or engine rejection; "" when fine
	Preemptions  int
	// ResentAt is when the request was last re-sent because its worker
	// was removed (fleet.go); 0 when never.
	ResentAt time.Duration
	// HeldTokens is the prompt tokens of the longest prefix of it some
	// worker's engine held when it was routed (its last routing; only
	// with an add event: warmup.go): the most any routing could have
	// served from cache, what a new worker's hit rate is judged on.
	HeldTokens int
	// Pinned: the request belongs to a session tree that pins its
	// prompts (Config.PinEvery).
	Pinned bool
	// Router is the router that routed it (0 with one router, and for a
	// peer policy).
	Router int
	// Charged is the tokens its tenant's ledger was charged for it
	// (uncached prompt at routing, output at the end; 0 without tenants).
	Charged int
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
	// TenantOf is each request's tenant index into Tenants (nil without
	// tenants); Tenants their tokens; Backlogged the time every tenant had
	// a request queued in some router (Config.Tenants).
	TenantOf   []int
	Tenants    []TenantTotals
	Backlogged time.Duration
	// Events are the fleet events as they happened (Config.Events).
	Events []EventRecord
	// Workers are the worker ids by index, added workers included.
	Workers []router.WorkerID
	// Engines are each worker's engine totals at the end, or when it left
	// (zero for a worker never added): what the engines computed, shadow
	// prefills (shadow.go) included.
	Engines []engine.Stats
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
	if err := cfg.checkFleet(); err != nil {
		return nil, err
	}
	if err := cfg.checkTenants(); err != nil {
		return nil, err
	}
	if cfg.Tenants.on() && cfg.Tenants.LatencyGuard > 0 {
		cfg.Router.LearnLatency = true // the guard predicts from the rates the routers learn (tenants.go)
	}
	if cfg.Routers < 0 || cfg.SyncDelay < 0 || cfg.SyncFreeExtra < 0 {
		return nil, fmt.Errorf("%d routers, sync delay %v + %v: %w", cfg.Routers, cfg.SyncDelay, cfg.SyncFreeExtra, ErrConfig)
	}
	if cfg.Router.BlockSize != w.BlockSize || cfg.Engine.BlockSize != w.BlockSize {
		return nil, fmt.Errorf("block sizes differ: workload %d, router %d, engine %d: %w",
			w.BlockSize, cfg.Router.BlockSize, cfg.Engine.BlockSize, ErrConfig)
	}
	s := &state{w: w, cfg: cfg, feed: cfg.Peer == nil && usesIndex(cfg.Router.Mode)}
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
	isoIDs []router.WorkerID // tenant isolation's scratch (tenants.go)

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

	aff    affinityState  // session bindings (affinity.go)
	fleet  fleetState     // fleet events (fleet.go)
	warm   warmState      // warm-up of added workers (warmup.go)
	adm    admissionState // the routers' queues and tenant ledgers (tenants.go)
	shadow shadowState    // shadow prefills (shadow.go)

	issued    int // closed loop: next request to send
	finished  int
	preempts  uint64
	idxErrs   int
	delivered int
	now       time.Duration
}

func (s *state) build() error {
	n := s.cfg.Workers + s.cfg.added()
	s.engines = make([]*engine.Engine, n)
	s.ids = make([]router.WorkerID, n)
	s.byWorker = make(map[router.WorkerID]int, n)
	s.next = make([]time.Duration, n)
	s.busy = make([]bool, n)
	s.dirty = make([]bool, n)
	s.index = router.NewIndex(s.w.BlockSize)
	s.fleet.init(s, n)
	infos := make([]router.WorkerInfo, s.cfg.Workers)
	for i := range n {
		s.ids[i] = router.WorkerID(WorkerID(i, max(n, s.cfg.IDSlots)))
		s.byWorker[s.ids[i]] = i
		if i >= s.cfg.Workers {
			continue // added by an event (fleet.go)
		}
		e, err := s.newEngine(i)
		if err != nil {
			return err
		}
		s.index.AddWorker(s.ids[i])
		infos[i] = router.WorkerInfo{ID: s.ids[i], TotalBlocks: s.capacity(i), MaxBatchedTokens: e.Config().MaxBatchedTokens}
	}
	s.rts = make([]*router.Router, max(s.cfg.Routers, 1))
	for k := range s.rts {
		// Router 0 keeps the single-router seed, so one router is exactly
		// the run it always was; the others tie-break differently, as
		// replicas seeded apart do.
		rt, err := router.New(s.cfg.Router, s.index, s.cfg.Seed+uint64(k)*0x9e3779b9)
		if err != nil {
			return err
		}
		rt.SetWorkers(infos)
		if s.cfg.PinTTL > 0 && s.cfg.PinEvery > 0 {
			rt.SetPinnedBlocks(s.pinnedBlocks)
		}
		s.rts[k] = rt
	}
	s.byID = make(map[string]int, len(s.w.Requests))
	s.res = make([]RequestResult, len(s.w.Requests))
	s.owner = make([]int, len(s.w.Requests))
	for i, r := range s.w.Requests {
		s.byID[r.ID] = i
		s.res[i].Worker = -1
		s.res[i].Pinned = PinnedRequest(s.w, s.cfg, i)
	}
	s.aff.init(s)
	s.shadow.init(s, n)
	s.warm.worker = -1
	s.warm.initHeld(s)
	return s.adm.init(s)
}

// newEngine builds worker i's engine.
func (s *state) newEngine(i int) (*engine.Engine, error) {
	ec := s.cfg.Engine
	ec.CapacityBlocks = s.capacity(i)
	ec.ReportOutputBlocks = s.cfg.Router.TrackOutputBlocks
	if ec.EngineHashSeed != 0 {
		// Distinct opaque names per worker, like engines without a
		// shared PYTHONHASHSEED.
		ec.EngineHashSeed += uint64(i)
	}
	e, err := engine.New(string(s.ids[i]), ec)
	if err != nil {
		return nil, fmt.Errorf("worker %s: %w", s.ids[i], err)
	}
	s.engines[i] = e
	return e, nil
}

// capacity is worker i's KV blocks; a worker an event adds has the first
// worker's.
func (s *state) capacity(i int) int {
	if i < len(s.cfg.KVBlocks) {
		return s.cfg.KVBlocks[i]
	}
	return s.cfg.KVBlocks[0]
}

// start queues the first arrivals: C clients' first requests, or every
// open-loop request (an arrival process, a trace's rows) and every
// session's first turn.
func (s *state) start() {
	switch {
	case s.w.Agent && s.w.OpenLoop:
		for _, root := range s.w.Roots {
			first := s.w.Sessions[root][0]
			s.push(s.w.Requests[first].At, first)
		}
		s.issued = len(s.w.Roots)
	case s.w.Agent:
		for s.issued < s.w.Concurrency && s.issued < len(s.w.Roots) {
			s.push(0, s.w.Sessions[s.w.Roots[s.issued]][0])
			s.issued++
		}
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
		s.tenantTimers(t)
		for len(s.deliver) > 0 && s.deliver[0].at <= t {
			d := heap.Pop(&s.deliver).(delivery)
			if s.fleet.gone[d.worker] {
				continue // its worker left: the index forgot it
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
		s.fleet.due(s, t)
		s.admitQueued() // waiters first: capacity freed this instant is theirs
		for len(s.arrivals) > 0 && s.arrivals[0].at <= t {
			a := heap.Pop(&s.arrivals).(timed)
			s.send(a.i)
		}
		s.admitQueued()
		for i, e := range s.engines {
			if !s.dirty[i] {
				continue
			}
			s.dirty[i] = false
			s.next[i], s.busy[i] = e.NextEventTime()
			s.drain(i)
		}
		s.fleet.leaveIdle(s)
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
	// A held queue head's wake always (it is what lets that head go);
	// tenant counters' publications only while something else is to happen.
	if w := s.adm.wakeAt; w >= 0 && (!ok || w < t) {
		t, ok = w, true
	}
	if pub, due := s.adm.nextPublication(); ok && due && pub < t {
		t = pub
	}
	// Fleet events too: one due after the last request is not waited for.
	if ev, due := s.fleet.next(); ok && due && ev < t {
		t = ev
	}
	return t, ok
}

// drain moves engine i's KV events into the delivery queue (or drops them
// when the policy does not read the index).
func (s *state) drain(i int) {
	evs := s.engines[i].DrainEvents()
	s.warm.applyHeld(s, i, evs)
	if !s.feed {
		return
	}
	for _, ev := range evs {
		s.seq++
		heap.Push(&s.deliver, delivery{at: ev.At + s.cfg.EventDelay, seq: s.seq, worker: i, kv: ev.KV})
	}
}

// send is request i's arrival: at the peer, or at a router, which routes
// and submits it at once or (with an admission queue) when its turn comes.
func (s *state) send(i int) {
	rr := &s.res[i]
	if !s.fleet.resent[i] {
		rr.Sent = s.now // a re-sent request keeps its first send
	}
	if s.cfg.Peer != nil {
		s.sendByPeer(i)
		return
	}
	k := s.pickRouter(i)
	s.owner[i] = k
	if s.adm.on {
		s.arrive(i, k) // the admission queue (tenants.go)
		return
	}
	s.dispatch(i, k)
}

// dispatch routes request i on router k and submits it to the chosen
// engine.
func (s *state) dispatch(i, k int) {
	r := &s.w.Requests[i]
	rr := &s.res[i]
	req := router.Request{ID: r.ID, Hashes: r.Hashes, Tokens: r.PromptTokens}
	if s.cfg.OSLHint {
		req.ExpectedOutputTokens = r.OutputTokens
	}
	s.warm.noteHeld(s, i)
	d, err := s.route(k, i, req)
	if err != nil {
		s.fail(i, fmt.Sprintf("route: %v", err))
		return
	}
	// What replica sync announces: the booking as Route made it.
	s.announce(k, syncMsg{kind: syncBook, booking: router.Booking{
		ID: r.ID, Origin: fmt.Sprint(k), Worker: d.Worker, Hashes: d.ActiveHashes,
		PrefillTokens: max(r.PromptTokens-d.Overlap*s.w.BlockSize, 0),
	}})
	rr.Routed = s.now
	prio := s.enginePriority(i, k) // the ledger's view before this request's charge
	s.charge(i, k, r.PromptTokens-d.Overlap*s.w.BlockSize)
	wi := s.byWorker[d.Worker]
	rr.Worker = wi
	err = s.engines[wi].Submit(s.now, engine.Request{
		ID: r.ID, NumTokens: r.PromptTokens, BlockHashes: r.Hashes, OutputTokens: r.OutputTokens, Priority: prio,
	})
	if err != nil {
		s.rts[k].Free(r.ID)
		s.announce(k, syncMsg{kind: syncFree, id: r.ID})
		s.fail(i, fmt.Sprintf("submit: %v", err))
		return
	}
	s.fleet.submitted(s, i, wi)
	s.dirty[wi] = true
}

// route is router k's decision for request i: the policy's, or the
// session's bound worker (affinity.go).
func (s *state) route(k, i int, req router.Request) (router.Decision, error) {
	// Workers draining with their sessions kept take no other request.
	req.Exclude = s.fleet.keepingIDs(s)
	if out, _ := s.isolationOut(k, s.adm.name(i), req); len(out) > 0 {
		req.Exclude = append(req.Exclude, out...) // tenant isolation (tenants.go)
	}
	if out, _ := s.guardOut(k, s.adm.name(i), req); len(out) > 0 {
		req.Exclude = append(req.Exclude, out...) // the latency guard (tenants.go)
	}
	if s.cfg.Affinity.Mode != AffinityOff && s.w.Requests[i].Session != workload.NoSession {
		return s.aff.route(s, k, i, req) // a session's turn goes where its binding says
	}
	d, err := s.rts[k].Route(req, epoch.Add(s.now))
	if err != nil {
		return d, err
	}
	return s.warm.steer(s, k, i, req, d)
}

// sendByPeer routes request i by the peer and submits it.
func (s *state) sendByPeer(i int) {
	r := &s.w.Requests[i]
	s.warm.noteHeld(s, i)
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
		if s.shadow.handle(s, o) {
			continue
		}
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
			if rr.Pinned {
				s.engines[wi].Pin(s.now, s.w.Requests[i].Hashes, s.cfg.PinTTL)
			}
			s.fleet.finished(wi)
			if s.cfg.Peer != nil {
				s.complete(i)
				continue
			}
			// Only the routing replica learns the output length
			// (kv-pooled's decode reserve); the others hear a free.
			s.rts[s.owner[i]].FinishedAt(o.RequestID, o.OutputTokens, epoch.Add(s.now))
			s.charge(i, s.owner[i], o.OutputTokens)
			s.announce(s.owner[i], syncMsg{kind: syncFree, id: o.RequestID})
			s.complete(i)
		}
	}
}

// complete records the end of request i and lets its client (closed loop)
// or its session's next turn go.
func (s *state) complete(i int) {
	s.finished++
	s.ended(i)
	if s.cfg.Progress != nil {
		s.cfg.Progress()
	}
	switch {
	case s.w.Agent:
		s.nextTurns(i)
	case s.w.Kind == workload.Synthetic:
		if s.issued < len(s.w.Requests) {
			s.push(s.now, s.issued)
			s.issued++
		}
	case s.w.Kind == workload.Trace:
		if nxt := s.w.Requests[i].NextTurn; nxt >= 0 {
			s.push(max(s.w.Requests[nxt].At, s.now+s.w.Requests[i].Think), nxt)
		}
	}
}

// nextTurns sends what request i's end lets go in an agent workload: its
// session's next turn and its subagents, its Think later; and, closed
// loop, the next top-level session when i ends one (its client is free).
func (s *state) nextTurns(i int) {
	r := &s.w.Requests[i]
	if r.NextTurn >= 0 {
		s.push(s.now+r.Think, r.NextTurn)
	}
	for _, c := range r.Children {
		s.push(s.now+r.Think, c)
	}
	if s.w.OpenLoop || r.NextTurn >= 0 || s.w.SessionRoot[r.Session] != r.Session {
		return
	}
	if s.issued < len(s.w.Roots) {
		s.push(s.now, s.w.Sessions[s.w.Roots[s.issued]][0])
		s.issued++
	}
}

func (s *state) finish() *Result {
	res := &Result{
		Policy:          string(s.cfg.Router.Mode),
		Requests:        s.res,
		Preemptions:     s.preempts,
		IndexErrors:     s.idxErrs,
		EventsDelivered: s.delivered,
		Events:          s.fleet.records,
		Workers:         s.ids,
		Engines:         s.fleet.stats,
	}
	for i, e := range s.engines {
		if e != nil {
			res.Engines[i] = e.Stats()
		}
	}
	if s.adm.tenants() {
		res.TenantOf = s.adm.tenantOf
		res.Tenants, res.Backlogged = s.adm.totals(s.now)
	}
	for i := range s.res {
		rr := &s.res[i]
		rr.Router = s.owner[i]
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

// PinnedRequest reports whether request i of w belongs to a session tree
// that cfg pins: one whose root session is a multiple of PinEvery.
func PinnedRequest(w *workload.Workload, cfg Config, i int) bool {
	if cfg.PinTTL <= 0 || cfg.PinEvery <= 0 {
		return false
	}
	r := w.Requests[i]
	return r.Session != workload.NoSession && w.SessionRoot[r.Session]%cfg.PinEvery == 0
}

// pinnedBlocks is what the routers read of the pins: the blocks pinned on
// a worker's engine (the replicated pins' blocks, in a real fleet).
func (s *state) pinnedBlocks(w router.WorkerID) int {
	if i, ok := s.byWorker[w]; ok && s.engines[i] != nil {
		return s.engines[i].PinnedBlocks()
	}
	return 0
}
