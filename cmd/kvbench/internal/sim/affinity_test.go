package sim

import (
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/router"
)

// TestSimSessionAffinity: agent sessions of a kvbench agents trace (their
// session_id) through three routers with a replica sync lag, under hard
// affinity (one shared table). With affinity every session's turns run on one worker
// and its cached fraction is no lower than without; without it some
// session moves between workers (what affinity is for). A turn never
// starts before its previous turn's end plus the think time.
func TestSimSessionAffinity(t *testing.T) {
	w, err := workload.NewAgents(workload.AgentTraceSpec{Sessions: 12, Turns: 6, Kinds: 2, SystemTokens: 2048, TurnTokens: 1024,
		OutputTokens: 64, ThinkMs: 500, StaggerMs: 100, Subagents: 1, SubTurns: 3, BlockTokens: 512, Seed: 3}, 16)
	if err != nil {
		t.Fatal(err)
	}
	moved := func(res *Result) int {
		n := 0
		for _, turns := range w.Sessions {
			for _, i := range turns[1:] {
				if res.Requests[i].Worker != res.Requests[turns[0]].Worker {
					n++
					break
				}
			}
		}
		return n
	}
	cfg := config(router.ModeKV, 4, 16384)
	cfg.Routers, cfg.SyncDelay = 3, 200*time.Millisecond
	free, freeSum := run(t, w, cfg)
	cfg.Affinity = Affinity{Mode: AffinityHard}
	bound, boundSum := run(t, w, cfg)
	if n := moved(bound); n != 0 {
		t.Errorf("with affinity %d sessions moved between workers", n)
	}
	if n := moved(free); n == 0 {
		t.Error("without affinity no session moved: the workload does not show what affinity is for")
	}
	if boundSum.CachedTokenRatio < freeSum.CachedTokenRatio {
		t.Errorf("cached fraction %.3f with affinity, %.3f without", boundSum.CachedTokenRatio, freeSum.CachedTokenRatio)
	}
	for _, turns := range w.Sessions {
		for k := 1; k < len(turns); k++ {
			prev, cur := bound.Requests[turns[k-1]], bound.Requests[turns[k]]
			if think := w.Requests[turns[k-1]].Think; cur.Sent < prev.Finished+think {
				t.Fatalf("turn %d sent at %v, its previous turn ended at %v (think %v)", turns[k], cur.Sent, prev.Finished, think)
			}
		}
	}
}
