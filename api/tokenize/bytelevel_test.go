package tokenize

import (
	"testing"
	"unicode"
)

func TestByteTables(t *testing.T) {
	seen := map[rune]bool{}
	for b := 0; b < 256; b++ {
		r := byteRunes[b]
		if seen[r] {
			t.Fatalf("rune %U used twice", r)
		}
		seen[r] = true
		if !unicode.IsPrint(r) || r == ' ' {
			t.Errorf("byte %#x maps to non-printable %U", b, r)
		}
		if int(runeBytes[r]) != b {
			t.Errorf("inverse of %U = %d, want %d", r, runeBytes[r], b)
		}
	}
	// Well-known spellings from GPT-2 vocabularies.
	for b, want := range map[byte]rune{' ': 'Ġ', '\n': 'Ċ', '\t': 'ĉ', 'a': 'a', 0x00: 'Ā', 0xAD: 'Ń', 0xFF: 'ÿ'} {
		if got := byteRunes[b]; got != want {
			t.Errorf("byte %#x -> %q, want %q", b, got, want)
		}
	}
	if b, ok := vocabBytes("Ġworld"); !ok || string(b) != " world" {
		t.Errorf("vocabBytes(Ġworld) = %q, %v", b, ok)
	}
	if _, ok := vocabBytes("a b"); ok {
		t.Error("vocabBytes accepted a raw space")
	}
	if got := vocabString([]byte(" world\n")); got != "ĠworldĊ" {
		t.Errorf("vocabString = %q", got)
	}
}

// TestLossyUTF8 pins Rust's from_utf8_lossy behaviour (Unicode "maximal
// subpart" substitution).
func TestLossyUTF8(t *testing.T) {
	tests := []struct{ in, want string }{
		{"plain", "plain"},
		{"\xe4\xbd", "\ufffd"},     // truncated 3-byte sequence: one
		{"\xe4\xbd\xa0", "你"},      // complete
		{"\xf0\x9f\x98", "\ufffd"}, // truncated 4-byte sequence: one
		{"a\xf0\x9f\x98b", "a\ufffdb"},
		{"\xff\xfe", "\ufffd\ufffd"},                     // never-valid bytes: one each
		{"\x80\x80", "\ufffd\ufffd"},                     // stray continuations: one each
		{"\xed\xa0\x80", "\ufffd\ufffd\ufffd"},           // surrogate: ED A0 is ill-formed
		{"\xe0\x80\x80", "\ufffd\ufffd\ufffd"},           // overlong
		{"\xf4\x90\x80\x80", "\ufffd\ufffd\ufffd\ufffd"}, // > U+10FFFF
		{"\xc3", "\ufffd"},
		{"\xe4\xbdx", "\ufffdx"},
	}
	for _, tt := range tests {
		if got := lossyUTF8([]byte(tt.in)); got != tt.want {
			t.Errorf("lossyUTF8(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestSanitizeUTF8(t *testing.T) {
	for in, want := range map[string]string{"ok": "ok", "a\xffb": "a\ufffdb", "\xe4\xbd": "\ufffd\ufffd", "\ufffd": "\ufffd"} {
		if got := sanitizeUTF8(in); got != want {
			t.Errorf("sanitizeUTF8(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestWordCache(t *testing.T) {
	c := newWordCache(2)
	c.put("aa", []uint32{1})
	c.put("bb", []uint32{2})
	if ids, ok := c.get("aa"); !ok || ids[0] != 1 {
		t.Fatal("miss after put")
	}
	c.put("cc", []uint32{3}) // full: starts over
	if _, ok := c.get("aa"); ok {
		t.Error("cache did not reset when full")
	}
	if _, ok := c.get("cc"); !ok {
		t.Error("entry lost after reset")
	}
	long := string(make([]byte, cacheMaxWord+1))
	c.put(long, []uint32{4})
	if _, ok := c.get(long); ok {
		t.Error("over-long word cached")
	}
}
