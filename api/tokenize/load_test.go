package tokenize

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestLoadHFErrors(t *testing.T) {
	set := func(f func(m map[string]any)) []byte {
		m := synth("a b")
		f(m)
		return mustJSON(t, m)
	}
	tests := []struct {
		name        string
		data        []byte
		unsupported bool // want errors.Is(err, ErrUnsupported)
	}{
		{"not json", []byte("{nope"), false},
		{"json array", []byte("[]"), false},
		{"empty object", []byte("{}"), false}, // no model
		{"ill-formed UTF-8", []byte("{\"model\":{\"vocab\":{\"a\":0,\"\x82\":1}}}"), false},
		{"model missing", set(func(m map[string]any) { delete(m, "model") }), false},
		{"model not object", set(func(m map[string]any) { m["model"] = 7 }), false},
		{"WordPiece model", set(func(m map[string]any) { model(m)["type"] = "WordPiece" }), true},
		{"dropout", set(func(m map[string]any) { model(m)["dropout"] = 0.1 }), true},
		{"unk_token not in vocab", set(func(m map[string]any) { model(m)["unk_token"] = "<unk>" }), true},
		{"merge shorter than subword prefix", set(func(m map[string]any) { model(m)["continuing_subword_prefix"] = "##" }), false},
		{"empty vocab", set(func(m map[string]any) { model(m)["vocab"] = map[string]any{} }), false},
		{"negative id", set(func(m map[string]any) { model(m)["vocab"].(map[string]any)["zz"] = -1 }), false},
		{"huge id", set(func(m map[string]any) { model(m)["vocab"].(map[string]any)["zz"] = 1 << 30 }), false},
		{"merge of unknown token", set(func(m map[string]any) { model(m)["merges"] = []any{"a qq"} }), false},
		{"merge result not in vocab", set(func(m map[string]any) { model(m)["merges"] = []any{"b c"} }), false},
		{"merge with one token", set(func(m map[string]any) { model(m)["merges"] = []any{"ab"} }), false},
		{"merge with three tokens", set(func(m map[string]any) { model(m)["merges"] = []any{"a b c"} }), false},
		{"merge pair of three", set(func(m map[string]any) { model(m)["merges"] = []any{[]any{"a", "b", "c"}} }), false},
		{"merge is a number", set(func(m map[string]any) { model(m)["merges"] = []any{1} }), false},
		{"lowercase normalizer", set(func(m map[string]any) { m["normalizer"] = map[string]any{"type": "Lowercase"} }), true},
		{"normalizer not object", set(func(m map[string]any) { m["normalizer"] = "NFC" }), false},
		{"unknown split regex", set(func(m map[string]any) {
			m["pre_tokenizer"].(map[string]any)["pretokenizers"].([]any)[0].(map[string]any)["pattern"] = map[string]any{"Regex": `\w+`}
		}), true},
		{"look-ahead regex", set(func(m map[string]any) {
			m["pre_tokenizer"].(map[string]any)["pretokenizers"].([]any)[0].(map[string]any)["pattern"] = map[string]any{"Regex": `a+(?!b)`}
		}), true},
		{"regex with \\s", set(func(m map[string]any) {
			m["pre_tokenizer"].(map[string]any)["pretokenizers"].([]any)[0].(map[string]any)["pattern"] = map[string]any{"Regex": `\s+`}
		}), true},
		{"regex matching empty", set(func(m map[string]any) {
			m["pre_tokenizer"].(map[string]any)["pretokenizers"].([]any)[0].(map[string]any)["pattern"] = map[string]any{"Regex": `a*`}
		}), true},
		{"split behavior unknown", set(func(m map[string]any) {
			m["pre_tokenizer"].(map[string]any)["pretokenizers"].([]any)[0].(map[string]any)["behavior"] = "Sideways"
		}), false},
		{"split after ByteLevel", set(func(m map[string]any) {
			p := m["pre_tokenizer"].(map[string]any)["pretokenizers"].([]any)
			p[0], p[1] = p[1], p[0]
		}), true},
		{"Metaspace first after a split", set(func(m map[string]any) {
			p := m["pre_tokenizer"].(map[string]any)["pretokenizers"].([]any)
			p[1] = map[string]any{"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}
		}), true},
		{"Precompiled normalizer", set(func(m map[string]any) { m["normalizer"] = map[string]any{"type": "Precompiled"} }), true},
		{"template without $A", set(func(m map[string]any) {
			m["post_processor"] = map[string]any{"type": "TemplateProcessing", "single": []any{}, "special_tokens": map[string]any{}}
		}), true},
		{"template special token unknown", set(func(m map[string]any) {
			m["post_processor"] = map[string]any{"type": "TemplateProcessing", "single": []any{
				map[string]any{"SpecialToken": map[string]any{"id": "<s>"}}, map[string]any{"Sequence": map[string]any{"id": "A"}}}}
		}), false},
		{"whitespace pre-tokenizer", set(func(m map[string]any) { m["pre_tokenizer"] = map[string]any{"type": "Whitespace"} }), true},
		{"CTC decoder", set(func(m map[string]any) { m["decoder"] = map[string]any{"type": "CTC"} }), true},
		{"metaspace decoder without replacement", set(func(m map[string]any) { m["decoder"] = map[string]any{"type": "Metaspace"} }), false},
		{"added token without id", set(func(m map[string]any) { m["added_tokens"] = []any{map[string]any{"content": "<x>"}} }), false},
		{"added token huge id", set(func(m map[string]any) { m["added_tokens"] = []any{map[string]any{"id": 1 << 30, "content": "<x>"}} }), false},
		{"added tokens not array", set(func(m map[string]any) { m["added_tokens"] = "x" }), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseHF(tt.data, "t")
			if err == nil {
				t.Fatal("no error")
			}
			if got := errors.Is(err, ErrUnsupported); got != tt.unsupported {
				t.Errorf("errors.Is(%v, ErrUnsupported) = %v, want %v", err, got, tt.unsupported)
			}
		})
	}
}

// TestLoadHFTruncated feeds every prefix of a valid file to the parser: it
// must return an error (or, for the full file, succeed) and never panic.
func TestLoadHFTruncated(t *testing.T) {
	m := synth("a b", "ab c")
	m["added_tokens"] = []any{map[string]any{"id": 400, "content": "<x>", "special": true}}
	data := mustJSON(t, m)
	for n := 0; n < len(data); n += 1 + n/200 {
		if _, err := parseHF(data[:n], "t"); err == nil {
			t.Fatalf("prefix of %d/%d bytes parsed without error", n, len(data))
		}
	}
	if _, err := parseHF(data, "t"); err != nil {
		t.Fatal(err)
	}
}

func TestLoadHFPaths(t *testing.T) {
	dir := t.TempDir()
	sub := filepath.Join(dir, "tiny")
	if err := os.Mkdir(sub, 0o755); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(sub, "tokenizer.json")
	if err := os.WriteFile(file, mustJSON(t, synth("a b")), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{file, sub} {
		h, err := LoadHF(p)
		if err != nil {
			t.Fatalf("LoadHF(%s): %v", p, err)
		}
		if h.Name() != "hf:tiny" {
			t.Errorf("Name() = %q, want hf:tiny", h.Name())
		}
	}

	t.Chdir(sub)
	if h, err := LoadHF("tokenizer.json"); err != nil || h.Name() != "hf:tiny" {
		t.Errorf("relative path: %v, %v", h, err)
	}

	_, err := LoadHF(filepath.Join(dir, "missing.json"))
	if !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing file: err = %v, want fs.ErrNotExist", err)
	}

	bad := filepath.Join(dir, "bad.json")
	if err := os.WriteFile(bad, []byte(`{"model":`), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = LoadHF(bad)
	if err == nil || !strings.Contains(err.Error(), bad) {
		t.Errorf("malformed file: err = %v, want an error naming the file", err)
	}
}
