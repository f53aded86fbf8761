package api

import "testing"

// The audit reads usage from every answer shape a worker sends: chat and
// completions (prompt_tokens, prompt_tokens_details), the Responses API
// (input_tokens, input_tokens_details; nested in "response" when
// streamed), in one piece or split across reads.
func TestAPIUsageScanner(t *testing.T) {
	cases := []struct {
		name                   string
		stream                 bool
		body                   string
		ok                     bool
		prompt, output, cached int
	}{
		{"chat", false, `{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":16}}}`, true, 40, 5, 16},
		{"chat without details", false, `{"usage":{"prompt_tokens":40,"completion_tokens":5}}`, true, 40, 5, 0},
		{"chat stream", true, "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n", true, 40, 2, 32},
		{"responses", false, `{"object":"response","output":[],"usage":{"input_tokens":50,"output_tokens":7,"input_tokens_details":{"cached_tokens":48},"total_tokens":57}}`, true, 50, 7, 48},
		{"responses stream", true, "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\"}\n\nevent: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\"usage\":{\"input_tokens\":50,\"output_tokens\":3,\"input_tokens_details\":{\"cached_tokens\":16}}}}\n\n", true, 50, 3, 16},
		{"no usage", false, `{"choices":[]}`, false, 0, 0, 0},
		{"stream without usage", true, "data: {\"choices\":[]}\n\ndata: [DONE]\n\n", false, 0, 0, 0},
		{"malformed", false, `{"usage":`, false, 0, 0, 0},
	}
	for _, c := range cases {
		for _, split := range []int{0, 7} { // whole, and in 7-byte reads
			sc := newUsageScanner(c.stream)
			b := []byte(c.body)
			if split == 0 {
				sc.write(b)
			} else {
				for len(b) > 0 {
					n := min(split, len(b))
					sc.write(b[:n])
					b = b[n:]
				}
			}
			u, ok := sc.usage()
			if ok != c.ok || u.PromptTokens != c.prompt || u.CompletionTokens != c.output || u.cachedTokens() != c.cached {
				t.Errorf("%s (reads of %d): ok %v, %d prompt, %d output, %d cached; want %v %d %d %d",
					c.name, split, ok, u.PromptTokens, u.CompletionTokens, u.cachedTokens(), c.ok, c.prompt, c.output, c.cached)
			}
		}
	}
}
