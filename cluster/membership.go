package cluster

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hashicorp/raft"
)

// Join adds (id, raftAddr) as a voter. Idempotent: the same id at the same
// address is already a voter → nil; the same id at a new address is removed
// and re-added; another id at this address is removed first. Followers
// forward to the leader. With TLS, raftAddr must first answer as node id.
func (n *Node) Join(ctx context.Context, id, raftAddr string) error {
	if id == "" || raftAddr == "" {
		return errors.New("cluster: join needs node_id and raft_addr")
	}
	if n.raft.State() != raft.Leader {
		// The leader checks raftAddr (handleJoin).
		return n.forwardAdmin(ctx, n.path(epJoin), joinRequest{NodeID: id, RaftAddr: raftAddr})
	}
	if n.cfg.TLS != nil {
		// The same proof the join endpoint asks for: a bogus voter would cost
		// the cluster its quorum.
		if err := n.verifyRaftPeer(ctx, id, raftAddr); err != nil {
			return fmt.Errorf("cluster: join %s: %w", id, err)
		}
	}
	return n.addVoter(ctx, raft.ServerID(id), raft.ServerAddress(raftAddr))
}

func (n *Node) addVoter(ctx context.Context, id raft.ServerID, addr raft.ServerAddress) error {
	cf := n.raft.GetConfiguration()
	if err := waitFuture(ctx, cf); err != nil {
		return fmt.Errorf("join %s: read configuration: %w", id, mapRaftError(err))
	}
	for _, s := range cf.Configuration().Servers {
		if s.ID == id && s.Address == addr {
			if s.Suffrage == raft.Voter {
				n.log.Info("join: already a voter", "id", id, "addr", addr)
				return nil
			}
			continue // a non-voter: AddVoter promotes it
		}
		if s.ID == id || s.Address == addr {
			n.log.Info("join: removing stale entry", "id", s.ID, "addr", s.Address)
			if err := waitFuture(ctx, n.raft.RemoveServer(s.ID, 0, n.cfg.ApplyTimeout)); err != nil {
				return fmt.Errorf("join %s: remove stale %s: %w", id, s.ID, mapRaftError(err))
			}
		}
	}
	if err := waitFuture(ctx, n.raft.AddVoter(id, addr, 0, n.cfg.ApplyTimeout)); err != nil {
		return fmt.Errorf("join %s: add voter: %w", id, mapRaftError(err))
	}
	n.log.Info("join: added voter", "id", id, "addr", addr)
	return nil
}

// Remove takes id out of the configuration. Followers forward to the leader.
func (n *Node) Remove(ctx context.Context, id string) error {
	if id == "" {
		return errors.New("cluster: remove needs node_id")
	}
	if n.raft.State() != raft.Leader {
		return n.forwardAdmin(ctx, n.path(epRemove), removeRequest{NodeID: id})
	}
	if err := waitFuture(ctx, n.raft.RemoveServer(raft.ServerID(id), 0, n.cfg.ApplyTimeout)); err != nil {
		return fmt.Errorf("remove %s: %w", id, mapRaftError(err))
	}
	n.log.Info("removed server", "id", id)
	return nil
}

func (n *Node) hasOtherVoters() bool {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	cf := n.raft.GetConfiguration()
	if waitFuture(ctx, cf) != nil {
		return true // let LeadershipTransfer decide
	}
	for _, s := range cf.Configuration().Servers {
		if s.Suffrage == raft.Voter && string(s.ID) != n.cfg.NodeID {
			return true
		}
	}
	return false
}
