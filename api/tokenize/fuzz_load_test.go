package tokenize

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/reftest"
)

// loadFuzzTexts are encoded by every tokenizer FuzzLoadHF manages to load:
// plain ASCII, digits (the three splitters treat them differently),
// whitespace runs, non-ASCII that NFC changes, invalid UTF-8, and ChatML
// markup (added tokens).
var loadFuzzTexts = []string{
	"Hello, world! 123",
	"  a\n\n b\t",
	"e\u0301 \u00e9 你好",
	"\xff\xfe<",
	"<|im_start|>user\nhi<|im_end|>",
}

// FuzzLoadHF: any bytes given as a tokenizer.json load or fail with an
// error, never panic; a tokenizer that loads encodes short texts without
// panicking, into ids below VocabSize, and decodes them without panicking.
// The same file loads the same way twice (parsing depends on nothing but
// the bytes).
func FuzzLoadHF(f *testing.F) {
	for _, s := range loadHFSeeds(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		h, err := parseHF(data, "fuzz")
		if err != nil {
			if h != nil {
				t.Fatalf("parseHF returned a tokenizer with error %v", err)
			}
			// A second parse must fail the same way: the error a user sees
			// at startup does not depend on map order.
			if _, err2 := parseHF(data, "fuzz"); err2 == nil || errors.Is(err, ErrUnsupported) != errors.Is(err2, ErrUnsupported) {
				t.Fatalf("second parse: %v, first: %v", err2, err)
			}
			return
		}
		h2, err := parseHF(data, "fuzz")
		if err != nil {
			t.Fatalf("second parse failed: %v", err)
		}
		for _, s := range loadFuzzTexts {
			ids := h.Encode(s)
			for _, id := range ids {
				if int(id) >= h.VocabSize() {
					t.Fatalf("Encode(%q) = %v: id %d >= VocabSize %d", s, ids, id, h.VocabSize())
				}
			}
			// Ids are what the router hashes: two loads of one file must
			// agree on them.
			if ids2 := h2.Encode(s); !slices.Equal(ids, ids2) {
				t.Fatalf("Encode(%q): %v, then %v after reloading the same file", s, ids, ids2)
			}
			_ = h.Decode(ids)
		}
	})
}

// loadHFSeeds: small valid files of each accepted shape (Qwen2 Split,
// Llama-3 Split with ignore_merges, GPT-2 ByteLevel, added tokens of each
// normalized kind, both merge encodings, the NFC normalizer), a cut-down
// Qwen2 file when it is on this machine, and invalid files near them.
func loadHFSeeds(tb testing.TB) [][]byte {
	var seeds [][]byte
	add := func(m map[string]any) { seeds = append(seeds, mustJSON(tb, m)) }

	add(synth("a b", "ab c", "Ġ t", "Ġt h"))

	withAdded := synth("a b")
	withAdded["normalizer"] = map[string]any{"type": "NFC"}
	withAdded["added_tokens"] = []any{
		map[string]any{"id": 300, "content": "<|im_start|>", "special": true, "normalized": false},
		map[string]any{"id": 301, "content": "<|im_end|>", "special": true, "lstrip": true, "rstrip": true},
		map[string]any{"id": 302, "content": "e\u0301", "special": false, "normalized": true, "single_word": true},
		map[string]any{"id": 2, "content": "", "special": true},
	}
	add(withAdded)

	llama := synth("a b")
	llama["pre_tokenizer"].(map[string]any)["pretokenizers"].([]any)[0].(map[string]any)["pattern"] = map[string]any{"Regex": patternLlama3}
	model(llama)["ignore_merges"] = true
	model(llama)["merges"] = []any{[]any{"a", "b"}}
	llama["normalizer"] = map[string]any{"type": "Sequence", "normalizers": []any{map[string]any{"type": "NFC"}}}
	add(llama)

	gpt2 := synth("a b")
	gpt2["pre_tokenizer"] = map[string]any{"type": "ByteLevel", "add_prefix_space": true, "use_regex": true}
	add(gpt2)

	// A vocab lacking some bytes (dropped when encoding) with an unk_token:
	// rejected; without one: loads.
	sparse := synth()
	model(sparse)["vocab"] = map[string]any{"a": 0, "b": 1, "ab": 2}
	model(sparse)["merges"] = []any{"a b"}
	add(sparse)
	model(sparse)["unk_token"] = "a"
	add(sparse)

	// SentencePiece-style BPE (Llama 2 / Gemma shape): Prepend + Replace
	// normalizers, no pre-tokenizer, byte fallback, unk, template and the
	// Replace/ByteFallback/Fuse/Strip decoder chain.
	add(spSynth(nil))
	// The same model behind each pre-tokenizer and Split behavior.
	for _, pre := range []map[string]any{
		{"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true},
		{"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never", "split": false},
		{"type": "Digits", "individual_digits": true},
		{"type": "Split", "pattern": map[string]any{"String": " "}, "behavior": "MergedWithPrevious", "invert": false},
		{"type": "Split", "pattern": map[string]any{"String": "a"}, "behavior": "MergedWithNext", "invert": true},
		{"type": "Split", "pattern": map[string]any{"Regex": "[0-9]+"}, "behavior": "Contiguous", "invert": false},
		{"type": "Split", "pattern": map[string]any{"Regex": patternDeepSeekWords}, "behavior": "Removed", "invert": false},
		{"type": "Sequence", "pretokenizers": []any{
			map[string]any{"type": "Split", "pattern": map[string]any{"Regex": patternDigits3}, "behavior": "Isolated", "invert": false},
			map[string]any{"type": "Split", "pattern": map[string]any{"Regex": patternO200k}, "behavior": "Isolated", "invert": false},
			map[string]any{"type": "ByteLevel", "add_prefix_space": true, "use_regex": false}}},
	} {
		add(spSynth(pre))
	}

	if q := cutQwen2(tb); q != nil {
		seeds = append(seeds, q)
	}

	for _, s := range []string{``, `{nope`, `[]`, `{}`, `null`, `{"model":{"type":"BPE","vocab":{"a":0}}}`,
		`{"pre_tokenizer":{"type":"ByteLevel"},"decoder":{"type":"ByteLevel"},"model":{"vocab":{"a":2097152}}}`,
		`{"pre_tokenizer":{"type":"ByteLevel"},"decoder":{"type":"ByteLevel"},"model":{"vocab":{"a":0},"merges":["a a"]}}`,
		`{"pre_tokenizer":{"type":"ByteLevel"},"decoder":{"type":"ByteLevel"},"model":{"vocab":{"a":0}},"added_tokens":[{"content":"x"}]}`,
	} {
		seeds = append(seeds, []byte(s))
	}
	return seeds
}

// spSynth is a small SentencePiece-style tokenizer.json (char-level BPE
// with byte fallback) with the given pre-tokenizer (nil: none).
func spSynth(pre map[string]any) map[string]any {
	vocab := map[string]any{"<unk>": 0, "<s>": 1, "</s>": 2}
	for b := 0; b < 256; b++ {
		vocab[fmt.Sprintf("<0x%02X>", b)] = 3 + b
	}
	for i, tok := range []string{"▁", "a", "b", "▁a", "ab", "▁ab", "\ufffd", "1"} {
		vocab[tok] = 259 + i
	}
	m := map[string]any{
		"added_tokens": []any{
			map[string]any{"id": 0, "content": "<unk>", "special": true},
			map[string]any{"id": 1, "content": "<s>", "special": true},
			map[string]any{"id": 2, "content": "</s>", "special": true, "normalized": true},
		},
		"normalizer": map[string]any{"type": "Sequence", "normalizers": []any{
			map[string]any{"type": "NFKC"},
			map[string]any{"type": "Prepend", "prepend": "▁"},
			map[string]any{"type": "Replace", "pattern": map[string]any{"String": " "}, "content": "▁"}}},
		"pre_tokenizer": pre,
		"post_processor": map[string]any{"type": "TemplateProcessing",
			"single":         []any{map[string]any{"SpecialToken": map[string]any{"id": "<s>"}}, map[string]any{"Sequence": map[string]any{"id": "A"}}},
			"special_tokens": map[string]any{"<s>": map[string]any{"id": "<s>", "ids": []any{1}, "tokens": []any{"<s>"}}}},
		"decoder": map[string]any{"type": "Sequence", "decoders": []any{
			map[string]any{"type": "Replace", "pattern": map[string]any{"String": "▁"}, "content": " "},
			map[string]any{"type": "ByteFallback"}, map[string]any{"type": "Fuse"},
			map[string]any{"type": "Strip", "content": " ", "start": 1, "stop": 0}}},
		"model": map[string]any{"type": "BPE", "unk_token": "<unk>", "fuse_unk": true, "byte_fallback": true,
			"vocab": vocab, "merges": []any{[]any{"▁", "a"}, []any{"a", "b"}, []any{"▁a", "b"}}},
	}
	return m
}

// cutQwen2 is the real Qwen2 tokenizer.json with its vocab cut to ids below
// 400 and the merges among them: every real component, at a size the fuzzer
// can mutate. nil when the file is not on this machine (a seed, not a
// reference check: the fuzz target runs without it).
func cutQwen2(tb testing.TB) []byte {
	dir, err := reftest.FindQwen2Dir()
	if err != nil {
		return nil
	}
	data, err := os.ReadFile(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		return nil
	}
	var m map[string]any
	if err := json.Unmarshal(data, &m); err != nil {
		tb.Fatalf("qwen2 tokenizer.json: %v", err)
	}
	mod := model(m)
	vocab := map[string]any{}
	for tok, id := range mod["vocab"].(map[string]any) {
		if id.(float64) < 400 {
			vocab[tok] = id
		}
	}
	var merges []any
	for _, mg := range mod["merges"].([]any) {
		var a, b string
		switch v := mg.(type) {
		case string:
			var ok bool
			if a, b, ok = strings.Cut(v, " "); !ok {
				continue
			}
		case []any:
			a, b = v[0].(string), v[1].(string)
		}
		_, okA := vocab[a]
		_, okB := vocab[b]
		_, okAB := vocab[a+b]
		if okA && okB && okAB {
			merges = append(merges, mg)
		}
	}
	mod["vocab"], mod["merges"] = vocab, merges
	return mustJSON(tb, m)
}
