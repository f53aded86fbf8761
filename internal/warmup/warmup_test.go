package warmup

import (
	"testing"

	"github.com/kvrouter/kvrouter/router"
)

func TestWarmUpSteer(t *testing.T) {
	p := Policy{Share: 0.3, Headroom: 0.8}
	row := func(id string, overlap int, busy bool) router.WorkerCost {
		return router.WorkerCost{Worker: router.WorkerID(id), Overlap: overlap, Busy: busy}
	}
	newPrefix := []router.WorkerCost{row("a", 0, false), row("b", 0, false), row("n", 0, false)}
	dup := []router.WorkerCost{row("a", 5, false), row("b", 3, false), row("n", 0, false)}
	single := []router.WorkerCost{row("a", 5, false), row("b", 0, false), row("n", 0, false)}
	busyNew := []router.WorkerCost{row("a", 0, false), row("n", 0, true)}
	for _, tc := range []struct {
		name   string
		rows   []router.WorkerCost
		chosen string
		util   float64
		draw   float64
		want   bool
	}{
		{"new prefix", newPrefix, "a", 0.5, 0.1, true},
		{"duplicated prefix", dup, "a", 0.5, 0.29, true},
		{"one holder", single, "a", 0.5, 0.1, false},
		{"outside the share", newPrefix, "a", 0.5, 0.3, false},
		{"no headroom", dup, "a", 0.8, 0.1, false},
		{"already there", newPrefix, "n", 0.5, 0.1, false},
		{"warming worker busy", busyNew, "a", 0.5, 0.1, false},
		{"warming worker absent", newPrefix[:2], "a", 0.5, 0.1, false},
	} {
		if got := Steer(tc.rows, router.WorkerID(tc.chosen), "n", tc.util, tc.draw, p); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}
