package zmqbridge

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/eventbus/internal/bustest"
	"github.com/kvrouter/kvrouter/router"
)

// The worked example of the issue: 16 tokens, block size 16, the engine's
// int hash, and our content hash of those tokens (kvrouter hash
// --block-size 16 ...).
var exampleTokens = []uint32{151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645, 198, 151644, 77091, 198, 151667}

const (
	exampleHash    uint64 = 3769069598958365908
	exampleContent uint64 = 7652252100776996844
)

// The msgpack fixtures are written with an independent encoder
// (vmihailenco/msgpack) from structures that follow the published vLLM and
// SGLang message definitions (msgspec structs: array_like ones encode as
// arrays with the class name as tag, the others as maps with a "type"
// key, both in field declaration order and without trailing defaults).

// omap is a map that keeps its key order (msgspec writes struct fields in
// declaration order).
type omap []kv

type kv struct {
	k string
	v any
}

func (m omap) EncodeMsgpack(enc *msgpack.Encoder) error {
	if err := enc.EncodeMapLen(len(m)); err != nil {
		return err
	}
	for _, e := range m {
		if err := enc.EncodeString(e.k); err != nil {
			return err
		}
		if err := enc.Encode(e.v); err != nil {
			return err
		}
	}
	return nil
}

// int64Code is an integer written as msgpack int64 (0xd3) whatever its
// value: how a signed 64-bit hash may arrive.
func int64Code(v int64) msgpack.RawMessage {
	b := make([]byte, 9)
	b[0] = 0xd3
	binary.BigEndian.PutUint64(b[1:], uint64(v))
	return b
}

// hash32 is a 32-byte raw hash (vLLM's SHA-256 block hash) whose last 8
// bytes are v, big-endian.
func hash32(v uint64, fill byte) []byte {
	b := bytes.Repeat([]byte{fill}, 32)
	binary.BigEndian.PutUint64(b[24:], v)
	return b
}

func mp(t testing.TB, v any) []byte {
	t.Helper()
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	if err := enc.Encode(v); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func u64s(v ...uint64) []any {
	out := make([]any, len(v))
	for i, x := range v {
		out[i] = x
	}
	return out
}

// tokens returns n blocks of 16 distinct tokens starting at base.
func tokens(base uint32, blocks int) []uint32 {
	out := make([]uint32, blocks*16)
	for i := range out {
		out[i] = base + uint32(i)
	}
	return out
}

// Engine event builders, old (array) and new (map) shapes.

func storedArr(hashes []any, parent any, toks []uint32, lora any, medium any, loraName any) []any {
	return []any{"BlockStored", hashes, parent, toks, 16, lora, medium, loraName}
}

func storedMap(hashes []any, parent any, toks []uint32, medium any, extra ...kv) omap {
	m := omap{{"type", "BlockStored"}, {"block_hashes", hashes}, {"parent_block_hash", parent}, {"token_ids", toks},
		{"block_size", 16}, {"lora_id", nil}, {"medium", medium}, {"lora_name", nil}}
	for _, e := range extra {
		replaced := false
		for i := range m {
			if m[i].k == e.k {
				m[i].v, replaced = e.v, true
			}
		}
		if !replaced {
			m = append(m, e)
		}
	}
	return m
}

func removedArr(hashes []any, medium any) []any { return []any{"BlockRemoved", hashes, medium} }

func removedMap(hashes []any, medium any) omap {
	return omap{{"type", "BlockRemoved"}, {"block_hashes", hashes}, {"medium", medium}}
}

func batchArr(ts float64, events []any, rank any) []any { return []any{ts, events, rank} }

// recordSink is a Sink that keeps every event and applies it to an index,
// as the cluster would.
type recordSink struct {
	mu     sync.Mutex
	events []router.KVEvent
	ix     *router.Index
	worker router.WorkerID
	errs   []error
}

func newRecordSink(blockSize int) *recordSink {
	ix := router.NewIndex(blockSize)
	ix.AddWorker("w")
	return &recordSink{ix: ix, worker: "w"}
}

func (s *recordSink) Emit(_ context.Context, evs []router.KVEvent) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ev := range evs {
		w := eventbus.FromKVEvent("w", 0, 1, ev)
		if err := eventbus.Validate(&w, 0); err != nil {
			return err
		}
		s.events = append(s.events, ev)
		if err := s.ix.Apply(s.worker, ev); err != nil {
			s.errs = append(s.errs, err)
		}
	}
	return nil
}

func (s *recordSink) kinds() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var b strings.Builder
	for _, ev := range s.events {
		switch ev.Kind {
		case router.EventStored:
			fmt.Fprintf(&b, "S%d ", len(ev.Blocks))
		case router.EventRemoved:
			fmt.Fprintf(&b, "R%d ", len(ev.Removed))
		case router.EventCleared:
			b.WriteString("C ")
		}
	}
	return strings.TrimSpace(b.String())
}

// contents is the set of content hashes the index holds for the worker.
func (s *recordSink) contents() map[uint64]bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[uint64]bool{}
	for _, b := range s.ix.WorkerBlocks(s.worker) {
		out[b.ContentHash] = true
	}
	return out
}

func (s *recordSink) indexErrors() []error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]error(nil), s.errs...)
}

// seqHashes is our content hashes of toks (chained from the start).
func seqHashes(toks []uint32, lora string) []uint64 {
	return router.SequenceHashes(toks, 16, lora)
}

// testLogger writes slog lines into t.Log (shown only on failure).
func testLogger(t testing.TB) *slog.Logger { return bustest.Logger(t) }
