package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	grpcstatus "google.golang.org/grpc/status"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/internal/pki"
	"github.com/kvrouter/kvrouter/internal/poll"
)

// TestServeExtProcTLS starts one replica as a gateway's endpoint picker
// (--ext-proc-listen) with TLS material and --api-client-certs: a gateway
// presenting an API client certificate of the cluster's CA gets readiness
// SERVING and the worker's endpoint for a chat request; one presenting a
// node certificate is refused (Unauthenticated), as on /v1/*.
func TestServeExtProcTLS(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica with TLS")
	}
	dir := t.TempDir()
	l := pki.Layout{Dir: filepath.Join(dir, "certs")}
	if _, err := l.Ensure([]pki.Holder{{Identity: pki.Node("r1"), Hosts: []string{"127.0.0.1"}}, {Identity: pki.Client("gw")}}); err != nil {
		t.Fatal(err)
	}
	mat := l.Material(pki.Node("r1"))
	tokenFile := filepath.Join(dir, "admin-token")
	if err := os.WriteFile(tokenFile, []byte("admin-secret-1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	worker := httptest.NewServer(http.NotFoundHandler()) // never contacted: the gateway sends the request
	defer worker.Close()
	wantEP, _ := api.WorkerEndpoint(worker.URL)

	ports := freePorts(t, 5)
	grpcAddr := fmt.Sprintf("127.0.0.1:%d", ports[4])
	args := []string{"--single-node", "--node-id", "r1", "--model", "m", "--data-dir", filepath.Join(dir, "r1"),
		"--http-addr", fmt.Sprintf("127.0.0.1:%d", ports[0]), "--raft-addr", fmt.Sprintf("127.0.0.1:%d", ports[1]),
		"--nats-addr", fmt.Sprintf("127.0.0.1:%d", ports[2]), "--nats-cluster-addr", fmt.Sprintf("127.0.0.1:%d", ports[3]),
		"--tls-ca", mat.CAFile, "--tls-cert", mat.CertFile, "--tls-key", mat.KeyFile, "--admin-token-file", tokenFile,
		"--api-client-certs", "--workers", "w1=" + worker.URL, "--ext-proc-listen", grpcAddr}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int)
	go func() { done <- runServe(ctx, args, nil, &logSink{t: t}) }()
	t.Cleanup(func() {
		cancel()
		if code := <-done; code != 0 {
			t.Errorf("runServe exited %d", code)
		}
	})

	dial := func(id pki.Identity) *grpc.ClientConn {
		b, err := pki.LoadBundle(l.Material(id))
		if err != nil {
			t.Fatal(err)
		}
		conn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(credentials.NewTLS(b.ClientTLS(pki.AllowRoles(pki.RoleNode)))))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}
	gw := dial(pki.Client("gw"))
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error {
		r, err := healthpb.NewHealthClient(gw).Check(ctx, &healthpb.HealthCheckRequest{Service: "readiness"})
		if err == nil && r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			err = fmt.Errorf("readiness %v", r.GetStatus())
		}
		return err
	})

	place := func(conn *grpc.ClientConn) (*extprocv3.ProcessingResponse, error) {
		sctx, stop := context.WithTimeout(ctx, 10*time.Second)
		defer stop()
		st, err := extprocv3.NewExternalProcessorClient(conn).Process(sctx)
		if err != nil {
			return nil, err
		}
		hdrs := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":method", RawValue: []byte("POST")},
			{Key: ":path", RawValue: []byte("/v1/chat/completions")}}}
		body := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("hello ", 40) + `"}]}`
		for _, m := range []*extprocv3.ProcessingRequest{
			{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: hdrs}}},
			{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte(body), EndOfStream: true}}},
		} {
			if err := st.Send(m); err != nil {
				break // the server may have refused the stream: Recv says why
			}
		}
		r, err := st.Recv()
		_ = st.CloseSend()
		return r, err
	}
	// The static worker is registered through Raft once the replica leads.
	poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
		r, err := place(gw)
		if err != nil {
			t.Fatalf("gateway with a client certificate: %v", err)
		}
		var got string
		for _, h := range r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
			if h.GetHeader().GetKey() == "x-gateway-destination-endpoint" {
				got = string(h.GetHeader().GetRawValue())
			}
		}
		if got != wantEP {
			return fmt.Errorf("destination %q, want the worker's %s (answer %v)", got, wantEP, r)
		}
		return nil
	})
	if _, err := place(dial(pki.Node("r1"))); grpcstatus.Code(err) != codes.Unauthenticated {
		t.Fatalf("a node certificate on the picker: %v, want Unauthenticated", err)
	}
}
