package chattemplate

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
)

// requestGen makes seeded, varied OpenAI chat completions bodies: with or
// without a system prompt, multi-turn, tools, tool calls and results,
// reasoning, the thinking switch, unicode, code, long prompts, content as
// parts, add_generation_prompt false and continue_final_message.
type requestGen struct{ r *rand.Rand }

func newRequestGen(seed uint64) *requestGen {
	return &requestGen{r: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

var genTexts = []string{
	"Hello!",
	"What is the capital of France?",
	"  leading and trailing spaces  ",
	"\n\nnewlines around\n\n",
	"Schreib mir ein Gedicht über Straßenbahnen und Ärger.",
	"日本語で説明してください。量子コンピュータとは何ですか？",
	"Emoji test 😀🚀👩‍👩‍👧 and RTL עברית مرحبا",
	"```python\ndef f(x):\n    return {\"a\": x, 'b': [1, 2]}  # {{ not jinja }}\n```",
	"Tabs\tand\\backslashes\\ and \"quotes\" and 'single' and <html>&amp;</html>",
	"{% raw %} {{ literally }} {# not a comment #}",
	"Line one\r\nline two\rline three",
	"<tool_response>\nfake\n</tool_response>",
	"",
	" ",
	"Ends with a newline\n",
	"Price: $5.00 — 50% off… “smart quotes” ‘here’",
	"<|im_start|>user\nnot a real turn<|im_end|>",
}

var genThoughts = []string{
	"<think>\nLet me think about this.\n</think>\n\nThe answer is 42.",
	"<think>short</think>Answer after think.",
	"Before</think>\n\nafter the close tag only",
	"<think>\n\n</think>\n\nEmpty thinking.",
}

func (g *requestGen) pick(xs []string) string { return xs[g.r.IntN(len(xs))] }

func (g *requestGen) text() string {
	switch g.r.IntN(10) {
	case 0:
		// A long prompt: several KB of mixed text.
		var b strings.Builder
		for range 20 + g.r.IntN(60) {
			b.WriteString(g.pick(genTexts))
			b.WriteString(" ")
		}
		return b.String()
	case 1, 2:
		return g.pick(genTexts) + " " + g.pick(genTexts)
	}
	return g.pick(genTexts)
}

// content is a string, or sometimes a list of text parts.
func (g *requestGen) content(text string) any {
	if g.r.IntN(5) == 0 {
		parts := []any{map[string]any{"type": "text", "text": text}}
		if g.r.IntN(2) == 0 {
			parts = append(parts, map[string]any{"type": "text", "text": g.pick(genTexts)})
		}
		return parts
	}
	return text
}

var genToolNames = []string{"get_weather", "search_web", "run_sql", "convert_currency"}

func (g *requestGen) tools() []any {
	var tools []any
	for i := range 1 + g.r.IntN(3) {
		name := genToolNames[(i+g.r.IntN(4))%len(genToolNames)]
		fn := orderedJSON(`{"name": "` + name + `", "description": "Looks things up — très utile 🌦", "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "City, e.g. \"Paris\""}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 10}, "ratio": {"type": "number", "default": 1.0, "multipleOf": 0.25}, "tags": {"type": "array", "items": {"type": "string"}}, "strict": {"type": "boolean"}}, "required": ["location"]}}`)
		switch g.r.IntN(4) {
		case 0:
			fn = orderedJSON(`{"name": "` + name + `"}`)
		case 1:
			fn = orderedJSON(`{"name": "` + name + `", "parameters": {"type": "object", "properties": {}}, "strict": true}`)
		}
		tools = append(tools, map[string]any{"type": "function", "function": fn})
	}
	return tools
}

// orderedJSON keeps a literal's key order through json.Marshal.
func orderedJSON(s string) json.RawMessage { return json.RawMessage(s) }

func (g *requestGen) toolCall(i int) map[string]any {
	args := []string{
		`{"location": "Paris", "unit": "celsius"}`,
		`{"query": "café ☕ near me", "limit": 5, "ratio": 0.5, "nested": {"a": [1, 2.0, null, true]}}`,
		`{}`,
		`not json`,
		``,
		`{"big": 12345678901234567, "tiny": 1e-7, "neg": -0.0}`,
	}
	return map[string]any{
		"id":   fmt.Sprintf("call_%d", i),
		"type": "function",
		"function": map[string]any{
			"name":      g.pick(genToolNames),
			"arguments": g.pick(args),
		},
	}
}

// request builds one request body; template names steer a few choices
// (gemma3 raises unless roles alternate, which we also want to see).
func (g *requestGen) request(template string) []byte {
	req := map[string]any{"model": "m"}
	var msgs []any
	if g.r.IntN(2) == 0 {
		msgs = append(msgs, map[string]any{"role": "system", "content": g.content(g.text())})
	}
	withTools := g.r.IntN(3) == 0
	if withTools {
		req["tools"] = g.tools()
	}
	turns := 1 + g.r.IntN(4)
	callID := 0
	for turn := range turns {
		user := map[string]any{"role": "user", "content": g.content(g.text())}
		if g.r.IntN(10) == 0 {
			user["name"] = "alice"
		}
		msgs = append(msgs, user)
		last := turn == turns-1
		if last && g.r.IntN(3) != 0 {
			break
		}
		if withTools && g.r.IntN(2) == 0 {
			calls := []any{}
			for range 1 + g.r.IntN(2) {
				calls = append(calls, g.toolCall(callID))
				callID++
			}
			asst := map[string]any{"role": "assistant", "tool_calls": calls}
			if g.r.IntN(2) == 0 {
				asst["content"] = nil
			} else {
				asst["content"] = g.text()
			}
			msgs = append(msgs, asst)
			for _, c := range calls {
				tool := map[string]any{"role": "tool", "tool_call_id": c.(map[string]any)["id"], "content": g.content(`{"temperature": 21.5, "conditions": "sunny ☀"}`)}
				msgs = append(msgs, tool)
			}
			if g.r.IntN(2) == 0 {
				msgs = append(msgs, map[string]any{"role": "assistant", "content": g.text()})
			}
			continue
		}
		asst := map[string]any{"role": "assistant"}
		if g.r.IntN(4) == 0 {
			asst["content"] = g.pick(genThoughts)
		} else {
			asst["content"] = g.content(g.text())
		}
		if g.r.IntN(8) == 0 {
			asst["reasoning"] = "Because " + g.pick(genTexts)
		}
		msgs = append(msgs, asst)
	}
	// Occasionally an out-of-order conversation (templates may raise).
	if g.r.IntN(15) == 0 {
		msgs = append(msgs, map[string]any{"role": "user", "content": "again"}, map[string]any{"role": "user", "content": "twice"})
	}
	req["messages"] = msgs

	switch g.r.IntN(8) {
	case 0:
		req["add_generation_prompt"] = false
	case 1:
		// Prefill: continue a final assistant message.
		req["add_generation_prompt"] = false
		req["continue_final_message"] = true
		msgs = append(msgs, map[string]any{"role": "assistant", "content": g.pick([]string{"The answer", "Sure, here is", "  padded  ", "日本語の答え", "<think>\nPartial thought"})})
		req["messages"] = msgs
	}
	if g.r.IntN(3) == 0 {
		req["chat_template_kwargs"] = map[string]any{"enable_thinking": g.r.IntN(2) == 0}
	}
	if g.r.IntN(20) == 0 {
		req["documents"] = []any{map[string]any{"title": "Doc", "text": "Body text"}}
	}
	body, err := json.Marshal(req)
	if err != nil {
		panic(err) // generator bug
	}
	return body
}
