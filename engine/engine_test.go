package engine

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/router"
)

func mustNew(tb testing.TB, id string, cfg Config) *Engine {
	tb.Helper()
	e, err := New(id, cfg)
	if err != nil {
		tb.Fatal(err)
	}
	return e
}

// seqTokens returns n token ids start, start+1, ...
func seqTokens(start, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(start + i)
	}
	return out
}

func cat(parts ...[]uint32) []uint32 {
	var out []uint32
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// runIdle runs e until it has nothing to do and returns its outputs.
func runIdle(tb testing.TB, e *Engine) []Output {
	tb.Helper()
	var out []Output
	for i := 0; ; i++ {
		t, ok := e.NextEventTime()
		if !ok {
			return out
		}
		if i > 1_000_000 {
			tb.Fatal("engine never went idle")
		}
		out = append(out, e.Advance(t)...)
	}
}

// runOne submits r at the engine's current time, runs until idle and
// returns r's Finished output.
func runOne(tb testing.TB, e *Engine, r Request) Output {
	tb.Helper()
	if err := e.Submit(e.Stats().Now, r); err != nil {
		tb.Fatal(err)
	}
	for _, o := range runIdle(tb, e) {
		if o.RequestID == r.ID && o.Kind == Finished {
			return o
		}
	}
	tb.Fatalf("request %s did not finish", r.ID)
	return Output{}
}

func find(outs []Output, id string, kind OutputKind) (Output, bool) {
	for _, o := range outs {
		if o.RequestID == id && o.Kind == kind {
			return o, true
		}
	}
	return Output{}, false
}

func removedHashes(evs []Event) []uint64 {
	var out []uint64
	for _, ev := range evs {
		if ev.KV.Kind == router.EventRemoved {
			out = append(out, ev.KV.Removed...)
		}
	}
	return out
}

func TestEnginePrefixHitOnResubmission(t *testing.T) {
	const bs = 16
	prefix := seqTokens(1, 96) // 6 blocks
	tests := []struct {
		name       string
		first      Request
		second     Request
		wantCached int
	}{
		{"same prompt", Request{Tokens: cat(prefix, seqTokens(500, 10))},
			Request{Tokens: cat(prefix, seqTokens(500, 10))}, 96},
		{"same prompt, whole blocks: last token recomputed", Request{Tokens: prefix},
			Request{Tokens: prefix}, 80},
		{"shared prefix, other tail", Request{Tokens: cat(prefix, seqTokens(500, 40))},
			Request{Tokens: cat(prefix, seqTokens(900, 40))}, 96},
		{"partial prefix", Request{Tokens: cat(prefix, seqTokens(500, 40))},
			Request{Tokens: cat(prefix[:50], seqTokens(900, 40))}, 48},
		{"first block differs", Request{Tokens: cat(prefix, seqTokens(500, 40))},
			Request{Tokens: cat([]uint32{7}, prefix[1:], seqTokens(500, 40))}, 0},
		{"other LoRA", Request{Tokens: cat(prefix, seqTokens(500, 40))},
			Request{Tokens: cat(prefix, seqTokens(500, 40)), LoRA: "my-lora"}, 0},
		{"same LoRA", Request{Tokens: cat(prefix, seqTokens(500, 40)), LoRA: "my-lora"},
			Request{Tokens: cat(prefix, seqTokens(500, 40)), LoRA: "my-lora"}, 128},
		{"precomputed hashes, no tokens", Request{Tokens: cat(prefix, seqTokens(500, 40))},
			Request{NumTokens: 136, BlockHashes: router.SequenceHashes(cat(prefix, seqTokens(500, 40)), bs, "")}, 128},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := mustNew(t, "w", Config{BlockSize: bs, CapacityBlocks: 64})
			tc.first.ID, tc.first.OutputTokens = "a", 4
			tc.second.ID, tc.second.OutputTokens = "b", 4
			if o := runOne(t, e, tc.first); o.CachedTokens != 0 {
				t.Fatalf("cold request cached %d tokens", o.CachedTokens)
			}
			o := runOne(t, e, tc.second)
			if o.CachedTokens != tc.wantCached {
				t.Errorf("cached tokens = %d, want %d", o.CachedTokens, tc.wantCached)
			}
			if want := max(len(tc.second.Tokens), tc.second.NumTokens); o.PromptTokens != want {
				t.Errorf("prompt tokens = %d, want %d", o.PromptTokens, want)
			}
			if st := e.Stats(); st.CachedTokens != uint64(tc.wantCached) {
				t.Errorf("stats cached tokens = %d, want %d", st.CachedTokens, tc.wantCached)
			}
		})
	}
}

// TestEngineLRUEviction checks the free queue order: a finished request's
// blocks are freed tail first, so its unique tail is evicted before the
// shared prefix and a prefix loses its last blocks first; a hit moves a
// prefix behind older blocks.
func TestEngineLRUEviction(t *testing.T) {
	const bs = 4
	p := seqTokens(1, 8)       // prefix: 2 blocks
	ta := seqTokens(100, 8)    // tail of a: 2 blocks
	tf := seqTokens(200, 8)    // tail of f: 2 blocks
	fill := seqTokens(300, 24) // 6 blocks: uses the never-used blocks
	h := func(toks []uint32) []uint64 { return router.SequenceHashes(toks, bs, "") }
	pa, pf := h(cat(p, ta)), h(cat(p, tf))
	tests := []struct {
		name  string
		steps [][]uint32 // prompts run one after another, 1 output token each
		// wantRemoved: every evicted block in order; wantCached: cached
		// tokens of a final request with prompt p + unrelated tail.
		wantRemoved []uint64
		wantCached  int
	}{
		{
			name:        "tail evicted before prefix",
			steps:       [][]uint32{cat(p, ta), fill, seqTokens(400, 8)},
			wantRemoved: []uint64{pa[3], pa[2]},
			wantCached:  8,
		},
		{
			name:        "prefix loses its last block first",
			steps:       [][]uint32{cat(p, ta), fill, seqTokens(400, 8), seqTokens(500, 4)},
			wantRemoved: []uint64{pa[3], pa[2], pa[1]},
			wantCached:  4,
		},
		{
			name:        "whole request gone",
			steps:       [][]uint32{cat(p, ta), fill, seqTokens(400, 16)},
			wantRemoved: []uint64{pa[3], pa[2], pa[1], pa[0]},
			wantCached:  0,
		},
		{
			// f hits p and is freed after a, so a's tail goes, then f's
			// tail, and p stays.
			name:        "hit refreshes the prefix",
			steps:       [][]uint32{cat(p, ta), cat(p, tf), seqTokens(300, 16), seqTokens(400, 16)},
			wantRemoved: []uint64{pa[3], pa[2], pf[3], pf[2]},
			wantCached:  8,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := mustNew(t, "w", Config{BlockSize: bs, CapacityBlocks: 10})
			for i, toks := range tc.steps {
				runOne(t, e, Request{ID: fmt.Sprint(i), Tokens: toks, OutputTokens: 1})
			}
			got := removedHashes(e.DrainEvents())
			if !slices.Equal(got, tc.wantRemoved) {
				t.Errorf("removed %v, want %v", got, tc.wantRemoved)
			}
			o := runOne(t, e, Request{ID: "probe", Tokens: cat(p, seqTokens(900, 3)), OutputTokens: 1})
			if o.CachedTokens != tc.wantCached {
				t.Errorf("probe cached %d tokens, want %d", o.CachedTokens, tc.wantCached)
			}
		})
	}
}

func TestEnginePinnedBlocksNeverEvicted(t *testing.T) {
	const bs = 4
	tests := []struct {
		name     string
		capacity int
		longOut  int
		churn    int // short requests run while the long one decodes
	}{
		{"tight", 9, 8, 6},
		{"roomy", 16, 20, 18},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := mustNew(t, "w", Config{BlockSize: bs, CapacityBlocks: tc.capacity})
			long := seqTokens(1, 12)
			pinned := router.SequenceHashes(long, bs, "")
			if err := e.Submit(0, Request{ID: "long", Tokens: long, OutputTokens: tc.longOut}); err != nil {
				t.Fatal(err)
			}
			var outs []Output
			for i := range tc.churn {
				now := e.Stats().Now
				if err := e.Submit(now, Request{ID: fmt.Sprint(i), Tokens: seqTokens(1000+i*100, 8), OutputTokens: 1}); err != nil {
					t.Fatal(err)
				}
				next, _ := e.NextEventTime()
				outs = append(outs, e.Advance(next)...)
				if _, done := find(outs, "long", Finished); done {
					t.Fatal("long request finished during churn")
				}
				for _, r := range removedHashes(e.DrainEvents()) {
					if slices.Contains(pinned, r) {
						t.Fatalf("pinned block %d evicted", r)
					}
				}
				if st := e.Stats(); st.UsedBlocks < len(pinned) {
					t.Fatalf("used blocks %d < pinned %d", st.UsedBlocks, len(pinned))
				}
			}
			if st := e.Stats(); st.EvictedBlocks == 0 {
				t.Fatal("churn evicted nothing: test is vacuous")
			}
			outs = append(outs, runIdle(t, e)...)
			if _, ok := find(outs, "long", Finished); !ok {
				t.Fatal("long request did not finish")
			}
			if o := runOne(t, e, Request{ID: "again", Tokens: long, OutputTokens: 1}); o.CachedTokens != 8 {
				t.Errorf("resubmitted long prompt cached %d tokens, want 8", o.CachedTokens)
			}
		})
	}
}

func TestEnginePreemptionNewestFirst(t *testing.T) {
	const bs = 4
	tests := []struct {
		name     string
		capacity int
		requests int
	}{
		{"victim is another request", 12, 3},
		{"victim is the request itself", 11, 3},
		{"many", 20, 6},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := mustNew(t, "w", Config{BlockSize: bs, CapacityBlocks: tc.capacity})
			for i := range tc.requests {
				if err := e.Submit(0, Request{ID: fmt.Sprint(i), Tokens: seqTokens(100*i+1, 12), OutputTokens: 12}); err != nil {
					t.Fatal(err)
				}
			}
			outs := runIdle(t, e)
			var preempted []string
			finished := 0
			for _, o := range outs {
				switch o.Kind {
				case Preempted:
					preempted = append(preempted, o.RequestID)
				case Finished:
					finished++
				}
			}
			if finished != tc.requests {
				t.Fatalf("%d of %d finished", finished, tc.requests)
			}
			if len(preempted) == 0 {
				t.Fatal("no preemption: test is vacuous")
			}
			if newest := fmt.Sprint(tc.requests - 1); preempted[0] != newest {
				t.Errorf("first preempted %s, want newest %s (all: %v)", preempted[0], newest, preempted)
			}
			if slices.Contains(preempted, "0") {
				t.Errorf("oldest request preempted: %v", preempted)
			}
			if st := e.Stats(); st.Preemptions != uint64(len(preempted)) || st.UsedBlocks != 0 {
				t.Errorf("stats %+v", st)
			}
		})
	}
}

func TestEngineChunkedPrefill(t *testing.T) {
	const bs = 16
	prof, _ := LookupProfile(ProfileDynamoMocker)
	d := func(ms float64) time.Duration { return msToDuration(ms, 1) }
	tests := []struct {
		name    string
		budget  int
		prompts []int
		// wantFirst: FirstToken time of each request; wantSteps: steps
		// until the last first token.
		wantFirst []time.Duration
	}{
		// Chunks that finish a prompt sample its first token, so their
		// step adds a decode step at the fill after scheduling (blocks of
		// 256); TestEngineTimingDynamo checks the formula by hand.
		{"one long prompt", 64, []int{200},
			[]time.Duration{3*d(prof.PrefillMs(64)) + d(prof.StepMs(8, 1, 13.0/256))}},
		{"fits one step", 8192, []int{200},
			[]time.Duration{d(prof.StepMs(200, 1, 13.0/256))}},
		{"two prompts share the budget", 64, []int{40, 40},
			// step 1: a 40 (samples) + b 24, 3 + 2 blocks; step 2: a's
			// decode token + b's last 16 (both sample), 3 + 3 blocks.
			[]time.Duration{
				d(prof.PassMs(Pass{Prefills: 2, ISL: 40 + 24, Sampled: 1, Fill: 5.0 / 256})),
				d(prof.PassMs(Pass{Prefills: 2, ISL: 40 + 24, Sampled: 1, Fill: 5.0 / 256})) +
					d(prof.PassMs(Pass{Prefills: 1, ISL: 40, Prefix: 24, Sampled: 2, Fill: 6.0 / 256})),
			}},
		{"budget of one block", 16, []int{40},
			[]time.Duration{2*d(prof.PrefillMs(16)) + d(prof.StepMs(8, 1, 3.0/256))}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := mustNew(t, "w", Config{BlockSize: bs, CapacityBlocks: 256, MaxBatchedTokens: tc.budget})
			total := 0
			for i, n := range tc.prompts {
				total += n
				if err := e.Submit(0, Request{ID: fmt.Sprint(i), Tokens: seqTokens(1000*i, n), OutputTokens: 2}); err != nil {
					t.Fatal(err)
				}
			}
			var outs []Output
			for {
				before := e.Stats().PrefillTokens
				next, ok := e.NextEventTime()
				if !ok {
					break
				}
				st := e.Stats()
				// Decode tokens count against the budget too.
				if got := int(st.PrefillTokens - before); got > tc.budget {
					t.Fatalf("step ran %d prefill tokens, budget %d", got, tc.budget)
				}
				outs = append(outs, e.Advance(next)...)
			}
			for i, want := range tc.wantFirst {
				o, ok := find(outs, fmt.Sprint(i), FirstToken)
				if !ok || o.At != want {
					t.Errorf("request %d first token at %v, want %v", i, o.At, want)
				}
			}
			if st := e.Stats(); st.PrefillTokens != uint64(total) {
				t.Errorf("prefill tokens %d, want %d", st.PrefillTokens, total)
			}
		})
	}
}

func TestEngineMaxRunning(t *testing.T) {
	e := mustNew(t, "w", Config{BlockSize: 4, CapacityBlocks: 64, MaxRunning: 2})
	for i := range 3 {
		if err := e.Submit(0, Request{ID: fmt.Sprint(i), Tokens: seqTokens(100*i, 8), OutputTokens: 5}); err != nil {
			t.Fatal(err)
		}
	}
	e.NextEventTime()
	if st := e.Stats(); st.Running != 2 || st.Waiting != 1 {
		t.Fatalf("running %d waiting %d, want 2 and 1", st.Running, st.Waiting)
	}
	outs := runIdle(t, e)
	f1, _ := find(outs, "1", Finished)
	s2, _ := find(outs, "2", FirstToken)
	if s2.At <= f1.At {
		t.Errorf("third request started at %v, before a slot freed at %v", s2.At, f1.At)
	}
}

func TestEngineEvents(t *testing.T) {
	const bs = 4
	tests := []struct {
		name string
		seed uint64
		base uint64
	}{
		{"engine hash = content hash", 0, 0},
		{"seeded engine hash", 42, 1000},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := mustNew(t, "w", Config{BlockSize: bs, CapacityBlocks: 8, MaxBatchedTokens: 8,
				EngineHashSeed: tc.seed, EventIDBase: tc.base})
			toks := seqTokens(1, 18) // 4 full blocks, cached in two chunks of 2
			content := router.SequenceHashes(toks, bs, "")
			runOne(t, e, Request{ID: "a", Tokens: toks, OutputTokens: 3})
			evs := e.DrainEvents()
			var stored []Event
			for _, ev := range evs {
				if ev.KV.Kind == router.EventStored {
					stored = append(stored, ev)
				}
			}
			if len(stored) < 2 {
				t.Fatalf("stored events %+v", evs)
			}
			eh := func(i int) uint64 { return e.EngineHash(content[i]) }
			if tc.seed != 0 && eh(0) == content[0] {
				t.Fatal("seeded engine hash equals content hash")
			}
			want0 := router.KVEvent{Kind: router.EventStored, BlockSize: bs, Blocks: []router.StoredBlock{
				{EngineHash: eh(0), ContentHash: content[0]}, {EngineHash: eh(1), ContentHash: content[1]}}}
			want1 := router.KVEvent{Kind: router.EventStored, BlockSize: bs, HasParent: true, Parent: eh(1),
				Blocks: []router.StoredBlock{{EngineHash: eh(2), ContentHash: content[2]}, {EngineHash: eh(3), ContentHash: content[3]}}}
			if !reflect.DeepEqual(stored[0].KV, want0) {
				t.Errorf("first stored %+v, want %+v", stored[0].KV, want0)
			}
			if !reflect.DeepEqual(stored[1].KV, want1) {
				t.Errorf("second stored %+v, want %+v", stored[1].KV, want1)
			}
			if stored[1].At <= stored[0].At {
				t.Errorf("second chunk stored at %v, first at %v", stored[1].At, stored[0].At)
			}
			// Fill the cache with other prompts: a's blocks are removed
			// under their engine hashes, tail first.
			runOne(t, e, Request{ID: "b", Tokens: seqTokens(100, 28), OutputTokens: 1})
			runOne(t, e, Request{ID: "c", Tokens: seqTokens(200, 28), OutputTokens: 1})
			evs = append(evs, e.DrainEvents()...)
			removed := removedHashes(evs)
			for i := 3; i >= 0; i-- {
				j := slices.Index(removed, eh(i))
				if j < 0 {
					t.Fatalf("block %d never removed (removed %v)", i, removed)
				}
				if i < 3 && j < slices.Index(removed, eh(i+1)) {
					t.Errorf("block %d removed before block %d", i, i+1)
				}
			}
			if err := e.Clear(e.Stats().Now); err != nil {
				t.Fatal(err)
			}
			evs = append(evs, e.DrainEvents()...)
			if last := evs[len(evs)-1].KV; last.Kind != router.EventCleared {
				t.Errorf("last event %+v, want cleared", last)
			}
			for i, ev := range evs {
				if ev.ID != tc.base+uint64(i)+1 {
					t.Fatalf("event %d has id %d, want %d", i, ev.ID, tc.base+uint64(i)+1)
				}
				if i > 0 && ev.At < evs[i-1].At {
					t.Fatalf("event %d at %v before event %d at %v", i, ev.At, i-1, evs[i-1].At)
				}
				if ev.KV.BlockSize != bs {
					t.Fatalf("event %d block size %d", i, ev.KV.BlockSize)
				}
			}
		})
	}
}

func TestEngineClear(t *testing.T) {
	e := mustNew(t, "w", Config{BlockSize: 4, CapacityBlocks: 16})
	toks := seqTokens(1, 13)
	if err := e.Submit(0, Request{ID: "a", Tokens: toks, OutputTokens: 4}); err != nil {
		t.Fatal(err)
	}
	e.NextEventTime()
	if err := e.Clear(0); !errors.Is(err, ErrBusy) {
		t.Fatalf("clear while running: %v, want ErrBusy", err)
	}
	runIdle(t, e)
	if len(e.CachedBlocks()) == 0 {
		t.Fatal("nothing cached")
	}
	if err := e.Clear(e.Stats().Now); err != nil {
		t.Fatal(err)
	}
	if n := len(e.CachedBlocks()); n != 0 || e.Stats().CachedBlocks != 0 {
		t.Fatalf("%d blocks cached after clear", n)
	}
	if o := runOne(t, e, Request{ID: "b", Tokens: toks, OutputTokens: 1}); o.CachedTokens != 0 {
		t.Errorf("hit %d tokens after clear", o.CachedTokens)
	}
}

func TestEngineCancel(t *testing.T) {
	tests := []struct {
		name     string
		cancelAt func(e *Engine) time.Duration
		id       string
	}{
		{"waiting", func(e *Engine) time.Duration { return 0 }, "b"},
		{"running mid-step", func(e *Engine) time.Duration { t, _ := e.NextEventTime(); return t / 2 }, "a"},
		{"running between steps", func(e *Engine) time.Duration { t, _ := e.NextEventTime(); return t }, "a"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := mustNew(t, "w", Config{BlockSize: 4, CapacityBlocks: 16, MaxRunning: 1})
			for _, id := range []string{"a", "b"} {
				if err := e.Submit(0, Request{ID: id, Tokens: seqTokens(len(id)*100, 10), OutputTokens: 5}); err != nil {
					t.Fatal(err)
				}
			}
			at := tc.cancelAt(e)
			outs := e.Advance(at)
			if !e.Cancel(at, tc.id) {
				t.Fatal("cancel found nothing")
			}
			if e.Cancel(at, tc.id) {
				t.Fatal("cancelled twice")
			}
			outs = append(outs, runIdle(t, e)...)
			for _, o := range outs {
				if o.RequestID == tc.id && o.Kind == Finished {
					t.Errorf("cancelled request finished: %+v", o)
				}
			}
			st := e.Stats()
			if st.Cancelled != 1 || st.Finished != 1 || st.UsedBlocks != 0 || st.Running+st.Waiting != 0 {
				t.Errorf("stats %+v", st)
			}
			// The id can be reused.
			if err := e.Submit(st.Now, Request{ID: tc.id, Tokens: seqTokens(7, 10)}); err != nil {
				t.Error(err)
			}
		})
	}
}

func TestEngineTiming(t *testing.T) {
	dyn, _ := LookupProfile(ProfileDynamoMocker)
	small, _ := LookupProfile(ProfileSeed001Small)
	near := func(a, b float64) bool { return a-b < 1e-9 && b-a < 1e-9 }
	formulas := []struct {
		name      string
		got, want float64
	}{
		// Dynamo's coefficients: 4.209989e-07·2,250,000 + 1.518344e-02·1,500 + 16.50142
		{"dynamo prefill 1500", dyn.PrefillMs(1500), 0.947247525 + 22.77516 + 16.50142},
		{"dynamo prefill 1", dyn.PrefillMs(1), 4.209989e-07 + 1.518344e-02 + 16.50142},
		{"dynamo prefill 0", dyn.PrefillMs(0), 0},
		{"dynamo decode p=0", dyn.DecodeMs(0), 5.74},
		{"dynamo decode p=0.5", dyn.DecodeMs(0.5), -6.435 + 27.005 + 5.74},
		{"dynamo decode p=1", dyn.DecodeMs(1), 34.01},
		{"dynamo decode floor", dyn.DecodeMs(3), 1},
		// prefill(100) + decode(0.9) = (0.004209989 + 1.518344 + 16.50142) + (−20.8494 + 48.609 + 5.74)
		{"dynamo mixed step", dyn.StepMs(100, 4, 0.9), 18.023973989 + 33.4996},
		{"dynamo prefill step that samples nothing", dyn.StepMs(100, 0, 0.9), 18.023973989},
		{"empty step", dyn.StepMs(0, 0, 0.5), 0},
		{"small cold 1500", small.PrefillMs(1500), 80.0},
		{"small 3000", small.PrefillMs(3000), 172.1},
	}
	for _, tc := range formulas {
		if !near(tc.got, tc.want) {
			t.Errorf("%s = %.9f, want %.9f", tc.name, tc.got, tc.want)
		}
	}
	if hit := small.PrefillMs(40); hit < 14 || hit > 16 {
		t.Errorf("small prefix-hit prefill = %.2f ms, want ≈ 15", hit)
	}

	const bs, capacity = 16, 1000
	tests := []struct {
		profile string
		speedup float64
	}{
		{ProfileDynamoMocker, 0},
		{ProfileDynamoMocker, 1},
		{ProfileDynamoMocker, 2.5},
		{ProfileSeed001Small, 1},
		{ProfileSeed001Small, 10},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%s/x%v", tc.profile, tc.speedup), func(t *testing.T) {
			e := mustNew(t, "w", Config{BlockSize: bs, CapacityBlocks: capacity, Profile: tc.profile, Speedup: tc.speedup})
			p, sp := e.Profile(), max(tc.speedup, 1)
			if tc.speedup != 0 {
				sp = tc.speedup
			}
			outs := runIdle(t, e)
			if len(outs) != 0 {
				t.Fatal("idle engine produced outputs")
			}
			start := 5 * time.Second
			if err := e.Submit(start, Request{ID: "a", Tokens: seqTokens(1, 1500), OutputTokens: 3}); err != nil {
				t.Fatal(err)
			}
			outs = runIdle(t, e)
			first, _ := find(outs, "a", FirstToken)
			fin, _ := find(outs, "a", Finished)
			// The prompt's step samples the first token at ⌈1500/16⌉ = 94 blocks.
			wantFirst := start + msToDuration(p.StepMs(1500, 1, 94.0/capacity), sp)
			// Two decode steps, each holding ceil(1501/16) then
			// ceil(1502/16) blocks.
			wantFin := wantFirst + msToDuration(p.DecodeMs(94.0/capacity), sp) + msToDuration(p.DecodeMs(94.0/capacity), sp)
			if first.At != wantFirst || fin.At != wantFin {
				t.Errorf("first token at %v (want %v), finished at %v (want %v)", first.At, wantFirst, fin.At, wantFin)
			}
		})
	}
}

// randomWorkload drives one engine with arrivals, shared prefixes, random
// lengths and cancellations, with a cache small enough to evict and preempt.
// It returns everything observable.
func randomWorkload(tb testing.TB, seed uint64, cfg Config) (*Engine, []Output, []Event) {
	tb.Helper()
	rng := rand.New(rand.NewPCG(seed, 7))
	e := mustNew(tb, "w", cfg)
	prefixes := make([][]uint32, 5)
	for i := range prefixes {
		prefixes[i] = randomTokens(rng, 20+rng.IntN(60))
	}
	var outs []Output
	var evs []Event
	var now time.Duration
	for i := range 300 {
		now += time.Duration(rng.IntN(20)) * time.Millisecond
		outs = append(outs, e.Advance(now)...)
		toks := cat(prefixes[rng.IntN(len(prefixes))], randomTokens(rng, 1+rng.IntN(40)))
		if err := e.Submit(now, Request{ID: fmt.Sprint(i), Tokens: toks, OutputTokens: 1 + rng.IntN(30)}); err != nil {
			tb.Fatal(err)
		}
		if rng.IntN(10) == 0 {
			e.Cancel(now, fmt.Sprint(rng.IntN(i+1)))
		}
		evs = append(evs, e.DrainEvents()...)
	}
	outs = append(outs, runIdle(tb, e)...)
	evs = append(evs, e.DrainEvents()...)
	return e, outs, evs
}

func TestEngineDeterminism(t *testing.T) {
	cfg := Config{BlockSize: 4, CapacityBlocks: 96, MaxBatchedTokens: 64, MaxRunning: 8, EngineHashSeed: 9}
	for seed := range uint64(3) {
		e1, o1, ev1 := randomWorkload(t, seed, cfg)
		e2, o2, ev2 := randomWorkload(t, seed, cfg)
		if !reflect.DeepEqual(o1, o2) {
			t.Fatalf("seed %d: outputs differ", seed)
		}
		if !reflect.DeepEqual(ev1, ev2) {
			t.Fatalf("seed %d: events differ", seed)
		}
		if !reflect.DeepEqual(e1.Stats(), e2.Stats()) || !reflect.DeepEqual(e1.CachedBlocks(), e2.CachedBlocks()) {
			t.Fatalf("seed %d: state differs", seed)
		}
		st := e1.Stats()
		if st.Preemptions == 0 || st.EvictedBlocks == 0 || st.Cancelled == 0 || st.CachedTokens == 0 {
			t.Errorf("seed %d: workload too gentle: %+v", seed, st)
		}
	}
}

// TestEngineEventReplay replays the event stream into a replica of the
// worker's cache: every stored parent is held, every removal names a held
// block, and the replica ends equal to CachedBlocks.
func TestEngineEventReplay(t *testing.T) {
	for _, seed := range []uint64{0, 77} {
		cfg := Config{BlockSize: 4, CapacityBlocks: 80, MaxBatchedTokens: 48, MaxRunning: 6, EngineHashSeed: seed}
		e, _, evs := randomWorkload(t, 11, cfg)
		replica := map[uint64]uint64{} // engine hash → content hash
		for i, ev := range evs {
			switch ev.KV.Kind {
			case router.EventStored:
				if ev.KV.HasParent {
					if _, ok := replica[ev.KV.Parent]; !ok {
						t.Fatalf("event %d: parent %d not held", i, ev.KV.Parent)
					}
				}
				for _, b := range ev.KV.Blocks {
					if _, ok := replica[b.EngineHash]; ok {
						t.Fatalf("event %d: block %d stored twice", i, b.EngineHash)
					}
					if b.EngineHash != e.EngineHash(b.ContentHash) {
						t.Fatalf("event %d: engine hash mismatch", i)
					}
					replica[b.EngineHash] = b.ContentHash
				}
			case router.EventRemoved:
				for _, h := range ev.KV.Removed {
					if _, ok := replica[h]; !ok {
						t.Fatalf("event %d: removed block %d not held", i, h)
					}
					delete(replica, h)
				}
			case router.EventCleared:
				clear(replica)
			}
		}
		cached := e.CachedBlocks()
		if len(cached) != len(replica) || len(cached) != e.Stats().CachedBlocks {
			t.Fatalf("replica %d blocks, engine %d (stats %d)", len(replica), len(cached), e.Stats().CachedBlocks)
		}
		for _, b := range cached {
			if replica[b.EngineHash] != b.ContentHash {
				t.Fatalf("block %d: replica %d, engine %d", b.EngineHash, replica[b.EngineHash], b.ContentHash)
			}
		}
	}
}

func TestEngineBadConfig(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
	}{
		{"zero block size", Config{CapacityBlocks: 10}},
		{"negative block size", Config{BlockSize: -16, CapacityBlocks: 10}},
		{"zero capacity", Config{BlockSize: 16}},
		{"negative max running", Config{BlockSize: 16, CapacityBlocks: 10, MaxRunning: -1}},
		{"negative token budget", Config{BlockSize: 16, CapacityBlocks: 10, MaxBatchedTokens: -1}},
		{"max model len over capacity", Config{BlockSize: 16, CapacityBlocks: 10, MaxModelLen: 161}},
		{"negative max model len", Config{BlockSize: 16, CapacityBlocks: 10, MaxModelLen: -1}},
		{"negative speedup", Config{BlockSize: 16, CapacityBlocks: 10, Speedup: -1}},
		{"unknown profile", Config{BlockSize: 16, CapacityBlocks: 10, Profile: "h100"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := New("w", tc.cfg); !errors.Is(err, ErrConfig) {
				t.Errorf("New = %v, want ErrConfig", err)
			}
		})
	}
	e, err := New("w", Config{BlockSize: 16, CapacityBlocks: 10})
	if err != nil {
		t.Fatal(err)
	}
	if c := e.Config(); c.MaxRunning != 256 || c.MaxBatchedTokens != 8192 || c.MaxModelLen != 160 ||
		c.Speedup != 1 || c.Profile != ProfileDynamoMocker {
		t.Errorf("defaults %+v", c)
	}
}

func TestEngineBadRequest(t *testing.T) {
	e := mustNew(t, "w", Config{BlockSize: 4, CapacityBlocks: 10})
	if err := e.Submit(time.Second, Request{ID: "a", Tokens: seqTokens(1, 8), OutputTokens: 2}); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		now  time.Duration
		r    Request
		want error
	}{
		{"duplicate id", time.Second, Request{ID: "a", Tokens: seqTokens(1, 8)}, ErrDuplicate},
		{"time backwards", 0, Request{ID: "b", Tokens: seqTokens(1, 8)}, ErrTime},
		{"empty prompt", time.Second, Request{ID: "b"}, ErrRequest},
		{"too long", time.Second, Request{ID: "b", Tokens: seqTokens(1, 38), OutputTokens: 3}, ErrRequest},
		{"negative output", time.Second, Request{ID: "b", Tokens: seqTokens(1, 8), OutputTokens: -1}, ErrRequest},
		{"hash count mismatch", time.Second, Request{ID: "b", Tokens: seqTokens(1, 8), BlockHashes: []uint64{1}}, ErrRequest},
		{"no tokens, no hashes", time.Second, Request{ID: "b", NumTokens: 8}, ErrRequest},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if err := e.Submit(tc.now, tc.r); !errors.Is(err, tc.want) {
				t.Errorf("Submit = %v, want %v", err, tc.want)
			}
		})
	}
	if st := e.Stats(); st.Submitted != 1 {
		t.Errorf("%d submitted, want 1", st.Submitted)
	}
}

func TestEngineOutputOrder(t *testing.T) {
	e := mustNew(t, "w", Config{BlockSize: 4, CapacityBlocks: 16})
	if err := e.Submit(0, Request{ID: "one", Tokens: seqTokens(1, 9), OutputTokens: 1}); err != nil {
		t.Fatal(err)
	}
	outs := runIdle(t, e)
	if len(outs) != 2 || outs[0].Kind != FirstToken || outs[1].Kind != Finished || outs[0].At != outs[1].At ||
		outs[1].OutputTokens != 1 || outs[1].PromptTokens != 9 {
		t.Fatalf("outputs %+v", outs)
	}
}

// BenchmarkEngineStep measures one step of a busy engine: 256 running
// sequences decoding while finished ones are replaced by new requests that
// hit a shared prefix and prefill their tails.
func BenchmarkEngineStep(b *testing.B) {
	const bs = 16
	e := mustNew(b, "w", Config{BlockSize: bs, CapacityBlocks: 20000})
	rng := rand.New(rand.NewPCG(1, 2))
	prefix := randomTokens(rng, 1024)
	prompts := make([][]uint32, 64)
	for i := range prompts {
		prompts[i] = cat(prefix, randomTokens(rng, 256))
	}
	n := 0
	var now time.Duration
	submit := func() {
		if err := e.Submit(now, Request{ID: fmt.Sprint(n), Tokens: prompts[n%len(prompts)], OutputTokens: 64 + n%128}); err != nil {
			b.Fatal(err)
		}
		n++
	}
	for range 256 {
		submit()
	}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		t, _ := e.NextEventTime()
		now = t
		for _, o := range e.Advance(t) {
			if o.Kind == Finished {
				submit()
			}
		}
		e.DrainEvents()
	}
	b.StopTimer()
	st := e.Stats()
	b.ReportMetric(float64(st.Running), "running")
}
