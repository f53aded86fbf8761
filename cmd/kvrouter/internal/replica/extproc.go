package replica

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/extproc"
	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/internal/pki"
)

// extProcServer is the endpoint picker's gRPC server (--ext-proc-listen):
// Envoy's ext_proc service over the API server's Pick, so a request placed
// for a gateway takes the proxy's routing step.
type extProcServer struct {
	g    *grpc.Server
	errc chan error
}

// serveExtProc listens on cfg.ExtProcAddr. With TLS material the port takes
// TLS only, with the node certificate and the cluster's CA as the HTTP
// port (client certificates verified when given; with --api-client-certs
// required, naming an API client, as on /v1/*). Without material (a
// loopback development cluster) it is plaintext.
func serveExtProc(cfg Config, bundle *pki.Bundle, srv *api.Server, ready func() bool, log *slog.Logger) (*extProcServer, error) {
	ln, err := net.Listen("tcp", cfg.ExtProcAddr)
	if err != nil {
		return nil, fmt.Errorf("ext_proc listen: %w", err)
	}
	var opts []grpc.ServerOption
	if bundle != nil {
		opts = append(opts, grpc.Creds(credentials.NewTLS(cluster.HTTPServerTLS(bundle))))
	}
	if cfg.APIClientCerts {
		opts = append(opts, grpc.StreamInterceptor(requireGRPCClient))
	}
	fallbacks := cfg.ExtProcFallbacks
	g := grpc.NewServer(opts...)
	extproc.Register(g, extproc.New(extproc.Config{Picker: extproc.Adapt(srv), Logger: log, Fallbacks: fallbacks,
		MaxBodyBytes: int(cfg.MaxBodyBytes)}), extproc.NewHealth(ready))
	s := &extProcServer{g: g, errc: make(chan error, 1)}
	go func() { s.errc <- g.Serve(ln) }()
	log.Info("endpoint picker serving (Envoy ext_proc)", "addr", ln.Addr().String(), "tls", bundle != nil,
		"client_certs", cfg.APIClientCerts, "fallbacks", fallbacks)
	return s, nil
}

// stop lets the open exchanges end (each request's stream closes with its
// answer) for up to wait, then cuts the rest: their bookings are freed as
// cancelled.
func (s *extProcServer) stop(wait time.Duration) {
	if s == nil {
		return
	}
	done := make(chan struct{})
	go func() { s.g.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(wait):
		s.g.Stop()
	}
}

// requireGRPCClient accepts a stream whose connection presented a verified
// certificate of the cluster's CA naming an API client (requireAPIClient
// for gRPC); the health service is exempt, as /health is.
func requireGRPCClient(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if info.FullMethod != "/envoy.service.ext_proc.v3.ExternalProcessor/Process" {
		return handler(srv, ss)
	}
	if err := grpcClientIdentity(ss.Context()); err != nil {
		return status.Errorf(codes.Unauthenticated, "client certificate required: %v", err)
	}
	return handler(srv, ss)
}

func grpcClientIdentity(ctx context.Context) error {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return errors.New("no peer")
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok {
		return errors.New("not a TLS connection")
	}
	id, err := pki.PeerIdentity(ti.State)
	if err != nil {
		return err
	}
	if id.Role != pki.RoleClient {
		return fmt.Errorf("%s is not an API client certificate", id)
	}
	return nil
}
