package engine

import (
	"fmt"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/router"
)

// OutputBlock outputs (Config.ReportOutputBlocks): one per output block
// boundary, at the token that opens it, by router.OutputBlocks' rule; none
// for the last token and none without the setting.
func TestEngineOutputBlocks(t *testing.T) {
	const bs = 4
	cases := []struct {
		prompt, output int
		want           []int // OutputTokens of the OutputBlock outputs
	}{
		// 10 prompt tokens: the partial 3rd block fills with tokens 1–2;
		// token 3 (position 12) opens block 4, 7 block 5, 11 block 6.
		{10, 12, []int{3, 7, 11}},
		// 8 prompt tokens (full blocks): the first token opens a block.
		{8, 9, []int{1, 5}}, // 9 would open a 3rd, but it is the last token
		{8, 1, nil},         // the only token is the last
		{10, 2, nil},        // fills the partial block
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("prompt %d output %d", c.prompt, c.output), func(t *testing.T) {
			for _, on := range []bool{false, true} {
				e := mustNew(t, "w", Config{BlockSize: bs, CapacityBlocks: 64, ReportOutputBlocks: on})
				if err := e.Submit(0, Request{ID: "r", Tokens: seqTokens(1, c.prompt), OutputTokens: c.output}); err != nil {
					t.Fatal(err)
				}
				var got []int
				for _, o := range runIdle(t, e) {
					if o.Kind == OutputBlock {
						got = append(got, o.OutputTokens)
						if o.PromptTokens != c.prompt || o.RequestID != "r" {
							t.Errorf("output %+v", o)
						}
					}
				}
				want := c.want
				if !on {
					want = nil
				}
				if !slices.Equal(got, want) {
					t.Errorf("report %v: OutputBlock at %v tokens, want %v", on, got, want)
				}
				// Each report is a block router.OutputBlocks counts.
				for k, g := range got {
					if n := router.OutputBlocks(c.prompt, g, bs); n != k+1 {
						t.Errorf("at %d tokens router.OutputBlocks = %d, want %d", g, n, k+1)
					}
				}
			}
		})
	}
}

// A preempted request does not report its blocks again when it is
// recomputed: the reports follow tokens generated, which a recompute does
// not repeat.
func TestEngineOutputBlocksAcrossPreemption(t *testing.T) {
	const bs = 4
	e := mustNew(t, "w", Config{BlockSize: bs, CapacityBlocks: 11, ReportOutputBlocks: true})
	for i := range 3 {
		if err := e.Submit(0, Request{ID: fmt.Sprint(i), Tokens: seqTokens(100*i+1, 12), OutputTokens: 12}); err != nil {
			t.Fatal(err)
		}
	}
	got := map[string][]int{}
	preempted := 0
	for _, o := range runIdle(t, e) {
		switch o.Kind {
		case OutputBlock:
			got[o.RequestID] = append(got[o.RequestID], o.OutputTokens)
		case Preempted:
			preempted++
		}
	}
	if preempted == 0 {
		t.Fatal("no preemption: test is vacuous")
	}
	for i := range 3 {
		if id := fmt.Sprint(i); !slices.Equal(got[id], []int{1, 5, 9}) {
			t.Errorf("request %s: OutputBlock at %v, want [1 5 9]", id, got[id])
		}
	}
}
