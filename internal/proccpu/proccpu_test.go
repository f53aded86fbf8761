package proccpu

import "testing"

// TestSelfCountsWork: the CPU time grows while the process computes
// (tens of milliseconds of arithmetic, far above getrusage's accounting
// granularity).
func TestSelfCountsWork(t *testing.T) {
	before := Self()
	x := uint64(1)
	for range 1 << 25 {
		x = x*6364136223846793005 + 1442695040888963407
	}
	after := Self()
	if after <= before || before < 0 {
		t.Fatalf("CPU time %v, then %v after computing (%d)", before, after, x)
	}
}
