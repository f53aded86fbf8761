package cluster

import (
	"sync"
	"sync/atomic"
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

// raftStore is raft.db (the Raft log and its stable store) with a close
// that raft's stray handlers cannot race. hashicorp/raft answers heartbeats
// on the transport's connection goroutine (processHeartbeat), which checks
// for shutdown only before it starts; one in flight when the node shuts
// down can still write the current term after raft.db is closed, and raft
// panics when that write fails ("failed to save current term: database not
// open"), taking the whole process down with it. So once closed, a write
// to the stable store never returns: that handler never answers (answering
// without the write would break Raft's promise to persist the term first),
// and the node is gone anyway. Reads and log writes keep failing with
// bolt's error, which raft handles without panicking. Only raft writes
// here; nothing of ours waits on a stable-store write.
type raftStore struct {
	*raftboltdb.BoltStore

	mu     sync.RWMutex // held for reading across each stable-store write, for writing by Close
	closed bool
	never  chan struct{} // never closed: what a write after Close waits on
	held   atomic.Int64  // writes held after Close (read by tests)
}

func openRaftStore(path string) (*raftStore, error) {
	b, err := raftboltdb.New(boltOptions(path))
	if err != nil {
		return nil, err
	}
	return &raftStore{BoltStore: b, never: make(chan struct{})}, nil
}

// enter returns with mu held for reading, or never once the store is closed.
func (s *raftStore) enter() {
	s.mu.RLock()
	if s.closed {
		s.mu.RUnlock()
		s.held.Add(1)
		<-s.never
	}
}

func (s *raftStore) Set(key, val []byte) error {
	s.enter()
	defer s.mu.RUnlock()
	return s.BoltStore.Set(key, val)
}

func (s *raftStore) SetUint64(key []byte, val uint64) error {
	s.enter()
	defer s.mu.RUnlock()
	return s.BoltStore.SetUint64(key, val)
}

// Close waits for the stable-store writes in progress, then closes raft.db.
func (s *raftStore) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	return s.BoltStore.Close()
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
