package session

import (
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"
)

func TestAPISessionFromRequest(t *testing.T) {
	long := strings.Repeat("a", MaxIDBytes)
	for _, tc := range []struct {
		name    string
		headers map[string]string
		body    string
		want    Key
		err     string // substring of the 400's message; "" = accepted
	}{
		{"none", nil, `{"model":"m"}`, Key{}, ""},
		{"dynamo", map[string]string{"X-Dynamo-Session-ID": "run-42:researcher", "X-Dynamo-Parent-Session-ID": "run-42"}, `{}`,
			Key{ID: "run-42:researcher", Parent: "run-42", Source: SourceDynamo}, ""},
		{"dynamo final", map[string]string{"x-dynamo-session-id": " s ", "x-dynamo-session-final": "TRUE"}, ``,
			Key{ID: "s", Final: true, Source: SourceDynamo}, ""},
		{"final false", map[string]string{"X-Dynamo-Session-ID": "s", "X-Dynamo-Session-Final": "false"}, ``, Key{ID: "s", Source: SourceDynamo}, ""},
		{"final malformed is ignored", map[string]string{"X-Dynamo-Session-ID": "s", "X-Dynamo-Session-Final": "yes please"}, ``, Key{ID: "s", Source: SourceDynamo}, ""},
		{"dynamo wins over the agents", map[string]string{"X-Dynamo-Session-ID": "d", "x-claude-code-session-id": "c", "session-id": "x"}, ``,
			Key{ID: "d", Source: SourceDynamo}, ""},
		{"empty dynamo header is absent", map[string]string{"X-Dynamo-Session-ID": "", "session-id": "codex-1"}, ``, Key{ID: "codex-1", Source: SourceCodex}, ""},
		{"claude root", map[string]string{"x-claude-code-session-id": "root"}, ``, Key{ID: "root", Source: SourceClaudeSession}, ""},
		{"claude top-level child", map[string]string{"x-claude-code-session-id": "root", "x-claude-code-agent-id": "child"}, ``,
			Key{ID: "child", Parent: "root", Source: SourceClaudeAgent}, ""},
		{"claude nested child", map[string]string{"x-claude-code-session-id": "root", "x-claude-code-agent-id": "grandchild", "x-claude-code-parent-agent-id": "child"}, ``,
			Key{ID: "grandchild", Parent: "child", Source: SourceClaudeAgent}, ""},
		{"claude final", map[string]string{"x-claude-code-session-id": "root", "X-Dynamo-Session-Final": "true"}, ``,
			Key{ID: "root", Final: true, Source: SourceClaudeSession}, ""},
		{"codex", map[string]string{"session-id": "019a-codex"}, ``, Key{ID: "019a-codex", Source: SourceCodex}, ""},
		{"opencode", map[string]string{"x-session-id": "ses_1", "x-parent-session-id": "ses_0"}, ``, Key{ID: "ses_1", Parent: "ses_0", Source: SourceOpenCode}, ""},
		{"opencode self-parent", map[string]string{"x-session-id": "ses_1", "x-parent-session-id": "ses_1"}, ``, Key{ID: "ses_1", Source: SourceOpenCode}, ""},
		{"session_control", nil, `{"nvext":{"session_control":{"session_id":"sub-1"}}}`, Key{ID: "sub-1", Source: SourceSessionControl}, ""},
		{"session_control open with timeout", nil, `{"nvext":{"session_control":{"session_id":"sub-1","action":"open","timeout":60,"future":1}}}`,
			Key{ID: "sub-1", TTL: time.Minute, Source: SourceSessionControl}, ""},
		{"session_control close", nil, `{"nvext":{"session_control":{"session_id":"sub-1","action":"close"}}}`,
			Key{ID: "sub-1", Final: true, Source: SourceSessionControl}, ""},
		{"session_control of another session than the header's", map[string]string{"X-Dynamo-Session-ID": "h"},
			`{"nvext":{"session_control":{"session_id":"b","action":"close"}}}`, Key{ID: "h", Source: SourceDynamo}, ""},
		{"prompt_cache_key", nil, `{"prompt_cache_key":"user-7-conv-3"}`, Key{ID: "user-7-conv-3", Source: SourcePromptCacheKey}, ""},
		{"prompt_cache_key unicode", nil, `{"prompt_cache_key":"ключ"}`, Key{ID: "ключ", Source: SourcePromptCacheKey}, ""},
		{"prompt_cache_key empty", nil, `{"prompt_cache_key":""}`, Key{}, ""},
		{"prompt_cache_key null", nil, `{"prompt_cache_key":null}`, Key{}, ""},
		{"header wins over prompt_cache_key", map[string]string{"X-Dynamo-Session-ID": "h"}, `{"prompt_cache_key":"b"}`, Key{ID: "h", Source: SourceDynamo}, ""},
		{"id at the limit", map[string]string{"X-Dynamo-Session-ID": long}, ``, Key{ID: long, Source: SourceDynamo}, ""},
		{"unknown nvext fields", nil, `{"nvext":{"agent_hints":{"bogus":1},"session_kontrol":2}}`, Key{}, ""},

		{"id over the limit", map[string]string{"X-Dynamo-Session-ID": long + "a"}, ``, Key{}, "257 bytes, limit 256"},
		{"parent over the limit", map[string]string{"X-Dynamo-Session-ID": "s", "X-Dynamo-Parent-Session-ID": long + "a"}, ``, Key{}, "parent is 257 bytes"},
		{"claude agent over the limit", map[string]string{"x-claude-code-agent-id": long + "a"}, ``, Key{}, "limit 256"},
		{"invalid utf-8", map[string]string{"session-id": "a\xffb"}, ``, Key{}, "not valid UTF-8"},
		{"control character in the body", nil, `{"prompt_cache_key":"a\u0007b"}`, Key{}, "control character"},
		{"prompt_cache_key not a string", nil, `{"prompt_cache_key":42}`, Key{}, "must be a string"},
		{"prompt_cache_key over the limit", nil, `{"prompt_cache_key":"` + long + `b"}`, Key{}, "limit 256"},
		{"session_control without id", nil, `{"nvext":{"session_control":{"action":"open"}}}`, Key{}, "session_id is required"},
		{"session_control id not a string", nil, `{"nvext":{"session_control":{"session_id":7}}}`, Key{}, "nvext.session_control: want"},
		{"session_control bad action", nil, `{"nvext":{"session_control":{"session_id":"s","action":"reopen"}}}`, Key{}, "must be open or close"},
		{"session_control negative timeout", nil, `{"nvext":{"session_control":{"session_id":"s","action":"open","timeout":-5}}}`, Key{}, "nvext.session_control: want"},
		{"session_control zero timeout", nil, `{"nvext":{"session_control":{"session_id":"s","action":"open","timeout":0}}}`, Key{}, "outside [1,31536000]"},
		{"session_control huge timeout", nil, `{"nvext":{"session_control":{"session_id":"s","timeout":31536001}}}`, Key{}, "outside [1,31536000]"},
		{"session_control not an object", nil, `{"nvext":{"session_control":"s"}}`, Key{}, "nvext.session_control: want"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := http.Header{}
			for k, v := range tc.headers {
				h.Set(k, v)
			}
			got, err := FromRequest(h, []byte(tc.body))
			if tc.err != "" {
				if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("got %+v (%v), want %+v", got, err, tc.want)
			}
		})
	}
}

// FuzzSessionFromRequest: any header value and body never panic; an
// accepted key always satisfies the replicated state's id rules.
func FuzzSessionFromRequest(f *testing.F) {
	f.Add("s", "p", `{"prompt_cache_key":"k"}`)
	f.Add("", "", `{"nvext":{"session_control":{"session_id":"s","action":"open","timeout":60}}}`)
	f.Add(strings.Repeat("x", 300), "", `{}`)
	f.Add("", "", `{"prompt_cache_key":[1]}`)
	f.Fuzz(func(t *testing.T, id, parent, body string) {
		h := http.Header{}
		h[http.CanonicalHeaderKey(HeaderID)] = []string{id}
		h[http.CanonicalHeaderKey(HeaderParent)] = []string{parent}
		k, err := FromRequest(h, []byte(body))
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			return
		}
		if k.ID == "" {
			return
		}
		if CheckID("id", k.ID) != nil || k.ID == "" || (k.Parent != "" && CheckID("parent", k.Parent) != nil) || k.TTL < 0 || k.TTL > MaxTTL {
			t.Fatalf("accepted a key the state would refuse: %+v", k)
		}
	})
}
