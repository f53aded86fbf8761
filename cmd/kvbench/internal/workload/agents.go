package workload

import (
	"fmt"
	"math/rand/v2"
)

// AgentTraceSpec shapes a synthetic agent workload (issue 28 item 4): coding
// agents' sessions, each turn repeating the whole conversation so far plus
// what the last turn added (a tool result, the model's answer), after a
// think time; some sessions fan out subagents that start from their
// parent's context. All sizes are in tokens; a hash id stands for
// BlockTokens of them, as in a Mooncake trace.
type AgentTraceSpec struct {
	Sessions     int     // root agent sessions
	Turns        int     // turns per root session
	Kinds        int     // distinct system prompts (agent kinds) the sessions share
	SystemTokens int     // system prompt and tool definitions, shared by one kind's sessions
	TurnTokens   int     // context each turn adds (tool results, user text, the previous answer)
	OutputTokens int     // generated per turn
	ThinkMs      float64 // pause between a turn's end and the next (tool calls, the user)
	StaggerMs    float64 // root sessions start this far apart
	Subagents    int     // subagents each root session spawns, after half its turns
	SubTurns     int     // turns per subagent
	BlockTokens  int     // tokens per hash id (512: Mooncake's; the block size: a capture's)
	Seed         uint64
}

// Check refuses a spec that cannot make a workload.
func (a AgentTraceSpec) Check() error {
	switch {
	case a.Sessions < 1 || a.Turns < 1:
		return fmt.Errorf("agents: %d sessions of %d turns: need at least one of each: %w", a.Sessions, a.Turns, ErrSpec)
	case a.Kinds < 1:
		return fmt.Errorf("agents: %d kinds: need at least one: %w", a.Kinds, ErrSpec)
	case a.SystemTokens < 0 || a.TurnTokens < 1 || a.OutputTokens < 1 || a.BlockTokens < 1:
		return fmt.Errorf("agents: system %d, turn %d, output %d, block %d tokens: turn, output and block must be positive, system not negative: %w",
			a.SystemTokens, a.TurnTokens, a.OutputTokens, a.BlockTokens, ErrSpec)
	case a.ThinkMs < 0 || a.StaggerMs < 0:
		return fmt.Errorf("agents: think %v ms, stagger %v ms: must not be negative: %w", a.ThinkMs, a.StaggerMs, ErrSpec)
	case a.Subagents < 0 || (a.Subagents > 0 && a.SubTurns < 1):
		return fmt.Errorf("agents: %d subagents of %d turns: %w", a.Subagents, a.SubTurns, ErrSpec)
	}
	if n := a.SystemTokens + (max(a.Turns, a.Turns/2+a.SubTurns))*(a.TurnTokens+a.OutputTokens); n > MaxTraceTokens {
		return fmt.Errorf("agents: a last turn of %d tokens is over %d: %w", n, MaxTraceTokens, ErrSpec)
	}
	return nil
}

// AgentRows are the workload's trace rows, session turns in order (each
// root session's, then its subagents'): a session's first turn at its start
// time, later turns closed loop after ThinkMs. A turn's prompt is the kind's
// system prompt, then every earlier turn's added context and answer, then
// its own added context; a subagent's starts with its parent's context as
// of half the parent's turns.
func AgentRows(a AgentTraceSpec) ([]TraceRow, error) {
	if err := a.Check(); err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(a.Seed, 0x5e5510))
	fresh := func(tokens int) []uint64 { // the hash ids of new content (full and partial blocks)
		ids := make([]uint64, (tokens+a.BlockTokens-1)/a.BlockTokens)
		for i := range ids {
			ids[i] = rng.Uint64() >> 1
		}
		return ids
	}
	kinds := make([][]uint64, a.Kinds)
	for k := range kinds {
		kinds[k] = fresh(a.SystemTokens)
	}
	var rows []TraceRow
	// session appends one session's turns. ctx is its context so far as
	// hash ids (ceil(tokens/BlockTokens) of them: a trailing partial block
	// gets a fresh id each turn, as an engine recomputes it); tokens is its
	// length.
	var session func(id string, startMs float64, ctx []uint64, tokens, turns int)
	session = func(id string, startMs float64, ctx []uint64, tokens, turns int) {
		for t := range turns {
			add := fresh(a.TurnTokens)
			prompt := append(append([]uint64(nil), ctx...), add...)
			in := tokens + a.TurnTokens
			think := a.ThinkMs
			if t == 0 {
				think = 0 // the session's first turn comes at its start
			}
			rows = append(rows, TraceRow{TimestampMs: startMs, InputLength: in, OutputLength: a.OutputTokens,
				HashIDs: prompt[:(in+a.BlockTokens-1)/a.BlockTokens], BlockTokens: a.BlockTokens,
				SessionID: id, HasSession: true, ThinkMs: think})
			// The next turn repeats this prompt and the answer: whole
			// blocks keep their ids; the answer's tokens come fresh.
			tokens = in + a.OutputTokens
			full := prompt[:in/a.BlockTokens]
			ctx = append(append([]uint64(nil), full...), fresh(tokens-len(full)*a.BlockTokens)...)
		}
	}
	for s := range a.Sessions {
		sys := kinds[s%a.Kinds]
		start := float64(s) * a.StaggerMs
		id := fmt.Sprintf("agent-%d", s)
		session(id, start, sys, a.SystemTokens, a.Turns)
		if a.Subagents == 0 {
			continue
		}
		// The parent's context after half its turns: replay the rows.
		mid := rows[len(rows)-a.Turns+a.Turns/2]
		for k := range a.Subagents {
			// A subagent's first turn comes once its parent's half is
			// done, roughly: the parent's think times and its start.
			at := start + float64(a.Turns/2)*a.ThinkMs
			session(fmt.Sprintf("%s/sub-%d", id, k), at, mid.HashIDs[:mid.InputLength/a.BlockTokens],
				mid.InputLength/a.BlockTokens*a.BlockTokens, a.SubTurns)
		}
	}
	return rows, nil
}

// NewAgents is the agent workload as the simulator replays it: AgentRows
// read as a trace with the router's block size.
func NewAgents(a AgentTraceSpec, blockSize int) (*Workload, error) {
	rows, err := AgentRows(a)
	if err != nil {
		return nil, err
	}
	if blockSize < 1 {
		return nil, fmt.Errorf("block size %d: %w", blockSize, ErrSpec)
	}
	return fromRows(rows, TraceSpec{Speedup: 1, BlockSize: blockSize}, "agents"), nil
}
