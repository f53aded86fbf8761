//go:build chaos

// Command chaosrun runs the chaos scenarios (chaos/run.sh builds and calls
// it; `make chaos SCENARIOS=… DURATION=…`).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/kvrouter/kvrouter/chaos"
)

func main() {
	var (
		scen     = flag.String("scenarios", "", "comma list of scenario ids, \"all\" or \"short\" (default "+chaos.DefaultScenarios+")")
		dur      = flag.String("duration", "", "fault phase of each scenario (default 60s)")
		root     = flag.String("root", ".", "repository root")
		bin      = flag.String("bin", "", "directory with kvrouter and kvmock (default <root>/bin)")
		out      = flag.String("out", "", "output directory (default <root>/chaos/out)")
		runID    = flag.String("run-id", "", "artifact folder name (default a timestamp)")
		keepRuns = flag.Int("keep-runs", 10, "artifact folders kept")
		prevBin  = flag.String("prev-bin", "", "the previous release's kvrouter, for U1 (default <bin>/kvrouter-prev)")
	)
	flag.Parse()
	ids, err := chaos.ParseScenarios(*scen)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaosrun:", err)
		os.Exit(2)
	}
	d, err := chaos.ParseDuration(*dur)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaosrun:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	defer stop()
	rep, err := chaos.Run(ctx, chaos.Options{Scenarios: ids, Duration: d, Root: *root, BinDir: *bin, OutDir: *out,
		RunID: *runID, KeepRuns: *keepRuns, PrevBin: *prevBin})
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaosrun:", err)
	}
	if rep == nil || !rep.Passed {
		os.Exit(1)
	}
}
