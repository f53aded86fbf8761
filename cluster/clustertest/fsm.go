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
	"slices"
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
// a SHA-256 chain over the accepted commands and their count. Like the real
// FSM it is idempotent: a command whose bytes were already accepted is a
// no-op, so a writer may retry after ErrOutcomeUnknown. Apply returns the
// count after the command (uint64) or ErrRejected.
type FSM struct {
	// mu guards applied, count, chain and seen: raft applies on its own
	// goroutine while tests read the digest and counts.
	mu      sync.Mutex
	applied uint64
	count   uint64
	chain   [32]byte
	seen    map[uint64]bool // first 8 bytes of SHA-256 of each accepted command

	restores   atomic.Uint64
	rejected   atomic.Uint64
	applyDelay atomic.Int64 // nanoseconds slept per ApplyBatch (simulates a slow FSM)
}

// NewFSM returns an empty FSM.
func NewFSM() *FSM { return &FSM{seen: map[uint64]bool{}} }

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
			f.rejected.Add(1)
			continue
		}
		sum := sha256.Sum256(l.Data)
		key := binary.BigEndian.Uint64(sum[:8])
		if !f.seen[key] {
			f.seen[key] = true
			h := sha256.New()
			h.Write(f.chain[:])
			h.Write(l.Data)
			h.Sum(f.chain[:0])
			f.count++
		}
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

// Halted is always nil: every command is known to this machine.
func (f *FSM) Halted() error { return nil }

// Refused counts rejected commands as domain errors.
func (f *FSM) Refused() (unknownTypes, undecodable, domainErrors uint64) {
	return 0, 0, f.rejected.Load()
}

// Snapshot format: "KVTF" | version u8 (2) | applied u64 | count u64 |
// chain[32] | n u32 | n sorted seen keys u64 | crc32(everything before).
const snapMagic = "KVTF"

type fsmSnapshot struct{ buf []byte }

func (f *FSM) Snapshot() (raft.FSMSnapshot, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	b := append([]byte(snapMagic), 2)
	b = binary.BigEndian.AppendUint64(b, f.applied)
	b = binary.BigEndian.AppendUint64(b, f.count)
	b = append(b, f.chain[:]...)
	keys := make([]uint64, 0, len(f.seen))
	for k := range f.seen {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	b = binary.BigEndian.AppendUint32(b, uint32(len(keys)))
	for _, k := range keys {
		b = binary.BigEndian.AppendUint64(b, k)
	}
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

// Restore builds fresh state, verifies it, then swaps it in.
func (f *FSM) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		return err
	}
	const head = 4 + 1 + 8 + 8 + 32 + 4
	if len(b) < head+4 || string(b[:4]) != snapMagic || b[4] != 2 {
		return errors.New("clustertest: bad snapshot header")
	}
	body, sum := b[:len(b)-4], binary.BigEndian.Uint32(b[len(b)-4:])
	if crc32.ChecksumIEEE(body) != sum {
		return errors.New("clustertest: snapshot checksum mismatch")
	}
	n := int(binary.BigEndian.Uint32(body[head-4:]))
	if len(body) != head+8*n {
		return errors.New("clustertest: snapshot length mismatch")
	}
	seen := make(map[uint64]bool, n)
	for i := 0; i < n; i++ {
		seen[binary.BigEndian.Uint64(body[head+8*i:])] = true
	}
	f.mu.Lock()
	f.applied = binary.BigEndian.Uint64(body[5:])
	f.count = binary.BigEndian.Uint64(body[13:])
	copy(f.chain[:], body[21:53])
	f.seen = seen
	f.mu.Unlock()
	f.restores.Add(1)
	return nil
}

var _ cluster.StateMachine = (*FSM)(nil)
