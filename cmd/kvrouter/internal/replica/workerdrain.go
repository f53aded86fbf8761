package replica

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/router"
)

// Draining workers (issue 29 item 2; not to be confused with drain.go,
// this replica's own shutdown).
//
// POST /workers/drain commits fsm.SetWorkerDrain (command 16) to the group
// that registers the worker (the control group unsharded, else the
// worker's data group: the drain flag lives in the registration it
// qualifies). From the log index it applies at, every replica's routers
// leave the worker out of their candidate sets (undrained, at the one
// place candidate sets are built: Router, refresh, Disagg); requests
// already running there finish. The leader of that group (watchDrains)
// completes the drain — fsm.SetWorkerDrain{Deregister}, which removes the
// worker only while it is still drained, so a completion proposed twice
// (a leader failing over between proposing and hearing the outcome) or
// after an undrain changes nothing — once the worker has had no active
// request for drainIdleGrace in the leader's view (its own bookings and
// every other replica's, replica sync), or once its deadline passed.

// drainIdleGrace: how long a drained worker must stay idle in the
// leader's view before it is deregistered. A replica that routed to it
// just before applying the drain announces that booking over replica sync
// within milliseconds; and a replica that has just become leader learns
// the other replicas' running requests from their full snapshots, sent
// every second (eventbus.SyncConfig.FullInterval): three seconds cover
// both with room for a late snapshot.
const drainIdleGrace = 3 * time.Second

// drainCheckEvery: how often the leader looks at its drained workers.
const drainCheckEvery = 250 * time.Millisecond

// drains is every drained worker, each from the group that owns it
// (groupOf), sorted by id.
func (r *replica) drains() []fsm.WorkerDrain {
	return mergeRanks(r, (*fsm.FSM).Drains, func(d fsm.WorkerDrain) router.WorkerID { return router.WorkerID(d.Worker) })
}

// drainedSet is drains by worker id (nil when none: the common case costs
// one read per owner group).
func (r *replica) drainedSet() map[string]fsm.WorkerDrain {
	ds := r.drains()
	if len(ds) == 0 {
		return nil
	}
	m := make(map[string]fsm.WorkerDrain, len(ds))
	for _, d := range ds {
		m[d.Worker] = d
	}
	return m
}

// undrained drops the ranks of drained workers from a candidate list: the
// one filter that keeps new requests off a drained worker on this
// replica. Their bookings stay in the routers' load until they end.
func (r *replica) undrained(ws []router.RoleWorker) []router.RoleWorker {
	drained := r.drainedSet()
	if drained == nil {
		return ws
	}
	out := make([]router.RoleWorker, 0, len(ws))
	for _, w := range ws {
		if _, ok := drained[baseID(w.ID)]; !ok {
			out = append(out, w)
		}
	}
	return out
}

func baseID(id router.WorkerID) string {
	s := string(id)
	for i := 0; i < len(s); i++ {
		if s[i] == '#' {
			return s[:i]
		}
	}
	return s
}

// DrainWorker drains worker id (api.WorkerDrainer); a zero deadline is
// none. It returns once this replica applied the drain.
func (r *replica) DrainWorker(ctx context.Context, id string, deadline time.Time) error {
	c := fsm.SetWorkerDrain{Worker: id, Drained: true}
	if !deadline.IsZero() {
		c.Deadline = deadline.UnixNano()
	}
	return r.proposeDrain(ctx, c)
}

// UndrainWorker reverses a drain not completed yet (api.WorkerDrainer).
func (r *replica) UndrainWorker(ctx context.Context, id string) error {
	return r.proposeDrain(ctx, fsm.SetWorkerDrain{Worker: id})
}

// proposeDrain validates c against the owner group's state and the clock,
// commits it there and waits until this replica applied it.
func (r *replica) proposeDrain(ctx context.Context, c fsm.SetWorkerDrain) error {
	if err := c.Validate(); err != nil {
		return fmt.Errorf("%w: %v", api.ErrInvalid, err)
	}
	g, placed := r.groupOf(c.Worker)
	if _, ok := r.worker(c.Worker); !ok || !placed {
		return fmt.Errorf("%w: worker %q is not registered", api.ErrUnknownWorker, c.Worker)
	}
	if r.sharded() {
		if p, _ := r.fsm.Placement(c.Worker); int(p) != g.id {
			// A drain committed to the group a move leaves would be lost
			// with its registration.
			return fmt.Errorf("%w: worker %q is moving from group %d to %d: drain it once the move is done", api.ErrInvalid, c.Worker, g.id, p)
		}
	}
	if err := g.fsm.CheckWorkerDrain(c); err != nil {
		return drainError(err)
	}
	if err := fsm.CheckTime(c, time.Now().UnixNano()); err != nil {
		return fmt.Errorf("%w: %v", api.ErrInvalid, err)
	}
	b, err := fsm.EncodeSetWorkerDrain(c)
	if err != nil {
		return fmt.Errorf("%w: %v", api.ErrInvalid, err)
	}
	if err := r.proposeOn(ctx, g, b); err != nil {
		return drainError(err)
	}
	r.waitAppliedOn(ctx, g)
	return nil
}

// drainError maps the FSM's refusals onto the API's errors.
func drainError(err error) error {
	if errors.Is(err, fsm.ErrUnknownWorker) {
		return fmt.Errorf("%w: %v", api.ErrUnknownWorker, err)
	}
	return apiError(err)
}

// watchDrains runs on group g's leader while it leads: it completes the
// drains of g's workers that are idle or past their deadline. idleSince is
// this leader's own observation; a new leader starts observing afresh
// (the grace starts again, the completion still happens once).
func (r *replica) watchDrains(ctx context.Context, g *dataGroup) {
	t := time.NewTicker(drainCheckEvery)
	defer t.Stop()
	idleSince := map[string]time.Time{}
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			r.completeDrains(ctx, g, now, idleSince)
		}
	}
}

// completeDrains is one pass of watchDrains.
func (r *replica) completeDrains(ctx context.Context, g *dataGroup, now time.Time, idleSince map[string]time.Time) {
	ds := g.fsm.Drains()
	seen := make(map[string]bool, len(ds))
	for _, d := range ds {
		seen[d.Worker] = true
		if at, ok := r.groupOf(d.Worker); !ok || at != g {
			continue // moving: the group it moves from keeps it
		}
		w, ok := g.fsm.Worker(d.Worker)
		if !ok {
			continue
		}
		var reason string
		active := r.activeRequests(w)
		switch {
		case d.Deadline != 0 && now.UnixNano() >= d.Deadline:
			reason = fmt.Sprintf("deadline passed with %d requests running", active)
		case active > 0:
			delete(idleSince, d.Worker)
			continue
		default:
			since, ok := idleSince[d.Worker]
			if !ok {
				idleSince[d.Worker] = now
				continue
			}
			if now.Sub(since) < drainIdleGrace {
				continue
			}
			reason = "idle"
		}
		b, err := fsm.EncodeSetWorkerDrain(fsm.SetWorkerDrain{Worker: d.Worker, Drained: true, Deregister: true})
		if err == nil {
			err = r.proposeOn(ctx, g, b)
		}
		switch {
		case err == nil:
			r.log.Info("drain complete: worker deregistered", "worker", d.Worker, "reason", reason, "group", g.id)
			delete(idleSince, d.Worker)
		case errors.Is(err, fsm.ErrNotDrained), errors.Is(err, fsm.ErrUnknownWorker):
			delete(idleSince, d.Worker) // undrained or gone meanwhile: nothing to complete
		case ctx.Err() == nil:
			r.log.Warn("drain completion failed; retrying", "worker", d.Worker, "err", err)
		}
	}
	for w := range idleSince {
		if !seen[w] {
			delete(idleSince, w)
		}
	}
}

// activeRequests is the requests running on any rank of w in this
// replica's view: its own bookings and every other replica's (replica
// sync), over every router (aggregated and disaggregated stages).
func (r *replica) activeRequests(w fsm.WorkerRecord) int {
	n := 0
	keys := w.Keys()
	r.eachRouter(func(rt *router.Router) {
		for _, k := range keys {
			n += rt.Load().Load(k).Requests
		}
	})
	return n
}

// drainFields marks a drained worker's /cluster/status entry.
func drainFields(drained map[string]fsm.WorkerDrain, id string, entry map[string]any) {
	d, ok := drained[id]
	entry["drained"] = ok
	if ok && d.Deadline != 0 {
		entry["drain_deadline"] = time.Unix(0, d.Deadline).UTC().Format(time.RFC3339Nano)
	}
}

// FleetWorkers is every registered worker with its cache in the index
// and its drain (api.FleetReader, for GET /fleet/plan).
func (r *replica) FleetWorkers() []api.FleetWorker {
	drained := r.drainedSet()
	src := r.overlaps()
	stats, _ := src.(router.CacheStats)
	var out []api.FleetWorker
	for _, w := range r.workers() {
		fw := api.FleetWorker{ID: w.ID, Model: w.Model, BlockSize: w.BlockSize, TotalBlocks: w.TotalBlocks * int(w.DPRanks),
			Ranks: w.Keys(), ActiveRequests: r.activeRequests(w)}
		if stats != nil {
			for _, k := range fw.Ranks {
				held, unique := stats.CacheCounts(k)
				fw.HeldBlocks += held
				fw.UniqueBlocks += unique
			}
		}
		if d, ok := drained[w.ID]; ok {
			fw.Drained = true
			if d.Deadline != 0 {
				fw.DrainDeadline = time.Unix(0, d.Deadline)
			}
		}
		out = append(out, fw)
	}
	return out
}

// drainHooks are the functions told of each drain applied here
// (api.DrainWatcher: the API's drain copies, --router-drain-shadow).
type drainHooks struct {
	mu  sync.Mutex
	fns []func(worker string)
}

// OnWorkerDrained registers fn, called with the worker's id each time a
// drain of it is applied on this replica (the log's order, the routers
// already without it). A drain replayed from the log at start-up calls it
// too; the API then holds nothing to copy.
func (r *replica) OnWorkerDrained(fn func(worker string)) {
	r.drained.mu.Lock()
	defer r.drained.mu.Unlock()
	r.drained.fns = append(r.drained.fns, fn)
}

func (h *drainHooks) notify(worker string) {
	h.mu.Lock()
	fns := slices.Clone(h.fns)
	h.mu.Unlock()
	for _, fn := range fns {
		fn(worker)
	}
}

var (
	_ api.DrainWatcher  = (*replica)(nil)
	_ api.WorkerDrainer = (*replica)(nil)
	_ api.FleetReader   = (*replica)(nil)
)
