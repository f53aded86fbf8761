package router

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

var disaggT0 = time.Date(2026, 10, 7, 0, 0, 0, 0, time.UTC)

// seed001Timing is the engine's seed001-small profile (Qwen3-0.6B on an
// 8 GB-class GPU), restated here: the engine package imports the router.
func seed001Timing() StepTiming {
	prefill := func(n int) float64 { x := float64(n); return 5.8e-6*x*x + 0.0353*x + 14.0 }
	decode := func(f float64) float64 { return math.Max(1, 14*f+7) }
	return StepTiming{PrefillMs: prefill, DecodeMs: decode, MaxBatchedTokens: 8192}
}

const mbps = 1e6 // MB/s in bytes per second, as seed 001 counts (344 MB = 344,064,000 B)

func near(got, want, tol time.Duration) bool { return got >= want-tol && got <= want+tol }

// Seed 001 §4.5's arithmetic: Qwen3-0.6B keeps 28 × 8 × 128 × 2 × 2 =
// 114,688 bytes of KV per token; over 104 MB/s a 1,500-token prompt moves
// 172,032,000 bytes in 1.654 s and a 3,000-token one 344,064,000 bytes in
// 3.308 s. The measured transfer (351.75 MB, 3,374 ms) was a 3,070-token
// prompt: 352,092,160 bytes, 3.386 s.
func TestDisaggSeed001Arithmetic(t *testing.T) {
	if got := KVQwen3_0_6B.BytesPerToken(); got != 114_688 {
		t.Fatalf("Qwen3-0.6B bytes per token = %d, want 114,688", got)
	}
	if got := (ModelKV{Given: 114_688, Layers: 1}).BytesPerToken(); got != 114_688 {
		t.Fatalf("given bytes per token ignored: %d", got)
	}
	link := Link{ThroughputBytesPerS: 104 * mbps}
	for _, c := range []struct {
		tokens int
		bytes  int64
		want   time.Duration
	}{
		{1_500, 172_032_000, 1_654_153_847},
		{3_000, 344_064_000, 3_308_307_693},
		{3_070, 352_092_160, 3_385_501_539},
		{500, 57_344_000, 551_384_616},
		{32_000, 3_670_016_000, 35_288_615_385},
	} {
		b := KVQwen3_0_6B.Bytes(c.tokens)
		if b != c.bytes {
			t.Errorf("%d tokens: %d bytes, want %d", c.tokens, b, c.bytes)
		}
		if got := link.Alone(b); got != c.want {
			t.Errorf("%d tokens over 104 MB/s: %v, want %v", c.tokens, got, c.want)
		}
		if got := link.TransferTime(b, 0); got != c.want {
			t.Errorf("%d tokens, nothing in flight: %v, want %v", c.tokens, got, c.want)
		}
	}
	// What the planner adds under always, on idle workers: the transfer and
	// one decode step (7 ms on an empty cache).
	pl := DisaggPlanner{Mode: DisaggAlways, KV: KVQwen3_0_6B, Timing: seed001Timing()}
	for _, c := range []struct {
		tokens int
		added  time.Duration
	}{{1_500, 1_654_153_847 + 7*time.Millisecond}, {3_000, 3_308_307_693 + 7*time.Millisecond}} {
		p, err := pl.Plan(PlanInput{Tokens: c.tokens,
			Prefill: &PlanWorker{Worker: "p"}, Decode: &PlanWorker{Worker: "d"},
			Link: &PlanLink{Name: "1gbe", Link: link}})
		if err != nil || !p.Disaggregated {
			t.Fatalf("always: %+v, %v", p, err)
		}
		if got := p.Disagg.Total - p.Agg.Total; !near(got, c.added, time.Microsecond) {
			t.Errorf("%d tokens: always adds %v, want %v\n%s", c.tokens, got, c.added, p.Explain())
		}
		// Prefill of 3,000 tokens on the seed001-small profile: 172 ms.
		if c.tokens == 3_000 && !near(p.Agg.Prefill, 172_100_000, time.Millisecond) {
			t.Errorf("3,000-token prefill %v, want ≈172 ms", p.Agg.Prefill)
		}
	}
}

// Seed 001: with four concurrent requests the four transfers split one link;
// each got a quarter (26–28 MB/s of 112) and took 12.5–13.1 s.
func TestDisaggLinkFairShare(t *testing.T) {
	link := Link{ThroughputBytesPerS: 104 * mbps}
	bytes := KVQwen3_0_6B.Bytes(3_000)
	ls := NewLinkState(link)
	for i := range 4 {
		ls.Start(string(rune('a'+i)), bytes, disaggT0)
	}
	if ls.InFlight() != 4 {
		t.Fatalf("in flight %d", ls.InFlight())
	}
	at, ok := ls.NextEvent()
	want := 4 * 3_308_307_692 * time.Nanosecond
	if !ok || !near(at.Sub(disaggT0), want, 10*time.Nanosecond) {
		t.Fatalf("next event at %v, want %v", at.Sub(disaggT0), want)
	}
	if got := ls.Advance(disaggT0.Add(want - time.Millisecond)); len(got) != 0 {
		t.Fatalf("completed early: %+v", got)
	}
	done := ls.Advance(at)
	if len(done) != 4 {
		t.Fatalf("%d of 4 done at %v", len(done), at.Sub(disaggT0))
	}
	for _, d := range done {
		rate := float64(d.Bytes) / d.Duration().Seconds() / mbps
		if math.Abs(rate-26) > 0.01 {
			t.Errorf("transfer %s: %.3f MB/s, want a quarter of 104", d.ID, rate)
		}
	}
	if ls.Peak() != 4 || ls.InFlight() != 0 {
		t.Errorf("peak %d in flight %d", ls.Peak(), ls.InFlight())
	}
	// The simple estimate says the same.
	if got := link.TransferTime(bytes, 3); !near(got, want, 10*time.Nanosecond) {
		t.Errorf("TransferTime with 3 in flight: %v, want %v", got, want)
	}
}

// A transfer joining a link mid-way: processor sharing gives it
// (B + Σ min(r_i, B)) / C.
func TestDisaggLinkEstimateProcessorSharing(t *testing.T) {
	link := Link{ThroughputBytesPerS: 100}
	ls := NewLinkState(link)
	ls.Start("big", 1_000, disaggT0)
	ls.Start("small", 100, disaggT0)
	now := disaggT0.Add(time.Second) // 50 B each moved
	ls.Advance(now)
	// Remaining: big 950, small 50. A new 200-byte transfer finishes after
	// (200 + 200 + 50) / 100 = 4.5 s.
	if got := ls.Estimate(now, 200, 0, nil); !near(got, 4500*time.Millisecond, time.Microsecond) {
		t.Errorf("estimate %v, want 4.5s", got)
	}
	// Starting 1 s later (small finishes at +1 s, big has 900 left): 2 × 200 / 100 = 4 s.
	if got := ls.Estimate(now, 200, time.Second, nil); !near(got, 4*time.Second, time.Microsecond) {
		t.Errorf("estimate after 1s %v, want 4s", got)
	}
	// A committed transfer ahead (100 B) also shares: (200 + 200 + 50 + 100) / 100.
	if got := ls.Estimate(now, 200, 0, []int64{100}); !near(got, 5500*time.Millisecond, time.Microsecond) {
		t.Errorf("estimate with one ahead %v, want 5.5s", got)
	}
	// The estimate does not change the link.
	if ls.InFlight() != 2 {
		t.Fatalf("estimate changed the link: %d in flight", ls.InFlight())
	}
	done := ls.Advance(disaggT0.Add(time.Hour))
	if len(done) != 2 || done[0].ID != "small" || done[1].ID != "big" {
		t.Fatalf("done %+v", done)
	}
	// small: 100 B at 50 B/s = 2 s; big: 100 B in those 2 s, then 900 B at 100 B/s = 11 s.
	if !near(done[0].At.Sub(disaggT0), 2*time.Second, time.Microsecond) || !near(done[1].At.Sub(disaggT0), 11*time.Second, time.Microsecond) {
		t.Errorf("completion times %v, %v", done[0].At.Sub(disaggT0), done[1].At.Sub(disaggT0))
	}
}

func TestDisaggLinkConcurrencyCapAndLatency(t *testing.T) {
	// Two slots: four equal transfers go in two waves.
	ls := NewLinkState(Link{ThroughputBytesPerS: 100, MaxConcurrent: 2})
	for _, id := range []string{"a", "b", "c", "d"} {
		ls.Start(id, 100, disaggT0)
	}
	done := ls.Advance(disaggT0.Add(time.Minute))
	if len(done) != 4 {
		t.Fatalf("done %d", len(done))
	}
	for i, want := range []time.Duration{2, 2, 4, 4} {
		if got := done[i].At.Sub(disaggT0); !near(got, want*time.Second, time.Microsecond) {
			t.Errorf("%s done at %v, want %vs", done[i].ID, got, want)
		}
	}
	if done[2].Began.Sub(disaggT0) != 2*time.Second || ls.Peak() != 2 {
		t.Errorf("c began at %v, peak %d", done[2].Began.Sub(disaggT0), ls.Peak())
	}
	if got := (Link{ThroughputBytesPerS: 100, MaxConcurrent: 2}).TransferTime(100, 3); got != 4*time.Second {
		t.Errorf("TransferTime in the second wave %v, want 4s", got)
	}
	// A per-transfer cap: one stream reaches 608 MB/s on a 10 GB/s link,
	// so 1,500 tokens take 283 ms (seed 001 §4.3: "about 280 ms").
	l := Link{ThroughputBytesPerS: 10_000 * mbps, PerTransferBytesPerS: 608 * mbps}
	if got := l.Alone(KVQwen3_0_6B.Bytes(1_500)); !near(got, 282_947_369, time.Microsecond) {
		t.Errorf("capped transfer %v", got)
	}
	// Latency comes first and uses no throughput.
	ls = NewLinkState(Link{ThroughputBytesPerS: 100, Latency: time.Second})
	ls.Start("a", 100, disaggT0)
	ls.Start("b", 100, disaggT0.Add(500*time.Millisecond))
	done = ls.Advance(disaggT0.Add(time.Minute))
	// a flows alone from 1 s to 1.5 s (50 B), shares from 1.5 s: 50 B at 50 B/s → 2.5 s;
	// b: 50 B by 2.5 s, then alone: 3 s.
	if len(done) != 2 || !near(done[0].At.Sub(disaggT0), 2500*time.Millisecond, time.Microsecond) ||
		!near(done[1].At.Sub(disaggT0), 3*time.Second, time.Microsecond) {
		t.Errorf("with latency: %+v", done)
	}
	// Cancel and zero-byte transfers.
	ls = NewLinkState(Link{ThroughputBytesPerS: 100})
	ls.Start("x", 100, disaggT0)
	ls.Start("zero", 0, disaggT0)
	if !ls.Cancel("x", disaggT0.Add(time.Millisecond)) || ls.Cancel("x", disaggT0) {
		t.Error("cancel")
	}
	if done := ls.Advance(disaggT0.Add(time.Millisecond)); len(done) != 1 || done[0].ID != "zero" || done[0].At != disaggT0 {
		t.Errorf("zero-byte transfer: %+v", done)
	}
}

func TestDisaggPrefillRun(t *testing.T) {
	// 1 ms per token, 10 ms per decode step, budget 100.
	tm := StepTiming{PrefillMs: func(n int) float64 { return float64(n) }, DecodeMs: func(float64) float64 { return 10 }, MaxBatchedTokens: 100}
	cases := []struct {
		ahead, own, decodes   int
		wait, mine, stallWant time.Duration
	}{
		{0, 50, 0, 0, 50 * time.Millisecond, 0},
		{0, 250, 0, 0, 250 * time.Millisecond, 0},
		{200, 50, 0, 200 * time.Millisecond, 50 * time.Millisecond, 0},
		{150, 100, 0, 100 * time.Millisecond, 150 * time.Millisecond, 0}, // the shared step counts as ours
		// 20 decoding: chunks of 80, each step 100 ms (80 + 20 tokens);
		// 160 own tokens = 2 steps; each stalls a decode by 100 − 10 ms.
		{0, 160, 20, 0, 200 * time.Millisecond, 180 * time.Millisecond},
		{80, 0, 0, 80 * time.Millisecond, 0, 0},
	}
	for _, c := range cases {
		w, m, s := tm.PrefillRun(c.ahead, c.own, c.decodes, 0)
		if w != c.wait || m != c.mine || s != c.stallWant {
			t.Errorf("PrefillRun(%d, %d, %d) = %v, %v, %v; want %v, %v, %v", c.ahead, c.own, c.decodes, w, m, s, c.wait, c.mine, c.stallWant)
		}
	}
}

func TestDisaggPlannerModes(t *testing.T) {
	slow := &PlanLink{Name: "1gbe", Link: Link{ThroughputBytesPerS: 104 * mbps}}
	fast := &PlanLink{Name: "rdma", Link: Link{ThroughputBytesPerS: 50_000 * mbps}}
	idle := &PlanWorker{Worker: "p1"}
	// The aggregated candidate has 24,000 prompt tokens queued and 40
	// sequences decoding: its prefill waits ≈ 1.9 s.
	busy := &PlanWorker{Worker: "d1", QueuedPrefillTokens: 24_000, DecodeSeqs: 40, Fill: 0.5}
	pl := func(m DisaggMode) *DisaggPlanner {
		return &DisaggPlanner{Mode: m, KV: KVQwen3_0_6B, Timing: seed001Timing()}
	}
	for _, c := range []struct {
		name     string
		mode     DisaggMode
		in       PlanInput
		disagg   bool
		fallback bool
		reason   string
	}{
		{"off", DisaggOff, PlanInput{Tokens: 3000, Prefill: idle, Decode: busy, Link: fast}, false, false, "off"},
		{"always slow", DisaggAlways, PlanInput{Tokens: 3000, Prefill: idle, Decode: busy, Link: slow}, true, false, "always"},
		{"always, no prefill", DisaggAlways, PlanInput{Tokens: 3000, Decode: busy, PrefillUnavailable: "all workers are busy"}, false, true, "no prefill worker available: all workers are busy"},
		{"always, no link", DisaggAlways, PlanInput{Tokens: 3000, Prefill: idle, Decode: busy}, false, true, "no transfer link"},
		{"auto slow link", DisaggAuto, PlanInput{Tokens: 3000, Prefill: idle, Decode: busy, Link: slow}, false, false, "auto: aggregated"},
		{"auto fast link", DisaggAuto, PlanInput{Tokens: 3000, Prefill: idle, Decode: busy, Link: fast}, true, false, "auto: disaggregated"},
		{"auto idle decode", DisaggAuto, PlanInput{Tokens: 3000, Prefill: idle, Decode: &PlanWorker{Worker: "d1"}, Link: fast}, false, false, "auto: aggregated"},
		{"auto, no prefill", DisaggAuto, PlanInput{Tokens: 3000, Decode: busy}, false, false, "no prefill worker"},
	} {
		p, err := pl(c.mode).Plan(c.in)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if p.Disaggregated != c.disagg || p.Fallback != c.fallback || !strings.Contains(p.Reason, c.reason) {
			t.Errorf("%s: disaggregated %v fallback %v reason %q; want %v %v %q\n%s", c.name, p.Disaggregated, p.Fallback, p.Reason, c.disagg, c.fallback, c.reason, p.Explain())
		}
		want := p.Agg.Total
		if p.Disaggregated {
			want = p.Disagg.Total
			if p.PrefillWorker != "p1" || p.DecodeWorker != "d1" {
				t.Errorf("%s: workers %s → %s", c.name, p.PrefillWorker, p.DecodeWorker)
			}
		}
		if p.Estimate != want {
			t.Errorf("%s: estimate %v, want %v", c.name, p.Estimate, want)
		}
	}
	// Auto takes the lower estimate, whichever it is.
	for _, link := range []*PlanLink{slow, fast} {
		for _, tokens := range []int{500, 3000, 32000} {
			p, _ := pl(DisaggAuto).Plan(PlanInput{Tokens: tokens, Prefill: idle, Decode: busy, Link: link})
			if p.Estimate != min(p.Agg.Total, p.Disagg.Total) {
				t.Errorf("auto %s %d tokens: %v, not min(%v, %v)", link.Name, tokens, p.Estimate, p.Agg.Total, p.Disagg.Total)
			}
		}
	}
	// The decode worker's cached prefix is not moved; the prefill worker's
	// cached prefix is not recomputed.
	p, _ := pl(DisaggAlways).Plan(PlanInput{Tokens: 3000, Prefill: &PlanWorker{Worker: "p1", CachedTokens: 2000},
		Decode: &PlanWorker{Worker: "d1", CachedTokens: 1024}, Link: slow})
	if p.Disagg.PrefillTokens != 1000 || p.Disagg.TransferTokens != 1976 || p.Disagg.TransferBytes != 1976*114_688 {
		t.Errorf("cached prefixes: prefill %d transfer %d tokens %d bytes", p.Disagg.PrefillTokens, p.Disagg.TransferTokens, p.Disagg.TransferBytes)
	}
	// Interference weight tips auto towards disaggregation.
	heavy := &DisaggPlanner{Mode: DisaggAuto, KV: KVQwen3_0_6B, Timing: seed001Timing(), InterferenceWeight: 1}
	light := &PlanWorker{Worker: "d1", DecodeSeqs: 200, Fill: 0.5}
	mid := &PlanLink{Name: "10g", Link: Link{ThroughputBytesPerS: 1_000 * mbps}}
	if p, _ := pl(DisaggAuto).Plan(PlanInput{Tokens: 3000, Prefill: idle, Decode: light, Link: mid}); p.Disaggregated {
		t.Errorf("TTFT alone should stay aggregated:\n%s", p.Explain())
	}
	if p, _ := heavy.Plan(PlanInput{Tokens: 3000, Prefill: idle, Decode: light, Link: mid}); !p.Disaggregated {
		t.Errorf("counting 200 sequences' stall should disaggregate:\n%s", p.Explain())
	}
	// A decode worker still prefilling aggregated work when the KV arrives
	// yields the first token in a mixed step, not a 7 ms decode step.
	p, _ = pl(DisaggAlways).Plan(PlanInput{Tokens: 3000, Prefill: idle, Decode: &PlanWorker{Worker: "d1", QueuedPrefillTokens: 32_000}, Link: fast})
	if p.Disagg.FirstDecode < 500*time.Millisecond {
		t.Errorf("first decode behind 32,000 queued prefill tokens: %v", p.Disagg.FirstDecode)
	}
	// Incoming KV: an aggregated prefill of 3,000 tokens (172 ms) delays a
	// KV arriving in 100 ms by 72 ms and one arriving before by the whole
	// 172 ms; one arriving after it is not delayed.
	e := pl(DisaggAuto).EstimateAggregated(3000, PlanWorker{Worker: "d1", IncomingKV: []time.Duration{-time.Second, 100 * time.Millisecond, time.Second}})
	if e.Blocked != 2 || !near(e.BlockedDelay, e.Prefill+e.Prefill-100*time.Millisecond, time.Microsecond) {
		t.Errorf("blocked %d by %v (prefill %v)", e.Blocked, e.BlockedDelay, e.Prefill)
	}
	f := p.DebugFields()
	if f["disaggregated"] != true || f["disaggregated_estimate"].(map[string]any)["transfer_bytes"] != int64(3000*114_688) {
		t.Errorf("debug fields %v", f)
	}
	if _, err := pl(DisaggAuto).Plan(PlanInput{Tokens: 10}); !errors.Is(err, ErrNoWorkers) {
		t.Errorf("no decode worker: %v", err)
	}
}

func TestDisaggParse(t *testing.T) {
	for s, want := range map[string]DisaggMode{"off": DisaggOff, "": DisaggOff, "always": DisaggAlways, "AUTO": DisaggAuto} {
		if got, err := ParseDisaggMode(s); err != nil || got != want {
			t.Errorf("ParseDisaggMode(%q) = %q, %v", s, got, err)
		}
	}
	if _, err := ParseDisaggMode("sometimes"); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("bad mode: %v", err)
	}
	for s, want := range map[string]Role{"prefill": RolePrefill, "decode": RoleDecode, "both": RoleBoth, "": RoleBoth} {
		if got, err := ParseRole(s); err != nil || got != want {
			t.Errorf("ParseRole(%q) = %q, %v", s, got, err)
		}
	}
	if _, err := ParseRole("encode"); err == nil {
		t.Error("bad role accepted")
	}
	p, d := SplitByRole([]RoleWorker{
		{WorkerInfo{ID: "d2"}, RoleDecode}, {WorkerInfo{ID: "b"}, RoleBoth}, {WorkerInfo{ID: "p1"}, RolePrefill}, {WorkerInfo{ID: "d1"}, RoleDecode},
	})
	ids := func(ws []WorkerInfo) (s []string) {
		for _, w := range ws {
			s = append(s, string(w.ID))
		}
		return s
	}
	if strings.Join(ids(p), ",") != "b,p1" || strings.Join(ids(d), ",") != "b,d1,d2" {
		t.Errorf("split: prefill %v decode %v", ids(p), ids(d))
	}
	bad := []Link{{}, {ThroughputBytesPerS: math.NaN()}, {ThroughputBytesPerS: 1, MaxConcurrent: -1}, {ThroughputBytesPerS: 1, PerTransferBytesPerS: -1}}
	for _, l := range bad {
		if l.Validate() == nil {
			t.Errorf("link %+v accepted", l)
		}
	}
	if (ModelKV{}).Validate() == nil || (ModelKV{Layers: -1, Given: 5}).Validate() == nil {
		t.Error("empty model KV accepted")
	}
	top := Topology{Links: map[string]Link{"a": {ThroughputBytesPerS: 1}}, Pairs: map[LinkPair]string{{"p", "d"}: "b"}}
	if top.Validate() == nil {
		t.Error("pair naming an undefined link accepted")
	}
}

// newDisaggTestRouter: prefill workers p1, p2, decode workers d1, d2 on one
// 104 MB/s link, the given mode, kv routing with block size 16.
func newDisaggTestRouter(t *testing.T, mode DisaggMode, ix *Index) *DisaggRouter {
	t.Helper()
	base := DefaultConfig()
	dr, err := NewDisaggRouter(base, ix, DisaggConfig{
		Mode: mode, KV: KVQwen3_0_6B, Timing: seed001Timing(),
		Topology: SingleLink("1gbe", Link{ThroughputBytesPerS: 104 * mbps}), TransferRetries: 1,
	}, 1)
	if err != nil {
		t.Fatal(err)
	}
	ws := []RoleWorker{
		{WorkerInfo{ID: "p1", TotalBlocks: 1000}, RolePrefill}, {WorkerInfo{ID: "p2", TotalBlocks: 1000}, RolePrefill},
		{WorkerInfo{ID: "d1", TotalBlocks: 1000}, RoleDecode}, {WorkerInfo{ID: "d2", TotalBlocks: 1000}, RoleDecode},
	}
	for _, w := range ws {
		ix.AddWorker(w.ID)
	}
	dr.SetWorkers(ws)
	return dr
}

func disaggHashes(base uint64, n int) []uint64 {
	out := make([]uint64, n)
	var parent uint64
	for i := range out {
		parent = ChainHash(parent, base*1_000_003+uint64(i))
		out[i] = parent
	}
	return out
}

func storeHashes(t *testing.T, ix *Index, w WorkerID, hs []uint64) {
	t.Helper()
	blocks := make([]StoredBlock, len(hs))
	for i, h := range hs {
		blocks[i] = StoredBlock{EngineHash: h, ContentHash: h}
	}
	if err := ix.Apply(w, KVEvent{Kind: EventStored, Blocks: blocks}); err != nil {
		t.Fatal(err)
	}
}

// Two-stage routing: the prefill worker by overlap, the decode worker by
// load; both bookings tracked and freed.
func TestDisaggRouterTwoStages(t *testing.T) {
	ix := NewIndex(16)
	dr := newDisaggTestRouter(t, DisaggAlways, ix)
	hs := disaggHashes(1, 100) // 1,600 tokens
	storeHashes(t, ix, "p2", hs[:80])
	storeHashes(t, ix, "d2", hs[:10])
	pr, dc := dr.Routers()
	// d2 is loaded: the decode router must pick d1 although d2 holds a prefix.
	dc.Load().Add(Booking{ID: "other", Worker: "d2", Hashes: disaggHashes(2, 50), PrefillDone: true, Added: disaggT0})

	req := Request{ID: "r1", Hashes: hs, Tokens: 1600}
	dd, err := dr.Route(req, disaggT0)
	if err != nil {
		t.Fatal(err)
	}
	if !dd.Disaggregated || dd.PrefillWorker != "p2" || dd.DecodeWorker != "d1" {
		t.Fatalf("plan %s → %s (disaggregated %v)\n%s", dd.PrefillWorker, dd.DecodeWorker, dd.Disaggregated, dd.Explain())
	}
	if dd.Disagg.PrefillTokens != 320 || dd.Disagg.TransferTokens != 1600 {
		t.Errorf("prefill %d tokens, transfer %d", dd.Disagg.PrefillTokens, dd.Disagg.TransferTokens)
	}
	if !strings.Contains(dd.Explain(), "0.0 * ") && !strings.Contains(dd.Explain(), "decode router") {
		t.Errorf("explain:\n%s", dd.Explain())
	}
	if l := pr.Load().Load("p2"); l.ActivePrefillTokens != 320 || l.Requests != 1 {
		t.Errorf("prefill booking %+v", l)
	}
	if l := dc.Load().Load("d1"); l.ActivePrefillTokens != 0 || l.Requests != 1 || l.ActiveBlocks != 100 {
		t.Errorf("decode booking %+v", l)
	}
	// Prefill done: the prefill worker's prompt load goes, the transfer starts.
	if _, err := dr.PrefillDone("r1", disaggT0.Add(100*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if l := pr.Load().Load("p2"); l.ActivePrefillTokens != 0 || l.Requests != 1 {
		t.Errorf("after prefill %+v", l)
	}
	if s := dr.Stats(); s.InFlightTransfers != 1 || s.Disaggregated != 1 {
		t.Errorf("stats %+v", s)
	}
	if err := dr.TransferDone("r1", disaggT0.Add(2*time.Second)); err != nil {
		t.Fatal(err)
	}
	if l := pr.Load().Load("p2"); l.Requests != 0 {
		t.Errorf("prefill booking not freed after the transfer: %+v", l)
	}
	if err := dr.TransferDone("r1", disaggT0.Add(2*time.Second)); !errors.Is(err, ErrWrongStage) {
		t.Errorf("second transfer done: %v", err)
	}
	dr.Free("r1")
	if l := dc.Load().Load("d1"); l.Requests != 0 || dr.InFlight() != 0 {
		t.Errorf("decode booking not freed: %+v", l)
	}
	if _, err := dr.PrefillDone("r1", disaggT0); !errors.Is(err, ErrUnknownRequest) {
		t.Errorf("unknown: %v", err)
	}
	if s := dr.Stats(); s.Transfers != 1 || s.TransferBytes != 1600*114_688 || math.Abs(s.TransferSeconds-1.9) > 1e-9 {
		t.Errorf("transfer stats %+v", s)
	}
}

// Auto: on a 104 MB/s link a 3,000-token request stays aggregated; with a
// 50 GB/s link and a busy decode worker it goes disaggregated; and the
// transfers in flight make the link estimate queue.
func TestDisaggRouterAutoAndQueueing(t *testing.T) {
	ix := NewIndex(16)
	dr := newDisaggTestRouter(t, DisaggAuto, ix)
	req := Request{ID: "a", Hashes: disaggHashes(3, 187), Tokens: 3000}
	dd, err := dr.Route(req, disaggT0)
	if err != nil || dd.Disaggregated {
		t.Fatalf("auto on 1 GbE went disaggregated (%v):\n%s", err, dd.Explain())
	}
	if !dd.DisaggOK || dd.Disagg.Total-dd.Agg.Total < 3*time.Second {
		t.Errorf("estimates: agg %v disagg %v", dd.Agg.Total, dd.Disagg.Total)
	}
	dr.Free("a")

	// Always: four requests at once; the fourth's estimate sees three
	// committed transfers ahead and the link split four ways.
	if err := dr.SetMode(DisaggAlways); err != nil {
		t.Fatal(err)
	}
	var last DisaggDecision
	for i := range 4 {
		r := Request{ID: string(rune('w' + i)), Hashes: disaggHashes(uint64(10+i), 187), Tokens: 3000}
		if last, err = dr.Route(r, disaggT0); err != nil || !last.Disaggregated {
			t.Fatalf("always %d: %v", i, err)
		}
	}
	alone := KVQwen3_0_6B.Bytes(3000)
	if q := last.Disagg.TransferQueue(); q < 2*(Link{ThroughputBytesPerS: 104 * mbps}).Alone(alone) {
		t.Errorf("fourth transfer's queueing %v, want ≥ 2 × alone\n%s", q, last.Explain())
	}
	for i := range 4 {
		id := string(rune('w' + i))
		if _, err := dr.PrefillDone(id, disaggT0.Add(200*time.Millisecond)); err != nil {
			t.Fatal(err)
		}
	}
	if s := dr.Stats(); s.InFlightTransfers != 4 {
		t.Errorf("in flight %d", s.InFlightTransfers)
	}
	for i := range 4 {
		dr.Free(string(rune('w' + i)))
	}
	if s := dr.Stats(); s.InFlightTransfers != 0 || dr.InFlight() != 0 {
		t.Errorf("after free: %+v", s)
	}
}

// No healthy prefill worker: always falls back to aggregated, loudly; a
// failed transfer is retried once, then served aggregated; a failed remote
// prefill goes aggregated at once. Nothing is lost.
func TestDisaggRouterFallbacks(t *testing.T) {
	ix := NewIndex(16)
	dr := newDisaggTestRouter(t, DisaggAlways, ix)
	_, dc := dr.Routers()
	hs := disaggHashes(5, 100)

	dd, err := dr.Route(Request{ID: "t", Hashes: hs, Tokens: 1600}, disaggT0)
	if err != nil || !dd.Disaggregated {
		t.Fatal(err)
	}
	if _, err := dr.PrefillDone("t", disaggT0); err != nil {
		t.Fatal(err)
	}
	rec, err := dr.TransferFailed("t", disaggT0.Add(time.Second), errors.New("connection reset"))
	if err != nil || rec.Action != RecoverRetryTransfer || rec.Attempt != 1 || !strings.Contains(rec.Reason, "connection reset") {
		t.Fatalf("first failure: %+v %v", rec, err)
	}
	rec, err = dr.TransferFailed("t", disaggT0.Add(2*time.Second), errors.New("connection reset"))
	if err != nil || rec.Action != RecoverAggregate || rec.Worker != dd.DecodeWorker {
		t.Fatalf("second failure: %+v %v", rec, err)
	}
	if l := dc.Load().Load(dd.DecodeWorker); l.ActivePrefillTokens != 1600 || l.Requests != 1 {
		t.Errorf("fallback booking %+v", l)
	}
	if p, err := dr.PrefillDone("t", disaggT0.Add(3*time.Second)); err != nil || p.Disaggregated || !p.Fallback {
		t.Errorf("aggregated after fallback: %+v %v", p, err)
	}
	dr.Free("t")

	dd, _ = dr.Route(Request{ID: "p", Hashes: hs, Tokens: 1600}, disaggT0)
	rec, err = dr.PrefillFailed("p", disaggT0, errors.New("worker gone"))
	if err != nil || rec.Action != RecoverAggregate || rec.Worker != dd.DecodeWorker {
		t.Fatalf("prefill failure: %+v %v", rec, err)
	}
	dr.Free("p")
	s := dr.Stats()
	if s.TransferRetries != 1 || s.TransferFallbacks != 1 || s.PrefillFallbacks != 1 || s.InFlightTransfers != 0 {
		t.Errorf("stats %+v", s)
	}

	// The prefill workers leave (unhealthy): always serves aggregated.
	dr.SetWorkers([]RoleWorker{{WorkerInfo{ID: "d1", TotalBlocks: 1000}, RoleDecode}})
	dd, err = dr.Route(Request{ID: "n", Hashes: hs, Tokens: 1600}, disaggT0)
	if err != nil || dd.Disaggregated || !dd.Fallback || dd.DecodeWorker != "d1" || !strings.Contains(dd.Reason, "no prefill worker") {
		t.Fatalf("no prefill worker: %+v %v", dd.DisaggPlan, err)
	}
	if dr.Stats().Fallbacks != 1 {
		t.Errorf("fallbacks %d", dr.Stats().Fallbacks)
	}
	dr.Free("n")
	// No decode-capable worker at all is an error.
	dr.SetWorkers([]RoleWorker{{WorkerInfo{ID: "p1"}, RolePrefill}})
	if _, err := dr.Route(Request{ID: "x", Hashes: hs, Tokens: 1600}, disaggT0); !errors.Is(err, ErrNoWorkers) {
		t.Errorf("no decode worker: %v", err)
	}
}

// A "both" worker is never its own remote prefill worker.
func TestDisaggRouterBothRole(t *testing.T) {
	ix := NewIndex(16)
	dr, err := NewDisaggRouter(DefaultConfig(), ix, DisaggConfig{Mode: DisaggAlways, KV: KVQwen3_0_6B, Timing: seed001Timing(),
		Topology: SingleLink("nvlink", Link{ThroughputBytesPerS: 50_000 * mbps, PerPair: true})}, 1)
	if err != nil {
		t.Fatal(err)
	}
	ix.AddWorker("b1")
	dr.SetWorkers([]RoleWorker{{WorkerInfo{ID: "b1"}, RoleBoth}})
	dd, err := dr.Route(Request{ID: "r", Hashes: disaggHashes(7, 10), Tokens: 160}, disaggT0)
	if err != nil || dd.Disaggregated || !dd.Fallback || dd.DecodeWorker != "b1" {
		t.Fatalf("single both worker: %+v %v", dd.DisaggPlan, err)
	}
	dr.Free("r")
	ix.AddWorker("b2")
	dr.SetWorkers([]RoleWorker{{WorkerInfo{ID: "b1"}, RoleBoth}, {WorkerInfo{ID: "b2"}, RoleBoth}})
	dd, err = dr.Route(Request{ID: "r", Hashes: disaggHashes(7, 10), Tokens: 160}, disaggT0)
	if err != nil || !dd.Disaggregated || dd.PrefillWorker == dd.DecodeWorker {
		t.Fatalf("two both workers: %+v %v", dd.DisaggPlan, err)
	}
	if len(dr.Workers()) != 2 {
		t.Errorf("workers %v", dr.Workers())
	}
}

// RouteWithin limits each stage to the workers given (a session's binding,
// a pinned prefix's holders): a limit overrides the stage's own choice, a
// limited decode stage with nothing left fails the plan, a limited prefill
// stage with nothing left serves the request aggregated on the decode
// worker; PlanWithin decides alike without booking.
func TestDisaggRouteWithin(t *testing.T) {
	hs := disaggHashes(1, 100)
	for _, tc := range []struct {
		name            string
		lim             StageLimits
		exclude         []WorkerID
		err             bool
		disagg          bool
		prefill, decode WorkerID
	}{
		{"no limits: by overlap and load", StageLimits{}, nil, false, true, "p2", "d1"},
		{"prefill limited against the overlap", StageLimits{Prefill: []WorkerID{"p1"}}, nil, false, true, "p1", "d1"},
		{"decode limited against the load", StageLimits{Decode: []WorkerID{"d2"}}, nil, false, true, "p2", "d2"},
		{"both limited", StageLimits{Prefill: []WorkerID{"p1"}, Decode: []WorkerID{"d2"}}, nil, false, true, "p1", "d2"},
		{"a set: the stage picks within it", StageLimits{Prefill: []WorkerID{"p1", "p2"}}, nil, false, true, "p2", "d1"},
		{"the limited prefill worker excluded: aggregated on the decode worker", StageLimits{Prefill: []WorkerID{"p1"}, Decode: []WorkerID{"d2"}}, []WorkerID{"p1"}, false, false, "", "d2"},
		{"the limited decode worker excluded: no plan", StageLimits{Decode: []WorkerID{"d2"}}, []WorkerID{"d2"}, true, false, "", ""},
		{"a limit naming no worker of the stage: no plan", StageLimits{Decode: []WorkerID{"p1"}}, nil, true, false, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ix := NewIndex(16)
			dr := newDisaggTestRouter(t, DisaggAlways, ix)
			storeHashes(t, ix, "p2", hs[:80])
			_, dc := dr.Routers()
			dc.Load().Add(Booking{ID: "other", Worker: "d2", Hashes: disaggHashes(2, 50), PrefillDone: true, Added: disaggT0})
			req := Request{ID: "r1", Hashes: hs, Tokens: 1600, Exclude: tc.exclude}
			plan, perr := dr.PlanWithin(req, tc.lim, disaggT0)
			dd, err := dr.RouteWithin(req, tc.lim, disaggT0)
			if (err != nil) != tc.err || (perr != nil) != tc.err {
				t.Fatalf("route %v, plan %v, want error %v", err, perr, tc.err)
			}
			if tc.err {
				if dr.InFlight() != 0 {
					t.Fatal("a failed plan booked")
				}
				return
			}
			if dd.Disaggregated != tc.disagg || dd.DecodeWorker != tc.decode || (tc.disagg && dd.PrefillWorker != tc.prefill) {
				t.Fatalf("plan %s → %s (disaggregated %v), want %s → %s (%v)\n%s", dd.PrefillWorker, dd.DecodeWorker, dd.Disaggregated,
					tc.prefill, tc.decode, tc.disagg, dd.Explain())
			}
			if plan.DecodeWorker != dd.DecodeWorker || plan.PrefillWorker != dd.PrefillWorker {
				t.Errorf("PlanWithin %s → %s, RouteWithin %s → %s", plan.PrefillWorker, plan.DecodeWorker, dd.PrefillWorker, dd.DecodeWorker)
			}
			if dc.Load().Load(tc.decode).Requests == 0 {
				t.Errorf("decode worker %s not booked", tc.decode)
			}
		})
	}
}
