package workload

import (
	"fmt"
	"math/rand/v2"
	"time"
)

// Agent sessions (issue 28 item 4): a coding agent's conversation, turn
// after turn, each turn resending the whole conversation so far.
//
//   - A top-level session starts with one of the shared prefixes (its system
//     prompt, drawn by the spec's order and popularity) and a user message
//     of TailTokens fresh tokens: its first turn.
//   - Turn t+1's prompt is turn t's prompt, then turn t's answer
//     (OutputTokens tokens: the answer is part of the next prompt), then a
//     new user message of TailTokens tokens. The context grows by
//     OutputTokens + TailTokens a turn.
//   - Turn t+1 is sent Think after turn t finished (think time: exponential
//     with mean AgentSpec.Think, drawn per turn from the seed).
//   - A top-level session's first turn spawns Subagents child sessions
//     when it finishes (after its Think, with its next turn): each starts
//     from the parent's first prompt and answer (the prefix they share with
//     the parent) plus a task message of its own, and runs Turns turns the
//     same way, concurrently with the parent and with each other.
//
// The engines cache an answer's blocks under hashes no prompt can hit
// (engine/DESIGN.md, "Output tokens take blocks"), so the next turn
// recomputes the previous answer and hits the previous prompt: the cached
// fraction a session can reach is below what a real engine reusing the
// generated tokens' KV would give.

// AgentSpec shapes agent sessions; Turns 0 means none.
type AgentSpec struct {
	Turns     int           // turns per session, subagents' included
	Think     time.Duration // mean think time after a turn finishes (0: the next turn at once)
	Subagents int           // child sessions each top-level session's first turn spawns
}

// Limits that keep a spec from asking for absurd amounts of memory.
const (
	MaxAgentTurns     = 1 << 12
	MaxAgentSubagents = 1 << 8
	MaxAgentThink     = 24 * time.Hour
)

// Check refuses an impossible agent spec.
func (a AgentSpec) Check() error {
	switch {
	case a.Turns < 0 || a.Turns > MaxAgentTurns:
		return fmt.Errorf("%d turns per session: want 0 to %d: %w", a.Turns, MaxAgentTurns, ErrSpec)
	case a.Subagents < 0 || a.Subagents > MaxAgentSubagents:
		return fmt.Errorf("%d subagents: want 0 to %d: %w", a.Subagents, MaxAgentSubagents, ErrSpec)
	case a.Think < 0 || a.Think > MaxAgentThink:
		return fmt.Errorf("think time %v: want 0 to %v: %w", a.Think, MaxAgentThink, ErrSpec)
	case a.Turns == 0 && (a.Subagents > 0 || a.Think > 0):
		return fmt.Errorf("think time and subagents shape sessions: give turns too: %w", ErrSpec)
	}
	return nil
}

// agentBuilder appends the requests of agent sessions to a workload.
type agentBuilder struct {
	w       *Workload
	s       SyntheticSpec
	max     int // requests in all
	text    *rand.Rand
	think   *rand.Rand
	prompts [][]uint32
}

// newAgentSessions fills w (prefixes drawn) with the agent sessions of s:
// whole session trees (a top-level session and its subagents) in start
// order until s.Requests requests, the last tree cut short.
func newAgentSessions(w *Workload, s SyntheticSpec, zipf float64, text *rand.Rand) (*Workload, error) {
	if err := s.Agent.Check(); err != nil {
		return nil, err
	}
	perTree := s.Agent.Turns * (1 + s.Agent.Subagents)
	roots := (s.Requests + perTree - 1) / perTree
	order := prefixOrder(s, zipf, roots)
	var arrivals []time.Duration
	if s.ArrivalRate > 0 {
		w.OpenLoop, w.ArrivalRate = true, s.ArrivalRate
		arrivals = Arrivals(roots, s.ArrivalRate, s.ArrivalCV, s.Seed)
	}
	w.Agent, w.tails = true, nil
	w.Requests = w.Requests[:0]
	b := &agentBuilder{w: w, s: s, max: s.Requests, text: text,
		think: rand.New(rand.NewPCG(s.Seed, 0x7468696e6b))}
	for k := 0; k < roots && len(w.Requests) < b.max; k++ {
		root := len(w.Sessions)
		w.Roots = append(w.Roots, root)
		first, answer := b.session(w.prefixes[order[k]], root, order[k])
		if arrivals != nil {
			w.Requests[first].At = arrivals[k]
		}
		for range s.Agent.Subagents {
			if len(w.Requests) >= b.max {
				break
			}
			child, _ := b.session(answer, root, order[k])
			w.Requests[first].Children = append(w.Requests[first].Children, child)
		}
	}
	w.prompts = b.prompts
	w.hashAll()
	return w, nil
}

// session appends one session of up to Turns turns starting from base and
// returns its first request and its first prompt with its answer (what
// its subagents start from).
func (b *agentBuilder) session(base []uint32, root, prefix int) (first int, firstAnswered []uint32) {
	w, s := b.w, b.s
	sess := len(w.Sessions)
	w.Sessions = append(w.Sessions, nil)
	w.SessionRoot = append(w.SessionRoot, root)
	history := base[:len(base):len(base)] // appending copies: base stays the parent's
	first = len(w.Requests)
	for t := range s.Agent.Turns {
		if len(w.Requests) >= b.max {
			break
		}
		prompt := append(history, randomTokens(b.text, s.TailTokens)...)
		prompt = prompt[:len(prompt):len(prompt)]
		history = append(prompt, randomTokens(b.text, s.OutputTokens)...)
		history = history[:len(history):len(history)]
		if t == 0 {
			firstAnswered = history
		}
		i := len(w.Requests)
		var think time.Duration
		if s.Agent.Think > 0 {
			think = time.Duration(b.think.ExpFloat64() * float64(s.Agent.Think))
		}
		if turns := w.Sessions[sess]; len(turns) > 0 {
			w.Requests[turns[len(turns)-1]].NextTurn = i
		}
		w.Sessions[sess] = append(w.Sessions[sess], i)
		w.Requests = append(w.Requests, Request{
			ID:           fmt.Sprintf("s%d.%d", sess, t),
			PromptTokens: len(prompt),
			OutputTokens: s.OutputTokens,
			Session:      sess,
			NextTurn:     -1,
			HitTokens:    hitTokens(s),
			Prefix:       prefix,
			SharedTokens: s.PrefixTokens,
			Think:        think,
		})
		b.prompts = append(b.prompts, prompt)
	}
	return first, firstAnswered
}
