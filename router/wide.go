package router

import "math/bits"

// wideSet is the set of workers in slots 64 and up holding one block, in
// one word so the index's second map costs what its first does.
//
// Most blocks of a large fleet are held by a few workers, so a set of up to
// wideInline slots, each below 1<<wideSlotBits, is kept inline: the slots
// ascending in 21-bit fields from the low end, a zero field ending the list
// (wide slots are never 0). Any other set (more holders, or a slot past 2M)
// is a bitset in the index's arena: the top bit set, the low 32 bits its
// index in Index.sets. The form depends only on the set (an arena set that
// shrinks back to wideInline inline-able slots goes inline again), so
// replicas holding the same blocks use the same memory.
type wideSet uint64

const (
	wideInline   = 3
	wideSlotBits = 21
	wideSlotMask = 1<<wideSlotBits - 1
	wideArena    = wideSet(1) << 63
)

// wideWordOf is the arena word holding slot's bit: word k covers slots
// 64(k+1) to 64(k+1)+63, the same numbering FindMatches walks in.
func wideWordOf(slot int) int { return slot/64 - 1 }

// inlineSlots unpacks an inline set.
func (v wideSet) inlineSlots() (slots [wideInline]int, n int) {
	for ; n < wideInline; n++ {
		s := int(uint64(v) >> (wideSlotBits * n) & wideSlotMask)
		if s == 0 {
			break
		}
		slots[n] = s
	}
	return slots, n
}

// packInline packs ascending slots, each in 64…wideSlotMask, at most wideInline.
func packInline(slots []int) wideSet {
	var v wideSet
	for i, s := range slots {
		v |= wideSet(s) << (wideSlotBits * i)
	}
	return v
}

// arenaLocked is the bitset of an arena set. ix.mu must be held.
func (ix *Index) arenaLocked(v wideSet) []uint64 { return ix.sets[uint32(v)] }

// wideHasLocked reports whether slot (64 or more) is in v. ix.mu must be held.
func (ix *Index) wideHasLocked(v wideSet, slot int) bool {
	if v&wideArena != 0 {
		set, k := ix.arenaLocked(v), wideWordOf(slot)
		return k < len(set) && set[k]&(1<<uint(slot%64)) != 0
	}
	slots, n := v.inlineSlots()
	for _, s := range slots[:n] {
		if s == slot {
			return true
		}
	}
	return false
}

// wideWordLocked is v's bits in arena word k. ix.mu must be held.
func (ix *Index) wideWordLocked(v wideSet, k int) uint64 {
	if v&wideArena != 0 {
		if set := ix.arenaLocked(v); k < len(set) {
			return set[k]
		}
		return 0
	}
	return v.inlineWord(k)
}

// inlineWord is an inline set's bits in arena word k, without loops or
// branches a lookup would mispredict (FindMatches calls it per block and
// word): an empty field is slot 0, whose word (-1) is never k.
func (v wideSet) inlineWord(k int) uint64 {
	key := uint64(k + 1) // a slot's word plus one: slot/64
	f0 := uint64(v) & wideSlotMask
	f1 := uint64(v) >> wideSlotBits & wideSlotMask
	f2 := uint64(v) >> (2 * wideSlotBits) & wideSlotMask
	var b0, b1, b2 uint64
	if f0>>6 == key {
		b0 = 1 << (f0 & 63)
	}
	if f1>>6 == key {
		b1 = 1 << (f1 & 63)
	}
	if f2>>6 == key {
		b2 = 1 << (f2 & 63)
	}
	return b0 | b1 | b2
}

// wideCountLocked is how many slots v holds, and the lowest of them (-1
// when none). ix.mu must be held.
func (ix *Index) wideCountLocked(v wideSet) (n, lowest int) {
	lowest = -1
	if v&wideArena == 0 {
		slots, n := v.inlineSlots()
		if n > 0 {
			lowest = slots[0]
		}
		return n, lowest
	}
	for k, word := range ix.arenaLocked(v) {
		if word != 0 && lowest < 0 {
			lowest = 64*(k+1) + bits.TrailingZeros64(word)
		}
		n += bits.OnesCount64(word)
	}
	return n, lowest
}

// wideEachLocked calls fn for every slot of v, ascending. ix.mu must be held.
func (ix *Index) wideEachLocked(v wideSet, fn func(slot int)) {
	if v&wideArena == 0 {
		slots, n := v.inlineSlots()
		for _, s := range slots[:n] {
			fn(s)
		}
		return
	}
	for k, word := range ix.arenaLocked(v) {
		for ; word != 0; word &= word - 1 {
			fn(64*(k+1) + bits.TrailingZeros64(word))
		}
	}
}

// wideAddLocked returns v (present: false for a block with no wide holder
// yet) with slot added; slot must not be in v. An arena set is changed in
// place: it belongs to this one block. ix.mu must be held for writing.
func (ix *Index) wideAddLocked(v wideSet, present bool, slot int) wideSet {
	if !present {
		v = 0
	}
	if v&wideArena != 0 {
		set, k := ix.arenaLocked(v), wideWordOf(slot)
		for len(set) <= k {
			set = append(set, 0)
		}
		set[k] |= 1 << uint(slot%64)
		ix.sets[uint32(v)] = set
		return v
	}
	slots, n := v.inlineSlots()
	var buf [wideInline + 1]int
	all := append(buf[:copy(buf[:], slots[:n])], slot)
	for i := len(all) - 1; i > 0 && all[i] < all[i-1]; i-- {
		all[i], all[i-1] = all[i-1], all[i]
	}
	if len(all) <= wideInline && slot <= wideSlotMask {
		return packInline(all)
	}
	return ix.newArenaLocked(all)
}

// wideRemoveLocked returns v with slot (in v) removed, and false when
// nothing is left. ix.mu must be held for writing.
func (ix *Index) wideRemoveLocked(v wideSet, slot int) (wideSet, bool) {
	if v&wideArena == 0 {
		slots, n := v.inlineSlots()
		var buf [wideInline]int
		rest := buf[:0]
		for _, s := range slots[:n] {
			if s != slot {
				rest = append(rest, s)
			}
		}
		return packInline(rest), len(rest) > 0
	}
	set := ix.arenaLocked(v)
	set[wideWordOf(slot)] &^= 1 << uint(slot%64)
	n, _ := ix.wideCountLocked(v)
	if n > wideInline {
		return v, true
	}
	var rest []int
	ix.wideEachLocked(v, func(s int) { rest = append(rest, s) })
	if n > 0 && rest[n-1] > wideSlotMask {
		return v, true // a slot past the inline range keeps the set in the arena
	}
	ix.freeArenaLocked(v)
	return packInline(rest), n > 0
}

// newArenaLocked stores slots (64 and up) as a bitset in the arena, reusing
// a freed entry and its memory when there is one. ix.mu must be held for writing.
func (ix *Index) newArenaLocked(slots []int) wideSet {
	var idx uint32
	if n := len(ix.freeSets); n > 0 {
		idx, ix.freeSets = ix.freeSets[n-1], ix.freeSets[:n-1]
	} else {
		idx = uint32(len(ix.sets))
		ix.sets = append(ix.sets, nil)
	}
	set := ix.sets[idx][:0]
	for _, s := range slots {
		k := wideWordOf(s)
		for len(set) <= k {
			set = append(set, 0)
		}
		set[k] |= 1 << uint(s%64)
	}
	ix.sets[idx] = set
	return wideArena | wideSet(idx)
}

// freeArenaLocked returns v's arena entry for reuse. ix.mu must be held for writing.
func (ix *Index) freeArenaLocked(v wideSet) {
	idx := uint32(v)
	clear(ix.sets[idx])
	ix.freeSets = append(ix.freeSets, idx)
}
