package router

import (
	"math/bits"
	"slices"
)

// A BlocksCopy is every worker's blocks copied out of the index in one pass
// under its lock, unsorted; Resolve orders them afterwards, without the
// lock. Snapshots and digests need the sorted lists (their bytes must not
// depend on map order), but the caller's lock — the FSM's, which Raft's
// apply loop waits on while a snapshot is captured — only has to cover the
// copy: sorting ten million blocks under it stalled ingest for seconds.
type BlocksCopy struct {
	slots []slotCopy
}

type slotCopy struct {
	present bool // a worker holds the slot
	id      WorkerID
	aliases []StoredBlock // engine name → content hash, as the worker's events named them
	held    []uint64      // content hashes the holder sets give the worker
}

// ResolvedBlocks is one worker's blocks as WorkerBlocks returns them, and
// which of them are dangling aliases (an engine name whose content hash
// the worker no longer holds; nil when none is).
type ResolvedBlocks struct {
	Blocks   []StoredBlock
	Dangling []bool
}

// CopyWorkerBlocks copies every worker's blocks under the index's read
// lock: map walks and appends only.
func (ix *Index) CopyWorkerBlocks() *BlocksCopy {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	c := &BlocksCopy{slots: make([]slotCopy, len(ix.slots))}
	for slot, wb := range ix.slots {
		if wb == nil {
			continue
		}
		sc := &c.slots[slot]
		sc.present, sc.id = true, wb.id
		sc.aliases = make([]StoredBlock, 0, wb.engine.Len())
		for eh, ch := range wb.engine.all() {
			sc.aliases = append(sc.aliases, StoredBlock{EngineHash: eh, ContentHash: ch})
		}
		sc.held = make([]uint64, 0, wb.held)
	}
	add := func(slot int, ch uint64) {
		if slot < len(c.slots) && c.slots[slot].present {
			c.slots[slot].held = append(c.slots[slot].held, ch)
		}
	}
	for ch, lo := range ix.blocks.all() {
		for w := lo; w != 0; w &= w - 1 {
			add(bits.TrailingZeros64(w), ch)
		}
	}
	for ch, v := range ix.wide {
		ix.wideEachLocked(v, func(slot int) { add(slot, ch) })
	}
	return c
}

// Resolve orders the copy: per worker, the aliases and, for every held
// content hash no alias names, a plain entry (engine hash = content hash),
// sorted by content hash then engine hash — exactly WorkerBlocks' lists.
func (c *BlocksCopy) Resolve() map[WorkerID]ResolvedBlocks {
	out := make(map[WorkerID]ResolvedBlocks, len(c.slots))
	for i := range c.slots {
		sc := &c.slots[i]
		if !sc.present {
			continue
		}
		out[sc.id] = sc.resolve()
	}
	return out
}

func (sc *slotCopy) resolve() ResolvedBlocks {
	slices.SortFunc(sc.aliases, compareStored)
	slices.Sort(sc.held)
	blocks := make([]StoredBlock, 0, len(sc.aliases)+len(sc.held))
	var dangling []bool
	a, h := sc.aliases, sc.held
	for len(a) > 0 || len(h) > 0 {
		switch {
		case len(h) == 0 || (len(a) > 0 && a[0].ContentHash < h[0]):
			// An alias of content the worker does not hold.
			if dangling == nil {
				dangling = make([]bool, len(blocks), cap(blocks))
			}
			blocks = append(blocks, a[0])
			dangling = append(dangling, true)
			a = a[1:]
		case len(a) == 0 || h[0] < a[0].ContentHash:
			blocks = append(blocks, StoredBlock{EngineHash: h[0], ContentHash: h[0]})
			if dangling != nil {
				dangling = append(dangling, false)
			}
			h = h[1:]
		default: // held and named: every alias of it, no plain entry
			ch := h[0]
			for len(a) > 0 && a[0].ContentHash == ch {
				blocks = append(blocks, a[0])
				if dangling != nil {
					dangling = append(dangling, false)
				}
				a = a[1:]
			}
			h = h[1:]
		}
	}
	sc.aliases, sc.held = nil, nil
	return ResolvedBlocks{Blocks: blocks, Dangling: dangling}
}
