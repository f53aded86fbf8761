package router

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
)

func pooledConfig() Config {
	cfg := DefaultConfig()
	cfg.Mode = ModeKVPooled
	return cfg
}

// fill stores n unique blocks (content derived from tag) on w.
func fill(t *testing.T, ix *Index, w WorkerID, tag, n int) {
	t.Helper()
	if n > 0 {
		store(t, ix, w, tokens(1_000_000*tag, 16*n))
	}
}

// homeOf is the rendezvous home of key among ws under r.
func homeOf(r *Router, key uint64) WorkerID {
	cands := make([]int, len(r.workers))
	for i := range cands {
		cands[i] = i
	}
	ranks := r.pooledRanksLocked(key, cands)
	for j, rk := range ranks {
		if rk == 0 {
			return r.workers[cands[j]].ID
		}
	}
	return ""
}

func TestPooledParseAndModes(t *testing.T) {
	for _, s := range []string{"kv-pooled", "kv_pooled", "pooled"} {
		if m, err := ParseMode(s); err != nil || m != ModeKVPooled {
			t.Errorf("ParseMode(%q) = %v, %v", s, m, err)
		}
	}
	found := false
	for _, m := range Modes {
		found = found || m == ModeKVPooled
	}
	if !found {
		t.Error("Modes lacks kv-pooled")
	}
}

// Each case builds an index and a load view, routes one request, and checks
// the choice (and, where it matters, that kv chooses otherwise: the case
// shows what kv-pooled adds).
func TestPooledDecisions(t *testing.T) {
	prompt := tokens(7, 16*12) // 12 blocks
	hashes := SequenceHashes(prompt, 16, "")
	other := SequenceHashes(tokens(90_000, 16*12), 16, "")
	ws3 := []WorkerInfo{{ID: "a", TotalBlocks: 100}, {ID: "b", TotalBlocks: 100}, {ID: "c", TotalBlocks: 100}}
	cases := []struct {
		name    string
		workers []WorkerInfo
		setup   func(t *testing.T, ix *Index, r *Router)
		req     Request
		want    WorkerID // "" = check() decides
		kvNot   WorkerID // a worker kv does NOT choose, to show the difference ("" = not checked)
		check   func(t *testing.T, d Decision)
	}{
		{
			name:    "holder kept although busier: evicting elsewhere costs more",
			workers: ws3,
			setup: func(t *testing.T, ix *Index, r *Router) {
				fill(t, ix, "a", 1, 90) // every cache full of its own content
				fill(t, ix, "b", 2, 100)
				fill(t, ix, "c", 3, 100)
				store(t, ix, "a", prompt[:16*10])
				r.Load().Add(Booking{ID: "bg1", Worker: "a", Hashes: other[:6], PrefillTokens: 0, Added: t0})
				r.Load().Add(Booking{ID: "bg2", Worker: "a", Hashes: other[6:], PrefillTokens: 0, Added: t0})
			},
			req: Request{ID: "q", Tokens: len(prompt), Hashes: hashes}, want: "a", kvNot: "a",
		},
		{
			name:    "holder that would queue for KV is left while another can start now",
			workers: ws3,
			setup: func(t *testing.T, ix *Index, r *Router) {
				store(t, ix, "a", prompt)
				// 95 distinct blocks in flight on a: no room for 12 more.
				big := SequenceHashes(tokens(50_000, 16*95), 16, "")
				r.Load().Add(Booking{ID: "bg", Worker: "a", Hashes: big, Added: t0})
			},
			req: Request{ID: "q", Tokens: len(prompt), Hashes: hashes},
			check: func(t *testing.T, d Decision) {
				if d.Worker == "a" {
					t.Errorf("routed to a, whose KV is full")
				}
				if !d.Rows[0].Busy || !strings.Contains(d.Rows[0].Reason(), "KV admission") {
					t.Errorf("row a: busy %v %q", d.Rows[0].Busy, d.Rows[0].Reason())
				}
			},
		},
		{
			name:    "overloaded cluster: no exclusion, the cache decides",
			workers: ws3,
			setup: func(t *testing.T, ix *Index, r *Router) {
				fill(t, ix, "a", 1, 88)
				fill(t, ix, "b", 2, 100)
				fill(t, ix, "c", 3, 100)
				store(t, ix, "a", prompt)
				for i, w := range []WorkerID{"a", "b", "c"} {
					n := 95
					if w != "a" {
						n = 85
					}
					big := SequenceHashes(tokens(60_000+10_000*i, 16*n), 16, "")
					r.Load().Add(Booking{ID: "bg" + string(w), Worker: w, Hashes: big, Added: t0})
				}
			},
			req: Request{ID: "q", Tokens: len(prompt), Hashes: hashes}, want: "a",
		},
		{
			name:    "room first: new content goes where nothing is evicted",
			workers: ws3,
			setup: func(t *testing.T, ix *Index, r *Router) {
				fill(t, ix, "a", 1, 100)
				fill(t, ix, "b", 2, 20)
				fill(t, ix, "c", 3, 100)
			},
			req: Request{ID: "q", Tokens: len(prompt), Hashes: hashes}, want: "b",
		},
		{
			name:    "duplicated content is cheap to lose",
			workers: ws3,
			setup: func(t *testing.T, ix *Index, r *Router) {
				fill(t, ix, "a", 1, 100) // unique
				fill(t, ix, "c", 3, 100) // unique
				fill(t, ix, "b", 1, 100) // a copy of a's
				// Now a's content is held twice: a and b are cheap, c is not;
				// with a and b tied on eviction the rendezvous home decides.
			},
			req: Request{ID: "q", Tokens: len(prompt), Hashes: hashes},
			check: func(t *testing.T, d Decision) {
				if d.Worker == "c" {
					t.Errorf("evicted unique content on c; rows %+v", d.Rows)
				}
			},
		},
		{
			name:    "capacities not registered: no admission rule, the cache still decides",
			workers: []WorkerInfo{{ID: "a"}, {ID: "b"}, {ID: "c"}},
			setup: func(t *testing.T, ix *Index, r *Router) {
				store(t, ix, "a", prompt)
				big := SequenceHashes(tokens(50_000, 16*95), 16, "")
				r.Load().Add(Booking{ID: "bg", Worker: "a", Hashes: big[:20], Added: t0})
			},
			req: Request{ID: "q", Tokens: len(prompt), Hashes: hashes}, want: "a",
			check: func(t *testing.T, d Decision) {
				for _, row := range d.Rows {
					if row.Busy {
						t.Errorf("row %s busy: %s", row.Worker, row.Reason())
					}
				}
			},
		},
		{
			name:    "heterogeneous capacity: the big worker takes new content when both are full",
			workers: []WorkerInfo{{ID: "big", TotalBlocks: 400}, {ID: "small", TotalBlocks: 100}},
			setup: func(t *testing.T, ix *Index, r *Router) {
				fill(t, ix, "big", 1, 400)
				fill(t, ix, "small", 2, 100)
			},
			req: Request{ID: "q", Tokens: len(prompt), Hashes: hashes},
			check: func(t *testing.T, d Decision) {
				// Equal eviction cost per block; the capacity-weighted home
				// decides — checked statistically in TestPooledHomes.
				if d.Worker != "big" && d.Worker != "small" {
					t.Errorf("chose %s", d.Worker)
				}
			},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for _, mode := range []Mode{ModeKVPooled, ModeKV} {
				if mode == ModeKV && c.kvNot == "" {
					continue
				}
				ix := NewIndex(16)
				cfg := DefaultConfig()
				cfg.Mode = mode
				r := newTestRouter(t, cfg, ix, c.workers...)
				c.setup(t, ix, r)
				d, err := r.Decide(c.req, t0)
				if err != nil {
					t.Fatalf("%s: %v", mode, err)
				}
				want := c.want
				if mode == ModeKV {
					if d.Worker == c.kvNot {
						t.Errorf("kv chose %s too: the case shows nothing", d.Worker)
					}
					return
				}
				if want != "" && d.Worker != want {
					t.Errorf("%s chose %s, want %s\n%s", mode, d.Worker, want, d.Explain())
				}
				if mode == ModeKVPooled && c.check != nil {
					c.check(t, d)
				}
			}
		})
	}
}

// kv spills the busier holder's prefix to an idle worker; kv-pooled does not.
func TestPooledDiffersFromKV(t *testing.T) {
	prompt := tokens(7, 16*12)
	hashes := SequenceHashes(prompt, 16, "")
	ws := []WorkerInfo{{ID: "a", TotalBlocks: 200}, {ID: "b", TotalBlocks: 200}}
	got := map[Mode]WorkerID{}
	for _, mode := range []Mode{ModeKV, ModeKVPooled} {
		ix := NewIndex(16)
		cfg := DefaultConfig()
		cfg.Mode = mode
		r := newTestRouter(t, cfg, ix, ws...)
		fill(t, ix, "a", 1, 188)
		fill(t, ix, "b", 2, 200)
		store(t, ix, "a", prompt)
		for i := range 2 {
			h := SequenceHashes(tokens(40_000+i*1000, 16*14), 16, "")
			r.Load().Add(Booking{ID: fmt.Sprint("bg", i), Worker: "a", Hashes: h, Added: t0})
		}
		d, err := r.Decide(Request{ID: "q", Tokens: len(prompt), Hashes: hashes}, t0)
		if err != nil {
			t.Fatal(err)
		}
		got[mode] = d.Worker
	}
	if got[ModeKV] != "b" || got[ModeKVPooled] != "a" {
		t.Errorf("kv chose %s (want b), kv-pooled %s (want a)", got[ModeKV], got[ModeKVPooled])
	}
}

// Fresh content goes to its rendezvous home: stable per key, spread over
// the workers in proportion to capacity, and a shared system prompt held
// everywhere does not make every conversation share one home.
func TestPooledHomes(t *testing.T) {
	t.Run("capacity-weighted and stable", func(t *testing.T) {
		ws := []WorkerInfo{{ID: "a", TotalBlocks: 300}, {ID: "b", TotalBlocks: 100}, {ID: "c", TotalBlocks: 100}}
		r := newTestRouter(t, pooledConfig(), NewIndex(16), ws...)
		count := map[WorkerID]int{}
		for k := range 3000 {
			h := homeOf(r, uint64(k)*0x9e3779b97f4a7c15)
			if h != homeOf(r, uint64(k)*0x9e3779b97f4a7c15) {
				t.Fatal("home not stable")
			}
			count[h]++
		}
		// Expected 60 / 20 / 20 %.
		if count["a"] < 1650 || count["a"] > 1950 || count["b"] < 450 || count["c"] < 450 {
			t.Errorf("homes %v, want about 1800/600/600", count)
		}
	})
	t.Run("removing a worker moves only its keys", func(t *testing.T) {
		ws := []WorkerInfo{{ID: "a", TotalBlocks: 100}, {ID: "b", TotalBlocks: 100}, {ID: "c", TotalBlocks: 100}, {ID: "d", TotalBlocks: 100}}
		r := newTestRouter(t, pooledConfig(), NewIndex(16), ws...)
		before := map[uint64]WorkerID{}
		for k := range uint64(1000) {
			before[k] = homeOf(r, k*7919)
		}
		r.SetWorkers(ws[:3])
		for k, h := range before {
			if h != "d" && homeOf(r, k*7919) != h {
				t.Fatalf("key %d moved from %s", k, h)
			}
		}
	})
	t.Run("fresh requests land on their homes", func(t *testing.T) {
		ix := NewIndex(16)
		ws := []WorkerInfo{{ID: "a", TotalBlocks: 1000}, {ID: "b", TotalBlocks: 1000}, {ID: "c", TotalBlocks: 1000}, {ID: "d", TotalBlocks: 1000}}
		r := newTestRouter(t, pooledConfig(), ix, ws...)
		system := tokens(3, 16*4)
		for _, w := range ws {
			store(t, ix, w.ID, system) // the system prompt is everywhere
		}
		seen := map[WorkerID]int{}
		for k := range 200 {
			p := append(append([]uint32{}, system...), tokens(100_000+k*1000, 16*8)...)
			h := SequenceHashes(p, 16, "")
			d, err := r.Decide(Request{ID: "q", Tokens: len(p), Hashes: h}, t0)
			if err != nil {
				t.Fatal(err)
			}
			if want := homeOf(r, h[4]); d.Worker != want {
				t.Fatalf("request %d went to %s, its home is %s", k, d.Worker, want)
			}
			seen[d.Worker]++
		}
		for _, w := range ws {
			if seen[w.ID] < 25 {
				t.Errorf("homes %v: the shared system prompt concentrates them", seen)
			}
		}
	})
}

// A burst of requests for the same new prefix, before any KV event: kv
// spreads them by load, kv-pooled keeps them on the worker already
// computing the prefix (synced load: ActiveLoad).
func TestPooledInflightBurst(t *testing.T) {
	ws := []WorkerInfo{{ID: "a", TotalBlocks: 1000}, {ID: "b", TotalBlocks: 1000}, {ID: "c", TotalBlocks: 1000}}
	prefix := tokens(11, 16*30)
	for _, mode := range []Mode{ModeKV, ModeKVPooled} {
		cfg := DefaultConfig()
		cfg.Mode = mode
		ix := NewIndex(16)
		r := newTestRouter(t, cfg, ix, ws...)
		for i, w := range ws {
			fill(t, ix, w.ID, i+1, 1000) // full caches: new content evicts
		}
		used := map[WorkerID]bool{}
		for i := range 3 {
			p := append(append([]uint32{}, prefix...), tokens(500_000+i*100, 16*2)...)
			d, err := r.Route(Request{ID: fmt.Sprint("r", i), Tokens: len(p), Hashes: SequenceHashes(p, 16, "")}, t0)
			if err != nil {
				t.Fatal(err)
			}
			used[d.Worker] = true
		}
		if mode == ModeKVPooled && len(used) != 1 {
			t.Errorf("kv-pooled spread one new prefix over %d workers", len(used))
		}
		if mode == ModeKV && len(used) == 1 {
			t.Errorf("kv kept the burst on one worker: the test shows nothing")
		}
	}
}

// pooledWorld is the replicated state and synced load two replicas share.
type pooledWorld struct {
	workers []WorkerInfo
	events  []func(ix *Index)
	books   []Booking
}

// Two replicas with the same index, registry and load make the same
// decisions, whatever else each of them routed before: no private history.
func TestPooledDeterministicAcrossReplicas(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	ws := []WorkerInfo{{ID: "w0", TotalBlocks: 400}, {ID: "w1", TotalBlocks: 400}, {ID: "w2", TotalBlocks: 800}, {ID: "w3", TotalBlocks: 200}}
	prefixes := make([][]uint32, 10)
	for k := range prefixes {
		prefixes[k] = tokens(1000*k+1, 16*(4+rng.IntN(20)))
	}
	mk := func(seed uint64) (*Router, *Index) {
		ix := NewIndex(16)
		r, err := New(pooledConfig(), ix, seed)
		if err != nil {
			t.Fatal(err)
		}
		r.SetWorkers(ws)
		for _, w := range ws {
			ix.AddWorker(w.ID)
		}
		return r, ix
	}
	a, ixa := mk(1)
	b, ixb := mk(1)
	// b has a private past: many decisions, all booked and freed again.
	for i := range 500 {
		p := prefixes[i%len(prefixes)]
		if _, err := b.Route(Request{ID: fmt.Sprint("old", i), Tokens: len(p), Hashes: SequenceHashes(p, 16, "")}, t0); err != nil {
			t.Fatal(err)
		}
		b.Free(fmt.Sprint("old", i))
	}
	// The same replicated state and synced load on both.
	for step := range 300 {
		w := ws[rng.IntN(len(ws))].ID
		switch rng.IntN(4) {
		case 0, 1:
			p := prefixes[rng.IntN(len(prefixes))]
			for _, ix := range []*Index{ixa, ixb} {
				store(t, ix, w, p)
			}
		case 2:
			p := prefixes[rng.IntN(len(prefixes))]
			h := SequenceHashes(p, 16, "")
			cut := rng.IntN(len(h))
			for _, ix := range []*Index{ixa, ixb} {
				_ = ix.Apply(w, KVEvent{Kind: EventRemoved, Removed: h[cut:]})
			}
		case 3:
			p := prefixes[rng.IntN(len(prefixes))]
			bk := Booking{ID: fmt.Sprint("bk", step), Worker: w, Hashes: SequenceHashes(p, 16, ""), PrefillTokens: len(p), Added: t0}
			a.Load().Add(bk)
			b.Load().Add(bk)
		}
		p := append(append([]uint32{}, prefixes[rng.IntN(len(prefixes))]...), tokens(900_000+step*50, 16*rng.IntN(3))...)
		req := Request{ID: fmt.Sprint("q", step), Tokens: len(p), Hashes: SequenceHashes(p, 16, "")}
		da, err1 := a.Decide(req, t0)
		db, err2 := b.Decide(req, t0)
		if err1 != nil || err2 != nil {
			t.Fatal(err1, err2)
		}
		if da.Worker != db.Worker {
			t.Fatalf("step %d: replicas disagree: %s vs %s\n%s\n%s", step, da.Worker, db.Worker, da.Explain(), db.Explain())
		}
		for i := range da.Rows {
			if da.Rows[i].Cost != db.Rows[i].Cost || da.Rows[i].Busy != db.Rows[i].Busy {
				t.Fatalf("step %d: cost tables differ at %s", step, da.Rows[i].Worker)
			}
		}
	}
}

// The index's unique counts match a brute-force count through any mix of
// stores, removals, clears and worker removals.
func TestPooledIndexUniqueCounts(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 9))
	ix := NewIndex(16)
	ws := []WorkerID{"a", "b", "c", "d"}
	for _, w := range ws {
		ix.AddWorker(w)
	}
	for step := range 3000 {
		w := ws[rng.IntN(len(ws))]
		switch op := rng.IntN(20); {
		case op < 12:
			h := uint64(1 + rng.IntN(60))
			_ = ix.Apply(w, KVEvent{Kind: EventStored, Blocks: []StoredBlock{{EngineHash: h, ContentHash: h}}})
		case op < 18:
			_ = ix.Apply(w, KVEvent{Kind: EventRemoved, Removed: []uint64{uint64(1 + rng.IntN(60))}})
		case op == 18:
			_ = ix.Apply(w, KVEvent{Kind: EventCleared})
		default:
			ix.RemoveWorker(w)
			ix.AddWorker(w)
		}
		for _, x := range ws {
			want := 0
			for _, b := range ix.WorkerBlocks(x) {
				if ix.Holders(b.ContentHash) == 1 {
					want++
				}
			}
			held, unique := ix.CacheCounts(x)
			if unique != want || held != ix.Held(x) || ix.Unique(x) != unique {
				t.Fatalf("step %d worker %s: unique %d, want %d (held %d)", step, x, unique, want, held)
			}
		}
	}
}

// Temperature > 0 samples over kv-pooled's costs too, and never picks a
// worker the admission rule left out.
func TestPooledTemperatureRespectsAdmission(t *testing.T) {
	ix := NewIndex(16)
	cfg := pooledConfig()
	cfg.Temperature = 1
	ws := []WorkerInfo{{ID: "a", TotalBlocks: 100}, {ID: "b", TotalBlocks: 100}, {ID: "c", TotalBlocks: 100}}
	r := newTestRouter(t, cfg, ix, ws...)
	big := SequenceHashes(tokens(50_000, 16*95), 16, "")
	r.Load().Add(Booking{ID: "bg", Worker: "a", Hashes: big, Added: t0})
	p := tokens(7, 16*12)
	for i := range 200 {
		d, err := r.Decide(Request{ID: fmt.Sprint(i), Tokens: len(p), Hashes: SequenceHashes(p, 16, "")}, t0)
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker == "a" {
			t.Fatal("sampled a worker that would wait for KV admission")
		}
	}
}

// A copy of content another candidate holds is priced when the fleet is
// not overloaded: the holder keeps the request although an empty worker
// (nothing to evict) has less load. With the copy weight at 0 the empty
// worker wins, so the case shows the term decides.
func TestPooledCopyCost(t *testing.T) {
	prompt := tokens(7, 16*12)
	hashes := SequenceHashes(prompt, 16, "")
	ws := []WorkerInfo{{ID: "a", TotalBlocks: 100}, {ID: "b", TotalBlocks: 100}, {ID: "c", TotalBlocks: 100}}
	zero := 0.0
	for _, c := range []struct {
		name   string
		weight *float64
		want   WorkerID
	}{
		{"default copy weight", nil, "a"},
		{"copy weight 0", &zero, "b"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ix := NewIndex(16)
			cfg := pooledConfig()
			cfg.Pooled.CopyWeight = c.weight
			r := newTestRouter(t, cfg, ix, ws...)
			fill(t, ix, "a", 1, 80)
			store(t, ix, "a", prompt)
			fill(t, ix, "c", 3, 100)
			// 30 blocks in flight on a: Dynamo's cost is 30+12 there, 12+12 on b.
			busy := SequenceHashes(tokens(40_000, 16*30), 16, "")
			r.Load().Add(Booking{ID: "bg", Worker: "a", Hashes: busy, Added: t0})
			d, err := r.Decide(Request{ID: "q", Tokens: len(prompt), Hashes: hashes}, t0)
			if err != nil {
				t.Fatal(err)
			}
			if d.Worker != c.want {
				t.Errorf("chose %s, want %s\n%s", d.Worker, c.want, d.Explain())
			}
		})
	}
}

// The decode reserve plans for the output lengths the router observed
// (Router.Finished): one block's worth before any, the configured length
// when set. A worker that admits a request under the first reserve is
// excluded once long outputs have been seen. The admission test on a is
// 70 blocks in flight + 12 new + reserve/2 (bg, running) + reserve (q)
// against 100: over at a reserve above 12 blocks.
func TestPooledReserveFromOutputs(t *testing.T) {
	prompt := tokens(7, 16*12)
	hashes := SequenceHashes(prompt, 16, "")
	ws := []WorkerInfo{{ID: "a", TotalBlocks: 100}, {ID: "b", TotalBlocks: 100}}
	long := 256.0
	for _, c := range []struct {
		name     string
		outputs  []int    // Finished before the decision
		config   *float64 // PooledConfig.OutputTokens
		reserve  float64  // (output tokens + 7.5) / 16
		excluded bool     // a: 70 blocks in flight + 12 new + 1.5·reserve > 100
	}{
		{"no output seen: one block's worth", nil, nil, (16 + 7.5) / 16, false},
		{"short outputs seen", []int{16, 48}, nil, (32 + 7.5) / 16, false},
		// 160 tokens: 10.47 blocks, 97.7 < 100 (the full reserve for bg
		// too, as before, said 102.9: excluded).
		{"outputs of 160 seen: admitted at the expected peak", []int{150, 170}, nil, (160 + 7.5) / 16, false},
		{"long outputs seen", []int{200, 220}, nil, (210 + 7.5) / 16, true}, // 102.4
		{"configured length wins", []int{16}, &long, (256 + 7.5) / 16, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			ix := NewIndex(16)
			cfg := pooledConfig()
			cfg.Pooled.OutputTokens = c.config
			r := newTestRouter(t, cfg, ix, ws...)
			for i, n := range c.outputs {
				id := fmt.Sprint("done", i)
				r.Load().Add(Booking{ID: id, Worker: "b", Hashes: hashes[:1], Added: t0})
				r.Finished(id, n)
			}
			store(t, ix, "a", prompt)
			held := SequenceHashes(tokens(50_000, 16*70), 16, "")
			r.Load().Add(Booking{ID: "bg", Worker: "a", Hashes: held, Added: t0})
			r.mu.Lock()
			got := r.pooledReserveLocked()
			r.mu.Unlock()
			if math.Abs(got-c.reserve) > 1e-9 {
				t.Errorf("reserve %.4f blocks, want %.4f", got, c.reserve)
			}
			d, err := r.Decide(Request{ID: "q", Tokens: len(prompt), Hashes: hashes}, t0)
			if err != nil {
				t.Fatal(err)
			}
			if d.Rows[0].Busy != c.excluded {
				t.Errorf("a busy %v (%s), want %v\n%s", d.Rows[0].Busy, d.Rows[0].Reason(), c.excluded, d.Explain())
			}
		})
	}
}

// When the cluster is overloaded copies are how load spreads, so the copy
// weight must not change any row: the same decision with weight 0 and with
// a large weight gives the same cost table.
func TestPooledCopyFreeWhenOverloaded(t *testing.T) {
	prompt := tokens(7, 16*12)
	hashes := SequenceHashes(prompt, 16, "")
	ws := []WorkerInfo{{ID: "a", TotalBlocks: 100}, {ID: "b", TotalBlocks: 100}, {ID: "c", TotalBlocks: 100}}
	rows := map[float64][]WorkerCost{}
	for _, weight := range []float64{0, 64} {
		ix := NewIndex(16)
		cfg := pooledConfig()
		cfg.Pooled.CopyWeight = &weight
		r := newTestRouter(t, cfg, ix, ws...)
		store(t, ix, "a", prompt)
		// 85 blocks in flight on every worker: 255 of 300, past the 0.8 line.
		for i, w := range []WorkerID{"a", "b", "c"} {
			h := SequenceHashes(tokens(60_000+10_000*i, 16*85), 16, "")
			r.Load().Add(Booking{ID: "bg" + string(w), Worker: w, Hashes: h, Added: t0})
		}
		d, err := r.Decide(Request{ID: "q", Tokens: len(prompt), Hashes: hashes}, t0)
		if err != nil {
			t.Fatal(err)
		}
		rows[weight] = d.Rows
	}
	for i := range rows[0] {
		if rows[0][i].Cost != rows[64][i].Cost || rows[0][i].Busy || rows[64][i].Busy {
			t.Errorf("row %s: cost %.3f with copy weight 0, %.3f with 64 (busy %v %v)", rows[0][i].Worker,
				rows[0][i].Cost, rows[64][i].Cost, rows[0][i].Busy, rows[64][i].Busy)
		}
	}
}

// Without output-block tracking a running request adds half its decode
// reserve to the admission test (pooledRunningReserveShare: the expected
// peak of requests at uniformly spread progress) and the new request its
// whole reserve, while the overload line counts every reserve whole.
// Reserve 10 blocks ((152.5 + 7.5) / 16), workers of 100 blocks, a
// 12-block prompt no worker holds in flight (12 new blocks):
//   - 2 running × 30 blocks: 60 + 12 + 2·5 + 10 = 92 ≤ 100, admitted (the
//     full reserve said 60 + 12 + 20 + 10 = 102: excluded);
//   - 4 running × 15 blocks: 60 + 12 + 4·5 + 10 = 102, 2 blocks over.
//
// Demand: a 60 + 2·10 = 80, b 60 + 4·10 = 100, 180 > 0.8 · 200 = 160, so
// together they are past the overload line (the halved reserves, 150,
// would not be): no exclusion, the queue price 0.5 · (2 − (−8)) = 5 on b.
func TestPooledRunningReserveShare(t *testing.T) {
	prompt := tokens(7, 16*12)
	hashes := SequenceHashes(prompt, 16, "")
	out, zero := 152.5, 0.0
	book := func(t *testing.T, r *Router, w WorkerID, n, blocks, tag int) {
		t.Helper()
		for k := range n {
			h := SequenceHashes(tokens(100_000*tag+10_000*k, 16*blocks), 16, "")
			r.Load().Add(Booking{ID: fmt.Sprint(w, k), Worker: w, Hashes: h, Added: t0})
		}
	}
	for _, c := range []struct {
		name       string
		a, b       [2]int // running requests × distinct blocks each
		holder     WorkerID
		busyA      bool
		busyB      bool
		overA      float64 // the admission overflow in the busy reason, when busy
		queueB     float64 // kv-pooled's extra on b beyond a's (queue price), overloaded only
		overloaded bool
	}{
		{name: "two running: admitted at the expected peak", a: [2]int{2, 30}, b: [2]int{0, 0}, holder: "a"},
		{name: "four running: 2 blocks over", a: [2]int{4, 15}, b: [2]int{0, 0}, holder: "a", busyA: true, overA: 2},
		{name: "past the overload line with whole reserves", a: [2]int{2, 30}, b: [2]int{4, 15}, holder: "", overloaded: true, queueB: 5},
	} {
		t.Run(c.name, func(t *testing.T) {
			ix := NewIndex(16)
			cfg := pooledConfig()
			cfg.Pooled.OutputTokens = &out
			cfg.Pooled.HomeWeight = &zero // no rendezvous term: the prices are exact
			r := newTestRouter(t, cfg, ix, WorkerInfo{ID: "a", TotalBlocks: 100}, WorkerInfo{ID: "b", TotalBlocks: 100})
			if c.holder != "" {
				store(t, ix, c.holder, prompt)
			}
			book(t, r, "a", c.a[0], c.a[1], 1)
			book(t, r, "b", c.b[0], c.b[1], 2)
			r.mu.Lock()
			reserve := r.pooledReserveLocked()
			r.mu.Unlock()
			if reserve != 10 {
				t.Fatalf("reserve %v blocks, want 10", reserve)
			}
			d, err := r.Decide(Request{ID: "q", Tokens: len(prompt), Hashes: hashes}, t0)
			if err != nil {
				t.Fatal(err)
			}
			a, b := d.Rows[0], d.Rows[1]
			if a.Busy != c.busyA || b.Busy != c.busyB {
				t.Fatalf("busy a %v b %v, want %v %v\n%s", a.Busy, b.Busy, c.busyA, c.busyB, d.Explain())
			}
			if c.busyA && !strings.Contains(a.Reason(), fmt.Sprintf("(%.0f blocks over)", c.overA)) {
				t.Errorf("a: %q, want %.0f blocks over", a.Reason(), c.overA)
			}
			if !c.busyA && d.Worker != "a" {
				t.Errorf("chose %s, want a\n%s", d.Worker, d.Explain())
			}
			if c.overloaded {
				// Neither holds the prompt, both caches empty (no eviction,
				// no copy), no home term: the pooled extras differ by the
				// queue price alone (and the 1e-6 rank tie-break).
				if diff := b.Pooled - a.Pooled; math.Abs(diff-c.queueB) > 1e-5 {
					t.Errorf("b's extra − a's = %.6f, want %.0f\n%s", diff, c.queueB, d.Explain())
				}
			}
		})
	}
}

// TestPooledEvictPrice: pinned blocks are held and not evictable. Victims
// come from the unpinned blocks at their unique fraction; an eviction
// reaching into the pinned blocks is priced whole, never as free, even
// when every pinned block is also held elsewhere.
func TestPooledEvictPrice(t *testing.T) {
	for _, tc := range []struct {
		name                 string
		evict                float64
		held, unique, pinned int
		want                 float64
	}{
		{"no pins: unique fraction", 10, 100, 50, 0, 5},
		{"no pins, all copies: free", 10, 100, 0, 0, 0},
		{"all pinned copies: whole", 10, 100, 0, 100, 10},
		{"room among unpinned copies: free", 10, 100, 0, 50, 0},
		{"past the unpinned: the rest whole", 10, 100, 0, 95, 5},
		{"pinned counted unique", 10, 100, 60, 50, 2},
		{"more pinned than held", 4, 10, 10, 30, 4},
		{"nothing held", 3, 0, 0, 5, 3},
	} {
		if got := pooledEvictPrice(tc.evict, tc.held, tc.unique, tc.pinned); math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("%s: price %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestPooledPinnedNotFree: two workers whose full caches hold the same
// content (evicting it looks free: every block is held elsewhere). New
// content goes to whichever worker's blocks are not pinned, and the pinned
// worker's row carries the whole eviction price.
func TestPooledPinnedNotFree(t *testing.T) {
	fresh := SequenceHashes(tokens(70_000, 16*12), 16, "")
	for _, pinnedOn := range []WorkerID{"a", "b"} {
		t.Run("pinned on "+string(pinnedOn), func(t *testing.T) {
			ix := NewIndex(16)
			r := newTestRouter(t, pooledConfig(), ix, WorkerInfo{ID: "a", TotalBlocks: 100}, WorkerInfo{ID: "b", TotalBlocks: 100})
			fill(t, ix, "a", 1, 100)
			fill(t, ix, "b", 1, 100) // the same content: copies
			req := Request{ID: "q", Tokens: 16 * 12, Hashes: fresh}
			before, err := r.Decide(req, t0)
			if err != nil {
				t.Fatal(err)
			}
			r.SetPinnedBlocks(func(w WorkerID) int {
				if w == pinnedOn {
					return 100
				}
				return 0
			})
			d, err := r.Decide(req, t0)
			if err != nil {
				t.Fatal(err)
			}
			if d.Worker == pinnedOn {
				t.Fatalf("new content evicts %s's pinned blocks: %s", pinnedOn, d.Explain())
			}
			i := 0
			if pinnedOn == "b" {
				i = 1
			}
			if rise := d.Rows[i].Pooled - before.Rows[i].Pooled; math.Abs(rise-DefaultPooledEvictWeight*12) > 1e-6 {
				t.Fatalf("pinning %s raised its price by %v, want the whole eviction %v", pinnedOn, rise, DefaultPooledEvictWeight*12)
			}
		})
	}
}
