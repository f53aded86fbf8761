package router

import (
	"iter"
	"math/bits"
	"math/rand/v2"
)

// blockTable maps a 64-bit block hash to a 64-bit word (a bitset of
// holders, or a content hash): open addressing with linear probing in one
// array of key/value pairs, so a lookup is one cache line in the common
// case, an update writes the slot the lookup found, and a batch of keys
// can have their lines fetched together (touch) before it is applied.
// Deletion shifts the following keys back (no tombstones), so probe
// sequences stay as short as the load allows.
//
// Key 0 marks an empty slot; the key 0 itself (a hash like any other) is
// kept beside the array. The slot of a key is the top bits of
// (key ^ seed)·φ: block hashes are already uniform, and the seed (drawn
// per table, like Go's map seeds) keeps a client from choosing prompts
// whose hashes pile into one run of slots. The seed decides the layout
// only: nothing that reads the table depends on its order.
//
// Not safe for concurrent use: Index guards it with its lock.
type blockTable struct {
	slots []tableSlot // len 0 or a power of two
	shift uint        // 64 − log2(len(slots))
	seed  uint64
	n     int // keys in slots
	zero  bool
	zeroV uint64 // the value of key 0, when zero
	// arena, when set, gives the table its arrays of 1 MB and more and
	// takes back the ones it grows out of (the engine-name tables:
	// slotarena.go).
	arena *slotArena
	sink  uint64 // touch's loads land here, so they are not dropped
}

type tableSlot struct{ key, val uint64 }

// The table grows when a key would take it past 7/10 full: linear
// probing's expected probes stay under 2 for a hit and under 6 for a miss.
const (
	tableLoadNum, tableLoadDen = 7, 10
	tableMinSlots              = 8
)

func (t *blockTable) home(k uint64) uint64 { return slotHome(k, t.seed, t.shift) }

// slotHome is the home slot of k in a table of seed and shift. The shift is
// at most 61 (8 slots or more); & 63 says so to the compiler, which then
// shifts without the guard for counts of 64 and up.
func slotHome(k, seed uint64, shift uint) uint64 {
	return ((k ^ seed) * 0x9e3779b97f4a7c15) >> (shift & 63)
}

// Len is how many keys the table holds.
func (t *blockTable) Len() int {
	if t.zero {
		return t.n + 1
	}
	return t.n
}

// get returns k's value and whether k is present.
func (t *blockTable) get(k uint64) (uint64, bool) {
	if k == 0 {
		return t.zeroV, t.zero
	}
	if t.n == 0 {
		return 0, false
	}
	mask := uint64(len(t.slots) - 1)
	for i := t.home(k); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.key == k {
			return s.val, true
		}
		if s.key == 0 {
			return 0, false
		}
	}
}

// word is get's value alone (0 when absent): a holder bitset.
func (t *blockTable) word(k uint64) uint64 {
	v, _ := t.get(k)
	return v
}

// ref returns a pointer to k's value, inserting k with value 0 when
// absent (existed false). The pointer is good until the next insertion.
func (t *blockTable) ref(k uint64) (v *uint64, existed bool) {
	if k == 0 {
		existed, t.zero = t.zero, true
		return &t.zeroV, existed
	}
	if (t.n+1)*tableLoadDen > len(t.slots)*tableLoadNum {
		t.grow()
	}
	mask := uint64(len(t.slots) - 1)
	for i := t.home(k); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.key == k {
			return &s.val, true
		}
		if s.key == 0 {
			s.key = k
			t.n++
			return &s.val, false
		}
	}
}

// set stores v under k.
func (t *blockTable) set(k, v uint64) {
	p, _ := t.ref(k)
	*p = v
}

// remove deletes k and returns its value, or false when absent.
func (t *blockTable) remove(k uint64) (uint64, bool) {
	if k == 0 {
		v, ok := t.zeroV, t.zero
		t.zero, t.zeroV = false, 0
		return v, ok
	}
	i, ok := t.find(k)
	if !ok {
		return 0, false
	}
	v := t.slots[i].val
	t.removeAt(i)
	return v, true
}

// clearBits clears bits in k's value when k is present and holds all of
// them, and removes k when nothing is left: one probe. It returns the value
// left and whether the bits were there (nothing changes when not).
func (t *blockTable) clearBits(k, bits uint64) (left uint64, had bool) {
	if k == 0 {
		if !t.zero || t.zeroV&bits != bits {
			return 0, false
		}
		if t.zeroV &^= bits; t.zeroV == 0 {
			t.zero = false
		}
		return t.zeroV, true
	}
	i, ok := t.find(k)
	if !ok || t.slots[i].val&bits != bits {
		return 0, false
	}
	if left = t.slots[i].val &^ bits; left != 0 {
		t.slots[i].val = left
	} else {
		t.removeAt(i)
	}
	return left, true
}

// find is the slot of k (not 0), or false.
func (t *blockTable) find(k uint64) (uint64, bool) {
	if t.n == 0 {
		return 0, false
	}
	mask := uint64(len(t.slots) - 1)
	for i := t.home(k); ; i = (i + 1) & mask {
		switch t.slots[i].key {
		case k:
			return i, true
		case 0:
			return 0, false
		}
	}
}

// removeAt empties slot i and shifts back every following key of the run
// whose home is not in (i, j]: it was placed past i because i was taken.
func (t *blockTable) removeAt(i uint64) {
	// The table's fields in locals: the stores into slots would otherwise
	// make the compiler reload them every step.
	slots, seed, shift := t.slots, t.seed, t.shift
	mask := uint64(len(slots) - 1)
	for j := (i + 1) & mask; ; j = (j + 1) & mask {
		s := slots[j]
		if s.key == 0 {
			break
		}
		if h := slotHome(s.key, seed, shift); (j-h)&mask >= (j-i)&mask {
			slots[i] = s
			i = j
		}
	}
	slots[i] = tableSlot{}
	t.n--
}

// peek reads k's home slot ahead of its use: with a prefetch instruction
// (prefetch_asm.go) it asks for the slot's cache line and returns 0 at
// once; without one it loads the slot and returns its key, which callers
// fold into a sink so the load is not dropped (a load holds the pipeline
// until its line comes once a few dozen are in flight, a prefetch does
// not: 20–26 % less CPU per applied block, BENCHMARKS.md issue 31).
func (t *blockTable) peek(k uint64) uint64 {
	if t.n == 0 {
		return 0
	}
	s := &t.slots[t.home(k)]
	if hasPrefetch {
		prefetchLine(s)
		return 0
	}
	return s.key
}

// prefetch asks for k's home slot's line with the prefetch instruction
// (a no-op without one: callers test hasPrefetch first).
func (t *blockTable) prefetch(k uint64) {
	if t.n != 0 {
		prefetchLine(&t.slots[t.home(k)])
	}
}

// grow doubles the slots (or makes the first ones) and reinserts.
func (t *blockTable) grow() {
	old := t.slots
	size := max(2*len(old), tableMinSlots)
	if t.seed == 0 {
		t.seed = rand.Uint64() | 1
	}
	if t.slots = t.arena.get(size); t.slots == nil {
		t.slots = make([]tableSlot, size)
		adviseHugePages(t.slots) // before the reinsertion writes it: its pages fault in huge
	}
	t.shift = uint(64 - bits.TrailingZeros(uint(size)))
	mask := uint64(size - 1)
	for _, s := range old {
		if s.key == 0 {
			continue
		}
		i := t.home(s.key)
		for t.slots[i].key != 0 {
			i = (i + 1) & mask
		}
		t.slots[i] = s
	}
	collapseHugePages(t.slots) // the pages the heap had touched before
	t.arena.put(old)
}

// release gives the table's array back to its arena and empties the
// table (a worker leaving the index).
func (t *blockTable) release() {
	t.arena.put(t.slots)
	*t = blockTable{arena: t.arena}
}

// clear empties the table and keeps its slots for the keys to come.
func (t *blockTable) clear() {
	clear(t.slots)
	t.n, t.zero, t.zeroV = 0, false, 0
}

// all yields every key and value, in no particular order. The table must
// not change during the walk.
func (t *blockTable) all() iter.Seq2[uint64, uint64] {
	return func(yield func(uint64, uint64) bool) {
		if t.zero && !yield(0, t.zeroV) {
			return
		}
		for _, s := range t.slots {
			if s.key != 0 && !yield(s.key, s.val) {
				return
			}
		}
	}
}
