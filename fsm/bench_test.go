package fsm

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/internal/proccpu"
	"github.com/kvrouter/kvrouter/router"
)

const (
	benchEvents    = 1024 // events per batch (one Raft entry)
	benchBlocks    = 4    // blocks per stored event
	benchWorkers   = 8
	benchRing      = 64 // distinct batches before the workers are resynced
	benchChainSize = 16 // events per chain: the others name their predecessor as parent
)

func benchWorkerID(w int) string { return fmt.Sprintf("vllm-%d", w) }

// benchBatches returns benchRing batches of benchEvents stored events of
// benchBlocks blocks each, spread over benchWorkers workers, with vLLM-like
// engine hashes (not our content hashes: 16 bytes per block on the wire) and
// parent links, event ids continuing from batch to batch.
func benchBatches(tb testing.TB) [][]KVBatchEvent {
	rng := newRand(42)
	out := make([][]KVBatchEvent, benchRing)
	next := make([]uint64, benchWorkers)   // per worker: events so far
	parent := make([]uint64, benchWorkers) // per worker: last engine hash
	for k := range out {
		evs := make([]KVBatchEvent, benchEvents)
		for i := range evs {
			w := i % benchWorkers
			ev := router.KVEvent{Kind: router.EventStored, BlockSize: 16, Blocks: make([]router.StoredBlock, benchBlocks)}
			if next[w]%benchChainSize != 0 {
				ev.HasParent, ev.Parent = true, parent[w]
			}
			for j := range ev.Blocks {
				h := rng.Uint64()
				ev.Blocks[j] = router.StoredBlock{EngineHash: h ^ 0x5bd1e995, ContentHash: h}
			}
			parent[w] = ev.Blocks[benchBlocks-1].EngineHash
			next[w]++
			evs[i] = KVBatchEvent{Worker: benchWorkerID(w), EventID: next[w], Event: ev}
		}
		out[k] = evs
	}
	return out
}

// BenchmarkFSMApplyBatch: applying one Raft entry of 1024 stored events of
// 4 blocks (4096 block events) through ApplyBatch, decode included. Every
// 64 batches (262k blocks) a fresh FSM takes over, outside the timer, so the
// index stays bounded and every event is fresh (no duplicates): the figure
// is for an index growing from empty to 262k blocks over 8 workers.
func BenchmarkFSMApplyBatch(b *testing.B) {
	fresh := func() *harness {
		h := newHarness(b)
		for w := range benchWorkers {
			h.ok(RegisterWorker{ID: benchWorkerID(w), DPRanks: 1, Model: "m", TotalBlocks: 1 << 20})
		}
		return h
	}
	var entries [][]byte
	for _, evs := range benchBatches(b) {
		entries = append(entries, mustEncode(b, KVEventBatch{Events: evs}))
	}
	h := fresh()
	b.SetBytes(int64(len(entries[0])))
	b.ReportAllocs()
	b.ResetTimer()
	var cpu time.Duration // the process's CPU time while the timer runs
	cpu0 := proccpu.Self()
	for i := 0; i < b.N; i++ {
		k := i % benchRing
		if k == 0 && i > 0 {
			b.StopTimer()
			cpu += proccpu.Self() - cpu0
			h = fresh()
			cpu0 = proccpu.Self()
			b.StartTimer()
		}
		out := h.f.ApplyBatch([]*raft.Log{h.next(entries[k])})
		if r := out[0].(*ApplyResult); r.Applied != benchEvents {
			b.Fatalf("batch %d: %+v", k, r)
		}
	}
	cpu += proccpu.Self() - cpu0
	blocks := float64(b.N) * benchEvents * benchBlocks
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/blocks, "ns/block")
	b.ReportMetric(float64(cpu.Nanoseconds())/blocks, "cpu-ns/block")
	b.ReportMetric(blocks/b.Elapsed().Seconds(), "blocks/s")
}

// BenchmarkEncodeKVBatch: encoding the same 1024-event batch into a reused
// buffer (what the leader's consumer loop does before raft.Apply).
func BenchmarkEncodeKVBatch(b *testing.B) {
	evs := benchBatches(b)[1]
	buf, err := AppendKVBatch(nil, evs)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(buf)))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		buf, _ = AppendKVBatch(buf[:0], evs)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*benchEvents), "ns/event")
}

// BenchmarkDecodeKVBatch: decoding that batch with the FSM's reused buffers.
func BenchmarkDecodeKVBatch(b *testing.B) {
	buf, err := AppendKVBatch(nil, benchBatches(b)[1])
	if err != nil {
		b.Fatal(err)
	}
	var d kvDecoder
	b.SetBytes(int64(len(buf)))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := d.decode(buf[2:], false); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*benchEvents), "ns/event")
}

// BenchmarkFSMSnapshot: capture and persist of a 262k-block index over 8
// workers (the capture runs under the lock, between applies).
func BenchmarkFSMSnapshot(b *testing.B) {
	h := newHarness(b)
	for w := range benchWorkers {
		h.ok(RegisterWorker{ID: benchWorkerID(w), DPRanks: 1, Model: "m"})
	}
	for _, evs := range benchBatches(b) {
		h.events(evs...)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		snap, _ := h.f.Snapshot()
		var sink memSink
		if err := snap.Persist(&sink); err != nil {
			b.Fatal(err)
		}
		b.SetBytes(int64(sink.Len()))
	}
}

// BenchmarkFSMLargeState: an FSM holding blocks block entries over workers
// workers (each block held by one worker, vLLM-like engine names that
// differ from our hashes), built through ApplyBatch outside the timer.
// Reported, once per run (use -benchtime 1x): heap per block entry of the
// live FSM (heapB/block), the snapshot capture that runs under the FSM's
// lock and so stalls applies (capture_ms), streaming it to a sink
// (persist_ms) and its size (snapshot_MB, B/block), restoring it into a
// fresh FSM (restore_ms) and the heap the capture holds until released
// (captureB/block: the image is the index's blocks a second time).
func BenchmarkFSMLargeState(b *testing.B) {
	for _, tc := range []struct{ blocks, workers int }{
		{1 << 20, 64}, {1 << 20, 1024}, {10 << 20, 64}, {10 << 20, 1024},
	} {
		b.Run(fmt.Sprintf("blocks=%dM/workers=%d", tc.blocks>>20, tc.workers), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				benchLargeState(b, tc.blocks, tc.workers)
			}
		})
	}
}

func heapNow() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

func benchLargeState(b *testing.B, blocks, workers int) {
	b.StopTimer()
	base := heapNow()
	h := newHarness(b)
	for w := range workers {
		h.ok(RegisterWorker{ID: benchWorkerID(w), DPRanks: 1, Model: "m", TotalBlocks: 1 << 30})
	}
	const perEvent, perBatch = 32, 1024 // blocks per event, events per Raft entry
	rng := newRand(7)
	next := make([]uint64, workers)
	evs := make([]KVBatchEvent, 0, perBatch)
	flush := func() {
		if r := h.events(evs...); r.Applied != len(evs) {
			b.Fatalf("applied %d of %d: %+v", r.Applied, len(evs), r)
		}
		evs = evs[:0]
	}
	for e := 0; e < blocks/perEvent; e++ {
		w := e % workers
		ev := router.KVEvent{Kind: router.EventStored, BlockSize: 16, Blocks: make([]router.StoredBlock, perEvent)}
		for j := range ev.Blocks {
			x := rng.Uint64()
			ev.Blocks[j] = router.StoredBlock{EngineHash: x ^ 0x5bd1e995, ContentHash: x}
		}
		next[w]++
		evs = append(evs, KVBatchEvent{Worker: benchWorkerID(w), EventID: next[w], Event: ev})
		if len(evs) == perBatch {
			flush()
		}
	}
	if len(evs) > 0 {
		flush()
	}
	live := heapNow()
	n := float64(blocks)
	b.ReportMetric(float64(live-base)/n, "heapB/block")

	b.StartTimer()
	t0 := time.Now()
	snap, err := h.f.Snapshot()
	if err != nil {
		b.Fatal(err)
	}
	capture := time.Since(t0)
	b.StopTimer()
	held := heapNow()
	b.StartTimer()
	t1 := time.Now()
	var sink memSink
	if err := snap.Persist(&sink); err != nil {
		b.Fatal(err)
	}
	persist := time.Since(t1)
	snap.Release()
	fresh := newFSM(b)
	t2 := time.Now()
	if err := restoreBytes(fresh, sink.Bytes()); err != nil {
		b.Fatal(err)
	}
	restore := time.Since(t2)
	b.StopTimer()
	if got := fresh.Digest(); got != h.f.Digest() {
		b.Fatalf("restored digest %s, want %s", got, h.f.Digest())
	}
	b.ReportMetric(float64(held-live)/n, "captureB/block")
	b.ReportMetric(float64(capture.Milliseconds()), "capture_ms")
	b.ReportMetric(float64(persist.Milliseconds()), "persist_ms")
	b.ReportMetric(float64(restore.Milliseconds()), "restore_ms")
	b.ReportMetric(float64(sink.Len())/(1<<20), "snapshot_MB")
	b.ReportMetric(float64(sink.Len())/n, "B/block")
	runtime.KeepAlive(fresh)
}
