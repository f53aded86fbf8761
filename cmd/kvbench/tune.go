package main

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/report"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/sim"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/router"
)

// kvbench tune: replay one workload (usually a replica's capture, kvrouter
// serve --capture-file) in the simulator under every setting of a grid —
// the policies (--policies) × Dynamo's knobs (prefill load scale, overlap
// credit, temperature) × the decode busy threshold — and print the best
// setting, its expected gain over the one the fleet runs now, and the
// flags or /busy_threshold call that apply it.
//
// Every sim flag describes the fleet and the workload (--workers,
// --kv-blocks, --trace, --reps, …); tune adds its grid and objective
// flags (tuneFlags).

// tuneSetting is one point of the grid.
type tuneSetting struct {
	Policy      router.Mode `json:"policy"`
	Scale       float64     `json:"prefill_load_scale"`
	Credit      float64     `json:"overlap_credit"`
	Temperature float64     `json:"temperature"`
	// DecodeThreshold is active_decode_blocks_threshold, PrefillThreshold
	// active_prefill_tokens_threshold_frac (nil: none).
	DecodeThreshold  *float64 `json:"active_decode_blocks_threshold"`
	PrefillThreshold *float64 `json:"active_prefill_tokens_threshold_frac"`
}

func thresholdString(v *float64) string {
	if v == nil {
		return "none"
	}
	return strconv.FormatFloat(*v, 'g', -1, 64)
}

func (s tuneSetting) String() string {
	thr := "decode-threshold=" + thresholdString(s.DecodeThreshold) + " prefill-threshold=" + thresholdString(s.PrefillThreshold)
	if !kvFamily(s.Policy) {
		return fmt.Sprintf("%s %s", s.Policy, thr)
	}
	return fmt.Sprintf("%s scale=%g credit=%g temperature=%g %s", s.Policy, s.Scale, s.Credit, s.Temperature, thr)
}

// tuneOptions are tune's own flags.
type tuneOptions struct {
	Scales, Credits, Temperatures []float64
	Thresholds, PrefillThresholds []*float64
	Objective                     string  // cached or hit
	MaxTTFTRatio                  float64 // p99 TTFT at most this × the current setting's
	Current                       tuneSetting
	Top                           int
	Model                         string
}

// tuneFlags are tune's flags (name → takes a value); the others are sim's.
var tuneFlagNames = []string{"scales", "credits", "temperatures", "decode-thresholds", "prefill-thresholds", "objective", "max-ttft-ratio", "current", "top", "model"}

// splitTuneArgs separates tune's flags from sim's (both "-f v" and "-f=v").
func splitTuneArgs(args []string) (tune map[string]string, rest []string, err error) {
	tune = map[string]string{}
	for i := 0; i < len(args); i++ {
		a := args[i]
		name, value, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !strings.HasPrefix(a, "-") || !slices.Contains(tuneFlagNames, name) {
			rest = append(rest, a)
			continue
		}
		if !hasValue {
			if i+1 >= len(args) {
				return nil, nil, cli.Usagef("--%s needs a value", name)
			}
			i++
			value = args[i]
		}
		tune[name] = value
	}
	return tune, rest, nil
}

func parseFloats(name, v string, lo, hi float64) ([]float64, error) {
	var out []float64
	for _, f := range strings.Split(v, ",") {
		x, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
		if err != nil || math.IsNaN(x) || x < lo || x > hi {
			return nil, cli.Usagef("--%s: %q is not a number in [%g, %g]", name, f, lo, hi)
		}
		out = append(out, x)
	}
	return out, nil
}

// parseTune reads tune's flags over the router's defaults.
func parseTune(flags map[string]string) (*tuneOptions, error) {
	def := router.DefaultConfig()
	t := &tuneOptions{Objective: "cached", MaxTTFTRatio: 1.5, Top: 10,
		Scales: []float64{def.PrefillLoadScale}, Credits: []float64{def.OverlapCredit}, Temperatures: []float64{def.Temperature},
		Thresholds: []*float64{def.Thresholds.ActiveDecodeBlocks}, PrefillThresholds: []*float64{def.Thresholds.ActivePrefillTokensFrac}, Model: "MODEL",
		Current: tuneSetting{Policy: router.ModeKV, Scale: def.PrefillLoadScale, Credit: def.OverlapCredit, Temperature: def.Temperature,
			DecodeThreshold: def.Thresholds.ActiveDecodeBlocks, PrefillThreshold: def.Thresholds.ActivePrefillTokensFrac}}
	var err error
	for name, v := range flags {
		switch name {
		case "scales":
			t.Scales, err = parseFloats(name, v, 0, 1e6)
		case "credits":
			t.Credits, err = parseFloats(name, v, 0, 1)
		case "temperatures":
			t.Temperatures, err = parseFloats(name, v, 0, 1e6)
		case "decode-thresholds":
			t.Thresholds, err = parseThresholds(name, v, 1)
		case "prefill-thresholds":
			t.PrefillThresholds, err = parseThresholds(name, v, 1e6)
		case "objective":
			if v != "cached" && v != "hit" {
				err = cli.Usagef("--objective must be cached (cached-token ratio) or hit (request hit rate), got %q", v)
			}
			t.Objective = v
		case "max-ttft-ratio":
			var x []float64
			if x, err = parseFloats(name, v, 1, 1e6); err == nil {
				t.MaxTTFTRatio = x[0]
			}
		case "top":
			if t.Top, err = strconv.Atoi(v); err != nil || t.Top < 1 {
				err = cli.Usagef("--top must be a positive integer, got %q", v)
			}
		case "model":
			t.Model = v
		case "current":
			t.Current, err = parseCurrent(v, t.Current)
		}
		if err != nil {
			return nil, err
		}
	}
	return t, nil
}

// parseThresholds reads a list of thresholds in [0, hi], "none" for off.
func parseThresholds(name, v string, hi float64) ([]*float64, error) {
	var out []*float64
	for _, f := range strings.Split(v, ",") {
		if strings.TrimSpace(f) == "none" {
			out = append(out, nil)
			continue
		}
		x, err := parseFloats(name, f, 0, hi)
		if err != nil {
			return nil, err
		}
		out = append(out, &x[0])
	}
	return out, nil
}

// parseCurrent reads the setting the fleet runs now: "kv-pooled" or
// "policy=kv,scale=2,credit=1,temperature=0,decode-threshold=0.9,prefill-threshold=2".
func parseCurrent(v string, cur tuneSetting) (tuneSetting, error) {
	for _, kv := range strings.Split(v, ",") {
		k, val, ok := strings.Cut(kv, "=")
		if !ok {
			k, val = "policy", kv
		}
		var err error
		var x []float64
		switch k {
		case "policy":
			var ms []router.Mode
			if ms, err = parsePolicies(val); err == nil {
				cur.Policy = ms[0]
			}
		case "scale":
			if x, err = parseFloats("current scale", val, 0, 1e6); err == nil {
				cur.Scale = x[0]
			}
		case "credit":
			if x, err = parseFloats("current credit", val, 0, 1); err == nil {
				cur.Credit = x[0]
			}
		case "temperature":
			if x, err = parseFloats("current temperature", val, 0, 1e6); err == nil {
				cur.Temperature = x[0]
			}
		case "decode-threshold", "prefill-threshold":
			hi, dst := 1.0, &cur.DecodeThreshold
			if k == "prefill-threshold" {
				hi, dst = 1e6, &cur.PrefillThreshold
			}
			var ts []*float64
			if ts, err = parseThresholds("current "+k, val, hi); err == nil {
				*dst = ts[0]
			}
		default:
			err = cli.Usagef("--current: unknown key %q (policy, scale, credit, temperature, decode-threshold, prefill-threshold)", k)
		}
		if err != nil {
			return cur, err
		}
	}
	return cur, nil
}

// grid is every distinct setting: the knobs only vary for kv-family
// policies. The current setting is always in it.
func (t *tuneOptions) grid(policies []router.Mode) []tuneSetting {
	seen := map[string]bool{}
	var out []tuneSetting
	add := func(s tuneSetting) {
		if !kvFamily(s.Policy) {
			def := router.DefaultConfig()
			s.Scale, s.Credit, s.Temperature = def.PrefillLoadScale, def.OverlapCredit, def.Temperature
		}
		if k := s.String(); !seen[k] {
			seen[k] = true
			out = append(out, s)
		}
	}
	add(t.Current)
	for _, p := range policies {
		for _, sc := range t.Scales {
			for _, cr := range t.Credits {
				for _, te := range t.Temperatures {
					for _, th := range t.Thresholds {
						for _, pth := range t.PrefillThresholds {
							add(tuneSetting{Policy: p, Scale: sc, Credit: cr, Temperature: te, DecodeThreshold: th, PrefillThreshold: pth})
						}
					}
				}
			}
		}
	}
	return out
}

// tuneResult is one setting's median figures.
type tuneResult struct {
	Setting tuneSetting   `json:"setting"`
	Result  report.Result `json:"result"`
	// Eligible: its p99 TTFT is within --max-ttft-ratio of the current
	// setting's.
	Eligible bool `json:"eligible"`
}

func (t *tuneOptions) score(r report.Result) float64 {
	if t.Objective == "hit" {
		return r.RequestHitRate
	}
	return r.CachedTokenRatio
}

// runTune is the `kvbench tune` subcommand.
func runTune(args []string, stdout, stderr io.Writer) int {
	flags, rest, err := splitTuneArgs(args)
	if err == nil {
		// tune's default policy grid is the cache-aware ones; a
		// --policies among the arguments comes later and wins.
		rest = append([]string{"--policies", "kv,kv-pooled"}, rest...)
	}
	var o *simOptions
	if err == nil {
		o, err = parseSimFlags(rest, stderr)
	}
	var t *tuneOptions
	if err == nil {
		t, err = parseTune(flags)
	}
	if code, failed := cli.ParseFailed("tune", err, stderr); failed {
		return code
	}
	results, live, header, err := executeTune(o, t, stderr)
	if err != nil {
		code := cli.ExitFail
		if badInput(err) {
			code = cli.ExitUsage
		}
		return cli.Fail(stderr, "tune", err, code)
	}
	if err := writeTune(stdout, header, t, results, live); err != nil {
		return cli.Fail(stderr, "tune", err, cli.ExitFail)
	}
	if o.JSON != "" {
		doc := map[string]any{"objective": t.Objective, "max_ttft_ratio": t.MaxTTFTRatio, "current": t.Current, "live": live, "results": results}
		if err := cli.WriteJSONFile(o.JSON, doc); err != nil {
			return cli.Fail(stderr, "tune", fmt.Errorf("write report: %w", err), cli.ExitFail)
		}
	}
	return cli.ExitOK
}

// executeTune simulates every setting of the grid, o.Reps runs each
// (seeds o.Seed…), o.Parallel at a time; results[0] is the current
// setting, the others best first.
func executeTune(o *simOptions, t *tuneOptions, stderr io.Writer) ([]tuneResult, *workload.Live, string, error) {
	start := time.Now()
	loads, err := o.workloads(stderr)
	if err != nil {
		return nil, nil, "", err
	}
	settings := t.grid(o.Policies)
	runs := make([][]report.Run, len(settings))
	for i := range runs {
		runs[i] = make([]report.Run, o.Reps)
	}
	errs := make([]error, len(settings)*o.Reps)
	type job struct{ s, r int }
	jobs := make(chan job)
	var wg sync.WaitGroup
	for range o.Parallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				s := settings[j.s]
				rc := o.routerConfig(s.Policy)
				if kvFamily(s.Policy) {
					rc.PrefillLoadScale, rc.OverlapCredit, rc.Temperature = s.Scale, s.Credit, s.Temperature
				}
				rc.Thresholds.ActiveDecodeBlocks, rc.Thresholds.ActivePrefillTokensFrac = s.DecodeThreshold, s.PrefillThreshold
				seed := o.Seed + uint64(j.r)
				res, err := sim.Run(loads[j.r], o.simConfig(rc, seed))
				if err != nil {
					errs[j.s*o.Reps+j.r] = fmt.Errorf("%s, rep %d: %w", s, j.r, err)
					continue
				}
				runs[j.s][j.r] = report.Run{Seed: seed, Summary: sim.Summarize(loads[j.r], res, o.Timeout)}
			}
		}()
	}
	for s := range settings {
		for r := range o.Reps {
			jobs <- job{s, r}
		}
	}
	close(jobs)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, nil, "", err
	}
	results := make([]tuneResult, len(settings))
	for i, s := range settings {
		results[i] = tuneResult{Setting: s, Result: report.Median(s.String(), runs[i])}
	}
	cur := results[0].Result.TTFT.P99
	for i := range results {
		results[i].Eligible = results[i].Result.TTFT.P99 <= t.MaxTTFTRatio*cur || i == 0
	}
	others := results[1:]
	slices.SortStableFunc(others, func(a, b tuneResult) int {
		if a.Eligible != b.Eligible {
			if a.Eligible {
				return -1
			}
			return 1
		}
		if d := t.score(b.Result) - t.score(a.Result); d != 0 {
			return cmp.Compare(d, 0)
		}
		if d := cmp.Compare(a.Result.TTFT.P99, b.Result.TTFT.P99); d != 0 {
			return d
		}
		// Equal figures: the smaller change from what runs now.
		return len(applyLines(t.Current, a.Setting, "")) - len(applyLines(t.Current, b.Setting, ""))
	})
	header := fmt.Sprintf("kvbench tune: %s, %d requests, %d workers × %s blocks of %d tokens, %d settings × %d reps (%.1fs)",
		loads[0].Name, len(loads[0].Requests), o.Workers, blocksLabel(o.KVBlocks), o.BlockSize, len(settings), o.Reps, time.Since(start).Seconds())
	return results, loads[0].Live, header, nil
}

// writeTune prints the table (current setting first, then the best
// --top), the best eligible setting's gain and how to apply it.
func writeTune(w io.Writer, header string, t *tuneOptions, results []tuneResult, live *workload.Live) error {
	objective := "cached-token ratio"
	if t.Objective == "hit" {
		objective = "request hit rate"
	}
	fmt.Fprintln(w, header)
	fmt.Fprintf(w, "objective: %s; a setting qualifies when its p99 TTFT is at most %.2g× the current setting's\n", objective, t.MaxTTFTRatio)
	if live != nil {
		fmt.Fprintf(w, "live, as the capture's engines reported it: hit rate %.3f, cached-token ratio %.3f over %d requests\n",
			live.RequestHitRate, live.CachedTokenRatio, live.Requests)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "\tsetting\thit rate\tcached ratio\tTTFT p50 ms\tTTFT p99 ms\tqualifies\t")
	row := func(label string, r tuneResult) {
		fmt.Fprintf(tw, "%s\t%s\t%.3f\t%.3f\t%.0f\t%.0f\t%v\t\n", label, r.Setting, r.Result.RequestHitRate, r.Result.CachedTokenRatio,
			r.Result.TTFT.P50, r.Result.TTFT.P99, r.Eligible)
	}
	row("current", results[0])
	for i, r := range results[1:] {
		if i == t.Top {
			break
		}
		row(strconv.Itoa(i+1), r)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	cur := results[0]
	var best *tuneResult
	for i := range results[1:] {
		if r := &results[1+i]; r.Eligible {
			best = r
			break
		}
	}
	if best == nil || t.score(best.Result) <= t.score(cur.Result) {
		fmt.Fprintf(w, "best: the current setting (%s); no setting of the grid does better on %s\n", cur.Setting, objective)
		return nil
	}
	gain := t.score(best.Result) - t.score(cur.Result)
	fmt.Fprintf(w, "best: %s: %s %.3f against %.3f now (%+.3f, %+.0f %%)\n", best.Setting, objective, t.score(best.Result), t.score(cur.Result),
		gain, 100*gain/math.Max(t.score(cur.Result), 1e-9))
	for _, line := range applyLines(cur.Setting, best.Setting, t.Model) {
		fmt.Fprintln(w, "apply: "+line)
	}
	return nil
}

// applyLines are the changes from cur to best: flags for the policy and
// knobs (a restart of each replica, one at a time), a /busy_threshold call
// for the threshold (at run time, replicated to every replica).
func applyLines(cur, best tuneSetting, model string) []string {
	var flags []string
	if best.Policy != cur.Policy {
		flags = append(flags, "--router-mode "+string(best.Policy))
	}
	if kvFamily(best.Policy) {
		if best.Scale != cur.Scale {
			flags = append(flags, fmt.Sprintf("--router-prefill-load-scale %g", best.Scale))
		}
		if best.Credit != cur.Credit {
			flags = append(flags, fmt.Sprintf("--router-kv-overlap-score-credit %g", best.Credit))
		}
		if best.Temperature != cur.Temperature {
			flags = append(flags, fmt.Sprintf("--router-temperature %g", best.Temperature))
		}
	}
	var lines []string
	if len(flags) > 0 {
		lines = append(lines, "kvrouter serve "+strings.Join(flags, " ")+"   (restart the replicas one at a time)")
	}
	// Thresholds change at run time, replicated to every replica: one
	// /busy_threshold call sets the new values and clears (our "clear"
	// extension; a null leaves a threshold as it is, as in Dynamo) the
	// ones turned off.
	body := map[string]any{"model": model}
	var clear []string
	for _, th := range []struct {
		name      string
		cur, best *float64
	}{{"active_decode_blocks_threshold", cur.DecodeThreshold, best.DecodeThreshold},
		{"active_prefill_tokens_threshold_frac", cur.PrefillThreshold, best.PrefillThreshold}} {
		switch {
		case equalThreshold(th.cur, th.best):
		case th.best == nil:
			clear = append(clear, th.name)
		default:
			body[th.name] = *th.best
		}
	}
	if len(clear) > 0 {
		body["clear"] = clear
	}
	if len(body) > 1 {
		js, _ := json.Marshal(body)
		lines = append(lines, fmt.Sprintf("curl -X POST https://REPLICA/busy_threshold -H \"Authorization: Bearer $ADMIN_TOKEN\" -d '%s'", js))
	}
	return lines
}

func equalThreshold(a, b *float64) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}
