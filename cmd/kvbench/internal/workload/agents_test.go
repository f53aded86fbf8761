package workload

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

func agentTraceSpec() AgentTraceSpec {
	return AgentTraceSpec{Sessions: 3, Turns: 4, Kinds: 2, SystemTokens: 1000, TurnTokens: 700, OutputTokens: 100,
		ThinkMs: 1500, StaggerMs: 200, Subagents: 2, SubTurns: 2, BlockTokens: 512, Seed: 7}
}

// TestSimAgentRows: sessions and turns as asked; each turn's prompt is
// the previous turn's full blocks then new ones (growing context, cacheable
// across turns); a kind's sessions share their system prompt; subagents
// start from their parent's context; later turns carry the think time.
func TestSimAgentRows(t *testing.T) {
	a := agentTraceSpec()
	rows, err := AgentRows(a)
	if err != nil {
		t.Fatal(err)
	}
	if want := a.Sessions * (a.Turns + a.Subagents*a.SubTurns); len(rows) != want {
		t.Fatalf("%d rows, want %d", len(rows), want)
	}
	bySession := map[string][]TraceRow{}
	for _, r := range rows {
		if !r.HasSession || len(r.HashIDs) != (r.InputLength+a.BlockTokens-1)/a.BlockTokens {
			t.Fatalf("row %+v: no session, or hash ids that do not cover its input", r)
		}
		bySession[r.SessionID] = append(bySession[r.SessionID], r)
	}
	if len(bySession) != a.Sessions*(1+a.Subagents) {
		t.Fatalf("%d sessions", len(bySession))
	}
	for id, turns := range bySession {
		for k := 1; k < len(turns); k++ {
			prev, cur := turns[k-1], turns[k]
			full := prev.HashIDs[:prev.InputLength/a.BlockTokens]
			if cur.InputLength != prev.InputLength+a.OutputTokens+a.TurnTokens || !slices.Equal(cur.HashIDs[:len(full)], full) || cur.ThinkMs != a.ThinkMs {
				t.Fatalf("%s turn %d does not extend turn %d: %+v after %+v", id, k, k-1, cur, prev)
			}
		}
		if turns[0].ThinkMs != 0 {
			t.Errorf("%s's first turn thinks %v ms", id, turns[0].ThinkMs)
		}
		if parent, sub, ok := strings.Cut(id, "/"); ok {
			mid := bySession[parent][a.Turns/2]
			n := mid.InputLength / a.BlockTokens
			if !slices.Equal(turns[0].HashIDs[:n], mid.HashIDs[:n]) {
				t.Errorf("%s (%s) does not start from its parent's context", id, sub)
			}
		}
	}
	sys := a.SystemTokens / a.BlockTokens
	if !slices.Equal(bySession["agent-0"][0].HashIDs[:sys], bySession["agent-2"][0].HashIDs[:sys]) ||
		slices.Equal(bySession["agent-0"][0].HashIDs[:sys], bySession["agent-1"][0].HashIDs[:sys]) {
		t.Error("sessions of one kind should share the system prompt, of two kinds not")
	}
	w, err := NewAgents(a, 16)
	if err != nil || len(w.Sessions) != len(bySession) || w.Requests[w.Sessions[0][0]].Think == 0 {
		t.Fatalf("as a workload: %v, %d sessions", err, len(w.Sessions))
	}
}

func TestSimAgentSpecErrors(t *testing.T) {
	for name, mutate := range map[string]func(*AgentTraceSpec){
		"no sessions":       func(a *AgentTraceSpec) { a.Sessions = 0 },
		"no turns":          func(a *AgentTraceSpec) { a.Turns = 0 },
		"no kinds":          func(a *AgentTraceSpec) { a.Kinds = 0 },
		"negative think":    func(a *AgentTraceSpec) { a.ThinkMs = -1 },
		"zero turn tokens":  func(a *AgentTraceSpec) { a.TurnTokens = 0 },
		"subagents no turn": func(a *AgentTraceSpec) { a.SubTurns = 0 },
		"too long":          func(a *AgentTraceSpec) { a.TurnTokens = MaxTraceTokens },
	} {
		a := agentTraceSpec()
		mutate(&a)
		if _, err := AgentRows(a); !errors.Is(err, ErrSpec) {
			t.Errorf("%s: %v", name, err)
		}
	}
}
