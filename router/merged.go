package router

// MergedOverlaps is one OverlapSource over several whose worker sets are
// disjoint: the block index sharded across Raft groups (issue 19), where a
// worker's blocks live in exactly one group's index. A lookup asks every
// part and concatenates, in part order, so its result is the one a single
// index holding every worker would give, up to the order of the entries
// (which the router does not depend on: cost ties break by worker id).
//
// It is also a TieredOverlapSource and a CacheStats when its parts are;
// a part that is not contributes no lower-tier hits and no counts.
// CacheCounts' "unique" is unique within the worker's own part: a block
// held by workers of two groups counts as unique in both (kv-pooled's
// eviction weight then overstates what an eviction loses; the groups do
// not see each other's holders without a cross-group lookup per block).
type MergedOverlaps []OverlapSource

// FindMatches implements OverlapSource. Like Index.FindMatches it reuses
// dst from its start; each part, which does the same, is handed the free
// tail of the buffer so it cannot overwrite an earlier part's entries.
func (m MergedOverlaps) FindMatches(seq []uint64, dst []Overlap) []Overlap {
	dst = dst[:0]
	for _, p := range m {
		dst = append(dst, p.FindMatches(seq, dst[len(dst):])...)
	}
	return dst
}

// FindTieredMatches implements TieredOverlapSource. device is the merged
// device result; each part is given it whole, and extends only its own
// workers (a part's index knows no other part's workers, so their entries
// find nothing in it).
func (m MergedOverlaps) FindTieredMatches(seq []uint64, device []Overlap, dst []TierOverlap) []TierOverlap {
	dst = dst[:0]
	for _, p := range m {
		if t, ok := p.(TieredOverlapSource); ok {
			dst = append(dst, t.FindTieredMatches(seq, device, dst[len(dst):])...)
		}
	}
	return dst
}

// CacheCounts implements CacheStats: the counts of the part that holds w.
func (m MergedOverlaps) CacheCounts(w WorkerID) (held, unique int) {
	for _, p := range m {
		if s, ok := p.(CacheStats); ok {
			if h, u := s.CacheCounts(w); h > 0 {
				return h, u
			}
		}
	}
	return 0, 0
}
