// Package session reads which agent session a request belongs to, the way
// Dynamo's frontend does (docs/agents/session-ids.md and the router's
// session affinity): the canonical X-Dynamo-Session-* headers, the coding
// agents' native headers mapped as Dynamo maps them, the body's
// nvext.session_control, and OpenAI's prompt_cache_key. It parses only:
// what a session is bound to is the replica's business (fsm, sessions.go).
package session

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// MaxIDBytes bounds a session id (and a parent's): Dynamo's limit, and the
// replicated state's (fsm.MaxSessionIDBytes).
const MaxIDBytes = 256

// MaxTTL is the longest TTL a request may ask for (nvext.session_control's
// timeout), Dynamo's bound on --router-session-affinity-ttl-secs.
const MaxTTL = 31536000 * time.Second

// Header names (canonical Dynamo, then each coding agent's own).
const (
	HeaderID       = "X-Dynamo-Session-ID"
	HeaderParent   = "X-Dynamo-Parent-Session-ID"
	HeaderFinal    = "X-Dynamo-Session-Final"
	claudeSession  = "X-Claude-Code-Session-Id"
	claudeAgent    = "X-Claude-Code-Agent-Id"
	claudeParent   = "X-Claude-Code-Parent-Agent-Id"
	codexSession   = "Session-Id"
	opencodeID     = "X-Session-Id"
	opencodeParent = "X-Parent-Session-Id"
)

// Where a session id came from (Key.Source; metrics label).
const (
	SourceDynamo         = "x-dynamo-session-id"
	SourceClaudeAgent    = "x-claude-code-agent-id"
	SourceClaudeSession  = "x-claude-code-session-id"
	SourceCodex          = "session-id"
	SourceOpenCode       = "x-session-id"
	SourceSessionControl = "nvext.session_control"
	SourcePromptCacheKey = "prompt_cache_key"
)

// ErrInvalid marks a request whose session input is malformed: the API
// answers 400 naming the field, and nothing is bound or proposed.
var ErrInvalid = errors.New("invalid session")

// Key is a request's session: empty ID = none.
type Key struct {
	ID     string
	Parent string // the parent session (subagents), "" = none
	// Final: the session's last request (X-Dynamo-Session-Final: true, or
	// nvext.session_control.action "close"): its binding ends after it.
	Final bool
	// TTL is the idle TTL the request asked for (nvext.session_control
	// with action "open" and a timeout); 0 = the configured one.
	TTL    time.Duration
	Source string
}

// body is the part of a request body sessions read; every other field is
// ignored, as Dynamo's serde structs ignore unknown fields.
type body struct {
	PromptCacheKey json.RawMessage `json:"prompt_cache_key"`
	Nvext          struct {
		SessionControl json.RawMessage `json:"session_control"`
	} `json:"nvext"`
}

// control is Dynamo's nvext.session_control: session_id on every turn,
// action "open" on the first (timeout: its inactivity timeout in seconds,
// default 300) or "close" on the last.
type control struct {
	SessionID *string `json:"session_id"`
	Action    *string `json:"action"`
	Timeout   *uint64 `json:"timeout"`
}

// FromRequest reads a request's session from its headers and JSON body.
// Precedence (first present wins): X-Dynamo-Session-ID (with
// X-Dynamo-Parent-Session-ID); Claude Code's agent id (a child: parent its
// parent-agent id, else the root session) or session id; Codex's
// session-id; OpenCode's x-session-id (with x-parent-session-id);
// nvext.session_control.session_id; prompt_cache_key. Empty header values
// count as absent (Dynamo's filter). X-Dynamo-Session-Final applies to
// whichever id was chosen. A malformed id (over MaxIDBytes, control
// characters, invalid UTF-8), a session_control that is not Dynamo's shape
// (session_id missing or not a string, action not open or close, timeout
// negative or fractional or beyond MaxTTL) or a prompt_cache_key that is
// not a string is an error wrapping ErrInvalid; unknown fields are ignored.
func FromRequest(h http.Header, raw []byte) (Key, error) {
	var k Key
	var err error
	header := func(name string) string { return strings.TrimSpace(h.Get(name)) }
	switch {
	case header(HeaderID) != "":
		k = Key{ID: header(HeaderID), Parent: header(HeaderParent), Source: SourceDynamo}
	case header(claudeAgent) != "":
		k = Key{ID: header(claudeAgent), Parent: cmpOr(header(claudeParent), header(claudeSession)), Source: SourceClaudeAgent}
	case header(claudeSession) != "":
		k = Key{ID: header(claudeSession), Source: SourceClaudeSession}
	case header(codexSession) != "":
		k = Key{ID: header(codexSession), Source: SourceCodex}
	case header(opencodeID) != "":
		k = Key{ID: header(opencodeID), Parent: header(opencodeParent), Source: SourceOpenCode}
	}
	var b body
	if len(raw) > 0 {
		// The caller parsed the body already; a body that is not an
		// object simply has no session fields here.
		_ = json.Unmarshal(raw, &b)
	}
	if sc := b.Nvext.SessionControl; len(sc) > 0 && string(sc) != "null" {
		c, err := readControl(sc)
		if err != nil {
			return Key{}, err
		}
		if k.ID == "" {
			k = Key{ID: *c.SessionID, Source: SourceSessionControl}
		}
		if k.ID == *c.SessionID && c.Action != nil {
			switch *c.Action {
			case "close":
				k.Final = true
			case "open":
				if c.Timeout != nil {
					k.TTL = time.Duration(*c.Timeout) * time.Second
				}
			}
		}
	}
	if pk := b.PromptCacheKey; len(pk) > 0 && string(pk) != "null" {
		var key string
		if err := json.Unmarshal(pk, &key); err != nil {
			return Key{}, fmt.Errorf("prompt_cache_key must be a string: %w", ErrInvalid)
		}
		if k.ID == "" && key != "" {
			k = Key{ID: key, Source: SourcePromptCacheKey}
		}
	}
	if k.ID == "" {
		return Key{}, nil
	}
	if err = CheckID(k.Source, k.ID); err != nil {
		return Key{}, err
	}
	if k.Parent != "" {
		if err = CheckID(k.Source+" parent", k.Parent); err != nil {
			return Key{}, err
		}
		if k.Parent == k.ID {
			k.Parent = "" // a root agent naming itself: no parent
		}
	}
	if final(header(HeaderFinal)) {
		k.Final = true
	}
	return k, nil
}

// readControl reads nvext.session_control in Dynamo's shape.
func readControl(raw json.RawMessage) (control, error) {
	var c control
	if err := json.Unmarshal(raw, &c); err != nil {
		return c, fmt.Errorf("nvext.session_control: want {\"session_id\": string, \"action\": \"open\"|\"close\", \"timeout\": seconds}: %w", ErrInvalid)
	}
	switch {
	case c.SessionID == nil || *c.SessionID == "":
		return c, fmt.Errorf("nvext.session_control.session_id is required: %w", ErrInvalid)
	case c.Action != nil && *c.Action != "open" && *c.Action != "close":
		return c, fmt.Errorf("nvext.session_control.action %q must be open or close: %w", *c.Action, ErrInvalid)
	case c.Timeout != nil && (*c.Timeout < 1 || time.Duration(*c.Timeout) > MaxTTL/time.Second):
		return c, fmt.Errorf("nvext.session_control.timeout %d outside [1,%d] seconds: %w", *c.Timeout, int64(MaxTTL/time.Second), ErrInvalid)
	}
	return c, nil
}

// CheckID is the rule for a session id: 1..MaxIDBytes bytes of valid
// UTF-8 without control characters.
func CheckID(what, id string) error {
	switch {
	case len(id) > MaxIDBytes:
		return fmt.Errorf("%s is %d bytes, limit %d: %w", what, len(id), MaxIDBytes, ErrInvalid)
	case !utf8.ValidString(id):
		return fmt.Errorf("%s is not valid UTF-8: %w", what, ErrInvalid)
	case strings.ContainsFunc(id, unicode.IsControl):
		return fmt.Errorf("%s holds a control character: %w", what, ErrInvalid)
	}
	return nil
}

// final reads X-Dynamo-Session-Final: "true" (any case) or "1" ends the
// session; anything else (false, empty, malformed) is ignored, as Dynamo
// ignores a malformed hint header.
func final(v string) bool { return strings.EqualFold(v, "true") || v == "1" }

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}
