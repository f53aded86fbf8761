package main

import (
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
)

// --repeat: the same prompts again, in order, under ids the simulator can
// tell apart.
func TestRepeatedWorkload(t *testing.T) {
	w, err := workload.NewSynthetic(workload.SyntheticSpec{Prefixes: 2, PrefixTokens: 64, TailTokens: 16, OutputTokens: 4,
		Requests: 5, Concurrency: 2, Seed: 3, BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	if repeated(w, 1) != w {
		t.Fatal("--repeat 1 should be the workload itself")
	}
	r := repeated(w, 3)
	if len(r.Requests) != 15 || len(w.Requests) != 5 {
		t.Fatalf("%d requests from %d (original now %d)", len(r.Requests), 5, len(w.Requests))
	}
	ids := map[string]bool{}
	for i, q := range r.Requests {
		o := w.Requests[i%5]
		if !slices.Equal(q.Hashes, o.Hashes) || q.PromptTokens != o.PromptTokens || q.Prefix != o.Prefix {
			t.Fatalf("request %d is not request %d again", i, i%5)
		}
		if ids[q.ID] {
			t.Fatalf("id %q twice", q.ID)
		}
		ids[q.ID] = true
	}
}
