package sim

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/kvrouter/kvrouter/api/tenant"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/router"
)

// The routers' admission queue and tenant fairness (issue 28 items 3–4),
// as kvrouter's replicas run them (api/queue.go), over the same code: each
// simulated router has a router.Queue (strict class, then the tenants'
// fair order, then the policy) and, with tenants, a tenant.Ledger (the
// virtual token counters, the lift, the yield rule with its MaxYield).
//
//   - A request arriving at a router is counted in its tenant's requests in
//     flight (Ledger.Begin) and passes at once only when nobody waits there
//     and the router's load view has a worker at or below the queue
//     threshold (Router.ShouldQueue); otherwise it waits in the queue.
//   - At every instant something happens (a prefill ends, a free or a
//     booking arrives from another router, a tenant report arrives), each
//     router in turn admits its queue's head while its view has room and
//     the head does not hold back for a lower tenant waiting on another
//     router (Ledger.Hold); the router that looks first rotates, as the
//     replicas race for freed capacity.
//   - A tenant is charged, on the router that routed the request, the
//     uncached prompt tokens of the decision (prompt − overlap × block
//     size) and its output tokens when it finishes (the live router
//     charges them as they stream; the sum is the same).
//   - With Tenants.LatencyGuard, a request whose tenant is over its share
//     (Ledger.Guard) also waits while its router predicts every worker over
//     the factor for a fresh request (Router.LatencyGuard), and is routed
//     among the workers within it only (route adds the others to its
//     Exclude); the routers learn the prediction's rates
//     (router.Config.LearnLatency).
//   - With Tenants.Isolation, a request whose tenant is over its share
//     also waits while every worker but the reserved ones
//     (tenant.Ledger.Isolation, tenant.ReservedWorkers) is over its window
//     (Router.ShouldQueueExcept), and is routed among those only; a request
//     of a tenant under its share is routed among the reserved workers
//     while one has room (its preference), else among all.
//   - Counters shared: every router publishes its ledger's Usage every
//     SyncInterval and at once when a tenant starts waiting there (the
//     Syncer's nudge); the others apply it (Ledger.Remote) SyncDelay later,
//     the replica sync lag of the load views. Counters local: no router
//     hears another's, as llm-d's per-replica flow control.

// TenantSpec is one tenant of a run: its name, its relative arrival-rate
// weight (each request is its with probability weight ÷ the weights'
// sum), and the router its requests reach (-1: round-robin over every
// router, as the balancer spreads them; k: router k only, a client whose
// connections the balancer keeps on one replica).
type TenantSpec struct {
	Name   string  `json:"name"`
	Weight float64 `json:"weight"`
	Router int     `json:"router"`
}

// TenantCounters says whether the routers share their tenant counters.
type TenantCounters string

// Counter modes (--tenant-counters).
const (
	CountersShared TenantCounters = "shared" // replica sync carries them (kvrouter)
	CountersLocal  TenantCounters = "local"  // each router its own (llm-d's flow control)
)

// Tenants configures tenant fairness in the routers; the zero value (no
// Specs) is off.
type Tenants struct {
	Specs    []TenantSpec
	Counters TenantCounters // "" is shared
	// SyncInterval is how often a router publishes its counters (0: the
	// live default, 100 ms); a tenant starting to wait publishes at once.
	SyncInterval time.Duration
	// Burst and Slack are the ledgers' (0: tenant.Config's defaults).
	Burst, Slack float64
	// Headroom holds a tenant over its share, while others are active, to
	// its share of each worker's admission window (tenant.Ledger.Window).
	Headroom bool
	// EnginePriority: each request carries to its engine the priority its
	// router's ledger gives its tenant at dispatch
	// (tenant.Ledger.EnginePriority); the engines need a priority
	// scheduling policy (engine.Config.Scheduling).
	EnginePriority bool
	// LatencyGuard (0: off; else a factor ≥ 1): a request of a tenant
	// over its share goes only to a worker where its router predicts a
	// fresh request's TTFT and TPOT within the factor × their idle values
	// (tenant.Ledger.Guard, router.Router.LatencyGuard); with none, it
	// waits in its router's queue. The routers learn the rates it
	// predicts from (router.Config.LearnLatency).
	LatencyGuard float64
	// Isolation (0: off; else a safety factor ≥ 1): while a tenant is over
	// its share, its routers keep its requests off the workers the ledger
	// reserves for the tenants under theirs, who prefer them
	// (tenant.Ledger.Isolation, tenant.ReservedWorkers).
	Isolation float64
}

// DefaultTenantSyncInterval is kvrouter serve's --tenant-sync-interval.
const DefaultTenantSyncInterval = 100 * time.Millisecond

// tenantModel is the one model of a simulated fleet, as the ledger keys it.
const tenantModel = "sim"

func (t *Tenants) on() bool { return len(t.Specs) > 0 }

// check refuses impossible tenant settings.
func (c *Config) checkTenants() error {
	t := &c.Tenants
	if !t.on() {
		return nil
	}
	if c.Router.QueueThreshold == nil {
		return fmt.Errorf("tenants need the routers' admission queue (a queue threshold): %w", ErrConfig)
	}
	if c.Peer != nil {
		return fmt.Errorf("tenants act on our routers, not on a peer's: %w", ErrConfig)
	}
	switch t.Counters {
	case "", CountersShared, CountersLocal:
	default:
		return fmt.Errorf("tenant counters %q: %w", t.Counters, ErrConfig)
	}
	if t.SyncInterval < 0 {
		return fmt.Errorf("tenant sync interval %v: %w", t.SyncInterval, ErrConfig)
	}
	if err := router.ValidateLatencyGuard(t.LatencyGuard); err != nil {
		return fmt.Errorf("tenants: %v: %w", err, ErrConfig)
	}
	if !tenant.ValidateIsolation(t.Isolation) || t.Isolation != t.Isolation {
		return fmt.Errorf("tenant isolation %v: want 0 or a finite factor of at least 1: %w", t.Isolation, ErrConfig)
	}
	seen := map[string]bool{}
	for _, sp := range t.Specs {
		if sp.Name == "" || seen[sp.Name] || !(sp.Weight > 0) || sp.Router < -1 || sp.Router >= max(c.Routers, 1) {
			return fmt.Errorf("tenant %+v: a new name, a positive weight and a router in [0, %d) or -1: %w", sp, max(c.Routers, 1), ErrConfig)
		}
		seen[sp.Name] = true
	}
	return nil
}

// admissionState is the routers' queues and ledgers.
type admissionState struct {
	on      bool // a queue threshold is set: the routers queue
	queues  []*router.Queue
	ledgers []*tenant.Ledger // nil without tenants
	shared  bool             // counters travel between routers
	every   time.Duration    // counter publication interval
	// nextPublish is the next periodic publication (shared counters).
	nextPublish time.Duration
	// wakeAt is the earliest time a held head's MaxYield runs out (-1: none).
	wakeAt time.Duration
	turn   int // the router that looks first at the next admission pass

	tenantOf  []int          // per request: its tenant, an index into specs
	begun     []bool         // per request: counted in its tenant's in-flight requests
	holdSince []time.Time    // per request: when it began holding back at the head
	waiting   []int          // per tenant: requests queued over every router
	rr        int            // round-robin counter of unpinned requests
	acc       []TenantTotals // per tenant
	backlog   time.Duration  // time every tenant had a request queued
	since     time.Duration  // when the current all-backlogged stretch began (-1: not in one)
	specs     []TenantSpec
}

// TenantTotals is one tenant's tokens over a run.
type TenantTotals struct {
	Name string
	// Tokens are the tokens charged to the tenant (uncached prompt at
	// routing, output at the end); Backlogged those charged while every
	// tenant had a request queued somewhere.
	Tokens, Backlogged int64
}

func (a *admissionState) init(s *state) error {
	a.wakeAt = -1
	a.since = -1
	cfg := s.cfg
	a.on = cfg.Router.QueueThreshold != nil && cfg.Peer == nil
	if !a.on {
		return nil
	}
	for range s.rts {
		a.queues = append(a.queues, router.NewQueue(cfg.Router.QueuePolicy))
	}
	t := cfg.Tenants
	if !t.on() {
		return nil
	}
	if t.EnginePriority && (cfg.Engine.Scheduling == "" || cfg.Engine.Scheduling == engine.SchedulingFCFS) {
		return fmt.Errorf("tenant engine priority needs a priority scheduling policy in the engines (an fcfs engine refuses a non-zero priority, as vLLM does): %w", ErrConfig)
	}
	a.specs = t.Specs
	a.shared = t.Counters != CountersLocal && len(s.rts) > 1
	a.every = t.SyncInterval
	if a.every <= 0 {
		a.every = DefaultTenantSyncInterval
	}
	a.nextPublish = a.every
	for k := range s.rts {
		l, err := tenant.New(tenant.Config{From: tenant.SourceHeader, Burst: t.Burst, Slack: t.Slack, Headroom: t.Headroom,
			LatencyGuard: t.LatencyGuard, Isolation: t.Isolation, Now: func() time.Time { return epoch.Add(s.now) }})
		if err != nil {
			return fmt.Errorf("router %d's tenant ledger: %v: %w", k, err, ErrConfig)
		}
		a.ledgers = append(a.ledgers, l)
		a.queues[k].SetFairness(l.Less(tenantModel))
	}
	a.begun = make([]bool, len(s.w.Requests))
	a.holdSince = make([]time.Time, len(s.w.Requests))
	a.waiting = make([]int, len(t.Specs))
	for _, sp := range t.Specs {
		a.acc = append(a.acc, TenantTotals{Name: sp.Name})
	}
	if s.w.TenantOf != nil {
		return a.streamTenants(s.w)
	}
	// Each request's tenant, drawn by weight: independent draws split
	// an arrival process into one per tenant at rates ∝ the weights (a
	// workload of per-tenant streams, above, carries its own). A
	// session's turns (and its subagents') are its top-level session's
	// tenant's: one client's conversation.
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x74656e616e74))
	sum := 0.0
	for _, sp := range t.Specs {
		sum += sp.Weight
	}
	draw := func() int {
		x, k := rng.Float64()*sum, 0
		for k < len(t.Specs)-1 && x >= t.Specs[k].Weight {
			x -= t.Specs[k].Weight
			k++
		}
		return k
	}
	bySession := map[int]int{}
	a.tenantOf = make([]int, len(s.w.Requests))
	for i, r := range s.w.Requests {
		if r.Session == workload.NoSession {
			a.tenantOf[i] = draw()
			continue
		}
		root := r.Session
		if r.Session < len(s.w.SessionRoot) {
			root = s.w.SessionRoot[r.Session]
		}
		k, ok := bySession[root]
		if !ok {
			k = draw()
			bySession[root] = k
		}
		a.tenantOf[i] = k
	}
	return nil
}

// streamTenants takes each request's tenant from a workload of per-tenant
// streams (workload.SyntheticSpec.Tenants), whose tenants must be the
// run's, by name.
func (a *admissionState) streamTenants(w *workload.Workload) error {
	index := make(map[string]int, len(a.specs))
	for k, sp := range a.specs {
		index[sp.Name] = k
	}
	of := make([]int, len(w.Tenants))
	for j, name := range w.Tenants {
		k, ok := index[name]
		if !ok {
			return fmt.Errorf("the workload's tenant %q is not one of the run's: %w", name, ErrConfig)
		}
		of[j] = k
	}
	if len(w.TenantOf) != len(w.Requests) {
		return fmt.Errorf("the workload tags %d of its %d requests with a tenant: %w", len(w.TenantOf), len(w.Requests), ErrConfig)
	}
	a.tenantOf = make([]int, len(w.Requests))
	for i, j := range w.TenantOf {
		if j < 0 || j >= len(of) {
			return fmt.Errorf("request %d's tenant %d: not one of the workload's %d: %w", i, j, len(of), ErrConfig)
		}
		a.tenantOf[i] = of[j]
	}
	return nil
}

// tenants reports whether tenant fairness is on.
func (a *admissionState) tenants() bool { return a.ledgers != nil }

// name is request i's tenant id ("" without tenants).
func (a *admissionState) name(i int) string {
	if !a.tenants() {
		return ""
	}
	return a.specs[a.tenantOf[i]].Name
}

// pickRouter is the router request i reaches: its tenant's, or the next in
// turn (the balancer's round-robin).
func (s *state) pickRouter(i int) int {
	a := &s.adm
	if a.tenants() {
		if s.fleet.resent[i] {
			return s.owner[i] // a retry through the same router: its ledger counted it in
		}
		if k := a.specs[a.tenantOf[i]].Router; k >= 0 {
			return k
		}
		k := a.rr % len(s.rts)
		a.rr++
		return k
	}
	k := s.routed % len(s.rts)
	s.routed++
	return k
}

// arrive is request i reaching router k with the queue on: it passes at
// once when nobody waits there and the view has room, else it queues.
func (s *state) arrive(i, k int) {
	a := &s.adm
	name := a.name(i)
	if a.tenants() && !a.begun[i] {
		a.ledgers[k].Begin(tenantModel, name) // no budgets in the simulator: always admitted
		a.begun[i] = true
	}
	q := a.queues[k]
	r := &s.w.Requests[i]
	req := router.Request{ID: r.ID, Tokens: r.PromptTokens, Hashes: r.Hashes}
	if (q.Len() == 0 || s.isolationPasses(k, name)) && !s.rts[k].ShouldQueueWithin(s.window(k, name), req) && !s.isolationHolds(k, name, req) && !s.guardHolds(k, name, req) {
		s.dispatch(i, k)
		return
	}
	if a.tenants() {
		l := a.ledgers[k]
		l.Enqueue(tenantModel, name, 0)
		a.markWaiting(s, a.tenantOf[i], +1)
		select {
		case <-l.Changed(): // the Syncer publishes at once
			s.publishTenants(k)
		default:
		}
	}
	q.Push(router.Waiting{Request: req, Arrived: epoch.Add(s.now), Value: i, Tenant: name})
}

// markWaiting moves tenant t's fleet-wide queued count by d, keeping the
// all-backlogged stretches' time.
func (a *admissionState) markWaiting(s *state, t, d int) {
	was := a.allBacklogged()
	a.waiting[t] += d
	switch now := a.allBacklogged(); {
	case now && !was:
		a.since = s.now
	case was && !now:
		a.backlog += s.now - a.since
		a.since = -1
	}
}

func (a *admissionState) allBacklogged() bool {
	for _, n := range a.waiting {
		if n == 0 {
			return false
		}
	}
	return len(a.waiting) > 0
}

// charge adds tokens to request i's tenant on router k.
func (s *state) charge(i, k, tokens int) {
	a := &s.adm
	if !a.tenants() || tokens <= 0 {
		return
	}
	a.ledgers[k].Charge(tenantModel, a.name(i), tokens)
	s.res[i].Charged += tokens
	t := a.tenantOf[i]
	a.acc[t].Tokens += int64(tokens)
	if a.allBacklogged() {
		a.acc[t].Backlogged += int64(tokens)
	}
}

// ended counts request i out of its tenant's requests in flight.
func (s *state) ended(i int) {
	a := &s.adm
	if !a.tenants() || !a.begun[i] {
		return
	}
	a.begun[i] = false
	a.ledgers[s.owner[i]].End(tenantModel, a.name(i))
}

// admitQueued lets each router admit its queue's heads while its view has
// room (api/queue.go's wait loop, for every waiter at once).
func (s *state) admitQueued() {
	a := &s.adm
	if !a.on {
		return
	}
	n := len(a.queues)
	a.turn++
	for j := range n {
		k := (a.turn + j) % n
		q := a.queues[k]
		for q.Len() > 0 {
			head, _ := q.Peek()
			i := head.Value.(int)
			if s.rts[k].ShouldQueueWithin(s.window(k, head.Tenant), head.Request) || s.isolationHolds(k, head.Tenant, head.Request) || s.guardHolds(k, head.Tenant, head.Request) {
				break
			}
			if a.tenants() {
				hold, _ := a.ledgers[k].Hold(tenantModel, head.Tenant, head.Class, &a.holdSince[i])
				if hold {
					until := a.holdSince[i].Sub(epoch) + a.ledgers[k].Config().MaxYield + time.Nanosecond
					if a.wakeAt < 0 || until < a.wakeAt {
						a.wakeAt = until
					}
					break
				}
			}
			q.Drop(head)
			if a.tenants() {
				a.ledgers[k].Dequeue(tenantModel, head.Tenant, head.Class)
				a.markWaiting(s, a.tenantOf[i], -1)
			}
			s.dispatch(i, k)
		}
	}
}

// enginePriority is the priority router k gives request i's tenant on its
// way to the engine (0 without tenants or Tenants.EnginePriority off).
func (s *state) enginePriority(i, k int) int {
	a := &s.adm
	if !a.tenants() || !s.cfg.Tenants.EnginePriority {
		return 0
	}
	return a.ledgers[k].EnginePriority(tenantModel, a.name(i))
}

// guardOut is the workers router k's latency guard keeps a request of
// tenant off (tenant.Ledger.Guard: only a tenant over its share is
// guarded), and whether that is every worker left (the request waits).
func (s *state) guardOut(k int, tenant string, req router.Request) ([]router.WorkerID, bool) {
	a := &s.adm
	if !a.tenants() || s.cfg.Tenants.LatencyGuard == 0 {
		return nil, false
	}
	f := a.ledgers[k].Guard(tenantModel, tenant)
	if f == 0 {
		return nil, false
	}
	req.Exclude = s.fleet.keepingIDs(s)
	if out, over := s.isolationOut(k, tenant, req); over {
		// The guard judges the workers isolation leaves it, by the
		// first token alone (router.Router.FirstTokenGuard).
		req.Exclude = append(req.Exclude, out...)
		return s.rts[k].FirstTokenGuard(req, f, epoch.Add(s.now), nil)
	}
	return s.rts[k].LatencyGuard(req, f, epoch.Add(s.now), nil)
}

// isolationOut is the workers router k's tenant isolation keeps a request
// of tenant off: with over, the workers reserved for the tenants under
// their share (tenant is over its); else, for a tenant under its share,
// the unreserved workers while a reserved one has room for the request
// (its preference), or none.
func (s *state) isolationOut(k int, name string, req router.Request) (out []router.WorkerID, over bool) {
	a := &s.adm
	if !a.tenants() || s.cfg.Tenants.Isolation == 0 {
		return nil, false
	}
	s.isoIDs = s.rts[k].WorkerIDs(s.isoIDs[:0])
	n, over := a.ledgers[k].Isolation(tenantModel, name, len(s.isoIDs))
	if n == 0 {
		return nil, false
	}
	reserved := tenant.ReservedWorkers(tenantModel, s.isoIDs, n, nil)
	if over {
		return reserved, true
	}
	req.Exclude = s.fleet.keepingIDs(s)
	if s.cfg.Tenants.LatencyGuard > 0 {
		// Under its share, with the guard keeping the unreserved workers
		// quick to a first token: the quickest workers, the reserved
		// ones among them first (router.Router.FirstTokenOrder).
		return s.rts[k].FirstTokenOrder(req, reserved, epoch.Add(s.now), nil), false
	}
	var others []router.WorkerID
	for _, w := range s.isoIDs {
		if !slices.Contains(reserved, w) {
			others = append(others, w)
		}
	}
	if s.rts[k].ShouldQueueExcept(1, req, others) {
		return nil, false // every reserved worker is full: anywhere by cost
	}
	return others, false
}

// isolationHolds reports whether router k's tenant isolation holds a
// request of tenant in the queue now: the tenant is over its share (by the
// isolation rule and by the counters) and every worker but the reserved
// ones is over its window.
func (s *state) isolationHolds(k int, tenant string, req router.Request) bool {
	out, over := s.isolationOut(k, tenant, req)
	if !over || !s.adm.ledgers[k].MayHold(tenantModel, tenant) {
		return false // never the queue's head for the others (tenant.Ledger.MayHold)
	}
	req.Exclude = s.fleet.keepingIDs(s)
	return s.rts[k].ShouldQueueExcept(s.window(k, tenant), req, out)
}

// isolationPasses reports whether a request of tenant arriving at router
// k may pass the requests queued there (tenant.Ledger.IsolationPasses: its
// tenant is under its share while isolation reserves workers and has
// nothing queued here), when it has room now.
func (s *state) isolationPasses(k int, tenant string) bool {
	a := &s.adm
	if !a.tenants() || s.cfg.Tenants.Isolation == 0 {
		return false
	}
	return a.ledgers[k].IsolationPasses(tenantModel, tenant, len(s.rts[k].WorkerIDs(s.isoIDs[:0])))
}

// guardHolds reports whether router k's latency guard holds a request of
// tenant in the queue now.
func (s *state) guardHolds(k int, tenant string, req router.Request) bool {
	_, hold := s.guardOut(k, tenant, req)
	return hold
}

// window is the share of each worker's admission window router k gives a
// request of tenant (tenant.Ledger.Window; 1 without tenants or with
// Tenants.Headroom off).
func (s *state) window(k int, tenant string) float64 {
	if !s.adm.tenants() {
		return 1
	}
	return s.adm.ledgers[k].Window(tenantModel, tenant)
}

// publishTenants sends router k's counters to the others (shared only).
func (s *state) publishTenants(k int) {
	a := &s.adm
	if !a.shared {
		return
	}
	s.announce(k, syncMsg{kind: syncTenants, usage: a.ledgers[k].Usage()})
}

// tenantTimers runs the periodic publication and the held heads' wake
// when due at t.
func (s *state) tenantTimers(t time.Duration) {
	a := &s.adm
	if a.wakeAt >= 0 && a.wakeAt <= t {
		a.wakeAt = -1 // admitQueued sets it again if a head still holds
	}
	if a.shared && a.nextPublish <= t {
		for k := range a.ledgers {
			s.publishTenants(k)
		}
		for a.nextPublish <= t {
			a.nextPublish += a.every
		}
	}
}

// nextPublication is the next periodic publication of the counters, if
// they are shared.
func (a *admissionState) nextPublication() (time.Duration, bool) {
	return a.nextPublish, a.shared
}

// totals closes the run's tenant figures.
func (a *admissionState) totals(now time.Duration) ([]TenantTotals, time.Duration) {
	if a.since >= 0 {
		a.backlog += now - a.since
		a.since = -1
	}
	return a.acc, a.backlog
}
