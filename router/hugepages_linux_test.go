//go:build linux

package router

import (
	"bufio"
	"fmt"
	"os"
	"strings"
	"testing"
	"unsafe"
)

// TestIndexBlockTableHugePages: a table grown past 4 MB asks for huge
// pages, and gets them where the kernel gives them to who asks
// (transparent huge pages in "madvise" or "always" mode): its mapping
// reports huge anonymous pages. Skipped where they are off.
func TestIndexBlockTableHugePages(t *testing.T) {
	mode, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled")
	if err != nil || strings.Contains(string(mode), "[never]") {
		t.Skipf("transparent huge pages off here (%q, %v)", mode, err)
	}
	var tab blockTable
	const keys = 300_000 // 512K slots: 8 MB
	for k := uint64(1); k <= keys; k++ {
		tab.set(k*0x9e3779b97f4a7c15, k)
	}
	if got := len(tab.slots) * int(unsafe.Sizeof(tableSlot{})); got < 8<<20 {
		t.Fatalf("table of %d bytes, want at least 8 MB", got)
	}
	// The first whole 2 MB page of the slots: madvise splits the heap's
	// mapping there.
	at := (uintptr(unsafe.Pointer(&tab.slots[0])) + 2<<20 - 1) &^ (2<<20 - 1)
	if huge := smapsAnonHuge(t, at); huge == 0 {
		t.Fatalf("the mapping holding the table's slots (at %#x) has no huge pages", at)
	}
	for k := uint64(1); k <= keys; k++ { // and the content is the content
		if v, ok := tab.get(k * 0x9e3779b97f4a7c15); !ok || v != k {
			t.Fatalf("key %d: %d %v", k, v, ok)
		}
	}
}

// smapsAnonHuge is the AnonHugePages figure (kB) of the mapping of this
// process that holds addr.
func smapsAnonHuge(t *testing.T, addr uintptr) int {
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		t.Skipf("no smaps: %v", err)
	}
	defer f.Close()
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		var lo, hi uintptr
		if n, _ := fmt.Sscanf(line, "%x-%x", &lo, &hi); n == 2 && strings.Contains(line, "-") && !strings.HasSuffix(strings.Fields(line)[0], ":") {
			in = lo <= addr && addr < hi
			continue
		}
		var kb int
		if in && strings.HasPrefix(line, "AnonHugePages:") {
			fmt.Sscanf(strings.TrimPrefix(line, "AnonHugePages:"), "%d", &kb)
			return kb
		}
	}
	t.Fatalf("no mapping holds %#x", addr)
	return 0
}
