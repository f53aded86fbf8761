package tokenize

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
)

// TestQwen2Exact checks ids known from the Qwen2 reference tokenizer.
func TestQwen2Exact(t *testing.T) {
	h := loadQwen2(t)
	tests := []struct {
		text string
		want []uint32
	}{
		{"Hello, world! 你好", []uint32{9707, 11, 1879, 0, 220, 108386}},
		{"<|im_start|>hello<|im_end|>", []uint32{151644, 14990, 151645}},
	}
	for _, tt := range tests {
		if got := h.Encode(tt.text); !slices.Equal(got, tt.want) {
			t.Errorf("Encode(%q) = %v, want %v", tt.text, got, tt.want)
		}
		if got := h.Decode(tt.want); got != tt.text {
			t.Errorf("Decode(%v) = %q, want %q", tt.want, got, tt.text)
		}
	}
}

// TestQwen2Tokens states expectations as vocab spellings. Each follows from
// the pre-tokenizer (BPE never merges across pieces) plus the fact that
// the whole piece is a vocab entry, or the piece is a single byte.
func TestQwen2Tokens(t *testing.T) {
	h := loadQwen2(t)
	tests := []struct {
		text string
		want []string
	}{
		{"12345", []string{"1", "2", "3", "4", "5"}},                              // \p{N}: one digit per piece
		{" 2024", []string{"Ġ", "2", "0", "2", "4"}},                              // lone space before a digit
		{"hello world", []string{"hello", "Ġworld"}},                              // space joins the next word
		{"don't", []string{"don", "'t"}},                                          // contraction piece
		{"I'M", []string{"I", "'M"}},                                              // case-insensitive contraction
		{"a   b", []string{"a", "ĠĠ", "Ġb"}},                                      // run minus its last space
		{"\n\n", []string{"ĊĊ"}},                                                  // \s*[\r\n]+
		{"x\n", []string{"x", "Ċ"}},                                               // newline never joins a word
		{"<|im_end|>\n<|im_start|>", []string{"<|im_end|>", "Ċ", "<|im_start|>"}}, // specials split first
		{"<|endoftext|>", []string{"<|endoftext|>"}},
	}
	for _, tt := range tests {
		want := make([]uint32, len(tt.want))
		for i, tok := range tt.want {
			id, ok := h.TokenID(tok)
			if !ok {
				t.Fatalf("%q not in vocab", tok)
			}
			want[i] = id
		}
		if got := h.Encode(tt.text); !slices.Equal(got, want) {
			t.Errorf("Encode(%q) = %v %q, want %v %q", tt.text, got, tokens(h, got), want, tt.want)
		}
	}
}

// TestQwen2Equivalent checks inputs that must encode identically.
func TestQwen2Equivalent(t *testing.T) {
	h := loadQwen2(t)
	tests := []struct{ name, a, b string }{
		{"NFC composes e + combining acute", "caf\u0065\u0301", "caf\u00e9"},
		{"NFC maps OHM SIGN to OMEGA", "\u2126", "\u03a9"},
		{"NFC composes Hangul jamo", "\u1100\u1161", "\uac00"},
		{"invalid byte reads as U+FFFD", "a\xffb", "a\ufffdb"},
		{"each invalid byte is one U+FFFD", "\xe4\xbd", "\ufffd\ufffd"},
	}
	for _, tt := range tests {
		if a, b := h.Encode(tt.a), h.Encode(tt.b); !slices.Equal(a, b) {
			t.Errorf("%s: Encode(%q) = %v, Encode(%q) = %v", tt.name, tt.a, a, tt.b, b)
		}
	}
	if ids := h.Encode(""); len(ids) != 0 {
		t.Errorf("Encode(\"\") = %v", ids)
	}
	// A partial special token is plain text.
	if ids := h.Encode("<|im_start"); slices.Contains(ids, 151644) {
		t.Errorf("partial special token matched: %v", ids)
	}
}

func TestQwen2Golden(t *testing.T) {
	h := loadQwen2(t)
	for _, c := range readGolden(t) {
		if got := h.Encode(c.Text); !slices.Equal(got, c.IDs) && !(len(got) == 0 && len(c.IDs) == 0) {
			t.Errorf("Encode(%q)\n got %v\nwant %v", c.Text, got, c.IDs)
		}
	}
}

// roundTripTexts are NFC-normalised UTF-8, so decode(encode(s)) must be s.
var roundTripTexts = []string{
	"", " ", "  ", "\n", "\r\n", "\t", "a", "Hello, world!", "don't stop 'til you've had y'all's",
	"1234567890", "3.14159e-10", "0x1F ½ ² ٣٤٥ Ⅻ",
	"line one\nline two\n\n\nline three\r\n",
	"    indented\n\tcode\n", "trailing spaces   ", "   leading", "a\u3000b\u00a0c\u2009d",
	"你好，世界！", "こんにちは世界", "한국어 텍스트", "Привет, мир", "مرحبا بالعالم", "שלום", "हिन्दी", "ไทย",
	"emoji 😀 👍🏽 👨‍👩‍👧 🇺🇸 ❤️", "𠀀𪚥", "\u200b\u200d\ufeff", "\x00\x01\x1f\x7f",
	"func main() {\n\tfmt.Println(\"hi\")\n}\n", `{"key": [1, 2, {"x": null}]}`,
	"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
	"<|im_start<|im_end|>|>", "<|endoftext|><|endoftext|>", "<||>", "\ufffd",
	strings.Repeat("ab ", 1000), strings.Repeat("x", 5000),
}

func TestQwen2RoundTrip(t *testing.T) {
	h := loadQwen2(t)
	for _, s := range roundTripTexts {
		if got := h.Decode(h.Encode(s)); got != s {
			t.Errorf("round trip of %q gave %q", s, got)
		}
	}
}

// TestQwen2DecodePartial: a character split over several ids decodes to one
// U+FFFD per maximal ill-formed subpart (HF uses from_utf8_lossy), and to
// the character once all its ids are there.
func TestQwen2DecodePartial(t *testing.T) {
	h := loadQwen2(t)
	for _, ch := range []string{"𪚥", "𠀀", "😀", "\U0001f9ec", "\U000e0100"} {
		ids := h.Encode(ch)
		if len(ids) < 2 {
			continue
		}
		if got := h.Decode(ids[:1]); got != "\ufffd" {
			t.Errorf("Decode(first id of %q) = %q, want one U+FFFD", ch, got)
		}
		if got := h.Decode(ids); got != ch {
			t.Errorf("Decode(%v) = %q, want %q", ids, got, ch)
		}
		return
	}
	t.Fatal("no test character needed more than one id")
}

func TestQwen2DecodeUnknownIDs(t *testing.T) {
	h := loadQwen2(t)
	if got := h.Decode([]uint32{14990, 1 << 30, uint32(h.VocabSize()), 1879}); got != "hello world" {
		t.Errorf("got %q", got)
	}
}

// TestQwen2Concurrent runs encodes in parallel on a tokenizer with a tiny
// cache (constant resets) and checks them against serial results; run
// with -race.
func TestQwen2Concurrent(t *testing.T) {
	shared := loadQwen2(t)
	h := *shared
	h.cache = newWordCache(32)
	texts := append([]string(nil), roundTripTexts...)
	for i := 0; i < 50; i++ {
		texts = append(texts, fmt.Sprintf("request %d: the quick brown fox #%d jumps", i, i*7))
	}
	want := make([][]uint32, len(texts))
	for i, s := range texts {
		want[i] = shared.Encode(s)
	}
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for r := 0; r < 5; r++ {
				for i := range texts {
					k := (i + g*7) % len(texts)
					if got := h.Encode(texts[k]); !slices.Equal(got, want[k]) {
						t.Errorf("goroutine %d: Encode(%q) = %v, want %v", g, texts[k], got, want[k])
						return
					}
				}
			}
		}(g)
	}
	wg.Wait()
}

func TestChatMLQwen2(t *testing.T) {
	h := loadQwen2(t)
	prompt, err := RenderChat([]Message{{Role: "user", Content: "hello"}}, ChatML, true)
	if err != nil {
		t.Fatal(err)
	}
	id := func(tok string) uint32 {
		v, ok := h.TokenID(tok)
		if !ok {
			t.Fatalf("%q not in vocab", tok)
		}
		return v
	}
	want := []uint32{151644, id("user"), id("Ċ"), id("hello"), 151645, id("Ċ"), 151644, id("assistant"), id("Ċ")}
	if got := h.Encode(prompt); !slices.Equal(got, want) {
		t.Errorf("Encode(%q) = %v, want %v", prompt, got, want)
	}
}
