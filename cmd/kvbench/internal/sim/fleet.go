package sim

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/internal/fleetplan"
	"github.com/kvrouter/kvrouter/router"
)

// Fleet events (issue 29 item 5): a worker removed, drained or added at a
// virtual time.
//
//   - remove: the worker leaves at once with its cache. Its running and
//     queued requests are re-sent at that instant through the routers (the
//     client's retry, or a proxy's), keeping their first send time, so the
//     loss shows in their TTFT; the routers forget their bookings there and
//     the index forgets its blocks.
//   - drain: the worker takes no new request from that instant (the
//     routers drop it from their candidates), its running and queued
//     requests finish there, and it leaves (cache and index entries gone)
//     when it is idle.
//   - drain-sessions: a drain that keeps the worker's bound sessions
//     (session affinity) there until they end; it leaves when idle and no
//     session bound there has a turn to come.
//   - drain-shadow: a drain that moves the bound sessions by shadow
//     prefill (shadow.go).
//   - add: a worker with the first worker's capacity joins, cold.
//
// Sessions bound to a worker that leaves or drains rebind at their next
// turn (affinity.go). Which worker a remove or drain takes is a Chooser's.

// EventKind is what a fleet event does.
type EventKind string

// Fleet event kinds.
const (
	EventRemove EventKind = "remove"
	EventDrain  EventKind = "drain"
	// EventDrainSessions drains but keeps serving the sessions bound to
	// the worker (session affinity) until they end: no new session and no
	// unbound request goes there; it leaves when idle with no bound
	// session left to come back.
	EventDrainSessions EventKind = "drain-sessions"
	// EventDrainShadow drains and moves the worker's bound sessions by
	// shadow prefill (shadow.go): a bound turn still runs there while a
	// copy of it fills the session's new worker, and the session moves
	// when the copy is there; it leaves when idle and every session whose
	// latest turn ran there has moved or ended.
	EventDrainShadow EventKind = "drain-shadow"
	EventAdd         EventKind = "add"
)

// Chooser picks the worker a remove or drain takes.
type Chooser string

// Choosers.
const (
	// ChooserPlan takes the cheapest worker to remove by the fleet
	// plan's cost model (internal/fleetplan, what GET /fleet/plan ranks
	// by): its recent cached tokens times the share of its blocks no
	// other worker holds, plus a little for its unique cold blocks.
	ChooserPlan Chooser = "plan"
	// ChooserRandom takes a worker uniformly at random (seeded by the run).
	ChooserRandom Chooser = "random"
	// ChooserLeastLoaded takes the worker with the fewest running and
	// waiting requests (the lowest index among equals).
	ChooserLeastLoaded Chooser = "least-loaded"
)

// Choosers lists the choosers by name.
var Choosers = []Chooser{ChooserPlan, ChooserRandom, ChooserLeastLoaded}

// ChooserIDPrefix names one worker: "id:w3" takes w3 (when it still takes
// requests), so a sweep over every worker finds what the best choice would
// have lost (the bound any ranking is measured against).
const ChooserIDPrefix = "id:"

// Valid reports whether c is a known chooser or names a worker.
func (c Chooser) Valid() bool {
	if name, ok := strings.CutPrefix(string(c), ChooserIDPrefix); ok {
		return name != ""
	}
	return slices.Contains(Choosers, c)
}

// FleetEvent is one change of the fleet at At.
type FleetEvent struct {
	At      time.Duration
	Kind    EventKind
	Chooser Chooser // remove and drain
}

// EventRecord is what a fleet event did.
type EventRecord struct {
	FleetEvent
	// Worker is the worker removed, drained or added (-1: none, when only
	// one worker was left to route to).
	Worker int
	// Resent counts the requests a removal re-sent.
	Resent int
	// Sessions are the sessions with turns still to come whose latest
	// turn before the event ran on the worker (remove and drain).
	Sessions []int
	// Left is when a drained worker left (-1: still draining at the end).
	Left time.Duration
	// Steered (add, with Config.WarmUp) counts the requests the warm-up
	// sent to the worker on purpose; WarmUpEnd is when it found the
	// worker warm and stopped (-1: it never did).
	Steered   int
	WarmUpEnd time.Duration
	// Shadow prefills (drain-shadow; add with Config.ShadowWarmUp;
	// shadow.go): copies sent, skipped for want of room, sessions rebound
	// when their copy ended; the prompt tokens the copies carried, those
	// their engines computed, and that prefill's time as steps of their
	// own (an upper bound: batched with other work it costs less).
	Shadows, ShadowSkipped, ShadowRebinds int
	// ShadowRedirects (shadow warm-up): requests routed to the warming
	// worker without its prefix that went to the best holder instead,
	// their copy sent to the warming worker.
	ShadowRedirects int
	// ShadowUsed (shadow warm-up): requests whose prefix a copy had
	// brought to the warming worker, sent there though the policy picked
	// another holder (shadow.go, useCopy).
	ShadowUsed                              int
	ShadowPromptTokens, ShadowPrefillTokens int64
	ShadowPrefillTime                       time.Duration
}

// PlanWindow is how far back the plan chooser counts each worker's cached
// tokens (the replica's longest hit-rate window, which GET /fleet/plan
// reads its hits per second from).
const PlanWindow = 10 * time.Minute

// added is how many workers the events add.
func (c *Config) added() int {
	n := 0
	for _, e := range c.Events {
		if e.Kind == EventAdd {
			n++
		}
	}
	return n
}

// checkFleet refuses impossible events and affinity settings.
func (c *Config) checkFleet() error {
	if err := c.Affinity.check(); err != nil {
		return err
	}
	if w := c.WarmUp; w != nil && (c.added() == 0 || !(w.Share > 0 && w.Share <= 1) || !(w.Headroom > 0)) {
		return fmt.Errorf("warm-up %+v needs an add event, a share in (0,1] and a positive headroom: %w", *w, ErrConfig)
	}
	if c.ShadowWarmUp && (c.added() == 0 || c.WarmUp != nil) {
		return fmt.Errorf("the shadow warm-up needs an add event and no steering warm-up: %w", ErrConfig)
	}
	if err := c.Shadow.check(); err != nil {
		return err
	}
	if c.Peer != nil && (len(c.Events) > 0 || c.Affinity.Mode != AffinityOff) {
		return fmt.Errorf("fleet events and session affinity act on our routers, not on a peer's: %w", ErrConfig)
	}
	for k, e := range c.Events {
		if e.At < 0 || (k > 0 && e.At < c.Events[k-1].At) {
			return fmt.Errorf("fleet event %d at %v: events go in time order from 0: %w", k, e.At, ErrConfig)
		}
		switch e.Kind {
		case EventAdd:
		case EventRemove, EventDrain, EventDrainSessions, EventDrainShadow:
			if !e.Chooser.Valid() {
				return fmt.Errorf("fleet event %d: chooser %q: %w", k, e.Chooser, ErrConfig)
			}
		default:
			return fmt.Errorf("fleet event %d: kind %q: %w", k, e.Kind, ErrConfig)
		}
	}
	return nil
}

// fleetState is the fleet's changes during a run. Without events it only
// keeps every worker present and counts nothing.
type fleetState struct {
	events    []FleetEvent
	nextEvent int
	records   []EventRecord
	present   []bool // in the fleet (added workers: from their event)
	gone      []bool // left
	draining  []bool
	// keeping: a drain-sessions worker: still a router candidate (bound
	// turns go there), excluded from every other decision.
	keeping  []bool
	inflight []int          // requests submitted to the worker and not finished
	resent   []bool         // per request: re-sent after its worker was removed
	lastTurn map[int]int    // session → its latest turn routed
	nextSlot int            // the slot the next add takes
	stats    []engine.Stats // per worker: its engine's totals when it left
	rng      *rand.Rand
	ids      []router.WorkerID // scratch: routable ids
}

func (f *fleetState) init(s *state, n int) {
	f.events = s.cfg.Events
	f.present = make([]bool, n)
	f.gone = make([]bool, n)
	f.draining = make([]bool, n)
	f.keeping = make([]bool, n)
	f.inflight = make([]int, n)
	f.stats = make([]engine.Stats, n)
	f.resent = make([]bool, len(s.w.Requests))
	for i := range s.cfg.Workers {
		f.present[i] = true
	}
	f.nextSlot = s.cfg.Workers
	if len(f.events) == 0 {
		return
	}
	f.lastTurn = map[int]int{}
	f.rng = rand.New(rand.NewPCG(s.cfg.Seed, 0x666c656574))
}

// routable reports whether worker wi takes new requests.
func (f *fleetState) routable(wi int) bool { return f.present[wi] && !f.gone[wi] && !f.draining[wi] }

// routableIDs are the ids of the workers that take new requests (scratch:
// valid until the next call).
func (f *fleetState) routableIDs(s *state) []router.WorkerID {
	f.ids = f.ids[:0]
	for wi, id := range s.ids {
		if f.routable(wi) {
			f.ids = append(f.ids, id)
		}
	}
	return f.ids
}

// next is the next event's time; false when none is left.
func (f *fleetState) next() (time.Duration, bool) {
	if f.nextEvent < len(f.events) {
		return f.events[f.nextEvent].At, true
	}
	return 0, false
}

// due applies the events due by t.
func (f *fleetState) due(s *state, t time.Duration) {
	for f.nextEvent < len(f.events) && f.events[f.nextEvent].At <= t {
		e := f.events[f.nextEvent]
		f.nextEvent++
		rec := EventRecord{FleetEvent: e, Worker: -1, Left: -1, WarmUpEnd: -1}
		switch e.Kind {
		case EventAdd:
			rec.Worker = f.add(s)
			s.warm.start(s, rec.Worker, len(f.records))
		case EventRemove, EventDrain, EventDrainSessions, EventDrainShadow:
			wi := f.choose(s, e.Chooser)
			if wi < 0 {
				break
			}
			rec.Worker = wi
			for sess, last := range f.lastTurn {
				if s.res[last].Worker == wi && s.w.Requests[last].NextTurn >= 0 {
					rec.Sessions = append(rec.Sessions, sess)
				}
			}
			slices.Sort(rec.Sessions)
			switch e.Kind {
			case EventDrain:
				f.draining[wi] = true
				f.setWorkers(s)
			case EventDrainSessions, EventDrainShadow:
				f.draining[wi], f.keeping[wi] = true, true
				f.setWorkers(s)
			default:
				rec.Resent = f.remove(s, wi)
			}
		}
		f.records = append(f.records, rec)
		if e.Kind == EventDrainShadow && rec.Worker >= 0 && s.shadow.policy.Eager {
			s.shadow.copyAll(s, len(f.records)-1)
		}
	}
}

// choose is the worker chooser c takes; -1 when fewer than two workers
// take requests (the fleet is not emptied).
func (f *fleetState) choose(s *state, c Chooser) int {
	cands := slices.Clone(f.routableIDs(s))
	if len(cands) < 2 {
		return -1
	}
	if name, ok := strings.CutPrefix(string(c), ChooserIDPrefix); ok {
		if wi, ok := s.byWorker[router.WorkerID(name)]; ok && f.routable(wi) {
			return wi
		}
		return -1
	}
	switch c {
	case ChooserRandom:
		return s.byWorker[cands[f.rng.IntN(len(cands))]]
	case ChooserLeastLoaded:
		best, load := -1, 0
		for _, id := range cands {
			wi := s.byWorker[id]
			st := s.engines[wi].Stats()
			if l := st.Running + st.Waiting; best < 0 || l < load {
				best, load = wi, l
			}
		}
		return best
	}
	return s.byWorker[cands[planCheapest(s, cands)]]
}

// planCheapest is the index in cands of the worker the fleet plan ranks
// cheapest to remove: fleetplan's cost on what the index holds (held and
// unique blocks) and the cached tokens each served per second over the
// last PlanWindow, as the router's replicas measure them.
func planCheapest(s *state, cands []router.WorkerID) int {
	from := max(s.now-PlanWindow, 0)
	cached := make(map[int]float64, len(cands))
	for _, rr := range s.res {
		if rr.Worker >= 0 && rr.FirstToken > 0 && rr.Sent >= from && rr.Sent < s.now {
			cached[rr.Worker] += float64(rr.CachedTokens)
		}
	}
	ws := make([]fleetplan.Worker, len(cands))
	for k, id := range cands {
		held, unique := s.index.CacheCounts(id)
		ws[k] = fleetplan.Worker{ID: string(id), BlockSize: s.w.BlockSize, HeldBlocks: held, UniqueBlocks: unique}
		if secs := (s.now - from).Seconds(); secs > 0 {
			ws[k].CachedTokensPerS = cached[s.byWorker[id]] / secs
		}
	}
	return fleetplan.Rank(ws)[0]
}

// remove takes worker wi out at once and re-sends what ran or waited there.
func (f *fleetState) remove(s *state, wi int) int {
	resent := 0
	for j := range s.res {
		rr := &s.res[j]
		if rr.Worker != wi || rr.Done || rr.Err != "" {
			continue
		}
		id := s.w.Requests[j].ID
		s.rts[s.owner[j]].Free(id)
		s.announce(s.owner[j], syncMsg{kind: syncFree, id: id})
		rr.Worker, rr.FirstToken, rr.CachedTokens, rr.ResentAt = -1, 0, 0, s.now
		f.resent[j] = true
		s.push(s.now, j)
		resent++
	}
	f.inflight[wi] = 0
	f.leave(s, wi)
	return resent
}

// leave drops worker wi: its engine, its index entries, its candidacy.
func (f *fleetState) leave(s *state, wi int) {
	f.gone[wi] = true
	f.stats[wi] = s.engines[wi].Stats()
	s.engines[wi] = nil
	s.busy[wi], s.dirty[wi] = false, false
	s.index.RemoveWorker(s.ids[wi])
	s.warm.left(s, wi)
	s.shadow.left(s, wi)
	f.setWorkers(s)
}

// leaveIdle lets drained workers with nothing left to run leave.
func (f *fleetState) leaveIdle(s *state) {
	for k := range f.records {
		rec := &f.records[k]
		if !rec.Kind.drains() || rec.Worker < 0 || f.gone[rec.Worker] || f.inflight[rec.Worker] > 0 {
			continue
		}
		if rec.Kind == EventDrainSessions && f.sessionsToCome(s, rec.Worker) {
			continue
		}
		if rec.Kind == EventDrainShadow && f.boundToCome(s, rec.Worker) {
			continue
		}
		rec.Left = s.now
		f.leave(s, rec.Worker)
	}
}

// sessionsToCome reports whether a session bound to worker wi (its latest
// turn ran there) has a turn still to come.
func (f *fleetState) sessionsToCome(s *state, wi int) bool {
	if s.cfg.Affinity.Mode == AffinityOff {
		return false
	}
	for _, last := range f.lastTurn {
		if s.res[last].Worker == wi && s.w.Requests[last].NextTurn >= 0 {
			return true
		}
	}
	return false
}

// boundToCome reports whether a session whose latest turn ran on worker
// wi, with a turn still to come, has not moved away by its copy (shadow.go).
func (f *fleetState) boundToCome(s *state, wi int) bool {
	if s.cfg.Affinity.Mode == AffinityOff {
		return false
	}
	for sess, last := range f.lastTurn {
		if _, moved := s.shadow.moved[sess]; !moved && s.res[last].Worker == wi && s.w.Requests[last].NextTurn >= 0 {
			return true
		}
	}
	return false
}

// drainRecord is the index of the drain-shadow event that drains worker
// wi; -1 when none does.
func (f *fleetState) drainRecord(wi int) int {
	for k := range f.records {
		if f.records[k].Kind == EventDrainShadow && f.records[k].Worker == wi {
			return k
		}
	}
	return -1
}

// drains reports whether an event of kind k drains its worker.
func (k EventKind) drains() bool {
	return k == EventDrain || k == EventDrainSessions || k == EventDrainShadow
}

// keepingIDs are the drain-sessions workers still in the fleet (scratch).
func (f *fleetState) keepingIDs(s *state) []router.WorkerID {
	var ids []router.WorkerID
	for wi, k := range f.keeping {
		if k && !f.gone[wi] {
			ids = append(ids, s.ids[wi])
		}
	}
	return ids
}

// add brings the next added worker in, cold.
func (f *fleetState) add(s *state) int {
	wi := f.nextSlot
	f.nextSlot++
	if _, err := s.newEngine(wi); err != nil {
		return -1 // the template built every other worker: cannot happen
	}
	f.present[wi] = true
	s.index.AddWorker(s.ids[wi])
	s.warm.joined(s, wi)
	f.setWorkers(s)
	return wi
}

// setWorkers gives every router the workers that take requests, as the
// registry's change reaches every replica.
func (f *fleetState) setWorkers(s *state) {
	var infos []router.WorkerInfo
	for wi, id := range s.ids {
		if f.routable(wi) || (f.keeping[wi] && !f.gone[wi]) {
			infos = append(infos, router.WorkerInfo{ID: id, TotalBlocks: s.capacity(wi), MaxBatchedTokens: s.engines[wi].Config().MaxBatchedTokens})
		}
	}
	for _, rt := range s.rts {
		rt.SetWorkers(infos)
	}
}

// submitted notes request i running on worker wi.
func (f *fleetState) submitted(s *state, i, wi int) {
	f.inflight[wi]++
	if f.lastTurn != nil {
		if sess := s.w.Requests[i].Session; sess != workload.NoSession {
			f.lastTurn[sess] = i
		}
	}
}

// finished notes a request's end on worker wi.
func (f *fleetState) finished(wi int) { f.inflight[wi]-- }
