package hitrate

// stack is one model's block-level LRU prefix cache, kept as two segments of
// one recency order: segment A holds the most recent `capA` blocks — exactly
// what an LRU cache of capA blocks holds, because LRU is a stack algorithm
// (the content of a smaller LRU cache is always the top of a larger one's
// order on the same reference stream) — and segment B the rest, up to
// `max` blocks in all. So one hash table and one list answer both
// questions, "seen before (within max blocks)?" (available) and "held by a
// pooled LRU of the fleet's capacity?" (reachable), for one map lookup per
// block.
//
// A request runs through it as through the pooled-LRU reference of kvbench
// (cmd/kvbench/internal/sim/reference.go) and vLLM's free queue: its cached
// prefix is held (taken out of the order, so its own new blocks cannot evict
// it), then all its blocks return as
// the most recent, tail first, so a prompt's tail ages out before its
// prefix, and the least recent blocks beyond the bound are evicted. That keeps both segments prefix-closed for chained hashes, which
// is why a hit is a leading run of blocks.
//
// Memory: one node (24 bytes) and one map entry per block,
// 62.5 bytes measured (BenchmarkHitRateMemory); at most max blocks.
type stack struct {
	idx   map[uint64]int32
	nodes []node  // 0: A's sentinel, 1: B's sentinel
	free  []int32 // released nodes
	lenA  int
	lenB  int
	capA  int
	max   int
	held  []int32 // scratch: the current request's cached prefix
}

type node struct {
	hash       uint64
	prev, next int32
	inA        bool
	held       bool // in the current request's cached prefix, out of the order
}

const (
	sentA int32 = 0
	sentB int32 = 1
)

func newStack(max int) *stack {
	s := &stack{idx: make(map[uint64]int32), nodes: make([]node, 2), max: max}
	s.nodes[sentA] = node{prev: sentA, next: sentA}
	s.nodes[sentB] = node{prev: sentB, next: sentB}
	return s
}

func (s *stack) size() int { return len(s.idx) }

func (s *stack) unlink(n int32) {
	p, q := s.nodes[n].prev, s.nodes[n].next
	s.nodes[p].next, s.nodes[q].prev = q, p
	if s.nodes[n].inA {
		s.lenA--
	} else {
		s.lenB--
	}
}

// insertAfter links n after at, in at's segment (at is a node or a sentinel).
func (s *stack) insertAfter(at, n int32, inA bool) {
	q := s.nodes[at].next
	s.nodes[n].prev, s.nodes[n].next, s.nodes[n].inA = at, q, inA
	s.nodes[at].next = n
	s.nodes[q].prev = n
	if inA {
		s.lenA++
	} else {
		s.lenB++
	}
}

// balance moves blocks across the segment boundary until A holds the capA
// most recent ones (A's tail is next to B's head in the recency order).
func (s *stack) balance() {
	for s.lenA > s.capA {
		n := s.nodes[sentA].prev
		s.unlink(n)
		s.insertAfter(sentB, n, false)
	}
	for s.lenA < s.capA && s.lenB > 0 {
		n := s.nodes[sentB].next
		s.unlink(n)
		s.insertAfter(s.nodes[sentA].prev, n, true)
	}
}

// alloc returns a node for hash h.
func (s *stack) alloc(h uint64) int32 {
	var n int32
	if k := len(s.free); k > 0 {
		n = s.free[k-1]
		s.free = s.free[:k-1]
	} else {
		s.nodes = append(s.nodes, node{})
		n = int32(len(s.nodes) - 1)
	}
	s.nodes[n].hash = h
	s.idx[h] = n
	return n
}

// trim evicts the least recent blocks beyond max. Evicting after a request
// is in rather than while it arrives picks the same victims: its blocks are
// all more recent than any other (unless it alone exceeds max).
func (s *stack) trim() {
	for len(s.idx) > s.max && s.lenA+s.lenB > 0 {
		n := s.nodes[sentB].prev // B's tail is the least recent
		if s.lenB == 0 {
			n = s.nodes[sentA].prev
		}
		s.unlink(n)
		delete(s.idx, s.nodes[n].hash)
		s.free = append(s.free, n)
	}
}

// admit runs one request's prompt blocks (chained hashes, in prompt order)
// through the cache with capA = capacity and returns the leading blocks
// that were cached on arrival: anywhere (available) and within the capA
// most recent (reachable).
func (s *stack) admit(hashes []uint64, capacity int) (available, reachable int) {
	if c := min(max(capacity, 0), s.max); c != s.capA { // the fleet changed
		s.capA = c
		s.balance()
	}
	s.held = s.held[:0]
	inA := true
	for _, h := range hashes {
		n, ok := s.idx[h]
		if !ok || s.nodes[n].held { // held: a hash repeated in one prompt (a collision)
			break
		}
		s.nodes[n].held = true
		if inA = inA && s.nodes[n].inA; inA {
			reachable++
		}
		s.held = append(s.held, n)
	}
	available = len(s.held)
	for _, n := range s.held {
		s.unlink(n)
	}
	// The new blocks, tail first, then the held prefix, each becoming the
	// most recent: the prompt ends up in order at the top.
	for i := len(hashes) - 1; i >= available; i-- {
		h := hashes[i]
		n, ok := s.idx[h]
		if ok { // a block past the first miss that is cached (a hash collision)
			if s.nodes[n].held {
				continue
			}
			s.unlink(n)
		} else {
			n = s.alloc(h)
		}
		s.insertAfter(sentA, n, true)
	}
	for i := available - 1; i >= 0; i-- {
		n := s.held[i]
		s.nodes[n].held = false
		s.insertAfter(sentA, n, true)
	}
	s.trim()
	s.balance()
	return available, reachable
}
