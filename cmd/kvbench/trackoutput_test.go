package main

import (
	"io"
	"testing"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/router"
)

// --track-output-blocks reaches every policy's router configuration (sim
// and tune build theirs with routerConfig); --sim-osl-hint is the
// simulator's. Both default to off.
func TestSimTrackOutputBlocksFlags(t *testing.T) {
	o, err := parseSimFlags([]string{"--policies", "kv,kv-pooled"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.TrackOutputBlocks || o.OSLHint || o.routerConfig(router.ModeKV).TrackOutputBlocks {
		t.Fatalf("defaults: track %v, osl %v", o.TrackOutputBlocks, o.OSLHint)
	}
	o, err = parseSimFlags([]string{"--policies", "kv,kv-pooled", "--track-output-blocks", "--sim-osl-hint"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range o.Policies {
		if !o.routerConfig(m).TrackOutputBlocks {
			t.Errorf("%s: TrackOutputBlocks off", m)
		}
	}
	if !o.OSLHint {
		t.Error("--sim-osl-hint not set")
	}
	if c := o.reportConfig(mustWorkload(t, o), 0); !c.TrackOutputBlocks || !c.OSLHint {
		t.Errorf("report config %+v", c)
	}
}

func mustWorkload(t *testing.T, o *simOptions) *workload.Workload {
	t.Helper()
	ws, err := o.workloads(io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	return ws[0]
}
