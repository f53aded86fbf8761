package prompt

import (
	"errors"
	"testing"

	"github.com/kvrouter/kvrouter/api/tokenize"
)

// FuzzPromptBodies: any request body gives ids or a RequestError (a 400),
// never a panic or another kind of error. The legacy model needs no files,
// so the target runs anywhere; the Jinja path is fuzzed in api/chattemplate.
func FuzzPromptBodies(f *testing.F) {
	for _, s := range []string{
		`{"prompt":"hello"}`, `{"prompt":[1,2,3]}`, `{"prompt":[[1],[2,3]]}`, `{"prompt":["a","b"],"add_special_tokens":false}`,
		`{"messages":[{"role":"user","content":"hi"}]}`, `{"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}]}`,
		`{"messages":[]}`, `{"prompt":null}`, `{"prompt":[[]]}`, `{"add_special_tokens":1}`, `[`, `null`, `{"prompt":[-1]}`,
	} {
		f.Add([]byte(s))
	}
	m := Legacy("m", tokenize.Builtin(), tokenize.Plain, "builtin")
	f.Fuzz(func(t *testing.T, body []byte) {
		check := func(what string, err error) {
			var re *RequestError
			if err != nil && !errors.As(err, &re) {
				t.Fatalf("%s: %T %v is not a RequestError", what, err, err)
			}
		}
		ps, err := m.Completion(body)
		check("completion", err)
		if err == nil && len(ps) == 0 {
			t.Fatal("completion: no prompts and no error")
		}
		_, err = m.Chat(body)
		check("chat", err)
		_, err = m.Tokenize(body)
		check("tokenize", err)
	})
}
