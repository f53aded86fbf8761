package tokenize

// bpeModel applies a byte-level BPE vocabulary to one pre-token at a time.
// It works on raw bytes: load time translated the vocab's byte-level
// spellings back to bytes, so no rune mapping happens per call.
type bpeModel struct {
	// byteID is the id of each single byte, -1 if the vocab lacks it (the
	// byte is then dropped, as HF does for a BPE without unk_token).
	byteID [256]int32
	// merges maps an adjacent pair of ids to the merge's rank (its line
	// number in the merges list: lower merges first) and the merged id.
	merges map[uint64]merge
	// whole maps raw bytes to ids; only set when the model has
	// ignore_merges (Llama-3), where a pre-token that is itself in the
	// vocab is emitted as one id without running merges.
	whole map[string]uint32
}

type merge struct {
	rank uint32
	id   uint32
}

func pairKey(a, b uint32) uint64 { return uint64(a)<<32 | uint64(b) }

// encodeWord appends the ids of one pre-token.
func (m *bpeModel) encodeWord(dst []uint32, word string) []uint32 {
	if m.whole != nil {
		if id, ok := m.whole[word]; ok {
			return append(dst, id)
		}
	}
	if len(word) == 1 {
		if id := m.byteID[word[0]]; id >= 0 {
			dst = append(dst, uint32(id))
		}
		return dst
	}
	return m.mergeWord(dst, word)
}

// symbol is one current piece of the word, in a doubly linked list over the
// initial byte positions. size==0 marks a piece absorbed by its left
// neighbour.
type symbol struct {
	id         uint32
	prev, next int32
	size       int32
}

// mergeWord runs BPE: repeatedly merge the adjacent pair with the lowest
// rank, leftmost first, until no adjacent pair has a merge. That order is
// what HF's BPE (and GPT-2's reference bpe()) produce; a heap keeps it
// O(n log n) so that a pathological 100 kB "word" cannot stall the router.
func (m *bpeModel) mergeWord(dst []uint32, word string) []uint32 {
	syms := make([]symbol, 0, len(word))
	for i := 0; i < len(word); i++ {
		id := m.byteID[word[i]]
		if id < 0 {
			continue
		}
		n := int32(len(syms))
		syms = append(syms, symbol{id: uint32(id), prev: n - 1, next: n + 1, size: 1})
	}
	if len(syms) == 0 {
		return dst
	}
	syms[len(syms)-1].next = -1

	var h mergeHeap
	for i := 0; i+1 < len(syms); i++ {
		if mg, ok := m.merges[pairKey(syms[i].id, syms[i+1].id)]; ok {
			h.push(mergeItem{rank: mg.rank, pos: int32(i), id: mg.id})
		}
	}
	for len(h) > 0 {
		top := h.pop()
		s := &syms[top.pos]
		// Skip entries made stale by earlier merges: the left piece was
		// absorbed, or it or its right neighbour has grown since.
		if s.size == 0 || s.next < 0 {
			continue
		}
		right := syms[s.next]
		if mg, ok := m.merges[pairKey(s.id, right.id)]; !ok || mg.id != top.id {
			continue
		}
		s.id = top.id
		s.size += right.size
		syms[s.next].size = 0
		s.next = right.next
		if s.next >= 0 {
			syms[s.next].prev = top.pos
		}
		if s.prev >= 0 {
			if mg, ok := m.merges[pairKey(syms[s.prev].id, s.id)]; ok {
				h.push(mergeItem{rank: mg.rank, pos: s.prev, id: mg.id})
			}
		}
		if s.next >= 0 {
			if mg, ok := m.merges[pairKey(s.id, syms[s.next].id)]; ok {
				h.push(mergeItem{rank: mg.rank, pos: top.pos, id: mg.id})
			}
		}
	}
	// Position 0 is never absorbed (only right pieces are), so the list
	// starts there.
	for i := int32(0); i >= 0; i = syms[i].next {
		dst = append(dst, syms[i].id)
	}
	return dst
}

type mergeItem struct {
	rank uint32
	pos  int32
	id   uint32
}

func (a mergeItem) less(b mergeItem) bool {
	if a.rank != b.rank {
		return a.rank < b.rank
	}
	return a.pos < b.pos
}

// mergeHeap is a binary min-heap on (rank, pos); hand-rolled to avoid
// container/heap's interface boxing on the hot path.
type mergeHeap []mergeItem

func (h *mergeHeap) push(it mergeItem) {
	*h = append(*h, it)
	s := *h
	for i := len(s) - 1; i > 0; {
		p := (i - 1) / 2
		if !s[i].less(s[p]) {
			break
		}
		s[i], s[p] = s[p], s[i]
		i = p
	}
}

func (h *mergeHeap) pop() mergeItem {
	s := *h
	top := s[0]
	last := len(s) - 1
	s[0] = s[last]
	s = s[:last]
	for i := 0; ; {
		l, r, min := 2*i+1, 2*i+2, i
		if l < len(s) && s[l].less(s[min]) {
			min = l
		}
		if r < len(s) && s[r].less(s[min]) {
			min = r
		}
		if min == i {
			break
		}
		s[i], s[min] = s[min], s[i]
		i = min
	}
	*h = s
	return top
}
