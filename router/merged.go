package router

import (
	"slices"
	"sync"
)

// MergedOverlaps is one OverlapSource over several: the block index sharded
// across Raft groups (issue 19), each part one group's index. A worker's
// blocks live in one part, except while it moves between groups: then two
// parts register it, and the one that does not own it holds a subset of
// what the owner holds (a copy in progress, which takes no events of its
// own until the owner let go of the worker). A lookup asks every part and
// concatenates, in part order, keeping one entry per worker: the owner's
// (MergeOptions.Owner), or without an owner the deepest, which the subset
// rule makes the same. Its result is then the one a single index holding
// every worker would give, up to the order of the entries (which the
// router does not depend on: cost ties break by worker id).
//
// It is also a TieredOverlapSource and a CacheStats when its parts are; a
// part that is not contributes no lower-tier hits and no counts. With
// MergeOptions.Indexes its CacheCounts' "unique" is fleet-wide: a block
// counts as unique to w only if no other worker of any part holds it, as
// in one index (kv-pooled's eviction weight).
type MergedOverlaps struct {
	parts []OverlapSource
	opt   MergeOptions

	mu    sync.Mutex         // guards the fields below: scratch and the fleet-wide counts' cache
	ixs   []*Index           // the indexes cross was counted over
	gens  []uint64           // their generations then (Index.gen)
	cross []map[WorkerID]int // per part: blocks w alone holds there that another part's worker holds too
	soles []soleBlock        // scratch: one part's blocks one worker holds
	keep  map[WorkerID]int   // scratch of dedupe's slow path
}

// MergeOptions are MergedOverlaps' optional parts.
type MergeOptions struct {
	// Owner is the index (into the parts) of the part that answers for
	// worker w, a rank key as the parts list it, or -1 when no part does
	// (or it is not known). It is asked only about a worker more than one
	// part lists, and by CacheCounts. nil: the deepest entry is kept and
	// CacheCounts reads the first part that counts blocks for w.
	Owner func(w WorkerID) int
	// Indexes, parallel to the parts, return each part's current device
	// index. With them CacheCounts' unique count is fleet-wide; without, it
	// is unique within the worker's own part.
	//
	// The fleet-wide counts take one pass over every part's index (only
	// kv-pooled asks for them), recounted when an index changed since the
	// last count (a generation each index keeps): while events flow, about
	// once per decision, a cost of the order of a walk of the whole index.
	Indexes []func() *Index
}

// NewMergedOverlaps is the merged view of parts.
func NewMergedOverlaps(parts []OverlapSource, opt MergeOptions) *MergedOverlaps {
	return &MergedOverlaps{parts: parts, opt: opt}
}

// maxInlineParts: part boundaries of up to this many parts live on the
// stack (the replica runs at most 16 data groups).
const maxInlineParts = 16

// FindMatches implements OverlapSource. Like Index.FindMatches it reuses
// dst from its start; each part, which does the same, is handed the free
// tail of the buffer so it cannot overwrite an earlier part's entries.
func (m *MergedOverlaps) FindMatches(seq []uint64, dst []Overlap) []Overlap {
	dst = dst[:0]
	var inline [maxInlineParts + 1]int
	ends := inline[:0]
	for _, p := range m.parts {
		dst = append(dst, p.FindMatches(seq, dst[len(dst):])...)
		ends = append(ends, len(dst))
	}
	return dedupe(m, dst, ends, func(o Overlap) WorkerID { return o.Worker }, func(o Overlap) int { return o.Blocks })
}

// FindTieredMatches implements TieredOverlapSource. device is the merged
// device result; each part is given it whole, and extends only its own
// workers (a part's index knows no other part's workers, so their entries
// find nothing in it; a worker two parts list is kept from one, as in
// FindMatches).
func (m *MergedOverlaps) FindTieredMatches(seq []uint64, device []Overlap, dst []TierOverlap) []TierOverlap {
	dst = dst[:0]
	var inline [maxInlineParts + 1]int
	ends := inline[:0]
	for _, p := range m.parts {
		if t, ok := p.(TieredOverlapSource); ok {
			dst = append(dst, t.FindTieredMatches(seq, device, dst[len(dst):])...)
		}
		ends = append(ends, len(dst))
	}
	return dedupe(m, dst, ends, func(o TierOverlap) WorkerID { return o.Worker }, func(o TierOverlap) int { return o.Host + o.Disk })
}

// dedupe keeps one entry per worker of dst, whose part i's entries end at
// ends[i]: the owner part's, or the deepest. Parts list each worker at most
// once, so a duplicate is a worker two parts list: a moving one, rare. The
// common case costs a hash per entry and no allocation.
func dedupe[T any](m *MergedOverlaps, dst []T, ends []int, id func(T) WorkerID, depth func(T) int) []T {
	if len(ends) < 2 || len(dst) < 2 {
		return dst
	}
	var filter [16]uint64 // 1,024 bits of worker-id hashes
	dup := false
	for i := range dst {
		h := fnv32(string(id(dst[i]))) & 1023
		if filter[h>>6]&(1<<(h&63)) != 0 && slices.ContainsFunc(dst[:i], func(o T) bool { return id(o) == id(dst[i]) }) {
			dup = true
			break
		}
		filter[h>>6] |= 1 << (h & 63)
	}
	if !dup {
		return dst
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.keep == nil {
		m.keep = map[WorkerID]int{}
	}
	clear(m.keep) // worker → the position of its kept entry
	part := 0
	for i := range dst {
		for i >= ends[part] {
			part++
		}
		w := id(dst[i])
		k, ok := m.keep[w]
		switch {
		case !ok:
			m.keep[w] = i
			continue
		case m.opt.Owner != nil:
			if owner := m.opt.Owner(w); owner == part {
				m.keep[w] = i
				continue
			} else if owner >= 0 && owner < len(ends) && partOf(ends, k) == owner {
				continue
			}
		}
		if depth(dst[i]) > depth(dst[k]) {
			m.keep[w] = i
		}
	}
	out := dst[:0]
	for i := range dst {
		if m.keep[id(dst[i])] == i {
			out = append(out, dst[i])
		}
	}
	return out
}

// partOf is the part whose entries hold position i.
func partOf(ends []int, i int) int {
	for p, e := range ends {
		if i < e {
			return p
		}
	}
	return len(ends) - 1
}

// fnv32 is FNV-1a of s (dedupe's filter; no allocation).
func fnv32(s string) uint32 {
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h ^= uint32(s[i])
		h *= 16777619
	}
	return h
}

// CacheCounts implements CacheStats: the counts of the part that owns w
// (without an owner, the first part that counts blocks for w). With
// MergeOptions.Indexes, unique leaves out the blocks only w holds in its
// part that a worker of another part holds too: unique fleet-wide.
func (m *MergedOverlaps) CacheCounts(w WorkerID) (held, unique int) {
	part := -1
	if m.opt.Owner != nil {
		part = m.opt.Owner(w)
	}
	if part < 0 || part >= len(m.parts) {
		part = -1
		for i, p := range m.parts {
			if s, ok := p.(CacheStats); ok {
				if h, _ := s.CacheCounts(w); h > 0 {
					part = i
					break
				}
			}
		}
	}
	if part < 0 {
		return 0, 0
	}
	s, ok := m.parts[part].(CacheStats)
	if !ok {
		return 0, 0
	}
	held, unique = s.CacheCounts(w)
	if unique > 0 && len(m.opt.Indexes) == len(m.parts) {
		unique = max(0, unique-m.crossHeld(part, w))
	}
	return held, unique
}

// soleBlock is a block one worker (slot) of a part holds alone there.
type soleBlock struct {
	ch     uint64
	worker WorkerID
	shared bool // another part's worker holds it too
}

// crossHeld is how many of the blocks w alone holds in part another
// part's worker holds too, recounted when an index changed.
func (m *MergedOverlaps) crossHeld(part int, w WorkerID) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.freshLocked() {
		m.countLocked()
	}
	return m.cross[part][w]
}

// freshLocked: the indexes are those cross was counted over, unchanged
// since. m.mu must be held.
func (m *MergedOverlaps) freshLocked() bool {
	if len(m.ixs) != len(m.opt.Indexes) {
		return false
	}
	for i, f := range m.opt.Indexes {
		if ix := f(); ix != m.ixs[i] || (ix != nil && ix.gen.Load() != m.gens[i]) {
			return false
		}
	}
	return true
}

// countLocked recounts cross: for each part, the blocks one worker holds
// alone in it, then whether any other part holds each with a worker other
// than that one (a worker's own copy in another part — it is moving — is
// not another holder). One part's lock at a time, so it never waits on one
// lock while holding another. The generations are read first: a change
// made during the count is seen as one the next call recounts for. m.mu
// must be held.
func (m *MergedOverlaps) countLocked() {
	n := len(m.opt.Indexes)
	m.ixs, m.gens = m.ixs[:0], m.gens[:0]
	for _, f := range m.opt.Indexes {
		ix := f()
		var g uint64
		if ix != nil {
			g = ix.gen.Load()
		}
		m.ixs, m.gens = append(m.ixs, ix), append(m.gens, g)
	}
	if len(m.cross) != n {
		m.cross = make([]map[WorkerID]int, n)
	}
	for p, ix := range m.ixs {
		if m.cross[p] == nil {
			m.cross[p] = map[WorkerID]int{}
		}
		clear(m.cross[p])
		if ix == nil {
			continue
		}
		m.soles = ix.appendSoles(m.soles[:0])
		for q, other := range m.ixs {
			if q != p && other != nil {
				other.markShared(m.soles)
			}
		}
		for _, s := range m.soles {
			if s.shared {
				m.cross[p][s.worker]++
			}
		}
	}
}

// appendSoles appends every device block exactly one worker holds.
func (ix *Index) appendSoles(dst []soleBlock) []soleBlock {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	add := func(ch uint64) {
		if n, sole := ix.holdersLocked(ch); n == 1 {
			if wb := ix.slots[sole]; wb != nil {
				dst = append(dst, soleBlock{ch: ch, worker: wb.id})
			}
		}
	}
	for ch := range ix.blocks.all() {
		add(ch)
	}
	for ch := range ix.wide {
		if _, both := ix.blocks.get(ch); !both {
			add(ch)
		}
	}
	return dst
}

// markShared sets shared on every block of soles this index holds with a
// worker other than the sole's.
func (ix *Index) markShared(soles []soleBlock) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	for i := range soles {
		s := &soles[i]
		if s.shared {
			continue
		}
		switch n, sole := ix.holdersLocked(s.ch); {
		case n > 1:
			s.shared = true
		case n == 1:
			if wb := ix.slots[sole]; wb != nil && wb.id != s.worker {
				s.shared = true
			}
		}
	}
}
