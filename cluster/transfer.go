package cluster

import (
	"fmt"

	"github.com/hashicorp/raft"
)

// TransferLeadershipTo hands this node's leadership to server id, a voter
// of the latest configuration, and returns when raft finished the attempt
// (nil: id won the election raft asked it to hold). Replicas running
// several groups use it to spread the groups' leaders (issue 19); raft
// refuses new applies on this node while the transfer runs (at most an
// election timeout), so callers back off after a failure.
func (n *Node) TransferLeadershipTo(id string) error {
	servers, _ := n.gate.servers()
	for _, s := range servers {
		if string(s.ID) == id && s.Suffrage == raft.Voter {
			if err := n.raft.LeadershipTransferToServer(s.ID, s.Address).Error(); err != nil {
				return fmt.Errorf("cluster: transfer leadership to %q: %w", id, err)
			}
			return nil
		}
	}
	return fmt.Errorf("cluster: transfer leadership to %q: not a voter of the configuration", id)
}

// Voters lists the voters of the latest configuration, in its order.
func (n *Node) Voters() []string {
	servers, _ := n.gate.servers()
	var out []string
	for _, s := range servers {
		if s.Suffrage == raft.Voter {
			out = append(out, string(s.ID))
		}
	}
	return out
}
