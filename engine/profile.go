package engine

import (
	"fmt"
	"math"
	"slices"
	"time"
)

// Profile is a step-time model. Times are in milliseconds before the
// engine's speedup divides them.
//
//	prefill ms = PrefillQuad·N² + PrefillLin·N + PrefillConst   (N new prompt tokens in the step; 0 when N = 0)
//	decode  ms = max(DecodeMin, DecodeQuad·p² + DecodeLin·p + DecodeConst)   (p = KV fill fraction)
//
// A step is one forward pass over a batch; PassMs says how its prefill
// chunks and sampled tokens combine (Dynamo's mocker: prefill + decode).
type Profile struct {
	Name                                  string
	PrefillQuad, PrefillLin, PrefillConst float64
	DecodeQuad, DecodeLin, DecodeConst    float64
	DecodeMin                             float64
}

// Profile names.
const (
	ProfileDynamoMocker = "dynamo-mocker"
	ProfileSeed001Small = "seed001-small"
)

var profiles = []Profile{
	{
		// Dynamo's mocker, PerfModel::Polynomial (engine/DESIGN.md,
		// "Timing", cites the file and commit): the coefficients as
		// Dynamo writes them, not rounded.
		Name:         ProfileDynamoMocker,
		PrefillQuad:  4.209989e-07,
		PrefillLin:   1.518344e-02,
		PrefillConst: 1.650142e+01,
		DecodeQuad:   -25.74,
		DecodeLin:    54.01,
		DecodeConst:  5.74,
		DecodeMin:    1,
	},
	{
		// Seed 001: Qwen3-0.6B on an 8 GB-class GPU (two workers sharing
		// it). Fitted to the measured TTFTs: a cold ~1,500-token prompt
		// ≈ 80 ms, 3,000 tokens ≈ 172 ms, a prefix hit (a few dozen new
		// tokens) ≈ 15 ms. The seed gives no per-token decode time; the
		// decode line (7 ms idle, 21 ms with a full cache) is an estimate.
		Name:         ProfileSeed001Small,
		PrefillQuad:  5.8e-6,
		PrefillLin:   0.0353,
		PrefillConst: 14.0,
		DecodeQuad:   0,
		DecodeLin:    14,
		DecodeConst:  7,
		DecodeMin:    1,
	},
}

// Profiles lists the built-in profile names, sorted.
func Profiles() []string {
	names := make([]string, len(profiles))
	for i, p := range profiles {
		names[i] = p.Name
	}
	slices.Sort(names)
	return names
}

// LookupProfile returns the built-in profile called name ("" is
// dynamo-mocker).
func LookupProfile(name string) (Profile, error) {
	if name == "" {
		name = ProfileDynamoMocker
	}
	for _, p := range profiles {
		if p.Name == name {
			return p, nil
		}
	}
	return Profile{}, fmt.Errorf("engine: unknown profile %q (have %v): %w", name, Profiles(), ErrConfig)
}

// PrefillMs is the prefill time of n new tokens; 0 for none, as Dynamo's
// mocker returns for a step whose prompts are wholly cached.
func (p Profile) PrefillMs(n int) float64 {
	if n <= 0 {
		return 0
	}
	x := float64(n)
	return p.PrefillQuad*x*x + p.PrefillLin*x + p.PrefillConst
}

// DecodeMs is the time of one decode step at KV fill fraction fill (0..1).
func (p Profile) DecodeMs(fill float64) float64 {
	return math.Max(p.DecodeMin, p.DecodeQuad*fill*fill+p.DecodeLin*fill+p.DecodeConst)
}

// Pass is one engine step as Dynamo's mocker (lib/mocker, vLLM scheduler
// core) accounts for it. Only requests that compute prompt tokens in the
// step count as prefills; tokens recomputed past the prompt after a
// preemption do not, nor does a prompt whose KV was received (Dynamo's
// decode workers charge no prefill).
type Pass struct {
	Prefills int // requests computing prompt tokens in this step
	// ISL sums, over those requests, the prompt position the step
	// reaches: tokens cached or computed before it plus this chunk.
	ISL int
	// Prefix sums, over those requests, the prompt tokens cached or
	// computed before the step (a prefix hit, earlier chunks).
	Prefix int
	// Sampled counts sequences that sample a token at the end of the
	// step: decoding sequences and prompts whose last chunk is in it.
	Sampled int
	Fill    float64 // KV blocks held by running requests ÷ capacity, after scheduling
}

// PrefillTokens is the token count Dynamo's polynomial is evaluated at:
// Prefills × (⌊ISL/Prefills⌋ − ⌊Prefix/Prefills⌋). The mocker reduces the
// batch to integer means before multiplying back, so this can fall short
// of the chunks' sum by up to Prefills−1 tokens.
func (x Pass) PrefillTokens() int {
	if x.Prefills <= 0 {
		return 0
	}
	return x.Prefills * max(x.ISL/x.Prefills-x.Prefix/x.Prefills, 0)
}

// PassMs is the time of one step: one prefill over the whole batch's new
// prompt tokens plus one decode step when any sequence samples a token.
// Both parts are added, never overlapped: Dynamo's mocker sleeps the
// prefill time, then the decode time, per forward pass.
func (p Profile) PassMs(x Pass) float64 {
	ms := p.PrefillMs(x.PrefillTokens())
	if x.Sampled > 0 {
		ms += p.DecodeMs(x.Fill)
	}
	return ms
}

// StepMs is PassMs for a step whose prompt tokens are one chunk of
// prefillTokens (or chunks whose means do not round) and in which sampled
// sequences sample a token at fill: PrefillMs(prefillTokens) +
// DecodeMs(fill), each only when its count is positive. A caller that
// passes only the decoding sequences as sampled leaves out the decode time
// of a step that finishes a prompt; Dynamo charges it (except on its
// prefill-only workers, where the first token comes with the prefill).
func (p Profile) StepMs(prefillTokens, sampled int, fill float64) float64 {
	x := Pass{Sampled: sampled, Fill: fill}
	if prefillTokens > 0 {
		x.Prefills, x.ISL = 1, prefillTokens
	}
	return p.PassMs(x)
}

// msToDuration converts model milliseconds to virtual time under speedup,
// never less than 1 ns so that time always moves forward.
func msToDuration(ms, speedup float64) time.Duration {
	d := time.Duration(math.Round(ms / speedup * 1e6))
	if d < 1 {
		d = 1
	}
	return d
}
