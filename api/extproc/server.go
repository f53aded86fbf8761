// Package extproc serves a replica as a Gateway API endpoint picker: the
// Envoy external processing service (envoy.service.ext_proc.v3), spoken as
// the Gateway API Inference Extension's endpoint picker protocol describes
// it (its docs/proposals/004). The gateway streams each HTTP request's
// headers and body in; the picker answers with the chosen endpoint in the
// x-gateway-destination-endpoint header and the envoy.lb dynamic metadata,
// then watches the answer go by (headers, body chunks, trailers) so the
// booking ends with it. The routing itself is the Picker's: this package
// only speaks the protocol (DESIGN.md).
package extproc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
)

// Request is one HTTP request to place.
type Request struct {
	Path   string      // :path without the query
	Header http.Header // the client's regular headers
	Body   []byte
	// Subset, when HasSubset, lists the only endpoints (ip:port) allowed.
	Subset    []string
	HasSubset bool
	Fallbacks int // endpoints to rank after the chosen one
}

// Placement is a placed request: booked until Finish or Cancel.
type Placement interface {
	// Endpoints are the chosen endpoint, then the fallbacks, as ip:port.
	Endpoints() []string
	// Worker names the worker booked (the proxy's X-Worker-Id).
	Worker() string
	// DPRank is the data-parallel rank to send, when the worker has one.
	DPRank() (int, bool)
	Served(endpoint string)
	ResponseHeaders(status int)
	ResponseBody(chunk []byte)
	Finish()
	Cancel()
}

// Picker places requests: the replica's API server (api.Server.Pick
// through Adapt) and, in tests, fakes.
type Picker interface {
	Pick(ctx context.Context, r Request) (Placement, error)
	// Any is an endpoint for a request without a body (nothing to route
	// by, nothing booked); false when there is none.
	Any() (string, bool)
}

// Refusal is a Pick error with an HTTP answer for the client (the picker
// answers it as an immediate response); any other error ends the stream.
type Refusal interface {
	error
	HTTPStatus() int
	AnswerBody() []byte
}

// Config configures the service.
type Config struct {
	Picker Picker
	Logger *slog.Logger
	// Fallbacks is how many endpoints follow the chosen one in the answer
	// (the gateway tries them in order when it cannot connect); 0, the
	// default, sends the choice alone, as GAIE's reference picker does: a
	// plain ORIGINAL_DST cluster reads one ip:port from the header.
	Fallbacks int
	// MaxBodyBytes bounds a request body (default 8 MiB): beyond, 413.
	MaxBodyBytes int
	// RequestBodyMode and ResponseBodyMode are the gateway's processing
	// modes when its messages do not say (Envoy sends protocol_config
	// since 1.35): default FULL_DUPLEX_STREAMED both, as GAIE's gateway
	// configurations set.
	RequestBodyMode  filterv3.ProcessingMode_BodySendMode
	ResponseBodyMode filterv3.ProcessingMode_BodySendMode
}

// Server is the ExternalProcessor service.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer
	cfg Config
	log *slog.Logger
}

// New returns the service.
func New(cfg Config) *Server {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	cfg.Fallbacks = max(cfg.Fallbacks, 0)
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = 8 << 20
	}
	if cfg.RequestBodyMode == filterv3.ProcessingMode_NONE {
		cfg.RequestBodyMode = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	}
	if cfg.ResponseBodyMode == filterv3.ProcessingMode_NONE {
		cfg.ResponseBodyMode = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	}
	return &Server{cfg: cfg, log: cfg.Logger}
}

// Process serves one HTTP request's exchange (Envoy opens one stream per
// request). Whatever ends the stream before the answer's end of stream —
// the client's cancel, the gateway's reset, an error — cancels the
// placement, so no booking outlives its request.
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	x := newExchange(s)
	defer x.cancel()
	ctx := stream.Context()
	for {
		msg, err := stream.Recv()
		if err == io.EOF || status.Code(err) == codes.Canceled {
			return nil
		}
		if err != nil {
			return err
		}
		out, err := x.handle(ctx, msg)
		for _, r := range out {
			if serr := stream.Send(r); serr != nil {
				return serr
			}
		}
		if err != nil {
			return err
		}
		if x.closed {
			return nil // an immediate response ends the exchange
		}
	}
}

// exchange is the state of one request's stream.
type exchange struct {
	s        *Server
	reqMode  filterv3.ProcessingMode_BodySendMode
	respMode filterv3.ProcessingMode_BodySendMode
	modeSet  bool
	head     requestHead
	subset   []string
	hasSub   bool
	body     []byte
	// placed is the placement once the body is in; headersSent: the
	// request headers were answered (at once in BUFFERED mode, with the
	// destination in FULL_DUPLEX_STREAMED).
	placed      Placement
	headersSent bool
	routed      bool // the destination went out (or a refusal)
	finished    bool
	closed      bool // an immediate response was sent
}

func newExchange(s *Server) *exchange {
	return &exchange{s: s, reqMode: s.cfg.RequestBodyMode, respMode: s.cfg.ResponseBodyMode}
}

// cancel frees a placement whose answer did not end.
func (x *exchange) cancel() {
	if x.placed != nil && !x.finished {
		x.finished = true
		x.placed.Cancel()
	}
}

func (x *exchange) finish() {
	if x.placed != nil && !x.finished {
		x.finished = true
		x.placed.Finish()
	}
}

// handle answers one message: zero, one or several responses, in the order
// Envoy expects them (request headers, then body, then trailers).
func (x *exchange) handle(ctx context.Context, msg *extprocv3.ProcessingRequest) ([]*extprocv3.ProcessingResponse, error) {
	if x.closed {
		return nil, status.Error(codes.FailedPrecondition, "the exchange ended with an immediate response")
	}
	if pc := msg.GetProtocolConfig(); pc != nil && !x.modeSet {
		x.modeSet = true
		x.reqMode, x.respMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
	}
	switch m := msg.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return x.requestHeaders(ctx, msg, m.RequestHeaders)
	case *extprocv3.ProcessingRequest_RequestBody:
		return x.requestBody(ctx, m.RequestBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return x.requestTrailers(ctx)
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return x.responseHeaders(msg, m.ResponseHeaders), nil
	case *extprocv3.ProcessingRequest_ResponseBody:
		return x.responseBody(m.ResponseBody), nil
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		x.finish()
		return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
			ResponseTrailers: &extprocv3.TrailersResponse{}}}}, nil
	}
	return nil, status.Error(codes.InvalidArgument, "a processing request without a known message")
}

func (x *exchange) requestHeaders(ctx context.Context, msg *extprocv3.ProcessingRequest, h *extprocv3.HttpHeaders) ([]*extprocv3.ProcessingResponse, error) {
	if x.headersSent || x.routed {
		return nil, status.Error(codes.FailedPrecondition, "request headers sent twice")
	}
	x.head = decodeHeaders(h.GetHeaders())
	x.subset, x.hasSub = subsetHint(msg.GetMetadataContext())
	if h.GetEndOfStream() {
		// No body (a GET such as /v1/models): nothing to route by, nothing
		// to book; any endpoint, as GAIE's picker does.
		ep, ok := x.s.cfg.Picker.Any()
		if !ok {
			return x.refuse(http.StatusServiceUnavailable, "no worker to send a request without a body to"), nil
		}
		x.headersSent, x.routed = true, true
		return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_RequestHeaders{
			RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{ClearRouteCache: true,
				HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{setHeader(DestinationHeader, ep)}}}}},
			DynamicMetadata: destinationMetadata(ep)}}, nil
	}
	switch x.reqMode {
	case filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_BUFFERED_PARTIAL:
		// Envoy waits for this answer before it sends the body; the
		// destination goes out with the body's answer.
		x.headersSent = true
		return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_RequestHeaders{
			RequestHeaders: &extprocv3.HeadersResponse{}}}}, nil
	case filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		return nil, nil // answered with the destination once the body is in
	}
	return x.refuse(http.StatusInternalServerError, fmt.Sprintf(
		"the gateway's request_body_mode is %s: the endpoint picker needs BUFFERED or FULL_DUPLEX_STREAMED to read the body", x.reqMode)), nil
}

func (x *exchange) requestBody(ctx context.Context, b *extprocv3.HttpBody) ([]*extprocv3.ProcessingResponse, error) {
	if x.routed {
		return nil, status.Error(codes.FailedPrecondition, "request body after the request was routed")
	}
	if len(x.body)+len(b.GetBody()) > x.s.cfg.MaxBodyBytes {
		return x.refuse(http.StatusRequestEntityTooLarge, fmt.Sprintf("request body over %d bytes", x.s.cfg.MaxBodyBytes)), nil
	}
	x.body = append(x.body, b.GetBody()...)
	if !b.GetEndOfStream() {
		if x.reqMode == filterv3.ProcessingMode_BUFFERED_PARTIAL || x.reqMode == filterv3.ProcessingMode_BUFFERED {
			// Envoy buffered as much as it would and sent it: the rest
			// never reaches us, so the prompt would be cut.
			return x.refuse(http.StatusRequestEntityTooLarge, "the gateway sent a partial body (buffer limit): raise it to route this request"), nil
		}
		return nil, nil
	}
	return x.route(ctx, false)
}

// requestTrailers: a request with trailers ends with them rather than with
// a body chunk's end of stream.
func (x *exchange) requestTrailers(ctx context.Context) ([]*extprocv3.ProcessingResponse, error) {
	var out []*extprocv3.ProcessingResponse
	if !x.routed {
		var err error
		if out, err = x.route(ctx, true); err != nil || x.closed {
			return out, err
		}
	}
	return append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
		RequestTrailers: &extprocv3.TrailersResponse{}}}), nil
}

// route places the request once its body is complete and answers with the
// destination: in FULL_DUPLEX_STREAMED the request headers' answer (with
// the header and metadata) and the body streamed back unchanged; in
// BUFFERED the body's answer carries the header and metadata.
func (x *exchange) route(ctx context.Context, trailers bool) ([]*extprocv3.ProcessingResponse, error) {
	x.routed = true
	pl, err := x.s.cfg.Picker.Pick(ctx, Request{Path: x.head.path, Header: x.head.header, Body: x.body,
		Subset: x.subset, HasSubset: x.hasSub, Fallbacks: x.s.cfg.Fallbacks})
	if err != nil {
		var ref Refusal
		if errors.As(err, &ref) {
			return x.refuseWith(ref.HTTPStatus(), ref.AnswerBody()), nil
		}
		return nil, status.Errorf(codes.Unavailable, "placing the request: %v", err)
	}
	x.placed = pl
	dest := strings.Join(pl.Endpoints(), ",")
	set := []*corev3.HeaderValueOption{setHeader(DestinationHeader, dest)}
	if rank, ok := pl.DPRank(); ok {
		set = append(set, setHeader("x-data-parallel-rank", strconv.Itoa(rank)))
	}
	common := &extprocv3.CommonResponse{ClearRouteCache: true, HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set}}
	md := destinationMetadata(dest)
	if x.headersSent { // BUFFERED: the headers were answered already
		return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_RequestBody{
			RequestBody: &extprocv3.BodyResponse{Response: common}}, DynamicMetadata: md}}, nil
	}
	x.headersSent = true
	out := []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{Response: common}}, DynamicMetadata: md}}
	for _, c := range chunks(x.body, !trailers) {
		out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
			RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: c}}}})
	}
	x.body = nil
	return out, nil
}

func (x *exchange) responseHeaders(msg *extprocv3.ProcessingRequest, h *extprocv3.HttpHeaders) []*extprocv3.ProcessingResponse {
	head := decodeHeaders(h.GetHeaders())
	var set []*corev3.HeaderValueOption
	if x.placed != nil && !x.finished {
		x.placed.Served(servedEndpoint(msg.GetMetadataContext()))
		x.placed.ResponseHeaders(head.status)
		set = append(set, setHeader("x-worker-id", x.placed.Worker()))
		if h.GetEndOfStream() {
			x.finish()
		}
	}
	r := &extprocv3.HeadersResponse{}
	if len(set) > 0 {
		r.Response = &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set}}
	}
	return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: r}}}
}

func (x *exchange) responseBody(b *extprocv3.HttpBody) []*extprocv3.ProcessingResponse {
	if x.placed != nil && !x.finished {
		x.placed.ResponseBody(b.GetBody())
	}
	if b.GetEndOfStream() {
		x.finish()
	}
	r := &extprocv3.BodyResponse{}
	if x.respMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		// In this mode the processor sends the body on: unchanged.
		r.Response = &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
			StreamedResponse: &extprocv3.StreamedBodyResponse{Body: b.GetBody(), EndOfStream: b.GetEndOfStream()}}}}
	}
	return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: r}}}
}

// refuse ends the exchange with an immediate response in OpenAI's error
// shape, as the proxy answers.
func (x *exchange) refuse(code int, msg string) []*extprocv3.ProcessingResponse {
	b := fmt.Appendf(nil, `{"error":{"message":%s,"type":%q,"code":%d}}`, strconv.Quote(msg), errorType(code), code)
	return x.refuseWith(code, b)
}

func (x *exchange) refuseWith(code int, body []byte) []*extprocv3.ProcessingResponse {
	x.routed, x.closed = true, true
	set := []*corev3.HeaderValueOption{setHeader("content-type", "application/json")}
	if code == http.StatusTooManyRequests {
		set = append(set, setHeader("retry-after", "1"))
	}
	return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
		ImmediateResponse: &extprocv3.ImmediateResponse{Status: &typev3.HttpStatus{Code: typev3.StatusCode(code)},
			Headers: &extprocv3.HeaderMutation{SetHeaders: set}, Body: body, Details: "kvrouter endpoint picker"}}}}
}

func errorType(code int) string {
	switch code {
	case http.StatusRequestEntityTooLarge, http.StatusBadRequest:
		return "invalid_request_error"
	case http.StatusTooManyRequests:
		return "rate_limit_exceeded"
	}
	return "service_unavailable"
}

func setHeader(k, v string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD}
}

// destinationMetadata is {"envoy.lb": {"x-gateway-destination-endpoint": dest}}.
func destinationMetadata(dest string) *structpb.Struct {
	return &structpb.Struct{Fields: map[string]*structpb.Value{
		DestinationNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			DestinationHeader: structpb.NewStringValue(dest)}}),
	}}
}

// bodyChunk bounds one streamed body message: gRPC's default limit on a
// received message is 4 MiB, Envoy's buffers are smaller still.
const bodyChunk = 62 << 10

// chunks splits body into streamed body mutations, the last with eos.
func chunks(body []byte, eos bool) []*extprocv3.BodyMutation {
	var out []*extprocv3.BodyMutation
	for {
		n := min(len(body), bodyChunk)
		last := n == len(body)
		out = append(out, &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
			StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body[:n], EndOfStream: eos && last}}})
		body = body[n:]
		if last {
			return out
		}
	}
}
