package prompt

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/kvrouter/kvrouter/internal/reftest"
)

// The end-to-end reference test: request body → ids, through the whole
// chain a replica runs (vLLM's request defaults, the model's own chat
// template, its tokenizer, its special-token rule), against the engines'
// reference implementations run independently of our code: the template
// rendered by Python jinja2 under transformers' settings
// (../chattemplate/testdata/render_ref.py) and the text tokenized by
// Hugging Face tokenizers in Rust (../tokenize/testdata/hf_reference.js).
// The variables handed to Python are built here from the raw request, not
// by our Conversation, so a preprocessing slip shows up too.

var refFamilies = []string{"llama3_1", "qwen3", "deepseek_v3", "gemma3"}

// refModels caches each family's loaded Model across the reference tests:
// loading Gemma 3's 260k-token vocabulary dominates their run time under
// -race. Test-only state.
var refModels = struct {
	sync.Mutex
	m map[string]*Model
}{m: map[string]*Model{}}

func loadRef(t *testing.T, fam string) (*Model, string) {
	t.Helper()
	dir := reftest.ModelDir(t, fam)
	refModels.Lock()
	defer refModels.Unlock()
	if m, ok := refModels.m[fam]; ok {
		return m, dir
	}
	m, err := Load(fam, dir)
	if err != nil {
		t.Fatal(err)
	}
	refModels.m[fam] = m
	return m, dir
}

func python(tb testing.TB) string {
	tb.Helper()
	for _, py := range []string{"python3", "/usr/bin/python3"} {
		if exec.Command(py, "-c", "import jinja2").Run() == nil {
			return py
		}
	}
	reftest.Missing(tb, "python3 with jinja2")
	return ""
}

// corpusWords mixes what breaks tokenizers and templates: unicode, code,
// whitespace runs, special-token look-alikes.
var corpusWords = strings.Split("a replica routes every prompt by its cached prefix and the load of each worker "+
	"Grüße aus Zürich — 北京 ソウル مرحبا 🚀🔥 👩‍👩‍👧 e\u0301 \t tabs\tand   runs of   spaces\r\nwindows line\n\n\n"+
	"for i in range(10):\n\tprint(i)  // mixed 007 2.5e10 0xFF 1234567 user@example.org <b>html</b> "+
	"<|im_start|> <s> <bos> don't I'LL We'Re {\"json\": [1, 2]} \\u00e9", " ")

type refRequest struct {
	body   []byte
	vars   map[string]any // what transformers hands the template
	family string
}

func words(r *rand.Rand, lo, hi int) string {
	n := lo + r.IntN(hi-lo+1)
	out := make([]string, n)
	for i := range out {
		out[i] = corpusWords[r.IntN(len(corpusWords))]
	}
	return strings.Join(out, " ")
}

// The tool as a client sends it (keys in its own order) and as vLLM hands it
// to the template: pydantic's model_dump order (type, function: name,
// description, parameters), parameters passed through as sent.
var (
	refToolsClient = json.RawMessage(`[{"function":{"parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]},"description":"Weather in a city","name":"get_weather"},"type":"function"}]`)
	refToolsVLLM   = json.RawMessage(`[{"type":"function","function":{"name":"get_weather","description":"Weather in a city","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]`)
)

// chatRequest builds one chat completions body and the template variables
// vLLM derives from it (string content, tools or None,
// add_generation_prompt, chat_template_kwargs merged).
func chatRequest(r *rand.Rand, i int) (map[string]any, map[string]any) {
	var msgs []any
	if r.IntN(2) == 0 {
		msgs = append(msgs, map[string]any{"role": "system", "content": words(r, 1, 40)})
	}
	turns := 1 + r.IntN(4)
	for t := 0; t < turns; t++ {
		msgs = append(msgs, map[string]any{"role": "user", "content": words(r, 1, 120)})
		if t < turns-1 || r.IntN(5) == 0 {
			msgs = append(msgs, map[string]any{"role": "assistant", "content": words(r, 1, 60)})
		}
	}
	if i%13 == 0 { // long prompt
		msgs = append(msgs, map[string]any{"role": "user", "content": words(r, 800, 1200)})
	}
	body := map[string]any{"model": "m", "messages": msgs}
	vars := map[string]any{"messages": msgs, "tools": nil, "documents": nil, "add_generation_prompt": true}
	if i%7 == 3 {
		body["tools"], vars["tools"] = refToolsClient, refToolsVLLM
	}
	if i%11 == 5 {
		body["chat_template_kwargs"] = map[string]any{"enable_thinking": false}
		vars["enable_thinking"] = false
	}
	if i%17 == 9 {
		body["add_generation_prompt"], vars["add_generation_prompt"] = false, false
	}
	return body, vars
}

// specialVars reads the special tokens a template sees from
// tokenizer_config.json (strings or AddedToken objects).
func specialVars(tb testing.TB, dir string) map[string]any {
	tb.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "tokenizer_config.json"))
	if err != nil {
		tb.Fatal(err)
	}
	var cfg map[string]any
	if err := json.Unmarshal(data, &cfg); err != nil {
		tb.Fatal(err)
	}
	out := map[string]any{}
	for _, k := range []string{"bos_token", "eos_token", "unk_token", "pad_token"} {
		switch v := cfg[k].(type) {
		case string:
			out[k] = v
		case map[string]any:
			out[k] = v["content"]
		}
	}
	return out
}

func runJSON(tb testing.TB, stdin []byte, name string, args ...string) []byte {
	tb.Helper()
	cmd := exec.Command(name, args...)
	cmd.Stdin = bytes.NewReader(stdin)
	cmd.Env = append(os.Environ(), "TOKENIZERS_PARALLELISM=false")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		tb.Fatalf("%s %v: %v\n%s", name, args, err, stderr.String())
	}
	return out
}

// hfEncode tokenizes texts with Hugging Face tokenizers (Rust): ids with
// add_special_tokens false and true.
func hfEncode(tb testing.TB, dir string, texts []string, opts ...string) (plain, special [][]uint32) {
	tb.Helper()
	if _, err := exec.LookPath("node"); err != nil {
		reftest.Missing(tb, "node")
	}
	f := filepath.Join(tb.TempDir(), "texts.json")
	data, _ := json.Marshal(texts)
	if err := os.WriteFile(f, data, 0o644); err != nil {
		tb.Fatal(err)
	}
	script, _ := filepath.Abs(filepath.Join("..", "tokenize", "testdata", "hf_reference.js"))
	args := append([]string{script, reftest.NodeModules(), filepath.Join(dir, "tokenizer.json"), f, "encode"}, opts...)
	out := runJSON(tb, nil, "node", args...)
	var res struct{ Plain, Special [][]uint32 }
	if err := json.Unmarshal(out, &res); err != nil {
		tb.Fatalf("hf_reference.js output: %v", err)
	}
	return res.Plain, res.Special
}

type pyResult struct {
	Out    *string `json:"out"`
	Error  string  `json:"error"`
	Raised bool    `json:"raised"`
}

func pyRender(tb testing.TB, src string, vars []map[string]any) []pyResult {
	tb.Helper()
	cases := make([]map[string]any, len(vars))
	for i, v := range vars {
		cases[i] = map[string]any{"template": "t", "vars": v}
	}
	in, _ := json.Marshal(map[string]any{"now": "2026-07-26T10:00:00", "templates": map[string]string{"t": src}, "cases": cases})
	script, _ := filepath.Abs(filepath.Join("..", "chattemplate", "testdata", "render_ref.py"))
	var res []pyResult
	if err := json.Unmarshal(runJSON(tb, in, python(tb), script), &res); err != nil {
		tb.Fatalf("render_ref.py output: %v", err)
	}
	return res
}

func TestPromptReferenceChat(t *testing.T) {
	const perFamily = 220
	for _, fam := range refFamilies {
		t.Run(fam, func(t *testing.T) {
			m, dir := loadRef(t, fam)
			var cfg struct {
				ChatTemplate string `json:"chat_template"`
			}
			data, _ := os.ReadFile(filepath.Join(dir, "tokenizer_config.json"))
			if err := json.Unmarshal(data, &cfg); err != nil {
				t.Fatal(err)
			}
			special := specialVars(t, dir)
			r := rand.New(rand.NewPCG(uint64(len(fam)), 14))
			bodies := make([][]byte, perFamily)
			vars := make([]map[string]any, perFamily)
			for i := range bodies {
				body, v := chatRequest(r, i)
				for k, s := range special {
					v[k] = s
				}
				bodies[i], _ = json.Marshal(body)
				vars[i] = v
			}
			rendered := pyRender(t, cfg.ChatTemplate, vars)
			var texts []string
			for _, res := range rendered {
				if res.Out != nil {
					texts = append(texts, *res.Out)
				}
			}
			plain, _ := hfEncode(t, dir, texts)
			exact, raised, k := 0, 0, 0
			for i, res := range rendered {
				got, err := m.Chat(bodies[i])
				if res.Out == nil {
					if !res.Raised || err == nil || err.Error() != res.Error {
						t.Errorf("request %d: python: %q (raised %v); ours: %v", i, res.Error, res.Raised, err)
					}
					raised++
					continue
				}
				want := plain[k]
				k++
				if err != nil {
					t.Errorf("request %d: %v", i, err)
					continue
				}
				if !slices.Equal(got, want) {
					t.Errorf("request %d: ids differ at %d (ours %d ids, HF %d)\nbody: %s", i, firstDiff(got, want), len(got), len(want), bodies[i])
					continue
				}
				exact++
			}
			t.Logf("%s: %d/%d chat requests exact, %d refused by the template as in Python", fam, exact, perFamily-raised, raised)
		})
	}
}

func firstDiff(a, b []uint32) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// TestPromptReferenceCompletions: completions prompts with vLLM's default
// add_special_tokens (true) and with it off. The expectation for true is
// HF tokenizers' with the post-processor Python transformers installs
// (hf_reference.js's "encode transformers": LlamaTokenizerFast and
// GemmaTokenizerFast rebuild it from tokenizer_config.json's add_bos_token,
// so DeepSeek V3 gets BOS although its tokenizer.json post-processor adds
// none).
func TestPromptReferenceCompletions(t *testing.T) {
	const perFamily = 80
	for _, fam := range refFamilies {
		t.Run(fam, func(t *testing.T) {
			m, dir := loadRef(t, fam)
			r := rand.New(rand.NewPCG(uint64(len(fam)), 15))
			texts := make([]string, perFamily)
			for i := range texts {
				texts[i] = words(r, 1, 200)
			}
			plain, special := hfEncode(t, dir, texts, "transformers")
			for i, text := range texts {
				for _, c := range []struct {
					flag string
					want []uint32
				}{{"", special[i]}, {`,"add_special_tokens":true`, special[i]}, {`,"add_special_tokens":false`, plain[i]}} {
					q, _ := json.Marshal(text)
					body := fmt.Appendf(nil, `{"model":"m","prompt":%s%s}`, q, c.flag)
					got, err := m.Completion(body)
					if err != nil {
						t.Fatalf("prompt %d: %v", i, err)
					}
					if !slices.Equal(got[0], c.want) {
						t.Errorf("prompt %d%s: ids differ at %d", i, c.flag, firstDiff(got[0], c.want))
					}
				}
			}
		})
	}
}
