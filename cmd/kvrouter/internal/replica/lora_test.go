package replica

import (
	"slices"
	"strings"
	"testing"
)

// vLLM lists loaded adapters in /v1/models with the base model as parent.
func TestLoRAParseAdapters(t *testing.T) {
	cases := []struct {
		name, body string
		want       []string
		wantErr    bool
	}{
		{"vllm with two adapters", `{"object":"list","data":[{"id":"base","parent":null},{"id":"sql","parent":"base"},{"id":"chat","parent":"base"}]}`, []string{"sql", "chat"}, false},
		{"adapter of another base", `{"data":[{"id":"x","parent":"other"}]}`, nil, false},
		{"no parent field (kvmock, SGLang without adapters)", `{"data":[{"id":"base"}]}`, nil, false},
		{"the base listing itself as parent", `{"data":[{"id":"base","parent":"base"}]}`, nil, false},
		{"not JSON", `<html>`, nil, true},
	}
	for _, c := range cases {
		got, err := parseAdapters(strings.NewReader(c.body), "base")
		if (err != nil) != c.wantErr || !slices.Equal(got, c.want) {
			t.Errorf("%s: %v %v, want %v", c.name, got, err, c.want)
		}
	}
}
