package sim

import (
	"container/heap"
	"fmt"
	"time"

	"github.com/kvrouter/kvrouter/api/tenant"
	"github.com/kvrouter/kvrouter/router"
)

// Replica sync between simulated routers: what kvrouter's replicas publish
// to each other (cmd/kvrouter/internal/replica: Booked, PrefillDone, Freed)
// and apply to their load view under the publisher's origin.

type syncKind uint8

const (
	syncBook syncKind = iota
	syncPrefillDone
	syncFree
	syncOutput // output-block tracking: a new output block (Syncer.Output)
	syncBind   // per-router session affinity: a binding made (affinity.go)
	// syncTenants: a router's tenant counters (tenants.go), as the
	// Syncer's SyncTenants carries them: absolute, the whole ledger.
	syncTenants
)

// syncMsg is one load-view update from router `from` to router `to`.
type syncMsg struct {
	at       time.Duration
	seq      uint64
	from, to int
	kind     syncKind
	booking  router.Booking        // syncBook
	id       string                // syncPrefillDone, syncFree, syncOutput
	output   router.OutputProgress // syncOutput: absolute progress
	session  int                   // syncBind: the session key
	worker   router.WorkerID       // syncBind: its worker
	usage    []tenant.Usage        // syncTenants
}

// announce sends msg from router k to every other router, SyncDelay from
// now (first tokens, output blocks and frees SyncFreeExtra later still). A zero delay
// applies it at once: every router then sees every
// booking before the next request is routed, the view one router has.
// One publisher's messages keep their order (a constant delay and the
// insertion sequence), as one NATS subject does.
func (s *state) announce(k int, msg syncMsg) {
	if len(s.rts) < 2 {
		return
	}
	msg.from = k
	delay := s.cfg.SyncDelay
	if msg.kind != syncBook && msg.kind != syncBind && msg.kind != syncTenants {
		// Output progress rides on the prefill-done message (SyncPrefillDone
		// with the ob/g/x keys), so it lags as first tokens do.
		delay += s.cfg.SyncFreeExtra
	}
	for j := range s.rts {
		if j == k {
			continue
		}
		m := msg
		m.to = j
		if delay == 0 {
			s.applySync(m)
			continue
		}
		s.seq++
		m.at, m.seq = s.now+delay, s.seq
		heap.Push(&s.syncs, m)
	}
}

// applySync applies a remote update to router m.to's load view, as
// replica.AddRemote/PrefillDoneRemote/FreeRemote/OutputRemote do. A free that overtook
// nothing is harmless; a booking arriving after its own free cannot happen
// (one publisher's order is kept).
func (s *state) applySync(m syncMsg) {
	if m.kind == syncBind {
		s.aff.tables[m.to][m.session] = m.worker // last writer wins
		return
	}
	if m.kind == syncTenants {
		s.adm.ledgers[m.to].Remote(fmt.Sprint(m.from), m.usage)
		return
	}
	load := s.rts[m.to].Load()
	switch m.kind {
	case syncBook:
		b := m.booking
		b.Added = epoch.Add(s.now) // the receiver stamps it, as replica.AddRemote does
		load.Add(b)
	case syncPrefillDone:
		load.PrefillDoneAt(m.id, epoch.Add(s.now)) // stamped on arrival, as bookings are
	case syncFree:
		load.Free(m.id)
	case syncOutput:
		load.SetOutput(m.id, m.output)
	}
}

type syncHeap []syncMsg

func (h syncHeap) Len() int { return len(h) }
func (h syncHeap) Less(a, b int) bool {
	if h[a].at != h[b].at {
		return h[a].at < h[b].at
	}
	return h[a].seq < h[b].seq
}
func (h syncHeap) Swap(a, b int) { h[a], h[b] = h[b], h[a] }
func (h *syncHeap) Push(x any)   { *h = append(*h, x.(syncMsg)) }
func (h *syncHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}
