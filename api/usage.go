package api

import (
	"bytes"
	"encoding/json"
)

// usage is the part of an OpenAI usage object the audit reads.
type usage struct {
	PromptTokens     int            `json:"prompt_tokens"`
	CompletionTokens int            `json:"completion_tokens"`
	Details          *cachedDetails `json:"prompt_tokens_details"`
	// The Responses API's names for the same numbers (normalized into the
	// fields above by fromResponses).
	InputTokens  int            `json:"input_tokens"`
	OutputTokens int            `json:"output_tokens"`
	InputDetails *cachedDetails `json:"input_tokens_details"`
}

type cachedDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

// fromResponses fills the chat/completions fields from the Responses API's
// (input_tokens, output_tokens, input_tokens_details) when only those are
// there.
func (u *usage) fromResponses() {
	if u.PromptTokens == 0 && u.CompletionTokens == 0 && u.Details == nil {
		u.PromptTokens, u.CompletionTokens, u.Details = u.InputTokens, u.OutputTokens, u.InputDetails
	}
}

// usageScanner finds the usage object in a relayed answer without holding
// the whole answer: for a stream it keeps the last SSE data line that
// carries usage, for a plain answer the body (bounded).
type usageScanner struct {
	stream  bool
	pending []byte // stream: the unfinished line
	found   []byte
	body    bytes.Buffer
}

const maxAuditBody = 1 << 20

func newUsageScanner(stream bool) *usageScanner { return &usageScanner{stream: stream} }

func (u *usageScanner) write(b []byte) {
	if !u.stream {
		if u.body.Len() < maxAuditBody {
			u.body.Write(b)
		}
		return
	}
	u.pending = append(u.pending, b...)
	for {
		i := bytes.IndexByte(u.pending, '\n')
		if i < 0 {
			break
		}
		line := bytes.TrimSpace(u.pending[:i])
		u.pending = u.pending[i+1:]
		if data, ok := bytes.CutPrefix(line, []byte("data:")); ok && bytes.Contains(data, []byte(`"usage"`)) {
			u.found = append(u.found[:0], bytes.TrimSpace(data)...)
		}
	}
	if len(u.pending) > maxAuditBody {
		u.pending = u.pending[:0]
	}
}

func (u *usageScanner) usage() (usage, bool) {
	src := u.found
	if !u.stream {
		src = u.body.Bytes()
	}
	// A Responses API answer nests it: the response object (plain) or the
	// response.completed event's "response" (streamed).
	var doc struct {
		Usage    *usage `json:"usage"`
		Response *struct {
			Usage *usage `json:"usage"`
		} `json:"response"`
	}
	if len(src) == 0 || json.Unmarshal(src, &doc) != nil {
		return usage{}, false
	}
	got := doc.Usage
	if got == nil && doc.Response != nil {
		got = doc.Response.Usage
	}
	if got == nil {
		return usage{}, false
	}
	got.fromResponses()
	return *got, true
}

// cachedTokens is the prompt tokens the engine served from its cache (0
// when it did not say).
func (u usage) cachedTokens() int {
	if u.Details == nil {
		return 0
	}
	return u.Details.CachedTokens
}
