package splitmix

import "testing"

// The reference values are SplitMix64's published first outputs from seed
// 0 (as in Vigna's splitmix64.c, which seeds xoshiro): Next from states 0,
// Gamma, 2·Gamma, ….
func TestSplitMixReference(t *testing.T) {
	want := []uint64{0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, 0x06c45d188009454f}
	state := uint64(0)
	for i, w := range want {
		if got := Next(state); got != w {
			t.Fatalf("output %d: %#x, want %#x", i, got, w)
		}
		state += Gamma
	}
	if Mix(0) != 0 {
		t.Fatalf("Mix(0) = %#x, want 0 (the finaliser fixes zero)", Mix(0))
	}
}
