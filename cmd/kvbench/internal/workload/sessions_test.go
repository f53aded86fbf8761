package workload

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/router"
)

func agentSpec(turns, subagents, requests int, think time.Duration, seed uint64) SyntheticSpec {
	return SyntheticSpec{
		Prefixes: 3, PrefixTokens: 64, TailTokens: 20, OutputTokens: 12,
		Requests: requests, Concurrency: 2, BlockSize: 16, Seed: seed,
		Agent: AgentSpec{Turns: turns, Think: think, Subagents: subagents},
	}
}

func TestSimAgentSessionsStructure(t *testing.T) {
	for _, tc := range []struct {
		name                       string
		turns, subagents, requests int
		wantSessions, wantRoots    int
		wantChildren               []int // per root: subagents spawned by its first turn
	}{
		{"one turn each", 1, 0, 4, 4, 4, []int{0, 0, 0, 0}},
		{"four turns", 4, 0, 8, 2, 2, []int{0, 0}},
		{"cut short", 4, 0, 10, 3, 3, []int{0, 0, 0}},
		{"two subagents", 3, 2, 18, 6, 2, []int{2, 2}},
		{"subagents cut short", 3, 2, 13, 5, 2, []int{2, 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, err := NewSynthetic(agentSpec(tc.turns, tc.subagents, tc.requests, 0, 7))
			if err != nil {
				t.Fatal(err)
			}
			if len(w.Requests) != tc.requests || len(w.Sessions) != tc.wantSessions || len(w.Roots) != tc.wantRoots || !w.Agent {
				t.Fatalf("%d requests, %d sessions, %d roots (agent %v); want %d, %d, %d",
					len(w.Requests), len(w.Sessions), len(w.Roots), w.Agent, tc.requests, tc.wantSessions, tc.wantRoots)
			}
			for k, root := range w.Roots {
				first := w.Requests[w.Sessions[root][0]]
				if len(first.Children) != tc.wantChildren[k] {
					t.Fatalf("root %d spawns %d subagents, want %d", k, len(first.Children), tc.wantChildren[k])
				}
				for _, c := range first.Children {
					cs := w.Requests[c].Session
					if w.SessionRoot[cs] != root || w.Sessions[cs][0] != c {
						t.Fatalf("child %d: session %d under root %d, want a first turn under %d", c, cs, w.SessionRoot[cs], root)
					}
				}
			}
			var tok, prev []uint32
			for s, turns := range w.Sessions {
				if len(turns) == 0 || len(turns) > tc.turns {
					t.Fatalf("session %d has %d turns", s, len(turns))
				}
				for k, i := range turns {
					r := w.Requests[i]
					if r.Session != s {
						t.Fatalf("request %d names session %d, listed under %d", i, r.Session, s)
					}
					wantNext := -1
					if k+1 < len(turns) {
						wantNext = turns[k+1]
					}
					if r.NextTurn != wantNext {
						t.Fatalf("session %d turn %d: next %d, want %d", s, k, r.NextTurn, wantNext)
					}
					tok = w.Tokens(i, tok)
					if len(tok) != r.PromptTokens || !slices.Equal(r.Hashes, router.SequenceHashes(tok, 16, "")) {
						t.Fatalf("request %d: tokens and hashes disagree with its prompt length", i)
					}
					if k > 0 {
						// Growing context: the whole previous prompt, the
						// previous answer, a new user message.
						if r.PromptTokens != len(prev)+12+20 || !slices.Equal(tok[:len(prev)], prev) {
							t.Fatalf("session %d turn %d: %d tokens do not extend the previous %d by answer and message", s, k, r.PromptTokens, len(prev))
						}
					}
					prev = slices.Clone(tok)
				}
			}
		})
	}
}

func TestSimAgentSubagentsSharePrefix(t *testing.T) {
	w, err := NewSynthetic(agentSpec(2, 2, 6, 0, 3))
	if err != nil {
		t.Fatal(err)
	}
	parent := w.Sessions[w.Roots[0]][0]
	var p, c []uint32
	p = w.Tokens(parent, p)
	for _, child := range w.Requests[parent].Children {
		c = w.Tokens(child, c)
		// The parent's first prompt and its answer, then the child's task.
		if len(c) != len(p)+12+20 || !slices.Equal(c[:len(p)], p) {
			t.Fatalf("subagent %d does not start from the parent's first prompt and answer", child)
		}
	}
	a, b := w.Requests[parent].Children[0], w.Requests[parent].Children[1]
	if slices.Equal(w.Requests[a].Hashes, w.Requests[b].Hashes) {
		t.Fatal("two subagents have the same prompt: their tasks should differ")
	}
}

func TestSimAgentDeterminismAndThink(t *testing.T) {
	gen := func(seed uint64, think time.Duration, rate float64) *Workload {
		s := agentSpec(3, 1, 24, think, seed)
		s.ArrivalRate = rate
		w, err := NewSynthetic(s)
		if err != nil {
			t.Fatal(err)
		}
		return w
	}
	a, b, c := gen(5, time.Second, 0), gen(5, time.Second, 0), gen(6, time.Second, 0)
	same := func(x, y *Workload) bool {
		for i := range x.Requests {
			if !slices.Equal(x.Requests[i].Hashes, y.Requests[i].Hashes) || x.Requests[i].Think != y.Requests[i].Think {
				return false
			}
		}
		return true
	}
	if !same(a, b) {
		t.Fatal("the same seed gave two workloads")
	}
	if same(a, c) {
		t.Fatal("another seed gave the same workload")
	}
	var sum time.Duration
	for _, r := range a.Requests {
		if r.Think < 0 {
			t.Fatalf("negative think time %v", r.Think)
		}
		sum += r.Think
	}
	if sum == 0 {
		t.Fatal("no think time drawn")
	}
	for _, r := range gen(5, 0, 0).Requests {
		if r.Think != 0 {
			t.Fatal("think time without --think-time")
		}
	}
	open := gen(5, time.Second, 2)
	if !open.OpenLoop {
		t.Fatal("an arrival rate should make sessions start open loop")
	}
	for k, root := range open.Roots {
		first := open.Requests[open.Sessions[root][0]]
		if k > 0 && first.At <= open.Requests[open.Sessions[open.Roots[k-1]][0]].At {
			t.Fatalf("root %d starts at %v, not after the one before", k, first.At)
		}
	}
}

func TestSimSessionSpecErrors(t *testing.T) {
	for _, a := range []AgentSpec{
		{Turns: -1}, {Turns: MaxAgentTurns + 1}, {Turns: 2, Subagents: -1}, {Turns: 2, Subagents: MaxAgentSubagents + 1},
		{Turns: 2, Think: -time.Second}, {Subagents: 2}, {Think: time.Second},
	} {
		s := agentSpec(0, 0, 10, 0, 1)
		s.Agent = a
		if _, err := NewSynthetic(s); !errors.Is(err, ErrSpec) {
			t.Errorf("%+v: %v, want ErrSpec", a, err)
		}
	}
}
