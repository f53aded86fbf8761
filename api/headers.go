package api

import (
	"net/http"
	"net/textproto"
	"strings"
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

// forwardedHeaders are the client headers a worker gets (besides our own
// Content-Type). An allow-list, not a copy: the client's credentials for
// this router are not the worker's business, and an Idempotency-Key header
// would make Go's transport replay a POST after a dropped connection, the
// very repeat the proxy loop exists to prevent.
var forwardedHeaders = []string{"Accept"}

// outboundHeader is the header of the request to a worker, from the
// client's: the allow-listed end-to-end headers only.
func outboundHeader(client http.Header) http.Header {
	in := client.Clone()
	removeHopByHop(in)
	out := http.Header{"Content-Type": {"application/json"}}
	for _, name := range forwardedHeaders {
		if v := in.Get(name); v != "" {
			out.Set(name, v)
		}
	}
	return out
}
