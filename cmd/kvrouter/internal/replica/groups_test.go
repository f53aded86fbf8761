package replica

import (
	"fmt"
	"testing"
)

func TestChooseGroup(t *testing.T) {
	tests := []struct {
		name   string
		counts []int
		want   func(got int) bool
	}{
		{"the only group", []int{5}, func(g int) bool { return g == 0 }},
		{"the emptiest", []int{3, 1, 2}, func(g int) bool { return g == 1 }},
		{"the emptiest, last", []int{2, 2, 0}, func(g int) bool { return g == 2 }},
		{"among equals, any", []int{1, 1, 1, 1}, func(g int) bool { return g >= 0 && g < 4 }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, w := range []string{"a", "worker-7", "w#x"} {
				if got := chooseGroup(tc.counts, w); !tc.want(got) {
					t.Fatalf("chooseGroup(%v, %q) = %d", tc.counts, w, got)
				}
				if chooseGroup(tc.counts, w) != chooseGroup(append([]int(nil), tc.counts...), w) {
					t.Fatalf("chooseGroup(%v, %q) is not deterministic", tc.counts, w)
				}
			}
		})
	}
	// Filling empty groups one worker at a time keeps them within one of
	// each other, whatever the names.
	counts := make([]int, 4)
	for i := range 40 {
		counts[chooseGroup(counts, fmt.Sprintf("w%d", i))]++
		lo, hi := counts[0], counts[0]
		for _, c := range counts {
			lo, hi = min(lo, c), max(hi, c)
		}
		if hi-lo > 1 {
			t.Fatalf("after %d workers the groups hold %v", i+1, counts)
		}
	}
	// Equal groups: the tie-break spreads names over all of them.
	seen := map[int]bool{}
	for i := range 64 {
		seen[chooseGroup([]int{0, 0, 0, 0}, fmt.Sprintf("w%d", i))] = true
	}
	if len(seen) != 4 {
		t.Fatalf("64 names over four empty groups chose only %v", seen)
	}
}

func TestPreferredLeader(t *testing.T) {
	tests := []struct {
		voters []string
		group  int
		want   string
	}{
		{nil, 1, ""},
		{[]string{"r3", "r1", "r2"}, 1, "r2"},
		{[]string{"r3", "r1", "r2"}, 2, "r3"},
		{[]string{"r3", "r1", "r2"}, 3, "r1"},
		{[]string{"r1"}, 4, "r1"},
	}
	for _, tc := range tests {
		if got := preferredLeader(tc.voters, tc.group); got != tc.want {
			t.Errorf("preferredLeader(%v, %d) = %q, want %q", tc.voters, tc.group, got, tc.want)
		}
	}
}

func TestGroupAddr(t *testing.T) {
	tests := []struct {
		addr   string
		offset int
		want   string
		err    bool
	}{
		{"127.0.0.1:7001", 100, "127.0.0.1:7101", false},
		{"[::1]:7001", 200, "[::1]:7201", false},
		{"node-1.example:7000", 0, "node-1.example:7000", false},
		{"127.0.0.1:65500", 100, "", true},
		{"no-port", 100, "", true},
	}
	for _, tc := range tests {
		got, err := groupAddr(tc.addr, tc.offset)
		if (err != nil) != tc.err || got != tc.want {
			t.Errorf("groupAddr(%q, %d) = %q, %v; want %q (error %v)", tc.addr, tc.offset, got, err, tc.want, tc.err)
		}
	}
}
