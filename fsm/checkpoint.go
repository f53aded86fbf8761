package fsm

import (
	"crypto/sha256"
	"encoding/hex"
	"slices"
	"sync"
)

// Digest checkpoints let replicas compare their states while entries keep
// arriving. Two replicas' digests are only comparable at the same applied
// index, and under steady KV-event ingest two status polls almost never
// land on one; so every replica digests its state at the same indexes —
// each multiple of the checkpoint interval, the moment that entry is
// applied — and keeps the last few. Any two replicas that applied a
// checkpoint's entry have a digest for exactly that state.
//
// The copy is taken under the apply lock (as a snapshot's: Index.
// CopyWorkerBlocks, ~95 ms per million blocks); sorting and hashing it
// happen on a goroutine of its own, so applies wait for the copy only.

// Checkpoint is the digest of the state right after the entry at Index.
type Checkpoint struct {
	Index  uint64 `json:"index"`
	Digest string `json:"digest"`
}

// checkpointsKept is how many recent checkpoints an FSM keeps.
const checkpointsKept = 8

type checkpoints struct {
	every uint64 // 0: off; set before the first apply

	mu   sync.Mutex
	ring []Checkpoint // oldest first, hashed ones only
}

// SetDigestCheckpoints makes the FSM digest its state after every entry
// whose index is a multiple of every (0: never, the default). Call it
// before the first apply.
func (f *FSM) SetDigestCheckpoints(every uint64) { f.ckpt.every = every }

// checkpointLocked digests the state if the entry just applied at index is
// a checkpoint. f.mu must be held.
func (f *FSM) checkpointLocked(index uint64) {
	if f.ckpt.every == 0 || index%f.ckpt.every != 0 || f.applied.Load() != index || f.halt.Load() != nil {
		return
	}
	img := f.captureLocked()
	go func() {
		h := sha256.New()
		_ = writeImage(h, img, false) // the digest's canonical form; hashes never fail to write
		f.ckpt.add(Checkpoint{Index: index, Digest: hex.EncodeToString(h.Sum(nil))})
	}()
}

func (c *checkpoints) add(cp Checkpoint) {
	c.mu.Lock()
	defer c.mu.Unlock()
	// Hashing goroutines may finish out of order: keep the ring sorted.
	i, _ := slices.BinarySearchFunc(c.ring, cp.Index, func(a Checkpoint, idx uint64) int {
		switch {
		case a.Index < idx:
			return -1
		case a.Index > idx:
			return 1
		}
		return 0
	})
	c.ring = slices.Insert(c.ring, i, cp)
	if len(c.ring) > checkpointsKept {
		c.ring = slices.Delete(c.ring, 0, len(c.ring)-checkpointsKept)
	}
}

// Checkpoints are the recent digest checkpoints, oldest first.
func (f *FSM) Checkpoints() []Checkpoint {
	f.ckpt.mu.Lock()
	defer f.ckpt.mu.Unlock()
	return append([]Checkpoint{}, f.ckpt.ring...) // [] in JSON before the first one, not null
}
