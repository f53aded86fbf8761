package router

import (
	"fmt"
	"math"
	"testing"
	"time"
)

// Dynamo's later cost terms, worked by hand from its formula (block size 16):
//
//	decay    = 1/(1 + d·(excess prefill tokens/16)/⌈isl/16⌉)
//	prefill  = (active prefill + isl)/16 − credit·decay·overlap, ≥ 0
//	cost     = scale·prefill + active blocks + new blocks + w·active requests
func TestCostDynamoTerms(t *testing.T) {
	cases := []struct {
		name  string
		cfg   func(*Config)
		in    costInput
		want  costTerms
		descr string
	}{
		{
			name: "no decay: full credit",
			in:   costInput{isl: 64, overlap: 4, load: WorkerLoad{ActivePrefillTokens: 128}},
			// (128+64)/16 − 4 = 8
			want: costTerms{prefill: 8, decay: 1, cost: 8},
		},
		{
			name: "decay 1, 8 blocks above the floor, 4-block prompt",
			cfg:  func(c *Config) { c.OverlapCreditDecay = 1 },
			in:   costInput{isl: 64, overlap: 4, load: WorkerLoad{ActivePrefillTokens: 128}},
			// decay = 1/(1 + 1·8/4) = 1/3; prefill = 12 − 4/3 = 32/3
			want: costTerms{prefill: 32.0 / 3, decay: 1.0 / 3, cost: 32.0 / 3},
		},
		{
			name: "decay 0.5 halves the credit at the same excess",
			cfg:  func(c *Config) { c.OverlapCreditDecay = 0.5 },
			in:   costInput{isl: 64, overlap: 4, load: WorkerLoad{ActivePrefillTokens: 128}},
			// decay = 1/(1 + 0.5·2) = 0.5; prefill = 12 − 2 = 10
			want: costTerms{prefill: 10, decay: 0.5, cost: 10},
		},
		{
			name: "excess measured from the floor",
			cfg:  func(c *Config) { c.OverlapCreditDecay = 1 },
			in:   costInput{isl: 64, overlap: 4, load: WorkerLoad{ActivePrefillTokens: 128}, minActivePrefill: 64},
			// excess 64 tokens = 4 blocks: decay = 1/(1 + 4/4) = 0.5; prefill = 12 − 2
			want: costTerms{prefill: 10, decay: 0.5, cost: 10},
		},
		{
			name: "at the floor the credit is whole",
			cfg:  func(c *Config) { c.OverlapCreditDecay = 1 },
			in:   costInput{isl: 64, overlap: 4, load: WorkerLoad{ActivePrefillTokens: 128}, minActivePrefill: 128},
			want: costTerms{prefill: 8, decay: 1, cost: 8},
		},
		{
			name: "a partial last block counts in the prompt's blocks",
			cfg:  func(c *Config) { c.OverlapCreditDecay = 1 },
			in:   costInput{isl: 50, overlap: 3, load: WorkerLoad{ActivePrefillTokens: 64}},
			// ⌈50/16⌉ = 4, excess 4 blocks: decay 0.5; prefill = 114/16 − 1.5 = 5.625
			want: costTerms{prefill: 5.625, decay: 0.5, cost: 5.625},
		},
		{
			name: "no decay without prefill tracking (as Dynamo)",
			cfg:  func(c *Config) { c.OverlapCreditDecay = 1; c.TrackPrefillTokens = false },
			in:   costInput{isl: 64, overlap: 2, load: WorkerLoad{ActivePrefillTokens: 128}},
			// 64/16 − 2 = 2
			want: costTerms{prefill: 2, decay: 1, cost: 2},
		},
		{
			name: "no decay for an empty prompt (no blocks to divide by)",
			cfg:  func(c *Config) { c.OverlapCreditDecay = 1 },
			in:   costInput{isl: 0, load: WorkerLoad{ActivePrefillTokens: 32}},
			want: costTerms{prefill: 2, decay: 1, cost: 2},
		},
		{
			name: "decode active-request weight",
			cfg:  func(c *Config) { c.DecodeActiveRequestWeight = 2 },
			in:   costInput{isl: 64, overlap: 1, load: WorkerLoad{ActiveBlocks: 5, Requests: 3}, newBlocks: 3},
			// prefill 4 − 1 = 3, decode 5 + 3 = 8, requests 2·3 = 6: 17
			want: costTerms{prefill: 3, decode: 8, requests: 6, decay: 1, cost: 17},
		},
		{
			name: "request weight beside a prefill scale",
			cfg:  func(c *Config) { c.DecodeActiveRequestWeight = 0.5; c.PrefillLoadScale = 1.5 },
			in:   costInput{isl: 64, overlap: 1, load: WorkerLoad{ActiveBlocks: 5, Requests: 3}, newBlocks: 3},
			// 1.5·3 + 8 + 1.5 = 14
			want: costTerms{prefill: 3, decode: 8, requests: 1.5, decay: 1, cost: 14},
		},
		{
			name: "all of it: decay, scale and requests",
			cfg: func(c *Config) {
				c.OverlapCreditDecay = 2
				c.PrefillLoadScale = 2
				c.DecodeActiveRequestWeight = 1
			},
			in: costInput{isl: 128, overlap: 6, load: WorkerLoad{ActivePrefillTokens: 96, ActiveBlocks: 10, Requests: 4}, newBlocks: 2, minActivePrefill: 32},
			// excess 64 = 4 blocks, 8-block prompt: decay = 1/(1 + 2·0.5) = 0.5
			// prefill = 224/16 − 3 = 11; cost = 22 + 12 + 4 = 38
			want: costTerms{prefill: 11, decode: 12, requests: 4, decay: 0.5, cost: 38},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := DefaultConfig()
			if c.cfg != nil {
				c.cfg(&cfg)
			}
			if err := cfg.Validate(); err != nil {
				t.Fatal(err)
			}
			got := computeTerms(&cfg, c.in)
			if !close(got.prefill, c.want.prefill) || !close(got.decode, c.want.decode) || !close(got.requests, c.want.requests) ||
				!close(got.decay, c.want.decay) || !close(got.cost, c.want.cost) {
				t.Fatalf("got %+v, want %+v", got, c.want)
			}
		})
	}
}

func close(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

// The decay changes a decision: B holds the whole 16-block prompt but
// carries a prefill backlog of 96 tokens (6 blocks) in one active block, A
// is idle and cold. Every prompt block is new to both active sets.
//
//	A: 256/16 = 16 prefill + 16 new blocks                        = 32
//	B, decay 0: (96+256)/16 − 16 = 6 prefill + 1 + 16 blocks      = 23 → B
//	B, decay 4: 1/(1 + 4·6/16) = 0.4; 22 − 6.4 = 15.6 prefill + 17 = 32.6 → A
func TestRouterCreditDecayDecision(t *testing.T) {
	toks := make([]uint32, 256)
	for i := range toks {
		toks[i] = uint32(i + 1)
	}
	for _, c := range []struct {
		decay    float64
		want     WorkerID
		costB    float64
		formulaB string
	}{
		{decay: 0, want: "b", costB: 23, formulaB: "23.000 = 1.0 * 6.000 + 17.000"},
		{decay: 4, want: "a", costB: 32.6, formulaB: "32.600 = 1.0 * 15.600 + 17.000 (credit decay 0.400)"},
	} {
		t.Run(fmt.Sprint("decay ", c.decay), func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.OverlapCreditDecay = c.decay
			ix := NewIndex(cfg.BlockSize)
			ix.AddWorker("a")
			ix.AddWorker("b")
			store(t, ix, "b", toks)
			rt, err := New(cfg, ix, 1)
			if err != nil {
				t.Fatal(err)
			}
			rt.SetWorkers([]WorkerInfo{{ID: "a"}, {ID: "b"}})
			now := time.Unix(100, 0)
			rt.Load().Add(Booking{ID: "backlog", Worker: "b", Hashes: []uint64{101}, PrefillTokens: 96, Added: now})
			d, err := rt.Decide(Request{ID: "q", Hashes: SequenceHashes(toks, 16, ""), Tokens: 256}, now)
			if err != nil {
				t.Fatal(err)
			}
			if d.Worker != c.want || !close(d.Rows[0].Cost, 32) || !close(d.Rows[1].Cost, c.costB) {
				t.Fatalf("chose %s with costs a %.3f b %.3f, want %s with 32 and %.3f\n%s", d.Worker, d.Rows[0].Cost, d.Rows[1].Cost, c.want, c.costB, d.Explain())
			}
			if got := d.Rows[1].Formula(d.Scale); got != c.formulaB {
				t.Fatalf("formula %q, want %q", got, c.formulaB)
			}
		})
	}
}

// Power of two choices: of two distinct workers drawn at random the one
// with fewer requests wins, so the most loaded of three is never chosen and
// the others are; one candidate is chosen alone; busy workers are not drawn.
func TestRouterPowerOfTwo(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Mode = ModePowerOfTwo
	rt, err := New(cfg, nil, 3)
	if err != nil {
		t.Fatal(err)
	}
	rt.SetWorkers([]WorkerInfo{{ID: "heavy"}, {ID: "light"}, {ID: "mid"}})
	now := time.Unix(100, 0)
	rt.Load().Add(Booking{ID: "h", Worker: "heavy", Sequences: 5, Added: now})
	rt.Load().Add(Booking{ID: "m", Worker: "mid", Added: now})
	chosen := map[WorkerID]int{}
	for i := range 300 {
		d, err := rt.Decide(Request{ID: fmt.Sprint(i)}, now)
		if err != nil {
			t.Fatal(err)
		}
		chosen[d.Worker]++
	}
	// light wins every draw it is in (2/3 of them), mid the draws with heavy (1/3).
	if chosen["heavy"] != 0 || chosen["light"] == 0 || chosen["mid"] == 0 || chosen["light"] <= chosen["mid"] {
		t.Fatalf("choices %v: want light most, mid sometimes, heavy never", chosen)
	}
	for i := range 20 {
		d, err := rt.Decide(Request{ID: fmt.Sprint(i), Exclude: []WorkerID{"light", "mid"}}, now)
		if err != nil || d.Worker != "heavy" {
			t.Fatalf("one candidate: chose %s (%v)", d.Worker, err)
		}
	}
	if m, err := ParseMode("power_of_two"); err != nil || m != ModePowerOfTwo {
		t.Fatalf("ParseMode(power_of_two) = %q, %v", m, err)
	}
}

// Assume KV reuse (the default): a second request with the same prompt on a
// worker adds no active blocks. Without (--no-router-assume-kv-reuse) it adds
// all of its own, and the booking carries hashes no other request shares.
func TestRouterDistinctActiveBlocks(t *testing.T) {
	hashes := []uint64{11, 12, 13}
	for _, c := range []struct {
		distinct      bool
		wantNewBlocks int
		wantActive    int
	}{
		{distinct: false, wantNewBlocks: 0, wantActive: 3},
		{distinct: true, wantNewBlocks: 3, wantActive: 6},
	} {
		t.Run(fmt.Sprint("distinct ", c.distinct), func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.DistinctActiveBlocks = c.distinct
			rt, err := New(cfg, NewIndex(cfg.BlockSize), 1)
			if err != nil {
				t.Fatal(err)
			}
			rt.SetWorkers([]WorkerInfo{{ID: "w"}})
			now := time.Unix(100, 0)
			first, err := rt.Route(Request{ID: "one", Hashes: hashes, Tokens: 48}, now)
			if err != nil {
				t.Fatal(err)
			}
			second, err := rt.Route(Request{ID: "two", Hashes: hashes, Tokens: 48}, now)
			if err != nil {
				t.Fatal(err)
			}
			if got := second.Rows[0].NewBlocks; got != c.wantNewBlocks {
				t.Fatalf("second request adds %d blocks, want %d", got, c.wantNewBlocks)
			}
			if got := rt.Load().Load("w").ActiveBlocks; got != c.wantActive {
				t.Fatalf("active blocks %d, want %d", got, c.wantActive)
			}
			sameAsPrompt := fmt.Sprint(first.ActiveHashes) == fmt.Sprint(hashes)
			if sameAsPrompt == c.distinct || len(first.ActiveHashes) != len(hashes) {
				t.Fatalf("booked hashes %v for prompt %v (distinct %v)", first.ActiveHashes, hashes, c.distinct)
			}
			if c.distinct && fmt.Sprint(first.ActiveHashes) == fmt.Sprint(second.ActiveHashes) {
				t.Fatal("two requests booked the same distinct hashes")
			}
		})
	}
}

// A disaggregated request of n sequences books one on the prefill worker
// (it prefills once) and n on the decode worker, aggregated or not; with
// DistinctActiveBlocks its bookings use the distinct hashes.
func TestDisaggBookingsSequencesAndHashes(t *testing.T) {
	for _, c := range []struct {
		name     string
		mode     DisaggMode
		distinct bool
	}{
		{"disaggregated", DisaggAlways, false},
		{"disaggregated, distinct blocks", DisaggAlways, true},
		{"aggregated", DisaggOff, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			ix := NewIndex(16)
			dr := newDisaggTestRouter(t, c.mode, ix)
			if c.distinct {
				base := DefaultConfig()
				base.DistinctActiveBlocks = true
				if err := dr.SetBaseConfig(base); err != nil {
					t.Fatal(err)
				}
			}
			hs := disaggHashes(5, 20)
			req := Request{ID: "n3", Hashes: hs, Tokens: 320, Sequences: 3}
			dd, err := dr.Route(req, disaggT0)
			if err != nil || dd.Disaggregated != (c.mode == DisaggAlways) {
				t.Fatalf("plan: %v (disaggregated %v)", err, dd.Disaggregated)
			}
			pr, dc := dr.Routers()
			if got := dc.Load().Load(dd.DecodeWorker); got.Requests != 3 {
				t.Fatalf("decode worker %s booked %+v, want 3 requests", dd.DecodeWorker, got)
			}
			if dd.Disaggregated {
				if got := pr.Load().Load(dd.PrefillWorker); got.Requests != 1 {
					t.Fatalf("prefill worker %s booked %+v, want 1 request", dd.PrefillWorker, got)
				}
			}
			// A second request with the same prompt on the same decode
			// worker shares its blocks unless they are distinct.
			rows := dc.Load().Rows([]WorkerInfo{{ID: dd.DecodeWorker}}, map[WorkerID]int{dd.DecodeWorker: 0}, hs, nil)
			if want := map[bool]int{false: 0, true: len(hs)}[c.distinct]; rows[0].NewBlocks != want {
				t.Fatalf("the prompt's blocks are %d new on the decode worker, want %d", rows[0].NewBlocks, want)
			}
		})
	}
}

// TestCostPerBlockIsDivision: costPlan.perBlock multiplies by 1/bs for a
// power-of-two block size; the bits must be the division's for every
// value the cost can see (token counts, their fractions, huge and tiny
// values), and a block size that is not a power of two must divide.
func TestCostPerBlockIsDivision(t *testing.T) {
	xs := []float64{0, 1, 3, 15, 16, 17, 511, 512, 513, 1e6 + 7, 123456789, 0.1, 1.0 / 3, math.MaxFloat64,
		math.SmallestNonzeroFloat64, 3 * math.SmallestNonzeroFloat64, 0x1p-1020, math.Inf(1), -0.0, -17}
	rng := newRand(7)
	for range 2000 {
		xs = append(xs, float64(rng.Int64N(1<<40)), rng.Float64()*1e9, math.Float64frombits(rng.Uint64()&^(1<<63)))
	}
	for _, bs := range []int{1, 2, 4, 16, 32, 64, 256, 1024, 3, 12, 48, 100} {
		cfg := DefaultConfig()
		cfg.BlockSize = bs
		p := newCostPlan(&cfg, 512)
		if pow2 := bs&(bs-1) == 0; (p.invBs != 0) != pow2 {
			t.Fatalf("block size %d: invBs %v, power of two %v", bs, p.invBs, pow2)
		}
		for _, x := range xs {
			got, want := p.perBlock(x), x/float64(bs)
			if math.Float64bits(got) != math.Float64bits(want) && !(math.IsNaN(got) && math.IsNaN(want)) {
				t.Fatalf("block size %d: perBlock(%v) = %v (%#x), x/bs = %v (%#x)", bs, x, got, math.Float64bits(got), want, math.Float64bits(want))
			}
		}
	}
}
