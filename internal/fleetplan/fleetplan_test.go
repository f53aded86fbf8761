package fleetplan

import (
	"slices"
	"testing"
)

func TestFleetPlanCostAndRank(t *testing.T) {
	ws := []Worker{
		{ID: "hot", BlockSize: 16, HeldBlocks: 100, UniqueBlocks: 50, CachedTokensPerS: 500},
		{ID: "shared", BlockSize: 16, HeldBlocks: 100, CachedTokensPerS: 900},
		{ID: "cold", BlockSize: 16, HeldBlocks: 40, UniqueBlocks: 40},
		{ID: "b-empty", BlockSize: 16},
		{ID: "a-empty", BlockSize: 16},
	}
	if c := Of(ws[0]); c.UniqueFraction != 0.5 || c.RecomputeTokensPerS != 250 || c.Removal != 250*300+0.1*50*16 {
		t.Fatalf("hot: %+v", c)
	}
	if c := Of(ws[1]); c.Removal != 0 || c.RecomputeTokensPerS != 0 {
		t.Fatalf("shared: %+v", c)
	}
	if c := Of(ws[3]); c.UniqueFraction != 0 || c.Removal != 0 {
		t.Fatalf("empty: %+v", c)
	}
	if got := Rank(ws); !slices.Equal(got, []int{4, 3, 1, 2, 0}) {
		t.Fatalf("rank %v", got)
	}
}
