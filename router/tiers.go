package router

import "fmt"

// Lower storage tiers (host, disk, external): each is an Index of its own
// holding the same workers, so a tier's blocks never touch the device
// tier's maps and FindMatches costs what it cost before tiers existed.
//
// A lower tier's stored events are applied without the parent check: a
// block offloaded to host memory has its parent on the GPU, on the host, or
// on neither (the engine offloads what it evicts, in its own order), and the
// index keys blocks by content hash, which already names the whole prefix.
// Block size and capacity checks apply as on the device tier.

// TierOverlap is how far a worker's cached prefix extends past its device
// prefix into the lower tiers, in blocks: Host continues where the device
// prefix ends, Disk where the host part ends (disk and external pools
// together, as Dynamo credits them).
type TierOverlap struct {
	Worker     WorkerID
	Host, Disk int
}

// TieredOverlapSource is an OverlapSource that also knows lower tiers.
type TieredOverlapSource interface {
	OverlapSource
	// FindTieredMatches extends device (FindMatches' result for seq) into
	// the lower tiers and appends the workers with a lower-tier hit to dst.
	FindTieredMatches(seq []uint64, device []Overlap, dst []TierOverlap) []TierOverlap
}

// applyLowerLocked applies ev (a lower tier's) for worker wb, adding the
// worker to the tier's index first. ix.mu must be held for writing.
func (ix *Index) applyLowerLocked(wb *workerBlocks, ev KVEvent, maxHeld int) error {
	if !ev.Tier.Valid() {
		return fmt.Errorf("apply %s event of worker %s: %v: %w", ev.Kind, wb.id, ev.Tier, ErrInvalidEvent)
	}
	t := ix.lower[ev.Tier]
	if t == nil {
		t = NewIndex(ix.blockSize)
		ix.lower[ev.Tier] = t
	}
	t.AddWorkerBlockSize(wb.id, wb.blockSize)
	tier := ev.Tier
	ev.HasParent, ev.Tier = false, TierDevice
	if err := t.ApplyCapped(wb.id, ev, maxHeld); err != nil {
		return fmt.Errorf("%v tier: %w", tier, err)
	}
	return nil
}

// LowerTier is the index of lower tier t, or nil when no event of t was
// applied (snapshots read it; callers must not apply events to it).
func (ix *Index) LowerTier(t Tier) *Index {
	if t == TierDevice || !t.Valid() {
		return nil
	}
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.lower[t]
}

// TierHeld is how many blocks worker w holds in tier t.
func (ix *Index) TierHeld(w WorkerID, t Tier) int {
	if t == TierDevice {
		return ix.Held(w)
	}
	if l := ix.LowerTier(t); l != nil {
		return l.Held(w)
	}
	return 0
}

// FindTieredMatches extends the device prefixes of device (FindMatches'
// result for seq) through the lower tiers, Dynamo's continuation walk
// (lower_tier_indexers.rs query_lower_tiers): tiers in the order host,
// disk, external; a worker enters a tier where its match so far ends (its
// device prefix, then plus its host blocks…) and gains the blocks it holds
// there contiguously from that point; a worker with no match so far enters
// a tier at block 0 if it holds the prompt's first block there. A worker
// that gains nothing in a tier goes on to the next from where it stood.
// Workers with a lower-tier hit are appended to dst, in the order first
// met (device order, then each tier's own order).
func (ix *Index) FindTieredMatches(seq []uint64, device []Overlap, dst []TierOverlap) []TierOverlap {
	dst = dst[:0]
	if len(seq) == 0 {
		return dst
	}
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	var tiers [NumTiers]*Index
	found := false
	for t := TierHost; t < NumTiers; t++ {
		if l := ix.lower[t]; l != nil && l.Len() > 0 {
			tiers[t], found = l, true
		}
	}
	if !found {
		return dst
	}
	type walk struct {
		w          WorkerID
		pos        int
		host, disk int
	}
	walks := make([]walk, 0, len(device)+4)
	at := make(map[WorkerID]int, len(device)+4)
	for _, o := range device {
		if _, ok := at[o.Worker]; !ok && o.Blocks > 0 {
			at[o.Worker] = len(walks)
			walks = append(walks, walk{w: o.Worker, pos: o.Blocks})
		}
	}
	var roots []Overlap
	for t := TierHost; t < NumTiers; t++ {
		l := tiers[t]
		if l == nil {
			continue
		}
		// Workers holding the first block here: the whole walk from 0 for
		// those not yet matched (FindMatches is that walk).
		roots = l.FindMatches(seq, roots)
		l.mu.RLock()
		for i := range walks {
			wk := &walks[i]
			slot, ok := l.slotOf[wk.w]
			if !ok {
				continue
			}
			n := 0
			for wk.pos+n < len(seq) && l.holdsLocked(seq[wk.pos+n], slot) {
				n++
			}
			wk.pos += n
			if t == TierHost {
				wk.host += n
			} else {
				wk.disk += n
			}
		}
		l.mu.RUnlock()
		for _, o := range roots {
			if _, ok := at[o.Worker]; ok {
				continue
			}
			at[o.Worker] = len(walks)
			wk := walk{w: o.Worker, pos: o.Blocks}
			if t == TierHost {
				wk.host = o.Blocks
			} else {
				wk.disk = o.Blocks
			}
			walks = append(walks, wk)
		}
	}
	for _, wk := range walks {
		if wk.host > 0 || wk.disk > 0 {
			dst = append(dst, TierOverlap{Worker: wk.w, Host: wk.host, Disk: wk.disk})
		}
	}
	return dst
}
