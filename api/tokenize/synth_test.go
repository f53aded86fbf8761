package tokenize

import (
	"encoding/json"
	"strings"
	"testing"
)

// synth builds a small tokenizer.json as a generic map so tests can break
// any part of it. Its vocab is the 256 byte-level symbols (id = byte value)
// followed by the result of each merge, in order; merges are "a b" strings
// in byte-level spelling.
func synth(merges ...string) map[string]any {
	vocab := map[string]any{}
	for b := 0; b < 256; b++ {
		vocab[string(byteRunes[b])] = b
	}
	ms := make([]any, len(merges))
	for i, m := range merges {
		ms[i] = m
		tok := strings.Replace(m, " ", "", 1)
		if _, ok := vocab[tok]; !ok {
			vocab[tok] = len(vocab)
		}
	}
	return map[string]any{
		"version":      "1.0",
		"added_tokens": []any{},
		"normalizer":   nil,
		"pre_tokenizer": map[string]any{"type": "Sequence", "pretokenizers": []any{
			map[string]any{"type": "Split", "pattern": map[string]any{"Regex": patternQwen2}, "behavior": "Isolated", "invert": false},
			map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
		}},
		"post_processor": nil,
		"decoder":        map[string]any{"type": "ByteLevel"},
		"model": map[string]any{
			"type": "BPE", "dropout": nil, "unk_token": nil, "continuing_subword_prefix": "",
			"end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
			"vocab": vocab, "merges": ms,
		},
	}
}

func model(m map[string]any) map[string]any { return m["model"].(map[string]any) }

func mustJSON(t testing.TB, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func mustParse(t testing.TB, m map[string]any) *HF {
	t.Helper()
	h, err := parseHF(mustJSON(t, m), "synth")
	if err != nil {
		t.Fatalf("parseHF: %v", err)
	}
	return h
}

// tokens spells ids in byte-level form, for readable failures.
func tokens(h *HF, ids []uint32) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		if h.has(id) {
			out[i] = h.tokens[id]
		}
	}
	return out
}

// vocabString is the inverse of vocabBytes: raw bytes to vocab spelling.
func vocabString(b []byte) string {
	out := make([]rune, len(b))
	for i, c := range b {
		out[i] = byteRunes[c]
	}
	return string(out)
}
