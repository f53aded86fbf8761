package sim

import (
	"errors"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/internal/warmup"
	"github.com/kvrouter/kvrouter/router"
)

// engineTotals sums the engines' submitted requests and computed prompt
// tokens.
func engineTotals(res *Result) (submitted, prefill uint64) {
	for _, st := range res.Engines {
		submitted += st.Submitted
		prefill += st.PrefillTokens
	}
	return submitted, prefill
}

// TestSimDrainShadowKeepsSessions: the agent sessions of
// TestSimDrainRebindsSessions, a worker drained at 2 s. A plain drain
// moves its sessions at their next turn, which recomputes their context
// (under the 95 %); drain-shadow sends each bound turn there and a
// copy of it to the session's new worker, and moves the session when the
// copy is there: its sessions keep ≥ 95 % of their cached tokens, and the
// worker leaves long before drain-sessions lets it (which keeps them
// until they end). The copies are engine requests: the engines submitted
// one more request and computed its prompt for each, and the event counts
// that work.
func TestSimDrainShadowKeepsSessions(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{
		Prefixes: 4, PrefixTokens: 512, TailTokens: 64, OutputTokens: 32, Requests: 480, Concurrency: 12, Seed: 9,
		Agent: workload.AgentSpec{Turns: 8, Think: 100 * time.Millisecond},
	})
	cfg := config(router.ModeRoundRobin, 4, 2048)
	cfg.Affinity = Affinity{Mode: AffinityHard}
	base, _ := run(t, w, cfg)
	o := DipOptions{Window: time.Second, Horizon: time.Minute, Tolerance: 0.02, TTFTFactor: 1.2, Timeout: time.Minute}
	type outcome struct {
		rec  EventRecord
		f    EventFigures
		res  *Result
		errs int
	}
	got := map[EventKind]outcome{}
	for _, kind := range []EventKind{EventDrain, EventDrainSessions, EventDrainShadow} {
		cfg.Events = []FleetEvent{{At: 2 * time.Second, Kind: kind, Chooser: ChooserRandom}}
		res, sum := run(t, w, cfg)
		f := MeasureEvents(w, res, base, o)[0]
		got[kind] = outcome{res.Events[0], f, res, sum.Errors}
		t.Logf("%-14s kept %.3f, left after %v, shadows %d (skipped %d, rebound %d), %d prompt tokens computed by them",
			kind, f.SessionsKept.Value, res.Events[0].Left-res.Events[0].At, res.Events[0].Shadows, res.Events[0].ShadowSkipped,
			res.Events[0].ShadowRebinds, res.Events[0].ShadowPrefillTokens)
	}
	plain, keep, shadow := got[EventDrain], got[EventDrainSessions], got[EventDrainShadow]
	if !plain.f.SessionsKept.Valid || plain.f.SessionsKept.Value >= 0.95 {
		t.Fatalf("a plain drain kept %+v of its sessions' cache: this workload no longer shows the loss", plain.f.SessionsKept)
	}
	if shadow.errs != 0 || shadow.rec.Worker != plain.rec.Worker || !shadow.f.SessionsKept.Valid || shadow.f.SessionsKept.Value < 0.95 {
		t.Fatalf("drain-shadow: %d errors, worker %d (drain: %d), kept %+v", shadow.errs, shadow.rec.Worker, plain.rec.Worker, shadow.f.SessionsKept)
	}
	if shadow.rec.Left < 0 || shadow.rec.Left >= keep.rec.Left {
		t.Fatalf("drain-shadow's worker left at %v, drain-sessions' at %v", shadow.rec.Left, keep.rec.Left)
	}
	rec := shadow.rec
	if rec.Shadows == 0 || rec.ShadowRebinds == 0 || rec.ShadowPrefillTokens <= 0 || rec.ShadowPrefillTime <= 0 ||
		rec.ShadowPromptTokens < rec.ShadowPrefillTokens || !shadow.f.ShadowPrefillShare.Valid || shadow.f.ShadowPrefillShare.Value <= 0 {
		t.Fatalf("shadow work not counted: %+v, share %+v", rec, shadow.f.ShadowPrefillShare)
	}
	// Charged to the engines: one more request submitted per copy.
	if sub, _ := engineTotals(shadow.res); sub != uint64(len(w.Requests)+rec.Shadows) {
		t.Fatalf("engines took %d requests, want %d and %d copies", sub, len(w.Requests), rec.Shadows)
	}
	if sub, _ := engineTotals(plain.res); sub != uint64(len(w.Requests)) {
		t.Fatalf("a plain drain's engines took %d requests for %d", sub, len(w.Requests))
	}
	// Eager: every session copied at the drain; the worker leaves no
	// later, and the sessions keep their cache all the same.
	cfg.Events = []FleetEvent{{At: 2 * time.Second, Kind: EventDrainShadow, Chooser: ChooserRandom}}
	cfg.Shadow.Eager = true
	eager, sum := run(t, w, cfg)
	fe := MeasureEvents(w, eager, base, o)[0]
	t.Logf("drain-shadow, eager: kept %.3f, left after %v, %d copies", fe.SessionsKept.Value, eager.Events[0].Left-eager.Events[0].At, eager.Events[0].Shadows)
	if sum.Errors != 0 || eager.Events[0].Left < 0 || eager.Events[0].Left > rec.Left || !fe.SessionsKept.Valid || fe.SessionsKept.Value < 0.95 ||
		eager.Events[0].Shadows < len(eager.Events[0].Sessions) {
		t.Fatalf("eager: %d errors, left at %v (at the next turn: %v), kept %+v, %d copies for %d sessions", sum.Errors, eager.Events[0].Left, rec.Left,
			fe.SessionsKept, eager.Events[0].Shadows, len(eager.Events[0].Sessions))
	}
	// No client request ran on the draining worker but its bound sessions'.
	bound := map[int]bool{}
	for _, sess := range rec.Sessions {
		bound[w.SessionRoot[sess]] = true
	}
	for i, rr := range shadow.res.Requests {
		if rr.Worker == rec.Worker && rr.Sent >= rec.At && !bound[w.SessionRoot[w.Requests[i].Session]] {
			t.Fatalf("request %d of session %d (not bound there) sent to the draining worker", i, w.Requests[i].Session)
		}
		if rr.Worker == rec.Worker && rr.Finished > rec.Left {
			t.Fatalf("request %d finished on the drained worker at %v, after it left at %v", i, rr.Finished, rec.Left)
		}
	}
}

// TestSimShadowWarmUp: the workload of TestSimWarmUp, a fourth worker
// added at 10 min, three seeds. With the shadow warm-up the new worker
// reaches the fleet's cached ratio in less than half the time cache-blind
// round-robin takes (the bar; kv alone takes more than
// round-robin here, so the check fails without the copies), with no
// window's p99 TTFT above 1.2 × the steady p99; the copies are charged to
// the engines and counted.
func TestSimShadowWarmUp(t *testing.T) {
	if testing.Short() {
		t.Skip("simulates 3 × 6 runs")
	}
	at := 10 * time.Minute
	var sums [3]float64
	for seed := uint64(1); seed <= 3; seed++ {
		w := planWorkload(t, seed)
		for k, tc := range []struct {
			name   string
			mode   router.Mode
			shadow bool
		}{{"kv", router.ModeKV, false}, {"kv+shadow", router.ModeKV, true}, {"round-robin", router.ModeRoundRobin, false}} {
			cfg := config(tc.mode, 3, planBlocks)
			base, err := Run(w, cfg)
			if err != nil {
				t.Fatal(err)
			}
			cfg.Events, cfg.ShadowWarmUp = []FleetEvent{{At: at, Kind: EventAdd}}, tc.shadow
			res, err := Run(w, cfg)
			if err != nil {
				t.Fatal(err)
			}
			f := MeasureEvents(w, res, base, planDip)[0]
			warmS := planDip.Horizon.Seconds()
			if f.WarmS.Valid {
				warmS = f.WarmS.Value
			}
			sums[k] += warmS
			rec := res.Events[0]
			t.Logf("seed %d %-11s warm after %3.0f s, share %4.1f%%, copies %d (%d prompt tokens computed, %.2f%% of the fleet's prefill), redirected %d; max window p99 %.0f ms (steady %.0f)",
				seed, tc.name, warmS, 100*f.NewWorkerShare.Value, rec.Shadows, rec.ShadowPrefillTokens, 100*f.ShadowPrefillShare.Value,
				rec.ShadowRedirects, f.MaxTTFTP99Ms, f.Steady.TTFT.P99)
			if !tc.shadow {
				continue
			}
			if f.MaxTTFTP99Ms > 1.2*f.Steady.TTFT.P99 {
				t.Errorf("seed %d: a window's p99 TTFT %.0f ms over 1.2 × the steady %.0f ms", seed, f.MaxTTFTP99Ms, f.Steady.TTFT.P99)
			}
			if sub, _ := engineTotals(res); rec.Shadows == 0 || rec.ShadowPrefillTokens <= 0 || sub != uint64(len(w.Requests)+rec.Shadows) {
				t.Fatalf("seed %d: %d copies computing %d tokens; engines took %d requests for %d", seed, rec.Shadows, rec.ShadowPrefillTokens, sub, len(w.Requests))
			}
		}
	}
	t.Logf("mean time to warm: kv %.0f s, kv+shadow %.0f s, round-robin %.0f s", sums[0]/3, sums[1]/3, sums[2]/3)
	if sums[1] >= sums[2]/2 {
		t.Fatalf("the shadow warm-up took %.0f s, not under half round-robin's %.0f s", sums[1]/3, sums[2]/3)
	}
}

// TestSimShadowWarmUpPooled: under kv-pooled, the workload of
// TestSimShadowWarmUp. kv-pooled places new content by rendezvous and
// keeps a held prefix on its holders (a copy is priced), so a cold worker
// gets a small share (4–8 %) and the prefixes it gets it must compute: it
// warms slowly. The shadow warm-up copies it the prefixes it lacks, after
// which kv-pooled shares them with it. Judged like with like
// (warm_comparable_s), over seeds 1–2, the warm-up takes under half the
// time without it, and the p99 TTFT of the requests sent while it warms,
// and of those sent within the horizon, stays within 1.2 × the same
// requests' p99 without the event (the steady window's p99 is one 10-s
// window's: 37 to 61 ms here).
func TestSimShadowWarmUpPooled(t *testing.T) {
	if testing.Short() {
		t.Skip("simulates 2 × 3 runs")
	}
	at := 10 * time.Minute
	var plain, shadow float64
	for seed := uint64(1); seed <= 2; seed++ {
		w := planWorkload(t, seed)
		cfg := config(router.ModeKVPooled, 3, planBlocks)
		base, err := Run(w, cfg)
		if err != nil {
			t.Fatal(err)
		}
		for _, on := range []bool{false, true} {
			warmS, f, res := warmAfterAdd(t, w, cfg, base, at, on)
			t.Logf("seed %d shadow %v: warm (like with like) after %.0f s (warm_s %v), share %.1f%%, copies %d, p99 while warming %.0f ms (%.0f without the event, steady %.0f), over the horizon × %.2f of the run without the event",
				seed, on, warmS, f.WarmS, 100*f.NewWorkerShare.Value, res.Events[0].Shadows, f.WarmUpTTFTP99Ms, f.WarmUpBaseTTFTP99Ms, f.Steady.TTFT.P99, f.TTFTP99VsBase)
			if !on {
				plain += warmS
				continue
			}
			shadow += warmS
			if res.Events[0].Shadows == 0 {
				t.Errorf("seed %d: no copies sent", seed)
			}
			if f.TTFTP99VsBase > 1.2 || f.WarmUpTTFTP99Ms > 1.2*f.WarmUpBaseTTFTP99Ms {
				t.Errorf("seed %d: p99 TTFT while warming %.0f ms (%.0f without the event), over the horizon × %.2f of the run without the event: over 1.2 ×",
					seed, f.WarmUpTTFTP99Ms, f.WarmUpBaseTTFTP99Ms, f.TTFTP99VsBase)
			}
		}
	}
	if shadow >= plain/2 {
		t.Fatalf("kv-pooled warmed in %.0f s on average with the shadow warm-up, %.0f s without: not under half", shadow/2, plain/2)
	}
}

// Shadow settings the simulation refuses.
func TestSimShadowConfigErrors(t *testing.T) {
	w := fleetWorkload(t)
	for name, f := range map[string]func(c *Config){
		"shadow warm-up without an add": func(c *Config) { c.ShadowWarmUp = true },
		"both warm-ups": func(c *Config) {
			c.ShadowWarmUp, c.Events = true, []FleetEvent{{At: time.Second, Kind: EventAdd}}
			c.WarmUp = &warmup.Policy{Share: 0.3, Headroom: warmup.DefaultHeadroom}
		},
		"negative inflight": func(c *Config) { c.Shadow.Inflight = -1 },
	} {
		cfg := config(router.ModeKV, 2, 512)
		f(&cfg)
		if _, err := Run(w, cfg); !errors.Is(err, ErrConfig) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// TestSimWarmBacklogged: the warming worker is backlogged when it has
// prefill queued and some other worker not busy has less.
func TestSimWarmBacklogged(t *testing.T) {
	row := func(id string, prefill int, busy bool) router.WorkerCost {
		return router.WorkerCost{Worker: router.WorkerID(id), ActivePrefillTokens: prefill, Busy: busy}
	}
	var w warmState
	for _, tc := range []struct {
		name string
		rows []router.WorkerCost
		want bool
	}{
		{"nothing queued there", []router.WorkerCost{row("new", 0, false), row("a", 0, false)}, false},
		{"another has less", []router.WorkerCost{row("new", 4000, false), row("a", 100, false)}, true},
		{"the others have more", []router.WorkerCost{row("new", 4000, false), row("a", 5000, false), row("b", 4000, false)}, false},
		{"the one with less is busy", []router.WorkerCost{row("new", 4000, false), row("a", 0, true), row("b", 9000, false)}, false},
		{"not among the rows", []router.WorkerCost{row("a", 0, false)}, false},
	} {
		if got := w.backlogged(tc.rows, "new"); got != tc.want {
			t.Errorf("%s: backlogged %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestSimShadowWarmUpUsesCopies: under kv-pooled on TestSimWarmUp's Zipf
// workload (seeds 1–3) the shadow warm-up makes the new worker warm, like
// with like, in under half round-robin's time, with p99 TTFT while it warms
// within 1.2 × the steady window's (the bar). It fails without
// useCopy: kv-pooled sent the copied prefixes' requests to their old holder
// (their rendezvous home), the copies aged out unused, and the new worker
// took 10, 20 and 40 s against round-robin's 20, 30 and 20 s.
func TestSimShadowWarmUpUsesCopies(t *testing.T) {
	if testing.Short() {
		t.Skip("simulates 3 × 4 runs")
	}
	at := 10 * time.Minute
	var rr, pooled float64
	for seed := uint64(1); seed <= 3; seed++ {
		w := planWorkload(t, seed)
		for _, mode := range []router.Mode{router.ModeRoundRobin, router.ModeKVPooled} {
			cfg := config(mode, 3, planBlocks)
			base, err := Run(w, cfg)
			if err != nil {
				t.Fatal(err)
			}
			warmS, f, res := warmAfterAdd(t, w, cfg, base, at, mode == router.ModeKVPooled)
			t.Logf("seed %d %s: warm (like with like) after %.0f s, copies %d, requests sent to them %d, p99 while warming %.0f ms (steady %.0f)",
				seed, mode, warmS, res.Events[0].Shadows, res.Events[0].ShadowUsed, f.WarmUpTTFTP99Ms, f.Steady.TTFT.P99)
			if mode == router.ModeRoundRobin {
				rr += warmS
				continue
			}
			pooled += warmS
			if res.Events[0].ShadowUsed == 0 || !f.ShadowUsed.Valid {
				t.Errorf("seed %d: no request sent to the copies (%d, figure %+v)", seed, res.Events[0].ShadowUsed, f.ShadowUsed)
			}
			if f.WarmUpTTFTP99Ms > 1.2*f.Steady.TTFT.P99 {
				t.Errorf("seed %d: p99 TTFT while warming %.0f ms, over 1.2 × the steady window's %.0f ms", seed, f.WarmUpTTFTP99Ms, f.Steady.TTFT.P99)
			}
		}
	}
	if pooled >= rr/2 {
		t.Fatalf("kv-pooled with the shadow warm-up warmed in %.0f s on average, round-robin in %.0f s: not under half", pooled/3, rr/3)
	}
}

// warmAfterAdd runs w with a worker added at `at`, the shadow warm-up on or
// off, and measures the event against base (the same run without it): the
// like-with-like time to warm in seconds (the horizon when never), the
// event's figures and the run.
func warmAfterAdd(t *testing.T, w *workload.Workload, cfg Config, base *Result, at time.Duration, shadow bool) (float64, EventFigures, *Result) {
	t.Helper()
	cfg.Events, cfg.ShadowWarmUp = []FleetEvent{{At: at, Kind: EventAdd}}, shadow
	res, err := Run(w, cfg)
	if err != nil {
		t.Fatal(err)
	}
	f := MeasureEvents(w, res, base, planDip)[0]
	warmS := planDip.Horizon.Seconds()
	if f.WarmComparableS.Valid {
		warmS = f.WarmComparableS.Value
	}
	return warmS, f, res
}
