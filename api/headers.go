package api

import (
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"net/textproto"
	"slices"
	"strings"

	"github.com/gin-gonic/gin"
)

// Hop-by-hop headers (RFC 9110 §7.6.1) describe one connection, not the
// message: the client's connection to us, or ours to the worker. A proxy
// that copies them tells one side about the other's connection (a
// worker's "Connection: close" or "Keep-Alive" reaching the client, a
// client's "Upgrade" reaching the worker).

// isHopByHop reports a canonical header name that never crosses the proxy.
func isHopByHop(name string) bool {
	switch name {
	case "Connection", "Keep-Alive", "Te", "Trailer", "Transfer-Encoding", "Upgrade":
		return true
	}
	return strings.HasPrefix(name, "Proxy-")
}

// connectionListed is the canonical names h's Connection header lists,
// which are hop-by-hop too. (Go's client deletes a response's Connection
// header when it says "close", and with it the names it listed, which then
// cross: a limit of what net/http hands us.) nil when there is none, as on
// most requests and answers: nothing to allocate.
func connectionListed(h http.Header) []string {
	var out []string
	for _, v := range h["Connection"] {
		for name := range strings.SplitSeq(v, ",") {
			if name = textproto.TrimString(name); name != "" {
				out = append(out, textproto.CanonicalMIMEHeaderKey(name))
			}
		}
	}
	return out
}

// crossing reports whether header name crosses the proxy: not hop-by-hop
// by its name nor listed in its message's Connection header (listed).
func crossing(name string, listed []string) bool {
	return !isHopByHop(name) && !slices.Contains(listed, name)
}

// copyHeaders sets dst[name] for every name of src that keep accepts,
// values copied into one backing array (one allocation whatever the number
// of headers; http.Header.Clone's way). Values dst has for a name already
// are kept in front, as Add would.
func copyHeaders(dst, src http.Header, keep func(name string) bool) {
	n := 0
	for name, vs := range src {
		if keep(name) {
			n += len(vs)
		}
	}
	if n == 0 {
		return
	}
	backing := make([]string, 0, n)
	for name, vs := range src {
		if !keep(name) {
			continue
		}
		if old := dst[name]; len(old) > 0 {
			dst[name] = append(old[:len(old):len(old)], vs...)
			continue
		}
		backing = append(backing, vs...)
		dst[name] = backing[len(backing)-len(vs) : len(backing) : len(backing)]
	}
}

// copyEndToEnd adds src's end-to-end headers to dst. Content-Length stays
// behind too: the relayed body is streamed, and may be cut short.
func copyEndToEnd(dst, src http.Header) {
	listed := connectionListed(src)
	copyHeaders(dst, src, func(name string) bool { return name != "Content-Length" && crossing(name, listed) })
}

// Which client headers reach a worker: every end-to-end header except
// those below (a deny-list, so the request ids, trace context, tenant and
// custom headers that clients and gateways rely on reach the engine):
//   - Authorization, Cookie, X-Api-Key, Api-Key: the client's credentials
//     for this router (or for a gateway in front of it: Azure OpenAI and
//     many API gateways take "api-key" or "x-api-key") are not the
//     worker's business (a worker API key replaces them,
//     Config.WorkerAPIKey); a worker registered by someone else would
//     otherwise collect every client's key;
//   - Idempotency-Key, X-Idempotency-Key: Go's transport would replay a
//     POST after a dropped connection, the very repeat the proxy loop
//     exists to prevent;
//   - Host, Content-Length, Content-Type, Expect: the outbound request's own;
//   - X-Data-Parallel-Rank: set by the router to the rank it booked (a
//     client's value would send the request to another rank than the one
//     the load was booked on);
//   - Forwarded, X-Forwarded-*, X-Real-Ip: a client could forge them.
var deniedHeaders = map[string]bool{
	"Authorization": true, "Cookie": true, "X-Api-Key": true, "Api-Key": true, "Idempotency-Key": true, "X-Idempotency-Key": true,
	"Host": true, "Content-Length": true, "Content-Type": true, "Expect": true,
	"X-Data-Parallel-Rank": true, "Forwarded": true, "X-Real-Ip": true,
}

func denied(name string) bool {
	return deniedHeaders[name] || strings.HasPrefix(name, "X-Forwarded-")
}

// outboundHeader is the header of the request to a worker, from the
// client's: its end-to-end headers minus the denied ones, plus our
// Content-Type.
func outboundHeader(client http.Header) http.Header {
	out := make(http.Header, len(client)+3) // + Content-Type, Authorization, X-Data-Parallel-Rank
	out["Content-Type"] = []string{"application/json"}
	listed := connectionListed(client)
	copyHeaders(out, client, func(name string) bool { return !denied(name) && crossing(name, listed) })
	return out
}

// requestID gives every inference request an id the client, the router's
// logs and the engine share: the client's X-Request-Id when it is a sane
// token (printable ASCII, at most 128 bytes), else a fresh random one. It
// is set on the request (so it reaches the worker, which vLLM uses as its
// own request id) and on the answer.
func requestID(c *gin.Context) {
	id := c.Request.Header.Get("X-Request-Id")
	if !saneRequestID(id) {
		var b [16]byte
		_, _ = rand.Read(b[:])
		id = hex.EncodeToString(b[:])
		c.Request.Header.Set("X-Request-Id", id)
	}
	c.Writer.Header().Set("X-Request-Id", id)
	c.Set(requestIDKey, id)
	c.Next()
}

const requestIDKey = "request_id"

func saneRequestID(id string) bool {
	if id == "" || len(id) > 128 {
		return false
	}
	for i := 0; i < len(id); i++ {
		if id[i] <= ' ' || id[i] > '~' {
			return false
		}
	}
	return true
}
