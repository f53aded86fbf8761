package api

import (
	"encoding/json"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/router"
)

// vLLM's /tokenize and /detokenize answer the ids the replica hashes.
func TestAPITokenizeEndpoints(t *testing.T) {
	s, _, _ := newTestServer(t, router.DefaultConfig())
	tok := tokenize.Builtin()
	cases := []struct {
		name, path, body string
		status           int
		want             []uint32
	}{
		{"completion prompt", "/tokenize", `{"model":"m","prompt":"hello there world"}`, 200, tok.EncodeSpecial("hello there world")},
		{"no special tokens", "/tokenize", `{"model":"m","prompt":"hello there","add_special_tokens":false}`, 200, tok.Encode("hello there")},
		{"model defaults to the only one", "/tokenize", `{"prompt":"hello"}`, 200, tok.EncodeSpecial("hello")},
		{"chat", "/tokenize", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, 200, nil},
		{"unknown model", "/tokenize", `{"model":"x","prompt":"hello"}`, 404, nil},
		{"no prompt", "/tokenize", `{"model":"m"}`, 400, nil},
		{"bad json", "/tokenize", `{`, 400, nil},
		{"detokenize without tokens", "/detokenize", `{"model":"m"}`, 400, nil},
	}
	for _, c := range cases {
		rec := do(s, "POST", c.path, c.body)
		if rec.Code != c.status {
			t.Errorf("%s: %d %s", c.name, rec.Code, rec.Body)
			continue
		}
		if c.status != 200 {
			var e struct {
				Error struct{ Message string } `json:"error"`
			}
			if json.Unmarshal(rec.Body.Bytes(), &e) != nil || e.Error.Message == "" {
				t.Errorf("%s: not an OpenAI-shaped error: %s", c.name, rec.Body)
			}
			continue
		}
		var out struct {
			Count  int      `json:"count"`
			Tokens []uint32 `json:"tokens"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil || out.Count != len(out.Tokens) || len(out.Tokens) == 0 {
			t.Errorf("%s: %s", c.name, rec.Body)
			continue
		}
		if c.want != nil && !slices.Equal(out.Tokens, c.want) {
			t.Errorf("%s: tokens %v, want %v", c.name, out.Tokens, c.want)
		}
	}
	ids, _ := json.Marshal(tok.Encode("hello there world"))
	rec := do(s, "POST", "/detokenize", `{"model":"m","tokens":`+string(ids)+`}`)
	var out struct{ Prompt string }
	if rec.Code != 200 || json.Unmarshal(rec.Body.Bytes(), &out) != nil || out.Prompt != tok.Decode(tok.Encode("hello there world")) {
		t.Errorf("detokenize: %d %s", rec.Code, rec.Body)
	}
}
