package fsm

import (
	"errors"
	"math"
	"slices"
	"testing"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/router"
)

func TestRankBlockCap(t *testing.T) {
	tests := []struct {
		total, want int
	}{
		{0, DefaultRankBlockCap},
		{-1, DefaultRankBlockCap},
		{1, 2},
		{4096, 8192},
		{math.MaxInt32, 2 * math.MaxInt32},
		{math.MaxInt, math.MaxInt},
	}
	for _, tc := range tests {
		if got := RankBlockCap(tc.total); got != tc.want {
			t.Errorf("RankBlockCap(%d) = %d, want %d", tc.total, got, tc.want)
		}
	}
}

// capWorker registers a one-rank worker "w" whose rank may hold 2 × total
// blocks, and one other worker, "x", with a large capacity.
func capWorker(t *testing.T, total int) *harness {
	h := newHarness(t)
	h.ok(RegisterWorker{ID: "w", DPRanks: 1, Model: "m", TotalBlocks: total})
	h.ok(RegisterWorker{ID: "x", DPRanks: 1, Model: "m", TotalBlocks: 1000})
	return h
}

// TestFSMRankBlockCap: a stored event that would take a rank past twice its
// registered capacity is refused whole, counted, reported once per rank
// per entry, and marks the rank stale; other ranks and removals are not
// affected.
func TestFSMRankBlockCap(t *testing.T) {
	type want struct {
		applied, over int
		held          int  // w's (rank 0) blocks after the entry
		stale         bool // w (rank 0) marked stale "over capacity"
		refused       uint64
	}
	tests := []struct {
		name    string
		total   int // w's registered capacity: cap 2×
		entries [][]KVBatchEvent
		want    want
	}{
		{"exactly at the cap", 2, [][]KVBatchEvent{{stored("w", 0, 1, 1, 2, 3, 4)}},
			want{applied: 1, held: 4}},
		{"one past the cap refuses the event whole", 2, [][]KVBatchEvent{{stored("w", 0, 1, 1, 2, 3), stored("w", 0, 2, 4, 5)}},
			want{applied: 1, over: 1, held: 3, stale: true, refused: 2}},
		{"blocks already held do not count", 2, [][]KVBatchEvent{{stored("w", 0, 1, 1, 2, 3, 4), stored("w", 0, 2, 3, 4)}},
			want{applied: 2, held: 4}},
		{"a removal makes room", 2, [][]KVBatchEvent{{stored("w", 0, 1, 1, 2, 3, 4), removed("w", 0, 2, 1, 2), stored("w", 0, 3, 5, 6)}},
			want{applied: 3, held: 4}},
		{"several refusals in one entry, counted each", 1, [][]KVBatchEvent{{stored("w", 0, 1, 1, 2), stored("w", 0, 2, 3), stored("w", 0, 3, 4, 5)}},
			want{applied: 1, over: 2, held: 2, stale: true, refused: 3}},
		{"another worker is not capped by w's capacity", 1, [][]KVBatchEvent{{stored("w", 0, 1, 1, 2), stored("x", 0, 1, 1, 2, 3, 4, 5)}},
			want{applied: 2, held: 2}},
		{"refusals across entries add up", 1, [][]KVBatchEvent{{stored("w", 0, 1, 1, 2)}, {stored("w", 0, 2, 3)}, {stored("w", 0, 3, 4)}},
			want{over: 1, held: 2, stale: true, refused: 2}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := capWorker(t, tc.total)
			var changes []Change
			h.f.OnChange(func(c Change) { changes = append(changes, c) })
			var last *ApplyResult
			for _, evs := range tc.entries {
				changes = changes[:0]
				last = h.events(evs...)
				if last.Err != nil {
					t.Fatal(last.Err)
				}
			}
			if last.Applied != tc.want.applied || last.OverCapacity != tc.want.over || last.Rejected != tc.want.over {
				t.Fatalf("last entry: applied %d over %d rejected %d, want %d, %d, %d",
					last.Applied, last.OverCapacity, last.Rejected, tc.want.applied, tc.want.over, tc.want.over)
			}
			if got := h.f.Index().Held("w"); got != tc.want.held {
				t.Fatalf("w holds %d blocks, want %d", got, tc.want.held)
			}
			s, stale := h.f.Stale()[RankKey{"w", 0}]
			if stale != tc.want.stale || (stale && s.Reason != StaleOverCapacity) {
				t.Fatalf("stale %v %+v, want %v", stale, s, tc.want.stale)
			}
			if got := h.f.OverCapacityRefused()["w"]; got != tc.want.refused {
				t.Fatalf("refused %d blocks, want %d", got, tc.want.refused)
			}
			n := 0
			for _, c := range changes {
				if c.Kind == ChangeOverCapacity {
					n++
					if c.Worker != "w" || c.DPRank != 0 || c.Reason == "" {
						t.Fatalf("change %+v", c)
					}
				}
			}
			if wantN := min(tc.want.over, 1); n != wantN {
				t.Fatalf("%d over-capacity changes in the last entry, want %d", n, wantN)
			}
			// The cursor moves past a refused event, as past any rejected one.
			if got := h.f.Cursors()[RankKey{"w", 0}]; got == 0 {
				t.Fatal("cursor did not move")
			}
		})
	}
}

// TestFSMRankBlockCapDefault: a worker that registered no capacity is capped
// at DefaultRankBlockCap, not unbounded.
func TestFSMRankBlockCapDefault(t *testing.T) {
	h := capWorker(t, 0)
	const per = 1 << 14
	hashes := make([]uint64, per)
	id := uint64(0)
	for held := 0; held < DefaultRankBlockCap; held += per {
		for i := range hashes {
			hashes[i] = uint64(held + i + 1)
		}
		id++
		if r := h.events(stored("w", 0, id, hashes...)); r.Applied != 1 {
			t.Fatalf("event %d: %+v", id, r)
		}
	}
	id++
	if r := h.events(stored("w", 0, id, math.MaxUint64)); r.OverCapacity != 1 {
		t.Fatalf("block %d past the default cap: %+v", DefaultRankBlockCap+1, r)
	}
	if got := h.f.Stats().Rejected[RejectOverCapacity]; got != 1 {
		t.Fatalf("Stats.Rejected[over_capacity] = %d", got)
	}
}

// TestFSMRankBlockCapDeterministic: replicas agree on every refusal — one
// that replayed the log and one restored from a snapshot taken midway,
// whose refused counters differ (they are diagnostics) while their digests
// agree. Lowering a worker's capacity below what it holds refuses only new
// blocks; deregistering it forgets its count.
func TestFSMRankBlockCapDeterministic(t *testing.T) {
	a := capWorker(t, 2)
	a.events(stored("w", 0, 1, 1, 2, 3), stored("w", 0, 2, 4, 5)) // second refused
	snap := snapshotBytes(t, a.f)

	b := newHarness(t)
	if err := restoreBytes(b.f, snap); err != nil {
		t.Fatal(err)
	}
	b.idx = a.idx
	rest := [][]byte{
		mustEncode(t, KVEventBatch{Events: []KVBatchEvent{removed("w", 0, 3, 1), stored("w", 0, 4, 6, 7, 8)}}), // 2+3 > 4: refused
		mustEncode(t, KVEventBatch{Events: []KVBatchEvent{stored("w", 0, 5, 6)}}),                              // 3 ≤ 4: fits
		mustEncode(t, RegisterWorker{ID: "w", DPRanks: 1, Model: "m", TotalBlocks: 1}),                         // cap 2 < held 3
		mustEncode(t, KVEventBatch{Events: []KVBatchEvent{stored("w", 0, 6, 2, 3), stored("w", 0, 7, 9)}}),     // restated: ok; new: refused
	}
	for i, e := range rest {
		ra, rb := a.raw(e), b.raw(e)
		if ra.Err != nil || rb.Err != nil || ra.OverCapacity != rb.OverCapacity || ra.Applied != rb.Applied {
			t.Fatalf("entry %d: replayed %+v, restored %+v", i, ra, rb)
		}
	}
	if a.f.Digest() != b.f.Digest() {
		t.Fatal("digests differ")
	}
	ra, rb := a.f.OverCapacityRefused()["w"], b.f.OverCapacityRefused()["w"]
	if ra != 2+3+1 || rb != 3+1 {
		t.Fatalf("refused blocks: replayed %d, restored %d (want 6 and 4: counted since each started)", ra, rb)
	}
	if held := a.f.Index().Held("w"); held != 3 {
		t.Fatalf("held %d, want 3", held)
	}
	a.ok(DeregisterWorker{ID: "w"})
	if _, ok := a.f.OverCapacityRefused()["w"]; ok {
		t.Fatal("a deregistered worker's count is kept")
	}
}

// TestFSMOversizeEntry: an entry larger than the FSM's limit is refused like
// an undecodable one (never a panic), the state and digest unchanged, the
// applied index moving on.
func TestFSMOversizeEntry(t *testing.T) {
	h := capWorker(t, 1000)
	h.f.maxEntry = 256
	small := mustEncode(t, KVEventBatch{Events: []KVBatchEvent{stored("w", 0, 1, 1, 2)}})
	if r := h.raw(small); r.Err != nil || r.Applied != 1 {
		t.Fatalf("small entry: %+v", r)
	}
	before := h.f.Digest()
	hashes := make([]uint64, 64)
	for i := range hashes {
		hashes[i] = uint64(100 + i)
	}
	big := mustEncode(t, KVEventBatch{Events: []KVBatchEvent{stored("w", 0, 2, hashes...)}})
	if len(big) <= h.f.maxEntry {
		t.Fatalf("test entry of %d bytes is not over %d", len(big), h.f.maxEntry)
	}
	r := h.raw(big)
	if !errors.Is(r.Err, ErrEntryTooLarge) || !errors.Is(r.Err, ErrUndecodable) || r.Applied != 0 {
		t.Fatalf("oversize entry: %+v", r)
	}
	if h.f.AppliedIndex() != h.idx {
		t.Fatalf("applied index %d, want %d", h.f.AppliedIndex(), h.idx)
	}
	if h.f.Digest() != before {
		t.Fatal("an oversize entry changed the state")
	}
	if s := h.f.Stats(); s.OversizeEntries != 1 || s.Undecodable != 1 {
		t.Fatalf("stats %+v", s)
	}
	// Entries that are not commands are never judged by size.
	out := h.f.ApplyBatch([]*raft.Log{{Index: h.idx + 1, Type: raft.LogNoop, Data: big}})
	if out[0] != nil || h.f.AppliedIndex() != h.idx+1 {
		t.Fatalf("noop entry: %v", out[0])
	}
}

// TestKVBatchEventBytesBound: the entry of any batch fits in
// KVBatchOverhead + Σ KVBatchEventBytes, and the bound is tight to within
// the per-event allowance for the string table and the worker index, so
// a proposer that splits by it neither overflows its cap nor wastes it.
func TestKVBatchEventBytesBound(t *testing.T) {
	g := newGen(7)
	long := string(slices.Repeat([]byte("w"), 300))
	for trial := range 300 {
		n := 1 + g.rng.IntN(64)
		evs := make([]KVBatchEvent, n)
		for i := range evs {
			evs[i] = g.kvEvent()
			switch g.rng.IntN(4) {
			case 0:
				evs[i].Worker = long
			case 1:
				evs[i].EventID = math.MaxUint64 - uint64(g.rng.IntN(10))
				evs[i].DPRank = math.MaxUint32
			}
		}
		enc, err := AppendKVBatch(nil, evs)
		if err != nil {
			t.Fatal(err)
		}
		sum, slack := KVBatchOverhead, KVBatchOverhead
		for i := range evs {
			sum += KVBatchEventBytes(&evs[i])
			slack += uvarintLen(uint64(len(evs[i].Worker))) + len(evs[i].Worker) + 5
		}
		if len(enc) > sum {
			t.Fatalf("trial %d: %d events encode to %d bytes, bound %d", trial, n, len(enc), sum)
		}
		if sum-len(enc) > slack {
			t.Fatalf("trial %d: bound %d exceeds the %d-byte encoding by more than %d", trial, sum, len(enc), slack)
		}
	}
	// One event of every kind, exactly: its encoding less the shared parts.
	for _, e := range []KVBatchEvent{
		stored("a", 0, 1, 1, 2, 3),
		storedAfter("a", 1, 300, 9, 1),
		{Worker: "a", EventID: 2, Event: router.KVEvent{Kind: router.EventStored, Blocks: []router.StoredBlock{{EngineHash: 5, ContentHash: 6}}}},
		removed("a", 0, 3, 1, 2),
		{Worker: "a", EventID: 4, Event: router.KVEvent{Kind: router.EventCleared, BlockSize: 16}},
	} {
		enc, err := AppendKVBatch(nil, []KVBatchEvent{e})
		if err != nil {
			t.Fatal(err)
		}
		// The entry adds four one-byte fields of its own (type, version,
		// the two counts) and spends one byte on the worker index where the
		// bound allows five: the two differences cancel.
		if got := KVBatchEventBytes(&e); got != len(enc) {
			t.Fatalf("%+v: %d bytes, its one-event entry %d", e, got, len(enc))
		}
	}
}
