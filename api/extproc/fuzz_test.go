package extproc

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// Fuzz targets for what this package decodes: Envoy's header maps, the
// metadata context (subset hint, served endpoint) and the message sequence
// of an exchange. `go test ./api/extproc` runs the seeds.

// FuzzExtProcHeaders: any header map decodes without panicking; the path
// carries no query, a status is a three-digit code or none, pseudo-headers
// never reach the regular headers, and the header count is bounded.
func FuzzExtProcHeaders(f *testing.F) {
	f.Add(":method\x00POST\x00:path\x00/v1/chat/completions?x=1\x00Authorization\x00Bearer k\x00:status\x00200")
	f.Add(":status\x00abc\x00\x00\x00:\x00x")
	f.Add(strings.Repeat("k\x00v\x00", 300))
	f.Fuzz(func(t *testing.T, in string) {
		parts := strings.Split(in, "\x00")
		m := &corev3.HeaderMap{}
		for i := 0; i+1 < len(parts); i += 2 {
			hv := &corev3.HeaderValue{Key: parts[i]}
			if i%4 == 0 {
				hv.RawValue = []byte(parts[i+1])
			} else {
				hv.Value = parts[i+1]
			}
			m.Headers = append(m.Headers, hv)
		}
		h := decodeHeaders(m)
		if strings.Contains(h.path, "?") {
			t.Fatalf("path %q keeps its query", h.path)
		}
		if h.status != 0 && (h.status < 100 || h.status > 999) {
			t.Fatalf("status %d", h.status)
		}
		n := 0
		for k, vs := range h.header {
			if strings.HasPrefix(k, ":") {
				t.Fatalf("pseudo-header %q among the headers", k)
			}
			n += len(vs)
		}
		if n > maxHeaders {
			t.Fatalf("%d headers kept", n)
		}
	})
}

// FuzzExtProcMetadata: any metadata context (its namespaces as JSON)
// yields a subset hint exactly when the key is there, of non-empty
// trimmed entries in the comma form, and a served endpoint without commas.
func FuzzExtProcMetadata(f *testing.F) {
	f.Add(`{"envoy.lb.subset_hint":{"x-gateway-destination-endpoint-subset":["10.0.0.1:8000", 7, "10.0.0.2:8000"]},"envoy.lb":{"x-gateway-destination-endpoint-served":"10.0.0.1:8000"}}`)
	f.Add(`{"envoy.lb.subset_hint":{"x-gateway-destination-endpoint-subset":" a:1, ,b:2 "},"envoy.lb":{"x-gateway-destination-endpoint-served":["a:1,b:2"]}}`)
	f.Add(`{"envoy.lb.subset_hint":{"x-gateway-destination-endpoint-subset":null}}`)
	f.Add(`{"envoy.lb.subset_hint":{}}`)
	f.Fuzz(func(t *testing.T, in string) {
		var raw map[string]any
		if json.Unmarshal([]byte(in), &raw) != nil {
			return
		}
		md := &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{}}
		for k, v := range raw {
			obj, ok := v.(map[string]any)
			if !ok {
				continue
			}
			s, err := structpb.NewStruct(obj)
			if err != nil {
				return
			}
			md.FilterMetadata[k] = s
		}
		subset, ok := subsetHint(md)
		_, present := md.GetFilterMetadata()[SubsetNamespace].GetFields()[SubsetKey]
		if ok != present {
			t.Fatalf("hint %v found=%v, key present=%v", subset, ok, present)
		}
		if ok && subset == nil {
			t.Fatal("a present hint must not read as absent (nil)")
		}
		if _, isStr := md.GetFilterMetadata()[SubsetNamespace].GetFields()[SubsetKey].GetKind().(*structpb.Value_StringValue); isStr {
			for _, s := range subset {
				if s == "" || s != strings.TrimSpace(s) || strings.Contains(s, ",") {
					t.Fatalf("comma form entry %q", s)
				}
			}
		}
		if served := servedEndpoint(md); strings.Contains(served, ",") {
			t.Fatalf("served %q names several endpoints", served)
		}
	})
}

// fuzzPicker places every request on one endpoint and counts the
// placement's ends.
type fuzzPicker struct {
	picks   int
	ends    int
	refuse  bool
	stopped bool // Finish or Cancel came
}

type fuzzPlacement struct{ p *fuzzPicker }

func (p *fuzzPicker) Pick(_ context.Context, r Request) (Placement, error) {
	p.picks++
	if p.refuse {
		return nil, testRefusal{}
	}
	return fuzzPlacement{p}, nil
}

func (p *fuzzPicker) Any() (string, bool) { return "10.0.0.3:8000", true }

func (f fuzzPlacement) Endpoints() []string { return []string{"10.0.0.1:8000", "10.0.0.2:8000"} }
func (f fuzzPlacement) Worker() string      { return "w1" }
func (f fuzzPlacement) DPRank() (int, bool) { return 0, false }
func (f fuzzPlacement) Served(string)       {}
func (f fuzzPlacement) ResponseHeaders(int) {}
func (f fuzzPlacement) ResponseBody([]byte) {}
func (f fuzzPlacement) Finish()             { f.p.ends++ }
func (f fuzzPlacement) Cancel()             { f.p.ends++ }

type testRefusal struct{}

func (testRefusal) Error() string      { return "refused" }
func (testRefusal) HTTPStatus() int    { return 429 }
func (testRefusal) AnswerBody() []byte { return []byte(`{"error":{"message":"refused"}}`) }

// FuzzExtProcExchange: any sequence of messages, in any order and mode,
// is answered without panicking; the request is placed at most once; the
// placement ends exactly once when the stream goes away; every answer
// sets its oneof; nothing is answered after an immediate response.
func FuzzExtProcExchange(f *testing.F) {
	f.Add([]byte{0, 1, 1, 3, 4, 4, 5}, uint8(4), false)
	f.Add([]byte{0, 1, 2, 3, 5}, uint8(2), false)
	f.Add([]byte{0, 1}, uint8(1), false)
	f.Add([]byte{0, 1, 3}, uint8(4), true)
	f.Add([]byte{3, 4, 0, 0, 2, 1, 1}, uint8(0), false)
	f.Fuzz(func(t *testing.T, ops []byte, mode uint8, refuse bool) {
		if len(ops) > 64 {
			return
		}
		p := &fuzzPicker{refuse: refuse}
		x := newExchange(New(Config{Picker: p, MaxBodyBytes: 64}))
		body := []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
		closed := false
		for i, op := range ops {
			var m *extprocv3.ProcessingRequest
			eos := op&0x10 != 0
			switch op % 6 {
			case 0:
				m = requestHeaders("/v1/chat/completions", &extprocv3.ProtocolConfiguration{
					RequestBodyMode:  filterv3.ProcessingMode_BodySendMode(mode % 6),
					ResponseBodyMode: filterv3.ProcessingMode_BodySendMode((mode / 6) % 6)}, subsetMD("10.0.0.1:8000"))
				m.GetRequestHeaders().EndOfStream = eos && i%2 == 0
			case 1:
				m = requestBody(body[:min(len(body), int(op)%len(body)+1)], !eos)
			case 2:
				m = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}}
			case 3:
				m = responseHeaders(200, "10.0.0.2:8000", "text/event-stream")
				m.GetResponseHeaders().EndOfStream = eos
			case 4:
				m = responseBody([]byte("data: {}\n\n"), eos)
			case 5:
				m = responseTrailers()
			}
			out, err := x.handle(context.Background(), m)
			if closed && len(out) > 0 {
				t.Fatal("answered after an immediate response")
			}
			for _, r := range out {
				if r.GetResponse() == nil {
					t.Fatalf("answer without a response: %v", r)
				}
			}
			if x.closed {
				closed = true
			}
			if err != nil {
				break // Process ends the stream on an error
			}
		}
		x.cancel()
		if p.picks > 1 {
			t.Fatalf("placed %d times", p.picks)
		}
		if want := p.picks; refuse {
			if p.ends != 0 {
				t.Fatalf("a refused request ended %d times", p.ends)
			}
		} else if p.ends != want {
			t.Fatalf("%d placements ended %d times", want, p.ends)
		}
	})
}
