package cluster

import (
	"github.com/hashicorp/raft"
)

// noteHalt is told (on raft's FSM goroutine) when the state machine halts
// or resumes. A halt is an operator's problem: the replica needs a newer
// build. A halted leader would keep proposing entries it cannot apply and
// answer reads it cannot serve, so haltLoop hands leadership away.
func (n *Node) noteHalt(err error) {
	if err == nil {
		n.log.Info("state machine resumed applying (restored a snapshot)")
		return
	}
	n.log.Error("state machine halted: this replica applies nothing more and is not ready until restarted with a build that knows the entry",
		"err", err, "applied_index", n.sm.AppliedIndex())
	select {
	case n.haltCh <- struct{}{}:
	default: // one pending notice is enough
	}
}

// haltLoop transfers leadership away from this node when its state machine
// halted while it leads (off the FSM goroutine: the transfer waits for
// raft's main loop).
func (n *Node) haltLoop() {
	defer n.wg.Done()
	for {
		select {
		case <-n.closing:
			return
		case <-n.haltCh:
		}
		if n.sm.Halted() == nil || n.raft.State() != raft.Leader || !n.hasOtherVoters() {
			continue
		}
		if err := n.raft.LeadershipTransfer().Error(); err != nil {
			n.log.Warn("halted leader: leadership transfer failed", "err", err)
			continue
		}
		n.log.Info("halted leader: leadership transferred")
	}
}
