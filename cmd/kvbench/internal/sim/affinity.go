package sim

import (
	"errors"
	"fmt"
	"slices"

	"github.com/kvrouter/kvrouter/router"
)

// Session affinity (issue 28), independent of the policy: a session's
// first turn is routed by the policy and binds the session to the worker
// chosen; its next turns go there (hard) or prefer it while it is not busy
// (soft). Subagents are grouped under their top-level session, as Dynamo
// groups them under X-Dynamo-Parent-Session-ID, so a whole agent tree
// shares one binding. A binding whose worker left or drains moves to the
// live worker holding most of the next turn's prefix (by the index), or,
// when none holds any, to the policy's choice.
//
// Where the bindings live is what the simulation compares:
//   - shared: one table every router reads and writes at once, what
//     kvrouter's Raft-replicated bindings give (a binding made through one
//     replica is the binding of all);
//   - per-router: each router has its own table and tells the others of a
//     binding it makes over replica sync, SyncDelay later (bookings' lag),
//     as an advisory best-effort sync does; a turn that reaches a router
//     before the binding did is routed afresh and binds again there, and
//     the later message overwrites the earlier (last writer wins).

// AffinityMode is how strongly a session keeps its worker.
type AffinityMode string

// Affinity modes.
const (
	AffinityOff  AffinityMode = ""
	AffinityHard AffinityMode = "hard" // always the bound worker while it is in the fleet
	AffinitySoft AffinityMode = "soft" // the bound worker unless it is busy (Affinity.Busy)
)

// Affinity configures session binding.
type Affinity struct {
	Mode AffinityMode
	// PerRouter keeps one table per router, synced with replica sync's
	// lag; false: one table all routers share.
	PerRouter bool
	// Busy (soft mode) is the share of the bound worker's KV blocks that
	// running requests hold, in the routing router's load view, above
	// which a turn goes where the policy sends it (the binding stays). A
	// worker the router's busy thresholds mark busy is over it too.
	Busy float64
}

// DefaultAffinityBusy is soft mode's default busy share.
const DefaultAffinityBusy = 0.9

func (a Affinity) check() error {
	switch a.Mode {
	case AffinityOff, AffinityHard, AffinitySoft:
	default:
		return fmt.Errorf("session affinity %q: %w", a.Mode, ErrConfig)
	}
	if a.Mode == AffinitySoft && !(a.Busy > 0 && a.Busy <= 1) {
		return fmt.Errorf("soft affinity's busy share %v outside (0, 1]: %w", a.Busy, ErrConfig)
	}
	return nil
}

// affinityState is the binding tables: one shared, or one per router.
type affinityState struct {
	tables  []map[int]router.WorkerID // session key → worker
	overlap []router.Overlap          // scratch for bestHolder
	// Rebinds counts bindings made again for a session already bound
	// somewhere (its worker left, or a lagging router bound it afresh).
	rebinds int
}

func (a *affinityState) init(s *state) {
	if s.cfg.Affinity.Mode == AffinityOff {
		return
	}
	n := 1
	if s.cfg.Affinity.PerRouter {
		n = len(s.rts)
	}
	a.tables = make([]map[int]router.WorkerID, n)
	for k := range a.tables {
		a.tables[k] = map[int]router.WorkerID{}
	}
}

// table is router k's view of the bindings.
func (a *affinityState) table(k int) map[int]router.WorkerID {
	if len(a.tables) == 1 {
		return a.tables[0]
	}
	return a.tables[k]
}

// key is the binding key of request i's session: its top-level session
// (agent workloads group subagents under it), else the session itself.
func (s *state) sessionKey(i int) int {
	sess := s.w.Requests[i].Session
	if s.w.SessionRoot != nil {
		return s.w.SessionRoot[sess]
	}
	return sess
}

// route routes request i of a session through router k under affinity.
func (a *affinityState) route(s *state, k, i int, req router.Request) (router.Decision, error) {
	key := s.sessionKey(i)
	rt := s.rts[k]
	bound, ok := a.table(k)[key]
	if ok {
		if wi := s.byWorker[bound]; s.fleet.routable(wi) {
			if s.cfg.Affinity.Mode == AffinityHard || !a.busy(s, k, bound, req) {
				if d, err := routeTo(s, k, bound, req); err == nil {
					return d, nil
				}
			}
			return rt.Route(req, epoch.Add(s.now)) // soft and busy: the binding stays
		}
		if wi := s.byWorker[bound]; s.fleet.keeping[wi] && !s.fleet.gone[wi] && s.fleet.drainRecord(wi) >= 0 {
			// Draining with shadows: the turn stays, its copy goes ahead.
			if d, ok := s.shadow.drainTurn(s, k, i, bound, req); ok {
				return d, nil
			}
		}
		if wi := s.byWorker[bound]; s.fleet.keeping[wi] && !s.fleet.gone[wi] {
			// Draining with its sessions kept: the bound turn still goes there.
			if d, err := routeTo(s, k, bound, req); err == nil {
				return d, nil
			}
		}
		// A session a drain-shadow moved goes where its copy went.
		if to, moved := s.shadow.movedTo(s, i); moved && s.fleet.routable(to) {
			if d, err := routeTo(s, k, s.ids[to], req); err == nil {
				a.bind(s, k, key, s.ids[to])
				return d, nil
			}
		}
		// Its worker left or drains: the holder of most of the prefix.
		if h, found := a.bestHolder(s, req.Hashes); found {
			if d, err := routeTo(s, k, h, req); err == nil {
				a.bind(s, k, key, h)
				return d, nil
			}
		}
	}
	d, err := rt.Route(req, epoch.Add(s.now))
	if err == nil {
		a.bind(s, k, key, d.Worker)
	}
	return d, err
}

// routeTo routes req through router k to worker w only (every other worker
// excluded), so the router books it as any decision of its own.
func routeTo(s *state, k int, w router.WorkerID, req router.Request) (router.Decision, error) {
	req.Exclude = othersThan(s, w)
	return s.rts[k].Route(req, epoch.Add(s.now))
}

// othersThan are the routers' candidates other than w: the workers that
// take requests and those draining with their sessions kept.
func othersThan(s *state, w router.WorkerID) []router.WorkerID {
	ids := append(slices.Clone(s.fleet.routableIDs(s)), s.fleet.keepingIDs(s)...)
	return slices.DeleteFunc(ids, func(id router.WorkerID) bool { return id == w })
}

// busy reports whether worker w is over the soft-mode share in router k's
// view (or busy by the router's own thresholds).
func (a *affinityState) busy(s *state, k int, w router.WorkerID, req router.Request) bool {
	req.Exclude = othersThan(s, w)
	d, err := s.rts[k].Decide(req, epoch.Add(s.now))
	if errors.Is(err, router.ErrAllBusy) {
		return true
	}
	for _, row := range d.Rows {
		if row.Worker == w {
			return float64(row.ActiveBlocks) > s.cfg.Affinity.Busy*float64(s.capacity(s.byWorker[w]))
		}
	}
	return false
}

// bestHolder is the routable worker holding the longest prefix of hashes
// (the lowest index among equals); false when none holds any.
func (a *affinityState) bestHolder(s *state, hashes []uint64) (router.WorkerID, bool) {
	a.overlap = s.index.FindMatches(hashes, a.overlap[:0])
	best, blocks := router.WorkerID(""), 0
	for _, o := range a.overlap {
		wi, ok := s.byWorker[o.Worker]
		if !ok || !s.fleet.routable(wi) {
			continue
		}
		if o.Blocks > blocks || (o.Blocks == blocks && blocks > 0 && wi < s.byWorker[best]) {
			best, blocks = o.Worker, o.Blocks
		}
	}
	return best, blocks > 0
}

// bind records key → w in router k's table and, per router, tells the
// other routers over replica sync.
func (a *affinityState) bind(s *state, k, key int, w router.WorkerID) {
	tab := a.table(k)
	old, had := tab[key]
	if had && old == w {
		return
	}
	if had {
		a.rebinds++
	}
	tab[key] = w
	if len(a.tables) > 1 {
		s.announce(k, syncMsg{kind: syncBind, session: key, worker: w})
	}
}
