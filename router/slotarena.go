package router

// slotArena hands the index's engine-name tables their slot arrays of 1 MB
// and more, carved from 32 MB slabs on huge pages, and takes them back when
// a table grows out of one or its worker leaves. A worker's engine names
// are a table of their own (64 workers holding 32K blocks each: 64 tables
// of 1 MB); each on the heap's 4 KB pages, a removal's first read (its
// engine name, at random in one of them) missed the TLB nearly every time,
// as the holder words did before they had huge pages of their own
// (hugepages_linux.go; the holder words' table, one big array, asks for
// them itself). Arrays under 1 MB come from the heap as before: a fleet
// whose workers hold fewer than ~45K engine names each never makes a slab.
//
// Not safe for concurrent use: Index guards it with its lock.
type slotArena struct {
	slab []tableSlot         // what is left of the newest slab
	free map[int][]slotChunk // arrays given back, by length
}

// slotChunk is an array given back to the arena.
type slotChunk []tableSlot

const (
	arenaMinSlots  = 1 << 16 // 1 MB: the smallest array the arena hands out
	arenaSlabSlots = 1 << 21 // 32 MB: a slab, and the largest array it hands out
)

// get returns a zeroed array of n slots (a power of two) from the arena,
// or nil when n is outside its sizes or there is no arena (the caller
// makes its own).
func (a *slotArena) get(n int) []tableSlot {
	if a == nil || n < arenaMinSlots || n > arenaSlabSlots {
		return nil
	}
	if l := a.free[n]; len(l) > 0 {
		s := l[len(l)-1]
		a.free[n] = l[:len(l)-1]
		clear(s)
		return s
	}
	if len(a.slab) < n {
		a.spill()
		a.slab = make([]tableSlot, arenaSlabSlots)
		adviseHugePages(a.slab)
		collapseHugePages(a.slab) // zeroed memory the heap had touched
	}
	s := a.slab[:n:n]
	a.slab = a.slab[n:]
	return s
}

// put takes back an array get handed out (any other, and any with no
// arena, is left to the collector). The caller no longer uses it.
func (a *slotArena) put(s []tableSlot) {
	n := len(s)
	if a == nil || n < arenaMinSlots || n > arenaSlabSlots || n&(n-1) != 0 {
		return
	}
	if a.free == nil {
		a.free = make(map[int][]slotChunk)
	}
	a.free[n] = append(a.free[n], s[:n:n])
}

// spill gives what is left of the slab to the free lists, in
// power-of-two pieces (every array carved from it is a multiple of the
// smallest, so the rest is too).
func (a *slotArena) spill() {
	for rest := a.slab; len(rest) >= arenaMinSlots; {
		n := arenaSlabSlots
		for n > len(rest) {
			n >>= 1
		}
		a.put(rest[:n:n])
		rest = rest[n:]
	}
	a.slab = nil
}
