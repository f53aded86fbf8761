package api

import (
	"encoding/json"
	"strconv"

	"github.com/kvrouter/kvrouter/api/jsonscan"
)

// sseEvent is what tokenScanner reads of one streamed chunk: how many of
// its choices carry output, and its usage.completion_tokens if it reports
// usage.
type sseEvent struct {
	content          int
	hasUsage         bool
	completionTokens int
}

// decodeSSEChunk reads a chunk with encoding/json, whose reading is the
// contract: ok false when it refuses the chunk.
func decodeSSEChunk(data []byte) (e sseEvent, ok bool) {
	var ch sseChunk
	if json.Unmarshal(data, &ch) != nil {
		return e, false
	}
	for _, c := range ch.Choices {
		if c.Text != "" || c.Delta != nil && (c.Delta.Content != "" || c.Delta.ReasoningContent != "" ||
			c.Delta.Reasoning != "" || len(c.Delta.ToolCalls) > 0) {
			e.content++
		}
	}
	if ch.Usage != nil {
		e.hasUsage, e.completionTokens = true, ch.Usage.CompletionTokens
	}
	return e, true
}

// scanSSEChunk is decodeSSEChunk without encoding/json's reflection, for
// the chunks engines send (every token's chunk passes here, after the
// client has it but on the relay's CPU): api/jsonscan finds the few values
// read, and any value whose reading could differ from encoding/json's
// (a key spelt in another case or repeated, an unexpected type, a count
// that is not an int) makes it answer ok false, so the caller decodes
// with encoding/json (FuzzAPISSEChunkMatchesJSON).
func scanSSEChunk(data []byte) (e sseEvent, ok bool) {
	var top [2][]byte
	if !jsonscan.TopInto(data, sseChunkKeys, top[:]) {
		return e, false
	}
	if choices := top[0]; !absentOrNull(choices) {
		elems, ok := jsonscan.Elements(choices)
		if !ok {
			return e, false // not an array: encoding/json's type error
		}
		for _, c := range elems {
			out, ok := choiceHasOutput(c)
			if !ok {
				return e, false
			}
			if out {
				e.content++
			}
		}
	}
	if usage := top[1]; !absentOrNull(usage) {
		if usage[0] != '{' {
			return e, false
		}
		var u [1][]byte
		if !jsonscan.TopInto(usage, sseUsageKeys, u[:]) {
			return e, false
		}
		e.hasUsage = true
		if n := u[0]; !absentOrNull(n) {
			v, err := strconv.ParseInt(string(n), 10, strconv.IntSize) // what encoding/json accepts into an int
			if err != nil {
				return e, false
			}
			e.completionTokens = int(v)
		}
	}
	return e, true
}

var (
	sseChunkKeys  = []string{"choices", "usage"}
	sseChoiceKeys = []string{"delta", "text"}
	sseDeltaKeys  = []string{"content", "reasoning_content", "reasoning", "tool_calls"}
	sseUsageKeys  = []string{"completion_tokens"}
)

// choiceHasOutput says whether one element of choices carries output (a
// non-empty text, delta content, reasoning or tool calls); ok false when
// encoding/json must read it.
func choiceHasOutput(c []byte) (out, ok bool) {
	if absentOrNull(c) {
		return false, true // a zero choice
	}
	if c[0] != '{' {
		return false, false
	}
	var f [2][]byte
	if !jsonscan.TopInto(c, sseChoiceKeys, f[:]) {
		return false, false
	}
	text, ok := nonEmptyString(f[1])
	if !ok {
		return false, false
	}
	delta := f[0]
	if absentOrNull(delta) {
		return text, true
	}
	if delta[0] != '{' {
		return false, false
	}
	var d [4][]byte
	if !jsonscan.TopInto(delta, sseDeltaKeys, d[:]) {
		return false, false
	}
	for _, v := range d[:3] {
		s, ok := nonEmptyString(v)
		if !ok {
			return false, false
		}
		text = text || s
	}
	if calls := d[3]; !absentOrNull(calls) {
		elems, ok := jsonscan.Elements(calls)
		if !ok {
			return false, false
		}
		text = text || len(elems) > 0
	}
	return text, true
}

// absentOrNull: absent (nil) or JSON null, which encoding/json leaves as the
// zero value.
func absentOrNull(v []byte) bool { return v == nil || string(v) == "null" }

// nonEmptyString says whether v, a raw JSON value or nil, is a string
// with at least one character; ok false when it is neither a string nor
// null (a type error to encoding/json). Only "" decodes to the empty
// string: an escape or an invalid byte decodes to at least one rune.
func nonEmptyString(v []byte) (nonEmpty, ok bool) {
	if absentOrNull(v) {
		return false, true
	}
	if v[0] != '"' {
		return false, false
	}
	return len(v) > 2, true
}
