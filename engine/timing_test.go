package engine

import (
	"fmt"
	"testing"
	"time"
)

// TestEngineTimingDynamo runs the engine through steps whose times were
// worked out by hand from Dynamo's mocker (lib/mocker/src/scheduler/vllm/core.rs
// and lib/mocker/src/common/perf_model.rs; engine/DESIGN.md, "Timing"), not
// from this package's code:
//
//	step ms   = prefill(T) + decode(p), each only when the step has one
//	T         = n · (⌊ΣISL/n⌋ − ⌊Σprefix/n⌋) over the n requests computing prompt tokens
//	prefill(T) = 4.209989e-07·T² + 1.518344e-02·T + 16.50142
//	decode(p)  = max(1, −25.74·p² + 54.01·p + 5.74), p = KV blocks in use ÷ capacity,
//	             charged when any sequence samples a token in the step
//
// Every case picks a capacity that makes p a round number where it can.
// The arithmetic is written next to each expected value; a helper sums the
// step times in milliseconds.
func TestEngineTimingDynamo(t *testing.T) {
	const bs = 16
	const (
		// decode(0.5) = −25.74·0.25 + 54.01·0.5 + 5.74 = −6.435 + 27.005 + 5.74
		decodeHalf = 26.31
		// prefill(1024) = 4.209989e-07·1,048,576 + 1.518344e-02·1,024 + 16.50142
		//               = 0.4414493425664 + 15.54784256 + 16.50142
		prefill1024 = 32.4907119025664
		// prefill(323) = 4.209989e-07·104,329 + 1.518344e-02·323 + 16.50142
		//              = 0.0439223942381 + 4.90425112 + 16.50142
		prefill323 = 21.4495935142381
		// prefill(2000) = 4.209989e-07·4,000,000 + 1.518344e-02·2,000 + 16.50142
		//               = 1.6839956 + 30.36688 + 16.50142
		prefill2000 = 48.5522956
		// decode(125/550): p² = 0.0516528925619835
		//   = −25.74·0.0516528925619835 + 54.01·0.2272727272727273 + 5.74
		//   = −1.3295454545454545 + 12.275 + 5.74
		decode125of550 = 16.6854545454545455
		// prefill(2371) = 4.209989e-07·5,621,641 + 1.518344e-02·2,371 + 16.50142
		//               = 2.3667046771949 + 35.99993624 + 16.50142
		prefill2371 = 54.8680609171949
		// prefill(1600) = 4.209989e-07·2,560,000 + 1.518344e-02·1,600 + 16.50142
		//               = 1.077757184 + 24.293504 + 16.50142
		prefill1600 = 41.872681184
		// decode(100/248): p = 0.4032258064516129, p² = 0.1625910509885536
		//   = −4.1850936524453694 + 21.7782258064516129 + 5.74
		decode100of248 = 23.3331321540062435
		// prefill(371) = 4.209989e-07·137,641 + 1.518344e-02·371 + 16.50142
		//              = 0.0579467095949 + 5.63305624 + 16.50142
		prefill371 = 22.1924229495949
		// prefill(200) = 4.209989e-07·40,000 + 1.518344e-02·200 + 16.50142
		//              = 0.016839956 + 3.036688 + 16.50142
		prefill200 = 19.554947956
	)
	type want struct {
		id   string
		kind OutputKind
		ms   float64 // virtual time of the output, ms from 0
	}
	tests := []struct {
		name  string
		cfg   Config
		setup func(t *testing.T, e *Engine) []Output
		want  []want
	}{
		{
			// A 2,371-token prompt alone with a 1,024-token budget: two
			// chunks that sample nothing (pure prefill: no decode time),
			// then the last 323 tokens, which sample the first token. The
			// prompt holds ⌈2,371/16⌉ = 149 blocks of 298: p = 0.5. Each
			// chunk counts only its own tokens: ISL 1,024 − prefix 0, then
			// 2,048 − 1,024, then 2,371 − 2,048 = 323.
			name: "pure prefill chunks, then the chunk that samples",
			cfg:  Config{BlockSize: bs, CapacityBlocks: 298, MaxBatchedTokens: 1024},
			setup: func(t *testing.T, e *Engine) []Output {
				mustSubmit(t, e, 0, Request{ID: "a", Tokens: seqTokens(1, 2371), OutputTokens: 2})
				return runIdle(t, e)
			},
			want: []want{
				// 32.4907119025664 + 32.4907119025664 + 21.4495935142381 + 26.31
				{"a", FirstToken, 2*prefill1024 + prefill323 + decodeHalf}, // 112.7410173193709
				// pure decode: token 2,372 needs ⌈2,372/16⌉ = 149 blocks, p = 0.5
				{"a", Finished, 2*prefill1024 + prefill323 + 2*decodeHalf}, // 139.0510173193709
			},
		},
		{
			// The case: a 2,371-token prefill in a step where
			// another request decodes at half fill. "d" (2,000 tokens) runs
			// alone first: prefill(2,000) + decode(125/550). Then "m"
			// arrives; the mixed step holds d's 126 blocks (token 2,001)
			// and m's 149: 275 of 550, p = 0.5. Dynamo adds the two
			// parts: 54.87 + 26.31 = 81.18 ms (the max(prefill(2,372),
			// decode) this engine used before gave 54.89).
			name: "mixed step: 2,371-token prefill at half fill",
			cfg:  Config{BlockSize: bs, CapacityBlocks: 550},
			setup: func(t *testing.T, e *Engine) []Output {
				mustSubmit(t, e, 0, Request{ID: "d", Tokens: seqTokens(100_000, 2000), OutputTokens: 3})
				outs := advanceOnce(t, e)
				mustSubmit(t, e, e.Stats().Now, Request{ID: "m", Tokens: seqTokens(200_000, 2371), OutputTokens: 2})
				return append(outs, runIdle(t, e)...)
			},
			want: []want{
				{"d", FirstToken, prefill2000 + decode125of550}, // 65.2377501454545455
				// + 54.8680609171949 + 26.31 = 146.4158110626494455
				{"m", FirstToken, prefill2000 + decode125of550 + prefill2371 + decodeHalf},
				// pure decode, both sampling: d token 2,002 → 126 blocks, m token 2,372 → 149; p = 0.5
				// 146.4158110626494455 + 26.31 = 172.7258110626494455
				{"d", Finished, prefill2000 + decode125of550 + prefill2371 + 2*decodeHalf},
				{"m", Finished, prefill2000 + decode125of550 + prefill2371 + 2*decodeHalf},
			},
		},
		{
			// "x" (1,600 tokens = 100 whole blocks) runs and frees its
			// blocks, which stay cached. "y" = the same 1,600 tokens + 371
			// more hits 100 blocks; its chunk has prefix 1,600 and ISL
			// 1,971, so Dynamo prices 1,971 − 1,600 = 371 tokens. y holds
			// ⌈1,971/16⌉ = 124 blocks of 248: p = 0.5.
			name: "cached-prefix prefill",
			cfg:  Config{BlockSize: bs, CapacityBlocks: 248},
			setup: func(t *testing.T, e *Engine) []Output {
				prefix := seqTokens(300_000, 1600)
				mustSubmit(t, e, 0, Request{ID: "x", Tokens: prefix, OutputTokens: 1})
				outs := advanceOnce(t, e)
				mustSubmit(t, e, e.Stats().Now, Request{ID: "y", Tokens: cat(prefix, seqTokens(400_000, 371)), OutputTokens: 1})
				return append(outs, runIdle(t, e)...)
			},
			want: []want{
				// 41.872681184 + 23.3331321540062435 = 65.2058133380062435
				{"x", Finished, prefill1600 + decode100of248},
				// + 22.1924229495949 + 26.31 = 113.7082362876011435
				{"y", FirstToken, prefill1600 + decode100of248 + prefill371 + decodeHalf},
			},
		},
		{
			// Two prompts of 101 and 100 tokens in one step: Dynamo takes
			// integer means, 2·(⌊201/2⌋ − ⌊0/2⌋) = 200 tokens (not 201), and
			// one prefill for the batch, not one per request. Both sample;
			// 7 + 7 blocks of 28: p = 0.5.
			name: "two prompts: one prefill over the batch, integer means",
			cfg:  Config{BlockSize: bs, CapacityBlocks: 28},
			setup: func(t *testing.T, e *Engine) []Output {
				mustSubmit(t, e, 0, Request{ID: "p", Tokens: seqTokens(500_000, 101), OutputTokens: 1})
				mustSubmit(t, e, 0, Request{ID: "q", Tokens: seqTokens(600_000, 100), OutputTokens: 1})
				return runIdle(t, e)
			},
			want: []want{
				{"p", Finished, prefill200 + decodeHalf}, // 19.554947956 + 26.31 = 45.864947956
				{"q", Finished, prefill200 + decodeHalf},
			},
		},
		{
			// Dynamo divides both parts by speedup_ratio: the first case
			// at speedup 4.
			name: "speedup divides the step",
			cfg:  Config{BlockSize: bs, CapacityBlocks: 298, MaxBatchedTokens: 1024, Speedup: 4},
			setup: func(t *testing.T, e *Engine) []Output {
				mustSubmit(t, e, 0, Request{ID: "a", Tokens: seqTokens(1, 2371), OutputTokens: 1})
				return runIdle(t, e)
			},
			want: []want{
				// 112.7410173193709 / 4
				{"a", Finished, (2*prefill1024 + prefill323 + decodeHalf) / 4}, // 28.185254329842725
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := mustNew(t, "w", tc.cfg)
			outs := tc.setup(t, e)
			for _, w := range tc.want {
				o, ok := find(outs, w.id, w.kind)
				if !ok {
					t.Fatalf("no %v for %s in %+v", w.kind, w.id, outs)
				}
				// Each step is rounded to the nanosecond on its own.
				if d := o.At - time.Duration(w.ms*1e6); d < -3 || d > 3 {
					t.Errorf("%s %v at %v, want %.9f ms", w.id, w.kind, o.At, w.ms)
				}
			}
		})
	}
}

// TestEngineTimingPass checks the formula on its own against the same hand
// arithmetic, including what the engine cannot produce on purpose.
func TestEngineTimingPass(t *testing.T) {
	dyn, err := LookupProfile(ProfileDynamoMocker)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		x    Pass
		want float64
	}{
		{"empty", Pass{Fill: 0.5}, 0},
		{"decode only at p = 0.5", Pass{Sampled: 3, Fill: 0.5}, 26.31},
		// decode(1) = −25.74 + 54.01 + 5.74
		{"decode only at p = 1", Pass{Sampled: 1, Fill: 1}, 34.01},
		{"prefill that samples nothing", Pass{Prefills: 1, ISL: 1024, Fill: 0.9}, 32.4907119025664},
		// prefill(2,371) + decode(0.5) = 54.8680609171949 + 26.31
		{"mixed, 2,371 tokens at half fill", Pass{Prefills: 1, ISL: 2371, Sampled: 2, Fill: 0.5}, 81.1780609171949},
		// chunk 2 of a request with a 1,000-token hit: ISL 2,024, prefix 1,000 → 1,024 tokens
		{"chunk after a prefix hit", Pass{Prefills: 1, ISL: 2024, Prefix: 1000}, 32.4907119025664},
		// 3·(⌊(150+1,100+2,000)/3⌋ − ⌊(100+1,000+1,900)/3⌋) = 3·(1,083 − 1,000) = 249, not 250;
		// prefill(249) = 4.209989e-07·62,001 + 1.518344e-02·249 + 16.50142
		//              = 0.0261023527989 + 3.78067656 + 16.50142
		{"integer means of three chunks", Pass{Prefills: 3, ISL: 3250, Prefix: 3000}, 20.3081989127989},
	}
	for _, tc := range tests {
		if got := dyn.PassMs(tc.x); got-tc.want > 1e-9 || tc.want-got > 1e-9 {
			t.Errorf("%s: %.10f ms, want %.10f", tc.name, got, tc.want)
		}
	}
	if got := (Pass{Prefills: 3, ISL: 3250, Prefix: 3000}).PrefillTokens(); got != 249 {
		t.Errorf("prefill tokens %d, want 249", got)
	}
}

func mustSubmit(t *testing.T, e *Engine, now time.Duration, r Request) {
	t.Helper()
	if err := e.Submit(now, r); err != nil {
		t.Fatal(fmt.Errorf("submit %s at %v: %w", r.ID, now, err))
	}
}

// advanceOnce completes the next step and returns its outputs.
func advanceOnce(t *testing.T, e *Engine) []Output {
	t.Helper()
	next, ok := e.NextEventTime()
	if !ok {
		t.Fatal("engine idle")
	}
	return e.Advance(next)
}
