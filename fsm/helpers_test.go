package fsm

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"testing"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/router"
)

var update = flag.Bool("update", false, "rewrite golden files and fuzz seed corpora in testdata/")

func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)) }

func ptr[T any](v T) *T { return &v }

// newFSM returns an FSM over Dynamo's defaults (block size 16).
func newFSM(t testing.TB) *FSM {
	t.Helper()
	f, err := NewFSM(router.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func mustEncode(t testing.TB, c Command) []byte {
	t.Helper()
	b, err := Encode(c)
	if err != nil {
		t.Fatalf("encode %T: %v", c, err)
	}
	return b
}

// harness feeds commands to an FSM with increasing log indexes.
type harness struct {
	t   testing.TB
	f   *FSM
	idx uint64
}

func newHarness(t testing.TB) *harness { return &harness{t: t, f: newFSM(t)} }

func (h *harness) next(data []byte) *raft.Log {
	h.idx++
	return &raft.Log{Index: h.idx, Term: 1, Type: raft.LogCommand, Data: data}
}

// raw applies data as the next log entry and returns the *ApplyResult.
func (h *harness) raw(data []byte) *ApplyResult {
	h.t.Helper()
	r, ok := h.f.Apply(h.next(data)).(*ApplyResult)
	if !ok {
		h.t.Fatalf("apply response is not an *ApplyResult")
	}
	return r
}

// apply applies c and returns its result.
func (h *harness) apply(c Command) *ApplyResult {
	h.t.Helper()
	return h.raw(mustEncode(h.t, c))
}

// ok applies c and fails the test on a domain error.
func (h *harness) ok(c Command) *ApplyResult {
	h.t.Helper()
	r := h.apply(c)
	if r.Err != nil {
		h.t.Fatalf("apply %T: %v", c, r.Err)
	}
	return r
}

func (h *harness) events(evs ...KVBatchEvent) *ApplyResult {
	h.t.Helper()
	return h.apply(KVEventBatch{Events: evs})
}

func stored(worker string, rank uint32, id uint64, hashes ...uint64) KVBatchEvent {
	bs := make([]router.StoredBlock, len(hashes))
	for i, x := range hashes {
		bs[i] = router.StoredBlock{EngineHash: x, ContentHash: x}
	}
	return KVBatchEvent{Worker: worker, DPRank: rank, EventID: id, Event: router.KVEvent{Kind: router.EventStored, Blocks: bs, BlockSize: 16}}
}

func storedAfter(worker string, rank uint32, id, parent uint64, hashes ...uint64) KVBatchEvent {
	e := stored(worker, rank, id, hashes...)
	e.Event.HasParent, e.Event.Parent = true, parent
	return e
}

func removed(worker string, rank uint32, id uint64, hashes ...uint64) KVBatchEvent {
	return KVBatchEvent{Worker: worker, DPRank: rank, EventID: id, Event: router.KVEvent{Kind: router.EventRemoved, Removed: hashes}}
}

// memSink is an in-memory raft.SnapshotSink.
type memSink struct {
	bytes.Buffer
	closed, cancelled bool
}

func (s *memSink) ID() string     { return "mem" }
func (s *memSink) Close() error   { s.closed = true; return nil }
func (s *memSink) Cancel() error  { s.cancelled = true; return nil }
func (s *memSink) String() string { return fmt.Sprintf("memSink(%d bytes)", s.Len()) }

func snapshotBytes(t testing.TB, f *FSM) []byte {
	t.Helper()
	snap, err := f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	defer snap.Release()
	var sink memSink
	if err := snap.Persist(&sink); err != nil {
		t.Fatal(err)
	}
	if !sink.closed || sink.cancelled {
		t.Fatalf("sink closed=%v cancelled=%v", sink.closed, sink.cancelled)
	}
	return sink.Bytes()
}

func restoreBytes(f *FSM, b []byte) error {
	return f.Restore(io.NopCloser(bytes.NewReader(b)))
}

// gen produces a random but reproducible stream of log entries exercising
// every command and most failure paths: duplicates, gaps, unknown workers,
// block size mismatches, missing parents, invalid configs, garbage bytes.
type gen struct {
	rng    *rand.Rand
	clock  int64
	ids    map[RankKey]uint64 // next event id per rank as the "workers" see it
	hashes []uint64
}

var genWorkers = []string{"w-a", "w-b", "w-c", "w-d", "w-e"}

func newGen(seed uint64) *gen {
	g := &gen{rng: newRand(seed), clock: 1_000_000_000, ids: make(map[RankKey]uint64)}
	for range 48 {
		g.hashes = append(g.hashes, g.rng.Uint64())
	}
	return g
}

func (g *gen) worker() string { return genWorkers[g.rng.IntN(len(genWorkers))] }
func (g *gen) hash() uint64   { return g.hashes[g.rng.IntN(len(g.hashes))] }

func (g *gen) eventID(k RankKey) uint64 {
	switch x := g.rng.IntN(20); {
	case x == 0:
		return 0 // unsequenced
	case x == 1 && g.ids[k] > 2:
		return g.ids[k] - 2 // a duplicate
	case x == 2:
		g.ids[k] += 3 // a gap
	}
	g.ids[k]++
	return g.ids[k]
}

func (g *gen) kvEvent() KVBatchEvent {
	k := RankKey{g.worker(), uint32(g.rng.IntN(3))}
	if g.rng.IntN(30) == 0 {
		k.Worker = "ghost" // never registered
	}
	e := KVBatchEvent{Worker: k.Worker, DPRank: k.DPRank, EventID: g.eventID(k)}
	switch x := g.rng.IntN(10); {
	case x < 6:
		n := 1 + g.rng.IntN(6)
		e.Event = router.KVEvent{Kind: router.EventStored, BlockSize: 16}
		for range n {
			ch := g.hash()
			eh := ch
			if g.rng.IntN(3) == 0 {
				eh = ch ^ 0xabcdef
			}
			e.Event.Blocks = append(e.Event.Blocks, router.StoredBlock{EngineHash: eh, ContentHash: ch})
		}
		if g.rng.IntN(3) == 0 {
			e.Event.HasParent, e.Event.Parent = true, g.hash()
		}
		if g.rng.IntN(25) == 0 {
			e.Event.BlockSize = 32
		}
		if g.rng.IntN(5) == 0 {
			e.Event.BlockSize = 0
		}
	case x < 9:
		e.Event = router.KVEvent{Kind: router.EventRemoved}
		for range 1 + g.rng.IntN(4) {
			h := g.hash()
			if g.rng.IntN(3) == 0 {
				h ^= 0xabcdef
			}
			e.Event.Removed = append(e.Event.Removed, h)
		}
	default:
		e.Event = router.KVEvent{Kind: router.EventCleared}
	}
	// A lower storage tier (host, disk, external) for some events of every
	// kind: tiered batches (command 12), tier indexes in snapshots (format 4).
	if g.rng.IntN(5) == 0 {
		e.Event.Tier = router.Tier(1 + g.rng.IntN(int(router.NumTiers)-1))
	}
	return e
}

// command returns the next entry's bytes.
func (g *gen) command(t testing.TB) []byte {
	r := g.rng
	var c Command
	switch x := r.IntN(100); {
	case x < 12:
		var lease int64
		if r.IntN(2) == 0 {
			lease = g.clock + int64(r.IntN(5_000_000_000))
		}
		c = RegisterWorker{ID: g.worker(), DPRanks: uint32(1 + r.IntN(3)), Address: "10.0.0.1:8000",
			Model: []string{"m1", "m2"}[r.IntN(2)], BlockSize: []int{0, 16, 16, 16, 32}[r.IntN(5)],
			TotalBlocks: 1000 + r.IntN(1000), MaxBatchedTokens: 8192, LeaseUntil: lease,
			OwnBlockSize: r.IntN(4) == 0} // m1 and m2 at 16 or 32, by their first worker
	case x < 15:
		c = DeregisterWorker{ID: g.worker()}
	case x < 55:
		var evs []KVBatchEvent
		for range 1 + r.IntN(12) {
			evs = append(evs, g.kvEvent())
		}
		c = KVEventBatch{Events: evs}
	case x < 62:
		u := SetModelConfig{Model: []string{"m1", "m2", "m3"}[r.IntN(3)]}
		if r.IntN(2) == 0 {
			u.Thresholds.ActiveDecodeBlocks = ptr(r.Float64() * 1.2) // sometimes > 1: invalid
		}
		if r.IntN(3) == 0 {
			u.Thresholds.ActivePrefillTokens = ptr(int64(r.IntN(10000)) - 100)
		}
		if r.IntN(3) == 0 {
			u.Temperature = ptr(r.Float64())
		}
		if r.IntN(4) == 0 {
			u.TrackPrefillTokens = ptr(r.IntN(2) == 0)
		}
		if r.IntN(4) == 0 {
			u.QueuePolicy = ptr([]router.QueuePolicy{"fcfs", "wspt", "bogus"}[r.IntN(3)])
		}
		if r.IntN(5) == 0 {
			u.Reset = ModelField(r.IntN(int(allModelFields) + 1))
		}
		c = u
	case x < 72:
		p := Predictions{Worker: router.WorkerKey(g.worker(), uint32(r.IntN(3))), Until: g.clock + int64(r.IntN(3_000_000_000))}
		for range 1 + r.IntN(8) {
			p.Hashes = append(p.Hashes, g.hash())
		}
		c = p
	case x < 82:
		g.clock += int64(r.IntN(1_500_000_000))
		now := g.clock
		if r.IntN(10) == 0 {
			now -= 2_000_000_000 // a leader with a slow clock
		}
		c = Tick{Now: now}
	case x < 86:
		id := fmt.Sprintf("n%d", r.IntN(3))
		c = RegisterNode{NodeID: id, RaftAddr: id + ":7000", HTTPAddr: fmt.Sprintf("%s:%d", id, 8000+r.IntN(3))}
	case x < 88:
		c = RemoveNode{NodeID: fmt.Sprintf("n%d", r.IntN(3))}
	case x < 93:
		k := RankKey{g.worker(), uint32(r.IntN(3))}
		c = ResyncWorker{Worker: k.Worker, DPRank: k.DPRank}
		g.ids[k] = uint64(r.IntN(100)) // the worker restarts its numbering anywhere
	case x < 94:
		w := router.WorkerKey(g.worker(), uint32(r.IntN(2)))
		if r.IntN(5) == 0 {
			c = UnpinPrefix{Model: "m1", Key: g.hash()}
			if r.IntN(2) == 0 {
				c = UnpinPrefix{Worker: g.worker()}
			}
			break
		}
		p := PinPrefix{Model: []string{"m1", "m2"}[r.IntN(2)], Worker: w, TTL: int64(1+r.IntN(60)) * 1_000_000_000,
			Until: g.clock + int64(r.IntN(4_000_000_000)) + 1}
		for range r.IntN(4) {
			p.Blocks = append(p.Blocks, g.hash())
		}
		p.Key = g.hash()
		if len(p.Blocks) > 0 {
			p.Key = p.Blocks[len(p.Blocks)-1]
			if r.IntN(3) == 0 {
				p.Replace = router.WorkerKey(g.worker(), 1)
				if p.Replace == p.Worker {
					p.Replace = ""
				}
			}
		}
		c = p
	case x < 95:
		sess := fmt.Sprintf("s%d", r.IntN(6))
		if r.IntN(4) == 0 {
			c = UnbindSessions{Session: sess}
			if r.IntN(2) == 0 {
				c = UnbindSessions{Worker: g.worker()}
			}
			break
		}
		c = BindSession{Session: sess, Worker: router.WorkerKey(g.worker(), uint32(r.IntN(2))),
			Until: g.clock + int64(r.IntN(4_000_000_000)) + 1, Replace: router.WorkerKey(g.worker(), 0)}
		if r.IntN(2) == 0 {
			// Two stages: a first turn, a touch, or a stage replaced.
			b := BindSessionStages{Session: sess, Prefill: router.WorkerKey(g.worker(), 1), Decode: router.WorkerKey(g.worker(), 0),
				Until: g.clock + int64(r.IntN(4_000_000_000)) + 1}
			if r.IntN(2) == 0 {
				b.SeenDecode = router.WorkerKey(g.worker(), 0)
				if r.IntN(2) == 0 {
					b.SeenPrefill = router.WorkerKey(g.worker(), 1)
				}
			}
			c = b
		}
	case x < 96:
		return []byte{byte(40+r.IntN(10)) | IgnoreIfUnknown, 1, 1, 2, 3}
	case x < 98:
		// A known type whose envelope version is unknown, with the ignore
		// bit (without it the FSM halts: TestFSMHaltsOnUnknownType).
		return []byte{byte(CmdTick) | IgnoreIfUnknown, 2, 1}
	default:
		b := mustEncode(t, KVEventBatch{Events: []KVBatchEvent{g.kvEvent()}})
		return b[:len(b)-1-r.IntN(len(b)-2)] // truncated: undecodable
	}
	return mustEncode(t, c)
}

// stream returns n entries.
func (g *gen) stream(t testing.TB, n int) [][]byte {
	out := make([][]byte, n)
	for i := range out {
		out[i] = g.command(t)
	}
	return out
}

func logsOf(entries [][]byte, first uint64) []*raft.Log {
	out := make([]*raft.Log, len(entries))
	for i, d := range entries {
		out[i] = &raft.Log{Index: first + uint64(i), Term: 1, Type: raft.LogCommand, Data: d}
	}
	return out
}

// olderBuildHalts plays entries on a build that knows command types up to
// newestType and snapshot formats up to newestFormat (0: this build's)
// and on this build. The first n entries must leave both at the same
// digest; entry n, of type want, must travel without the ignore bit and
// halt the older build at index n+1 with its state and applied index
// unmoved, every later entry answering ErrHalted; this build applies
// them all without error. It returns both FSMs for the caller's own
// checks of the new state and of the older build's snapshot refusal.
func olderBuildHalts(t *testing.T, entries [][]byte, n int, newestType CommandType, newestFormat byte, want CommandType) (older, newer *FSM) {
	t.Helper()
	if entries[n][0] != byte(want) {
		t.Fatalf("a %v travels as type %d without the ignore bit", want, entries[n][0])
	}
	older, newer = newFSM(t), newFSM(t)
	older.newestType, older.newestFormat = newestType, newestFormat
	older.ApplyBatch(logsOf(entries[:n], 1))
	newer.ApplyBatch(logsOf(entries[:n], 1))
	if older.Digest() != newer.Digest() {
		t.Fatalf("builds differ before the first %v", want)
	}
	before := older.Digest()
	out := older.ApplyBatch(logsOf(entries[n:], uint64(n+1)))
	var he *HaltError
	if !errors.As(ResponseError(out[0]), &he) || he.Type != want || he.Index != uint64(n+1) ||
		older.AppliedIndex() != uint64(n) || older.Digest() != before {
		t.Fatalf("older build: %v, applied %d", ResponseError(out[0]), older.AppliedIndex())
	}
	for i, r := range out[1:] {
		if !errors.Is(ResponseError(r), ErrHalted) {
			t.Fatalf("older build, entry %d after the halt: %v", n+2+i, ResponseError(r))
		}
	}
	for i, r := range newer.ApplyBatch(logsOf(entries[n:], uint64(n+1))) {
		if err := ResponseError(r); err != nil {
			t.Fatalf("newer build, entry %d: %v", n+1+i, err)
		}
	}
	if newer.Halted() != nil || newer.AppliedIndex() != uint64(len(entries)) {
		t.Fatalf("newer build: halted %v, applied %d of %d", newer.Halted(), newer.AppliedIndex(), len(entries))
	}
	return older, newer
}
