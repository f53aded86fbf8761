package sim

import (
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/router"
)

// blocksSeen steps s to the end and returns, per router, the worker w0's
// active blocks each time they changed, with the virtual time.
type blocksAt struct {
	at     time.Duration
	blocks int
}

func blocksSeen(t *testing.T, s *state) [][]blocksAt {
	t.Helper()
	seen := make([][]blocksAt, len(s.rts))
	for s.step() {
		for k, rt := range s.rts {
			b := rt.Load().Load(s.ids[0]).ActiveBlocks
			if n := len(seen[k]); n == 0 || seen[k][n-1].blocks != b {
				seen[k] = append(seen[k], blocksAt{s.now, b})
			}
		}
	}
	if s.finished != len(s.res) {
		t.Fatalf("%d of %d finished", s.finished, len(s.res))
	}
	return seen
}

func maxBlocks(seen []blocksAt) int {
	m := 0
	for _, x := range seen {
		m = max(m, x.blocks)
	}
	return m
}

// One request of 256 + 32 prompt tokens (18 full blocks of 16) generating
// 64 on one worker: its output opens blocks at tokens 1, 17, 33 and 49
// (288 + g − 1 a multiple of 16; the 64th is the last and is not
// reported), so with output tracking the router's view peaks at 18 + 4
// = 22 blocks. With the output length as the expected output (osl) every
// block decays by g/64 when one appears: 19·(1 − 1/64) = 18.7 → 19, then
// 20·(1 − 17/64) = 14.7 → 15, 21·(1 − 33/64) = 10.2 → 10, 22·(1 − 49/64)
// = 5.2 → 5.
func TestSimOutputBlocks(t *testing.T) {
	cases := []struct {
		name        string
		track, hint bool
		want        []int // w0's active blocks as they change
	}{
		{"off", false, false, []int{18, 0}},
		{"off with osl", false, true, []int{18, 0}},
		{"tracked", true, false, []int{18, 19, 20, 21, 22, 0}},
		{"tracked with osl", true, true, []int{18, 19, 15, 10, 5, 0}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			w := synthetic(t, workload.SyntheticSpec{Prefixes: 1, PrefixTokens: 256, TailTokens: 32, OutputTokens: 64, Requests: 1, Concurrency: 1, Seed: 3})
			cfg := config(router.ModeKV, 1, 256)
			cfg.Router.TrackOutputBlocks, cfg.OSLHint = c.track, c.hint
			s := &state{w: w, cfg: cfg, feed: true}
			if err := s.build(); err != nil {
				t.Fatal(err)
			}
			s.start()
			seen := blocksSeen(t, s)[0]
			var got []int
			for _, x := range seen {
				got = append(got, x.blocks)
			}
			if len(got) != len(c.want) {
				t.Fatalf("active blocks %v, want %v", got, c.want)
			}
			for i := range got {
				if got[i] != c.want[i] {
					t.Fatalf("active blocks %v, want %v", got, c.want)
				}
			}
		})
	}
}

// Two routers, 100 ms of sync lag: router 1 books router 0's request's
// output blocks (SetOutput) exactly the lag after router 0 did, and ends
// empty.
func TestSimOutputBlocksSynced(t *testing.T) {
	const lag = 100 * time.Millisecond
	w := synthetic(t, workload.SyntheticSpec{Prefixes: 1, PrefixTokens: 256, TailTokens: 32, OutputTokens: 64, Requests: 1, Concurrency: 1, Seed: 3})
	cfg := config(router.ModeKV, 1, 256)
	cfg.Router.TrackOutputBlocks = true
	cfg.Routers, cfg.SyncDelay = 2, lag
	s := &state{w: w, cfg: cfg, feed: true}
	if err := s.build(); err != nil {
		t.Fatal(err)
	}
	s.start()
	seen := blocksSeen(t, s)
	if len(seen[1]) == 0 || seen[1][0] != (blocksAt{0, 0}) {
		t.Fatalf("router 1 starts with %v, want nothing booked at 0", seen[1])
	}
	seen[1] = seen[1][1:] // the booking itself arrives the lag later too
	if len(seen[0]) != 6 || len(seen[1]) != 6 {
		t.Fatalf("router views %v and %v: want 6 values each (18…22, 0)", seen[0], seen[1])
	}
	for i := range seen[0] {
		a, b := seen[0][i], seen[1][i]
		if a.blocks != b.blocks || b.at-a.at != lag {
			t.Errorf("change %d: router 0 %d blocks at %v, router 1 %d at %v: want the same %v later", i, a.blocks, a.at, b.blocks, b.at, lag)
		}
	}
	if maxBlocks(seen[1]) != 22 {
		t.Errorf("router 1 peaks at %d blocks, want 22", maxBlocks(seen[1]))
	}
}
