package cluster

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
)

// A stable-store write after raft.db is closed must never return: raft
// panics when writing the current term fails, and its heartbeat handler can
// still be running when the node closes the store (see raftStore).
func TestClusterRaftStoreWriteAfterClose(t *testing.T) {
	s, err := openRaftStore(filepath.Join(t.TempDir(), "raft.db"))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.SetUint64([]byte("CurrentTerm"), 1); err != nil {
		t.Fatalf("write before close: %v", err)
	}
	if got, err := s.GetUint64([]byte("CurrentTerm")); err != nil || got != 1 {
		t.Fatalf("read before close: %d, %v", got, err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second close: %v", err)
	}

	returned := make(chan error, 2)
	go func() { returned <- s.SetUint64([]byte("CurrentTerm"), 2) }()
	go func() { returned <- s.Set([]byte("LastVoteCand"), []byte("n2")) }()
	poll.Until(t, 10*time.Second, time.Millisecond, func() error {
		select {
		case err := <-returned:
			t.Fatalf("a stable-store write after close returned (%v); raft would panic on its error", err)
		default:
		}
		if h := s.held.Load(); h < 2 {
			return fmt.Errorf("%d writes after close held, want 2", h)
		}
		return nil
	})
	select {
	case err := <-returned:
		t.Fatalf("a held write returned: %v", err)
	default:
	}
	// Reads keep failing with bolt's error, as raft expects of a closed store.
	if _, err := s.GetUint64([]byte("CurrentTerm")); err == nil {
		t.Fatal("read after close: no error")
	}
}
