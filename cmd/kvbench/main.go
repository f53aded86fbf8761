// Command kvbench runs kvrouter's workloads and A/B benchmarks.
//
//	kvbench sim …     in-process, virtual-time simulation (engines + the real router)
//	kvbench goodput … the highest arrival rate each policy serves within a latency SLO
//	kvbench load …    the same workloads in real time against live endpoints
//	kvbench ingest …  KV-event ingest throughput of a cluster
//	kvbench tune …    the best policy and knobs for a captured workload, and how to apply them
//	kvbench disagg …  disaggregated prefill/decode in virtual time
//	kvbench figures … rerun BENCHMARKS.md's printed commands, check or rewrite their tables
//
// Exit codes: 0 success, 1 a run failed, 2 bad usage or bad input.
package main

import (
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
)

// command is one subcommand. run gets the arguments after the subcommand's
// name and returns the process exit code.
type command struct {
	name    string
	summary string
	run     func(args []string, stdout, stderr io.Writer) int
}

// commands is the subcommand table; add new subcommands here.
var commands = []command{
	{"sim", "simulate N engines routed by the real router, in virtual time", runSim},
	{"goodput", "the highest Poisson (or bursty) arrival rate each policy serves within an SLO (--slo-ttft-ms, --slo-tpot-ms), by bisection in the simulator", runGoodput},
	{"load", "replay a workload in real time against live endpoints", runLoad},
	{"ingest", "publish synthetic KV events to a cluster and measure ingest", runIngest},
	{"disagg", "simulate disaggregated prefill/decode over a KV link: --disagg off/always/auto side by side", runDisagg},
	{"tune", "replay a workload (a replica's --capture-file) under a grid of policies and knobs; print the best setting and how to apply it", runTune},
	{"agents", "write a synthetic agent workload (multi-turn sessions with growing context, think time, subagents) as a Mooncake trace for sim --trace", runAgents},
	{"figures", "rerun the commands printed in BENCHMARKS.md and check (--check) or rewrite (--write) their tables", runFigures},
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return cli.ExitUsage
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		usage(stdout)
		return cli.ExitOK
	}
	for _, c := range commands {
		if c.name == args[0] {
			return c.run(args[1:], stdout, stderr)
		}
	}
	fmt.Fprintf(stderr, "kvbench: unknown command %q\n", args[0])
	usage(stderr)
	return cli.ExitUsage
}

func usage(w io.Writer) {
	var b strings.Builder
	b.WriteString("usage: kvbench <command> [flags]\n\ncommands:\n")
	for _, c := range commands {
		fmt.Fprintf(&b, "  %-8s %s\n", c.name, c.summary)
	}
	b.WriteString("\nRun 'kvbench <command> -h' for a command's flags.\n")
	io.WriteString(w, b.String())
}
