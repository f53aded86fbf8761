package tokenize

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
)

// benchText builds a deterministic prompt of about n Qwen2 tokens that mixes
// what a router sees: ChatML markup, English prose, code, numbers and CJK.
func benchText(h *HF, n int) string {
	rng := rand.New(rand.NewPCG(42, 42))
	words := strings.Fields(`the of and to in is that for it with as was on be by this are from or
		at an not have which but they their you we will can has one all been would there more
		request cache router token block prefix worker latency throughput model server queue
		kvrouter's don't it's we'll they're configuration deployment kubernetes inference`)
	code := []string{"func (s *Server) Handle(w http.ResponseWriter, r *http.Request) {\n",
		"\tif err != nil {\n\t\treturn fmt.Errorf(\"decode: %w\", err)\n\t}\n", "}\n\n"}
	cjk := []string{"你好，世界。", "路由器缓存命中率", "トークン化", "모델 서버"}
	var b strings.Builder
	b.WriteString("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
	for len(h.Encode(b.String())) < n {
		switch r := rng.IntN(20); {
		case r < 14:
			b.WriteString(words[rng.IntN(len(words))])
			b.WriteByte(" .,!\n "[rng.IntN(6)])
		case r < 16:
			b.WriteString(code[rng.IntN(len(code))])
		case r < 18:
			fmt.Fprintf(&b, "%d.%02d ", rng.IntN(100000), rng.IntN(100))
		default:
			b.WriteString(cjk[rng.IntN(len(cjk))])
		}
	}
	b.WriteString("<|im_end|>\n<|im_start|>assistant\n")
	return b.String()
}

// BenchmarkEncodeQwen2 encodes a ~2,000-token prompt. "warm" is the steady
// state of a router (word cache filled by earlier requests); "cold" starts
// each iteration with an empty cache.
func BenchmarkEncodeQwen2(b *testing.B) {
	shared := loadQwen2(b)
	text := benchText(shared, 2000)
	ntok := len(shared.Encode(text))
	for _, mode := range []string{"warm", "cold"} {
		b.Run(mode, func(b *testing.B) {
			h := *shared
			h.cache = newWordCache(cacheEntries)
			h.Encode(text)
			b.SetBytes(int64(len(text)))
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if mode == "cold" {
					h.cache = newWordCache(cacheEntries)
				}
				h.Encode(text)
			}
			b.ReportMetric(float64(ntok), "tokens/op")
		})
	}
}

func BenchmarkDecodeQwen2(b *testing.B) {
	h := loadQwen2(b)
	ids := h.Encode(benchText(h, 2000))
	b.ReportAllocs()
	for b.Loop() {
		h.Decode(ids)
	}
}

func BenchmarkEncodeBuiltin(b *testing.B) {
	tok := Builtin()
	text := benchText(loadQwen2(b), 2000)
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	for b.Loop() {
		tok.Encode(text)
	}
}

// BenchmarkEncodeBuiltinWords encodes kvbench load's default prompt: 2,371
// builtin words (canonical spellings, one token each) as one text.
func BenchmarkEncodeBuiltinWords(b *testing.B) {
	tok := Builtin()
	rng := rand.New(rand.NewPCG(31, 4))
	ids := make([]uint32, 2371)
	for i := range ids {
		ids[i] = builtinWordBase + uint32(rng.IntN(builtinWordCount))
	}
	text := tok.Decode(ids)
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	for b.Loop() {
		tok.Encode(text)
	}
}
