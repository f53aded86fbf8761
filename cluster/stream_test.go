package cluster

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"testing"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/internal/pki"
)

// Pipelined replication stays off on every transport newTransport builds
// (plain TCP, a dial hook, mutual TLS): raft then replicates with one
// synchronous append at a time instead of the pipeline whose unbuffered
// channels can wedge a follower and hang Shutdown (stream.go).
func TestTransportDisablesPipelining(t *testing.T) {
	ca, err := pki.NewCA(pki.CAOptions{Name: "test CA"})
	if err != nil {
		t.Fatal(err)
	}
	kp, err := ca.Issue(pki.Request{Identity: pki.Node("n0"), Hosts: []string{"127.0.0.1"}})
	if err != nil {
		t.Fatal(err)
	}
	bundle, err := pki.NewBundle(ca.CertPEM(), kp)
	if err != nil {
		t.Fatal(err)
	}
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}
	for _, c := range []struct {
		name string
		cfg  Config
	}{
		{"tcp", Config{NodeID: "n0", RaftAddr: "127.0.0.1:0", AdvertiseAddr: "127.0.0.1:7000"}},
		{"dial hook", Config{NodeID: "n0", RaftAddr: "127.0.0.1:0", AdvertiseAddr: "127.0.0.1:7000", Dial: dial}},
		{"mutual TLS", Config{NodeID: "n0", RaftAddr: "127.0.0.1:0", AdvertiseAddr: "127.0.0.1:7000", TLS: bundle, Logger: slog.New(slog.DiscardHandler)}},
	} {
		t.Run(c.name, func(t *testing.T) {
			hl := NewHCLogger(slog.New(slog.DiscardHandler), "raft").(*hclogAdapter)
			trans, err := newTransport(&c.cfg, hl, newPeerGate(&c.cfg), func() {})
			if err != nil {
				t.Fatal(err)
			}
			defer trans.Close()
			p, err := trans.AppendEntriesPipeline("n1", "127.0.0.1:7001")
			if !errors.Is(err, raft.ErrPipelineReplicationNotSupported) {
				if p != nil {
					p.Close()
				}
				t.Fatalf("AppendEntriesPipeline: %v, want %v", err, raft.ErrPipelineReplicationNotSupported)
			}
		})
	}
}
