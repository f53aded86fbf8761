package router

import (
	"fmt"
	"math/bits"
	"slices"
	"sync"
	"sync/atomic"
)

// Index is the prefix index: which worker holds which block, keyed by our
// content (sequence) hash. Each worker also keeps the engine's name for each
// block it holds, only to apply later removals by that name.
//
// Each worker has a block size: the index's, or its own when added with
// AddWorkerBlockSize (a fleet whose models use different block sizes shares
// one index). Hashes of blocks of different sizes are chained over different
// token counts, so they do not meet by anything but chance (2^-64): a lookup
// with one model's hashes finds the workers that hold those blocks.
//
// Routing reads (FindMatches) take the read lock and run while events apply.
type Index struct {
	blockSize int // set once by NewIndex: the default of workers added without one

	// mu guards the maps and slices below (stats are atomics, read without
	// it). Routing reads take it for reading, event application for
	// writing; the *Locked helpers say which they need.
	mu sync.RWMutex
	// blocks maps a content hash to the workers in slots 0–63 holding it,
	// one word of bits, in an open-addressing table (one probe finds the
	// word and updates it in place); wide maps it to the workers in slots 64 and up (a
	// wideSet, also one word: a few slots inline, more in the sets arena).
	// A block is a key of a map only while a worker of that map's slots
	// holds it, so a lookup reads only the maps its surviving workers sit
	// in: a fleet of 64 touches one map as a plain map would, and a prompt
	// cached only by workers past slot 63 reads only wide. wideOnly counts
	// the blocks that are keys of wide alone (Len is len(blocks)+wideOnly).
	blocks   blockTable // content hash → bits of slots 0–63 (blocktable.go)
	arena    slotArena  // the engine-name tables' big arrays (slotarena.go)
	wide     map[uint64]wideSet
	sets     [][]uint64 // arena bitsets of the wide sets not inline, by index
	freeSets []uint32   // arena entries free for reuse
	wideOnly int
	slots    []*workerBlocks // by slot; nil when free
	slotOf   map[WorkerID]int
	free     []int

	stats indexCounters
	// pend counts what the events applied under one holding of mu did,
	// added to stats when it ends (flushStatsLocked).
	pend pendingCounts
	// batchSlots: ApplyBatch's scratch, each event's worker slot (mu held).
	batchSlots []int32
	// removing: removeEventLocked's scratch, the content hashes of a
	// removed event's blocks (mu held).
	removing []uint64
	sink     uint64 // the prefetch reads land here, so they are not dropped
	// gen counts the sections that held mu for writing (bumped inside
	// them): a reader that saw gen g under mu, and later reads g again,
	// knows the index has not changed since (MergedOverlaps' cache).
	gen atomic.Uint64

	// lower holds the lower tiers (TierHost…), one index each with the
	// same workers, created with a tier's first event: a fleet without
	// offload tiers pays nothing for them, and FindMatches (device tier)
	// never reads them. Written under mu; each has its own lock, always
	// taken after mu (tiers.go).
	lower [NumTiers]*Index
}

// holdsLocked reports whether slot holds the block ch. ix.mu must be held.
func (ix *Index) holdsLocked(ch uint64, slot int) bool {
	if slot < 64 {
		return ix.blocks.word(ch)&(1<<uint(slot)) != 0
	}
	v, ok := ix.wide[ch]
	return ok && ix.wideHasLocked(v, slot)
}

// holdersLocked is how many workers hold ch and, when that is one, its
// slot. ix.mu must be held.
func (ix *Index) holdersLocked(ch uint64) (n, sole int) {
	lo := ix.blocks.word(ch)
	n, sole = bits.OnesCount64(lo), bits.TrailingZeros64(lo)
	if len(ix.wide) > 0 { // no fleet past 64 workers: skip the second map
		if v, ok := ix.wide[ch]; ok {
			wn, lowest := ix.wideCountLocked(v)
			if n == 0 {
				sole = lowest
			}
			n += wn
		}
	}
	return n, sole
}

// addHolderLocked records that slot (not yet a holder) holds ch. ix.mu must
// be held for writing.
func (ix *Index) addHolderLocked(ch uint64, slot int) {
	if slot < 64 {
		p, inBlocks := ix.blocks.ref(ch)
		if !inBlocks && len(ix.wide) > 0 {
			if _, inWide := ix.wide[ch]; inWide {
				ix.wideOnly--
			}
		}
		*p |= 1 << uint(slot)
		return
	}
	_, inBlocks := ix.blocks.get(ch)
	v, inWide := ix.wide[ch]
	if !inBlocks && !inWide {
		ix.wideOnly++
	}
	ix.wide[ch] = ix.wideAddLocked(v, inWide, slot)
}

// dropHolderLocked records that slot (a holder) no longer holds ch. ix.mu
// must be held for writing.
func (ix *Index) dropHolderLocked(ch uint64, slot int) {
	if slot < 64 {
		ix.dropLowLocked(ch, slot)
		return
	}
	_, inBlocks := ix.blocks.get(ch)
	if v, left := ix.wideRemoveLocked(ix.wide[ch], slot); left {
		ix.wide[ch] = v
		return
	}
	delete(ix.wide, ch)
	if !inBlocks {
		ix.wideOnly--
	}
}

// dropLowLocked clears slot's bit (slot < 64) in ch's word, in one probe,
// and returns the word left and whether slot held ch (nothing changes when
// not); a word left empty leaves the table. ix.mu must be held for
// writing.
func (ix *Index) dropLowLocked(ch uint64, slot int) (uint64, bool) {
	lo, had := ix.blocks.clearBits(ch, 1<<uint(slot))
	if had && lo == 0 && len(ix.wide) > 0 {
		if _, inWide := ix.wide[ch]; inWide {
			ix.wideOnly++
		}
	}
	return lo, had
}

// workerBlocks is one worker's view: engine hash → content hash for blocks
// whose engine name differs from the content hash (engines that already use
// our hash, like kvmock, cost nothing here), how many blocks it holds, and
// how many of those no other worker holds.
type workerBlocks struct {
	id        WorkerID
	blockSize int        // the worker's events' block size: never 0 (the index's when added without one)
	engine    blockTable // engine hash → content hash, where they differ
	held      int
	unique    int
}

type indexCounters struct {
	storedBlocks    atomic.Uint64
	removedBlocks   atomic.Uint64
	unknownRemovals atomic.Uint64
	duplicateStores atomic.Uint64
	missingParents  atomic.Uint64
	sizeMismatches  atomic.Uint64
	unknownWorkers  atomic.Uint64
	clears          atomic.Uint64
	overCapacity    atomic.Uint64
}

// IndexStats are the index's counters since it was created.
type IndexStats struct {
	StoredBlocks    uint64 // blocks newly recorded
	RemovedBlocks   uint64
	UnknownRemovals uint64 // removes of engine hashes the worker did not hold (ignored)
	DuplicateStores uint64 // stores of blocks the worker already held (no change)
	MissingParents  uint64 // stored events rejected: parent not held
	SizeMismatches  uint64 // events rejected: block size differs from the worker's
	UnknownWorkers  uint64 // events for workers not in the index
	Clears          uint64
	OverCapacity    uint64 // stored events refused by ApplyCapped's cap
}

// NewIndex returns an empty index for blocks of blockSize tokens.
func NewIndex(blockSize int) *Index {
	return &Index{
		blockSize: blockSize,
		wide:      make(map[uint64]wideSet),
		slotOf:    make(map[WorkerID]int),
	}
}

// BlockSize is the configured tokens per block: the block size of workers
// added without their own.
func (ix *Index) BlockSize() int { return ix.blockSize }

// AddWorker makes w known to the index, with the index's block size.
// Adding a known worker is a no-op.
func (ix *Index) AddWorker(w WorkerID) { ix.AddWorkerBlockSize(w, 0) }

// AddWorkerBlockSize makes w known to the index with its own block size
// (0 or less = the index's): w's events are checked against it. Adding a
// known worker is a no-op, whatever the size (its blocks were hashed at
// the size it has): remove it first to change its block size.
func (ix *Index) AddWorkerBlockSize(w WorkerID, blockSize int) {
	if blockSize <= 0 {
		blockSize = ix.blockSize
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.gen.Add(1)
	if _, ok := ix.slotOf[w]; ok {
		return
	}
	wb := &workerBlocks{id: w, blockSize: blockSize}
	wb.engine.arena = &ix.arena
	slot := len(ix.slots)
	if n := len(ix.free); n > 0 {
		// Reuse the lowest free slot so slots stay dense and below 64.
		slices.Sort(ix.free)
		slot, ix.free = ix.free[0], ix.free[1:]
		ix.slots[slot] = wb
	} else {
		ix.slots = append(ix.slots, wb)
	}
	ix.slotOf[w] = slot
}

// WorkerBlockSize is w's block size (the index's unless it was added with
// its own), or false when w is not known.
func (ix *Index) WorkerBlockSize(w WorkerID) (int, bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if slot, ok := ix.slotOf[w]; ok {
		return ix.slots[slot].blockSize, true
	}
	return 0, false
}

// RemoveWorker forgets w and every block it held.
func (ix *Index) RemoveWorker(w WorkerID) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.gen.Add(1)
	slot, ok := ix.slotOf[w]
	if !ok {
		return
	}
	ix.clearLocked(slot)
	ix.slots[slot].engine.release()
	ix.slots[slot] = nil
	delete(ix.slotOf, w)
	ix.free = append(ix.free, slot)
	for _, t := range ix.lower {
		if t != nil {
			t.RemoveWorker(w)
		}
	}
}

// HasWorker reports whether w is known.
func (ix *Index) HasWorker(w WorkerID) bool {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	_, ok := ix.slotOf[w]
	return ok
}

// Workers returns the known workers, sorted.
func (ix *Index) Workers() []WorkerID {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	out := make([]WorkerID, 0, len(ix.slotOf))
	for w := range ix.slotOf {
		out = append(out, w)
	}
	slices.Sort(out)
	return out
}

// Apply applies one event of worker w. Applying the same event twice changes
// nothing. A rejected event (unknown worker, a block size other than the
// worker's, missing parent) changes nothing and returns a typed error.
func (ix *Index) Apply(w WorkerID, ev KVEvent) error { return ix.ApplyCapped(w, ev, 0) }

// ApplyCapped is Apply with a cap on the blocks w may hold: a stored event
// that would take w past maxHeld blocks is refused whole with a
// *CapacityError (removals, clears and stores of blocks w already holds
// always apply). maxHeld <= 0 means no cap. The decision depends only on the index and the event, so replicas
// holding the same index decide alike (fsm caps each worker rank at a
// multiple of its registered capacity).
func (ix *Index) ApplyCapped(w WorkerID, ev KVEvent, maxHeld int) error {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.gen.Add(1)
	slot, ok := ix.slotOf[w]
	if !ok {
		slot = -1
	}
	err := ix.applyEventLocked(w, slot, &ev, maxHeld, true)
	ix.flushStatsLocked()
	return err
}

// applyEventLocked is ApplyCapped's work for one event of worker w in slot
// (-1: not in the index), counting into ix.pend (the caller flushes).
// prefetch: read the event's slots ahead here (ApplyBatch reads them
// itself, further ahead). ix.mu must be held for writing.
func (ix *Index) applyEventLocked(w WorkerID, slot int, ev *KVEvent, maxHeld int, prefetch bool) error {
	if slot < 0 {
		ix.pend.unknownWorkers++
		return fmt.Errorf("apply %s event of worker %s: %w", ev.Kind, w, ErrUnknownWorker)
	}
	wb := ix.slots[slot]
	if ev.Tier != TierDevice {
		return ix.applyLowerLocked(wb, *ev, maxHeld)
	}
	switch ev.Kind {
	case EventStored:
		if ev.BlockSize != 0 && ev.BlockSize != wb.blockSize {
			ix.pend.sizeMismatches++
			return &BlockSizeError{Worker: w, Got: ev.BlockSize, Want: wb.blockSize}
		}
		if ev.HasParent && !ix.holdsEngineLocked(slot, wb, ev.Parent) {
			ix.pend.missingParents++
			return &MissingParentError{Worker: w, Parent: ev.Parent}
		}
		if maxHeld > 0 && wb.held+len(ev.Blocks) > maxHeld {
			// Only now count exactly: blocks w already holds add nothing.
			// (A block named twice in the event counts twice: the
			// decision errs toward refusing, deterministically.)
			adding := 0
			for _, b := range ev.Blocks {
				if !ix.holdsLocked(b.ContentHash, slot) {
					adding++
				}
			}
			if adding > 0 && wb.held+adding > maxHeld {
				ix.pend.overCapacity++
				return &CapacityError{Worker: w, Held: wb.held, Adding: adding, Limit: maxHeld}
			}
		}
		if slot < 64 && prefetch {
			ix.prefetchStoredLocked(wb, ev.Blocks)
		}
		for _, b := range ev.Blocks {
			ix.storeLocked(slot, wb, b)
		}
	case EventRemoved:
		ix.removeEventLocked(slot, wb, ev.Removed, prefetch && slot < 64)
	case EventCleared:
		ix.pend.clears++
		ix.clearLocked(slot)
	default:
		return fmt.Errorf("apply event of worker %s: kind %d: %w", w, ev.Kind, ErrInvalidEvent)
	}
	return nil
}

// pendingCounts are the counts of the events applied under one holding of
// ix.mu, added to the counters when it ends (flushStatsLocked): one atomic
// add per counter per event, or per batch, not per block.
type pendingCounts struct {
	stored, removed, unknown, dups                                       uint64
	unknownWorkers, sizeMismatches, missingParents, overCapacity, clears uint64
}

// flushStatsLocked adds the pending counts to the counters.
// ix.mu must be held for writing.
func (ix *Index) flushStatsLocked() {
	p := &ix.pend
	add := func(c *atomic.Uint64, n uint64) {
		if n != 0 {
			c.Add(n)
		}
	}
	add(&ix.stats.storedBlocks, p.stored)
	add(&ix.stats.removedBlocks, p.removed)
	add(&ix.stats.unknownRemovals, p.unknown)
	add(&ix.stats.duplicateStores, p.dups)
	add(&ix.stats.unknownWorkers, p.unknownWorkers)
	add(&ix.stats.sizeMismatches, p.sizeMismatches)
	add(&ix.stats.missingParents, p.missingParents)
	add(&ix.stats.overCapacity, p.overCapacity)
	add(&ix.stats.clears, p.clears)
	*p = pendingCounts{}
}

// prefetchStoredLocked reads, ahead of a stored event's blocks, the table
// slots their application will read: each block's engine name in wb's
// aliases and its content hash in blocks. The reads do not depend on one
// another, so the cache misses of the whole event overlap instead of
// coming one after another; the blocks then apply in order, as before,
// over lines already fetched. Reads only: the state and its order of
// changes are exactly the unbatched ones. ix.mu must be held.
func (ix *Index) prefetchStoredLocked(wb *workerBlocks, blocks []StoredBlock) {
	if len(blocks) < 2 {
		return
	}
	acc := uint64(0)
	for _, b := range blocks {
		if b.EngineHash != b.ContentHash {
			acc ^= wb.engine.peek(b.EngineHash)
		}
		acc ^= ix.blocks.peek(b.ContentHash)
	}
	ix.sink = acc
}

// holdsEngineLocked: ix.mu must be held.
func (ix *Index) holdsEngineLocked(slot int, wb *workerBlocks, eh uint64) bool {
	if _, ok := wb.engine.get(eh); ok {
		return true
	}
	return ix.holdsLocked(eh, slot)
}

// storeLocked: ix.mu must be held for writing.
func (ix *Index) storeLocked(slot int, wb *workerBlocks, b StoredBlock) {
	if b.EngineHash != b.ContentHash {
		p, existed := wb.engine.ref(b.EngineHash)
		old := *p
		*p = b.ContentHash
		if existed && old != b.ContentHash {
			// The engine reused a name for other content: the old block is gone.
			ix.dropLocked(slot, wb, old)
		}
	}
	if slot < 64 {
		ix.storeLowLocked(slot, wb, b.ContentHash)
		return
	}
	if ix.holdsLocked(b.ContentHash, slot) {
		ix.pend.dups++
		return
	}
	n, sole := ix.holdersLocked(b.ContentHash)
	ix.countJoinLocked(wb, n, sole)
	ix.addHolderLocked(b.ContentHash, slot)
	wb.held++
	ix.pend.stored++
}

// storeLowLocked is storeLocked's block for slot < 64: one probe finds
// ch's word, tells whether slot holds it and who else does, and takes the
// new bit. ix.mu must be held for writing.
func (ix *Index) storeLowLocked(slot int, wb *workerBlocks, ch uint64) {
	bit := uint64(1) << uint(slot)
	p, existed := ix.blocks.ref(ch)
	lo := *p
	if lo&bit != 0 {
		ix.pend.dups++
		return
	}
	n, sole := bits.OnesCount64(lo), bits.TrailingZeros64(lo)
	if len(ix.wide) > 0 {
		if v, ok := ix.wide[ch]; ok {
			wn, lowest := ix.wideCountLocked(v)
			if n == 0 {
				sole = lowest
			}
			n += wn
			if !existed {
				ix.wideOnly--
			}
		}
	}
	ix.countJoinLocked(wb, n, sole)
	*p = lo | bit // nothing entered the table since ref: p still points at ch's word
	wb.held++
	ix.pend.stored++
}

// countJoinLocked keeps the unique counts right when wb joins a block's
// n holders (sole: the one when n is 1). ix.mu must be held for writing.
func (ix *Index) countJoinLocked(wb *workerBlocks, n, sole int) {
	switch n {
	case 0:
		wb.unique++
	case 1:
		if other := ix.slots[sole]; other != nil {
			other.unique--
		}
	}
}

// removeEventLocked applies a removed event's blocks in two passes: the
// engine names leave wb's aliases, giving each block's content hash, then
// the content hashes leave the holder words. The passes touch different
// tables and neither reads what the other writes, so the outcome is that
// of removing block by block; the split finds each engine name once (a
// read-ahead of the words needs the content hashes first: it used to look
// every name up twice) and reads the words ahead with the hashes the first
// pass found. prefetch: read the engine names' and the words' slots ahead
// (slot < 64 only). ix.mu must be held for writing.
func (ix *Index) removeEventLocked(slot int, wb *workerBlocks, removed []uint64, prefetch bool) {
	prefetch = prefetch && len(removed) > 1
	if prefetch && wb.engine.Len() > 0 {
		acc := uint64(0)
		for _, eh := range removed {
			acc ^= wb.engine.peek(eh)
		}
		ix.sink = acc
	}
	chs := ix.removing[:0]
	acc := uint64(0)
	for _, eh := range removed {
		ch, ok := wb.engine.remove(eh)
		if !ok {
			ch = eh
		}
		chs = append(chs, ch)
		if prefetch {
			// The word's read goes out as soon as its hash is known, so it
			// overlaps the rest of this pass (3 % less CPU than a loop of
			// its own after it, in-process A/B).
			acc ^= ix.blocks.peek(ch)
		}
	}
	ix.sink ^= acc
	for _, ch := range chs {
		if ix.dropLocked(slot, wb, ch) {
			ix.pend.removed++
		} else {
			ix.pend.unknown++
		}
	}
	ix.removing = chs[:0]
	if cap(chs) > 1<<12 {
		ix.removing = nil // a huge event's scratch is not kept
	}
}

// dropLocked clears slot's bit for content hash ch; false if it was not set.
func (ix *Index) dropLocked(slot int, wb *workerBlocks, ch uint64) bool {
	if slot < 64 {
		// One probe: the word tells whether slot holds ch, and the
		// holders left after it.
		lo, had := ix.dropLowLocked(ch, slot)
		if !had {
			return false
		}
		n, sole := bits.OnesCount64(lo), bits.TrailingZeros64(lo)
		if len(ix.wide) > 0 {
			if v, ok := ix.wide[ch]; ok {
				wn, lowest := ix.wideCountLocked(v)
				if n == 0 {
					sole = lowest
				}
				n += wn
			}
		}
		ix.countLeaveLocked(wb, n, sole)
		wb.held--
		return true
	}
	if !ix.holdsLocked(ch, slot) {
		return false
	}
	ix.leaveLocked(wb, slot, ch)
	wb.held--
	return true
}

// leaveLocked removes slot (worker wb, a holder) from the holders of ch
// and keeps the unique counts right. ix.mu must be held for writing.
func (ix *Index) leaveLocked(wb *workerBlocks, slot int, ch uint64) {
	ix.dropHolderLocked(ch, slot)
	n, sole := ix.holdersLocked(ch)
	ix.countLeaveLocked(wb, n, sole)
}

// countLeaveLocked keeps the unique counts right when wb has left a block
// that n workers still hold (sole: the one when n is 1). ix.mu must be
// held for writing.
func (ix *Index) countLeaveLocked(wb *workerBlocks, n, sole int) {
	switch n {
	case 0:
		wb.unique--
	case 1:
		if other := ix.slots[sole]; other != nil {
			other.unique++
		}
	}
}

// clearLocked drops every block of slot. ix.mu must be held for writing.
func (ix *Index) clearLocked(slot int) {
	wb := ix.slots[slot]
	if wb.held == 0 {
		wb.engine.clear()
		return
	}
	mine := ix.slotBlocksLocked(slot, make([]uint64, 0, wb.held))
	for _, ch := range mine {
		ix.leaveLocked(wb, slot, ch)
	}
	wb.held, wb.unique = 0, 0
	wb.engine.clear()
}

// slotBlocksLocked appends the content hashes slot holds to dst, walking
// only the map of its range. ix.mu must be held.
func (ix *Index) slotBlocksLocked(slot int, dst []uint64) []uint64 {
	if slot < 64 {
		for ch, lo := range ix.blocks.all() {
			if lo&(1<<uint(slot)) != 0 {
				dst = append(dst, ch)
			}
		}
		return dst
	}
	for ch, v := range ix.wide {
		if ix.wideHasLocked(v, slot) {
			dst = append(dst, ch)
		}
	}
	return dst
}

// Overlap is how many leading blocks of a prompt a worker holds.
type Overlap struct {
	Worker WorkerID
	Blocks int
}

// FindMatches returns, for every worker holding at least the first block of
// seq (sequence hashes in prompt order), the length of its contiguous cached
// prefix. It appends to dst to let hot callers reuse a buffer.
func (ix *Index) FindMatches(seq []uint64, dst []Overlap) []Overlap {
	dst = dst[:0]
	if len(seq) == 0 {
		return dst
	}
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if len(ix.wide) == 0 {
		return ix.matchSmallLocked(seq, ix.blocks.word(seq[0]), dst)
	}
	return ix.matchWideLocked(seq, dst)
}

// matchLead is how many blocks ahead of the walk FindMatches asks for
// the table's lines with the prefetch instruction, on top of the group
// of 8 it loads together: the next groups' misses are on their way while
// this one's apply.
const matchLead = 16

// matchSmallLocked walks the prompt while the surviving workers all sit in
// slots 0–63: one table lookup and two word operations per block. The
// lookups of a few blocks at a time go first, apart from the walk that
// uses them, so their memory fetches overlap (matchWideLocked does the
// same); a few lookups past the end of a match are the price.
// ix.mu must be held.
func (ix *Index) matchSmallLocked(seq []uint64, cur uint64, dst []Overlap) []Overlap {
	const ahead = 8
	var los [ahead]uint64
	if hasPrefetch && cur != 0 {
		for _, h := range seq[1:min(len(seq), 1+matchLead)] {
			ix.blocks.prefetch(h)
		}
	}
	for start := 1; start < len(seq) && cur != 0; start += ahead {
		end := min(start+ahead, len(seq))
		if hasPrefetch {
			for _, h := range seq[min(start+matchLead, len(seq)):min(end+matchLead, len(seq))] {
				ix.blocks.prefetch(h)
			}
		}
		for i := start; i < end; i++ {
			los[i-start] = ix.blocks.word(seq[i])
		}
		for i := start; i < end; i++ {
			next := los[i-start] & cur
			if dropped := cur &^ next; dropped != 0 {
				dst = ix.appendSlotsLocked(dst, dropped, 0, i)
			}
			if cur = next; cur == 0 {
				return dst
			}
		}
	}
	return ix.appendSlotsLocked(dst, cur, 0, len(seq))
}

// matchWideLocked is matchSmallLocked for fleets with slots 64 and up. The
// surviving wide workers are a bitset by arena word (hi) with the list of
// its words that still have bits (live), so each block costs a lookup in
// blocks while workers of slots 0–63 survive, one in wide while wider ones
// do, and a word operation per live word: a prompt held by two workers of
// 1,024 costs what it costs in a fleet of 64. Drops are reported as
// matchSmallLocked reports them, word 0 first then by word.
// ix.mu must be held.
func (ix *Index) matchWideLocked(seq []uint64, dst []Overlap) []Overlap {
	lo := ix.blocks.word(seq[0])
	first, ok := ix.wide[seq[0]]
	if !ok {
		return ix.matchSmallLocked(seq, lo, dst)
	}
	words := wideWordOf(len(ix.slots)-1) + 1
	var hiBuf [16]uint64 // 1,088 slots without an allocation
	var liveBuf [16]int
	hi, live := hiBuf[:0], liveBuf[:0]
	if words > len(hiBuf) {
		hi, live = make([]uint64, 0, words), make([]int, 0, words)
	}
	hi = hi[:words]
	for k := range hi {
		if hi[k] = ix.wideWordLocked(first, k); hi[k] != 0 {
			live = append(live, k)
		}
	}
	// The lookups of a few blocks at a time go first, apart from the walk
	// that uses them: they do not depend on one another, so the memory
	// fetches overlap instead of each waiting for the walk's branches (a
	// few lookups past the end of a match are the price).
	const ahead = 8
	var los [ahead]uint64
	var vs [ahead]wideSet
	for start := 1; start < len(seq); start += ahead {
		end := min(start+ahead, len(seq))
		if lo != 0 {
			for i := start; i < end; i++ {
				los[i-start] = ix.blocks.word(seq[i])
			}
		}
		if len(live) > 0 {
			for i := start; i < end; i++ {
				vs[i-start] = ix.wide[seq[i]] // absent: 0, the empty inline set
			}
		}
		for i := start; i < end; i++ {
			if lo != 0 {
				next := los[i-start] & lo
				if dropped := lo &^ next; dropped != 0 {
					dst = ix.appendSlotsLocked(dst, dropped, 0, i)
				}
				lo = next
			}
			n := 0
			for _, k := range live {
				next := hi[k] & ix.wideWordLocked(vs[i-start], k)
				if next != hi[k] {
					dst = ix.appendSlotsLocked(dst, hi[k]&^next, 64*(k+1), i)
					hi[k] = next
				}
				if next != 0 {
					live[n] = k
					n++
				}
			}
			live = live[:n]
			if lo == 0 && n == 0 {
				return dst
			}
		}
	}
	dst = ix.appendSlotsLocked(dst, lo, 0, len(seq))
	for _, k := range live {
		dst = ix.appendSlotsLocked(dst, hi[k], 64*(k+1), len(seq))
	}
	return dst
}

// appendSlotsLocked appends Overlap{worker, blocks} for every live slot set
// in word (bit b is slot base+b). ix.mu must be held.
func (ix *Index) appendSlotsLocked(dst []Overlap, word uint64, base, blocks int) []Overlap {
	for word != 0 {
		b := bits.TrailingZeros64(word)
		word &^= 1 << uint(b)
		if wb := ix.slots[base+b]; wb != nil {
			dst = append(dst, Overlap{Worker: wb.id, Blocks: blocks})
		}
	}
	return dst
}

// Holders is how many workers hold the block with content hash ch.
func (ix *Index) Holders(ch uint64) int {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	n, _ := ix.holdersLocked(ch)
	return n
}

// Held is how many blocks worker w holds.
func (ix *Index) Held(w WorkerID) int {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if slot, ok := ix.slotOf[w]; ok {
		return ix.slots[slot].held
	}
	return 0
}

// Unique is how many of the blocks worker w holds no other worker holds:
// losing one of them loses the content, losing any other block does not.
func (ix *Index) Unique(w WorkerID) int {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if slot, ok := ix.slotOf[w]; ok {
		return ix.slots[slot].unique
	}
	return 0
}

// CacheCounts is Held and Unique of w under one lock (kv-pooled's
// CacheStats).
func (ix *Index) CacheCounts(w WorkerID) (held, unique int) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if slot, ok := ix.slotOf[w]; ok {
		return ix.slots[slot].held, ix.slots[slot].unique
	}
	return 0, 0
}

// Len is the number of distinct blocks held by any worker.
func (ix *Index) Len() int {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.blocks.Len() + ix.wideOnly
}

// WorkerBlocks lists the blocks w holds, sorted by content hash then engine
// hash, for snapshots and digests (deterministic whatever the map order).
func (ix *Index) WorkerBlocks(w WorkerID) []StoredBlock {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	slot, ok := ix.slotOf[w]
	if !ok {
		return nil
	}
	wb := ix.slots[slot]
	out := make([]StoredBlock, 0, wb.held)
	aliased := make(map[uint64]bool, wb.engine.Len())
	for eh, ch := range wb.engine.all() {
		out = append(out, StoredBlock{EngineHash: eh, ContentHash: ch})
		aliased[ch] = true
	}
	for _, ch := range ix.slotBlocksLocked(slot, make([]uint64, 0, wb.held)) {
		if !aliased[ch] {
			out = append(out, StoredBlock{EngineHash: ch, ContentHash: ch})
		}
	}
	slices.SortFunc(out, compareStored)
	return out
}

// AllWorkerBlocks is WorkerBlocks for every worker at once, in one pass
// over the index (snapshots and digests: per-worker calls would each walk
// the whole index).
func (ix *Index) AllWorkerBlocks() map[WorkerID][]StoredBlock {
	res := ix.CopyWorkerBlocks().Resolve()
	out := make(map[WorkerID][]StoredBlock, len(res))
	for id, r := range res {
		out[id] = r.Blocks
	}
	return out
}

func compareStored(a, b StoredBlock) int {
	if a.ContentHash != b.ContentHash {
		if a.ContentHash < b.ContentHash {
			return -1
		}
		return 1
	}
	switch {
	case a.EngineHash < b.EngineHash:
		return -1
	case a.EngineHash > b.EngineHash:
		return 1
	}
	return 0
}

// Stats returns the counters.
func (ix *Index) Stats() IndexStats {
	return IndexStats{
		StoredBlocks:    ix.stats.storedBlocks.Load(),
		RemovedBlocks:   ix.stats.removedBlocks.Load(),
		UnknownRemovals: ix.stats.unknownRemovals.Load(),
		DuplicateStores: ix.stats.duplicateStores.Load(),
		MissingParents:  ix.stats.missingParents.Load(),
		SizeMismatches:  ix.stats.sizeMismatches.Load(),
		UnknownWorkers:  ix.stats.unknownWorkers.Load(),
		Clears:          ix.stats.clears.Load(),
		OverCapacity:    ix.stats.overCapacity.Load(),
	}
}
