package router

import (
	"errors"
	"maps"
	"slices"
	"testing"
)

func chain(hashes ...uint64) []StoredBlock {
	out := make([]StoredBlock, len(hashes))
	for i, h := range hashes {
		out[i] = StoredBlock{EngineHash: h + 1000, ContentHash: h}
	}
	return out
}

func overlapOf(ix *Index, seq []uint64) map[WorkerID]int {
	m := map[WorkerID]int{}
	for _, o := range ix.FindMatches(seq, nil) {
		m[o.Worker] = o.Blocks
	}
	return m
}

func TestIndexEvents(t *testing.T) {
	type step struct {
		worker WorkerID
		ev     KVEvent
		err    error
	}
	stored := func(parent uint64, hasParent bool, hs ...uint64) KVEvent {
		return KVEvent{Kind: EventStored, HasParent: hasParent, Parent: parent, Blocks: chain(hs...), BlockSize: 16}
	}
	tests := []struct {
		name  string
		steps []step
		query []uint64
		want  map[WorkerID]int
	}{
		{"chain under parent", []step{
			{"a", stored(0, false, 1, 2), nil},
			{"a", stored(1002, true, 3), nil},
		}, []uint64{1, 2, 3, 4}, map[WorkerID]int{"a": 3}},
		{"contiguous prefix only", []step{
			{"a", stored(0, false, 1, 2, 3), nil},
			{"b", stored(0, false, 1), nil},
			{"b", stored(1001, true, 2), nil},
			{"a", KVEvent{Kind: EventRemoved, Removed: []uint64{1002}}, nil},
		}, []uint64{1, 2, 3}, map[WorkerID]int{"a": 1, "b": 2}},
		{"removal does not cascade", []step{
			{"a", stored(0, false, 1, 2, 3), nil},
			{"a", KVEvent{Kind: EventRemoved, Removed: []uint64{1001}}, nil},
		}, []uint64{2, 3}, map[WorkerID]int{"a": 2}},
		{"re-applying is harmless", []step{
			{"a", stored(0, false, 1, 2), nil},
			{"a", stored(0, false, 1, 2), nil},
			{"a", KVEvent{Kind: EventRemoved, Removed: []uint64{1002}}, nil},
			{"a", KVEvent{Kind: EventRemoved, Removed: []uint64{1002}}, nil},
		}, []uint64{1, 2}, map[WorkerID]int{"a": 1}},
		{"missing parent rejected", []step{
			{"a", stored(4242, true, 7), ErrMissingParent},
		}, []uint64{7}, map[WorkerID]int{}},
		{"block size mismatch rejected", []step{
			{"a", KVEvent{Kind: EventStored, Blocks: chain(1), BlockSize: 32}, ErrBlockSizeMismatch},
		}, []uint64{1}, map[WorkerID]int{}},
		{"unknown worker rejected", []step{
			{"zz", stored(0, false, 1), ErrUnknownWorker},
		}, []uint64{1}, map[WorkerID]int{}},
		{"cleared", []step{
			{"a", stored(0, false, 1, 2), nil},
			{"b", stored(0, false, 1, 2), nil},
			{"a", KVEvent{Kind: EventCleared}, nil},
		}, []uint64{1, 2}, map[WorkerID]int{"b": 2}},
		{"unknown removal ignored", []step{
			{"a", stored(0, false, 1), nil},
			{"a", KVEvent{Kind: EventRemoved, Removed: []uint64{555}}, nil},
		}, []uint64{1}, map[WorkerID]int{"a": 1}},
		{"bad kind", []step{
			{"a", KVEvent{Kind: 9}, ErrInvalidEvent},
		}, []uint64{1}, map[WorkerID]int{}},
		{"empty query", nil, nil, map[WorkerID]int{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ix := NewIndex(16)
			ix.AddWorker("a")
			ix.AddWorker("b")
			for i, s := range tc.steps {
				err := ix.Apply(s.worker, s.ev)
				if (tc.steps[i].err == nil) != (err == nil) || (err != nil && !errors.Is(err, s.err)) {
					t.Fatalf("step %d: err = %v, want %v", i, err, s.err)
				}
			}
			got := overlapOf(ix, tc.query)
			if len(got) != len(tc.want) {
				t.Fatalf("overlaps %v, want %v", got, tc.want)
			}
			for w, n := range tc.want {
				if got[w] != n {
					t.Errorf("overlaps %v, want %v", got, tc.want)
				}
			}
		})
	}
}

func TestIndexMissingParentIsTyped(t *testing.T) {
	ix := NewIndex(16)
	ix.AddWorker("a")
	err := ix.Apply("a", KVEvent{Kind: EventStored, HasParent: true, Parent: 77, Blocks: chain(1)})
	var mp *MissingParentError
	if !errors.As(err, &mp) || mp.Worker != "a" || mp.Parent != 77 {
		t.Fatalf("err = %v", err)
	}
	if s := ix.Stats(); s.MissingParents != 1 || s.StoredBlocks != 0 {
		t.Errorf("stats %+v", s)
	}
}

func TestIndexRemoveWorkerAndSlotReuse(t *testing.T) {
	ix := NewIndex(16)
	for _, w := range []WorkerID{"a", "b", "c"} {
		ix.AddWorker(w)
		if err := ix.Apply(w, KVEvent{Kind: EventStored, Blocks: chain(1, 2)}); err != nil {
			t.Fatal(err)
		}
	}
	ix.RemoveWorker("b")
	ix.AddWorker("d") // takes b's slot: must not inherit b's blocks
	got := overlapOf(ix, []uint64{1, 2})
	if got["b"] != 0 || got["d"] != 0 || got["a"] != 2 || got["c"] != 2 {
		t.Errorf("overlaps %v", got)
	}
	if !slices.Equal(ix.Workers(), []WorkerID{"a", "c", "d"}) {
		t.Errorf("workers %v", ix.Workers())
	}
	if ix.Held("a") != 2 || ix.Held("d") != 0 || ix.Holders(1) != 2 || ix.Len() != 2 {
		t.Errorf("held a=%d d=%d holders=%d len=%d", ix.Held("a"), ix.Held("d"), ix.Holders(1), ix.Len())
	}
}

// More than 64 workers take the wide bitset path.
func TestIndexManyWorkers(t *testing.T) {
	ix := NewIndex(16)
	const n = 150
	for i := range n {
		w := WorkerKey("w", uint32(i))
		ix.AddWorker(w)
		// worker i holds the first i%5+1 blocks
		hs := []uint64{1, 2, 3, 4, 5}[:i%5+1]
		if err := ix.Apply(w, KVEvent{Kind: EventStored, Blocks: chain(hs...)}); err != nil {
			t.Fatal(err)
		}
	}
	got := overlapOf(ix, []uint64{1, 2, 3, 4, 5, 6})
	if len(got) != n {
		t.Fatalf("%d workers matched", len(got))
	}
	for i := range n {
		if w := WorkerKey("w", uint32(i)); got[w] != i%5+1 {
			t.Errorf("%s overlap %d, want %d", w, got[w], i%5+1)
		}
	}
	ix.RemoveWorker(WorkerKey("w", 100))
	if got := overlapOf(ix, []uint64{1}); len(got) != n-1 {
		t.Errorf("after removal %d matched", len(got))
	}
}

func TestIndexWorkerBlocksSorted(t *testing.T) {
	ix := NewIndex(16)
	ix.AddWorker("a")
	_ = ix.Apply("a", KVEvent{Kind: EventStored, Blocks: []StoredBlock{{EngineHash: 9, ContentHash: 9}, {EngineHash: 50, ContentHash: 3}}})
	got := ix.WorkerBlocks("a")
	want := []StoredBlock{{EngineHash: 50, ContentHash: 3}, {EngineHash: 9, ContentHash: 9}}
	if !slices.Equal(got, want) {
		t.Errorf("blocks %v, want %v", got, want)
	}
}

// FuzzIndexApply drives the index with arbitrary events: it never panics,
// overlaps never exceed the query, and applying an event twice equals once.
func FuzzIndexApply(f *testing.F) {
	f.Add([]byte{1, 0, 3, 1, 2, 3, 2, 0, 1, 2})
	f.Add([]byte{1, 1, 2, 5, 6, 3, 1, 0, 9})
	f.Fuzz(func(t *testing.T, data []byte) {
		a, b := NewIndex(4), NewIndex(4)
		workers := []WorkerID{"x", "y", "z"}
		for _, w := range workers {
			a.AddWorker(w)
			b.AddWorker(w)
		}
		for len(data) >= 3 {
			kind, w, n := EventKind(data[0]%4), workers[int(data[1])%len(workers)], int(data[2]%6)
			data = data[3:]
			ev := KVEvent{Kind: kind, BlockSize: []int{0, 4, 8}[n%3]}
			hs := make([]uint64, 0, n)
			for i := 0; i < n && i < len(data); i++ {
				hs = append(hs, uint64(data[i]%16))
			}
			data = data[min(n, len(data)):]
			if n%2 == 1 && len(hs) > 0 {
				ev.HasParent, ev.Parent, hs = true, hs[0], hs[1:]
			}
			ev.Blocks = chain(hs...)
			ev.Removed = hs
			errA := a.Apply(w, ev)
			_ = b.Apply(w, ev)
			errB := b.Apply(w, ev)
			if kind != EventStored && (errA == nil) != (errB == nil) {
				t.Fatalf("second apply changed the outcome: %v vs %v", errA, errB)
			}
		}
		q := []uint64{0, 1, 2, 3, 4, 5, 6, 7}
		for _, o := range a.FindMatches(q, nil) {
			if o.Blocks < 1 || o.Blocks > len(q) {
				t.Fatalf("overlap %d", o.Blocks)
			}
		}
		for _, w := range workers {
			if !slices.Equal(a.WorkerBlocks(w), b.WorkerBlocks(w)) {
				t.Fatalf("worker %s: once %v, twice %v", w, a.WorkerBlocks(w), b.WorkerBlocks(w))
			}
		}
	})
}

// FuzzBlockHashes: any tokens and block size, never a panic, and hashes
// depend only on full blocks.
func FuzzBlockHashes(f *testing.F) {
	f.Add([]byte{1, 0, 0, 0, 2, 0, 0, 0}, 1)
	f.Add([]byte{}, 16)
	f.Fuzz(func(t *testing.T, raw []byte, bs int) {
		toks := make([]uint32, len(raw)/4)
		for i := range toks {
			toks[i] = uint32(raw[4*i]) | uint32(raw[4*i+1])<<8 | uint32(raw[4*i+2])<<16 | uint32(raw[4*i+3])<<24
		}
		bs = bs%64 - 8 // include zero and negative sizes
		local, seq := BlockHashes(toks, bs, "l")
		if bs <= 0 {
			if local != nil || seq != nil {
				t.Fatalf("block size %d gave hashes", bs)
			}
			return
		}
		if len(seq) != len(toks)/bs || len(local) != len(seq) {
			t.Fatalf("%d tokens, bs %d: %d hashes", len(toks), bs, len(seq))
		}
		if extra := append(slices.Clone(toks), 7); len(SequenceHashes(extra, bs, "l")) >= len(seq) {
			if got := SequenceHashes(extra, bs, "l")[:len(seq)]; !slices.Equal(got, seq) {
				t.Fatalf("appending a token changed earlier hashes")
			}
		}
	})
}

func TestIndexAllWorkerBlocksMatchesPerWorker(t *testing.T) {
	ix := NewIndex(16)
	for i := range 70 { // past 64: the wide path too
		w := WorkerKey("w", uint32(i))
		ix.AddWorker(w)
		_ = ix.Apply(w, KVEvent{Kind: EventStored, Blocks: []StoredBlock{
			{EngineHash: uint64(i), ContentHash: uint64(i)}, {EngineHash: 1000 + uint64(i%3), ContentHash: 7}}})
	}
	all := ix.AllWorkerBlocks()
	for _, w := range ix.Workers() {
		if !slices.Equal(all[w], ix.WorkerBlocks(w)) {
			t.Fatalf("%s: all %v, per worker %v", w, all[w], ix.WorkerBlocks(w))
		}
	}
}

// TestIndexPerWorkerBlockSize: workers added with their own block size (a
// fleet of models with different block sizes shares one index) have their
// events checked against it, not the index's; lookups with one size's
// hashes find the workers holding those blocks and no others; a removed
// worker's slot and size are not inherited.
func TestIndexPerWorkerBlockSize(t *testing.T) {
	type step struct {
		worker WorkerID
		size   int // event block size (0 = unstated)
		hashes []uint64
		err    error
	}
	tests := []struct {
		name  string
		steps []step
		query []uint64
		want  map[WorkerID]int
	}{
		{"each worker at its own size", []step{
			{"a16", 16, []uint64{1, 2}, nil},
			{"b32", 32, []uint64{91, 92}, nil},
			{"c32", 32, []uint64{91}, nil},
		}, []uint64{91, 92}, map[WorkerID]int{"b32": 2, "c32": 1}},
		{"the index's size is refused for a 32 worker", []step{
			{"b32", 16, []uint64{91}, ErrBlockSizeMismatch},
		}, []uint64{91}, map[WorkerID]int{}},
		{"32 is refused for a default worker", []step{
			{"a16", 32, []uint64{1}, ErrBlockSizeMismatch},
		}, []uint64{1}, map[WorkerID]int{}},
		{"a worker added with the index's size", []step{
			{"d16", 16, []uint64{1}, nil},
			{"d16", 32, []uint64{2}, ErrBlockSizeMismatch},
		}, []uint64{1, 2}, map[WorkerID]int{"d16": 1}},
		{"unstated size is accepted", []step{
			{"b32", 0, []uint64{91}, nil},
			{"a16", 0, []uint64{1}, nil},
		}, []uint64{91}, map[WorkerID]int{"b32": 1}},
		{"16-token lookup misses 32-token blocks", []step{
			{"a16", 16, []uint64{1, 2}, nil},
			{"b32", 32, []uint64{91}, nil},
		}, []uint64{1, 2}, map[WorkerID]int{"a16": 2}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ix := NewIndex(16)
			ix.AddWorker("a16")
			ix.AddWorkerBlockSize("b32", 32)
			ix.AddWorkerBlockSize("c32", 32)
			ix.AddWorkerBlockSize("d16", 16)
			for i, s := range tc.steps {
				err := ix.Apply(s.worker, KVEvent{Kind: EventStored, Blocks: chain(s.hashes...), BlockSize: s.size})
				if (s.err == nil) != (err == nil) || (err != nil && !errors.Is(err, s.err)) {
					t.Fatalf("step %d: err = %v, want %v", i, err, s.err)
				}
				var bse *BlockSizeError
				if errors.As(err, &bse) {
					if want, _ := ix.WorkerBlockSize(s.worker); bse.Got != s.size || bse.Want != want {
						t.Fatalf("step %d: %+v, worker's size %d", i, bse, want)
					}
				}
			}
			if got := overlapOf(ix, tc.query); !maps.Equal(got, tc.want) {
				t.Fatalf("overlaps %v, want %v", got, tc.want)
			}
		})
	}

	ix := NewIndex(16)
	ix.AddWorkerBlockSize("b", 32)
	ix.AddWorker("b") // known: keeps its size
	for w, want := range map[WorkerID]int{"b": 32} {
		if got, ok := ix.WorkerBlockSize(w); !ok || got != want {
			t.Fatalf("%s block size %d %v, want %d", w, got, ok, want)
		}
	}
	if _, ok := ix.WorkerBlockSize("zz"); ok {
		t.Fatal("unknown worker has a block size")
	}
	if err := ix.Apply("b", KVEvent{Kind: EventStored, Blocks: chain(1), BlockSize: 32}); err != nil {
		t.Fatal(err)
	}
	ix.RemoveWorker("b")
	ix.AddWorker("e") // takes b's slot: neither its blocks nor its size
	if bs, _ := ix.WorkerBlockSize("e"); bs != 16 || ix.Held("e") != 0 {
		t.Fatalf("e: block size %d, held %d", bs, ix.Held("e"))
	}
	if err := ix.Apply("e", KVEvent{Kind: EventStored, Blocks: chain(1), BlockSize: 32}); !errors.Is(err, ErrBlockSizeMismatch) {
		t.Fatalf("32-token event on e: %v", err)
	}
	if s := ix.Stats(); s.SizeMismatches != 1 {
		t.Fatalf("stats %+v", s)
	}
}

// TestIndexApplyCapped: a stored event that would take the worker past its
// cap is refused whole with a typed error; blocks it already holds do not
// count; removals and clears always apply; 0 means no cap.
func TestIndexApplyCapped(t *testing.T) {
	stored := func(hs ...uint64) KVEvent { return KVEvent{Kind: EventStored, Blocks: chain(hs...)} }
	type step struct {
		ev      KVEvent
		cap     int
		refused bool
	}
	tests := []struct {
		name  string
		steps []step
		held  int
	}{
		{"up to the cap", []step{{stored(1, 2, 3), 4, false}, {stored(4), 4, false}}, 4},
		{"one past the cap, refused whole", []step{{stored(1, 2, 3), 4, false}, {stored(4, 5), 4, true}}, 3},
		{"held blocks add nothing", []step{{stored(1, 2, 3, 4), 4, false}, {stored(3, 4), 4, false}}, 4},
		{"new among held still refused", []step{{stored(1, 2, 3, 4), 4, false}, {stored(4, 5), 4, true}}, 4},
		{"removal makes room", []step{
			{stored(1, 2, 3, 4), 4, false},
			{KVEvent{Kind: EventRemoved, Removed: []uint64{1001, 1002}}, 4, false},
			{stored(5, 6), 4, false},
		}, 4},
		{"clear always applies", []step{{stored(1, 2), 2, false}, {KVEvent{Kind: EventCleared}, 2, false}, {stored(3, 4), 2, false}}, 2},
		{"no cap", []step{{stored(1, 2, 3, 4, 5), 0, false}}, 5},
		{"a lower cap after the fact refuses new blocks only", []step{
			{stored(1, 2, 3), 0, false}, {stored(2, 3), 1, false}, {stored(9), 1, true},
		}, 3},
		{"a block named twice counts twice", []step{{stored(1), 2, false}, {stored(2, 2), 2, true}}, 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ix := NewIndex(16)
			ix.AddWorker("a")
			for i, s := range tc.steps {
				err := ix.ApplyCapped("a", s.ev, s.cap)
				var ce *CapacityError
				if got := errors.As(err, &ce); got != s.refused || (err != nil && !s.refused) {
					t.Fatalf("step %d: err %v, want refused %v", i, err, s.refused)
				}
				if s.refused && (!errors.Is(err, ErrOverCapacity) || ce.Limit != s.cap) {
					t.Fatalf("step %d: %v", i, err)
				}
			}
			if got := ix.Held("a"); got != tc.held {
				t.Fatalf("held %d, want %d", got, tc.held)
			}
		})
	}
}
