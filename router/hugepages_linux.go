//go:build linux

package router

import (
	"runtime"
	"syscall"
	"unsafe"
)

// Huge pages for big tables. A big table's reads land at random: on 4 KB
// pages nearly every one misses the TLB, and the page walk (two-dimensional
// under a hypervisor) holds up the prefetch instruction that reads the
// slot ahead; on 2 MB pages a 32 MB table needs 16 TLB entries
// (BENCHMARKS.md, issue 31: 15 % less CPU per applied block at 1M blocks).
// Transparent huge pages give them to who asks in "madvise" mode (and to
// everyone in "always"); where they are off the calls fail and nothing
// changes. Neither call changes the table's content.

const (
	hugePage     = 2 << 20
	madvCollapse = 25 // MADV_COLLAPSE (Linux 6.1): not in package syscall
)

// hugeRange is the part of slots made of whole 2 MB pages (lo == hi: none,
// or a table under 4 MB, not worth it).
func hugeRange(slots []tableSlot) (lo, hi uintptr) {
	size := uintptr(len(slots)) * unsafe.Sizeof(tableSlot{})
	if size < 2*hugePage {
		return 0, 0
	}
	start := uintptr(unsafe.Pointer(unsafe.SliceData(slots)))
	return (start + hugePage - 1) &^ (hugePage - 1), (start + size) &^ (hugePage - 1)
}

// adviseHugePages asks for huge pages for a fresh array before it is
// written (MADV_HUGEPAGE): pages the heap has not touched yet then fault in
// huge.
func adviseHugePages(slots []tableSlot) {
	if lo, hi := hugeRange(slots); hi > lo {
		_, _, _ = syscall.Syscall(syscall.SYS_MADVISE, lo, hi-lo, syscall.MADV_HUGEPAGE)
	}
	runtime.KeepAlive(slots)
}

// collapseHugePages turns the 4 KB pages an array already had (the heap
// reuses memory, zeroed, hence touched) into huge ones now
// (MADV_COLLAPSE) rather than whenever khugepaged passes: once per growth
// of a table of 4 MB or more, a copy of its memory beside the rehash of
// every key that growth does anyway.
func collapseHugePages(slots []tableSlot) {
	if lo, hi := hugeRange(slots); hi > lo {
		_, _, _ = syscall.Syscall(syscall.SYS_MADVISE, lo, hi-lo, madvCollapse)
	}
	runtime.KeepAlive(slots)
}
