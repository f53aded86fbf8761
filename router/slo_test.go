package router

import (
	"errors"
	"fmt"
	"math"
	"slices"
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
		{SLO{TPOT: time.Millisecond, Attainment: 0.99}, true, true},
		{SLO{TPOT: time.Millisecond, Attainment: 1}, false, true},
		{SLO{TPOT: time.Millisecond, Attainment: -0.1}, false, true},
		{SLO{TPOT: time.Millisecond, Attainment: math.NaN()}, false, true},
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
// sends it to a (its copy price on b is 96 blocks); kv's cost prefers b
// while a runs more than 11 blocks. With TTFT alone judged, a leaves the
// candidates when it is predicted to miss while b is predicted to meet.
// With TPOT judged kv's pick stands unless the departure is predicted to
// meet the limit with the TPOT line's observed error added (errMs, the
// residuals' 0.9 quantile here); a prediction not available yet places as
// without an SLO.
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
		noFit   bool    // no TPOT observed yet
		noRates bool    // no prefill or decode rate observed yet
		noErr   bool    // no TPOT prediction error observed yet
		errMs   float64 // the TPOT line's observed error
		running []running
		want    WorkerID
		kv      bool   // kv's rows (no placement terms) decide
		busyA   string // a substring of a's busy reason, "" for not busy
		fresh   bool   // the request's prompt is held nowhere
		fillA   int    // blocks of other content a caches beside the prompt
		capB    int    // b's capacity (0: 100 blocks, 101 with TPOT judged)
	}{
		{name: "no SLO", running: []running{{"a", 40, 0}}, want: "a"},
		// The line TPOT = 0.05·fill (10 ms at 0.2, 40 ms at 0.8) meets 30 ms
		// at 0.6. a's fill: (28 pinned + 10 reserved + 12 new + 10)/100 = 0.6.
		// kv's pick is b (cost 24 against a's 39), predicted to meet.
		{name: "tpot: placement's pick meets with the error", slo: SLO{TPOT: 30 * ms}, running: []running{{"a", 27, 0}}, want: "a"},
		// The same on a fleet of one capacity: kv's pick, its rows.
		{name: "tpot: one capacity: kv's", slo: SLO{TPOT: 30 * ms}, capB: 100, running: []running{{"a", 27, 0}}, want: "b", kv: true},
		{name: "tpot: placement's pick within the error: kv's", slo: SLO{TPOT: 30 * ms}, errMs: 1, running: []running{{"a", 27, 0}}, want: "b", kv: true},
		{name: "tpot: no error observed yet: kv's", slo: SLO{TPOT: 30 * ms}, noErr: true, running: []running{{"a", 27, 0}}, want: "b", kv: true},
		{name: "tpot: placement's pick over the line: kv's", slo: SLO{TPOT: 30 * ms}, running: []running{{"a", 29, 0}}, want: "b", kv: true},
		{name: "tpot: far over the line: kv's", slo: SLO{TTFT: time.Second, TPOT: 30 * ms}, running: []running{{"a", 40, 0}}, want: "b", kv: true},
		// a runs 10 blocks: kv's pick (22 against 24), predicted at 21.5 ms
		// (fill 0.43) against a 20 ms limit; b at 11 ms (fill 0.22).
		{name: "tpot: kv's pick misses, another meets with the error", slo: SLO{TPOT: 20 * ms}, errMs: 5, running: []running{{"a", 10, 0}},
			want: "b", kv: true, busyA: "miss the SLO"},
		{name: "tpot: kv's pick misses, none meets with the error: kv's", slo: SLO{TPOT: 20 * ms}, errMs: 10, running: []running{{"a", 10, 0}},
			want: "a", kv: true},
		// b over the line too (fill 0.72 both): no candidate meets it, so
		// kv-pooled places as without an SLO.
		{name: "tpot: every worker over the line", slo: SLO{TPOT: 30 * ms},
			running: []running{{"a", 40, 0}, {"b", 40, 0}}, want: "a"},
		{name: "tpot: no observations yet", slo: SLO{TPOT: 30 * ms}, noFit: true, running: []running{{"a", 40, 0}}, want: "a"},
		// TTFT: a holds 95 blocks, its running request 1 s into a 1.525 s
		// decode (6.25 blocks of output): the 12 new blocks fit when it
		// ends, 0.525 s from now. b starts it now: 12 blocks at 1 ms.
		// b, the only one left, holds no more of the prompt than kv's pick
		// among the rest (itself): kv's rows.
		{name: "ttft: the wait misses", slo: SLO{TTFT: 100 * ms}, running: []running{{"a", 95, time.Second}}, want: "b", kv: true, busyA: "miss the SLO"},
		// 525 ms meets 600 ms: a stays a candidate; kv's pick is b (84
		// against a's 107) and so is the placement's (the fleet
		// overloaded, its queue price), which holds no more of the prompt
		// than kv's pick: kv's rows decide.
		{name: "ttft: the wait meets a looser SLO", slo: SLO{TTFT: 600 * ms},
			running: []running{{"a", 95, time.Second}, {"b", 60, 0}}, want: "b", kv: true},
		// Both meet 600 ms; kv's pick is b (24 against a's 39), the
		// placement's a (b would copy the 12 blocks a holds), which holds
		// more of the prompt: the placement's pick stands, its rows as
		// without an SLO.
		{name: "ttft: the placement's pick holds more of the prompt than kv's", slo: SLO{TTFT: 600 * ms},
			running: []running{{"a", 27, 0}}, want: "a"},

		// A prompt no one holds; a caches 95 blocks of other content,
		// so 7 of the 12 new blocks evict unique blocks (8 each); b runs
		// 20 blocks: kv's pick is a (24 against 44), the placement's b
		// (24 + 56 against 44), holding no more of the prompt. Both meet
		// 600 ms. b larger than a: the placement's pick stands; b of a's
		// capacity: kv's pick.
		{name: "ttft: equal overlap, the placement's pick has more capacity", slo: SLO{TTFT: 600 * ms}, fresh: true, fillA: 95, capB: 200,
			running: []running{{"b", 20, 0}}, want: "b"},
		{name: "ttft: equal overlap, the placement's pick no larger: kv's", slo: SLO{TTFT: 600 * ms}, fresh: true, fillA: 95,
			running: []running{{"b", 20, 0}}, want: "a", kv: true},
		{name: "ttft: no rates yet", slo: SLO{TTFT: 100 * ms}, noRates: true, running: []running{{"a", 40, 0}}, want: "a"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ix := NewIndex(16)
			cfg := pooledConfig()
			cfg.Pooled.OutputTokens = &out
			cfg.Pooled.HomeWeight = ptr(0.0)
			cfg.SLO = c.slo
			// b's capacity: 101 blocks where TPOT is judged, so the fleet is
			// not uniform and the departure rules decide (on one capacity
			// kv-pooled takes kv's pick: the uniform case below).
			capB := c.capB
			if capB == 0 {
				capB = 100
				if c.slo.TPOT > 0 {
					capB = 101
				}
			}
			r := newTestRouter(t, cfg, ix, WorkerInfo{ID: "a", TotalBlocks: 100}, WorkerInfo{ID: "b", TotalBlocks: capB})
			store(t, ix, "a", prompt)
			if c.fillA > 0 {
				store(t, ix, "a", tokens(77, 16*c.fillA))
			}
			prompt, hashes := prompt, hashes
			if c.fresh {
				prompt = tokens(8, 16*12)
				hashes = SequenceHashes(prompt, 16, "")
			}
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
			if !c.noErr {
				for range 20 {
					r.wait.tpotErr.observe(c.errMs/1e3, pooledOutputWindow)
				}
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
			// kv's pick: the rows as kv computes them, no placement terms
			// (kv's costs here, 24 and 22–41, have none of the placement's
			// copy price of 96).
			for _, row := range d.Rows {
				if c.kv && row.Pooled != 0 {
					t.Fatalf("kv's pick with placement terms in the rows\n%s", d.Explain())
				}
			}
			// Where the rule neither excludes nor falls back to kv's
			// pick, the cost table is kv-pooled's without an SLO, to the
			// bit.
			if c.busyA == "" && !c.kv {
				cfg.SLO = SLO{}
				r2 := newTestRouter(t, cfg, ix, WorkerInfo{ID: "a", TotalBlocks: 100}, WorkerInfo{ID: "b", TotalBlocks: capB})
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
	// w is booked with a prediction: the line through x and y falls, so it
	// predicts their mean TPOT, 75 ms; w's 100 ms is an error of +25 ms.
	if _, err := r.Route(req("w", 5_000), t0.Add(3*time.Second)); err != nil {
		t.Fatal(err)
	}
	r.PrefillDoneAt("w", t0.Add(3100*time.Millisecond))
	r.FinishedAt("w", 11, t0.Add(4100*time.Millisecond))
	r.mu.Lock()
	errs := slices.Clone(r.wait.tpotErr.sorted)
	r.mu.Unlock()
	if len(errs) != 1 || math.Abs(errs[0]-0.025) > 1e-9 {
		t.Errorf("TPOT errors %v, want [0.025]", errs)
	}
	// Without an SLO nothing is learned.
	cfg.SLO = SLO{}
	r2 := newTestRouter(t, cfg, NewIndex(16), WorkerInfo{ID: "a", TotalBlocks: 100})
	if _, err := r2.Route(req("x", 1_000), t0); err != nil {
		t.Fatal(err)
	}
	r2.PrefillDoneAt("x", t0.Add(100*time.Millisecond))
	r2.FinishedAt("x", 11, t0.Add(time.Second))
	if r2.wait.tpot.n != 0 || len(r2.wait.tpotErr.sorted) != 0 {
		t.Errorf("learned without an SLO: %+v", r2.wait.tpot)
	}
}

// With TPOT judged, kv's pick stands unless departing from it is predicted
// to meet the SLO with the observed error: the prompt is cached on b, which
// also runs 20 blocks; c is empty. kv's cost prefers c (24: 12 blocks of
// prefill and 12 new ones, against b's 32); the placement keeps the request
// on b (copying 12 blocks to c is priced at 96), predicted at 20 ms (fill
// 0.4). When a runs 80 blocks it is predicted to miss (fill 1.1). With only
// TTFT judged the placement prices pick among the workers that meet.
func TestPooledSLODepartsFromKVOnlyWhenSafe(t *testing.T) {
	prompt := tokens(7, 16*12)
	hashes := SequenceHashes(prompt, 16, "")
	out := 152.5
	ms := time.Millisecond
	for _, c := range []struct {
		name    string
		slo     SLO
		aBlocks int
		errMs   float64
		want    WorkerID
		pooled  bool   // the chosen row carries placement terms
		busyA   string // a substring of a's busy reason, "" for not busy
		busyB   string
		bQueued int // blocks of a prompt waiting for its prefill on b
	}{
		{name: "placement's pick safe", slo: SLO{TPOT: 30 * ms}, aBlocks: 10, want: "b", pooled: true},
		{name: "placement's pick within the error: kv's", slo: SLO{TPOT: 30 * ms}, aBlocks: 10, errMs: 12, want: "c"},
		{name: "a misses, placement's pick safe", slo: SLO{TPOT: 30 * ms}, aBlocks: 80, want: "b", pooled: true, busyA: "KV admission"},
		{name: "a misses, placement's pick within the error: kv's", slo: SLO{TPOT: 30 * ms}, aBlocks: 80, errMs: 12, want: "c"},
		{name: "a misses the TTFT: placement", slo: SLO{TTFT: 100 * ms}, aBlocks: 95, want: "b", pooled: true, busyA: "miss the SLO"},
		// With TTFT judged the placement's pick must also be predicted to
		// start the request no later than kv's pick (sloNoSlowerLocked):
		// b holds the prompt (0 blocks to compute, 0 s), c computes its 12
		// blocks (12 ms at 1 ms a block): b stands; with 13 blocks of
		// another prompt waiting for their prefill on b (and a TPOT limit
		// b still meets with them), b's 13 ms come after c's 12 ms: kv's
		// pick, where without the rule the placement's b stood.
		{name: "placement's pick no slower to first token", slo: SLO{TTFT: time.Second, TPOT: 30 * ms}, aBlocks: 10, want: "b", pooled: true},
		{name: "placement's pick slower to first token: kv's", slo: SLO{TTFT: time.Second, TPOT: 50 * ms}, aBlocks: 10, bQueued: 13, want: "c"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ix := NewIndex(16)
			cfg := pooledConfig()
			cfg.Pooled.OutputTokens = &out
			cfg.Pooled.HomeWeight = ptr(0.0)
			cfg.SLO = c.slo
			// c one block larger: not one capacity (pooledKVPickLocked).
			r := newTestRouter(t, cfg, ix, WorkerInfo{ID: "a", TotalBlocks: 100}, WorkerInfo{ID: "b", TotalBlocks: 100}, WorkerInfo{ID: "c", TotalBlocks: 101})
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
			if c.bQueued > 0 {
				queued := tokens(300_000, 16*c.bQueued)
				r.Load().Add(Booking{ID: "queued", Worker: "b", Hashes: SequenceHashes(queued, 16, ""), PrefillTokens: len(queued), PromptTokens: len(queued), Added: now})
			}
			r.mu.Lock()
			r.wait.tpot.observe(0.2, 0.010, pooledOutputWindow)
			r.wait.tpot.observe(0.8, 0.040, pooledOutputWindow)
			r.wait.fleet.prefill.observe(0.1, 100, pooledRateWindow)
			r.wait.fleet.decode.observe(1, 100, pooledRateWindow)
			r.outputs = pooledOutputs{n: 1, mean: out}
			for range 20 {
				r.wait.tpotErr.observe(c.errMs/1e3, pooledOutputWindow)
			}
			r.mu.Unlock()
			d, err := r.Decide(Request{ID: "q", Tokens: len(prompt), Hashes: hashes}, now)
			if err != nil {
				t.Fatal(err)
			}
			row := d.Rows[r.pos[d.Worker]]
			if d.Worker != c.want || (row.Pooled != 0) != c.pooled {
				t.Fatalf("chose %s (pooled %v), want %s (pooled terms %v)\n%s", d.Worker, row.Pooled, c.want, c.pooled, d.Explain())
			}
			for k, want := range []string{c.busyA, c.busyB} {
				got := d.Rows[k]
				if got.Busy != (want != "") || !strings.Contains(got.Reason(), want) {
					t.Errorf("row %d busy %v %q, want %q\n%s", k, got.Busy, got.Reason(), want, d.Explain())
				}
			}
		})
	}
}

// When kv's pick is predicted to miss the TPOT limit, kv's cost picks among
// the workers predicted to meet it with the observed error, the others shown
// busy; with none, kv's pick stands. b holds the prompt and runs two
// requests of 10 blocks: kv's cost 32 (20 running + 12), predicted to miss
// on the line TPOT = 0.05·fill. a runs 12
// blocks: 36, fill (12 + 10 + 12 + 10)/100 = 0.44, 22 ms; c 14 blocks: 38,
// 0.46, 23 ms. The limit is 24 ms. (b's fill counts the prompt's 12 blocks:
// cached, they are not in flight there: (20 + 20 + 12 + 10)/100, 31 ms.)
// With d, which also holds the prompt and runs 21 blocks (33; fill 0.53,
// 26.5 ms), d stays a candidate when it meets the limit without the error:
// moving there recomputes nothing b would not.
// With TTFT judged too (a loose 1 s), a departure must also be predicted to
// start the request no later than kv's pick (sloNoSlowerLocked): b holds
// the prompt and computes none of it (0 s), a and c compute its 12 blocks
// (12 ms at the observed 1 ms a block), so they leave and kv's pick
// stands; d holds the prompt (0 s) and stays.
func TestPooledSLOKVPickMisses(t *testing.T) {
	prompt := tokens(7, 16*12)
	hashes := SequenceHashes(prompt, 16, "")
	out := 152.5
	for _, c := range []struct {
		name    string
		errMs   float64
		d       bool    // worker d, a holder that meets the limit
		limitMs float64 // the TPOT limit; 0: 24 ms
		ttftMs  float64 // the TTFT limit; 0: not judged
		want    WorkerID
		busy    [4]string // a, b, c, d: a substring of the busy reason
	}{
		{name: "a and c safe", errMs: 0.5, want: "a", busy: [4]string{"", "miss the SLO", ""}},
		{name: "a safe", errMs: 1.5, want: "a", busy: [4]string{"", "miss the SLO", "observed error"}},
		{name: "none safe: kv's pick", errMs: 3, want: "b"},
		// A 28 ms limit with 2 ms of error: a and c are safe, d is not but
		// holds the prompt, and kv's cost among the three picks d (33).
		{name: "a holder that meets without the error", errMs: 2, limitMs: 28, d: true, want: "d",
			busy: [4]string{"", "miss the SLO", "", ""}},
		// The departures a and c meet the SLO with the error but start the
		// request later than b: kv's pick stands.
		{name: "safe workers slower to first token: kv's pick", errMs: 0.5, ttftMs: 1000, want: "b"},
		{name: "the holder no slower to first token stays, the others leave", errMs: 2, limitMs: 28, ttftMs: 1000, d: true, want: "d",
			busy: [4]string{"later than kv's pick", "miss the SLO", "later than kv's pick", ""}},
	} {
		t.Run(c.name, func(t *testing.T) {
			ix := NewIndex(16)
			cfg := pooledConfig()
			cfg.Pooled.OutputTokens = &out
			cfg.Pooled.HomeWeight = ptr(0.0)
			limit := 24 * time.Millisecond
			if c.limitMs > 0 {
				limit = time.Duration(c.limitMs * float64(time.Millisecond))
			}
			cfg.SLO = SLO{TPOT: limit, TTFT: time.Duration(c.ttftMs * float64(time.Millisecond))}
			// c one block larger: not one capacity (pooledKVPickLocked).
			workers := []WorkerInfo{{ID: "a", TotalBlocks: 100}, {ID: "b", TotalBlocks: 100}, {ID: "c", TotalBlocks: 101}}
			runs := []struct {
				worker WorkerID
				blocks int
			}{{"a", 12}, {"b", 10}, {"b", 10}, {"c", 14}}
			if c.d {
				workers = append(workers, WorkerInfo{ID: "d", TotalBlocks: 100})
				runs = append(runs, struct {
					worker WorkerID
					blocks int
				}{"d", 21})
			}
			r := newTestRouter(t, cfg, ix, workers...)
			store(t, ix, "b", prompt)
			if c.d {
				store(t, ix, "d", prompt)
			}
			now := t0.Add(10 * time.Second)
			for k, run := range runs {
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
			for range 20 {
				r.wait.tpotErr.observe(c.errMs/1e3, pooledOutputWindow)
			}
			r.mu.Unlock()
			d, err := r.Decide(Request{ID: "q", Tokens: len(prompt), Hashes: hashes}, now)
			if err != nil {
				t.Fatal(err)
			}
			if d.Worker != c.want {
				t.Fatalf("chose %s, want %s\n%s", d.Worker, c.want, d.Explain())
			}
			for k, want := range c.busy[:len(d.Rows)] {
				got := d.Rows[k]
				if got.Busy != (want != "") || !strings.Contains(got.Reason(), want) || got.Pooled != 0 {
					t.Errorf("row %d busy %v %q (pooled terms %v), want %q and kv's row\n%s", k, got.Busy, got.Reason(), got.Pooled, want, d.Explain())
				}
			}
		})
	}
}

// residuals: the quantile over the last window errors, once there are
// 1/(1 − q) of them.
func TestSLOResiduals(t *testing.T) {
	var e residuals
	for k := range 9 {
		e.observe(float64(k), 20)
	}
	if _, ok := e.quantile(0.9); ok {
		t.Fatalf("0.9 quantile of 9 errors: want none")
	}
	e.observe(9, 20) // 0..9
	if q, ok := e.quantile(0.9); !ok || q != 8 {
		t.Errorf("0.9 quantile of 0..9 = %v, %v; want 8 (9 of 10 at or under)", q, ok)
	}
	e.observe(math.NaN(), 20)
	for k := 10; k < 30; k++ { // the window keeps 10..29
		e.observe(float64(k), 20)
	}
	if q, ok := e.quantile(0.9); !ok || q != 27 || len(e.sorted) != 20 {
		t.Errorf("after the window moved: %v, %v over %d; want 27 over 20", q, ok, len(e.sorted))
	}
	if q, _ := e.quantile(0.5); q != 19 {
		t.Errorf("median %v, want 19", q)
	}
}
