package jsonscan

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

// testKeys are the keys the tests ask for; probe is encoding/json's reading
// of them, which Top must agree with whenever it vouches for a body.
var testKeys = []string{"model", "prompt", "stream", "n"}

type probe struct {
	Model  json.RawMessage `json:"model"`
	Prompt json.RawMessage `json:"prompt"`
	Stream json.RawMessage `json:"stream"`
	N      json.RawMessage `json:"n"`
}

func (p probe) vals() [][]byte { return [][]byte{p.Model, p.Prompt, p.Stream, p.N} }

// checkAgainstEncodingJSON fails when Top vouches for a body that
// encoding/json reads differently or refuses.
func checkAgainstEncodingJSON(t *testing.T, body []byte) (ok bool) {
	t.Helper()
	vals, ok := Top(body, testKeys)
	if !ok {
		if vals != nil {
			t.Errorf("Top(%q): values without ok", body)
		}
		return false
	}
	var p probe
	if err := json.Unmarshal(body, &p); err != nil {
		t.Fatalf("Top vouched for %q, encoding/json refuses it: %v", body, err)
	}
	for i, want := range p.vals() {
		if !bytes.Equal(vals[i], want) {
			t.Fatalf("Top(%q) %s = %q, encoding/json reads %q", body, testKeys[i], vals[i], want)
		}
	}
	return true
}

func TestJSONScanTop(t *testing.T) {
	long := `"` + strings.Repeat("bakemo ", 3000) + `"`
	for _, tc := range []struct {
		name, body string
		ok         bool
	}{
		{"completion", `{"model":"m","prompt":` + long + `,"stream":true,"stream_options":{"include_usage":true},"max_tokens":4}`, true},
		{"spaces everywhere", " \t\r\n{ \"model\" : \"m\" , \"n\" : -1.5e+3 , \"x\" : [ 1 , { } , [ ] , null ] } \n", true},
		{"empty object", `{}`, true},
		{"nested objects and escapes elsewhere", `{"a":{"b":{"c":["\u00e9\n\"",true,false,null,0,-0.0,1E9]}},"prompt":"ok"}`, true},
		{"non-ASCII in values", `{"prompt":"héllo 你好","model":"m"}`, true},
		{"invalid UTF-8 in a value (valid JSON to encoding/json)", "{\"prompt\":\"a\xffb\"}", true},
		{"an escaped value", `{"prompt":"a\"b\\c\u0041"}`, true},
		{"not an object", `["model"]`, false},
		{"null", `null`, false},
		{"empty", ``, false},
		{"trailing garbage", `{"model":"m"} x`, false},
		{"two values", `{"model":"m"}{}`, false},
		{"trailing comma", `{"model":"m",}`, false},
		{"missing colon", `{"model" "m"}`, false},
		{"unterminated string", `{"model":"m`, false},
		{"control character in a string", "{\"prompt\":\"a\nb\"}", false},
		{"bad escape", `{"prompt":"a\qb"}`, false},
		{"short unicode escape", `{"prompt":"\u12"}`, false},
		{"leading zero", `{"n":01}`, false},
		{"bare minus", `{"n":-}`, false},
		{"dot without digits", `{"n":1.}`, false},
		{"exponent without digits", `{"n":1e}`, false},
		{"plus sign", `{"n":+1}`, false},
		{"bad literal", `{"stream":tru}`, false},
		{"single quotes", `{'model':'m'}`, false},
		{"repeated key", `{"model":"a","model":"b"}`, false},
		{"case-folded key", `{"Model":"m"}`, false},
		{"escaped key", `{"mod\u0065l":"m"}`, false},
		{"non-ASCII key (Unicode folding)", `{"ſtream":true}`, false},
		{"unknown keys only", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":3}`, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if ok := checkAgainstEncodingJSON(t, []byte(tc.body)); ok != tc.ok {
				t.Errorf("ok = %v, want %v", ok, tc.ok)
			}
			if !tc.ok && json.Valid([]byte(tc.body)) && strings.HasPrefix(strings.TrimSpace(tc.body), "{") {
				t.Logf("valid JSON left to encoding/json: %s", tc.body)
			}
		})
	}
}

func TestJSONScanTopAbsentKeys(t *testing.T) {
	vals, ok := Top([]byte(`{"stream":false}`), testKeys)
	if !ok || vals[0] != nil || vals[1] != nil || string(vals[2]) != "false" || vals[3] != nil {
		t.Fatalf("got %q %v", vals, ok)
	}
}

func TestJSONScanTopDepth(t *testing.T) {
	deep := func(n int) []byte {
		return []byte(`{"a":` + strings.Repeat("[", n-1) + strings.Repeat("]", n-1) + `}`)
	}
	if !checkAgainstEncodingJSON(t, deep(maxDepth)) {
		t.Error("nesting at encoding/json's limit refused")
	}
	if checkAgainstEncodingJSON(t, deep(maxDepth+1)) {
		t.Error("nesting past encoding/json's limit accepted")
	}
}

// FuzzJSONScanTop: whatever Top vouches for, encoding/json accepts and
// reads the same values from.
func FuzzJSONScanTop(f *testing.F) {
	for _, s := range []string{`{"model":"m","prompt":"a b c","stream":true,"n":2}`, `{"prompt":["a",[1,2]],"x":{"y":null}}`,
		`{"Model":"m"}`, `{"n":-0.5E-7}`, "{\"prompt\":\"\\u00e9\xff\"}", `[1]`, `{"a":"b",}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		checkAgainstEncodingJSON(t, body)
	})
}

func BenchmarkJSONScanTop(b *testing.B) {
	body := []byte(`{"model":"m","prompt":"` + strings.Repeat("bakemo ", 2400) + `","max_tokens":64,"stream":true,"stream_options":{"include_usage":true}}`)
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if _, ok := Top(body, testKeys); !ok {
			b.Fatal("refused")
		}
	}
}

// TestJSONScanStopsRun: the eight-byte test agrees with strStop for every
// byte value in every position.
func TestJSONScanStopsRun(t *testing.T) {
	for pos := range 8 {
		for c := range 256 {
			w := uint64(0x6161616161616161) // "aaaaaaaa"
			w = w&^(0xff<<(8*pos)) | uint64(c)<<(8*pos)
			if got := stopsRun(w); got != strStop[c] {
				t.Fatalf("byte %#x at %d: stopsRun %v, strStop %v", c, pos, got, strStop[c])
			}
		}
	}
}

// FuzzJSONScanElements: Elements splits exactly the arrays encoding/json
// reads as []json.RawMessage, into the same elements.
func FuzzJSONScanElements(f *testing.F) {
	for _, s := range []string{`[]`, ` [ ] `, `[1,"a",{"b":[2]},null]`, `[1,]`, `{"a":1}`, `[1] x`, `["\u00e9", true, -0.5e3]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		got, ok := Elements(data)
		var want []json.RawMessage
		err := json.Unmarshal(data, &want)
		if wantOK := err == nil && bytes.HasPrefix(bytes.TrimLeft(data, " \t\r\n"), []byte("[")); ok != wantOK {
			t.Fatalf("%q: Elements ok %v, encoding/json %v", data, ok, err)
		}
		if !ok {
			return
		}
		if len(got) != len(want) {
			t.Fatalf("%q: %d elements, encoding/json %d", data, len(got), len(want))
		}
		for i := range got {
			if !bytes.Equal(got[i], want[i]) {
				t.Fatalf("%q: element %d %q, encoding/json %q", data, i, got[i], want[i])
			}
		}
	})
}
