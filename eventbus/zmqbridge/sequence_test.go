package zmqbridge

import (
	"context"
	"encoding/binary"
	"errors"
	"reflect"
	"sort"
	"testing"
)

// history is a fake replay socket: it answers like vLLM's, with every
// buffered batch whose sequence number is at least the one asked for.
type history struct {
	frames []Frame
	calls  []uint64
	fail   error
}

func (h *history) Replay(_ context.Context, from uint64, fn func(Frame) error) error {
	h.calls = append(h.calls, from)
	if h.fail != nil {
		return h.fail
	}
	for _, f := range h.frames {
		if f.Seq >= from {
			if err := fn(f); err != nil {
				return err
			}
		}
	}
	return nil
}

// engineSim builds the batches of a fake engine: batch i stores one root
// block named engine hash gen*1000+i with its own tokens, and may remove
// earlier ones. truth is what the engine's cache then holds.
type engineSim struct {
	t     *testing.T
	gen   uint64
	seq   uint64
	hist  *history
	truth map[uint64]uint64 // engine hash → content hash
}

func newEngineSim(t *testing.T, gen uint64, h *history) *engineSim {
	return &engineSim{t: t, gen: gen, hist: h, truth: map[uint64]uint64{}}
}

// next publishes the next batch (kept in the replay buffer) and returns
// its live frames.
func (e *engineSim) next(remove ...uint64) [][]byte {
	seq := e.seq
	e.seq++
	h := e.gen*1000 + seq
	toks := tokens(uint32(e.gen*100000+seq*16), 1)
	evs := []any{storedArr(u64s(h), nil, toks, nil, "GPU", nil)}
	e.truth[h] = seqHashes(toks, "")[0]
	if len(remove) > 0 {
		evs = append(evs, removedArr(u64s(remove...), "GPU"))
		for _, r := range remove {
			delete(e.truth, r)
		}
	}
	payload := mp(e.t, batchArr(float64(seq), evs, 0))
	e.hist.frames = append(e.hist.frames, Frame{Seq: seq, Payload: payload})
	var s [8]byte
	binary.BigEndian.PutUint64(s[:], seq)
	return [][]byte{{}, s[:], payload}
}

func (e *engineSim) contents() []uint64 {
	var out []uint64
	for _, c := range e.truth {
		out = append(out, c)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

func sortedKeys(m map[uint64]bool) []uint64 {
	var out []uint64
	for k := range m {
		out = append(out, k)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

func newTestStream(t *testing.T, rep Replayer) (*Stream, *recordSink) {
	sink := newRecordSink(16)
	cfg := StreamConfig{Worker: "w", BlockSize: 16, Sink: sink, Logger: testLogger(t)}
	if rep != nil {
		cfg.Replayer = rep
	}
	s := NewStream(cfg)
	if err := s.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	return s, sink
}

func feed(t *testing.T, s *Stream, frames ...[][]byte) {
	t.Helper()
	for _, f := range frames {
		if err := s.HandleLive(t.Context(), f); err != nil {
			t.Fatal(err)
		}
	}
}

func checkIndex(t *testing.T, sink *recordSink, want []uint64) {
	t.Helper()
	if got := sortedKeys(sink.contents()); !reflect.DeepEqual(got, want) && !(len(got) == 0 && len(want) == 0) {
		t.Fatalf("index holds %v, engine holds %v", got, want)
	}
	if errs := sink.indexErrors(); len(errs) > 0 {
		t.Fatalf("index errors: %v", errs)
	}
}

func TestBridgeSequenceInOrder(t *testing.T) {
	h := &history{}
	e := newEngineSim(t, 1, h)
	s, sink := newTestStream(t, h)
	feed(t, s, e.next(), e.next(), e.next(1000))
	checkIndex(t, sink, e.contents())
	if st := s.Stats(); st.Batches != 3 || st.Replays != 0 || st.LastSeq != 2 || !st.HaveSeq || st.Blocks != 2 {
		t.Fatalf("stats %+v", st)
	}
	if k := sink.kinds(); k != "C S1 S1 S1 R1" {
		t.Fatalf("events %s", k)
	}
}

func TestBridgeSequenceGapReplays(t *testing.T) {
	h := &history{}
	e := newEngineSim(t, 1, h)
	s, sink := newTestStream(t, h)
	b0, b1, b2, b3, b4 := e.next(), e.next(), e.next(1000), e.next(), e.next(1002)
	feed(t, s, b0, b1, b4) // b2, b3 lost on the way
	if !reflect.DeepEqual(h.calls, []uint64{1}) {
		t.Fatalf("replay requests %v, want [1] (from the last applied batch)", h.calls)
	}
	checkIndex(t, sink, e.contents())
	// The live copies of what the replay applied are skipped.
	feed(t, s, b3, b4)
	b5 := e.next()
	feed(t, s, b5)
	checkIndex(t, sink, e.contents())
	st := s.Stats()
	if st.Gaps != 1 || st.ReplayedBatches != 3 || st.Duplicates != 3 || st.Resyncs != 0 || st.Batches != 6 {
		t.Fatalf("stats %+v", st)
	}
	_ = b2
}

func TestBridgeSequenceBackwardsIsRestart(t *testing.T) {
	h := &history{}
	e := newEngineSim(t, 1, h)
	s, sink := newTestStream(t, h)
	feed(t, s, e.next(), e.next(), e.next())
	// The engine restarts: new sequence from 0, empty cache, new buffer.
	h.frames = nil
	e2 := newEngineSim(t, 2, h)
	n0, n1 := e2.next(), e2.next()
	feed(t, s, n1) // n0 was published before the bridge reconnected
	checkIndex(t, sink, e2.contents())
	if !reflect.DeepEqual(h.calls, []uint64{0}) {
		t.Fatalf("replay requests %v, want [0]", h.calls)
	}
	feed(t, s, e2.next())
	checkIndex(t, sink, e2.contents())
	if st := s.Stats(); st.Restarts != 1 || st.Resyncs != 1 || st.HistoryLost != 0 {
		t.Fatalf("stats %+v", st)
	}
	// A restart whose first batch we see is applied without a replay.
	h.frames = nil
	e3 := newEngineSim(t, 3, h)
	feed(t, s, e3.next())
	checkIndex(t, sink, e3.contents())
	if len(h.calls) != 1 {
		t.Fatalf("replay requests %v", h.calls)
	}
	_ = n0
}

func TestBridgeSequenceReplayMismatchResyncs(t *testing.T) {
	h := &history{}
	e := newEngineSim(t, 1, h)
	s, sink := newTestStream(t, h)
	feed(t, s, e.next(), e.next())
	var last [][]byte
	for range 4 {
		last = e.next(1000 + uint64(len(h.frames)) - 1)
	}
	// The engine's buffer has rolled past what the bridge applied.
	h.frames = h.frames[3:]
	feed(t, s, last)
	if !reflect.DeepEqual(h.calls, []uint64{1, 0}) {
		t.Fatalf("replay requests %v, want [1 0]", h.calls)
	}
	// The index holds a subset of the engine's blocks (those stored in
	// the buffered history), never a block it lacks.
	got := sink.contents()
	truth := map[uint64]bool{}
	for _, c := range e.contents() {
		truth[c] = true
	}
	for c := range got {
		if !truth[c] {
			t.Fatalf("index holds %d, which the engine does not", c)
		}
	}
	if len(got) != 1 || !got[e.truth[1005]] {
		t.Fatalf("index holds %v, want block 1005 (the only one stored by the buffered batches and still held)", got)
	}
	st := s.Stats()
	if st.ReplayMismatches != 1 || st.Resyncs != 1 || st.HistoryLost != 1 {
		t.Fatalf("stats %+v", st)
	}
	// And it goes on normally.
	feed(t, s, e.next())
	if st := s.Stats(); st.LastSeq != 6 || st.Resyncs != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestBridgeSequenceStartMidStream(t *testing.T) {
	h := &history{}
	e := newEngineSim(t, 1, h)
	for range 5 {
		e.next()
	}
	e.next(1001)
	live := e.next()
	s, sink := newTestStream(t, h)
	feed(t, s, live)
	checkIndex(t, sink, e.contents())
	if !reflect.DeepEqual(h.calls, []uint64{0}) || s.Stats().HistoryLost != 0 {
		t.Fatalf("calls %v stats %+v", h.calls, s.Stats())
	}
}

func TestBridgeSequenceReconnectVerifies(t *testing.T) {
	h := &history{}
	e := newEngineSim(t, 1, h)
	s, sink := newTestStream(t, h)
	feed(t, s, e.next(), e.next())
	// Same engine, connection blip: verified by replay, then applied.
	s.Disconnected()
	feed(t, s, e.next())
	checkIndex(t, sink, e.contents())
	if !reflect.DeepEqual(h.calls, []uint64{1}) || s.Stats().Resyncs != 0 {
		t.Fatalf("calls %v stats %+v", h.calls, s.Stats())
	}
	// The engine restarted while disconnected and has already published
	// more batches than before: the sequence number alone looks fine, the
	// replayed anchor does not.
	h.frames = nil
	e2 := newEngineSim(t, 2, h)
	var live [][]byte
	for range 4 {
		live = e2.next()
	}
	s.Disconnected()
	feed(t, s, live)
	checkIndex(t, sink, e2.contents())
	if st := s.Stats(); st.Resyncs != 1 || st.ReplayMismatches != 1 || st.Reconnects != 2 {
		t.Fatalf("stats %+v", st)
	}
}

func TestBridgeSequenceWithoutReplay(t *testing.T) {
	e := newEngineSim(t, 1, &history{})
	s, sink := newTestStream(t, nil)
	b0, b1, b2 := e.next(), e.next(), e.next()
	feed(t, s, b0, b2)
	// Cleared, then only what came after the gap.
	if got := sink.contents(); len(got) != 1 || !got[e.truth[1002]] {
		t.Fatalf("index %v", got)
	}
	if k := sink.kinds(); k != "C S1 C S1" {
		t.Fatalf("events %s", k)
	}
	_ = b1
}

func TestBridgeSequenceReplayFailure(t *testing.T) {
	h := &history{}
	e := newEngineSim(t, 1, h)
	s, sink := newTestStream(t, h)
	feed(t, s, e.next())
	e.next()
	h.fail = errors.New("timeout")
	live := e.next()
	feed(t, s, live)
	// Nothing replayable: cleared, then carried on from the live batch.
	if got := sink.contents(); len(got) != 1 || !got[e.truth[1002]] {
		t.Fatalf("index %v", got)
	}
	if st := s.Stats(); st.ReplayFailures != 2 || st.Resyncs != 1 || st.HistoryLost != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestBridgeSequenceMalformed(t *testing.T) {
	h := &history{}
	e := newEngineSim(t, 1, h)
	s, sink := newTestStream(t, h)
	feed(t, s, e.next())
	feed(t, s, [][]byte{{}, {1, 2}, {3}}, [][]byte{{1}}) // bad frames: no effect
	// A payload that does not decode still takes its sequence number.
	var seq [8]byte
	binary.BigEndian.PutUint64(seq[:], 1)
	e.seq++
	feed(t, s, [][]byte{{}, seq[:], {0xc1, 0xc1}})
	// One bad event in a batch: the others apply.
	payload := mp(t, batchArr(0, []any{
		[]any{"BlockStored", u64s(5), nil, []any{-1}, 16},
		storedArr(u64s(6), nil, tokens(9000, 1), nil, "GPU", nil),
		[]any{"BlockStored", u64s(7), nil, tokens(0, 1), 32, nil}, // wrong block size
		omap{{"type", "BlockEvicted"}},
	}, 3))
	binary.BigEndian.PutUint64(seq[:], 2)
	feed(t, s, [][]byte{{}, seq[:], payload})
	st := s.Stats()
	if st.MalformedFrames != 2 || st.MalformedBatches != 1 || st.MalformedEvents != 1 || st.Gaps != 0 ||
		st.DPRankMismatches != 1 || st.Converter.Skipped[SkipBlockSizeMismatch] != 1 || st.Converter.Skipped[SkipUnknownType] != 1 {
		t.Fatalf("stats %+v", st)
	}
	if got := sink.contents(); len(got) != 2 || !got[seqHashes(tokens(9000, 1), "")[0]] {
		t.Fatalf("index %v", got)
	}
}

func TestBridgeSequenceRepublish(t *testing.T) {
	h := &history{}
	e := newEngineSim(t, 1, h)
	s, sink := newTestStream(t, h)
	feed(t, s, e.next(), e.next(), e.next(1000))
	if err := s.Republish(t.Context()); err != nil {
		t.Fatal(err)
	}
	checkIndex(t, sink, e.contents())
	if k := sink.kinds(); k != "C S1 S1 S1 R1 C S2" {
		t.Fatalf("events %s", k)
	}
}

func TestBridgeSequenceCatchUpAndReconnect(t *testing.T) {
	h := &history{}
	e := newEngineSim(t, 1, h)
	b0, b1, b2 := e.next(), e.next(), e.next(1000)
	s, sink := newTestStream(t, h)
	// A running engine: its history is read before any live batch.
	if err := s.CatchUp(t.Context()); err != nil {
		t.Fatal(err)
	}
	checkIndex(t, sink, e.contents())
	// Live copies of the replayed batches are skipped.
	feed(t, s, b1, b2)
	if st := s.Stats(); st.Duplicates != 2 || st.Batches != 3 {
		t.Fatalf("stats %+v", st)
	}
	// Reconnect to the same engine, which published meanwhile: the
	// missed batches come from the replay at once.
	e.next()
	e.next(1001)
	if err := s.Reconnected(t.Context()); err != nil {
		t.Fatal(err)
	}
	checkIndex(t, sink, e.contents())
	if st := s.Stats(); st.Resyncs != 0 || st.Reconnects != 1 {
		t.Fatalf("stats %+v", st)
	}
	// Reconnect to a restarted engine that has published nothing yet:
	// its cache is empty, so is the index.
	h.frames = nil
	if err := s.Reconnected(t.Context()); err != nil {
		t.Fatal(err)
	}
	checkIndex(t, sink, nil)
	if st := s.Stats(); st.Restarts != 1 || st.Resyncs != 1 {
		t.Fatalf("stats %+v", st)
	}
	// Its first batch then applies normally.
	e2 := newEngineSim(t, 2, h)
	feed(t, s, e2.next())
	checkIndex(t, sink, e2.contents())
	// A fresh engine replays nothing: the stream waits for live batches.
	h2 := &history{}
	s2, sink2 := newTestStream(t, h2)
	if err := s2.CatchUp(t.Context()); err != nil {
		t.Fatal(err)
	}
	e3 := newEngineSim(t, 3, h2)
	feed(t, s2, e3.next())
	checkIndex(t, sink2, e3.contents())
	if len(h2.calls) != 1 {
		t.Fatalf("calls %v", h2.calls)
	}
	_ = b0
}
