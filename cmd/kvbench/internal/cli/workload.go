package cli

import (
	"flag"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
)

// Defaults of the synthetic workload, the same for sim and load so that
// `kvbench load` with no workload flags replays the very requests `kvbench
// sim` simulates with none (same generator, same seed). 1,200 requests is
// seed 002's run length, the one every published figure uses; it also keeps
// the cold first send of each prefix to each worker a small share of the
// hit rate (there are at most prefixes × workers of them, whatever the run's
// length).
const (
	DefaultPrefixes     = 7
	DefaultPrefixTokens = 2032
	DefaultTailTokens   = 339
	DefaultOutputTokens = 64
	DefaultRequests     = 1200
	DefaultConcurrency  = 8
)

// Workload is the synthetic prefix workload's flags (seed 002's shape):
// K shared prefixes, a fresh tail per request, C closed-loop clients.
type Workload struct {
	Prefixes     int
	PrefixTokens int
	TailTokens   int
	OutputTokens int
	Requests     int
	Concurrency  int
	PrefixOrder  string
}

// WorkloadFlags are the flag names Register defines, for commands that
// refuse them in another mode (sim --trace).
func WorkloadFlags() []string {
	return []string{"prefixes", "prefix-tokens", "tail-tokens", "output-tokens", "requests", "concurrency", "prefix-order"}
}

// Register defines the workload's flags on fs with the shared defaults.
func (w *Workload) Register(fs *flag.FlagSet) {
	fs.IntVar(&w.Prefixes, "prefixes", DefaultPrefixes, "synthetic: number of shared prefixes")
	fs.IntVar(&w.PrefixTokens, "prefix-tokens", DefaultPrefixTokens, "synthetic: tokens per shared prefix")
	fs.IntVar(&w.TailTokens, "tail-tokens", DefaultTailTokens, "synthetic: fresh random tokens after the prefix")
	fs.IntVar(&w.OutputTokens, "output-tokens", DefaultOutputTokens, "synthetic: tokens generated per request (max_tokens when live)")
	fs.IntVar(&w.Requests, "requests", DefaultRequests, "synthetic: requests per run (per pass when live)")
	fs.IntVar(&w.Concurrency, "concurrency", DefaultConcurrency, "synthetic: closed-loop clients")
	fs.StringVar(&w.PrefixOrder, "prefix-order", workload.PrefixRandom, "synthetic: random (each request draws a prefix uniformly) or shuffled (every prefix equally often, in random order)")
}

// Check validates what every command needs of the workload; a command
// adds its own bounds.
func (w *Workload) Check() error {
	switch {
	case w.Prefixes < 1:
		return Usagef("--prefixes %d: need at least one", w.Prefixes)
	case w.PrefixTokens < 0 || w.TailTokens < 0:
		return Usagef("--prefix-tokens and --tail-tokens must not be negative")
	case w.PrefixTokens+w.TailTokens < 1:
		return Usagef("--prefix-tokens + --tail-tokens must be at least one token")
	case w.OutputTokens < 1:
		return Usagef("--output-tokens %d: need at least one", w.OutputTokens)
	case w.Requests < 1:
		return Usagef("--requests %d: need at least one", w.Requests)
	case w.Concurrency < 1:
		return Usagef("--concurrency %d: need at least one client", w.Concurrency)
	case w.PrefixOrder != workload.PrefixRandom && w.PrefixOrder != workload.PrefixShuffled:
		return Usagef("--prefix-order %q: want %s or %s", w.PrefixOrder, workload.PrefixRandom, workload.PrefixShuffled)
	}
	return nil
}

// Spec is the generator's input for this workload; popularity and hot
// shift, which only sim offers, are left to the caller.
func (w *Workload) Spec(blockSize int, seed uint64) workload.SyntheticSpec {
	return workload.SyntheticSpec{
		Prefixes: w.Prefixes, PrefixTokens: w.PrefixTokens, TailTokens: w.TailTokens,
		OutputTokens: w.OutputTokens, Requests: w.Requests, Concurrency: w.Concurrency,
		BlockSize: blockSize, Seed: seed, Order: w.PrefixOrder,
	}
}
