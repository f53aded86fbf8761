package sim

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/router"
)

func synthetic(t *testing.T, spec workload.SyntheticSpec) *workload.Workload {
	t.Helper()
	if spec.BlockSize == 0 {
		spec.BlockSize = 16
	}
	w, err := workload.NewSynthetic(spec)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func config(mode router.Mode, workers, blocks int) Config {
	rc := router.DefaultConfig()
	rc.Mode = mode
	kv := make([]int, workers)
	for i := range kv {
		kv[i] = blocks
	}
	return Config{
		Workers: workers, KVBlocks: kv,
		Engine:     engine.Config{BlockSize: 16},
		Router:     rc,
		EventDelay: 5 * time.Millisecond,
		Seed:       1,
	}
}

func run(t *testing.T, w *workload.Workload, cfg Config) (*Result, Summary) {
	t.Helper()
	res, err := Run(w, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return res, Summarize(w, res, time.Minute)
}

// A prefix workload that does not fit one worker: kv must beat round-robin,
// every request must complete, and the closed loop must keep concurrency.
func TestSimRunInvariants(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{
		Prefixes: 8, PrefixTokens: 1024, TailTokens: 100, OutputTokens: 16,
		Requests: 300, Concurrency: 4, Seed: 5,
	})
	sums := map[router.Mode]Summary{}
	for _, m := range []router.Mode{router.ModeRoundRobin, router.ModeRandom, router.ModeKV, router.ModeKVApprox, router.ModeLeastLoaded, router.ModeLoadAware} {
		res, s := run(t, w, config(m, 4, 200))
		sums[m] = s
		if s.Errors != 0 || s.Completed != len(w.Requests) {
			t.Fatalf("%s: %d errors, %d of %d completed", m, s.Errors, s.Completed, len(w.Requests))
		}
		if res.IndexErrors != 0 {
			t.Errorf("%s: %d KV events rejected by the index", m, res.IndexErrors)
		}
		if (m == router.ModeKV) != (res.EventsDelivered > 0) {
			t.Errorf("%s: %d events delivered (only kv reads the event-fed index)", m, res.EventsDelivered)
		}
		// Closed loop: never more than 4 requests in flight, and each one
		// sent when an earlier one finished (or at 0).
		for i, rr := range res.Requests {
			if rr.FirstToken <= rr.Sent || rr.Finished < rr.FirstToken {
				t.Fatalf("%s: request %d times sent %v first %v finished %v", m, i, rr.Sent, rr.FirstToken, rr.Finished)
			}
			inflight := 0
			for _, o := range res.Requests {
				if o.Sent <= rr.Sent && o.Finished > rr.Sent {
					inflight++
				}
			}
			if inflight > 4 {
				t.Fatalf("%s: %d requests in flight when request %d was sent", m, inflight, i)
			}
			if i >= 4 && rr.Sent == 0 {
				t.Fatalf("%s: request %d sent at 0 with concurrency 4", m, i)
			}
			if i > 0 && rr.Sent < res.Requests[i-1].Sent {
				t.Fatalf("%s: request %d sent before request %d", m, i, i-1)
			}
		}
	}
	rr, kv := sums[router.ModeRoundRobin], sums[router.ModeKV]
	t.Logf("hit rate: round-robin %.3f, kv %.3f, kv-approx %.3f", rr.RequestHitRate, kv.RequestHitRate, sums[router.ModeKVApprox].RequestHitRate)
	if kv.RequestHitRate < rr.RequestHitRate || kv.CachedTokenRatio < rr.CachedTokenRatio {
		t.Fatalf("kv (%.3f, %.3f) below round-robin (%.3f, %.3f)", kv.RequestHitRate, kv.CachedTokenRatio, rr.RequestHitRate, rr.CachedTokenRatio)
	}
	if kv.RequestHitRate < rr.RequestHitRate+0.1 {
		t.Fatalf("kv hit rate %.3f is not clearly above round-robin's %.3f", kv.RequestHitRate, rr.RequestHitRate)
	}
	if rr.WorkersPerPrefix != 4 {
		t.Fatalf("round-robin spread a prefix over %.2f workers, want all 4", rr.WorkersPerPrefix)
	}
}

func TestSimDeterministic(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{
		Prefixes: 5, PrefixTokens: 512, TailTokens: 40, OutputTokens: 8, Requests: 120, Concurrency: 6, Seed: 9,
	})
	for _, m := range []router.Mode{router.ModeRandom, router.ModeKV} {
		a, _ := run(t, w, config(m, 3, 120))
		b, _ := run(t, w, config(m, 3, 120))
		for i := range a.Requests {
			if a.Requests[i] != b.Requests[i] {
				t.Fatalf("%s: request %d: %+v then %+v", m, i, a.Requests[i], b.Requests[i])
			}
		}
	}
}

func distinctBlocks(w *workload.Workload) int {
	distinct := map[uint64]bool{}
	for _, r := range w.Requests {
		for _, h := range r.Hashes {
			distinct[h] = true
		}
	}
	return len(distinct)
}

// The references against each other and against the policies. With room
// for every distinct block the pooled-LRU reference is the ideal and no
// policy caches more. With less room it is not a bound for a fleet (LRU is
// not optimal: a partition can keep what one LRU evicts; kv-pooled exceeds
// it on 3 workers in BENCHMARKS.md), but the ideal stays one, and one engine
// of the whole capacity pays for its pins: it caches no more than the
// pooled LRU, and more than the same capacity split over round-robin.
func TestSimPooledReferenceBound(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{
		Prefixes: 6, PrefixTokens: 800, TailTokens: 60, OutputTokens: 8, Requests: 200, Concurrency: 4, Seed: 3,
	})
	distinct := distinctBlocks(w)
	ref := ComputeReference(w, distinct)
	if ref.PooledLRU != ref.Ideal || ref.Ideal <= 0 {
		t.Fatalf("pooled %.4f, ideal %.4f: with room for every block they must be equal", ref.PooledLRU, ref.Ideal)
	}
	for _, m := range []router.Mode{router.ModeRoundRobin, router.ModeKV, router.ModeKVApprox, router.ModeKVPooled} {
		for _, blocks := range []int{(distinct + 2) / 3, 80} {
			_, s := run(t, w, config(m, 3, blocks))
			if s.Errors != 0 {
				t.Fatalf("%s with %d blocks each: %d errors", m, blocks, s.Errors)
			}
			if s.CachedTokenRatio > ref.PooledLRU {
				t.Errorf("%s with %d blocks each: cached ratio %.4f above the pooled reference %.4f", m, blocks, s.CachedTokenRatio, ref.PooledLRU)
			}
		}
	}

	// Capacity below the distinct blocks: 8 prefixes of 50 blocks on 3
	// workers of 90 (270 in all, the prefixes alone need 400).
	w = synthetic(t, workload.SyntheticSpec{
		Prefixes: 8, PrefixTokens: 800, TailTokens: 60, OutputTokens: 32, Requests: 400, Concurrency: 4, Seed: 4,
	})
	const workers, blocks = 3, 90
	ref = ComputeReference(w, workers*blocks)
	if !(ref.PooledLRU > 0 && ref.PooledLRU < ref.Ideal-0.05) {
		t.Fatalf("pooled %.4f, ideal %.4f: the case must be one where the pooled LRU misses", ref.PooledLRU, ref.Ideal)
	}
	one, err := EngineReference(w, config(router.ModeRoundRobin, 1, 1), workers*blocks)
	if err != nil {
		t.Fatal(err)
	}
	_, rr := run(t, w, config(router.ModeRoundRobin, workers, blocks))
	t.Logf("pooled LRU %.4f, one engine %.4f, round-robin %.4f, ideal %.4f", ref.PooledLRU, one, rr.CachedTokenRatio, ref.Ideal)
	if one > ref.PooledLRU || one <= rr.CachedTokenRatio {
		t.Errorf("one engine %.4f: want at most the pooled LRU %.4f and above round-robin over the same capacity %.4f", one, ref.PooledLRU, rr.CachedTokenRatio)
	}
	for _, m := range []router.Mode{router.ModeRoundRobin, router.ModeKV, router.ModeKVPooled} {
		_, s := run(t, w, config(m, workers, blocks))
		if s.Errors != 0 || s.CachedTokenRatio > ref.Ideal {
			t.Errorf("%s: %d errors, cached ratio %.4f above the ideal %.4f", m, s.Errors, s.CachedTokenRatio, ref.Ideal)
		}
	}
}

// One worker, one client. With block-aligned prompts and one output token
// the engine holds exactly the prompt's full blocks while a request runs
// and frees them in the reference's order, so the two agree exactly, with
// eviction or without (every tail is unique, so no prompt is wholly cached
// and vLLM's recomputed last block never allocates). Without eviction they
// agree exactly whatever the output (the hit accounting). With a partial
// last block and output tokens under eviction the engine caches less: the
// partial block and the output blocks take room while the request runs,
// and the full blocks mixing prompt and output tokens stay cached after
// it, in room the reference gives to prompt blocks.
func TestSimReferenceMatchesSingleEngine(t *testing.T) {
	cases := []struct {
		name         string
		tail, output int
		capacity     int // 0: every distinct block
		exact        bool
	}{
		{"no eviction, aligned prompt", 48, 1, 0, true},
		{"no eviction, partial last block and 16 output tokens", 50, 16, 0, true},
		{"eviction, aligned prompt", 48, 1, 180, true},
		{"eviction, partial last block and 16 output tokens", 50, 16, 180, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			w := synthetic(t, workload.SyntheticSpec{
				Prefixes: 9, PrefixTokens: 640, TailTokens: c.tail, OutputTokens: c.output, Requests: 150, Concurrency: 1, Seed: 11,
			})
			capacity := c.capacity
			if capacity == 0 {
				// Every distinct block plus the running request's partial
				// and output blocks: nothing is ever evicted.
				capacity = distinctBlocks(w) + 2
			}
			_, s := run(t, w, config(router.ModeRoundRobin, 1, capacity))
			ref := ComputeReference(w, capacity)
			t.Logf("engine %.6f, reference %.6f, ideal %.6f", s.CachedTokenRatio, ref.PooledLRU, ref.Ideal)
			switch {
			case c.exact && s.CachedTokenRatio != ref.PooledLRU:
				t.Fatalf("engine %.6f, reference %.6f: must be equal", s.CachedTokenRatio, ref.PooledLRU)
			case c.capacity == 0 && ref.PooledLRU != ref.Ideal:
				t.Fatalf("reference %.6f, ideal %.6f: nothing is evicted, they must be equal", ref.PooledLRU, ref.Ideal)
			case c.capacity > 0 && ref.PooledLRU >= ref.Ideal:
				t.Fatalf("reference %.6f, ideal %.6f: the case must evict", ref.PooledLRU, ref.Ideal)
			case !c.exact && s.CachedTokenRatio > ref.PooledLRU:
				t.Fatalf("engine %.6f above the reference %.6f", s.CachedTokenRatio, ref.PooledLRU)
			}
		})
	}
}

// Events reach the index only after the delay: with a delay longer than the
// run, kv sees no overlap and loses its advantage.
func TestSimEventDelay(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{
		Prefixes: 8, PrefixTokens: 1024, TailTokens: 100, OutputTokens: 16, Requests: 200, Concurrency: 4, Seed: 2,
	})
	cfg := config(router.ModeKV, 4, 200)
	_, fast := run(t, w, cfg)
	cfg.EventDelay = time.Hour
	res, slow := run(t, w, cfg)
	if res.EventsDelivered != 0 {
		t.Fatalf("%d events delivered within an hour's delay", res.EventsDelivered)
	}
	t.Logf("kv hit rate: 5ms delay %.3f, 1h delay %.3f", fast.RequestHitRate, slow.RequestHitRate)
	if slow.RequestHitRate >= fast.RequestHitRate-0.2 {
		t.Fatalf("kv without timely events hits %.3f, with them %.3f", slow.RequestHitRate, fast.RequestHitRate)
	}
}

func TestSimTraceSessionsAndOpenLoop(t *testing.T) {
	p := filepath.Join(t.TempDir(), "t.jsonl")
	lines := `{"timestamp": 0, "input_length": 2000, "output_length": 50, "hash_ids": [0, 1, 2, 3], "session_id": 1}
{"timestamp": 0, "input_length": 1000, "output_length": 50, "hash_ids": [0, 9]}
{"timestamp": 10, "input_length": 2600, "output_length": 10, "hash_ids": [0, 1, 2, 3, 4, 5], "session_id": 1}
{"timestamp": 5000, "input_length": 1000, "output_length": 10, "hash_ids": [0, 9]}
`
	if err := os.WriteFile(p, []byte(lines), 0o644); err != nil {
		t.Fatal(err)
	}
	w, err := workload.LoadTrace(workload.TraceSpec{Path: p, Speedup: 1, BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	res, s := run(t, w, config(router.ModeKV, 2, 1000))
	if s.Errors != 0 {
		t.Fatalf("%d errors", s.Errors)
	}
	r := res.Requests
	// Open loop: rows without a session go at their timestamps.
	if r[1].Sent != 0 || r[3].Sent != 5*time.Second {
		t.Fatalf("open-loop rows sent at %v and %v", r[1].Sent, r[3].Sent)
	}
	// The second turn waits for the first (which takes far more than 10 ms).
	if r[2].Sent != r[0].Finished || r[2].Sent <= 10*time.Millisecond {
		t.Fatalf("turn 2 sent at %v, turn 1 finished at %v", r[2].Sent, r[0].Finished)
	}
	// It extends turn 1, so kv routes it there and it hits.
	if r[2].Worker != r[0].Worker || r[2].CachedTokens < 1900 {
		t.Fatalf("turn 2 on worker %d with %d cached tokens; turn 1 on %d", r[2].Worker, r[2].CachedTokens, r[0].Worker)
	}
	if r[3].CachedTokens < 16 {
		t.Fatalf("row 4 repeats row 2's ids but cached %d tokens", r[3].CachedTokens)
	}
}

func TestSimRejectsImpossibleRequests(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{
		Prefixes: 1, PrefixTokens: 500, TailTokens: 0, OutputTokens: 100, Requests: 3, Concurrency: 2, Seed: 1,
	})
	// 600 tokens do not fit 30 blocks of 16: every request fails, none hangs.
	_, s := run(t, w, config(router.ModeKV, 2, 30))
	if s.Errors != 3 || s.Completed != 0 {
		t.Fatalf("%d errors, %d completed; want 3 and 0", s.Errors, s.Completed)
	}
	if _, err := Run(w, Config{Workers: 2, KVBlocks: []int{10}}); err == nil {
		t.Fatal("2 workers with 1 capacity accepted")
	}
}

// The reference LRU against a plain slice model of the same rules.
func TestSimReferenceLRUMatchesNaive(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := range 20 {
		capacity := 5 + rng.IntN(60)
		c := newLRU(capacity)
		var queue []uint64 // free queue, head first
		cached := map[uint64]bool{}
		for range 300 {
			// Chains over a small alphabet so that prefixes repeat.
			n := 1 + rng.IntN(12)
			hashes := make([]uint64, n)
			for i := range hashes {
				hashes[i] = uint64(i)<<32 | uint64(rng.IntN(3))
				if i > 0 {
					hashes[i] ^= hashes[i-1] * 31
				}
			}
			want := 0
			for want < n && cached[hashes[want]] {
				want++
			}
			if got := c.match(hashes); got != want {
				t.Fatalf("trial %d: match %d, naive %d", trial, got, want)
			}
			if got := c.admit(hashes); got != want {
				t.Fatalf("trial %d: admit found %d cached, naive %d", trial, got, want)
			}
			// Naive: take the request's blocks out of the queue, allocate
			// missing ones from the head, then free tail first.
			var held []uint64
			for _, h := range hashes {
				if cached[h] {
					for i, q := range queue {
						if q == h {
							queue = append(queue[:i], queue[i+1:]...)
							break
						}
					}
					held = append(held, h)
					continue
				}
				if len(cached) >= capacity {
					if len(queue) == 0 {
						break
					}
					delete(cached, queue[0])
					queue = queue[1:]
				}
				cached[h] = true
				held = append(held, h)
			}
			for i := len(held) - 1; i >= 0; i-- {
				queue = append(queue, held[i])
			}
			if c.byHash.n != len(cached) {
				t.Fatalf("trial %d: %d cached, naive %d", trial, c.byHash.n, len(cached))
			}
			for h := range cached {
				if _, ok := c.byHash.get(h); !ok {
					t.Fatalf("trial %d: block %x missing", trial, h)
				}
			}
		}
	}
}

func TestSimBlockMap(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	m := newBlockMap(8)
	ref := map[uint64]int32{}
	for i := range 200000 {
		// Few distinct keys with clustered low bits: long probe runs.
		k := uint64(rng.IntN(300)) << 3
		if rng.IntN(2) == 0 {
			k |= 1 << 60
		}
		if _, ok := ref[k]; ok {
			m.del(k)
			delete(ref, k)
		} else {
			v := int32(i%1000 + 1)
			m.put(k, v)
			ref[k] = v
		}
		if i%997 == 0 {
			for k, v := range ref {
				if got, ok := m.get(k); !ok || got != v {
					t.Fatalf("step %d: key %x → %d, %v; want %d", i, k, got, ok, v)
				}
			}
			if m.n != len(ref) {
				t.Fatalf("step %d: %d keys, want %d", i, m.n, len(ref))
			}
		}
	}
	s := newHashSet()
	for k := range uint64(5000) {
		s.add(k * 7)
	}
	for k := range uint64(35000) {
		if s.has(k) != (k%7 == 0) {
			t.Fatalf("hash set: has(%d) = %v", k, s.has(k))
		}
	}
}

// Seed 002's hard case, shortened: kv-pooled caches clearly more than kv
// (close to the pooled-LRU reference), spreads each prefix over fewer
// workers, and is deterministic.
func TestSimPooledBeatsKV(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{
		Prefixes: 24, PrefixTokens: 2032, TailTokens: 339, OutputTokens: 64, Requests: 600, Concurrency: 8, Seed: 11,
	})
	ref := ComputeReference(w, 6*585)
	_, kv := run(t, w, config(router.ModeKV, 6, 585))
	a, pooled := run(t, w, config(router.ModeKVPooled, 6, 585))
	if pooled.Errors != 0 || pooled.CachedTokenRatio < kv.CachedTokenRatio+0.1 || pooled.CachedTokenRatio < 0.9*ref.PooledLRU {
		t.Fatalf("kv-pooled cached %.3f (errors %d), kv %.3f, pooled-LRU reference %.3f", pooled.CachedTokenRatio, pooled.Errors, kv.CachedTokenRatio, ref.PooledLRU)
	}
	if pooled.WorkersPerPrefix >= kv.WorkersPerPrefix {
		t.Errorf("kv-pooled spread a prefix over %.2f workers, kv over %.2f", pooled.WorkersPerPrefix, kv.WorkersPerPrefix)
	}
	if pooled.TTFT.P99 > 1.1*kv.TTFT.P99 {
		t.Errorf("kv-pooled p99 TTFT %.1f ms, kv %.1f ms", pooled.TTFT.P99, kv.TTFT.P99)
	}
	b, _ := run(t, w, config(router.ModeKVPooled, 6, 585))
	for i := range a.Requests {
		if a.Requests[i] != b.Requests[i] {
			t.Fatalf("request %d: %+v then %+v", i, a.Requests[i], b.Requests[i])
		}
	}
}

// Open loop: every request is sent at its arrival time, whether or not the
// fleet has finished the earlier ones (a closed loop of one client would
// wait for each).
func TestSimSyntheticOpenLoop(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{Prefixes: 2, PrefixTokens: 256, TailTokens: 32, OutputTokens: 200, Requests: 40,
		Concurrency: 1, Seed: 3, ArrivalRate: 50})
	res, s := run(t, w, config(router.ModeKV, 2, 1000))
	if s.Errors != 0 {
		t.Fatalf("%d errors", s.Errors)
	}
	overlapped := false
	for i, rr := range res.Requests {
		if rr.Sent != w.Requests[i].At {
			t.Fatalf("request %d sent at %v, arrives at %v", i, rr.Sent, w.Requests[i].At)
		}
		if i > 0 && rr.Sent < res.Requests[i-1].Finished {
			overlapped = true
		}
	}
	if !overlapped {
		t.Fatal("at 50 requests/s of 200-token answers no request was sent before the previous finished: not open loop")
	}
}
