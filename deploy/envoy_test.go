package deploy

import (
	"os"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	extprocfilter "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"github.com/goccy/go-yaml"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/kvrouter/kvrouter/api/extproc"
)

// validatable is what go-control-plane's generated validators provide.
type validatable interface{ ValidateAll() error }

// TestDeployEnvoyConfig checks envoy/envoy.yaml against Envoy's v3 API as
// go-control-plane v1.40.0 generates it: every field known and well typed
// (protojson, unknown fields refused, typed_config resolved), every
// message's constraints (the generated ValidateAll, the typed configs
// unpacked and validated too), and the protocol wiring the picker needs:
// ext_proc with both bodies FULL_DUPLEX_STREAMED towards the picker
// cluster, an ORIGINAL_DST cluster reading the picker's destination header,
// the picker cluster on HTTP/2 with gRPC health checks of "readiness". Not
// checked: that an Envoy binary accepts and runs it.
func TestDeployEnvoyConfig(t *testing.T) {
	raw, err := os.ReadFile("envoy/envoy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	js, err := yaml.YAMLToJSON(raw)
	if err != nil {
		t.Fatal(err)
	}
	var b bootstrapv3.Bootstrap
	if err := protojson.Unmarshal(js, &b); err != nil {
		t.Fatalf("not Envoy's v3 bootstrap: %v", err)
	}
	if err := b.ValidateAll(); err != nil {
		t.Fatalf("bootstrap constraints: %v", err)
	}
	unpack := func(what string, a interface {
		UnmarshalTo(proto.Message) error
	}, m proto.Message) {
		t.Helper()
		if err := a.UnmarshalTo(m); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if v, ok := m.(validatable); ok {
			if err := v.ValidateAll(); err != nil {
				t.Fatalf("%s constraints: %v", what, err)
			}
		}
	}
	var hcm hcmv3.HttpConnectionManager
	unpack("http_connection_manager", b.GetStaticResources().GetListeners()[0].GetFilterChains()[0].GetFilters()[0].GetTypedConfig(), &hcm)
	var ep extprocfilter.ExternalProcessor
	found := false
	for _, f := range hcm.GetHttpFilters() {
		if f.GetName() == "envoy.filters.http.ext_proc" {
			unpack("ext_proc", f.GetTypedConfig(), &ep)
			found = true
		}
	}
	if !found {
		t.Fatal("no ext_proc filter")
	}
	pm := ep.GetProcessingMode()
	if pm.GetRequestBodyMode() != extprocfilter.ProcessingMode_FULL_DUPLEX_STREAMED || pm.GetResponseBodyMode() != extprocfilter.ProcessingMode_FULL_DUPLEX_STREAMED {
		t.Fatalf("body modes %v / %v, want FULL_DUPLEX_STREAMED both", pm.GetRequestBodyMode(), pm.GetResponseBodyMode())
	}
	picker := ep.GetGrpcService().GetEnvoyGrpc().GetClusterName()
	clusters := map[string]*clusterv3.Cluster{}
	for _, c := range b.GetStaticResources().GetClusters() {
		clusters[c.GetName()] = c
	}
	pc, ok := clusters[picker]
	if !ok {
		t.Fatalf("ext_proc names cluster %q, not defined", picker)
	}
	if _, ok := pc.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]; !ok {
		t.Fatal("the picker cluster must speak HTTP/2 (gRPC)")
	}
	if hc := pc.GetHealthChecks(); len(hc) == 0 || hc[0].GetGrpcHealthCheck().GetServiceName() != "readiness" {
		t.Fatal("the picker cluster should health-check gRPC readiness")
	}
	if len(pc.GetLoadAssignment().GetEndpoints()[0].GetLbEndpoints()) < 3 {
		t.Fatal("list every replica: they are all pickers (active-active)")
	}
	route := hcm.GetRouteConfig().GetVirtualHosts()[0].GetRoutes()[0].GetRoute().GetCluster()
	wc, ok := clusters[route]
	if !ok || wc.GetType() != clusterv3.Cluster_ORIGINAL_DST {
		t.Fatalf("requests route to %q, want an ORIGINAL_DST cluster", route)
	}
	if h := wc.GetOriginalDstLbConfig().GetHttpHeaderName(); !wc.GetOriginalDstLbConfig().GetUseHttpHeader() || !strings.EqualFold(h, extproc.DestinationHeader) {
		t.Fatalf("ORIGINAL_DST reads header %q, want %s", h, extproc.DestinationHeader)
	}
}
