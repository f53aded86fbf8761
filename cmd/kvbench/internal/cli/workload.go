package cli

import (
	"flag"
	"math"
	"time"

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
	// ArrivalRate > 0 sends requests open loop at that mean rate (per
	// second) instead of from Concurrency clients; ArrivalCV is the
	// coefficient of variation of the gaps (1: Poisson, above 1: bursty).
	ArrivalRate float64
	ArrivalCV   float64
}

// WorkloadFlags are the flag names Register defines, for commands that
// refuse them in another mode (sim --trace).
func WorkloadFlags() []string {
	return []string{"prefixes", "prefix-tokens", "tail-tokens", "output-tokens", "requests", "concurrency", "prefix-order",
		"arrival-rate", "arrival-cv"}
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
	fs.Float64Var(&w.ArrivalRate, "arrival-rate", 0, "synthetic: requests per second, sent open loop whether or not the fleet keeps up (0: the closed loop of --concurrency clients)")
	fs.Float64Var(&w.ArrivalCV, "arrival-cv", 1, "synthetic, with --arrival-rate: coefficient of variation of the gaps between arrivals, gamma-distributed (1: Poisson; above 1: bursty)")
}

// CheckArrival refuses arrival settings that contradict each other; set
// names the flags given on the command line.
func (w *Workload) CheckArrival(set map[string]bool) error {
	switch {
	case math.IsNaN(w.ArrivalRate) || math.IsInf(w.ArrivalRate, 0) || w.ArrivalRate < 0:
		return Usagef("--arrival-rate %v: want requests per second >= 0", w.ArrivalRate)
	case !(w.ArrivalCV > 0) || math.IsInf(w.ArrivalCV, 0):
		return Usagef("--arrival-cv %v: want a positive number (1: Poisson)", w.ArrivalCV)
	case set["arrival-cv"] && w.ArrivalRate == 0:
		return Usagef("--arrival-cv shapes open-loop arrivals: give --arrival-rate too")
	case set["concurrency"] && w.ArrivalRate > 0:
		return Usagef("--concurrency is the closed loop's client count; with --arrival-rate requests arrive open loop: give one of them")
	}
	return nil
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
		ArrivalRate: w.ArrivalRate, ArrivalCV: w.ArrivalCV,
	}
}

// SLO is the latency objective flags of sim, load and goodput: a request
// meets it when its time to first token and its time per output token
// after the first are both within their limits (0: not judged).
type SLO struct {
	TTFTMs float64
	TPOTMs float64
}

// Register defines --slo-ttft-ms and --slo-tpot-ms on fs.
func (o *SLO) Register(fs *flag.FlagSet) {
	fs.Float64Var(&o.TTFTMs, "slo-ttft-ms", 0, "SLO: time to first token limit in ms (0: not judged); with an SLO every policy reports slo_attainment")
	fs.Float64Var(&o.TPOTMs, "slo-tpot-ms", 0, "SLO: limit on the time per output token after the first, in ms (0: not judged)")
}

// Check refuses negative or non-finite limits.
func (o *SLO) Check() error {
	for _, v := range []struct {
		name string
		v    float64
	}{{"slo-ttft-ms", o.TTFTMs}, {"slo-tpot-ms", o.TPOTMs}} {
		if math.IsNaN(v.v) || math.IsInf(v.v, 0) || v.v < 0 {
			return Usagef("--%s %v: want milliseconds >= 0", v.name, v.v)
		}
	}
	return nil
}

// Set reports whether any limit was given.
func (o *SLO) Set() bool { return o.TTFTMs > 0 || o.TPOTMs > 0 }

// Durations are the limits as durations (0: not judged).
func (o *SLO) Durations() (ttft, tpot time.Duration) {
	ms := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	return ms(o.TTFTMs), ms(o.TPOTMs)
}
