package cluster

import (
	"context"
	"fmt"
	"net"
	"time"

	"github.com/hashicorp/raft"
)

// streamLayer is raft.StreamLayer over TCP with a pluggable dialer. It speaks
// exactly what raft.NewTCPTransport speaks; it exists so Config.Dial (the
// test harness's link switch) also governs Raft connections.
type streamLayer struct {
	ln        net.Listener
	advertise net.Addr
	dial      func(ctx context.Context, network, addr string) (net.Conn, error)
}

func (s *streamLayer) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return s.dial(ctx, "tcp", string(address))
}

func (s *streamLayer) Accept() (net.Conn, error) { return s.ln.Accept() }
func (s *streamLayer) Close() error              { return s.ln.Close() }
func (s *streamLayer) Addr() net.Addr            { return s.advertise }

// newTransport builds the Raft network transport: mutual TLS when
// cfg.TLS is set (tls.go), else raft.NewTCPTransport's stream layer when no
// dial hook is configured, ours otherwise. The NetworkTransport on top —
// connection pool, I/O timeouts, pipelining — is the same in every case.
func newTransport(cfg *Config, logger *hclogAdapter, gate *peerGate, refused func()) (*raft.NetworkTransport, error) {
	adv, err := net.ResolveTCPAddr("tcp", cfg.AdvertiseAddr)
	if err != nil {
		return nil, fmt.Errorf("resolve advertise address %q: %w", cfg.AdvertiseAddr, err)
	}
	tc := &raft.NetworkTransportConfig{
		MaxPool: 3,
		// 1 turns pipelined replication off. With hashicorp/raft's default
		// of 2 the pipeline's channels are unbuffered, and a follower that
		// answers an append with Success=false can leave the sender parked
		// on the in-progress channel with nobody left to read it: the
		// follower is never replicated to again (heartbeats still flow, so
		// no election heals it) and Shutdown waits forever on the
		// replication goroutine. TestServeShardedGrow hung 18 minutes in
		// netPipeline.AppendEntries that way (2026-12-02); grafana/pyroscope
		// #5518 traced the same deadlock. Each append is then one
		// synchronous RPC; our entries are batches, so the cost is
		// BENCHMARKS.md's ("Raft: committed batches").
		MaxRPCsInFlight: 1,
		Timeout:         cfg.TransportTimeout,
		Logger:          logger.Named("transport"),
	}
	if cfg.TLS != nil {
		ln, err := net.Listen("tcp", cfg.RaftAddr)
		if err != nil {
			return nil, fmt.Errorf("raft transport on %s: %w", cfg.RaftAddr, err)
		}
		tc.Stream = newTLSStreamLayer(ln, adv, cfg, gate, refused)
		return raft.NewNetworkTransportWithConfig(tc), nil
	}
	if cfg.Dial == nil {
		t, err := raft.NewTCPTransportWithConfig(cfg.RaftAddr, adv, tc)
		if err != nil {
			return nil, fmt.Errorf("raft transport on %s: %w", cfg.RaftAddr, err)
		}
		return t, nil
	}
	ln, err := net.Listen("tcp", cfg.RaftAddr)
	if err != nil {
		return nil, fmt.Errorf("raft transport on %s: %w", cfg.RaftAddr, err)
	}
	tc.Stream = &streamLayer{ln: ln, advertise: adv, dial: cfg.Dial}
	return raft.NewNetworkTransportWithConfig(tc), nil
}
