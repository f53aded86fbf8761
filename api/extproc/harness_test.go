package extproc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// testReplica is an in-memory api.Replica: one model, one index and
// router, no Raft. Load notifications are recorded for assertions.
type testReplica struct {
	mu     sync.Mutex
	index  *router.Index
	rt     *router.Router
	urls   map[router.WorkerID]string
	ranks  map[router.WorkerID]int // data-parallel ranks behind one engine
	events []string
}

const model = "m"

func newTestReplica(t testing.TB, cfg router.Config) *testReplica {
	ix := router.NewIndex(cfg.BlockSize)
	rt, err := router.New(cfg, ix, 1)
	if err != nil {
		t.Fatal(err)
	}
	return &testReplica{index: ix, rt: rt, urls: map[router.WorkerID]string{}}
}

func (f *testReplica) addWorker(id router.WorkerID, url string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.urls[id] = url
	f.index.AddWorker(id)
	f.rt.SetWorkers(append(f.rt.Workers(), router.WorkerInfo{ID: id, TotalBlocks: 1000, MaxBatchedTokens: 8192}))
}

func (f *testReplica) NodeID() string   { return "r1" }
func (f *testReplica) Models() []string { return []string{model} }
func (f *testReplica) Router(m string) (*router.Router, bool) {
	return f.rt, m == model
}
func (f *testReplica) WorkerURL(id router.WorkerID) (string, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	u, ok := f.urls[id]
	return u, ok
}
func (f *testReplica) DPRank(id router.WorkerID) (int, bool) {
	r, ok := f.ranks[id]
	return r, ok
}
func (f *testReplica) Adapter(string) (string, []router.WorkerID, bool) { return "", nil, false }
func (f *testReplica) ReadBarrier(context.Context) error                { return nil }
func (f *testReplica) Thresholds(string) (router.Thresholds, bool) {
	return f.rt.Config().Thresholds, true
}
func (f *testReplica) RegisterWorker(context.Context, api.WorkerSpec) error { return nil }
func (f *testReplica) DeregisterWorker(context.Context, string) error       { return nil }
func (f *testReplica) Ready() (bool, string)                                { return true, "" }
func (f *testReplica) Status(bool) map[string]any                           { return map[string]any{"node_id": "r1"} }
func (f *testReplica) Audit(w router.WorkerID, predicted, reported, _ int) {
	f.note(fmt.Sprintf("audit %s %d/%d", w, predicted, reported))
}
func (f *testReplica) Booked(_ string, b router.Booking) {
	f.note("add " + b.ID + " " + string(b.Worker))
}
func (f *testReplica) PrefillDone(_, id string) { f.note("prefill " + id) }
func (f *testReplica) Freed(_, id string)       { f.note("free " + id) }
func (f *testReplica) SetThresholds(context.Context, string, api.ThresholdUpdate) (router.Thresholds, error) {
	return router.Thresholds{}, nil
}

func (f *testReplica) note(s string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.events = append(f.events, s)
}

func (f *testReplica) noted() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.events)
}

// store puts the blocks of tokens on worker w, as its engine's events would.
func (f *testReplica) store(t testing.TB, w router.WorkerID, tokens []uint32) {
	t.Helper()
	seq := router.SequenceHashes(tokens, f.rt.Config().BlockSize, "")
	if len(seq) < 2 {
		t.Fatal("prompt shorter than two blocks")
	}
	blocks := make([]router.StoredBlock, len(seq))
	for i, h := range seq {
		blocks[i] = router.StoredBlock{EngineHash: h, ContentHash: h}
	}
	if err := f.index.Apply(w, router.KVEvent{Kind: router.EventStored, Blocks: blocks}); err != nil {
		t.Fatal(err)
	}
}

// fakeWorker answers OpenAI requests like an engine: JSON with usage, or
// an SSE stream ending with usage.
func fakeWorker(t testing.TB) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			Stream bool `json:"stream"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		if body.Stream {
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, streamAnswer)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, plainAnswer)
	}))
	t.Cleanup(srv.Close)
	return srv
}

const (
	plainAnswer  = `{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":40,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}`
	streamAnswer = "data: {\"choices\":[{\"delta\":{\"content\":\"t0\"}}]}\n\n" +
		"data: {\"choices\":[{\"delta\":{\"content\":\"t1\"}}]}\n\n" +
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\ndata: [DONE]\n\n"
)

// side is one replica: its state and its API server.
type side struct {
	rep *testReplica
	srv *api.Server
}

func newSide(t testing.TB, cfg router.Config, workers []*httptest.Server) side {
	rep := newTestReplica(t, cfg)
	for i, w := range workers {
		rep.addWorker(router.WorkerID(fmt.Sprintf("w%d", i+1)), w.URL)
	}
	srv := api.New(api.Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true}, rep)
	return side{rep: rep, srv: srv}
}

// pickerConn serves s's ext_proc on an in-memory listener and returns a
// client of it.
func pickerConn(t testing.TB, p Picker, cfg Config) extprocv3.ExternalProcessorClient {
	cfg.Picker = p
	ln := bufconn.Listen(1 << 20)
	g := grpc.NewServer()
	Register(g, New(cfg), NewHealth(func() bool { return true }))
	go func() { _ = g.Serve(ln) }()
	t.Cleanup(g.Stop)
	conn, err := grpc.NewClient("passthrough:///bufconn",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return ln.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return extprocv3.NewExternalProcessorClient(conn)
}

// The messages Envoy sends, built with the generated protobufs.

func headerMap(kv ...string) *corev3.HeaderMap {
	m := &corev3.HeaderMap{}
	for i := 0; i+1 < len(kv); i += 2 {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return m
}

func requestHeaders(path string, mode *extprocv3.ProtocolConfiguration, md *corev3.Metadata, extra ...string) *extprocv3.ProcessingRequest {
	kv := append([]string{":method", "POST", ":path", path, ":authority", "gw.example", "content-type", "application/json"}, extra...)
	return &extprocv3.ProcessingRequest{ProtocolConfig: mode, MetadataContext: md,
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: headerMap(kv...)}}}
}

func requestBody(b []byte, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: b, EndOfStream: eos}}}
}

func responseHeaders(status int, served string, contentType string) *extprocv3.ProcessingRequest {
	var md *corev3.Metadata
	if served != "" {
		md = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{DestinationNamespace: {Fields: map[string]*structpb.Value{
			ServedKey: structpb.NewStringValue(served)}}}}
	}
	return &extprocv3.ProcessingRequest{MetadataContext: md, Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: headerMap(":status", fmt.Sprint(status), "content-type", contentType)}}}
}

func responseBody(b []byte, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: b, EndOfStream: eos}}}
}

func responseTrailers() *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{
		ResponseTrailers: &extprocv3.HttpTrailers{}}}
}

func subsetMD(eps ...string) *corev3.Metadata {
	vals := make([]*structpb.Value, len(eps))
	for i, e := range eps {
		vals[i] = structpb.NewStringValue(e)
	}
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{SubsetNamespace: {Fields: map[string]*structpb.Value{
		SubsetKey: structpb.NewListValue(&structpb.ListValue{Values: vals})}}}}
}

var (
	buffered = &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_BUFFERED, ResponseBodyMode: filterv3.ProcessingMode_BUFFERED}
	duplex   = &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED}
)

// envoy is one ext_proc stream, driven as Envoy drives it.
type envoy struct {
	t      testing.TB
	stream extprocv3.ExternalProcessor_ProcessClient
	cancel context.CancelFunc
}

func openStream(t testing.TB, c extprocv3.ExternalProcessorClient) *envoy {
	ctx, cancel := context.WithCancel(context.Background())
	st, err := c.Process(ctx)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(cancel)
	return &envoy{t: t, stream: st, cancel: cancel}
}

func (e *envoy) send(m *extprocv3.ProcessingRequest) {
	e.t.Helper()
	if err := e.stream.Send(m); err != nil {
		e.t.Fatalf("send: %v", err)
	}
}

func (e *envoy) recv() *extprocv3.ProcessingResponse {
	e.t.Helper()
	r, err := e.stream.Recv()
	if err != nil {
		e.t.Fatalf("recv: %v", err)
	}
	return r
}

// decision is what the picker answered for a request.
type decision struct {
	header    string // x-gateway-destination-endpoint
	metadata  string // envoy.lb's x-gateway-destination-endpoint
	body      []byte // the request body streamed back (FULL_DUPLEX_STREAMED)
	immediate *extprocv3.ImmediateResponse
}

func (d decision) endpoints() []string { return strings.Split(d.header, ",") }

func destinationOf(r *extprocv3.ProcessingResponse, common *extprocv3.CommonResponse) (header, md string) {
	for _, h := range common.GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == DestinationHeader {
			header = string(h.GetHeader().GetRawValue())
		}
	}
	md = r.GetDynamicMetadata().GetFields()[DestinationNamespace].GetStructValue().GetFields()[DestinationHeader].GetStringValue()
	return header, md
}

// placeDuplex sends a request in FULL_DUPLEX_STREAMED mode, its body in
// chunks of at most chunk bytes (0: one), and reads the picker's answer:
// the request headers' answer with the destination, then the body back.
func (e *envoy) placeDuplex(path string, body []byte, chunk int, md *corev3.Metadata, extra ...string) decision {
	e.t.Helper()
	e.send(requestHeaders(path, duplex, md, extra...))
	if chunk <= 0 {
		chunk = len(body)
	}
	for off := 0; off < len(body); off += chunk {
		end := min(off+chunk, len(body))
		if err := e.stream.Send(requestBody(body[off:end], end == len(body))); err != nil {
			if errors.Is(err, io.EOF) {
				// The picker answered before the body's end (an
				// immediate response, e.g. past the body limit) and
				// ended the stream: read its answer, as Envoy does.
				break
			}
			e.t.Fatalf("send: %v", err)
		}
	}
	r := e.recv()
	if im := r.GetImmediateResponse(); im != nil {
		return decision{immediate: im}
	}
	hr := r.GetRequestHeaders()
	if hr == nil {
		e.t.Fatalf("first answer %T, want request headers", r.GetResponse())
	}
	var d decision
	d.header, d.metadata = destinationOf(r, hr.GetResponse())
	for {
		br := e.recv().GetRequestBody()
		if br == nil {
			e.t.Fatal("want the request body streamed back")
		}
		sr := br.GetResponse().GetBodyMutation().GetStreamedResponse()
		d.body = append(d.body, sr.GetBody()...)
		if sr.GetEndOfStream() {
			return d
		}
	}
}

// answer relays a worker's answer through the picker as Envoy does in
// FULL_DUPLEX_STREAMED mode: headers, body chunks (echoed back), trailers.
func (e *envoy) answer(served, contentType string, body []byte, chunk int) {
	e.t.Helper()
	e.send(responseHeaders(200, served, contentType))
	if e.recv().GetResponseHeaders() == nil {
		e.t.Fatal("want the response headers answered")
	}
	for off := 0; off < len(body); off += chunk {
		end := min(off+chunk, len(body))
		e.send(responseBody(body[off:end], end == len(body)))
		sr := e.recv().GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if string(sr.GetBody()) != string(body[off:end]) || sr.GetEndOfStream() != (end == len(body)) {
			e.t.Fatalf("response chunk echoed as %q eos=%v", sr.GetBody(), sr.GetEndOfStream())
		}
	}
	e.stream.CloseSend()
	if _, err := e.stream.Recv(); err != io.EOF {
		e.t.Fatalf("stream end: %v, want EOF", err)
	}
}

// proxied sends body through s's OpenAI proxy and returns the worker that
// answered (X-Worker-Id).
func proxied(t testing.TB, s *api.Server, path, body string) string {
	t.Helper()
	rec := httptest.NewRecorder()
	req := httptest.NewRequest("POST", path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	s.Handler().ServeHTTP(rec, req)
	if rec.Code != 200 {
		t.Fatalf("proxy: %d %s", rec.Code, rec.Body)
	}
	return rec.Header().Get("X-Worker-Id")
}

// tokensOf is the prompt ids s hashes for a chat body (its /tokenize).
func tokensOf(t testing.TB, s *api.Server, body string) []uint32 {
	t.Helper()
	rec := httptest.NewRecorder()
	s.Handler().ServeHTTP(rec, httptest.NewRequest("POST", "/tokenize", strings.NewReader(body)))
	var out struct {
		Tokens []uint32 `json:"tokens"`
	}
	if rec.Code != 200 || json.Unmarshal(rec.Body.Bytes(), &out) != nil {
		t.Fatalf("tokenize: %d %s", rec.Code, rec.Body)
	}
	return out.Tokens
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
		if cond() {
			return nil
		}
		return fmt.Errorf("not yet: %s", what)
	})
}
