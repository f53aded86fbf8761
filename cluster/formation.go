package cluster

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hashicorp/raft"
)

// Form makes this node a cluster member, following one rule for every start:
//  1. the data dir already held Raft state: resume (nothing to do);
//  2. Join targets given: ask them to add this node as a voter, retrying with
//     backoff; after Config.JoinAttempts failed rounds fall through to 3 if
//     this node is in Peers, else keep retrying until ctx ends;
//  3. Peers given (and this node among them): bootstrap the full expected
//     set — every node given the same Peers writes the same configuration;
//  4. neither: bootstrap a single-node cluster.
//
// It returns once the node is a member (or has bootstrapped); readiness
// follows when a leader is known and the node has caught up.
func (n *Node) Form(ctx context.Context) error {
	if n.hadState {
		n.log.Info("resuming from existing raft state")
		return nil
	}
	cfg := &n.cfg
	if len(cfg.Join) > 0 {
		backoff := 100 * time.Millisecond
		for attempt := 1; ; attempt++ {
			err := n.joinOnce(ctx)
			if err == nil {
				return nil
			}
			if cfg.selfInPeers() && attempt >= cfg.JoinAttempts {
				n.log.Info("join failed, bootstrapping from peers", "attempts", attempt, "err", err)
				break
			}
			n.log.Info("join failed, retrying", "attempt", attempt, "backoff", backoff, "err", err)
			select {
			case <-ctx.Done():
				return fmt.Errorf("cluster: join: %w (last error: %v)", ctx.Err(), err)
			case <-n.closing:
				return ErrShutdown
			case <-time.After(backoff):
			}
			backoff = min(backoff*2, 2*time.Second)
		}
	}
	var servers []raft.Server
	switch {
	case len(cfg.Peers) > 0 && !cfg.selfInPeers():
		return fmt.Errorf("cluster: node %q is not in peers and no join target accepted it", cfg.NodeID)
	case len(cfg.Peers) > 0:
		for _, p := range cfg.Peers {
			servers = append(servers, raft.Server{Suffrage: raft.Voter, ID: raft.ServerID(p.ID), Address: raft.ServerAddress(p.RaftAddr)})
		}
	default:
		servers = []raft.Server{{Suffrage: raft.Voter, ID: raft.ServerID(cfg.NodeID), Address: raft.ServerAddress(cfg.AdvertiseAddr)}}
	}
	err := n.raft.BootstrapCluster(raft.Configuration{Servers: servers}).Error()
	if errors.Is(err, raft.ErrCantBootstrap) {
		// State arrived meanwhile (a peer that bootstrapped first replicated
		// to us); that is the same cluster.
		n.log.Info("bootstrap skipped: raft state already present")
		return nil
	}
	if err != nil {
		return fmt.Errorf("cluster: bootstrap: %w", err)
	}
	n.log.Info("bootstrapped cluster", "servers", len(servers))
	return nil
}
