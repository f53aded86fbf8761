package api

import (
	"bytes"
	"encoding/json"
)

// usage is the part of an OpenAI usage object the audit reads.
type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	Details          *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
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
	var doc struct {
		Usage *usage `json:"usage"`
	}
	if len(src) == 0 || json.Unmarshal(src, &doc) != nil || doc.Usage == nil {
		return usage{}, false
	}
	return *doc.Usage, true
}

// cachedTokens is the prompt tokens the engine served from its cache (0
// when it did not say).
func (u usage) cachedTokens() int {
	if u.Details == nil {
		return 0
	}
	return u.Details.CachedTokens
}
