package cluster

import (
	"time"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	"go.etcd.io/bbolt"
)

// boltOptions is the only place the Raft store is configured: NoSync must
// stay false (every log append is fsynced before it is acknowledged).
func boltOptions(path string) raftboltdb.Options {
	return raftboltdb.Options{
		Path:   path,
		NoSync: false,
		// Fail instead of hanging when another process (or a not yet closed
		// node in the same process) holds the file lock.
		BoltOptions: &bbolt.Options{Timeout: 3 * time.Second},
	}
}

// lastCommandAtOrBelow finds the newest LogCommand entry <= idx, looking back
// a bounded distance. 0 when none is found or the log is compacted there (a
// snapshot then covers it, and raft's applied index accounts for it).
func (n *Node) lastCommandAtOrBelow(idx uint64) uint64 {
	var l raft.Log
	for i, steps := idx, 0; i > 0 && steps < 256; i, steps = i-1, steps+1 {
		if err := n.logs.GetLog(i, &l); err != nil {
			return 0
		}
		if l.Type == raft.LogCommand {
			return i
		}
	}
	return 0
}
