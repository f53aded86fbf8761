package prompt

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/api/tokenize"
)

// modelDirWith makes a model directory holding a tiny byte-level BPE
// tokenizer.json (testdata/tiny: the GPT-2 byte alphabet, three merges and
// an added <|bos|>; loads in microseconds, even under -race) and the given
// extra files.
func modelDirWith(t *testing.T, files map[string]string) string {
	t.Helper()
	src, err := filepath.Abs(filepath.Join("testdata", "tiny", "tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.Symlink(src, filepath.Join(dir, "tokenizer.json")); err != nil {
		t.Fatal(err)
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestPromptLoadDirectory(t *testing.T) {
	const tmplA = `{% for m in messages %}A:{{ m.content }}{% endfor %}`
	cases := []struct {
		name    string
		files   map[string]string
		wantErr string // substring; "" = loads
		chat    string // expected rendered prefix marker when it loads with a template
	}{
		{name: "tokenizer only", files: nil},
		{name: "string template", files: map[string]string{"tokenizer_config.json": `{"chat_template": "{% for m in messages %}S:{{ m.content }}{% endfor %}"}`}, chat: "S:"},
		{name: "named list picks default", files: map[string]string{"tokenizer_config.json": `{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{% for m in messages %}D:{{ m.content }}{% endfor %}"}]}`}, chat: "D:"},
		{name: "named list without default", files: map[string]string{"tokenizer_config.json": `{"chat_template": [{"name": "tool_use", "template": "T"}]}`}, wantErr: `without a "default"`},
		{name: "chat_template.jinja wins", files: map[string]string{"chat_template.jinja": tmplA, "tokenizer_config.json": `{"chat_template": "X"}`}, chat: "A:"},
		{name: "chat_template.json last", files: map[string]string{"chat_template.json": `{"chat_template": "{% for m in messages %}J:{{ m.content }}{% endfor %}"}`}, chat: "J:"},
		{name: "broken config", files: map[string]string{"tokenizer_config.json": `{"chat_template": `}, wantErr: "tokenizer_config.json"},
		{name: "broken generation config", files: map[string]string{"generation_config.json": `{`}, wantErr: "generation_config.json: not valid JSON"},
		{name: "bos asked for but unset", files: map[string]string{"tokenizer_config.json": `{"add_bos_token": true}`}, wantErr: "bos_token is not set"},
		{name: "bos not in vocabulary", files: map[string]string{"tokenizer_config.json": `{"add_bos_token": true, "bos_token": "<nope>"}`}, wantErr: "not in the vocabulary"},
		{name: "bos from the config", files: map[string]string{"tokenizer_config.json": `{"add_bos_token": true, "bos_token": "<|bos|>"}`}},
		{name: "template syntax error", files: map[string]string{"chat_template.jinja": `{% for m in messages %}`}, wantErr: "chat_template.jinja"},
		{name: "bad special token", files: map[string]string{"tokenizer_config.json": `{"eos_token": 5}`}, wantErr: "eos_token"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := modelDirWith(t, c.files)
			m, err := Load("m", dir)
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("Load: %v, want an error containing %q", err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("Load: %v", err)
			}
			if m.HasChatTemplate() != (c.chat != "") {
				t.Fatalf("HasChatTemplate = %v", m.HasChatTemplate())
			}
			if c.chat == "" {
				if _, err := m.Chat([]byte(`{"messages":[{"role":"user","content":"hi"}]}`)); err == nil {
					t.Fatal("chat without a template: no error")
				}
				return
			}
			got, err := m.Chat([]byte(`{"messages":[{"role":"user","content":"hi"}]}`))
			if err != nil {
				t.Fatal(err)
			}
			if want := m.Tokenizer().Encode(c.chat + "hi"); !slices.Equal(got, want) {
				t.Fatalf("ids %v, want %v", got, want)
			}
		})
	}
}

func TestPromptLoadMissing(t *testing.T) {
	if _, err := Load("m", filepath.Join(t.TempDir(), "absent")); err == nil {
		t.Fatal("absent directory loaded")
	}
	if _, err := Load("m", t.TempDir()); err == nil || !strings.Contains(err.Error(), "no tokenizer.json") {
		t.Fatalf("empty directory: %v", err)
	}
}

// A template that raises answers with the template's message, verbatim.
func TestPromptTemplateRaises(t *testing.T) {
	dir := modelDirWith(t, map[string]string{"chat_template.jinja": `{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must start with user') }}{% endif %}ok`})
	m, err := Load("m", dir)
	if err != nil {
		t.Fatal(err)
	}
	_, err = m.Chat([]byte(`{"messages":[{"role":"assistant","content":"hi"}]}`))
	var re *RequestError
	if !errors.As(err, &re) || re.Msg != "Conversation roles must start with user" {
		t.Fatalf("err = %v", err)
	}
	if _, err := m.Chat([]byte(`{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}`)); !errors.As(err, &re) {
		t.Fatalf("image part: %v", err)
	}
}

// The fingerprint follows every file that decides ids.
func TestPromptFingerprint(t *testing.T) {
	a, err := Load("m", modelDirWith(t, map[string]string{"chat_template.jinja": "A"}))
	if err != nil {
		t.Fatal(err)
	}
	b, err := Load("m", modelDirWith(t, map[string]string{"chat_template.jinja": "A"}))
	if err != nil {
		t.Fatal(err)
	}
	c, err := Load("m", modelDirWith(t, map[string]string{"chat_template.jinja": "B"}))
	if err != nil {
		t.Fatal(err)
	}
	if a.Fingerprint() != b.Fingerprint() || a.Fingerprint() == c.Fingerprint() {
		t.Fatalf("fingerprints %s %s %s", a.Fingerprint(), b.Fingerprint(), c.Fingerprint())
	}
}

func TestPromptCompletionShapes(t *testing.T) {
	m := Legacy("m", tokenize.Builtin(), tokenize.Plain, "builtin")
	cases := []struct {
		body    string
		prompts int
		wantErr bool
	}{
		{`{"prompt":"hello world"}`, 1, false},
		{`{"prompt":["a b","c"]}`, 2, false},
		{`{"prompt":[1,2,3]}`, 1, false},
		{`{"prompt":[[1,2],[3]]}`, 2, false},
		{`{"prompt":["a",[3]]}`, 2, false},
		{`{"prompt":[]}`, 0, true},
		{`{"prompt":[[]]}`, 0, true},
		{`{"prompt":null}`, 0, true},
		{`{"prompt":{"x":1}}`, 0, true},
		{`{"prompt":"x","add_special_tokens":"yes"}`, 0, true},
		{`not json`, 0, true},
	}
	for _, c := range cases {
		got, err := m.Completion([]byte(c.body))
		if (err != nil) != c.wantErr || len(got) != c.prompts {
			t.Errorf("%s: %d prompts, err %v", c.body, len(got), err)
		}
	}
}

// Sets: files first, then the --model names on the default tokenizer;
// models known only from workers have no tokenizer once directories are in
// use (and the default, as before, when none are).
func TestPromptSetLookup(t *testing.T) {
	m, err := Load("withfiles", modelDirWith(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	s := NewSet([]string{"listed"}, []*Model{m}, tokenize.Builtin(), tokenize.Plain, "builtin")
	for model, want := range map[string]bool{"withfiles": true, "listed": true, "workers-only": false} {
		if _, ok := s.Lookup(model); ok != want {
			t.Errorf("Lookup(%q) = %v, want %v", model, ok, want)
		}
	}
	if got, _ := s.Lookup("withfiles"); got != m {
		t.Error("model with files not served by its files")
	}
	legacy := NewSet([]string{"listed"}, nil, tokenize.Builtin(), tokenize.Plain, "builtin")
	if _, ok := legacy.Lookup("workers-only"); !ok {
		t.Error("without model directories every model uses the default tokenizer")
	}
	d := s.Describe([]string{"workers-only", "withfiles"})
	if d[0]["model"] != "withfiles" || d[1]["tokenizer"] != "none" {
		t.Errorf("Describe = %v", d)
	}
}

// add_bos_token in the config decides what add_special_tokens adds, as
// transformers' LlamaTokenizerFast does; absent, tokenizer.json's
// post-processor (here: none) does.
func TestPromptSpecialTokensFromConfig(t *testing.T) {
	with, err := Load("m", modelDirWith(t, map[string]string{"tokenizer_config.json": `{"add_bos_token": true, "bos_token": "<|bos|>"}`}))
	if err != nil {
		t.Fatal(err)
	}
	without, err := Load("m", modelDirWith(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	bos, _ := with.Tokenizer().(interface{ TokenID(string) (uint32, bool) }).TokenID("<|bos|>")
	plain := without.Tokenizer().Encode("hi there")
	for _, c := range []struct {
		m    *Model
		body string
		want []uint32
	}{
		{with, `{"prompt":"hi there"}`, append([]uint32{bos}, plain...)},
		{with, `{"prompt":"hi there","add_special_tokens":false}`, plain},
		{without, `{"prompt":"hi there"}`, plain},
	} {
		got, err := c.m.Completion([]byte(c.body))
		if err != nil || !slices.Equal(got[0], c.want) {
			t.Errorf("%s: %v %v, want %v", c.body, got, err, c.want)
		}
	}
}
