package api

import (
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"net/textproto"
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

// removeHopByHop deletes h's hop-by-hop headers, those its Connection
// header names included. (Go's client deletes a response's Connection
// header when it says "close", and with it the names it listed, which
// then cross: a limit of what net/http hands us.)
func removeHopByHop(h http.Header) {
	for _, v := range h.Values("Connection") {
		for name := range strings.SplitSeq(v, ",") {
			if name = textproto.TrimString(name); name != "" {
				h.Del(name)
			}
		}
	}
	for name := range h {
		if isHopByHop(name) {
			delete(h, name)
		}
	}
}

// copyEndToEnd adds src's end-to-end headers to dst. Content-Length stays
// behind too: the relayed body is streamed, and may be cut short.
func copyEndToEnd(dst, src http.Header) {
	h := src.Clone()
	removeHopByHop(h)
	h.Del("Content-Length")
	for name, vs := range h {
		for _, v := range vs {
			dst.Add(name, v)
		}
	}
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
	in := client.Clone()
	removeHopByHop(in)
	out := http.Header{"Content-Type": {"application/json"}}
	for name, vs := range in {
		if denied(name) {
			continue
		}
		out[name] = vs
	}
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
