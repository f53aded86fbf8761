package router

// BatchEvent is one event of a batch applied by ApplyBatch: the worker,
// the event (read, never kept or changed) and the cap ApplyCapped would
// take (maxHeld <= 0: none).
type BatchEvent struct {
	Worker  WorkerID
	Event   *KVEvent
	MaxHeld int
}

// Read-ahead distances of ApplyBatch, in blocks of the events from the one
// applying on (it included). Far: the slots an event names directly (a
// stored block's engine name and content hash, a removed block's engine
// name). Near: a removed block's word, whose content hash the engine name's
// slot gives, read once the far read has had time to arrive. The core
// keeps a few dozen misses in flight, so reading further ahead than an
// event of 16 blocks only queues the next event's misses before this
// one's (48/24 or 32/16 blocks ahead cost 10–20 % more CPU per block
// than 16/8 on 16-block events, with loads as the read-ahead and again
// with the prefetch instruction; BENCHMARKS.md, issue 31). What the
// distance buys is for small events: a one-block event is read 15 events
// ahead instead of not at all.
const (
	batchAheadFar  = 16
	batchAheadNear = 8
)

// ApplyBatch applies evs in order, each exactly as ApplyCapped(e.Worker,
// *e.Event, e.MaxHeld) would one after the other, and sets errs[i] to event
// i's outcome (errs must be at least as long as evs): the same index, the
// same counters, the same errors. What it saves over those calls: one
// holding of the lock and one generation for the whole batch, one worker
// lookup per run of one worker's events, the counters reached once, and
// the cache misses: the table slots of the events ahead are read while the
// earlier ones apply, across event boundaries, so even one-block events
// overlap their misses (ApplyCapped can read ahead only within its event).
// The read-ahead only reads: what applies, and in which order, is the
// event-by-event sequence.
func (ix *Index) ApplyBatch(evs []BatchEvent, errs []error) {
	if len(evs) == 0 {
		return
	}
	errs = errs[:len(evs)]
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.gen.Add(1)
	slots := ix.batchSlotsLocked(evs)
	far, near := 0, 0           // the next event to read ahead, each distance
	aheadFar, aheadNear := 0, 0 // blocks of the events in [i, far), [i, near)
	for i := range evs {
		for far < len(evs) && (far <= i || aheadFar < batchAheadFar) {
			aheadFar += ix.readAheadFarLocked(int(slots[far]), evs[far].Event)
			far++
		}
		for near < len(evs) && (near <= i || aheadNear < batchAheadNear) {
			aheadNear += ix.readAheadNearLocked(int(slots[near]), evs[near].Event)
			near++
		}
		e := &evs[i]
		errs[i] = ix.applyEventLocked(e.Worker, int(slots[i]), e.Event, e.MaxHeld, false)
		n := batchWeight(e.Event)
		aheadFar -= n
		aheadNear -= n
	}
	ix.flushStatsLocked()
	if cap(ix.batchSlots) > 1<<16 {
		ix.batchSlots = nil // a huge entry's scratch is not kept
	}
}

// batchSlotsLocked resolves each event's worker to its slot (-1 when not
// in the index), one map lookup per run of one worker's events. ix.mu must
// be held.
func (ix *Index) batchSlotsLocked(evs []BatchEvent) []int32 {
	out := ix.batchSlots[:0]
	last, lastSlot := WorkerID(""), int32(-1)
	for i := range evs {
		if w := evs[i].Worker; i == 0 || w != last {
			s, ok := ix.slotOf[w]
			if !ok {
				s = -1
			}
			last, lastSlot = w, int32(s)
		}
		out = append(out, lastSlot)
	}
	ix.batchSlots = out
	return out
}

// batchWeight is how many blocks an event's read-ahead covers.
func batchWeight(ev *KVEvent) int {
	if ev.Tier != TierDevice {
		return 0
	}
	switch ev.Kind {
	case EventStored:
		return len(ev.Blocks)
	case EventRemoved:
		return len(ev.Removed)
	}
	return 0
}

// readAheadFarLocked reads the slots an event of the worker in slot names
// directly and returns its weight. Reads only. ix.mu must be held.
func (ix *Index) readAheadFarLocked(slot int, ev *KVEvent) int {
	n := batchWeight(ev)
	if n == 0 || slot < 0 || slot >= 64 {
		return n
	}
	wb := ix.slots[slot]
	acc := uint64(0)
	switch ev.Kind {
	case EventStored:
		for _, b := range ev.Blocks {
			if b.EngineHash != b.ContentHash {
				acc ^= wb.engine.peek(b.EngineHash)
			}
			acc ^= ix.blocks.peek(b.ContentHash)
		}
	case EventRemoved:
		if wb.engine.Len() > 0 {
			for _, eh := range ev.Removed {
				acc ^= wb.engine.peek(eh)
			}
		}
	}
	ix.sink ^= acc
	return n
}

// readAheadNearLocked reads the words a removed event's blocks name
// through their engine names (read far ahead) and returns the event's
// weight. An engine name that an event before it stores is not found yet:
// its word is read under the engine name, a wasted read, nothing worse.
// Reads only. ix.mu must be held.
func (ix *Index) readAheadNearLocked(slot int, ev *KVEvent) int {
	n := batchWeight(ev)
	if n == 0 || slot < 0 || slot >= 64 || ev.Kind != EventRemoved {
		return n
	}
	wb := ix.slots[slot]
	acc := uint64(0)
	for _, eh := range ev.Removed {
		ch, ok := wb.engine.get(eh)
		if !ok {
			ch = eh
		}
		acc ^= ix.blocks.peek(ch)
	}
	ix.sink ^= acc
	return n
}
