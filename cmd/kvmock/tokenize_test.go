package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/api/prompt"
	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/internal/reftest"
)

// refModelDir is a real Hugging Face model directory from the pinned npm
// reference packages (internal/reftest: skipped without them, failed in CI).
func refModelDir(t *testing.T, family string) string {
	t.Helper()
	return reftest.ModelDir(t, family)
}

type tokenizeDoc struct {
	Count       int       `json:"count"`
	MaxModelLen int       `json:"max_model_len"`
	Tokens      []uint32  `json:"tokens"`
	TokenStrs   *[]string `json:"token_strs"`
}

func postTokenize(t *testing.T, url, body string) tokenizeDoc {
	t.Helper()
	status, out := post(t, url+"/tokenize", []byte(body))
	if status != 200 {
		t.Fatalf("/tokenize %s: HTTP %d: %s", body, status, out)
	}
	var d tokenizeDoc
	if err := json.Unmarshal(out, &d); err != nil {
		t.Fatal(err)
	}
	if d.Count != len(d.Tokens) {
		t.Fatalf("count %d, %d tokens", d.Count, len(d.Tokens))
	}
	return d
}

// Without --model-dir, /tokenize answers with the ids kvmock computes for
// its prompts with the builtin tokenizer (the router's default), in vLLM's
// JSON; /detokenize inverts it.
func TestMockTokenizeBuiltin(t *testing.T) {
	tm := startMock(t, nil, true)
	chat := `{"model":"kvmock","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hello there, ünïcödé 🙂"}]}`
	d := postTokenize(t, tm.url, chat)
	if want := routerTokens(t, []byte(chat)); !slices.Equal(d.Tokens, want) {
		t.Fatalf("chat: %v, router %v", d.Tokens, want)
	}
	if d.MaxModelLen != tm.m.engCfg.MaxModelLen || d.TokenStrs != nil {
		t.Fatalf("max_model_len %d (engine %d), token_strs %v", d.MaxModelLen, tm.m.engCfg.MaxModelLen, d.TokenStrs)
	}
	d = postTokenize(t, tm.url, `{"prompt":"Once upon a time"}`)
	if want := tokenize.Builtin().Encode("Once upon a time"); !slices.Equal(d.Tokens, want) {
		t.Fatalf("prompt: %v, want %v", d.Tokens, want)
	}
	ids, _ := json.Marshal(d.Tokens)
	status, out := post(t, tm.url+"/detokenize", []byte(`{"tokens":`+string(ids)+`}`))
	var back struct{ Prompt string }
	// The builtin tokenizer hashes unknown words: its decode spells them
	// canonically.
	if status != 200 || json.Unmarshal(out, &back) != nil || back.Prompt != tokenize.Builtin().Decode(d.Tokens) {
		t.Fatalf("/detokenize: HTTP %d %s", status, out)
	}

	for _, c := range []struct {
		path, body string
		status     int
	}{
		{"/tokenize", `{"model":"other","prompt":"x"}`, 404},
		{"/tokenize", `{"prompt":`, 400},
		{"/tokenize", `{"prompt":[1,2]}`, 400},
		{"/tokenize", `{"messages":[]}`, 400},
		{"/detokenize", `{"prompt":"x"}`, 400},
		{"/detokenize", `{"model":"other","tokens":[1]}`, 404},
	} {
		if status, out := post(t, tm.url+c.path, []byte(c.body)); status != c.status || !strings.Contains(string(out), `"error"`) {
			t.Errorf("%s %s: HTTP %d %s, want %d", c.path, c.body, status, out, c.status)
		}
	}
}

// With --model-dir, prompts are tokenized by the directory's files through
// api/prompt, so /tokenize, the prompt the engine runs and the router's ids
// agree; --chat-template-file makes chat prompts differ on purpose.
func TestMockTokenizeModelDir(t *testing.T) {
	dir := refModelDir(t, "qwen3")
	ref, err := prompt.Load("qwen3", dir)
	if err != nil {
		t.Fatal(err)
	}
	tm := startMock(t, func(c *config) { c.Model, c.ModelDir = "qwen3", dir }, false)
	bodies := []string{
		`{"model":"qwen3","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Count to five.\nThen stop."}]}`,
		`{"messages":[{"role":"user","content":"def f(x):\n    return x**2  # 平方 🙂"}],"chat_template_kwargs":{"enable_thinking":false}}`,
		`{"prompt":"<|im_start|>user\nhi<|im_end|>"}`,
		`{"prompt":"plain text","add_special_tokens":false}`,
	}
	for _, b := range bodies {
		want, err := ref.Tokenize([]byte(b))
		if err != nil {
			t.Fatal(err)
		}
		if d := postTokenize(t, tm.url, b); !slices.Equal(d.Tokens, want) {
			t.Fatalf("%s:\nkvmock %v\nrouter %v", b, d.Tokens, want)
		}
	}
	// The engine runs exactly these ids: its usage counts them.
	var req map[string]any
	_ = json.Unmarshal([]byte(bodies[0]), &req)
	req["max_tokens"] = 2
	status, out := post(t, tm.url+"/v1/chat/completions", req)
	if status != 200 {
		t.Fatalf("chat: HTTP %d %s", status, out)
	}
	want, _ := ref.Chat([]byte(bodies[0]))
	if a := decodeAnswer(t, out); a.Usage == nil || a.Usage.PromptTokens != len(want) {
		t.Fatalf("usage %+v, want %d prompt tokens", a.Usage, len(want))
	}
	ids, _ := json.Marshal(want)
	status, out = post(t, tm.url+"/detokenize", []byte(`{"tokens":`+string(ids)+`}`))
	var back struct{ Prompt string }
	if status != 200 || json.Unmarshal(out, &back) != nil || !strings.HasPrefix(back.Prompt, "<|im_start|>system\nYou are terse.<|im_end|>") {
		t.Fatalf("/detokenize: HTTP %d %s", status, out)
	}

	// A deliberately different template: same directory, other ids.
	tmpl := filepath.Join(t.TempDir(), "drift.jinja")
	// ChatML without the newline after <|im_end|>: a subtle drift.
	src := "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
	if err := os.WriteFile(tmpl, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	drift := startMock(t, func(c *config) { c.Model, c.ModelDir, c.ChatTemplateFile = "qwen3", dir, tmpl }, true)
	got := postTokenize(t, drift.url, bodies[0]).Tokens
	if slices.Equal(got, want) {
		t.Fatalf("the override template gives the directory's ids")
	}
	if fp := drift.m.prompt.Fingerprint(); fp == ref.Fingerprint() {
		t.Fatalf("fingerprint %s unchanged by the override", fp)
	}
	// Completions do not use the template.
	if a, b := postTokenize(t, drift.url, bodies[2]).Tokens, postTokenize(t, tm.url, bodies[2]).Tokens; !slices.Equal(a, b) {
		t.Fatalf("prompt ids differ: %v %v", a, b)
	}
}

func TestMockConfigModelDir(t *testing.T) {
	env := map[string]string{"KVMOCK_MODEL_DIR": "/models/qwen3", "KVMOCK_CHAT_TEMPLATE_FILE": "/t.jinja"}
	c, err := parseConfig(nil, func(k string) string { return env[k] }, nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.ModelDir != "/models/qwen3" || c.ChatTemplateFile != "/t.jinja" {
		t.Fatalf("config %+v", c)
	}
	if _, err := parseConfig([]string{"--chat-template-file", "/t.jinja"}, func(string) string { return "" }, nil); err == nil {
		t.Fatal("--chat-template-file without --model-dir accepted")
	}
	c.ModelDir = t.TempDir() // no tokenizer.json
	if _, err := newMock(c, testLog(t), nil); err == nil || !strings.Contains(err.Error(), "tokenizer.json") {
		t.Fatalf("empty model dir: %v", err)
	}
	c.ModelDir = "/nonexistent"
	if _, err := newMock(c, testLog(t), nil); err == nil || !strings.Contains(err.Error(), "--model-dir") {
		t.Fatalf("missing model dir: %v", err)
	}
}
