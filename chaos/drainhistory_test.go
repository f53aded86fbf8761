package chaos

import (
	"testing"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/fsm"
)

// TestChaosDrainHistory: D1's replay of a worker's drains counts a
// completion only while the worker is registered and drained; a stale
// second completion (after the worker registered again) is refused and
// leaves it registered, which D1 compares with the replicas' status.
func TestChaosDrainHistory(t *testing.T) {
	reg := fsm.RegisterWorker{ID: "w", DPRanks: 1, Address: "http://10.0.0.1:1", Model: "m", TotalBlocks: 8}
	drain := fsm.SetWorkerDrain{Worker: "w", Drained: true}
	done := fsm.SetWorkerDrain{Worker: "w", Drained: true, Deregister: true}
	undrain := fsm.SetWorkerDrain{Worker: "w"}
	other := fsm.SetWorkerDrain{Worker: "x", Drained: true, Deregister: true}
	cases := []struct {
		name       string
		first      uint64 // index of the first entry (> 1: a compacted log)
		cmds       []fsm.Command
		want       drainHistory
		exactlyOne bool // Completed == Drains
	}{
		{"one drain, one completion", 1, []fsm.Command{reg, drain, done},
			drainHistory{Drains: 1, Completed: 1, Proposed: 1}, true},
		{"registered again after it", 1, []fsm.Command{reg, drain, done, reg},
			drainHistory{Drains: 1, Completed: 1, Proposed: 1, Registered: true}, true},
		{"a second completion after it (a new leader's) is refused", 1, []fsm.Command{reg, drain, done, done},
			drainHistory{Drains: 1, Completed: 1, Refused: 1, Proposed: 2}, true},
		{"a stale completion spares the worker registered again", 1, []fsm.Command{reg, drain, done, reg, done},
			drainHistory{Drains: 1, Completed: 1, Refused: 1, Proposed: 2, Registered: true}, true},
		{"a completion after an undrain is refused", 1, []fsm.Command{reg, drain, undrain, done},
			drainHistory{Drains: 1, Refused: 1, Proposed: 1, Registered: true}, false},
		{"a renewal keeps the drain", 1, []fsm.Command{reg, drain, reg, done},
			drainHistory{Drains: 1, Completed: 1, Proposed: 1}, true},
		{"two rounds", 1, []fsm.Command{reg, drain, done, reg, drain, done, done},
			drainHistory{Drains: 2, Completed: 2, Refused: 1, Proposed: 3}, true},
		{"another worker's completion does not count", 1, []fsm.Command{reg, drain, other, done},
			drainHistory{Drains: 1, Completed: 1, Proposed: 1}, true},
		{"a plain deregistration is counted apart", 1, []fsm.Command{reg, drain, fsm.DeregisterWorker{ID: "w"}, done},
			drainHistory{Drains: 1, OtherGone: 1, Refused: 1, Proposed: 1}, false},
		{"compacted: registered before the first entry", 500, []fsm.Command{drain, done},
			drainHistory{Drains: 1, Completed: 1, Proposed: 1}, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var logs []*raft.Log
			for i, cmd := range c.cmds {
				b, err := fsm.Encode(cmd)
				if err != nil {
					t.Fatal(err)
				}
				logs = append(logs, &raft.Log{Index: c.first + uint64(i), Type: raft.LogCommand, Data: b})
			}
			logs = append(logs, &raft.Log{Index: c.first + uint64(len(logs)), Type: raft.LogNoop})
			got := replayDrains("w", logs)
			if got != c.want {
				t.Errorf("got %+v, want %+v", got, c.want)
			}
			if (got.Completed == got.Drains && got.Drains > 0) != c.exactlyOne {
				t.Errorf("exactly once = %v, want %v", got.Completed == got.Drains, c.exactlyOne)
			}
		})
	}
}
