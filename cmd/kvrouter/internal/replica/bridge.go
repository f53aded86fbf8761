package replica

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/eventbus/zmqbridge"
)

// startReplicaBridge runs a bridge inside a replica (small fleets: no
// sidecars): the workers of the config file at path, published through the
// replica's own NATS connection and registered with the replica itself
// (selfURL). It returns when the bridge is set up; the bridge runs until
// ctx ends, and wait blocks until it has stopped.
func startReplicaBridge(ctx context.Context, path string, nc *nats.Conn, selfURL, adminToken string, blockSize int,
	client *http.Client, reg prometheus.Registerer, log *slog.Logger) (wait func(), err error) {
	if log == nil {
		log = slog.Default()
	}
	fc, err := zmqbridge.LoadConfigFile(path)
	if err != nil {
		return nil, err
	}
	if fc.BlockSize != 0 && fc.BlockSize != blockSize {
		return nil, fmt.Errorf("bridge config %s: block_size %d differs from the router's %d", path, fc.BlockSize, blockSize)
	}
	register := fc.Register
	if len(register) == 0 && selfURL != "" {
		register = []string{selfURL}
	}
	token := fc.AdminToken
	if token == "" {
		token = adminToken
	}
	b, err := zmqbridge.New(zmqbridge.Config{BlockSize: blockSize, Publishers: zmqbridge.NATSPublishers(nc, log), NATS: nc,
		Register: register, AdminToken: token, HTTPClient: client, Logger: log})
	if err != nil {
		return nil, err
	}
	if reg != nil {
		if err := reg.Register(b.Collector()); err != nil {
			return nil, err
		}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := b.Run(ctx, fc.Workers); err != nil {
			log.Error("in-replica bridge failed", "err", err)
		}
	}()
	return func() { <-done }, nil
}
