package tokenize

import "unicode/utf8"

// bpeModel is HF's BPE model applied to one pre-token at a time. It follows
// BPE::merge_word in tokenizers 0.22: the word is cut into units, each unit
// is looked up in the vocab (with continuing_subword_prefix on all but the
// first and end_of_word_suffix on the last), a missing unit becomes its
// <0xNN> byte tokens (byte_fallback) or unk_token (fused with a preceding
// unk if fuse_unk), and then merges run lowest rank first, leftmost among
// equals.
//
// Units depend on the pre-tokenizer. After a ByteLevel pre-tokenizer HF's
// units are the byte-level runes of the word's bytes, one per byte; we keep
// the raw bytes and map them at load time, so Encode never builds the
// mapped string. Otherwise units are the word's runes (SentencePiece-style
// vocabularies such as Llama 2 and Gemma).
type bpeModel struct {
	byteLevel bool
	// vocab maps spellings (as in tokenizer.json) to ids; the slow path
	// for units that carry a prefix or suffix.
	vocab map[string]uint32
	// byteID (byte-level) is the id of each byte's unit, -1 if the vocab
	// lacks it; runeID (otherwise) the id of each single-rune entry.
	// Both ignore prefix and suffix: only used when there are none.
	byteID [256]int32
	runeID map[rune]uint32
	// prefix is continuing_subword_prefix, suffix end_of_word_suffix;
	// "" when absent (an empty one changes nothing either).
	prefix, suffix string
	byteFallback   bool
	// fallback is the id of "<0xNN>" for each byte, -1 if absent.
	fallback [256]int32
	unk      int32 // id of unk_token, -1 without one
	fuseUnk  bool
	// merges maps an adjacent pair of ids to the merge's rank (its index
	// in the merges list) and the merged id.
	merges map[uint64]merge
	// whole maps words to ids; only set with ignore_merges (Llama 3,
	// gpt-oss), where a word that is itself in the vocab is one id
	// without running merges. Keys are raw bytes in byte-level mode.
	whole map[string]uint32
}

type merge struct {
	rank uint32
	id   uint32
}

func pairKey(a, b uint32) uint64 { return uint64(a)<<32 | uint64(b) }

// encodeWord appends the ids of one non-empty pre-token.
func (m *bpeModel) encodeWord(dst []uint32, word string) []uint32 {
	if m.whole != nil {
		if id, ok := m.whole[word]; ok {
			return append(dst, id)
		}
	}
	if m.byteLevel && len(word) == 1 && m.prefix == "" && m.suffix == "" {
		if id := m.byteID[word[0]]; id >= 0 {
			return append(dst, uint32(id))
		}
	}
	syms := m.units(make([]symbol, 0, len(word)), word)
	return m.mergeWord(dst, syms)
}

// symbol is one current piece of the word, in a doubly linked list over the
// initial units. dead marks a piece absorbed by its left neighbour.
type symbol struct {
	id         uint32
	prev, next int32
	dead       bool
}

// units appends the initial symbols of word.
func (m *bpeModel) units(syms []symbol, word string) []symbol {
	add := func(id uint32) {
		n := int32(len(syms))
		syms = append(syms, symbol{id: id, prev: n - 1, next: n + 1})
	}
	fast := m.prefix == "" && m.suffix == ""
	pendingUnk := false // an unk not yet added (HF's `unk` variable)
	for i := 0; i < len(word); {
		w := 1
		var id uint32
		found := false
		if m.byteLevel {
			if fast {
				if v := m.byteID[word[i]]; v >= 0 {
					id, found = uint32(v), true
				}
			}
		} else {
			var r rune
			r, w = utf8.DecodeRuneInString(word[i:])
			if fast {
				id, found = m.runeID[r]
			}
		}
		var spelling string
		if !fast || !found {
			spelling = m.spelling(word, i, w)
			if !fast {
				id, found = m.vocab[spelling]
			}
		}
		i += w
		if found {
			if pendingUnk {
				add(uint32(m.unk))
				pendingUnk = false
			}
			add(id)
			continue
		}
		if m.byteFallback && m.addFallback(spelling, add) {
			// HF adds the byte tokens without first flushing a pending
			// unk, so that unk lands after them.
			continue
		}
		if m.unk >= 0 {
			if pendingUnk && !m.fuseUnk {
				add(uint32(m.unk))
			}
			pendingUnk = true
		}
	}
	if pendingUnk {
		add(uint32(m.unk))
	}
	if len(syms) > 0 {
		syms[len(syms)-1].next = -1
	}
	return syms
}

// spelling is the vocab spelling of the unit word[i:i+w]: byte-level runes
// in byte-level mode, with the prefix unless it is the first unit and the
// suffix if it is the last.
func (m *bpeModel) spelling(word string, i, w int) string {
	var s string
	if m.byteLevel {
		s = string(byteRunes[word[i]])
	} else {
		s = word[i : i+w]
	}
	if i > 0 {
		s = m.prefix + s
	}
	if i+w == len(word) {
		s += m.suffix
	}
	return s
}

// addFallback adds the <0xNN> tokens of s's bytes if the vocab has all of
// them, and reports whether it did.
func (m *bpeModel) addFallback(s string, add func(uint32)) bool {
	for i := 0; i < len(s); i++ {
		if m.fallback[s[i]] < 0 {
			return false
		}
	}
	for i := 0; i < len(s); i++ {
		add(uint32(m.fallback[s[i]]))
	}
	return true
}

// mergeWord runs BPE over syms: repeatedly merge the adjacent pair with the
// lowest rank, leftmost first, until no adjacent pair has a merge. A heap
// keeps it O(n log n) so that a pathological 100 kB "word" (Gemma and
// Llama 2 have no pre-tokenizer that splits words) cannot stall the router.
func (m *bpeModel) mergeWord(dst []uint32, syms []symbol) []uint32 {
	if len(syms) == 0 {
		return dst
	}
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
		// absorbed, or it or its right neighbour has changed since.
		if s.dead || s.next < 0 {
			continue
		}
		right := syms[s.next]
		if mg, ok := m.merges[pairKey(s.id, right.id)]; !ok || mg.id != top.id {
			continue
		}
		s.id = top.id
		syms[s.next].dead = true
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
