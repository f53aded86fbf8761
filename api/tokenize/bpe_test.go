package tokenize

import (
	"slices"
	"strings"
	"testing"
)

func TestBPEMergeOrder(t *testing.T) {
	tests := []struct {
		name   string
		merges []string
		in     string
		want   []string
	}{
		{"no merges: bytes", nil, "abc", []string{"a", "b", "c"}},
		{"chained merges", []string{"a b", "ab c"}, "abc", []string{"abc"}},
		{"lower rank wins over position", []string{"b c", "a b"}, "abc", []string{"a", "bc"}},
		{"equal rank: leftmost first", []string{"a a"}, "aaa", []string{"aa", "a"}},
		{"all occurrences merge", []string{"a a", "aa aa"}, "aaaaa", []string{"aaaa", "a"}},
		{"merge needs adjacency after earlier merges", []string{"b c", "a b", "a bc"}, "abc", []string{"abc"}},
		{"space is Ġ in merges", []string{"Ġ a"}, "x a", []string{"x", "Ġa"}},
		{"multi-byte UTF-8", []string{"ä ½", "å ¥", "å¥ ½"}, "好", []string{"å¥½"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := mustParse(t, synth(tt.merges...))
			if got := tokens(h, h.Encode(tt.in)); !slices.Equal(got, tt.want) {
				t.Errorf("Encode(%q) = %q, want %q", tt.in, got, tt.want)
			}
		})
	}
}

// TestBPELongWord guards the heap: a 200 kB single word must not be
// quadratic, and must agree with the obvious result.
func TestBPELongWord(t *testing.T) {
	h := mustParse(t, synth("a a", "aa aa", "aaaa aaaa"))
	ids := h.Encode(strings.Repeat("a", 200_000))
	if len(ids) != 25_000 {
		t.Fatalf("got %d ids, want 25000", len(ids))
	}
	if h.Decode(ids) != strings.Repeat("a", 200_000) {
		t.Fatal("round trip failed")
	}
}

func TestBPEIgnoreMerges(t *testing.T) {
	m := synth("a b")
	// "abc" in the vocab without a merge path: reachable only through
	// ignore_merges (Llama-3 behaviour).
	model(m)["vocab"].(map[string]any)["abc"] = 999
	h := mustParse(t, m)
	if got := tokens(h, h.Encode("abc")); !slices.Equal(got, []string{"ab", "c"}) {
		t.Errorf("without ignore_merges: %q", got)
	}
	model(m)["ignore_merges"] = true
	h = mustParse(t, m)
	if got := h.Encode("abc"); !slices.Equal(got, []uint32{999}) {
		t.Errorf("with ignore_merges: %v", got)
	}
}

func TestBPEMissingByteDropped(t *testing.T) {
	m := synth()
	delete(model(m)["vocab"].(map[string]any), "b")
	h := mustParse(t, m)
	if got := tokens(h, h.Encode("abc")); !slices.Equal(got, []string{"a", "c"}) {
		t.Errorf("got %q, want [a c] (HF drops bytes missing from a vocab without unk)", got)
	}
}

func TestMergesPairFormat(t *testing.T) {
	m := synth()
	model(m)["vocab"].(map[string]any)["ab"] = 300
	model(m)["merges"] = []any{[]any{"a", "b"}}
	h := mustParse(t, m)
	if got := h.Encode("ab"); !slices.Equal(got, []uint32{300}) {
		t.Errorf("got %v", got)
	}
}

func TestGPT2PrefixSpace(t *testing.T) {
	m := synth("Ġ a")
	m["pre_tokenizer"] = map[string]any{"type": "ByteLevel", "add_prefix_space": true, "use_regex": true}
	h := mustParse(t, m)
	if got := tokens(h, h.Encode("a a")); !slices.Equal(got, []string{"Ġa", "Ġa"}) {
		t.Errorf("got %q", got)
	}
	if got := h.Decode(h.Encode("a")); got != " a" {
		t.Errorf("decode = %q, want the prefix space kept (HF does not strip it)", got)
	}
}

func TestAddedTokenOptions(t *testing.T) {
	tok := func(id int, content string, opts ...string) map[string]any {
		m := map[string]any{"id": id, "content": content, "special": true, "normalized": false}
		for _, o := range opts {
			m[o] = true
		}
		return m
	}
	tests := []struct {
		name  string
		added []any
		in    string
		want  []string
	}{
		{"split out", []any{tok(500, "<x>")}, "a<x>b", []string{"a", "<x>", "b"}},
		{"longest wins", []any{tok(500, "<x>"), tok(501, "<x>>")}, "<x>>", []string{"<x>>"}},
		{"leftmost wins", []any{tok(500, "ab"), tok(501, "bcd")}, "abcd", []string{"ab", "c", "d"}},
		{"lstrip eats spaces", []any{tok(500, "<x>", "lstrip")}, "a  <x>b", []string{"a", "<x>", "b"}},
		{"rstrip eats spaces", []any{tok(500, "<x>", "rstrip")}, "a <x>  b", []string{"a", "Ġ", "<x>", "b"}},
		{"single_word at boundary", []any{tok(500, "ab", "single_word")}, "x ab y", []string{"x", "Ġ", "ab", "Ġ", "y"}},
		{"single_word inside word", []any{tok(500, "ab", "single_word")}, "xab", []string{"x", "a", "b"}},
		{"normalized token matches NFC text", []any{tok(500, "é", "normalized")}, "e\u0301", []string{"é"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := synth()
			m["normalizer"] = map[string]any{"type": "NFC"}
			m["added_tokens"] = tt.added
			h := mustParse(t, m)
			var got []string
			for _, id := range h.Encode(tt.in) {
				if id >= 500 {
					got = append(got, addedContent(tt.added, id))
				} else {
					got = append(got, tokens(h, []uint32{id})[0])
				}
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("Encode(%q) = %q, want %q", tt.in, got, tt.want)
			}
		})
	}
}

func addedContent(added []any, id uint32) string {
	for _, a := range added {
		m := a.(map[string]any)
		if m["id"].(int) == int(id) {
			return m["content"].(string)
		}
	}
	return "?"
}

// TestAddedTokenDecode pins HF's ByteLevel decoder behaviour on added
// tokens: content made only of byte-level runes is mapped back to bytes.
func TestAddedTokenDecode(t *testing.T) {
	m := synth()
	m["added_tokens"] = []any{
		map[string]any{"id": 500, "content": "<|x|>", "special": true},
		map[string]any{"id": 501, "content": "é", "special": true},   // U+00E9 = byte-level rune of 0xE9
		map[string]any{"id": 502, "content": "a b", "special": true}, // ' ' is not a byte-level rune
		map[string]any{"id": 503, "content": "ĠĠ", "special": true},  // Ġ is the rune of ' '
	}
	h := mustParse(t, m)
	tests := []struct {
		id   uint32
		want string
	}{{500, "<|x|>"}, {501, "\uFFFD"}, {502, "a b"}, {503, "  "}}
	for _, tt := range tests {
		if got := h.Decode([]uint32{tt.id}); got != tt.want {
			t.Errorf("Decode(%d) = %q, want %q", tt.id, got, tt.want)
		}
	}
	// Encoding still maps each content to its id.
	if got := h.Encode("é<|x|>a bĠĠ"); !slices.Equal(got, []uint32{501, 500, 502, 503}) {
		t.Errorf("Encode = %v", got)
	}
}
