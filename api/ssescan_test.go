package api

import (
	"testing"
)

// sseChunkSeeds are chunks as engines send them, and the shapes the scanner
// must hand to encoding/json.
var sseChunkSeeds = []string{
	`{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" w1","finish_reason":null}]}`,
	`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`,
	`{"choices":[{"delta":{"content":"Hi"}},{"delta":{"reasoning_content":"x"}},{"delta":{"tool_calls":[{"id":"t"}]}}]}`,
	`{"choices":[],"usage":{"prompt_tokens":2371,"completion_tokens":4,"total_tokens":2375}}`,
	`{"choices":[{"text":"a"}],"usage":{"completion_tokens":7}}`,
	`{"choices":[null,{"delta":null,"text":null}],"usage":null}`,
	`{"choices":[{"Text":"a"}]}`, `{"choices":[{"text":"a","text":""}]}`, `{"choices":[{"text":5}]}`,
	`{"choices":{"text":"a"}}`, `{"usage":{"completion_tokens":1.5}}`, `{"usage":{"completion_tokens":"3"}}`,
	`{"usage":[]}`, `{"choices":[{"delta":{"tool_calls":[ ]}}]}`, `{"choices":[{"delta":{"tool_calls":{}}}]}`,
	`{"choices":[{"text":"\u0000"}]}`, `{"choices":[{"delta":{"content":"é","reasoning":""}}]}`,
	`{"usage":{"completion_tokens":99999999999999999999}}`, `{"choices":[1]}`, `{"choices":[{"delta":"x"}]}`,
}

// TestAPISSEChunkScan: the engines' usual chunks are read without
// encoding/json, and each shape it cannot vouch for is left to it.
func TestAPISSEChunkScan(t *testing.T) {
	for _, tc := range []struct {
		chunk    string
		want     sseEvent
		scanned  bool // read by the scanner itself
		decodeOK bool
	}{
		{sseChunkSeeds[0], sseEvent{content: 1}, true, true},
		{sseChunkSeeds[1], sseEvent{}, true, true},
		{sseChunkSeeds[2], sseEvent{content: 3}, true, true},
		{sseChunkSeeds[3], sseEvent{hasUsage: true, completionTokens: 4}, true, true},
		{sseChunkSeeds[5], sseEvent{}, true, true},
		{`{"choices":[{"Text":"a"}]}`, sseEvent{content: 1}, false, true}, // case-folded key: encoding/json's match
		{`{"choices":[{"text":5}]}`, sseEvent{}, false, false},
		{`{"usage":{"completion_tokens":1.5}}`, sseEvent{}, false, false},
	} {
		e, ok := scanSSEChunk([]byte(tc.chunk))
		if ok != tc.scanned || ok && e != tc.want {
			t.Errorf("scan %s = %+v, %v; want %+v, %v", tc.chunk, e, ok, tc.want, tc.scanned)
		}
		e, ok = decodeSSEChunk([]byte(tc.chunk))
		if ok != tc.decodeOK || ok && e != tc.want {
			t.Errorf("decode %s = %+v, %v; want %+v, %v", tc.chunk, e, ok, tc.want, tc.decodeOK)
		}
	}
}

// FuzzAPISSEChunkMatchesJSON: whenever the scanner reads a chunk, its
// reading is encoding/json's.
func FuzzAPISSEChunkMatchesJSON(f *testing.F) {
	for _, s := range sseChunkSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		got, ok := scanSSEChunk(data)
		if !ok {
			return
		}
		want, wantOK := decodeSSEChunk(data)
		if !wantOK || got != want {
			t.Fatalf("%q: scanner %+v, encoding/json %+v (ok %v)", data, got, want, wantOK)
		}
	})
}

func BenchmarkAPISSEChunk(b *testing.B) {
	chunk := []byte(sseChunkSeeds[0])
	b.Run("scan", func(b *testing.B) {
		for b.Loop() {
			scanSSEChunk(chunk)
		}
	})
	b.Run("encoding-json", func(b *testing.B) {
		for b.Loop() {
			decodeSSEChunk(chunk)
		}
	})
}
