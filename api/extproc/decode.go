package extproc

import (
	"net/http"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// The endpoint picker protocol's names (GAIE docs/proposals/004).
const (
	// DestinationHeader carries the chosen endpoint(s) to the gateway, and
	// is the key of the same value in the envoy.lb dynamic metadata.
	DestinationHeader = "x-gateway-destination-endpoint"
	// DestinationNamespace wraps the destination in the dynamic metadata,
	// and the served endpoint in the metadata context.
	DestinationNamespace = "envoy.lb"
	// SubsetNamespace and SubsetKey hold the gateway's subset hint in the
	// request's metadata context: a list of "ip:port".
	SubsetNamespace = "envoy.lb.subset_hint"
	SubsetKey       = "x-gateway-destination-endpoint-subset"
	// ServedKey, under DestinationNamespace in the response's metadata
	// context, names the endpoint that served the request.
	ServedKey = "x-gateway-destination-endpoint-served"
)

// maxHeaders bounds the headers one message may carry into the request
// (Envoy's own default limit is 100).
const maxHeaders = 256

// requestHead is what the picker reads from a message's headers.
type requestHead struct {
	header http.Header // regular headers, canonicalized
	method string      // :method
	path   string      // :path without its query
	status int         // :status of a response (0: none or invalid)
}

// decodeHeaders turns Envoy's header map into a requestHead. Envoy sends a
// header's value in raw_value (value is the older field); pseudo-headers
// (":path", ":method", ":status", ...) go to their fields, others into the
// header. Headers beyond maxHeaders are dropped.
func decodeHeaders(m *corev3.HeaderMap) requestHead {
	h := requestHead{header: make(http.Header)}
	if m == nil {
		return h
	}
	for i, hv := range m.GetHeaders() {
		if i >= maxHeaders {
			break
		}
		v := string(hv.GetRawValue())
		if v == "" {
			v = hv.GetValue()
		}
		k := strings.ToLower(hv.GetKey())
		switch k {
		case "":
		case ":method":
			h.method = v
		case ":path":
			h.path, _, _ = strings.Cut(v, "?")
		case ":status":
			if n, err := strconv.Atoi(v); err == nil && n >= 100 && n <= 999 {
				h.status = n
			}
		default:
			if k[0] != ':' {
				h.header.Add(k, v)
			}
		}
	}
	return h
}

// subsetHint reads the gateway's subset hint from a metadata context:
// ok is false when it gives none (no namespace, or no key in it: pick from
// the whole pool); the list holds its string entries (others are ignored,
// as GAIE's picker does). A single string is read as a comma list.
func subsetHint(md *corev3.Metadata) (subset []string, ok bool) {
	ns := md.GetFilterMetadata()[SubsetNamespace]
	v, found := ns.GetFields()[SubsetKey]
	if !found {
		return nil, false
	}
	switch k := v.GetKind().(type) {
	case *structpb.Value_ListValue:
		subset = []string{}
		for _, e := range k.ListValue.GetValues() {
			if s, isStr := e.GetKind().(*structpb.Value_StringValue); isStr {
				subset = append(subset, strings.TrimSpace(s.StringValue))
			}
		}
		return subset, true
	case *structpb.Value_StringValue:
		subset = []string{}
		for _, s := range strings.Split(k.StringValue, ",") {
			if s = strings.TrimSpace(s); s != "" {
				subset = append(subset, s)
			}
		}
		return subset, true
	}
	return []string{}, true // present but neither: nothing eligible
}

// servedEndpoint reads the endpoint that served the request from a
// response message's metadata context ("" when the gateway does not say).
// A list names the first.
func servedEndpoint(md *corev3.Metadata) string {
	v := md.GetFilterMetadata()[DestinationNamespace].GetFields()[ServedKey]
	var s string
	switch k := v.GetKind().(type) {
	case *structpb.Value_StringValue:
		s = k.StringValue
	case *structpb.Value_ListValue:
		if vs := k.ListValue.GetValues(); len(vs) > 0 {
			s = vs[0].GetStringValue()
		}
	}
	s, _, _ = strings.Cut(s, ",")
	return strings.TrimSpace(s)
}
