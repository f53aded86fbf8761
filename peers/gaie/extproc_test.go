package gaie

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"
	"sigs.k8s.io/gateway-api-inference-extension/test/integration"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/extproc"
	"github.com/kvrouter/kvrouter/router"
)

// pickerReplica is the least api.Replica a picker needs: one model, its
// router over an index, worker addresses.
type pickerReplica struct {
	rt   *router.Router
	urls map[router.WorkerID]string
}

func (f *pickerReplica) NodeID() string                         { return "r1" }
func (f *pickerReplica) Models() []string                       { return []string{"m"} }
func (f *pickerReplica) Router(m string) (*router.Router, bool) { return f.rt, m == "m" }
func (f *pickerReplica) WorkerURL(id router.WorkerID) (string, bool) {
	u, ok := f.urls[id]
	return u, ok
}
func (f *pickerReplica) DPRank(router.WorkerID) (int, bool) { return 0, false }
func (f *pickerReplica) Adapter(string) (string, []router.WorkerID, bool) {
	return "", nil, false
}
func (f *pickerReplica) ReadBarrier(context.Context) error { return nil }
func (f *pickerReplica) Thresholds(string) (router.Thresholds, bool) {
	return router.Thresholds{}, true
}
func (f *pickerReplica) SetThresholds(context.Context, string, api.ThresholdUpdate) (router.Thresholds, error) {
	return router.Thresholds{}, nil
}
func (f *pickerReplica) RegisterWorker(context.Context, api.WorkerSpec) error { return nil }
func (f *pickerReplica) DeregisterWorker(context.Context, string) error       { return nil }
func (f *pickerReplica) Ready() (bool, string)                                { return true, "" }
func (f *pickerReplica) Status(bool) map[string]any                           { return map[string]any{} }
func (f *pickerReplica) Audit(router.WorkerID, int, int, int)                 {}
func (f *pickerReplica) Booked(string, router.Booking)                        {}
func (f *pickerReplica) PrefillDone(string, string)                           {}
func (f *pickerReplica) Freed(string, string)                                 {}

// TestExtProcGAIERequestBuilders drives kvrouter's endpoint picker with the
// Gateway API Inference Extension's own request builders
// (test/integration.GenerateStreamedRequestSet, v1.3.0: the headers and
// body frames its integration tests send its picker, subset metadata
// included): kvrouter answers with the destination header and the
// envoy.lb metadata, equal, within the subset, and the body streamed back.
func TestExtProcGAIERequestBuilders(t *testing.T) {
	ix := router.NewIndex(16)
	rt, err := router.New(router.DefaultConfig(), ix, 1)
	if err != nil {
		t.Fatal(err)
	}
	rep := &pickerReplica{rt: rt, urls: map[router.WorkerID]string{}}
	var endpoints []string
	for _, id := range []router.WorkerID{"w1", "w2", "w3"} {
		w := httptest.NewServer(http.NotFoundHandler())
		t.Cleanup(w.Close)
		rep.urls[id] = w.URL
		ix.AddWorker(id)
		ep, _ := api.WorkerEndpoint(w.URL)
		endpoints = append(endpoints, ep)
	}
	rt.SetWorkers([]router.WorkerInfo{{ID: "w1", TotalBlocks: 1000}, {ID: "w2", TotalBlocks: 1000}, {ID: "w3", TotalBlocks: 1000}})
	srv := api.New(api.Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true}, rep)

	ln := bufconn.Listen(1 << 20)
	g := grpc.NewServer()
	extproc.Register(g, extproc.New(extproc.Config{Picker: extproc.Adapt(srv)}), extproc.NewHealth(func() bool { return true }))
	go func() { _ = g.Serve(ln) }()
	t.Cleanup(g.Stop)
	conn, err := grpc.NewClient("passthrough:///bufconn",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return ln.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	client := extprocv3.NewExternalProcessorClient(conn)

	for _, subset := range [][]string{nil, {endpoints[2]}, {endpoints[0], endpoints[1]}} {
		st, err := client.Process(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range integration.GenerateStreamedRequestSet(logr.Discard(), "a prompt from GAIE's builders", "m", "", subset) {
			if err := st.Send(m); err != nil {
				t.Fatal(err)
			}
		}
		r, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if im := r.GetImmediateResponse(); im != nil {
			t.Fatalf("subset %v: refused %d %s", subset, im.GetStatus().GetCode(), im.GetBody())
		}
		var header string
		for _, h := range r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
			if h.GetHeader().GetKey() == extproc.DestinationHeader {
				header = string(h.GetHeader().GetRawValue())
			}
		}
		md := r.GetDynamicMetadata().GetFields()[extproc.DestinationNamespace].GetStructValue().GetFields()[extproc.DestinationHeader].GetStringValue()
		if header == "" || header != md {
			t.Fatalf("subset %v: header %q, metadata %q", subset, header, md)
		}
		allowed := endpoints
		if subset != nil {
			allowed = subset
		}
		for _, ep := range strings.Split(header, ",") {
			if !slices.Contains(allowed, ep) {
				t.Fatalf("subset %v: endpoint %s outside it (%s)", subset, ep, header)
			}
		}
		body := r
		for !body.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetEndOfStream() {
			if body, err = st.Recv(); err != nil {
				t.Fatal(err)
			}
		}
		_ = st.CloseSend()
	}
}
