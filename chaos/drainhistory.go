package chaos

import (
	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/fsm"
)

// drainHistory is what one replica's Raft log says about one worker's
// drains (D1, drain.go): read after the run, it is the Raft-applied
// history the live observations are checked against.
type drainHistory struct {
	Replica    string `json:"replica"`
	Group      int    `json:"group,omitempty"` // summed over every group when 0 on a sharded replica
	FirstIndex uint64 `json:"first_index"`
	LastIndex  uint64 `json:"last_index"`
	Drains     int    `json:"drains"`                // drains of a registered, undrained worker
	Completed  int    `json:"completions_applied"`   // completions that removed it
	Refused    int    `json:"completions_refused"`   // completions that found it undrained or gone
	Proposed   int    `json:"completions_in_log"`    // every completion entry
	OtherGone  int    `json:"other_deregistrations"` // DeregisterWorker of it while registered
	// Registered: whether the worker is registered after the last entry,
	// by these rules. D1 compares it with every replica's final status:
	// an FSM that let a stale completion remove the worker registered
	// again would list it nowhere while this says registered.
	Registered bool   `json:"registered_at_end"`
	Err        string `json:"error,omitempty"`
}

// replayDrains follows worker through logs (in index order) with the
// FSM's rules for the commands that touch it (fsm/DESIGN.md, Draining
// workers), written again here rather than borrowed from the FSM under
// test: a registration starts undrained and a renewal keeps the drain; a
// drain applies to a registered worker; a completion
// (SetWorkerDrain{Deregister}) removes it only while it is registered and
// drained, else it is refused. Exactly once: Completed == Drains (each
// drain completed by one entry), Refused counts the duplicates (a new
// leader completing again) the rule turned away, and Registered, the
// state the rule predicts, must match what the replicas show. The worker
// is taken as registered before the first entry when the log was
// compacted (logs[0].Index > 1): D1 registers it before its first round.
func replayDrains(worker string, logs []*raft.Log) drainHistory {
	var h drainHistory
	registered, drained := len(logs) > 0 && logs[0].Index > 1, false
	for _, l := range logs {
		if l.Type != raft.LogCommand || len(l.Data) == 0 {
			continue
		}
		switch fsm.CommandType(l.Data[0] &^ 0x80) { // decode only what can touch the worker
		case fsm.CmdRegisterWorker, fsm.CmdRegisterWorkerRole, fsm.CmdRegisterWorkerBlockSize, fsm.CmdDeregisterWorker, fsm.CmdSetWorkerDrain:
		default:
			continue
		}
		c, err := fsm.Decode(l.Data)
		if err != nil {
			continue
		}
		switch c := c.(type) {
		case fsm.RegisterWorker:
			if c.ID == worker {
				if !registered {
					drained = false
				}
				registered = true
			}
		case fsm.DeregisterWorker:
			if c.ID == worker {
				if registered {
					h.OtherGone++
				}
				registered, drained = false, false
			}
		case fsm.SetWorkerDrain:
			if c.Worker != worker {
				continue
			}
			switch {
			case c.Deregister:
				h.Proposed++
				if registered && drained {
					h.Completed++
					registered, drained = false, false
				} else {
					h.Refused++
				}
			case c.Drained && registered:
				if !drained {
					h.Drains++
				}
				drained = true
			case registered:
				drained = false
			}
		}
	}
	h.Registered = registered
	return h
}
