package router

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/proccpu"
)

// cpuClock reads the process's CPU time (user + system), so a benchmark
// can report CPU ns per op beside the wall-clock ns/op: on a shared
// machine the wall clock also counts the time other processes hold the
// cores, the CPU time only (mostly) this benchmark's own work.
type cpuClock time.Duration

func startCPU() cpuClock { return cpuClock(proccpu.Self()) }

// report adds the CPU ns per op since c as the metric cpu-ns/op (per n
// ops; b.N when n is 0).
func (c cpuClock) report(b *testing.B, n int) {
	if n == 0 {
		n = b.N
	}
	b.ReportMetric(float64(proccpu.Self()-time.Duration(c))/float64(n), "cpu-ns/op")
}

// benchIndex builds an index of blocks distinct blocks in chains of chainLen,
// each chain stored on two of workers workers, with engine hashes that differ
// from content hashes (as vLLM's do), and returns it with its chains.
func benchIndex(b testing.TB, blocks, workers, chainLen int) (*Index, [][]uint64) {
	rng := rand.New(rand.NewPCG(1, 2))
	ix := NewIndex(16)
	for w := range workers {
		ix.AddWorker(WorkerID(fmt.Sprintf("w%02d", w)))
	}
	chains := make([][]uint64, blocks/chainLen)
	for c := range chains {
		seq := make([]uint64, chainLen)
		sb := make([]StoredBlock, chainLen)
		for i := range seq {
			seq[i] = rng.Uint64()
			sb[i] = StoredBlock{EngineHash: seq[i] ^ 0x5bd1e995, ContentHash: seq[i]}
		}
		chains[c] = seq
		w1 := rng.IntN(workers)
		w2 := (w1 + 1 + rng.IntN(workers-1)) % workers
		for _, w := range []int{w1, w2} {
			if err := ix.Apply(WorkerID(fmt.Sprintf("w%02d", w)), KVEvent{Kind: EventStored, Blocks: sb}); err != nil {
				b.Fatal(err)
			}
		}
	}
	return ix, chains
}

// benchFleets are the fleet sizes the index benchmarks run at: one word of
// worker bits, and past it (issue 19: an index for 1,000 workers).
var benchFleets = []int{64, 256, 1024}

// BenchmarkFindMatches: one overlap lookup of a 256-block prompt that is
// fully cached (the worst case: no early exit) over 1M blocks, each chain
// held by two workers of the fleet.
func BenchmarkFindMatches(b *testing.B) {
	for _, workers := range benchFleets {
		b.Run(fmt.Sprintf("blocks=1M/workers=%d/prompt=256", workers), func(b *testing.B) {
			ix, chains := benchIndex(b, 1<<20, workers, 256)
			var dst []Overlap
			b.ResetTimer()
			defer startCPU().report(b, 0)
			for i := 0; i < b.N; i++ {
				dst = ix.FindMatches(chains[(i*4099)%len(chains)], dst)
				if len(dst) == 0 || dst[0].Blocks != 256 {
					b.Fatalf("overlap %v", dst)
				}
			}
		})
	}
}

// BenchmarkApplyStored: ns per stored block at a steady 1M blocks over 64
// workers, as in a full cache: each iteration stores a fresh 16-block chain
// on a worker and removes that worker's oldest chain, so the figure includes
// the matching removal and the maps never grow.
func BenchmarkApplyStored(b *testing.B) {
	for _, workers := range benchFleets {
		b.Run(fmt.Sprintf("blocks=1M/workers=%d", workers), func(b *testing.B) { benchApplyStored(b, workers, 0) })
	}
	// The same through ApplyCapped with a cap never reached (what fsm
	// does for every stored event): the cost of the cap check.
	b.Run("capped/blocks=1M/workers=64", func(b *testing.B) { benchApplyStored(b, 64, 1<<30) })
	// A fresh chain for every store. Above, the pool of 4,096 chains
	// cycles in step with the rings (64 workers × 64 slots), so each
	// iteration removes a chain and stores that same chain again: the
	// store finds every slot it needs in the cache the removal just
	// filled. Here the pool (4,099 chains) is out of step: the store is
	// of a chain not held, whose slots are as cold as the removal's.
	b.Run("fresh/blocks=1M/workers=64", func(b *testing.B) { benchApplyStoredPool(b, 64, 0, 4099) })
	applyStoredMore(b)
}

// benchApplyStored applies stored events through ApplyCapped with maxHeld
// (0: no cap, what Apply does), evicting as it goes.
func benchApplyStored(b *testing.B, workers, maxHeld int) {
	benchApplyStoredPool(b, workers, maxHeld, 4096)
}

// benchApplyStoredPool is benchApplyStored with a pool of poolSize chains
// to store from, in turn.
func benchApplyStoredPool(b *testing.B, workers, maxHeld, poolSize int) {
	ix, _ := benchIndex(b, 1<<20, workers, 256)
	// 64 chains per worker at 64 workers; fewer per worker in bigger fleets
	// so the rings add the same 64K blocks whatever the fleet.
	const chain = 16
	ring := max(1, 64*64/workers)
	rng := rand.New(rand.NewPCG(9, 9))
	fresh := func() KVEvent {
		sb := make([]StoredBlock, chain)
		for i := range sb {
			h := rng.Uint64()
			sb[i] = StoredBlock{EngineHash: h ^ 0x5bd1e995, ContentHash: h}
		}
		return KVEvent{Kind: EventStored, Blocks: sb, BlockSize: 16}
	}
	ids := ix.Workers()
	// Each worker keeps a ring of its last chains to evict from.
	rings := make([][]KVEvent, len(ids))
	for w := range rings {
		for range ring {
			ev := fresh()
			_ = ix.Apply(ids[w], ev)
			rings[w] = append(rings[w], ev)
		}
	}
	pool := make([]KVEvent, poolSize)
	for i := range pool {
		pool[i] = fresh()
	}
	removal := make([]uint64, chain)
	b.ResetTimer()
	defer startCPU().report(b, 0)
	for e := 0; e*chain < b.N; e++ {
		w := e % len(ids)
		slot := (e / len(ids)) % ring
		old := rings[w][slot]
		for i, blk := range old.Blocks {
			removal[i] = blk.EngineHash
		}
		if err := ix.Apply(ids[w], KVEvent{Kind: EventRemoved, Removed: removal}); err != nil {
			b.Fatal(err)
		}
		ev := pool[e%len(pool)]
		if err := ix.ApplyCapped(ids[w], ev, maxHeld); err != nil {
			b.Fatal(err)
		}
		rings[w][slot] = ev
	}
}

// selectBench is a router over workers workers and a 256K-block index
// with four in-flight requests per worker, and prompts of promptBlocks
// blocks.
func selectBench(b *testing.B, workers, promptBlocks int) (*Router, [][]uint64) {
	ix, chains := benchIndex(b, 1<<18, workers, promptBlocks)
	r, err := New(DefaultConfig(), ix, 1)
	if err != nil {
		b.Fatal(err)
	}
	ws := make([]WorkerInfo, 0, workers)
	for _, w := range ix.Workers() {
		ws = append(ws, WorkerInfo{ID: w, TotalBlocks: 10000, MaxBatchedTokens: 8192})
	}
	r.SetWorkers(ws)
	for i := range 4 * workers {
		r.Load().Add(Booking{ID: fmt.Sprint("bg", i), Worker: ws[i%workers].ID, Hashes: chains[i], PrefillTokens: 512, Added: t0})
	}
	return r, chains
}

// BenchmarkSelect: one whole routing decision (overlap lookup, load rows,
// cost of every worker, pick) for a 32-block (512-token) prompt over 64,
// 256 and 1,024 workers, in every mode ("workers=N" alone is kv, so the
// pattern BenchmarkSelect/workers=64$ selects kv alone). The
// rows of one decision are the next one's storage (decideBench), as a
// caller without a decision log can do: the decision itself allocates
// nothing ("new-rows/": Decide, a new cost table per decision). Booking
// the load is measured separately by BenchmarkRoute.
func BenchmarkSelect(b *testing.B) {
	for _, workers := range benchFleets {
		for _, mode := range Modes {
			name := fmt.Sprintf("workers=%d", workers)
			if mode != ModeKV {
				name = fmt.Sprintf("mode=%s/workers=%d", mode, workers)
			}
			b.Run(name, func(b *testing.B) {
				r, chains := selectBench(b, workers, 32)
				cfg := r.Config()
				cfg.Mode = mode
				if err := r.SetConfig(cfg); err != nil {
					b.Fatal(err)
				}
				var rows []WorkerCost
				b.ResetTimer()
				defer startCPU().report(b, 0)
				for i := 0; i < b.N; i++ {
					d, err := decideBench(r, Request{ID: "q", Hashes: chains[(i*31)%len(chains)], Tokens: 32 * 16}, t0, rows)
					if err != nil {
						b.Fatal(err)
					}
					rows = d.Rows
				}
			})
		}
	}
	b.Run("new-rows/workers=64", func(b *testing.B) {
		r, chains := selectBench(b, 64, 32)
		b.ResetTimer()
		defer startCPU().report(b, 0)
		for i := 0; i < b.N; i++ {
			if _, err := r.Decide(Request{ID: "q", Hashes: chains[(i*31)%len(chains)], Tokens: 32 * 16}, t0); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkSelectOverTheLine: kv-pooled's decision when 60 of 64 workers
// are over the admission line and 4 can start the request, with rates and
// output lengths observed, so the TTFT-parity rule estimates the wait at
// every worker over the line (their running requests, in order of expected
// end). "one-waiting": the same with a request already waiting for
// admission, which turns the rule off: the difference is the rule's cost.
func BenchmarkSelectOverTheLine(b *testing.B) {
	for _, waiting := range []bool{false, true} {
		name := "workers=64/parity"
		if waiting {
			name += "/one-waiting"
		}
		b.Run(name, func(b *testing.B) {
			ix, chains := benchIndex(b, 1<<18, 64, 32)
			cfg := DefaultConfig()
			cfg.Mode = ModeKVPooled
			r, err := New(cfg, ix, 1)
			if err != nil {
				b.Fatal(err)
			}
			ws := make([]WorkerInfo, 0, 64)
			for i, w := range ix.Workers() {
				total := 140 // 4 running requests of 32 blocks: over the line
				if i%16 == 0 {
					total = 10_000
				}
				ws = append(ws, WorkerInfo{ID: w, TotalBlocks: total, MaxBatchedTokens: 8192})
			}
			r.SetWorkers(ws)
			for i := range 256 {
				id := fmt.Sprint("bg", i)
				r.Load().Add(Booking{ID: id, Worker: ws[i%64].ID, Hashes: chains[i], PrefillTokens: 512, Added: t0})
				r.Load().PrefillDoneAt(id, t0.Add(time.Duration(i)*time.Millisecond))
			}
			r.mu.Lock()
			r.wait.fleet.prefill.observe(0.1, 100, pooledRateWindow)
			r.wait.fleet.decode.observe(1, 100, pooledRateWindow)
			r.outputs = pooledOutputs{n: 1, mean: 64}
			if waiting {
				r.wait.book("waiting", ws[0].ID, t0, 10, false)
			}
			r.mu.Unlock()
			now := t0.Add(500 * time.Millisecond)
			var rows []WorkerCost
			b.ResetTimer()
			defer startCPU().report(b, 0)
			for i := 0; i < b.N; i++ {
				d, err := decideBench(r, Request{ID: "q", Hashes: chains[256+(i*31)%(len(chains)-256)], Tokens: 32 * 16}, now, rows)
				if err != nil {
					b.Fatal(err)
				}
				rows = d.Rows
			}
		})
	}
}

// BenchmarkRoute: decide, book the load and free it, for a 64-block prompt.
func BenchmarkRoute(b *testing.B) {
	b.Run("workers=64/prompt=64", func(b *testing.B) {
		r, chains := selectBench(b, 64, 64)
		ids := make([]string, 1024)
		for i := range ids {
			ids[i] = fmt.Sprint("r", i)
		}
		b.ResetTimer()
		defer startCPU().report(b, 0)
		for i := 0; i < b.N; i++ {
			id := ids[i%len(ids)]
			if _, err := r.Route(Request{ID: id, Hashes: chains[(i*31)%len(chains)], Tokens: 64 * 16}, t0); err != nil {
				b.Fatal(err)
			}
			r.Free(id)
		}
	})
}

// BenchmarkIndexMemory reports heap bytes per (block, worker) entry at 1M
// blocks, each chain held by two workers of the fleet, with engine hashes
// that differ from content hashes (vLLM) and with equal ones (kvmock, our
// bridge).
func BenchmarkIndexMemory(b *testing.B) {
	for _, workers := range benchFleets {
		for _, aliased := range []bool{true, false} {
			b.Run(fmt.Sprintf("blocks=1M/workers=%d/engine-names=%v", workers, aliased), func(b *testing.B) {
				for i := 0; i < b.N; i++ {
					benchIndexMemory(b, workers, aliased)
				}
			})
		}
	}
}

func benchIndexMemory(b *testing.B, workers int, aliased bool) {
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	ix := NewIndex(16)
	rng := rand.New(rand.NewPCG(3, 4))
	for w := range workers {
		ix.AddWorker(WorkerID(fmt.Sprint("w", w)))
	}
	entries := 0
	sb := make([]StoredBlock, 256)
	for c := 0; c < (1<<20)/256; c++ {
		for j := range sb {
			h := rng.Uint64()
			sb[j] = StoredBlock{EngineHash: h, ContentHash: h}
			if aliased {
				sb[j].EngineHash ^= 0x5bd1e995
			}
		}
		// Two holders drawn at random, as in benchIndex: past 64 workers
		// they mostly sit in different words of bits.
		first := rng.IntN(workers)
		for _, w := range []int{first, (first + 1 + rng.IntN(workers-1)) % workers} {
			_ = ix.Apply(WorkerID(fmt.Sprint("w", w)), KVEvent{Kind: EventStored, Blocks: sb})
			entries += len(sb)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(entries), "B/entry")
	runtime.KeepAlive(ix)
}
