package router

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"
)

func TestSLOValidate(t *testing.T) {
	for _, c := range []struct {
		slo SLO
		ok  bool
		set bool
	}{
		{SLO{}, true, false},
		{SLO{TTFT: 500 * time.Millisecond}, true, true},
		{SLO{TPOT: 30 * time.Millisecond}, true, true},
		{SLO{TTFT: -time.Millisecond}, false, false},
		{SLO{TPOT: -time.Millisecond}, false, false},
	} {
		cfg := pooledConfig()
		cfg.SLO = c.slo
		err := cfg.Validate()
		if (err == nil) != c.ok || (err != nil && !errors.Is(err, ErrInvalidConfig)) {
			t.Errorf("%+v: Validate = %v, want ok %v", c.slo, err, c.ok)
		}
		if c.slo.Set() != c.set {
			t.Errorf("%+v: Set = %v, want %v", c.slo, c.slo.Set(), c.set)
		}
	}
}

func TestLinearFit(t *testing.T) {
	for _, c := range []struct {
		name   string
		obs    [][2]float64 // x, y
		window int
		at     float64
		want   float64
		ok     bool
	}{
		{name: "none", window: 8, at: 0.5},
		{name: "one", obs: [][2]float64{{0.5, 0.02}}, window: 8, at: 0.5},
		{name: "no spread in x", obs: [][2]float64{{0.5, 0.02}, {0.5, 0.03}}, window: 8, at: 0.5},
		{name: "line", obs: [][2]float64{{0.2, 0.010}, {0.8, 0.040}}, window: 8, at: 0.6, want: 0.030, ok: true},
		{name: "least squares", obs: [][2]float64{{0, 0}, {0, 2}, {1, 2}, {1, 4}}, window: 8, at: 0.5, want: 2, ok: true},
		// A line that falls predicts the mean: more fill never speeds a worker up.
		{name: "falling line is flat", obs: [][2]float64{{0.2, 0.040}, {0.8, 0.010}}, window: 8, at: 0.9, want: 0.025, ok: true},
		{name: "invalid ignored", obs: [][2]float64{{0.2, 0.010}, {math.NaN(), 1}, {0.5, -1}, {0.8, 0.040}}, window: 8, at: 0.6, want: 0.030, ok: true},
		// Window 2: the count stops at 2, so the third observation weighs
		// half (want worked below).
		{name: "window", obs: [][2]float64{{0.2, 0.010}, {0.8, 0.040}, {0.8, 0.060}}, window: 2, at: 0.8, ok: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			var f linearFit
			for _, o := range c.obs {
				f.observe(o[0], o[1], c.window)
			}
			got, ok := f.predict(c.at)
			if c.name == "window" {
				// Work the running means by hand instead: n stops at 2.
				mx, my, mxx, mxy := 0.2, 0.010, 0.04, 0.002
				for _, o := range [][2]float64{{0.8, 0.040}, {0.8, 0.060}} {
					mx += (o[0] - mx) / 2
					my += (o[1] - my) / 2
					mxx += (o[0]*o[0] - mxx) / 2
					mxy += (o[0]*o[1] - mxy) / 2
				}
				c.want = my + (mxy-mx*my)/(mxx-mx*mx)*(c.at-mx)
			}
			if ok != c.ok || math.Abs(got-c.want) > 1e-12 {
				t.Errorf("predict(%v) = %v, %v; want %v, %v", c.at, got, ok, c.want, c.ok)
			}
		})
	}
}

// engineWait mirrors an engine's admission: a prompt starts when its new
// blocks fit beside the running requests' prompts and the output each has
// generated so far.
func TestEngineWait(t *testing.T) {
	now := t0.Add(time.Minute)
	const spt, bs, decode = 0.01, 16.0, 1.6 // 160 tokens, 10 blocks each
	run := func(id string, alone float64, elapsed float64) runningSeq {
		return runningSeq{id: id, start: now.Add(-time.Duration(elapsed * float64(time.Second))), alone: alone, seqs: 1}
	}
	for _, c := range []struct {
		name          string
		running       []runningSeq
		prompts, need float64
		want          float64
	}{
		{name: "fits now", running: []runningSeq{run("x", 50, 0.8)}, prompts: 50, need: 40, want: 0}, // 50 + 5 + 40
		// 50 + 5 + 50 > 100: x ends in 0.8 s and frees its 50 blocks and its output.
		{name: "waits for the first end", running: []runningSeq{run("x", 50, 0.8)}, prompts: 50, need: 50, want: 0.8},
		// x (ends in 0.16 s) frees 20; y, 1.44 s in, then holds 30 + 10 of output: 40 + 70 > 100 until y ends.
		{name: "outputs grow while waiting", running: []runningSeq{run("x", 20, 1.44), run("y", 30, 0.16)},
			prompts: 50, need: 70, want: 1.44},
		// Not enough even when all end: one more whole decode.
		{name: "never fits: one more decode", running: []runningSeq{run("x", 20, 1.0)}, prompts: 90, need: 90, want: 0.6 + decode},
		{name: "nothing running, too big", prompts: 0, need: 120, want: decode},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := engineWait(c.running, c.prompts, c.need, 100, decode, spt, bs, now)
			if math.Abs(got-c.want) > 1e-9 {
				t.Errorf("wait %v s, want %v", got, c.want)
			}
		})
	}
}

// The SLO rule on two workers of 100 blocks: the request's 12-block prompt
// is cached on a, and b holds nothing of it. Without an SLO kv-pooled
// sends it to a (its copy price on b is 96 blocks); with one, a leaves the
// candidates when it is predicted to miss the SLO while b is predicted to
// meet it, and stays when b misses too or nothing is observed yet.
func TestPooledSLODecisions(t *testing.T) {
	prompt := tokens(7, 16*12)
	hashes := SequenceHashes(prompt, 16, "")
	out := 152.5 // reserve: (152.5 + 7.5)/16 = 10 blocks
	ms := time.Millisecond
	type running struct {
		worker  WorkerID
		blocks  int
		elapsed time.Duration // since its first token
	}
	for _, c := range []struct {
		name    string
		slo     SLO
		noFit   bool // no TPOT observed yet
		noRates bool // no prefill or decode rate observed yet
		running []running
		want    WorkerID
		busyA   string // a substring of a's busy reason, "" for not busy
	}{
		{name: "no SLO", running: []running{{"a", 40, 0}}, want: "a"},
		// The line TPOT = 0.05·fill (10 ms at 0.2, 40 ms at 0.8) meets 30 ms
		// at 0.6. a's fill: (28 pinned + 10 reserved + 12 new + 10)/100 = 0.6.
		{name: "tpot: just under the line", slo: SLO{TPOT: 30 * ms}, running: []running{{"a", 27, 0}}, want: "a"},
		{name: "tpot: just over the line", slo: SLO{TPOT: 30 * ms}, running: []running{{"a", 29, 0}}, want: "b", busyA: "predicted TTFT"},
		{name: "tpot: far over the line", slo: SLO{TTFT: time.Second, TPOT: 30 * ms}, running: []running{{"a", 40, 0}}, want: "b", busyA: "miss the SLO"},
		// b over the line too (fill 0.72 both): no candidate meets it, so
		// kv-pooled places as without an SLO.
		{name: "tpot: every worker over the line", slo: SLO{TPOT: 30 * ms},
			running: []running{{"a", 40, 0}, {"b", 40, 0}}, want: "a"},
		{name: "tpot: no observations yet", slo: SLO{TPOT: 30 * ms}, noFit: true, running: []running{{"a", 40, 0}}, want: "a"},
		// TTFT: a holds 95 blocks, its running request 1 s into a 1.525 s
		// decode (6.25 blocks of output): the 12 new blocks fit when it
		// ends, 0.525 s from now. b starts it now: 12 blocks at 1 ms.
		{name: "ttft: the wait misses", slo: SLO{TTFT: 100 * ms}, running: []running{{"a", 95, time.Second}}, want: "b", busyA: "miss the SLO"},
		// 525 ms meets 600 ms: a stays a candidate, and (the fleet
		// overloaded) kv-pooled's queue price sends the request to b as it
		// does without an SLO.
		{name: "ttft: the wait meets a looser SLO", slo: SLO{TTFT: 600 * ms},
			running: []running{{"a", 95, time.Second}, {"b", 60, 0}}, want: "b"},
		{name: "ttft: no rates yet", slo: SLO{TTFT: 100 * ms}, noRates: true, running: []running{{"a", 40, 0}}, want: "a"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ix := NewIndex(16)
			cfg := pooledConfig()
			cfg.Pooled.OutputTokens = &out
			cfg.Pooled.HomeWeight = ptr(0.0)
			cfg.SLO = c.slo
			r := newTestRouter(t, cfg, ix, WorkerInfo{ID: "a", TotalBlocks: 100}, WorkerInfo{ID: "b", TotalBlocks: 100})
			store(t, ix, "a", prompt)
			now := t0.Add(10 * time.Second)
			for k, run := range c.running {
				id := fmt.Sprint("run", k)
				h := SequenceHashes(tokens(100_000+10_000*k, 16*run.blocks), 16, "")
				r.Load().Add(Booking{ID: id, Worker: run.worker, Hashes: h, Added: t0})
				r.Load().PrefillDoneAt(id, now.Add(-run.elapsed))
			}
			r.mu.Lock()
			if !c.noFit {
				r.wait.tpot.observe(0.2, 0.010, pooledOutputWindow)
				r.wait.tpot.observe(0.8, 0.040, pooledOutputWindow)
			}
			if !c.noRates {
				r.wait.fleet.prefill.observe(0.1, 100, pooledRateWindow) // 1 ms a block
				r.wait.fleet.decode.observe(1, 100, pooledRateWindow)    // 10 ms a token
				r.outputs = pooledOutputs{n: 1, mean: out}
			}
			r.mu.Unlock()
			d, err := r.Decide(Request{ID: "q", Tokens: len(prompt), Hashes: hashes}, now)
			if err != nil {
				t.Fatal(err)
			}
			a := d.Rows[0]
			if d.Worker != c.want || a.Busy != (c.busyA != "") || !strings.Contains(a.Reason(), c.busyA) {
				t.Fatalf("chose %s (a busy %v %q), want %s (%q)\n%s", d.Worker, a.Busy, a.Reason(), c.want, c.busyA, d.Explain())
			}
			// Where the rule excludes nothing, the cost table is kv-pooled's
			// without an SLO, to the bit.
			if c.busyA == "" {
				cfg.SLO = SLO{}
				r2 := newTestRouter(t, cfg, ix, WorkerInfo{ID: "a", TotalBlocks: 100}, WorkerInfo{ID: "b", TotalBlocks: 100})
				r2.load = r.load
				r.mu.Lock()
				r2.wait.fleet, r2.outputs = r.wait.fleet, r.outputs
				r.mu.Unlock()
				d2, err := r2.Decide(Request{ID: "q", Tokens: len(prompt), Hashes: hashes}, now)
				if err != nil {
					t.Fatal(err)
				}
				for i := range d.Rows {
					if d.Rows[i] != d2.Rows[i] {
						t.Errorf("row %d with the SLO %+v, without %+v", i, d.Rows[i], d2.Rows[i])
					}
				}
			}
		})
	}
}

// Route and FinishedAt teach the TPOT line: each finished request's TPOT
// against its worker's mean fill between its first token and its end, as
// the decisions sampled it (its fill at booking when none did).
func TestPooledSLOLearnsTPOT(t *testing.T) {
	ix := NewIndex(16)
	cfg := pooledConfig()
	out := 152.5
	cfg.Pooled.OutputTokens = &out
	cfg.SLO = SLO{TPOT: 30 * time.Millisecond}
	r := newTestRouter(t, cfg, ix, WorkerInfo{ID: "a", TotalBlocks: 100})
	req := func(id string, tag int) Request {
		p := tokens(tag, 16*20)
		return Request{ID: id, Tokens: len(p), Hashes: SequenceHashes(p, 16, "")}
	}
	// x: booked alone, fill (20 + 10)/100 = 0.3; no decision samples it
	// while it runs: observed at 0.3.
	if _, err := r.Route(req("x", 1_000), t0); err != nil {
		t.Fatal(err)
	}
	r.PrefillDoneAt("x", t0.Add(100*time.Millisecond))
	r.FinishedAt("x", 11, t0.Add(time.Second+100*time.Millisecond)) // 10 tokens after the first in 1 s
	r.mu.Lock()
	fx := r.wait.tpot
	r.mu.Unlock()
	if fx.n != 1 || math.Abs(fx.mx-0.3) > 1e-12 || math.Abs(fx.my-0.1) > 1e-12 {
		t.Fatalf("after x: %+v, want one observation (0.3, 0.1)", fx)
	}
	// y is booked at fill 0.3, then v joins it (0.6 with v) before y's
	// first token, and z's decision samples a at 0.6 while y runs: y is
	// observed at that mean, not at its booking fill.
	if _, err := r.Route(req("y", 2_000), t0.Add(2*time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Route(req("v", 4_000), t0.Add(2050*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	r.PrefillDoneAt("y", t0.Add(2100*time.Millisecond))
	if _, err := r.Route(req("z", 3_000), t0.Add(2200*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	r.FinishedAt("y", 11, t0.Add(2600*time.Millisecond))
	r.mu.Lock()
	fy := r.wait.tpot
	r.mu.Unlock()
	if fy.n != 2 || math.Abs(fy.mx-(0.3+0.6)/2) > 1e-12 || math.Abs(fy.my-(0.1+0.05)/2) > 1e-12 {
		t.Fatalf("after y: %+v, want (0.6, 0.05) added", fy)
	}
	// Without an SLO nothing is learned.
	cfg.SLO = SLO{}
	r2 := newTestRouter(t, cfg, NewIndex(16), WorkerInfo{ID: "a", TotalBlocks: 100})
	if _, err := r2.Route(req("x", 1_000), t0); err != nil {
		t.Fatal(err)
	}
	r2.PrefillDoneAt("x", t0.Add(100*time.Millisecond))
	r2.FinishedAt("x", 11, t0.Add(time.Second))
	if r2.wait.tpot.n != 0 {
		t.Errorf("learned without an SLO: %+v", r2.wait.tpot)
	}
}

// With TPOT judged and the fleet at its SLO line (a predicted to miss, b
// and c to meet), kv's cost picks among the workers that meet, not the
// placement prices: the prompt is cached on b, which also runs 20 blocks;
// c is empty. kv-pooled without the miss keeps the request on b (copying
// 12 blocks to c is priced at 96); kv's cost prefers c (24: 12 blocks
// of prefill and 12 new ones, against b's 32: its 20 running blocks and
// their output). With only TTFT judged the placement prices still pick
// among the workers that meet.
func TestPooledSLOAtTheLinePicksByKVCost(t *testing.T) {
	prompt := tokens(7, 16*12)
	hashes := SequenceHashes(prompt, 16, "")
	out := 152.5
	ms := time.Millisecond
	for _, c := range []struct {
		name    string
		slo     SLO
		aBlocks int
		want    WorkerID
		pooled  bool // the chosen row carries placement terms
	}{
		{name: "no worker misses: placement", slo: SLO{TPOT: 30 * ms}, aBlocks: 10, want: "b", pooled: true},
		{name: "a misses: kv's cost", slo: SLO{TPOT: 30 * ms}, aBlocks: 80, want: "c"},
		{name: "a misses the TTFT: placement", slo: SLO{TTFT: 100 * ms}, aBlocks: 95, want: "b", pooled: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			ix := NewIndex(16)
			cfg := pooledConfig()
			cfg.Pooled.OutputTokens = &out
			cfg.Pooled.HomeWeight = ptr(0.0)
			cfg.SLO = c.slo
			r := newTestRouter(t, cfg, ix, WorkerInfo{ID: "a", TotalBlocks: 100}, WorkerInfo{ID: "b", TotalBlocks: 100}, WorkerInfo{ID: "c", TotalBlocks: 100})
			store(t, ix, "b", prompt)
			now := t0.Add(10 * time.Second)
			for k, run := range []struct {
				worker WorkerID
				blocks int
			}{{"a", c.aBlocks}, {"b", 20}} {
				id := fmt.Sprint("run", k)
				h := SequenceHashes(tokens(100_000+10_000*k, 16*run.blocks), 16, "")
				r.Load().Add(Booking{ID: id, Worker: run.worker, Hashes: h, Added: t0})
				r.Load().PrefillDoneAt(id, now.Add(-time.Second))
			}
			r.mu.Lock()
			r.wait.tpot.observe(0.2, 0.010, pooledOutputWindow)
			r.wait.tpot.observe(0.8, 0.040, pooledOutputWindow)
			r.wait.fleet.prefill.observe(0.1, 100, pooledRateWindow)
			r.wait.fleet.decode.observe(1, 100, pooledRateWindow)
			r.outputs = pooledOutputs{n: 1, mean: out}
			r.mu.Unlock()
			d, err := r.Decide(Request{ID: "q", Tokens: len(prompt), Hashes: hashes}, now)
			if err != nil {
				t.Fatal(err)
			}
			row := d.Rows[r.pos[d.Worker]]
			if d.Worker != c.want || (row.Pooled != 0) != c.pooled {
				t.Fatalf("chose %s (pooled %v), want %s (pooled terms %v)\n%s", d.Worker, row.Pooled, c.want, c.pooled, d.Explain())
			}
			if c.want == "c" && !d.Rows[0].Busy {
				t.Errorf("a not excluded\n%s", d.Explain())
			}
		})
	}
}
