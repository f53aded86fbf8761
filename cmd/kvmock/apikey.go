package main

import (
	"crypto/subtle"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
)

// Worker-side authentication and the headers a router forwards.
//
// --api-key is vLLM's: with it, /v1/* answers 401 unless the request
// carries "Authorization: Bearer <key>" (the health, metrics and tokenizer
// endpoints stay open, as vLLM's do). Each refusal is counted
// (requests.unauthorized in /stats, kvmock_unauthorized_requests_total).
//
// kvmock also records what reaches it of the client's request identity —
// X-Request-Id (vLLM takes it as its own request id) and W3C traceparent —
// so a test through a router can see they crossed it (/stats "forwarded").

// forwardedHeaders counts and keeps the last of the identity headers seen.
type forwardedHeaders struct {
	withRequestID, withTraceparent atomic.Uint64

	mu                         sync.Mutex
	lastRequestID, lastTraceID string
}

func (f *forwardedHeaders) note(h http.Header) {
	id, tp := h.Get("X-Request-Id"), h.Get("Traceparent")
	if id != "" {
		f.withRequestID.Add(1)
	}
	if tp != "" {
		f.withTraceparent.Add(1)
	}
	if id == "" && tp == "" {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if id != "" {
		f.lastRequestID = id
	}
	if tp != "" {
		f.lastTraceID = tp
	}
}

// forwardedDoc is the /stats view of forwardedHeaders.
type forwardedDoc struct {
	WithRequestID   uint64 `json:"with_request_id"`
	WithTraceparent uint64 `json:"with_traceparent"`
	LastRequestID   string `json:"last_request_id,omitempty"`
	LastTraceparent string `json:"last_traceparent,omitempty"`
}

func (f *forwardedHeaders) doc() forwardedDoc {
	f.mu.Lock()
	defer f.mu.Unlock()
	return forwardedDoc{WithRequestID: f.withRequestID.Load(), WithTraceparent: f.withTraceparent.Load(),
		LastRequestID: f.lastRequestID, LastTraceparent: f.lastTraceID}
}

// guard wraps the API handler: identity headers are recorded, and with an
// API key /v1/* needs the right bearer token.
func (m *Mock) guard(h http.Handler) http.Handler {
	key := []byte(m.cfg.APIKey)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/v1/") {
			if len(key) > 0 && !bearerMatches(r.Header.Get("Authorization"), key) {
				m.ctr.unauthorized.Add(1)
				m.log.Warn("request without this worker's API key refused", "path", r.URL.Path,
					"authorization", authShape(r.Header.Get("Authorization")))
				writeError(w, http.StatusUnauthorized, "invalid_request_error", "invalid_api_key",
					"Unauthorized: this worker was started with --api-key and the request does not carry it as a bearer token")
				return
			}
			m.fwd.note(r.Header)
		}
		h.ServeHTTP(w, r)
	})
}

// bearerMatches compares in constant time: the key is a secret.
func bearerMatches(header string, key []byte) bool {
	tok, ok := strings.CutPrefix(header, "Bearer ")
	return ok && subtle.ConstantTimeCompare([]byte(tok), key) == 1
}

// authShape describes an Authorization header for a log line without its
// secret: absent, a bearer token, or another scheme.
func authShape(h string) string {
	switch {
	case h == "":
		return "absent"
	case strings.HasPrefix(h, "Bearer "):
		return "a bearer token that is not this worker's key"
	default:
		return "not a bearer token"
	}
}
