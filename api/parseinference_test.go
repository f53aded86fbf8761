package api

import (
	"bytes"
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/api/prompt"
	"github.com/kvrouter/kvrouter/api/tokenize"
)

// checkParseInference fails when parseInference reads body differently
// from json.Unmarshal into inferenceRequest (its error message included),
// or hands the tokenizer prompt values other than the body's own: the
// one-pass path must be invisible.
func checkParseInference(t *testing.T, m *prompt.Model, body []byte) {
	t.Helper()
	in, hasMessages, f, err := parseInference(body)
	var ref inferenceRequest
	rerr := json.Unmarshal(body, &ref)
	if (err == nil) != (rerr == nil) || (err != nil && err.Error() != rerr.Error()) {
		t.Fatalf("%q: error %v, encoding/json %v", body, err, rerr)
	}
	if err != nil {
		return
	}
	if hasMessages != (len(ref.Messages) > 0) {
		t.Fatalf("%q: hasMessages %v, encoding/json read %d messages", body, hasMessages, len(ref.Messages))
	}
	in.Messages, ref.Messages = nil, nil
	if !reflect.DeepEqual(in, ref) {
		t.Fatalf("%q: read %+v, encoding/json %+v", body, in, ref)
	}
	if !f.Known {
		return
	}
	var p struct {
		Prompt           json.RawMessage `json:"prompt"`
		AddSpecialTokens json.RawMessage `json:"add_special_tokens"`
	}
	if err := json.Unmarshal(body, &p); err != nil {
		t.Fatalf("%q: %v", body, err)
	}
	if !bytes.Equal(f.Prompt, p.Prompt) || !bytes.Equal(f.AddSpecialTokens, p.AddSpecialTokens) {
		t.Fatalf("%q: prompt fields %q %q, encoding/json %q %q", body, f.Prompt, f.AddSpecialTokens, p.Prompt, p.AddSpecialTokens)
	}
	got, gerr := m.CompletionFields(body, f)
	want, werr := m.Completion(body)
	if fmt.Sprint(gerr) != fmt.Sprint(werr) || !reflect.DeepEqual(got, want) {
		t.Fatalf("%q: tokens %v (%v), Completion %v (%v)", body, got, gerr, want, werr)
	}
}

func TestAPIParseInferenceMatchesEncodingJSON(t *testing.T) {
	m := prompt.Legacy("m", tokenize.Builtin(), tokenize.ChatML, "builtin")
	long := strings.Repeat("bakemo dubiza ", 1200)
	for _, body := range []string{
		`{"model":"m","prompt":"` + long + `","max_tokens":64,"stream":true,"stream_options":{"include_usage":true}}`,
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":false,"n":3,"cache_salt":"s","nvext":{"agent_hints":{"priority":2,"osl":100}}}`,
		`{"model":"m","messages":[ ]}`, `{"model":"m","messages":null}`, `{"model":"m","messages":"hi"}`, `{"model":"m","messages":{}}`,
		`{"model":"m","prompt":["a b",[1,2,3]],"add_special_tokens":false}`, `{"model":"m","prompt":"x","add_special_tokens":"yes"}`,
		`{"model":"m","prompt":"\u00e9\n\"q\""}`, "{\"model\":\"m\",\"prompt\":\"bad \xff utf-8\"}", `{"model":"m","prompt":null}`, `{"model":"m"}`,
		`{"model":7}`, `{"model":null,"prompt":"a"}`, `{"model":"m","stream":"yes"}`, `{"model":"m","stream":null}`, `{"model":"m","n":1.5}`,
		`{"model":"m","n":-2}`, `{"model":"m","nvext":[]}`, `{"model":"m","nvext":{"agent_hints":{"priority":"high"}}}`,
		`{"Model":"m","prompt":"a"}`, `{"model":"a","model":"b"}`, `{"mod\u0065l":"m"}`, `{"STREAM":true,"model":"m"}`,
		`null`, `[]`, `"m"`, ``, `{"model":"m",}`, `{"model":"m"} {}`, `{"model":"m","x":01}`,
	} {
		checkParseInference(t, m, []byte(body))
	}
}

// FuzzAPIParseInference: whatever the body, parseInference reads it as
// encoding/json does (the fast path of a new decoder, fuzzed against the
// decoder it stands in for).
func FuzzAPIParseInference(f *testing.F) {
	for _, s := range []string{`{"model":"m","prompt":"a b c","stream":true,"n":2,"nvext":{"agent_hints":{"osl":5}}}`,
		`{"model":"m","messages":[{"role":"user","content":"x"}],"add_special_tokens":true}`, `{"Model":"m"}`, `{"n":"1"}`,
		`{"prompt":[[1,2],"w"],"cache_salt":"\u0041"}`} {
		f.Add([]byte(s))
	}
	m := prompt.Legacy("m", tokenize.Builtin(), tokenize.ChatML, "builtin")
	f.Fuzz(func(t *testing.T, body []byte) {
		if len(body) > 1<<16 {
			return
		}
		checkParseInference(t, m, body)
	})
}
