package fsm

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// TestFSMDigestCheckpoints: two FSMs applying the same entries, one of
// them in batches, record the same digest at every checkpoint index, and
// each equals the digest of a third FSM stopped at that index; only the
// last checkpointsKept are kept.
func TestFSMDigestCheckpoints(t *testing.T) {
	a, b := newHarness(t), newHarness(t)
	a.f.SetDigestCheckpoints(3)
	b.f.SetDigestCheckpoints(3)
	var cmds [][]byte
	cmds = append(cmds, mustEncode(t, RegisterWorker{ID: "w1", DPRanks: 1, Model: "m", TotalBlocks: 1000}))
	for i := range 40 {
		ev := KVBatchEvent{Worker: "w1", EventID: uint64(i + 1), Event: router.KVEvent{Kind: router.EventStored,
			Blocks: []router.StoredBlock{{EngineHash: uint64(1000 + i), ContentHash: uint64(i + 1)}}}}
		cmds = append(cmds, mustEncode(t, KVEventBatch{Events: []KVBatchEvent{ev}}))
	}
	for _, c := range cmds {
		a.raw(c)
	}
	logs := make([]*raft.Log, 0, len(cmds))
	for _, c := range cmds {
		logs = append(logs, b.next(c))
	}
	b.f.ApplyBatch(logs)

	want := map[uint64]string{} // index → digest of the state right after it
	for _, stop := range []uint64{3, 6, 39, 9 * 3, 13 * 3} {
		c := newHarness(t)
		for _, d := range cmds[:stop] {
			c.raw(d)
		}
		want[stop] = c.f.Digest()
	}
	var ca []Checkpoint
	poll.Until(t, 10*time.Second, 5*time.Millisecond, func() error {
		ca = a.f.Checkpoints()
		cb := b.f.Checkpoints()
		if len(ca) != checkpointsKept || len(cb) != checkpointsKept || ca[len(ca)-1].Index != 39 || cb[len(cb)-1].Index != 39 {
			return fmt.Errorf("checkpoints %v and %v", ca, cb)
		}
		// Hashing goroutines finish in any order, so a ring may hold 39
		// before an earlier checkpoint's digest lands: wait for both to settle.
		if !slices.Equal(ca, cb) {
			return fmt.Errorf("entry by entry %v, batched %v", ca, cb)
		}
		return nil
	})
	if ca[0].Index != 39-3*(checkpointsKept-1) {
		t.Fatalf("kept %v: want the last %d", ca, checkpointsKept)
	}
	compared := 0
	for _, cp := range ca {
		if d, ok := want[cp.Index]; ok {
			compared++
			if d != cp.Digest {
				t.Fatalf("checkpoint %d: %s, the state's digest there %s", cp.Index, cp.Digest, d)
			}
		}
	}
	if compared < 2 {
		t.Fatalf("only %d checkpoints compared with a stopped state: %v", compared, ca)
	}
}
