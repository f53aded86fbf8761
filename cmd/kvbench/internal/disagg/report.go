package disagg

import (
	"fmt"
	"io"
	"math"
	"strings"
	"sync"

	"github.com/kvrouter/kvrouter/router"
)

// Grid is a sweep: every link speed × prompt length × mode on Base.
type Grid struct {
	Base         Config
	LinkMBps     []float64 // MB/s, 1 MB = 10⁶ bytes
	PromptTokens []int
	Modes        []router.DisaggMode
	Bound        float64 // auto's p50 TTFT must be ≤ Bound × min(off, always)
	Parallel     int
}

// Report is kvbench disagg's JSON report.
type Report struct {
	Config  ReportConfig `json:"config"`
	Cells   []Cell       `json:"cells"`
	Check   *Check       `json:"check,omitempty"`
	Seed001 *Seed001     `json:"seed001,omitempty"`
}

// ReportConfig records every setting of the run.
type ReportConfig struct {
	Profile              string    `json:"profile"`
	KVBytesPerToken      int64     `json:"kv_bytes_per_token"`
	PrefillWorkers       int       `json:"prefill_workers"`
	DecodeWorkers        int       `json:"decode_workers"`
	Concurrency          int       `json:"concurrency"`
	Requests             int       `json:"requests"`
	OutputTokens         int       `json:"output_tokens"`
	MaxBatchedTokens     int       `json:"max_batched_tokens"`
	MaxRunning           int       `json:"max_running"`
	KVCapacityTokens     int       `json:"kv_capacity_tokens"`
	BlockSize            int       `json:"block_size"`
	LinkMBps             []float64 `json:"link_mbps"`
	PerTransferMBps      float64   `json:"link_per_transfer_mbps"`
	LinkMaxConcurrent    int       `json:"link_max_concurrent"`
	LinkLatencyMs        float64   `json:"link_latency_ms"`
	PromptTokens         []int     `json:"prompt_tokens"`
	Modes                []string  `json:"modes"`
	PrefixGroups         int       `json:"prefix_groups"`
	PrefixTokens         int       `json:"prefix_tokens"`
	FailEvery            int       `json:"fail_every"`
	TransferRetries      int       `json:"transfer_retries"`
	InterferenceWeight   float64   `json:"interference_weight"`
	ThinkTimeMs          float64   `json:"think_time_ms"`
	Seed                 uint64    `json:"seed"`
	Bound                float64   `json:"auto_bound"`
	BytesPerMB           float64   `json:"bytes_per_mb"`
	FirstTokenOnDecode   bool      `json:"first_token_on_decode_worker"`
	RouterRequestsExpiry string    `json:"router_request_expiry"`
}

// Cell is one link speed × prompt length, every mode.
type Cell struct {
	LinkMBps     float64 `json:"link_mbps"`
	PromptTokens int     `json:"prompt_tokens"`
	// TransferBytes and TransferAloneMs are the arithmetic: the prompt's KV
	// and its transfer time on an idle link.
	TransferBytes   int64    `json:"transfer_bytes"`
	TransferAloneMs float64  `json:"transfer_alone_ms"`
	Results         []Result `json:"results"`
	// AutoOverBest is auto's p50 TTFT ÷ the lower of off's and always'
	// (0 when a mode is missing); Holds is AutoOverBest ≤ the bound.
	AutoOverBest float64 `json:"auto_over_best,omitempty"`
	Holds        *bool   `json:"holds,omitempty"`
}

// Result returns the cell's result for mode m.
func (c *Cell) Result(m router.DisaggMode) (Result, bool) {
	for _, r := range c.Results {
		if r.Mode == string(m) {
			return r, true
		}
	}
	return Result{}, false
}

// Check summarises the auto bound over the grid.
type Check struct {
	Bound   float64  `json:"bound"`
	Cells   int      `json:"cells"`
	Holding int      `json:"holding"`
	Failing []string `json:"failing"`
	Worst   float64  `json:"worst_ratio"`
	WorstAt string   `json:"worst_at"`
}

// Runs is the number of simulations Run does: one per cell and mode.
func (g *Grid) Runs() int { return len(g.LinkMBps) * len(g.PromptTokens) * len(g.Modes) }

// Run runs the grid; progress, when set, is called after each simulation
// with the number done and Runs.
func (g *Grid) Run(progress func(done, total int)) (*Report, error) {
	type job struct {
		cell, mode int
		cfg        Config
	}
	cells := make([]Cell, 0, len(g.LinkMBps)*len(g.PromptTokens))
	var jobs []job
	for _, l := range g.LinkMBps {
		for _, p := range g.PromptTokens {
			c := Cell{LinkMBps: l, PromptTokens: p, TransferBytes: g.Base.KV.Bytes(p), Results: make([]Result, len(g.Modes))}
			link := g.Base.Link
			link.ThroughputBytesPerS = l * 1e6
			c.TransferAloneMs = float64(link.Alone(c.TransferBytes)) / 1e6
			for mi, m := range g.Modes {
				cfg := g.Base
				cfg.Mode, cfg.Link, cfg.PromptTokens = m, link, p
				jobs = append(jobs, job{len(cells), mi, cfg})
			}
			cells = append(cells, c)
		}
	}
	errs := make([]error, len(jobs))
	var mu sync.Mutex
	done := 0
	sem := make(chan struct{}, max(g.Parallel, 1))
	var wg sync.WaitGroup
	for i, j := range jobs {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			res, err := Run(j.cfg)
			mu.Lock()
			defer mu.Unlock()
			cells[j.cell].Results[j.mode], errs[i] = res, err
			done++
			if progress != nil {
				progress(done, len(jobs))
			}
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			j := jobs[i]
			return nil, fmt.Errorf("%s, link %v MB/s, %d-token prompts: %w", j.cfg.Mode, cells[j.cell].LinkMBps, cells[j.cell].PromptTokens, err)
		}
	}
	rep := &Report{Config: g.reportConfig(), Cells: cells}
	rep.Check = g.check(rep.Cells)
	return rep, nil
}

func (g *Grid) reportConfig() ReportConfig {
	b := g.Base
	modes := make([]string, len(g.Modes))
	for i, m := range g.Modes {
		modes[i] = string(m)
	}
	return ReportConfig{
		Profile: b.Profile.Name, KVBytesPerToken: b.KV.BytesPerToken(), PrefillWorkers: b.PrefillWorkers, DecodeWorkers: b.DecodeWorkers,
		Concurrency: b.Concurrency, Requests: b.Requests, OutputTokens: b.OutputTokens, MaxBatchedTokens: b.MaxBatchedTokens,
		MaxRunning: b.MaxRunning, KVCapacityTokens: b.KVCapacityTokens, BlockSize: b.BlockSize, LinkMBps: g.LinkMBps,
		PerTransferMBps: b.Link.PerTransferBytesPerS / 1e6, LinkMaxConcurrent: b.Link.MaxConcurrent,
		LinkLatencyMs: float64(b.Link.Latency) / 1e6, PromptTokens: g.PromptTokens, Modes: modes,
		PrefixGroups: b.PrefixGroups, PrefixTokens: b.PrefixTokens, FailEvery: b.FailEvery, TransferRetries: b.TransferRetries,
		InterferenceWeight: b.InterferenceWeight, ThinkTimeMs: float64(b.ThinkTime) / 1e6, Seed: b.Seed, Bound: g.Bound, BytesPerMB: 1e6, FirstTokenOnDecode: true,
		RouterRequestsExpiry: "off",
	}
}

// check computes auto ÷ min(off, always) per cell when all three ran.
func (g *Grid) check(cells []Cell) *Check {
	ch := &Check{Bound: g.Bound, Failing: []string{}}
	for i := range cells {
		c := &cells[i]
		off, ok1 := c.Result(router.DisaggOff)
		alw, ok2 := c.Result(router.DisaggAlways)
		auto, ok3 := c.Result(router.DisaggAuto)
		if !ok1 || !ok2 || !ok3 {
			continue
		}
		best := math.Min(off.TTFT.P50, alw.TTFT.P50)
		if best <= 0 {
			continue
		}
		c.AutoOverBest = auto.TTFT.P50 / best
		holds := c.AutoOverBest <= g.Bound
		c.Holds = &holds
		ch.Cells++
		where := fmt.Sprintf("%g MB/s, %d tokens", c.LinkMBps, c.PromptTokens)
		if holds {
			ch.Holding++
		} else {
			ch.Failing = append(ch.Failing, fmt.Sprintf("%s: auto %.0f ms vs best %.0f ms (×%.3f)", where, auto.TTFT.P50, best, c.AutoOverBest))
		}
		if c.AutoOverBest > ch.Worst {
			ch.Worst, ch.WorstAt = c.AutoOverBest, where
		}
	}
	if ch.Cells == 0 {
		return nil
	}
	return ch
}

// Seed001 reproduces seed 001 §4.5: one prefill and one decode worker
// across a 104 MB/s link, 64 output tokens, concurrency 1 and 4.
type Seed001 struct {
	LinkMBps        float64      `json:"link_mbps"`
	KVBytesPerToken int64        `json:"kv_bytes_per_token"`
	Rows            []Seed001Row `json:"rows"`
}

// Seed001Row is one prompt length × concurrency.
type Seed001Row struct {
	PromptTokens int     `json:"prompt_tokens"`
	Concurrency  int     `json:"concurrency"`
	Bytes        int64   `json:"bytes"`
	ArithmeticS  float64 `json:"arithmetic_s"` // bytes ÷ link
	OffP50S      float64 `json:"off_ttft_p50_s"`
	AlwaysP50S   float64 `json:"always_ttft_p50_s"`
	AddedS       float64 `json:"added_s"` // always − off
	TransferP50S float64 `json:"transfer_p50_s"`
	PerTransfer  float64 `json:"per_transfer_mbps"`
	PeakXfers    int     `json:"peak_concurrent_transfers"`
	Measured     string  `json:"seed001_measured"`
}

// Seed001Runs is the number of simulations RunSeed001 does: two prompt
// lengths × off and always × concurrency 1 and 4.
const Seed001Runs = 2 * 2 * 2

// RunSeed001 runs the reproduction on base (its profile, KV size, budget);
// progress, when set, is called after each simulation with the number done
// and Seed001Runs.
func RunSeed001(base Config, parallel int, progress func(done, total int)) (*Seed001, error) {
	const linkMBps = 104
	out := &Seed001{LinkMBps: linkMBps, KVBytesPerToken: base.KV.BytesPerToken()}
	measured := map[[2]int]string{
		{1500, 1}: "TTFT 1.72–1.75 s (solo 44–78 ms)",
		{3000, 1}: "TTFT 3.4–3.5 s (solo 172 ms); one transfer 351.75 MB in 3,374 ms = 104 MB/s",
		{1500, 4}: "not reported",
		{3000, 4}: "each of 4 transfers 26–28 MB/s (sum ≈ 112), 12.5–13.1 s",
	}
	g := Grid{Base: base, LinkMBps: []float64{linkMBps}, PromptTokens: []int{1500, 3000},
		Modes: []router.DisaggMode{router.DisaggOff, router.DisaggAlways}, Parallel: parallel, Bound: 1.05}
	g.Base.PrefillWorkers, g.Base.DecodeWorkers, g.Base.OutputTokens = 1, 1, 64
	g.Base.PrefixGroups, g.Base.PrefixTokens, g.Base.FailEvery, g.Base.ThinkTime = 0, 0, 0, 0
	g.Base.Link = router.Link{ThroughputBytesPerS: linkMBps * 1e6}
	for i, conc := range []int{1, 4} {
		g.Base.Concurrency = conc
		g.Base.Requests = 20 * conc
		var each func(done, total int)
		if progress != nil {
			each = func(done, _ int) { progress(i*g.Runs()+done, Seed001Runs) }
		}
		rep, err := g.Run(each)
		if err != nil {
			return nil, err
		}
		for _, c := range rep.Cells {
			off, _ := c.Result(router.DisaggOff)
			alw, _ := c.Result(router.DisaggAlways)
			out.Rows = append(out.Rows, Seed001Row{
				PromptTokens: c.PromptTokens, Concurrency: conc, Bytes: c.TransferBytes,
				ArithmeticS: float64(c.TransferBytes) / (linkMBps * 1e6),
				OffP50S:     off.TTFT.P50 / 1e3, AlwaysP50S: alw.TTFT.P50 / 1e3, AddedS: (alw.TTFT.P50 - off.TTFT.P50) / 1e3,
				TransferP50S: alw.TransferMs.P50 / 1e3, PerTransfer: alw.TransferMBpsMean, PeakXfers: alw.PeakTransfers,
				Measured: measured[[2]int{c.PromptTokens, conc}],
			})
		}
	}
	return out, nil
}

// Header is the one-line description of the run.
func (r *Report) Header() string {
	c := r.Config
	return fmt.Sprintf("kvbench disagg: profile %s, %d prefill + %d decode workers, concurrency %d, %d requests × %d output tokens, KV %d B/token",
		c.Profile, c.PrefillWorkers, c.DecodeWorkers, c.Concurrency, c.Requests, c.OutputTokens, c.KVBytesPerToken)
}

func sec(ms float64) string {
	switch {
	case ms >= 10_000:
		return fmt.Sprintf("%.1f", ms/1e3)
	case ms >= 1_000:
		return fmt.Sprintf("%.2f", ms/1e3)
	}
	return fmt.Sprintf("%.3f", ms/1e3)
}

// WriteTable prints the grid (markdown), the check and the seed-001 rows.
func WriteTable(w io.Writer, r *Report) error {
	var b strings.Builder
	b.WriteString(r.Header() + "\n\n")
	modes := r.Config.Modes
	b.WriteString("| link MB/s | prompt | KV moved | idle-link transfer s |")
	for _, m := range modes {
		fmt.Fprintf(&b, " %s TTFT p50 / p99 s |", m)
	}
	b.WriteString(" auto disagg % | auto ÷ best | ITL p50 ms (" + strings.Join(modes, " / ") + ") |\n")
	b.WriteString("|---:|---:|---:|---:|" + strings.Repeat("---:|", len(modes)) + "---:|---:|---|\n")
	for _, c := range r.Cells {
		fmt.Fprintf(&b, "| %g | %d | %.1f MB | %s |", c.LinkMBps, c.PromptTokens, float64(c.TransferBytes)/1e6, sec(c.TransferAloneMs))
		var itl []string
		for _, res := range c.Results {
			fmt.Fprintf(&b, " %s / %s |", sec(res.TTFT.P50), sec(res.TTFT.P99))
			itl = append(itl, fmt.Sprintf("%.0f", res.ITL.P50))
		}
		auto, ok := c.Result(router.DisaggAuto)
		if ok && auto.Completed > 0 {
			fmt.Fprintf(&b, " %.0f%% |", 100*float64(auto.Disaggregated)/float64(max(auto.Disaggregated+auto.Aggregated, 1)))
		} else {
			b.WriteString(" – |")
		}
		switch {
		case c.Holds == nil:
			b.WriteString(" – |")
		case *c.Holds:
			fmt.Fprintf(&b, " %.3f |", c.AutoOverBest)
		default:
			fmt.Fprintf(&b, " **%.3f** |", c.AutoOverBest)
		}
		fmt.Fprintf(&b, " %s |\n", strings.Join(itl, " / "))
	}
	for _, c := range r.Cells {
		for _, res := range c.Results {
			if res.TransferRetries+res.TransferFallbacks > 0 || res.Completed < res.Requests {
				fmt.Fprintf(&b, "\n%g MB/s, %d tokens, %s: %d failed transfers retried, %d served aggregated after failing; %d of %d requests completed",
					c.LinkMBps, c.PromptTokens, res.Mode, res.TransferRetries, res.TransferFallbacks, res.Completed, res.Requests)
			}
		}
	}
	if ch := r.Check; ch != nil {
		fmt.Fprintf(&b, "\nauto ≤ %.2f × min(off, always) in p50 TTFT: holds in %d of %d cells; worst ×%.3f at %s\n",
			ch.Bound, ch.Holding, ch.Cells, ch.Worst, ch.WorstAt)
		for _, f := range ch.Failing {
			fmt.Fprintf(&b, "  fails: %s\n", f)
		}
	}
	if s := r.Seed001; s != nil {
		fmt.Fprintf(&b, "\nseed 001 §4.5 (1 prefill + 1 decode worker, %g MB/s link, %d B/token, 64 output tokens):\n\n", s.LinkMBps, s.KVBytesPerToken)
		b.WriteString("| prompt | concurrency | KV bytes | bytes ÷ link s | off TTFT p50 s | always TTFT p50 s | added s | transfer p50 s | per-transfer MB/s | peak transfers | seed 001 measured |\n")
		b.WriteString("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
		for _, x := range s.Rows {
			fmt.Fprintf(&b, "| %d | %d | %d | %.3f | %.3f | %.3f | %.3f | %.3f | %.1f | %d | %s |\n", x.PromptTokens, x.Concurrency, x.Bytes,
				x.ArithmeticS, x.OffP50S, x.AlwaysP50S, x.AddedS, x.TransferP50S, x.PerTransfer, x.PeakXfers, x.Measured)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}
