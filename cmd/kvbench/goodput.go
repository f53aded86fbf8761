package main

import (
	"cmp"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/goodput"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/progress"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/report"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/sim"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
)

// goodputOptions are kvbench goodput's flags: sim's workload and fleet
// flags, the SLO, and how to search.
type goodputOptions struct {
	*simOptions
	Search goodput.Search
}

// goodputFlags are the flags goodput adds to sim's; the rest go to
// parseSimFlags unchanged.
var goodputFlags = []string{"attainment", "rate-start", "rate-min", "rate-max", "precision"}

func parseGoodputFlags(args []string, output io.Writer) (*goodputOptions, error) {
	fs := flag.NewFlagSet("kvbench goodput", flag.ContinueOnError)
	fs.SetOutput(output)
	g := &goodputOptions{}
	fs.Float64Var(&g.Search.Target, "attainment", 0.9, "the share of requests that must meet the SLO (failures are misses)")
	fs.Float64Var(&g.Search.Start, "rate-start", 1, "the first arrival rate tried (requests/s); the search doubles or halves from there")
	fs.Float64Var(&g.Search.MinRate, "rate-min", 0.01, "below this rate the goodput is reported as 0")
	fs.Float64Var(&g.Search.MaxRate, "rate-max", 1000, "the search stops doubling at this rate (the result then says capped)")
	fs.Float64Var(&g.Search.Precision, "precision", 0.02, "bisect until the bracket around the goodput is this narrow, relative (0.02: within 2 %)")
	own, rest := splitFlags(args, goodputFlags)
	if err := cli.Parse(fs, own); err != nil {
		return nil, err
	}
	if err := g.Search.Check(); err != nil {
		return nil, cli.Usagef("%v", err)
	}
	for _, a := range rest {
		name := strings.TrimLeft(strings.SplitN(a, "=", 2)[0], "-")
		switch {
		case !strings.HasPrefix(a, "-"):
		case name == "arrival-rate":
			return nil, cli.Usagef("--arrival-rate: goodput searches the rate itself (--rate-start, --rate-min, --rate-max)")
		case name == "concurrency":
			return nil, cli.Usagef("--concurrency: goodput sends requests open loop at the rates it searches; there are no closed-loop clients")
		case name == "repeat":
			return nil, cli.Usagef("--repeat: goodput sends open loop; give more --requests instead")
		}
	}
	// A synthetic list is generated at 1 request/s and stretched to each
	// rate; a trace keeps its own arrival pattern, stretched likewise.
	if !slices.ContainsFunc(rest, func(a string) bool { return strings.TrimLeft(strings.SplitN(a, "=", 2)[0], "-") == "trace" }) {
		rest = append(rest, "--arrival-rate", "1")
	}
	o, err := parseSimFlags(rest, output)
	if err != nil {
		return nil, err
	}
	if !o.SLO.Set() {
		return nil, cli.Usagef("goodput needs an SLO: --slo-ttft-ms and/or --slo-tpot-ms")
	}
	g.simOptions = o
	return g, nil
}

// splitFlags separates the arguments of the named flags (as -name, --name,
// with =value or the next argument) from the rest, keeping each side's
// order.
func splitFlags(args, names []string) (own, rest []string) {
	for i := 0; i < len(args); i++ {
		a := args[i]
		name := strings.TrimLeft(strings.SplitN(a, "=", 2)[0], "-")
		if !strings.HasPrefix(a, "-") || !slices.Contains(names, name) {
			rest = append(rest, a)
			continue
		}
		own = append(own, a)
		if !strings.Contains(a, "=") && i+1 < len(args) {
			i++
			own = append(own, args[i])
		}
	}
	return own, rest
}

// goodputReport is goodput's JSON document.
type goodputReport struct {
	Config  goodputConfig   `json:"config"`
	Results []goodputResult `json:"results"`

	base *workload.Workload // rep 0's requests, for the chart's subtitle
}

type goodputConfig struct {
	simConfig
	AttainmentTarget float64 `json:"attainment_target"`
	Precision        float64 `json:"precision"`
	RateStart        float64 `json:"rate_start"`
	RateMin          float64 `json:"rate_min"`
	RateMax          float64 `json:"rate_max"`
	// TraceRate is a trace's own mean arrival rate (requests/s over its
	// span); each rate searched stretches its timestamps by TraceRate/rate.
	TraceRate float64 `json:"trace_rate,omitempty"`
}

// goodputResult is one policy's goodput, its figures there and every rate
// the search measured.
type goodputResult struct {
	Policy string  `json:"policy"`
	RPS    float64 `json:"goodput_rps"`
	// Capped: the SLO was still met at --rate-max.
	Capped bool `json:"capped,omitempty"`
	// VsRoundRobin is the goodput ÷ round-robin's, when round-robin ran
	// and carried any.
	VsRoundRobin float64        `json:"vs_round_robin,omitempty"`
	At           *report.Result `json:"at_goodput"`
	Points       []ratePoint    `json:"points"`
}

type ratePoint struct {
	Rate       float64 `json:"rate"`
	Attainment float64 `json:"slo_attainment"`
	TTFTP99    float64 `json:"ttft_p99_ms"`
	TPOTP99    float64 `json:"tpot_p99_ms"`
}

func runGoodput(args []string, stdout, stderr io.Writer) int {
	g, err := parseGoodputFlags(args, stderr)
	if code, failed := cli.ParseFailed("goodput", err, stderr); failed {
		return code
	}
	rep, header, err := executeGoodput(g, stderr)
	if err != nil {
		code := cli.ExitFail
		if badInput(err) {
			code = cli.ExitUsage
		}
		return cli.Fail(stderr, "goodput", err, code)
	}
	if err := writeGoodputTable(stdout, header, rep); err != nil {
		return cli.Fail(stderr, "goodput", err, cli.ExitFail)
	}
	if g.JSON != "" {
		if err := cli.WriteJSONFile(g.JSON, rep); err != nil {
			return cli.Fail(stderr, "goodput", fmt.Errorf("write report: %w", err), cli.ExitFail)
		}
	}
	if g.Plot != "" {
		if err := report.PlotAttainment(g.Plot, goodputFigure(g, rep)); err != nil {
			return cli.Fail(stderr, "goodput", fmt.Errorf("write chart: %w", err), cli.ExitFail)
		}
	}
	return cli.ExitOK
}

// executeGoodput searches every policy's goodput on the same requests (one
// synthetic list per rep, its arrival pattern stretched to each rate).
func executeGoodput(g *goodputOptions, stderr io.Writer) (*goodputReport, string, error) {
	start := time.Now()
	base, err := g.workloads(stderr) // synthetic: at 1 request/s
	if err != nil {
		return nil, "", err
	}
	if g.Trace != "" {
		for i, w := range base {
			if base[i], err = traceAtItsRate(w); err != nil {
				return nil, "", err
			}
		}
	}
	np := len(g.Policies)
	results := make([]goodputResult, np)
	errs := make([]error, np)
	var done atomic.Int64
	var evals atomic.Int64
	stop := progress.Start(stderr, progress.Meter{Name: "kvbench goodput", Unit: "requests simulated", Count: done.Load,
		Detail: func() string { return fmt.Sprintf("%d rates measured", evals.Load()) }}, g.Progress.Options(stderr))
	sem := make(chan struct{}, g.Parallel)
	var wg sync.WaitGroup
	for p := range np {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			eval := func(rate float64) (goodput.Point[report.Result], error) {
				runs := make([]report.Run, g.Reps)
				for r := range g.Reps {
					seed := g.Seed + uint64(r)
					w := atRate(base[r], rate)
					res, err := g.runPolicy(w, g.Policies[p], seed, func() { done.Add(1) })
					if err != nil {
						return goodput.Point[report.Result]{}, fmt.Errorf("rep %d: %w", r, err)
					}
					runs[r] = report.Run{Seed: seed, Summary: sim.SummarizeSLO(w, res, g.Timeout, g.slo())}
				}
				evals.Add(1)
				res := report.Median(string(g.Policies[p]), runs)
				return goodput.Point[report.Result]{Attainment: res.SLOAttainment.Value, Figures: res}, nil
			}
			found, err := goodput.Run(g.Search, eval)
			if err != nil {
				errs[p] = fmt.Errorf("policy %s: %w", g.Policies[p], err)
				return
			}
			results[p] = goodputResult{Policy: string(g.Policies[p]), RPS: found.Goodput, Capped: found.Capped}
			if found.Goodput > 0 {
				at := found.At.Figures
				results[p].At = &at
			}
			for _, pt := range found.Points {
				results[p].Points = append(results[p].Points, ratePoint{Rate: pt.Rate, Attainment: pt.Attainment,
					TTFTP99: pt.Figures.TTFT.P99, TPOTP99: pt.Figures.TPOT.P99})
			}
			slices.SortFunc(results[p].Points, func(a, b ratePoint) int { return cmp.Compare(a.Rate, b.Rate) })
		}()
	}
	wg.Wait()
	stop()
	if err := errors.Join(errs...); err != nil {
		return nil, "", err
	}
	if rr := roundRobinGoodput(results); rr > 0 {
		for i := range results {
			results[i].VsRoundRobin = results[i].RPS / rr
		}
	}
	wall := time.Since(start)
	rep := &goodputReport{Results: results, base: base[0], Config: goodputConfig{
		simConfig: g.reportConfig(base[0], wall), AttainmentTarget: g.Search.Target, Precision: g.Search.Precision,
		RateStart: g.Search.Start, RateMin: g.Search.MinRate, RateMax: g.Search.MaxRate,
	}}
	if rep.Config.Synthetic != nil {
		rep.Config.Synthetic.ArrivalRate = 0 // searched, not given
	} else {
		rep.Config.TraceRate = base[0].ArrivalRate
	}
	header := fmt.Sprintf("kvbench goodput: %s, %d requests, %d workers × %s blocks of %d tokens, seed %d; SLO %s, attainment ≥ %.0f %%, arrivals %s",
		workloadName(base[0]), len(base[0].Requests), g.Workers, blocksLabel(g.KVBlocks), g.BlockSize, g.Seed,
		sloLabel(g.slo()), 100*g.Search.Target, arrivalLabel(g.ArrivalCV))
	if g.Reps > 1 {
		header += fmt.Sprintf(", medians of %d reps", g.Reps)
	}
	header += fmt.Sprintf(" (%.1fs)", wall.Seconds())
	return rep, header, nil
}

// workloadName is w's name without the arrival rate it was generated at
// (a trace: with its own rate, which the search stretches).
func workloadName(w *workload.Workload) string {
	if w.Kind == workload.Trace {
		return fmt.Sprintf("%s (its own rate %.3g/s)", w.Name, w.ArrivalRate)
	}
	name, _, _ := strings.Cut(w.Name, " arrival_rate=")
	return name
}

// traceAtItsRate is a trace workload marked with its own mean arrival
// rate, (requests − 1) over the span of its timestamps, so atRate can
// stretch it like a synthetic list.
func traceAtItsRate(w *workload.Workload) (*workload.Workload, error) {
	var first, last time.Duration
	for i, r := range w.Requests {
		if i == 0 || r.At < first {
			first = r.At
		}
		last = max(last, r.At)
	}
	if len(w.Requests) < 2 || last <= first {
		return nil, fmt.Errorf("trace %s: its timestamps span no time, so it has no rate to scale: %w", w.Name, workload.ErrSpec)
	}
	out := *w
	out.ArrivalRate = float64(len(w.Requests)-1) / (last - first).Seconds()
	return &out, nil
}

// atRate is w (whose requests arrive at w.ArrivalRate) with its arrival
// pattern stretched to rate requests/s.
func atRate(w *workload.Workload, rate float64) *workload.Workload {
	out := *w
	out.ArrivalRate = rate
	out.Requests = slices.Clone(w.Requests)
	for i := range out.Requests {
		out.Requests[i].At = time.Duration(float64(w.Requests[i].At) * w.ArrivalRate / rate)
	}
	return &out
}

func roundRobinGoodput(rs []goodputResult) float64 {
	for _, r := range rs {
		if r.Policy == "round-robin" {
			return r.RPS
		}
	}
	return 0
}

func sloLabel(slo sim.SLO) string {
	var parts []string
	if slo.TTFT > 0 {
		parts = append(parts, fmt.Sprintf("TTFT ≤ %v", slo.TTFT))
	}
	if slo.TPOT > 0 {
		parts = append(parts, fmt.Sprintf("TPOT ≤ %v", slo.TPOT))
	}
	return strings.Join(parts, " and ")
}

func arrivalLabel(cv float64) string {
	if cv == 1 {
		return "Poisson"
	}
	return fmt.Sprintf("gamma gaps, CV %g", cv)
}

func writeGoodputTable(w io.Writer, header string, rep *goodputReport) error {
	var b strings.Builder
	b.WriteString(header)
	b.WriteByte('\n')
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\tgoodput req/s\t× round-robin\tTTFT p50 ms\tTTFT p90 ms\tTTFT p99 ms\tTPOT p50 ms\tTPOT p99 ms\tSLO met\tcached ratio\trates tried\t")
	var results []report.Result
	for _, r := range rep.Results {
		results = append(results, report.Result{Policy: r.Policy})
		vs := "-"
		if r.VsRoundRobin > 0 {
			vs = fmt.Sprintf("%.2f", r.VsRoundRobin)
		}
		gp := fmt.Sprintf("%.3g", r.RPS)
		if r.Capped {
			gp = "≥ " + gp
		}
		if r.At == nil {
			fmt.Fprintf(tw, "%s\t%s\t%s\t-\t-\t-\t-\t-\t-\t-\t%d\t\n", r.Policy, gp, vs, len(r.Points))
			continue
		}
		a := r.At
		fmt.Fprintf(tw, "%s\t%s\t%s\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f%%\t%.3f\t%d\t\n", r.Policy, gp, vs,
			a.TTFT.P50, a.TTFT.P90.Value, a.TTFT.P99, a.TPOT.P50, a.TPOT.P99, 100*a.SLOAttainment.Value, a.CachedTokenRatio, len(r.Points))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	b.WriteString("figures at each policy's goodput; cached ratio is a diagnostic, not the goal\n")
	if note := report.PolicyNote(results); note != "" {
		b.WriteString(note)
		b.WriteByte('\n')
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// goodputFigure is the chart's data: attainment against rate per policy.
func goodputFigure(g *goodputOptions, rep *goodputReport) report.AttainmentChart {
	c := report.AttainmentChart{
		SLO: sloLabel(g.slo()),
		Subtitle: fmt.Sprintf("%s; %d requests, %d workers × %s blocks; %s arrivals, seed %d", workloadName(rep.base), len(rep.base.Requests),
			g.Workers, blocksLabel(g.KVBlocks), arrivalLabel(g.ArrivalCV), g.Seed),
		Target: rep.Config.AttainmentTarget,
	}
	for _, r := range rep.Results {
		s := report.AttainmentSeries{Policy: r.Policy, Goodput: r.RPS}
		for _, p := range r.Points {
			s.Rates = append(s.Rates, p.Rate)
			s.Attainment = append(s.Attainment, p.Attainment)
		}
		c.Series = append(c.Series, s)
	}
	return c
}
