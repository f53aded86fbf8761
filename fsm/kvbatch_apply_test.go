package fsm

import (
	"errors"
	"fmt"
	"reflect"
	"slices"
	"testing"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/router"
)

// applyEventsOneByOne is the reference: applyEventsLocked as it was
// before router.Index.ApplyBatch, one ApplyCapped per event, verbatim.
func applyEventsOneByOne(f *FSM, idx uint64, evs []KVBatchEvent, res *ApplyResult) {
	st := f.st
	var applied, dups, gaps, rejUnknown, rejSize, rejParent, rejInvalid, rejOver, overBlocks int
	var over []*rankState // ranks refused by their cap in this entry (few)
	for i := range evs {
		e := &evs[i]
		ws := st.workers[e.Worker]
		if ws == nil || e.DPRank >= uint32(len(ws.ranks)) {
			rejUnknown++
			if len(res.UnknownWorkers) < maxReportedUnknown {
				if k := router.WorkerKey(e.Worker, e.DPRank); !slices.Contains(res.UnknownWorkers, k) {
					res.UnknownWorkers = append(res.UnknownWorkers, k)
				}
			}
			continue
		}
		rs := ws.ranks[e.DPRank]
		if id := e.EventID; id != 0 {
			switch {
			case rs.resynced:
				rs.resynced = false // a new baseline after a resync: no gap
			case id <= rs.last:
				dups++
				continue
			case id > rs.last+1:
				gaps++
				f.markStaleLocked(idx, rs, fmt.Sprintf("gap from %d to %d", rs.last, id), id, res)
			}
			// The cursor moves for every event consumed, applied or rejected:
			// a rejected event would be rejected again, and it is no gap.
			rs.last = id
		}
		if bs := e.Event.BlockSize; bs != 0 && bs != ws.rec.BlockSize {
			rejSize++
			continue
		}
		limit := RankBlockCap(ws.rec.TotalBlocks)
		if e.Event.Tier != router.TierDevice {
			limit = LowerTierBlockCap
		}
		err := st.index.ApplyCapped(rs.key, e.Event, limit)
		if err == nil {
			applied++
			if e.Event.Kind == router.EventCleared && e.Event.Tier == router.TierDevice && rs.stale {
				// The worker says its cache is empty: index and worker agree
				// again, and what follows chains from nothing.
				rs.stale, rs.reason, rs.staleID = false, "", 0
			}
			continue
		}
		var mp *router.MissingParentError
		var ce *router.CapacityError
		switch {
		case errors.As(err, &mp):
			rejParent++
			f.markStaleLocked(idx, rs, "missing parent", e.EventID, res)
		case errors.As(err, &ce):
			// The index would hold more of this rank than twice what the
			// worker can: refuse, deterministically (held counts are
			// replicated state, the cap comes from the registry), and have
			// the rank resynced.
			rejOver++
			overBlocks += ce.Adding
			f.refused[ws.rec.ID] += uint64(ce.Adding)
			f.markStaleLocked(idx, rs, StaleOverCapacity, e.EventID, res)
			if !slices.Contains(over, rs) {
				over = append(over, rs)
				f.changes = append(f.changes, Change{Kind: ChangeOverCapacity, Index: idx, Worker: rs.worker, DPRank: rs.rank,
					Reason: fmt.Sprintf("holds %d blocks, cap %d (registered capacity %d)", ce.Held, ce.Limit, ws.rec.TotalBlocks)})
			}
		case errors.Is(err, router.ErrBlockSizeMismatch):
			rejSize++
		case errors.Is(err, router.ErrUnknownWorker):
			rejUnknown++ // registry and index disagree: cannot happen, count it anyway
		default:
			rejInvalid++
		}
	}
	rejected := rejUnknown + rejSize + rejParent + rejInvalid + rejOver
	res.Applied, res.Duplicates, res.Gaps, res.Rejected, res.Unknown = applied, dups, gaps, rejected, rejUnknown
	res.OverCapacity = rejOver
	slices.Sort(res.UnknownWorkers)
	s := &f.stats
	s.events.Add(uint64(len(evs)))
	s.applied.Add(uint64(applied))
	s.duplicates.Add(uint64(dups))
	s.gaps.Add(uint64(gaps))
	s.unknownWorker.Add(uint64(rejUnknown))
	s.blockSize.Add(uint64(rejSize))
	s.missingParent.Add(uint64(rejParent))
	s.invalid.Add(uint64(rejInvalid))
	if rejOver > 0 {
		s.overCapacity.Add(uint64(rejOver))
		s.overCapacityBlocks.Add(uint64(overBlocks))
	}
}

// kvPair is two FSMs fed the same entries: batch applies KV batches whole
// (applyEventsLocked), ref event by event (applyEventsOneByOne).
type kvPair struct {
	t          testing.TB
	batch, ref *harness
	chB, chR   []Change
}

func newKVPair(t testing.TB) *kvPair {
	p := &kvPair{t: t, batch: newHarness(t), ref: newHarness(t)}
	p.ref.f.eventsOneByOne = applyEventsOneByOne
	p.batch.f.OnChange(func(c Change) { p.chB = append(p.chB, c) })
	p.ref.f.OnChange(func(c Change) { p.chR = append(p.chR, c) })
	return p
}

// apply applies data as the next entry to both, through ApplyBatch (as
// raft does), and fails unless the results and the states agree.
func (p *kvPair) apply(data []byte) *ApplyResult {
	p.t.Helper()
	rb := p.batch.f.ApplyBatch([]*raft.Log{p.batch.next(data)})[0].(*ApplyResult)
	rr := p.ref.f.ApplyBatch([]*raft.Log{p.ref.next(data)})[0].(*ApplyResult)
	if errString(rb.Err) != errString(rr.Err) {
		p.t.Fatalf("errors: batch %v, one by one %v", rb.Err, rr.Err)
	}
	cb, cr := *rb, *rr
	cb.Err, cr.Err = nil, nil
	if !reflect.DeepEqual(cb, cr) {
		p.t.Fatalf("results:\nbatch      %+v\none by one %+v", cb, cr)
	}
	p.same()
	return rb
}

// same fails unless both hold the same state, with the same counters and
// the same changes reported, in the same order.
func (p *kvPair) same() {
	p.t.Helper()
	a, b := p.batch.f, p.ref.f
	if da, db := a.Digest(), b.Digest(); da != db {
		p.t.Fatalf("digests: batch %s, one by one %s", da, db)
	}
	if sa, sb := snapshotBytes(p.t, a), snapshotBytes(p.t, b); !slices.Equal(sa, sb) {
		p.t.Fatalf("snapshots differ (%d and %d bytes)", len(sa), len(sb))
	}
	if sa, sb := a.Stats(), b.Stats(); !reflect.DeepEqual(sa, sb) {
		p.t.Fatalf("stats:\nbatch      %+v\none by one %+v", sa, sb)
	}
	if sa, sb := a.Index().Stats(), b.Index().Stats(); sa != sb {
		p.t.Fatalf("index stats:\nbatch      %+v\none by one %+v", sa, sb)
	}
	if sa, sb := a.Stale(), b.Stale(); !reflect.DeepEqual(sa, sb) {
		p.t.Fatalf("stale:\nbatch      %+v\none by one %+v", sa, sb)
	}
	if ca, cb := a.Cursors(), b.Cursors(); !reflect.DeepEqual(ca, cb) {
		p.t.Fatalf("cursors:\nbatch      %+v\none by one %+v", ca, cb)
	}
	if oa, ob := a.OverCapacityRefused(), b.OverCapacityRefused(); !reflect.DeepEqual(oa, ob) {
		p.t.Fatalf("refused: batch %v, one by one %v", oa, ob)
	}
	if !reflect.DeepEqual(p.chB, p.chR) {
		p.t.Fatalf("changes:\nbatch      %+v\none by one %+v", p.chB, p.chR)
	}
}

// kvGen draws KV batches over a few workers: sequenced events in order,
// repeated (duplicates), skipping ahead (gaps) and unsequenced; stores
// with parents held and not, of blocks other ranks hold, removals of
// blocks stored earlier in the same batch and of blocks never stored,
// cleared ranks, block sizes other than the worker's, lower tiers, events
// of unregistered workers and ranks, and ranks small enough to go over
// their cap.
type kvGen struct {
	rng    interface{ IntN(int) int }
	ids    map[router.WorkerID]uint64
	stored map[router.WorkerID][]uint64
}

var kvGenWorkers = []struct {
	id    string
	ranks uint32
}{{"w0", 2}, {"w1", 1}, {"w2", 1}, {"w3", 3}}

func kvGenRegister(w string, ranks uint32) RegisterWorker {
	r := worker(w, ranks)
	r.TotalBlocks = 12 // a small cap per rank: the cap is reached
	return r
}

func (g *kvGen) event() KVBatchEvent {
	w := kvGenWorkers[g.rng.IntN(len(kvGenWorkers))]
	e := KVBatchEvent{Worker: w.id, DPRank: uint32(g.rng.IntN(int(w.ranks)))}
	switch g.rng.IntN(40) {
	case 0:
		e.Worker = "ghost"
	case 1:
		e.DPRank = w.ranks // no such rank
	}
	key := router.WorkerKey(e.Worker, e.DPRank)
	switch r := g.rng.IntN(20); {
	case r < 14:
		g.ids[key]++
		e.EventID = g.ids[key]
	case r < 16:
		e.EventID = g.ids[key] - min(g.ids[key], uint64(g.rng.IntN(3))) // a duplicate (or 0 at first)
	case r < 18:
		g.ids[key] += 2 + uint64(g.rng.IntN(4))
		e.EventID = g.ids[key]
	}
	ev := &e.Event
	switch r := g.rng.IntN(20); {
	case r < 11:
		ev.Kind = router.EventStored
		base := uint64(g.rng.IntN(64))
		for i := range 1 + g.rng.IntN(5) {
			h := base + uint64(i)
			eh := h + 1000
			if g.rng.IntN(6) == 0 {
				eh = h
			}
			ev.Blocks = append(ev.Blocks, router.StoredBlock{EngineHash: eh, ContentHash: h})
		}
		if held := g.stored[key]; g.rng.IntN(3) > 0 {
			ev.HasParent = true
			if len(held) > 0 && g.rng.IntN(5) > 0 {
				ev.Parent = held[g.rng.IntN(len(held))]
			} else {
				ev.Parent = 3000 + uint64(g.rng.IntN(64))
			}
		}
		for _, b := range ev.Blocks {
			g.stored[key] = append(g.stored[key], b.EngineHash)
		}
	case r < 18:
		ev.Kind = router.EventRemoved
		held := g.stored[key]
		for range 1 + g.rng.IntN(5) {
			if len(held) > 0 && g.rng.IntN(5) > 0 {
				ev.Removed = append(ev.Removed, held[g.rng.IntN(len(held))])
			} else {
				ev.Removed = append(ev.Removed, 3000+uint64(g.rng.IntN(64)))
			}
		}
	default:
		ev.Kind = router.EventCleared
	}
	switch g.rng.IntN(25) {
	case 0:
		ev.BlockSize = 32
	case 1, 2:
		ev.Tier = router.TierHost
	case 3, 4, 5, 6:
		ev.BlockSize = 16
	}
	return e
}

func (g *kvGen) entry(t testing.TB, n int) []byte {
	evs := make([]KVBatchEvent, n)
	for i := range evs {
		evs[i] = g.event()
	}
	return mustEncode(t, KVEventBatch{Events: evs})
}

// TestFSMApplyKVBatchMatchesOneByOne: random KV-batch entries applied
// whole (one ApplyBatch into the index) and event by event (the loop
// before it) give the same results, digests, snapshot bytes, counters,
// cursors, stale marks and changes, in the same order, entry after entry,
// with resyncs, deregistrations and re-registrations between them.
func TestFSMApplyKVBatchMatchesOneByOne(t *testing.T) {
	var total ApplyResult
	for seed := range uint64(8) {
		p := newKVPair(t)
		for _, w := range kvGenWorkers {
			p.apply(mustEncode(t, kvGenRegister(w.id, w.ranks)))
		}
		g := &kvGen{rng: newRand(seed), ids: map[router.WorkerID]uint64{}, stored: map[router.WorkerID][]uint64{}}
		for round := range 60 {
			r := p.apply(g.entry(t, g.rng.IntN(60)))
			total.Applied += r.Applied
			total.Duplicates += r.Duplicates
			total.Gaps += r.Gaps
			total.Unknown += r.Unknown
			total.OverCapacity += r.OverCapacity
			total.Rejected += r.Rejected - r.Unknown - r.OverCapacity
			total.Stale = append(total.Stale, r.Stale...)
			w := kvGenWorkers[g.rng.IntN(len(kvGenWorkers))]
			switch round % 7 {
			case 3:
				p.apply(mustEncode(t, ResyncWorker{Worker: w.id, DPRank: 0}))
				g.stored[router.WorkerKey(w.id, 0)] = nil
			case 5:
				p.apply(mustEncode(t, DeregisterWorker{ID: w.id}))
				p.apply(mustEncode(t, kvGenRegister(w.id, w.ranks)))
				for r := range w.ranks {
					k := router.WorkerKey(w.id, r)
					g.ids[k], g.stored[k] = 0, nil
				}
			}
		}
	}
	// Every path was taken (a generator that stopped drawing one would
	// leave it untested).
	if total.Applied == 0 || total.Duplicates == 0 || total.Gaps == 0 || total.Unknown == 0 || total.OverCapacity == 0 ||
		total.Rejected == 0 || len(total.Stale) == 0 {
		t.Fatalf("a case was never drawn: %+v", total)
	}
}

// FuzzFSMApplyKVBatch: KV-batch entries built from any bytes (workers,
// ranks, event ids, kinds, hashes, parents, sizes, tiers) applied whole
// and event by event leave the same state and results.
func FuzzFSMApplyKVBatch(f *testing.F) {
	f.Add([]byte{0, 1, 1, 2, 3, 4, 5, 6, 7, 1, 1, 2, 1, 9, 9, 2, 0, 1, 1, 4, 3, 2, 2, 0})
	f.Add([]byte{3, 2, 0, 5, 1, 2, 4, 8, 16, 32, 0, 0, 7, 6, 5, 4, 3, 2, 1, 0, 255, 254})
	f.Fuzz(func(t *testing.T, data []byte) {
		p := newKVPair(t)
		for _, w := range kvGenWorkers {
			p.apply(mustEncode(t, kvGenRegister(w.id, w.ranks)))
		}
		var evs []KVBatchEvent
		for len(data) >= 6 {
			d := data[:6]
			data = data[6:]
			w := kvGenWorkers[int(d[0])%len(kvGenWorkers)]
			e := KVBatchEvent{Worker: w.id, DPRank: uint32(d[0]/4) % (w.ranks + 1), EventID: uint64(d[1] % 12)}
			if d[0] >= 250 {
				e.Worker = "ghost"
			}
			ev := &e.Event
			ev.Kind = router.EventKind(1 + d[2]%3)
			for i := range int(d[3] % 5) {
				h := uint64(d[4]%32) + uint64(i)
				eh := h + 1000*uint64(d[5]%2)
				switch ev.Kind {
				case router.EventStored:
					ev.Blocks = append(ev.Blocks, router.StoredBlock{EngineHash: eh, ContentHash: h})
				case router.EventRemoved:
					ev.Removed = append(ev.Removed, eh)
				}
			}
			if ev.Kind == router.EventStored && d[5]&2 != 0 {
				ev.HasParent, ev.Parent = true, uint64(d[4]%32)+1000*uint64(d[5]/4%2)
			}
			ev.BlockSize = []int{0, 16, 32, 0}[d[5]/8%4]
			if d[5] >= 224 {
				ev.Tier = router.Tier(1 + d[5]%3)
			}
			evs = append(evs, e)
			if d[2] >= 240 { // the end of an entry
				p.apply(mustEncode(t, KVEventBatch{Events: evs}))
				evs = evs[:0]
			}
		}
		p.apply(mustEncode(t, KVEventBatch{Events: evs}))
	})
}
