package fsm

import (
	"fmt"
	"testing"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/internal/proccpu"
	"github.com/kvrouter/kvrouter/router"
)

// BenchmarkApplyBatch: whole KV-batch entries through FSM.ApplyBatch
// (decode, cursors, index) at a steady 1M blocks over 64 workers, as in a
// full cache: each entry removes, for 8 workers, the oldest chain of
// their ring and stores a fresh one in its place, so the index neither
// grows nor shrinks (the workload of router's BenchmarkApplyStored, as
// Raft entries instead of Index calls). events=16blocks: stored and removed
// events of 16 blocks (16 events, 128 stored and 128 removed blocks an
// entry); events=1block: one block an event (256 events an entry), as
// engines that report each block on its own send them. Events are
// unsequenced (id 0), so the entries can be replayed in a cycle; vLLM-like
// engine names (16 bytes a block in the entry). Metrics: cpu-ns/block (the
// process's CPU time per stored block, its removal included: comparable
// with BenchmarkApplyStored) and ns/block-event (wall clock per block
// event, stored or removed).
func BenchmarkApplyBatch(b *testing.B) {
	for _, chain := range []int{16, 1} {
		name := fmt.Sprintf("events=%dblocks/blocks=1M/workers=64", chain)
		if chain == 1 {
			name = "events=1block/blocks=1M/workers=64"
		}
		b.Run(name, func(b *testing.B) { benchApplyBatch(b, chain) })
	}
}

func benchApplyBatch(b *testing.B, chain int) {
	const (
		workers   = 64
		perEntry  = 8 // workers whose chains an entry replaces
		blocks    = 1 << 20
		ringBlock = 1024 // blocks in each worker's ring
	)
	h := newHarness(b)
	ids := make([]string, workers)
	for w := range ids {
		ids[w] = fmt.Sprintf("w%02d", w)
		h.ok(RegisterWorker{ID: ids[w], DPRanks: 1, Model: "m", TotalBlocks: 1 << 30})
	}
	rng := newRand(9)
	fresh := func(n int) router.KVEvent {
		ev := router.KVEvent{Kind: router.EventStored, BlockSize: 16, Blocks: make([]router.StoredBlock, n)}
		for i := range ev.Blocks {
			x := rng.Uint64()
			ev.Blocks[i] = router.StoredBlock{EngineHash: x ^ 0x5bd1e995, ContentHash: x}
		}
		return ev
	}
	apply := func(evs []KVBatchEvent) {
		if r := h.events(evs...); r.Err != nil || r.Applied != len(evs) {
			b.Fatalf("applied %d of %d: %+v", r.Applied, len(evs), r)
		}
	}
	// The resident blocks: chains of 256 on two workers each.
	var evs []KVBatchEvent
	for range blocks / 256 {
		ev := fresh(256)
		w1 := rng.IntN(workers)
		w2 := (w1 + 1 + rng.IntN(workers-1)) % workers
		evs = append(evs, KVBatchEvent{Worker: ids[w1], Event: ev}, KVBatchEvent{Worker: ids[w2], Event: ev})
		if len(evs) >= 256 {
			apply(evs)
			evs = evs[:0]
		}
	}
	apply(evs)
	// Each worker's ring: two sets of chains, A stored now, B not; the
	// first half of the cycle replaces A by B, the second B by A, so the
	// entries replay forever against the same state.
	ring := ringBlock / chain
	var sets [2][][]router.KVEvent // set, worker, ring slot
	for s := range sets {
		sets[s] = make([][]router.KVEvent, workers)
		for w := range workers {
			for range ring {
				sets[s][w] = append(sets[s][w], fresh(chain))
			}
		}
	}
	evs = evs[:0]
	for w := range workers {
		for _, ev := range sets[0][w] {
			evs = append(evs, KVBatchEvent{Worker: ids[w], Event: ev})
		}
		apply(evs)
		evs = evs[:0]
	}
	removal := func(ev router.KVEvent) router.KVEvent {
		r := router.KVEvent{Kind: router.EventRemoved, Removed: make([]uint64, len(ev.Blocks))}
		for i, blk := range ev.Blocks {
			r.Removed[i] = blk.EngineHash
		}
		return r
	}
	var entries [][]byte
	perWorker := 16 / chain // slots of a worker an entry replaces: 16 blocks
	for half := range 2 {
		from, to := sets[half], sets[1-half]
		for slot := 0; slot < ring; slot += perWorker {
			for w0 := 0; w0 < workers; w0 += perEntry {
				evs = evs[:0]
				for w := w0; w < w0+perEntry; w++ {
					for k := slot; k < slot+perWorker; k++ {
						evs = append(evs, KVBatchEvent{Worker: ids[w], Event: removal(from[w][k])})
					}
					for k := slot; k < slot+perWorker; k++ {
						evs = append(evs, KVBatchEvent{Worker: ids[w], Event: to[w][k]})
					}
				}
				entries = append(entries, mustEncode(b, KVEventBatch{Events: evs}))
			}
		}
	}
	stored := perEntry * 16 // stored blocks an entry
	logs := make([]*raft.Log, 1)
	b.SetBytes(int64(len(entries[0])))
	b.ResetTimer()
	cpu0 := proccpu.Self()
	for i := 0; i < b.N; i++ {
		logs[0] = h.next(entries[i%len(entries)])
		if r := h.f.ApplyBatch(logs)[0].(*ApplyResult); r.Applied != 2*perEntry*perWorker {
			b.Fatalf("entry %d: %+v", i%len(entries), r)
		}
	}
	cpu := proccpu.Self() - cpu0
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N*stored), "cpu-ns/block")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*stored*2), "ns/block-event")
}
