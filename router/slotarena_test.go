package router

import (
	"testing"
	"unsafe"
)

// TestIndexSlotArena: the arena hands out zeroed arrays of its sizes only,
// reuses what it is given back, and carves slabs without overlap.
func TestIndexSlotArena(t *testing.T) {
	var a slotArena
	if s := a.get(arenaMinSlots / 2); s != nil {
		t.Fatalf("get below the smallest size: %d slots", len(s))
	}
	if s := a.get(2 * arenaSlabSlots); s != nil {
		t.Fatalf("get above a slab: %d slots", len(s))
	}
	var nilArena *slotArena
	if s := nilArena.get(arenaMinSlots); s != nil {
		t.Fatal("a nil arena handed out an array")
	}
	nilArena.put(make([]tableSlot, arenaMinSlots)) // must not panic

	// Carve a slab in mixed sizes; no two arrays share a slot.
	sizes := []int{arenaMinSlots, 4 * arenaMinSlots, arenaMinSlots, 2 * arenaMinSlots, 8 * arenaMinSlots, arenaSlabSlots}
	var got [][]tableSlot
	for _, n := range sizes {
		s := a.get(n)
		if len(s) != n || cap(s) != n {
			t.Fatalf("get(%d): len %d cap %d", n, len(s), cap(s))
		}
		for i := range s {
			if s[i] != (tableSlot{}) {
				t.Fatalf("get(%d): slot %d not zero", n, i)
			}
			s[i] = tableSlot{key: uint64(len(got) + 1), val: uint64(i)}
		}
		got = append(got, s)
	}
	for i, s := range got {
		for j, o := range got[:i] {
			lo, hi := uintptr(unsafe.Pointer(&s[0])), uintptr(unsafe.Pointer(&s[len(s)-1]))
			olo, ohi := uintptr(unsafe.Pointer(&o[0])), uintptr(unsafe.Pointer(&o[len(o)-1]))
			if lo <= ohi && olo <= hi {
				t.Fatalf("arrays %d and %d overlap", i, j)
			}
		}
		for k := range s {
			if s[k].key != uint64(i+1) || s[k].val != uint64(k) {
				t.Fatalf("array %d slot %d overwritten: %+v", i, k, s[k])
			}
		}
	}
	// The first slab's rest (32 − 16 × 1 MB of it went to arrays) was spilled
	// when the 32 MB array needed a slab of its own: 16 MB of free pieces.
	free := 0
	for n, l := range a.free {
		free += n * len(l)
	}
	if want := arenaSlabSlots - 16*arenaMinSlots; free != want {
		t.Fatalf("spilled %d slots, want %d", free, want)
	}
	// Given back, an array comes back zeroed to the next get of its size.
	back := got[1]
	a.put(back)
	again := a.get(len(back))
	if &again[0] != &back[0] {
		t.Fatal("a given-back array was not reused")
	}
	for i := range again {
		if again[i] != (tableSlot{}) {
			t.Fatalf("reused array: slot %d not zero", i)
		}
	}
}

// TestIndexBlockTableArena: tables sharing an arena, grown past 1 MB (their
// arrays then come from it), one released and another grown into what it
// gave back, hold what Go maps hold.
func TestIndexBlockTableArena(t *testing.T) {
	var a slotArena
	tabs := make([]blockTable, 3)
	refs := make([]map[uint64]uint64, len(tabs))
	for i := range tabs {
		tabs[i].arena = &a
		refs[i] = map[uint64]uint64{}
	}
	rng := newRand(11)
	check := func(step string) {
		t.Helper()
		for i := range tabs {
			if tabs[i].Len() != len(refs[i]) {
				t.Fatalf("%s: table %d holds %d keys, want %d", step, i, tabs[i].Len(), len(refs[i]))
			}
			for k, v := range refs[i] {
				if got, ok := tabs[i].get(k); !ok || got != v {
					t.Fatalf("%s: table %d key %x = %x %v, want %x", step, i, k, got, ok, v)
				}
			}
		}
	}
	fill := func(i, n int) {
		for range n {
			k, v := rng.Uint64(), rng.Uint64()
			tabs[i].set(k, v)
			refs[i][k] = v
			if rng.IntN(4) == 0 { // and remove one now and then
				for k := range refs[i] {
					if _, ok := tabs[i].remove(k); !ok {
						t.Fatalf("table %d: key %x not found to remove", i, k)
					}
					delete(refs[i], k)
					break
				}
			}
		}
	}
	for i := range tabs {
		fill(i, 60_000) // ~45K keys: 64K slots, a 1 MB array from the arena
	}
	check("filled")
	if a.slab == nil {
		t.Fatal("no slab was made: the tables' arrays did not come from the arena")
	}
	tabs[0].release()
	refs[0] = map[uint64]uint64{}
	if tabs[0].Len() != 0 || len(a.free[arenaMinSlots]) == 0 {
		t.Fatalf("release: table holds %d keys, %d free 1 MB arrays", tabs[0].Len(), len(a.free[arenaMinSlots]))
	}
	fill(1, 60_000) // grows to 2 MB, giving its 1 MB array back
	fill(0, 60_000) // made again from a given-back array
	check("after release and regrowth")
}
