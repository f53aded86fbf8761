package clustertest

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/cluster"
)

// ErrRejected is the domain error FSM returns for commands starting with
// RejectPrefix (committed, no state change).
var ErrRejected = errors.New("clustertest: command rejected")

// RejectPrefix marks a command FSM rejects.
const RejectPrefix = "reject:"

// FSM is a tiny deterministic state machine for cluster tests: its state is
// a SHA-256 chain over the accepted commands and their count. Apply returns
// the new count (uint64) or ErrRejected.
type FSM struct {
	mu      sync.Mutex
	applied uint64
	count   uint64
	chain   [32]byte

	restores   atomic.Uint64
	applyDelay atomic.Int64 // nanoseconds slept per ApplyBatch (simulates a slow FSM)
}

// NewFSM returns an empty FSM.
func NewFSM() *FSM { return &FSM{} }

// SetApplyDelay makes every ApplyBatch sleep d (0 disables).
func (f *FSM) SetApplyDelay(d time.Duration) { f.applyDelay.Store(int64(d)) }

// Restores counts successful Restore calls.
func (f *FSM) Restores() uint64 { return f.restores.Load() }

// Count is the number of accepted commands.
func (f *FSM) Count() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.count
}

func (f *FSM) Apply(l *raft.Log) any { return f.ApplyBatch([]*raft.Log{l})[0] }

func (f *FSM) ApplyBatch(logs []*raft.Log) []any {
	if d := f.applyDelay.Load(); d > 0 {
		time.Sleep(time.Duration(d))
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]any, len(logs))
	for i, l := range logs {
		if l.Type != raft.LogCommand || l.Index <= f.applied {
			continue
		}
		f.applied = l.Index
		if bytes.HasPrefix(l.Data, []byte(RejectPrefix)) {
			out[i] = fmt.Errorf("%w: %q", ErrRejected, l.Data)
			continue
		}
		h := sha256.New()
		h.Write(f.chain[:])
		h.Write(l.Data)
		h.Sum(f.chain[:0])
		f.count++
		out[i] = f.count
	}
	return out
}

func (f *FSM) Digest() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return hex.EncodeToString(f.chain[:8]) + "/" + strconv.FormatUint(f.count, 10)
}

func (f *FSM) AppliedIndex() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.applied
}

// Snapshot format: "KVTF" | version u8 | applied u64 | count u64 | chain[32] | crc32(previous).
const snapMagic = "KVTF"

type fsmSnapshot struct{ buf []byte }

func (f *FSM) Snapshot() (raft.FSMSnapshot, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	b := append([]byte(snapMagic), 1)
	b = binary.BigEndian.AppendUint64(b, f.applied)
	b = binary.BigEndian.AppendUint64(b, f.count)
	b = append(b, f.chain[:]...)
	b = binary.BigEndian.AppendUint32(b, crc32.ChecksumIEEE(b))
	return &fsmSnapshot{buf: b}, nil
}

func (s *fsmSnapshot) Persist(sink raft.SnapshotSink) error {
	if _, err := sink.Write(s.buf); err != nil {
		sink.Cancel()
		return err
	}
	return sink.Close()
}

func (s *fsmSnapshot) Release() {}

func (f *FSM) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		return err
	}
	const size = 4 + 1 + 8 + 8 + 32 + 4
	if len(b) != size || string(b[:4]) != snapMagic || b[4] != 1 {
		return errors.New("clustertest: bad snapshot header")
	}
	if crc32.ChecksumIEEE(b[:size-4]) != binary.BigEndian.Uint32(b[size-4:]) {
		return errors.New("clustertest: snapshot checksum mismatch")
	}
	f.mu.Lock()
	f.applied = binary.BigEndian.Uint64(b[5:])
	f.count = binary.BigEndian.Uint64(b[13:])
	copy(f.chain[:], b[21:53])
	f.mu.Unlock()
	f.restores.Add(1)
	return nil
}

var _ cluster.StateMachine = (*FSM)(nil)
