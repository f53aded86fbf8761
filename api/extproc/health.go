package extproc

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// Health answers the gRPC health checks the endpoint picker protocol names:
// "liveness" (the process answers), "readiness" and the ExternalProcessor
// service (this replica can route: knows a leader, caught up, has
// workers). Unlike GAIE's picker, where only the elected leader is ready,
// every replica is: they share one index through Raft (active-active).
type Health struct {
	healthpb.UnimplementedHealthServer
	ready func() bool
}

// NewHealth reports ready as ready says.
func NewHealth(ready func() bool) *Health { return &Health{ready: ready} }

func (h *Health) Check(_ context.Context, r *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	serving := healthpb.HealthCheckResponse_SERVING
	switch r.GetService() {
	case "", "liveness":
	case "readiness", extprocv3.ExternalProcessor_ServiceDesc.ServiceName:
		if !h.ready() {
			serving = healthpb.HealthCheckResponse_NOT_SERVING
		}
	default:
		return nil, status.Errorf(codes.NotFound, "unknown service %q", r.GetService())
	}
	return &healthpb.HealthCheckResponse{Status: serving}, nil
}

// Register puts the picker and its health checks on g.
func Register(g *grpc.Server, s *Server, h *Health) {
	extprocv3.RegisterExternalProcessorServer(g, s)
	healthpb.RegisterHealthServer(g, h)
}
