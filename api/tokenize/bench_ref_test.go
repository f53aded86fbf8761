package tokenize

import (
	"testing"
	"time"
)

// BenchmarkVsHF times Encode against HF tokenizers (Rust, one thread,
// encodeBatch from node) on the same texts in the same run, per family,
// and reports both throughputs and their ratio (ours/HF; above 1 is
// faster than HF). The texts are the differential test's random strings;
// each side's word cache is warm from a first pass, and the best of three
// passes counts.
//
//	go test -run '^$' -bench VsHF -benchtime 1x ./api/tokenize/
func BenchmarkVsHF(b *testing.B) {
	requireReference(b)
	texts := genTexts(2, 10_000)
	textsPath := writeTexts(b, texts)
	for _, fam := range refFamilies(b) {
		b.Run(fam.name, func(b *testing.B) {
			h, err := LoadHF(fam.path)
			if err != nil {
				b.Fatal(err)
			}
			var ref struct {
				Seconds float64 `json:"seconds"`
				Tokens  int     `json:"tokens"`
			}
			if err := runReference(fam.path, textsPath, &ref, "bench", "3"); err != nil {
				b.Fatal(err)
			}
			tokens := 0
			for _, s := range texts {
				tokens += len(h.Encode(s))
			}
			if tokens != ref.Tokens {
				// Characters assigned after Unicode 15.0 (see DESIGN.md).
				b.Logf("ours %d tokens, HF %d", tokens, ref.Tokens)
			}
			b.ResetTimer()
			var best time.Duration
			for b.Loop() {
				for range 3 {
					t0 := time.Now()
					for _, s := range texts {
						h.Encode(s)
					}
					if d := time.Since(t0); best == 0 || d < best {
						best = d
					}
				}
			}
			ours := float64(tokens) / best.Seconds()
			hf := float64(ref.Tokens) / ref.Seconds
			b.ReportMetric(ours, "tok/s")
			b.ReportMetric(hf, "hf-tok/s")
			b.ReportMetric(ours/hf, "x-hf")
		})
	}
}
