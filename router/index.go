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
	// blocks maps a content hash to the workers in slots 0–63 holding it;
	// wide holds the words for slots 64 and up, only for blocks that have
	// such holders. A block held by anyone is always a key of blocks (value
	// 0 when only wide slots hold it). Splitting keeps the common map's
	// values one word, so a lookup touches as little memory as a plain map.
	blocks map[uint64]uint64
	wide   map[uint64][]uint64
	slots  []*workerBlocks // by slot; nil when free
	slotOf map[WorkerID]int
	free   []int

	stats indexCounters
}

// workerSet is a bitset of worker slots; slots 0–63 inline so the common
// fleet costs one word per block.
type workerSet struct {
	lo uint64
	hi *[]uint64 // slots 64 and up, word i covers slots 64(i+1)…
}

func (s workerSet) has(slot int) bool {
	if slot < 64 {
		return s.lo&(1<<uint(slot)) != 0
	}
	if s.hi == nil {
		return false
	}
	w := slot/64 - 1
	return w < len(*s.hi) && (*s.hi)[w]&(1<<uint(slot%64)) != 0
}

func (s workerSet) empty() bool {
	if s.lo != 0 {
		return false
	}
	if s.hi != nil {
		for _, w := range *s.hi {
			if w != 0 {
				return false
			}
		}
	}
	return true
}

func (s workerSet) count() int {
	n := bits.OnesCount64(s.lo)
	if s.hi != nil {
		for _, w := range *s.hi {
			n += bits.OnesCount64(w)
		}
	}
	return n
}

// with returns s with slot added (copying hi: values in the map are never
// mutated in place, so readers holding a copy stay consistent).
func (s workerSet) with(slot int) workerSet {
	if slot < 64 {
		s.lo |= 1 << uint(slot)
		return s
	}
	w := slot/64 - 1
	var hi []uint64
	if s.hi != nil {
		hi = slices.Clone(*s.hi)
	}
	for len(hi) <= w {
		hi = append(hi, 0)
	}
	hi[w] |= 1 << uint(slot%64)
	s.hi = &hi
	return s
}

func (s workerSet) without(slot int) workerSet {
	if slot < 64 {
		s.lo &^= 1 << uint(slot)
		return s
	}
	if s.hi == nil {
		return s
	}
	w := slot/64 - 1
	if w >= len(*s.hi) {
		return s
	}
	hi := slices.Clone(*s.hi)
	hi[w] &^= 1 << uint(slot%64)
	s.hi = &hi
	return s
}

// getLocked returns the holders of ch. ix.mu must be held.
func (ix *Index) getLocked(ch uint64) (workerSet, bool) {
	lo, ok := ix.blocks[ch]
	if !ok {
		return workerSet{}, false
	}
	s := workerSet{lo: lo}
	if len(ix.wide) > 0 { // no fleet past 64 workers: skip the second map
		if hi, wide := ix.wide[ch]; wide {
			s.hi = &hi
		}
	}
	return s, true
}

// putLocked stores the holders of ch, deleting it when empty. ix.mu must be held for writing.
func (ix *Index) putLocked(ch uint64, s workerSet) {
	if s.empty() {
		delete(ix.blocks, ch)
		if len(ix.wide) > 0 {
			delete(ix.wide, ch)
		}
		return
	}
	ix.blocks[ch] = s.lo
	if s.hi != nil && (workerSet{hi: s.hi}).count() > 0 {
		ix.wide[ch] = *s.hi
	} else if len(ix.wide) > 0 {
		delete(ix.wide, ch)
	}
}

// workerBlocks is one worker's view: engine hash → content hash for blocks
// whose engine name differs from the content hash (engines that already use
// our hash, like kvmock, cost nothing here), how many blocks it holds, and
// how many of those no other worker holds.
type workerBlocks struct {
	id        WorkerID
	blockSize int // the worker's events' block size: never 0 (the index's when added without one)
	engine    map[uint64]uint64
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
		blocks:    make(map[uint64]uint64),
		wide:      make(map[uint64][]uint64),
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
	if _, ok := ix.slotOf[w]; ok {
		return
	}
	wb := &workerBlocks{id: w, blockSize: blockSize, engine: make(map[uint64]uint64)}
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
	slot, ok := ix.slotOf[w]
	if !ok {
		return
	}
	ix.clearLocked(slot)
	ix.slots[slot] = nil
	delete(ix.slotOf, w)
	ix.free = append(ix.free, slot)
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
	slot, ok := ix.slotOf[w]
	if !ok {
		ix.stats.unknownWorkers.Add(1)
		return fmt.Errorf("apply %s event of worker %s: %w", ev.Kind, w, ErrUnknownWorker)
	}
	wb := ix.slots[slot]
	switch ev.Kind {
	case EventStored:
		if ev.BlockSize != 0 && ev.BlockSize != wb.blockSize {
			ix.stats.sizeMismatches.Add(1)
			return &BlockSizeError{Worker: w, Got: ev.BlockSize, Want: wb.blockSize}
		}
		if ev.HasParent && !ix.holdsEngineLocked(slot, wb, ev.Parent) {
			ix.stats.missingParents.Add(1)
			return &MissingParentError{Worker: w, Parent: ev.Parent}
		}
		if maxHeld > 0 && wb.held+len(ev.Blocks) > maxHeld {
			// Only now count exactly: blocks w already holds add nothing.
			// (A block named twice in the event counts twice: the
			// decision errs toward refusing, deterministically.)
			adding := 0
			for _, b := range ev.Blocks {
				if set, _ := ix.getLocked(b.ContentHash); !set.has(slot) {
					adding++
				}
			}
			if adding > 0 && wb.held+adding > maxHeld {
				ix.stats.overCapacity.Add(1)
				return &CapacityError{Worker: w, Held: wb.held, Adding: adding, Limit: maxHeld}
			}
		}
		for _, b := range ev.Blocks {
			ix.storeLocked(slot, wb, b)
		}
	case EventRemoved:
		for _, eh := range ev.Removed {
			ix.removeLocked(slot, wb, eh)
		}
	case EventCleared:
		ix.stats.clears.Add(1)
		ix.clearLocked(slot)
	default:
		return fmt.Errorf("apply event of worker %s: kind %d: %w", w, ev.Kind, ErrInvalidEvent)
	}
	return nil
}

// holdsEngineLocked: ix.mu must be held.
func (ix *Index) holdsEngineLocked(slot int, wb *workerBlocks, eh uint64) bool {
	if _, ok := wb.engine[eh]; ok {
		return true
	}
	set, _ := ix.getLocked(eh)
	return set.has(slot)
}

// storeLocked: ix.mu must be held for writing.
func (ix *Index) storeLocked(slot int, wb *workerBlocks, b StoredBlock) {
	if b.EngineHash != b.ContentHash {
		if old, ok := wb.engine[b.EngineHash]; ok && old != b.ContentHash {
			// The engine reused a name for other content: the old block is gone.
			ix.dropLocked(slot, wb, old)
		}
		wb.engine[b.EngineHash] = b.ContentHash
	}
	set, _ := ix.getLocked(b.ContentHash)
	if set.has(slot) {
		ix.stats.duplicateStores.Add(1)
		return
	}
	switch set.count() {
	case 0:
		wb.unique++
	case 1:
		if sole := ix.soleLocked(set); sole != nil {
			sole.unique--
		}
	}
	ix.putLocked(b.ContentHash, set.with(slot))
	wb.held++
	ix.stats.storedBlocks.Add(1)
}

// soleLocked is the worker of a one-holder set (nil if its slot is free).
// ix.mu must be held.
func (ix *Index) soleLocked(set workerSet) *workerBlocks {
	if set.lo != 0 {
		return ix.slots[bits.TrailingZeros64(set.lo)]
	}
	for w, word := range *set.hi {
		if word != 0 {
			return ix.slots[64*(w+1)+bits.TrailingZeros64(word)]
		}
	}
	return nil
}

// removeLocked: ix.mu must be held for writing.
func (ix *Index) removeLocked(slot int, wb *workerBlocks, eh uint64) {
	ch, ok := wb.engine[eh]
	if ok {
		delete(wb.engine, eh)
	} else {
		ch = eh
	}
	if !ix.dropLocked(slot, wb, ch) {
		ix.stats.unknownRemovals.Add(1)
		return
	}
	ix.stats.removedBlocks.Add(1)
}

// dropLocked clears slot's bit for content hash ch; false if it was not set.
func (ix *Index) dropLocked(slot int, wb *workerBlocks, ch uint64) bool {
	set, ok := ix.getLocked(ch)
	if !ok || !set.has(slot) {
		return false
	}
	ix.leaveLocked(wb, set, slot, ch)
	wb.held--
	return true
}

// leaveLocked removes slot (worker wb) from set, the holders of ch, and
// keeps the unique counts right. ix.mu must be held for writing.
func (ix *Index) leaveLocked(wb *workerBlocks, set workerSet, slot int, ch uint64) {
	rest := set.without(slot)
	switch rest.count() {
	case 0:
		wb.unique--
	case 1:
		if sole := ix.soleLocked(rest); sole != nil {
			sole.unique++
		}
	}
	ix.putLocked(ch, rest)
}

// clearLocked drops every block of slot. ix.mu must be held for writing.
func (ix *Index) clearLocked(slot int) {
	wb := ix.slots[slot]
	if wb.held == 0 {
		clear(wb.engine)
		return
	}
	var mine []uint64
	for ch := range ix.blocks {
		if set, _ := ix.getLocked(ch); set.has(slot) {
			mine = append(mine, ch)
		}
	}
	for _, ch := range mine {
		set, _ := ix.getLocked(ch)
		ix.leaveLocked(wb, set, slot, ch)
	}
	wb.held, wb.unique = 0, 0
	clear(wb.engine)
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
		return ix.matchSmallLocked(seq, ix.blocks[seq[0]], dst)
	}
	first, ok := ix.getLocked(seq[0])
	if !ok {
		return dst
	}
	return ix.matchWideLocked(seq, first, dst)
}

// matchSmallLocked walks the prompt while the surviving workers all sit in
// slots 0–63: one map lookup and two word operations per block.
// ix.mu must be held.
func (ix *Index) matchSmallLocked(seq []uint64, cur uint64, dst []Overlap) []Overlap {
	for i := 1; i < len(seq) && cur != 0; i++ {
		next := ix.blocks[seq[i]] & cur
		if dropped := cur &^ next; dropped != 0 {
			dst = ix.appendSlotsLocked(dst, dropped, 0, i)
		}
		cur = next
	}
	return ix.appendSlotsLocked(dst, cur, 0, len(seq))
}

// matchWideLocked is matchSmallLocked for fleets with slots 64 and up.
// ix.mu must be held.
func (ix *Index) matchWideLocked(seq []uint64, first workerSet, dst []Overlap) []Overlap {
	cur := []uint64{first.lo}
	if first.hi != nil {
		cur = append(cur, *first.hi...)
	}
	next := make([]uint64, len(cur))
	for i := 1; i < len(seq); i++ {
		set, _ := ix.getLocked(seq[i])
		alive := false
		for w := range cur {
			var word uint64
			if w == 0 {
				word = set.lo
			} else if set.hi != nil && w-1 < len(*set.hi) {
				word = (*set.hi)[w-1]
			}
			next[w] = cur[w] & word
			if dropped := cur[w] &^ next[w]; dropped != 0 {
				dst = ix.appendSlotsLocked(dst, dropped, w*64, i)
			}
			alive = alive || next[w] != 0
		}
		cur, next = next, cur
		if !alive {
			return dst
		}
	}
	for w := range cur {
		dst = ix.appendSlotsLocked(dst, cur[w], w*64, len(seq))
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
	set, _ := ix.getLocked(ch)
	return set.count()
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
	return len(ix.blocks)
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
	aliased := make(map[uint64]bool, len(wb.engine))
	for eh, ch := range wb.engine {
		out = append(out, StoredBlock{EngineHash: eh, ContentHash: ch})
		aliased[ch] = true
	}
	for ch := range ix.blocks {
		if set, _ := ix.getLocked(ch); set.has(slot) && !aliased[ch] {
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
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	lists := make([][]StoredBlock, len(ix.slots))
	aliased := make([]map[uint64]bool, len(ix.slots))
	for slot, wb := range ix.slots {
		if wb == nil {
			continue
		}
		lists[slot] = make([]StoredBlock, 0, wb.held)
		aliased[slot] = make(map[uint64]bool, len(wb.engine))
		for eh, ch := range wb.engine {
			lists[slot] = append(lists[slot], StoredBlock{EngineHash: eh, ContentHash: ch})
			aliased[slot][ch] = true
		}
	}
	for ch, lo := range ix.blocks {
		add := func(slot int) {
			if slot < len(ix.slots) && ix.slots[slot] != nil && !aliased[slot][ch] {
				lists[slot] = append(lists[slot], StoredBlock{EngineHash: ch, ContentHash: ch})
			}
		}
		for w := lo; w != 0; w &= w - 1 {
			add(bits.TrailingZeros64(w))
		}
		if hi, ok := ix.wide[ch]; ok {
			for i, word := range hi {
				for w := word; w != 0; w &= w - 1 {
					add(64*(i+1) + bits.TrailingZeros64(w))
				}
			}
		}
	}
	out := make(map[WorkerID][]StoredBlock, len(ix.slotOf))
	for slot, wb := range ix.slots {
		if wb == nil {
			continue
		}
		slices.SortFunc(lists[slot], compareStored)
		out[wb.id] = lists[slot]
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
