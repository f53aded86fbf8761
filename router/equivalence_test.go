package router

import (
	"bufio"
	"crypto/sha256"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// updateDecisions rewrites testdata/decisions.golden from the code under
// test: run it on the commit whose decisions are the reference.
var (
	updateDecisions = flag.Bool("update-decisions", false, "rewrite testdata/decisions.golden")
	dumpDecisions   = flag.String("decisions-dump", "", "write every decision of TestRouterDecisionsGolden to this file")
)

// decisionScenario is one router setup of TestRouterDecisionsGolden.
type decisionScenario struct {
	name    string
	workers int
	total   int // TotalBlocks of every worker (0: not registered)
	mixed   bool
	cfg     func(*Config)
	observe bool // feed prefill-done and finished times (kv-pooled's rates, the SLO's lines)
	slow    int  // requests run slow× longer (0: 1)
}

func goldenScenarios() []decisionScenario {
	f := func(v float64) *float64 { return &v }
	i := func(v int64) *int64 { return &v }
	return []decisionScenario{
		{name: "kv", workers: 8, total: 4000},
		{name: "kv-wide", workers: 70, total: 4000},
		{name: "kv-busy-decode", workers: 8, total: 60, slow: 4, cfg: func(c *Config) {
			c.Thresholds = Thresholds{ActiveDecodeBlocks: f(0.9)}
		}},
		{name: "kv-busy-prefill", workers: 8, total: 4000, slow: 4, cfg: func(c *Config) {
			c.Thresholds = Thresholds{ActivePrefillTokens: i(500), ActivePrefillTokensFrac: f(0.15)}
		}},
		{name: "kv-busy-frac", workers: 8, total: 4000, slow: 4, cfg: func(c *Config) {
			c.Thresholds = Thresholds{ActivePrefillTokensFrac: f(0.1)}
		}},
		{name: "kv-temperature", workers: 8, total: 4000, cfg: func(c *Config) { c.Temperature = 0.5 }},
		{name: "kv-decay", workers: 8, total: 4000, cfg: func(c *Config) {
			c.OverlapCreditDecay, c.DecodeActiveRequestWeight = 1, 2
		}},
		{name: "kv-distinct", workers: 8, total: 4000, cfg: func(c *Config) { c.DistinctActiveBlocks = true }},
		{name: "round-robin", workers: 8, cfg: func(c *Config) { c.Mode = ModeRoundRobin }},
		{name: "random", workers: 8, cfg: func(c *Config) { c.Mode = ModeRandom }},
		{name: "least-loaded", workers: 8, cfg: func(c *Config) { c.Mode = ModeLeastLoaded }},
		{name: "power-of-two", workers: 8, cfg: func(c *Config) { c.Mode = ModePowerOfTwo }},
		{name: "kv-approx", workers: 8, cfg: func(c *Config) { c.Mode = ModeKVApprox }},
		{name: "kv-pooled", workers: 8, total: 4000, cfg: func(c *Config) { c.Mode = ModeKVPooled }},
		{name: "kv-pooled-tight", workers: 6, total: 130, slow: 2, observe: true, cfg: func(c *Config) { c.Mode = ModeKVPooled }},
		{name: "kv-pooled-t60-s1", workers: 6, total: 60, slow: 1, observe: true, cfg: func(c *Config) { c.Mode = ModeKVPooled }},
		{name: "kv-pooled-t60-s3", workers: 6, total: 60, slow: 3, observe: true, cfg: func(c *Config) { c.Mode = ModeKVPooled }},
		{name: "kv-pooled-t90-s1", workers: 6, total: 90, slow: 1, observe: true, cfg: func(c *Config) { c.Mode = ModeKVPooled }},
		{name: "kv-pooled-t90-s3", workers: 6, total: 90, slow: 3, observe: true, cfg: func(c *Config) { c.Mode = ModeKVPooled }},
		{name: "kv-pooled-t250-s1", workers: 6, total: 250, slow: 1, observe: true, cfg: func(c *Config) { c.Mode = ModeKVPooled }},
		{name: "kv-pooled-t250-s3", workers: 6, total: 250, slow: 3, observe: true, cfg: func(c *Config) { c.Mode = ModeKVPooled }},
		{name: "kv-pooled-t400-s1", workers: 6, total: 400, slow: 1, observe: true, cfg: func(c *Config) { c.Mode = ModeKVPooled }},
		{name: "kv-pooled-t400-s3", workers: 6, total: 400, slow: 3, observe: true, cfg: func(c *Config) { c.Mode = ModeKVPooled }},
		{name: "kv-pooled-mixed", workers: 6, total: 200, mixed: true, observe: true, cfg: func(c *Config) { c.Mode = ModeKVPooled }},
		{name: "kv-pooled-unknown-capacity", workers: 6, observe: true, cfg: func(c *Config) { c.Mode = ModeKVPooled }},
		{name: "kv-pooled-wait", workers: 6, total: 160, slow: 4, observe: true, cfg: func(c *Config) {
			c.Mode = ModeKVPooled
			c.Pooled.WaitWeight = f(0.5)
		}},
		{name: "kv-pooled-tracked", workers: 6, total: 130, slow: 2, observe: true, cfg: func(c *Config) {
			c.Mode, c.TrackOutputBlocks = ModeKVPooled, true
		}},
		{name: "kv-pooled-slo", workers: 6, total: 200, observe: true, cfg: func(c *Config) {
			c.Mode = ModeKVPooled
			c.SLO = SLO{TTFT: 60 * time.Millisecond, TPOT: 12 * time.Millisecond}
		}},
		{name: "kv-pooled-slo-ttft", workers: 6, total: 200, slow: 3, observe: true, cfg: func(c *Config) {
			c.Mode = ModeKVPooled
			c.SLO = SLO{TTFT: 40 * time.Millisecond}
		}},
	}
}

// runDecisionScenario routes 300 requests of shared prefixes through one
// scenario on a virtual clock (with events storing what was routed, some
// requests finishing) and writes one line per decision: the worker, each
// row's cost bits, and the explanation, which carries every busy reason.
func runDecisionScenario(t *testing.T, sc decisionScenario, out *bufio.Writer) {
	runScenario(t, sc, out, false)
}

// runScenario is runDecisionScenario; with reuse every decision writes its
// cost table into the last one's storage (RouteInto).
func runScenario(t *testing.T, sc decisionScenario, out *bufio.Writer, reuse bool) {
	rng := rand.New(rand.NewPCG(42, uint64(len(sc.name))))
	cfg := DefaultConfig()
	if sc.cfg != nil {
		sc.cfg(&cfg)
	}
	ix := NewIndex(cfg.BlockSize)
	r, err := New(cfg, ix, 7)
	if err != nil {
		t.Fatal(err)
	}
	ws := make([]WorkerInfo, sc.workers)
	for w := range ws {
		ws[w] = WorkerInfo{ID: WorkerID(fmt.Sprintf("w%03d", w)), TotalBlocks: sc.total, MaxBatchedTokens: 4096}
		if sc.mixed {
			ws[w].TotalBlocks = sc.total * (1 + w%3)
		}
		ix.AddWorker(ws[w].ID)
	}
	r.SetWorkers(ws)
	prefixes := make([][]uint64, 12)
	for p := range prefixes {
		prefixes[p] = make([]uint64, 24)
		for k := range prefixes[p] {
			prefixes[p][k] = rng.Uint64()
		}
	}
	type live struct {
		id     string
		worker WorkerID
		done   bool
		out    int
	}
	var running []live
	var rows []WorkerCost
	now := t0
	for n := range 300 {
		now = now.Add(time.Duration(5+rng.IntN(40)) * time.Millisecond)
		p := prefixes[rng.IntN(len(prefixes))]
		hashes := append([]uint64(nil), p[:8+rng.IntN(16)]...)
		for range rng.IntN(6) {
			hashes = append(hashes, rng.Uint64())
		}
		req := Request{ID: fmt.Sprint("q", n), Hashes: hashes, Tokens: len(hashes)*cfg.BlockSize + rng.IntN(cfg.BlockSize)}
		if n%17 == 5 {
			req.Exclude = []WorkerID{ws[rng.IntN(len(ws))].ID}
		}
		if n%23 == 7 {
			req.Sequences = 2
		}
		var d Decision
		if reuse {
			d, err = r.RouteInto(req, now, rows)
			rows = d.Rows
		} else {
			d, err = r.Route(req, now)
		}
		fmt.Fprintf(out, "%s %d %s err=%v\n", sc.name, n, d.Worker, err)
		for _, row := range d.Rows {
			fmt.Fprintf(out, "  %s %x %x %x %x %v\n", row.Worker, math.Float64bits(row.Cost), math.Float64bits(row.PrefillBlocks),
				math.Float64bits(row.DecodeBlocks), math.Float64bits(row.Pooled), row.Busy)
		}
		out.WriteString(d.Explain())
		if err != nil {
			continue
		}
		// The engine stores what it computed (most of the time).
		if rng.IntN(4) != 0 {
			sb := make([]StoredBlock, len(hashes))
			for k, h := range hashes {
				sb[k] = StoredBlock{EngineHash: h, ContentHash: h}
			}
			if err := ix.Apply(d.Worker, KVEvent{Kind: EventStored, Blocks: sb}); err != nil {
				t.Fatal(err)
			}
		}
		running = append(running, live{id: req.ID, worker: d.Worker, out: 16 + rng.IntN(64)})
		// Some running requests get their first token, some finish.
		for k := 0; k < len(running); k++ {
			l := &running[k]
			switch x := rng.IntN(10 * max(sc.slow, 1)); {
			case !l.done && x < 5:
				l.done = true
				if sc.observe {
					r.PrefillDoneAt(l.id, now)
				} else {
					r.PrefillDone(l.id)
				}
			case l.done && x < 3:
				if cfg.TrackOutputBlocks {
					r.Generated(l.id, l.out/2)
				}
			case l.done && x < 5:
				if sc.observe {
					r.FinishedAt(l.id, l.out, now)
				} else {
					r.Finished(l.id, l.out)
				}
				running = append(running[:k], running[k+1:]...)
				k--
			}
		}
	}
}

// TestRouterDecisionsGolden pins every decision of a set of seeded
// scenarios, all modes, busy thresholds, exclusions, kv-pooled's admission
// rule, TTFT parity, wait price and SLO, to the decisions of the commit
// that wrote testdata/decisions.golden: the same inputs pick the same
// worker with the same cost table, bit for bit, and the same reasons. The
// file holds one digest per scenario (the whole text is ~10 MB):
// -decisions-dump FILE writes the text, to diff two commits' decisions.
func TestRouterDecisionsGolden(t *testing.T) {
	var digests, dump strings.Builder
	for _, sc := range goldenScenarios() {
		var sb strings.Builder
		w := bufio.NewWriter(&sb)
		runDecisionScenario(t, sc, w)
		w.Flush()
		fmt.Fprintf(&digests, "%s %x %d\n", sc.name, sha256.Sum256([]byte(sb.String())), strings.Count(sb.String(), "\n"))
		dump.WriteString(sb.String())
	}
	if *dumpDecisions != "" {
		if err := os.WriteFile(*dumpDecisions, []byte(dump.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got := digests.String()
	path := filepath.Join("testdata", "decisions.golden")
	if *updateDecisions {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	gl, wl := strings.Split(got, "\n"), strings.Split(string(want), "\n")
	if len(gl) != len(wl) {
		t.Fatalf("%d scenarios, %s has %d", len(gl)-1, path, len(wl)-1)
	}
	for k := range gl {
		if gl[k] != wl[k] {
			t.Errorf("decisions differ from %s:\ngot  %s\nwant %s", path, gl[k], wl[k])
		}
	}
}

// TestRouterRouteIntoSameDecisions: writing each cost table into the last
// one's storage (a busy row followed by a free one, a reason left behind)
// changes no decision, row or reason.
func TestRouterRouteIntoSameDecisions(t *testing.T) {
	for _, sc := range goldenScenarios() {
		var fresh, reused strings.Builder
		w := bufio.NewWriter(&fresh)
		runScenario(t, sc, w, false)
		w.Flush()
		w = bufio.NewWriter(&reused)
		runScenario(t, sc, w, true)
		w.Flush()
		if fresh.String() != reused.String() {
			t.Errorf("%s: RouteInto's decisions differ from Route's", sc.name)
		}
	}
}
