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
//	prefill ms = PrefillQuad·N² + PrefillLin·N + PrefillConst   (N new tokens in the step)
//	decode  ms = max(DecodeMin, DecodeQuad·p² + DecodeLin·p + DecodeConst)   (p = KV fill fraction)
//
// A step is one forward pass over a batch (see StepMs for how prefill chunks
// and decode tokens in one batch combine).
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
		// Dynamo's mocker (DESIGN.md §6).
		Name:         ProfileDynamoMocker,
		PrefillQuad:  4.21e-7,
		PrefillLin:   0.01518,
		PrefillConst: 16.5,
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

// PrefillMs is the prefill time of n new tokens.
func (p Profile) PrefillMs(n int) float64 {
	x := float64(n)
	return p.PrefillQuad*x*x + p.PrefillLin*x + p.PrefillConst
}

// DecodeMs is the time of one decode step at KV fill fraction fill (0..1).
func (p Profile) DecodeMs(fill float64) float64 {
	return math.Max(p.DecodeMin, p.DecodeQuad*fill*fill+p.DecodeLin*fill+p.DecodeConst)
}

// StepMs is the time of one engine step that runs prefillTokens prompt
// tokens (chunks of one or more prompts) and decodeSeqs decode tokens (one per
// decoding sequence) at KV fill fraction fill:
//
//   - decode only: DecodeMs(fill);
//   - prefill only: PrefillMs(prefillTokens);
//   - mixed: max(PrefillMs(prefillTokens+decodeSeqs), DecodeMs(fill)) — vLLM
//     runs the whole batch as one forward pass, so the decode tokens are just
//     more new tokens, and a mixed step never costs less than a decode step.
//
// An empty step costs 0.
func (p Profile) StepMs(prefillTokens, decodeSeqs int, fill float64) float64 {
	switch {
	case prefillTokens == 0 && decodeSeqs == 0:
		return 0
	case prefillTokens == 0:
		return p.DecodeMs(fill)
	case decodeSeqs == 0:
		return p.PrefillMs(prefillTokens)
	}
	return math.Max(p.PrefillMs(prefillTokens+decodeSeqs), p.DecodeMs(fill))
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
