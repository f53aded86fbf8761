package tokenize

import (
	"strings"
	"testing"

	"golang.org/x/text/unicode/norm"
)

// expectedDecode is what Decode(Encode(s)) must return: s with invalid
// bytes replaced by U+FFFD and each stretch between added tokens put in NFC.
// (Not NFC of the whole string: HF splits added tokens off before
// normalising, so "<|im_end|>\u0338" keeps its '>' instead of composing
// it to '≯'.)
func expectedDecode(h *HF, s string) string {
	var b strings.Builder
	for _, seg := range h.added.split(nil, sanitizeUTF8(s)) {
		if seg.added {
			b.WriteString(seg.text)
		} else {
			b.WriteString(norm.NFC.String(seg.text))
		}
	}
	return b.String()
}

// FuzzEncode: Encode never panics, ids are in range, and decoding gives the
// text back (for NFC-normalised valid UTF-8, exactly s).
func FuzzEncode(f *testing.F) {
	h := loadQwen2(f)
	for _, s := range roundTripTexts {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		ids := h.Encode(s)
		for _, id := range ids {
			if int(id) >= h.VocabSize() {
				t.Fatalf("id %d out of range", id)
			}
		}
		if got, want := h.Decode(ids), expectedDecode(h, s); got != want {
			t.Fatalf("Decode(Encode(%q)) = %q, want %q", s, got, want)
		}
	})
}

func TestSpecialBeforeNormalization(t *testing.T) {
	h := loadQwen2(t)
	// '>' + U+0338 composes to U+226F under NFC; the special token must be
	// cut out first, leaving the combining mark on its own.
	ids := h.Encode("<|im_end|>\u0338")
	if len(ids) < 2 || ids[0] != 151645 {
		t.Fatalf("Encode = %v, want <|im_end|> first", ids)
	}
	if got := h.Decode(ids); got != "<|im_end|>\u0338" {
		t.Errorf("Decode = %q", got)
	}
}
