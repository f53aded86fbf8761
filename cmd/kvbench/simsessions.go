package main

import (
	"flag"
	"math"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/sim"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
)

// sessionOptions are sim's agent-session and session-affinity flags
// (issue 28 item 4).
type sessionOptions struct {
	Turns     int     // --session-turns: turns per session (0: no sessions)
	ThinkMs   float64 // --think-time-ms: mean think time between turns
	Subagents int     // --subagents: child sessions a top-level session's first turn spawns

	Affinity string  // --session-affinity: off, hard, soft
	Table    string  // --session-affinity-table: shared, per-router
	Busy     float64 // --session-affinity-busy: soft mode's busy share

	PinEvery int           // --pin-every: every K-th session tree pins its prompts (0: none)
	PinTTL   time.Duration // --pin-ttl: the pins' TTL (nvext.cache_control's ttl)
}

func (o *sessionOptions) register(fs *flag.FlagSet) {
	fs.IntVar(&o.Turns, "session-turns", 0, "synthetic: agent sessions of N turns, each resending the conversation so far (its answers included) plus --tail-tokens new tokens; --requests counts turns, --concurrency or --arrival-rate applies to top-level sessions (0: independent requests)")
	fs.Float64Var(&o.ThinkMs, "think-time-ms", 0, "with --session-turns: mean think time in ms from a turn's end to the session's next turn (exponential, drawn from the seed)")
	fs.IntVar(&o.Subagents, "subagents", 0, "with --session-turns: child sessions each top-level session's first turn spawns when it ends, sharing its prompt and answer as their prefix, each of --session-turns turns, run concurrently")
	fs.StringVar(&o.Affinity, "session-affinity", "off", "bind a session (subagents under their parent) to the worker its first turn went to: off, hard (always there while it is in the fleet), soft (there unless over --session-affinity-busy); policy-independent")
	fs.StringVar(&o.Table, "session-affinity-table", "shared", "with --routers > 1: shared (one binding table every router reads, as kvrouter's Raft-replicated bindings) or per-router (each router's own, told to the others --sync-delay later, last writer wins: an advisory sync)")
	fs.Float64Var(&o.Busy, "session-affinity-busy", sim.DefaultAffinityBusy, "soft affinity: share of the bound worker's KV blocks held by running requests (in the routing router's view) above which a turn goes where the policy sends it")
	fs.IntVar(&o.PinEvery, "pin-every", 0, "prefix pins (nvext.cache_control): the session trees whose root is a multiple of K pin each turn's prompt on its worker when the turn ends, for --pin-ttl; the engines keep pinned blocks as SGLang's HiCache does and kv-pooled sees them (0: no pins)")
	fs.DurationVar(&o.PinTTL, "pin-ttl", 5*time.Minute, "with --pin-every: the pins' TTL, renewed by every hit (1s to 1h, as cache_control's ttl)")
}

// check validates the session flags; set names the flags given.
func (o *sessionOptions) check(set map[string]bool, so *simOptions) error {
	switch {
	case o.Turns < 0 || o.Turns > workload.MaxAgentTurns:
		return cli.Usagef("--session-turns %d: want 0 to %d", o.Turns, workload.MaxAgentTurns)
	case math.IsNaN(o.ThinkMs) || o.ThinkMs < 0 || o.ThinkMs > float64(workload.MaxAgentThink/time.Millisecond):
		return cli.Usagef("--think-time-ms %v: want 0 to %d ms", o.ThinkMs, workload.MaxAgentThink/time.Millisecond)
	case o.Subagents < 0 || o.Subagents > workload.MaxAgentSubagents:
		return cli.Usagef("--subagents %d: want 0 to %d", o.Subagents, workload.MaxAgentSubagents)
	case o.Turns == 0 && (set["think-time-ms"] || set["subagents"]):
		return cli.Usagef("--think-time-ms and --subagents shape agent sessions: give --session-turns too")
	case o.Turns > 0 && so.Repeat > 1:
		return cli.Usagef("--repeat replays independent requests; agent sessions (--session-turns) take more --requests instead")
	}
	switch o.Affinity {
	case "off", string(sim.AffinityHard), string(sim.AffinitySoft):
	default:
		return cli.Usagef("--session-affinity %q: want off, hard or soft", o.Affinity)
	}
	switch o.Table {
	case "shared", "per-router":
	default:
		return cli.Usagef("--session-affinity-table %q: want shared or per-router", o.Table)
	}
	if math.IsNaN(o.Busy) || !(o.Busy > 0 && o.Busy <= 1) {
		return cli.Usagef("--session-affinity-busy %v: want a share in (0, 1]", o.Busy)
	}
	if set["session-affinity-busy"] && o.Affinity != string(sim.AffinitySoft) {
		return cli.Usagef("--session-affinity-busy applies to --session-affinity soft")
	}
	if set["session-affinity-table"] && o.Affinity == "off" {
		return cli.Usagef("--session-affinity-table says where bindings live: give --session-affinity hard or soft")
	}
	switch {
	case o.PinEvery < 0:
		return cli.Usagef("--pin-every %d: want 0 (no pins) or more", o.PinEvery)
	case o.PinTTL < time.Second || o.PinTTL > time.Hour:
		return cli.Usagef("--pin-ttl %v: want 1s to 1h", o.PinTTL)
	case set["pin-ttl"] && o.PinEvery == 0:
		return cli.Usagef("--pin-ttl is the pins' TTL: give --pin-every too")
	case o.PinEvery > 0 && so.Trace == "" && o.Turns == 0:
		return cli.Usagef("--pin-every pins session trees: give --session-turns (or a --trace with session_id rows)")
	}
	if o.Affinity != "off" {
		if so.Trace == "" && o.Turns == 0 {
			return cli.Usagef("--session-affinity binds sessions: give --session-turns (or a --trace with session_id rows)")
		}
		for _, m := range so.Policies {
			if _, peer := peerPolicies[m]; peer {
				return cli.Usagef("policy %s routes by its own scheduler: --session-affinity acts on ours", m)
			}
		}
	}
	return nil
}

// agent is the generator's agent spec.
func (o *sessionOptions) agent() workload.AgentSpec {
	return workload.AgentSpec{Turns: o.Turns, Think: time.Duration(o.ThinkMs * float64(time.Millisecond)), Subagents: o.Subagents}
}

// affinity is the simulator's affinity setting.
func (o *sessionOptions) affinity() sim.Affinity {
	if o.Affinity == "off" {
		return sim.Affinity{}
	}
	return sim.Affinity{Mode: sim.AffinityMode(o.Affinity), PerRouter: o.Table == "per-router", Busy: o.Busy}
}

// sessionsCfg is the report's config.sessions (absent without sessions).
type sessionsCfg struct {
	Turns       int     `json:"turns"`
	ThinkTimeMs float64 `json:"think_time_ms"`
	Subagents   int     `json:"subagents"`
	PinEvery    int     `json:"pin_every,omitempty"`
	PinTTLS     float64 `json:"pin_ttl_s,omitempty"`
}

// affinityCfg is the report's config.session_affinity (absent when off).
type affinityCfg struct {
	Mode  string   `json:"mode"`
	Table string   `json:"table"`
	Busy  *float64 `json:"busy,omitempty"` // soft only
}

func (o *sessionOptions) config() (*sessionsCfg, *affinityCfg) {
	var s *sessionsCfg
	var a *affinityCfg
	if o.Turns > 0 || o.PinEvery > 0 {
		s = &sessionsCfg{Turns: o.Turns, ThinkTimeMs: o.ThinkMs, Subagents: o.Subagents}
		if o.PinEvery > 0 {
			s.PinEvery, s.PinTTLS = o.PinEvery, o.PinTTL.Seconds()
		}
	}
	if o.Affinity != "off" {
		a = &affinityCfg{Mode: o.Affinity, Table: o.Table}
		if o.Affinity == string(sim.AffinitySoft) {
			b := o.Busy
			a.Busy = &b
		}
	}
	return s, a
}
