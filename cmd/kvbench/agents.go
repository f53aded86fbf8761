package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
)

// runAgents writes a synthetic agent workload (issue 28 item 4) as a
// Mooncake trace: multi-turn sessions whose context grows each turn, with
// think time (think_ms) and subagents, for `kvbench sim --trace` (with or
// without --session-affinity) and `kvbench load --trace`.
func runAgents(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("kvbench agents", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var a workload.AgentTraceSpec
	var out string
	fs.IntVar(&a.Sessions, "sessions", 40, "root agent sessions")
	fs.IntVar(&a.Turns, "turns", 8, "turns per root session")
	fs.IntVar(&a.Kinds, "kinds", 4, "distinct system prompts (agent kinds) the sessions share")
	fs.IntVar(&a.SystemTokens, "system-tokens", 4096, "tokens of a kind's system prompt and tool definitions")
	fs.IntVar(&a.TurnTokens, "turn-tokens", 1024, "tokens each turn adds (a tool result, the user's text)")
	fs.IntVar(&a.OutputTokens, "output-tokens", 256, "tokens generated per turn (they join the next turn's prompt)")
	fs.Float64Var(&a.ThinkMs, "think-ms", 2000, "pause between a turn's answer and the session's next turn (tool calls, the user)")
	fs.Float64Var(&a.StaggerMs, "stagger-ms", 500, "root sessions start this far apart")
	fs.IntVar(&a.Subagents, "subagents", 2, "subagents each root session spawns after half its turns, starting from its context")
	fs.IntVar(&a.SubTurns, "subagent-turns", 4, "turns per subagent")
	fs.IntVar(&a.BlockTokens, "block-tokens", workload.TraceBlockTokens, "tokens per hash id (512 as Mooncake's traces; the router's block size as a capture)")
	fs.Uint64Var(&a.Seed, "seed", 1, "seed of the hash ids")
	fs.StringVar(&out, "out", "", "write the trace here (default: stdout)")
	err := cli.Parse(fs, args)
	if code, failed := cli.ParseFailed("agents", err, stderr); failed {
		return code
	}
	rows, err := workload.AgentRows(a)
	if err != nil {
		return cli.Fail(stderr, "agents", cli.Usagef("%v", err), cli.ExitUsage)
	}
	w := stdout
	if out != "" {
		f, err := os.Create(out)
		if err != nil {
			return cli.Fail(stderr, "agents", err, cli.ExitFail)
		}
		defer f.Close()
		w = f
	}
	if err := writeAgentTrace(w, rows); err != nil {
		return cli.Fail(stderr, "agents", err, cli.ExitFail)
	}
	fmt.Fprintf(stderr, "kvbench agents: %d sessions (%d root, %d subagents each), %d turns\n",
		a.Sessions*(1+a.Subagents), a.Sessions, a.Subagents, len(rows))
	return cli.ExitOK
}

// traceLine is one Mooncake trace row as kvbench agents writes it.
type traceLine struct {
	Timestamp    float64  `json:"timestamp"`
	InputLength  int      `json:"input_length"`
	OutputLength int      `json:"output_length"`
	HashIDs      []uint64 `json:"hash_ids"`
	BlockTokens  int      `json:"block_tokens,omitempty"`
	SessionID    string   `json:"session_id"`
	ThinkMs      float64  `json:"think_ms,omitempty"`
}

func writeAgentTrace(w io.Writer, rows []workload.TraceRow) error {
	bw := bufio.NewWriter(w)
	enc := json.NewEncoder(bw)
	for _, r := range rows {
		bt := r.BlockTokens
		if bt == workload.TraceBlockTokens {
			bt = 0 // Mooncake's default: leave the field out
		}
		if err := enc.Encode(traceLine{Timestamp: r.TimestampMs, InputLength: r.InputLength, OutputLength: r.OutputLength,
			HashIDs: r.HashIDs, BlockTokens: bt, SessionID: r.SessionID, ThinkMs: r.ThinkMs}); err != nil {
			return err
		}
	}
	return errors.Join(bw.Flush())
}
