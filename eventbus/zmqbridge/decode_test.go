package zmqbridge

import (
	"bytes"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"testing"

	"github.com/kvrouter/kvrouter/router"
)

var update = flag.Bool("update", false, "rewrite testdata/*.msgpack from the hand-built structures")

const childHash uint64 = 0x1122334455667788

// sglangHash is a negative int64 hash as SGLang publishes them
// (hash_str_to_int64); its 64-bit name is its two's complement bits.
var sglangHash int64 = -1234567890123456789

// goldenFixtures are the committed payloads: every shape, every hash
// encoding, the batch as array and as map.
func goldenFixtures(t testing.TB) map[string][]byte {
	child := tokens(1000, 1)
	return map[string][]byte{
		// Older vLLM: tagged arrays, uint64 hashes, [ts, events, dp_rank].
		"vllm_array_uint64": mp(t, batchArr(1752000000.25, []any{
			storedArr(u64s(exampleHash), nil, exampleTokens, nil, "GPU", nil),
			storedArr(u64s(childHash), exampleHash, child, nil, "GPU", nil),
			removedArr(u64s(childHash), "GPU"),
			[]any{"AllBlocksCleared"},
		}, 0)),
		// Oldest vLLM: no medium, no lora_name, no dp rank (trailing
		// defaults left out).
		"vllm_array_legacy": mp(t, []any{1752000000.5, []any{
			[]any{"BlockStored", u64s(exampleHash), nil, exampleTokens, 16, nil},
			[]any{"BlockRemoved", u64s(exampleHash)},
			[]any{"AllBlocksCleared"},
		}}),
		// SGLang: tagged arrays, signed int64 hashes, [ts, events,
		// attn_dp_rank]; one event on the CPU tier.
		"sglang_array_int64": mp(t, batchArr(1752000001, []any{
			[]any{"BlockStored", []any{int64Code(int64(exampleHash))}, nil, exampleTokens, 16, nil, "GPU"},
			[]any{"BlockStored", []any{sglangHash}, int64Code(int64(exampleHash)), child, 16, nil, "GPU"},
			[]any{"BlockRemoved", []any{sglangHash}, "CPU_PINNED"},
		}, 0)),
		// vLLM >= 0.26: events are maps tagged by "type", 32-byte hashes,
		// a LoRA block with typed extra keys, an unknown event type.
		"vllm_map_bytes32": mp(t, batchArr(1752000002.75, []any{
			storedMap([]any{hash32(exampleHash, 0xab)}, nil, exampleTokens, "GPU"),
			storedMap([]any{hash32(childHash, 0xcd)}, hash32(exampleHash, 0xab), child, "GPU",
				kv{"lora_id", 3}, kv{"lora_name", "sql-adapter"},
				kv{"extra_keys", []any{[]any{omap{{"type", "lora"}, {"name", "sql-adapter"}}}}},
				kv{"group_idx", 0}, kv{"kv_cache_spec_kind", "full_attention"}),
			removedMap([]any{hash32(childHash, 0xcd)}, "GPU"),
			omap{{"type", "AllBlocksCleared"}},
			omap{{"type", "BlockPinned"}, {"block_hashes", u64s(1)}},
		}, 2)),
		// The batch as a map.
		"vllm_map_batch": mp(t, omap{{"ts", 1752000003.0}, {"events", []any{
			storedMap(u64s(exampleHash), nil, exampleTokens, nil),
		}}, {"data_parallel_rank", 1}}),
	}
}

func TestBridgeGoldenFixtures(t *testing.T) {
	fx := goldenFixtures(t)
	names := make([]string, 0, len(fx))
	for n := range fx {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, name := range names {
		path := filepath.Join("testdata", name+".msgpack")
		if *update {
			if err := os.WriteFile(path, fx[name], 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		got, err := os.ReadFile(path)
		if err != nil {
			t.Fatalf("%v (run go test -run TestBridgeGoldenFixtures -update)", err)
		}
		if !bytes.Equal(got, fx[name]) {
			t.Errorf("%s: committed bytes differ from the fixture structures (run with -update after checking why)", name)
		}
	}

	load := func(name string) Batch {
		t.Helper()
		data, err := os.ReadFile(filepath.Join("testdata", name+".msgpack"))
		if err != nil {
			t.Fatal(err)
		}
		b, err := DecodeBatch(data)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if len(b.Bad) != 0 {
			t.Fatalf("%s: bad events %v", name, b.Bad)
		}
		return b
	}
	kinds := func(b Batch) []EventKind {
		var out []EventKind
		for _, e := range b.Events {
			out = append(out, e.Kind)
		}
		return out
	}
	S, R, C, U := KindBlockStored, KindBlockRemoved, KindAllBlocksCleared, KindUnknown

	b := load("vllm_array_uint64")
	if !reflect.DeepEqual(kinds(b), []EventKind{S, S, R, C}) || b.TS != 1752000000.25 || !b.HasDPRank || b.DPRank != 0 {
		t.Fatalf("vllm_array_uint64: %+v", b)
	}
	e := b.Events[0]
	if !reflect.DeepEqual(e.BlockHashes, []uint64{exampleHash}) || e.HasParent || !reflect.DeepEqual(e.TokenIDs, exampleTokens) ||
		e.BlockSize != 16 || e.HasLoRAID || e.Medium != "GPU" || e.LoRAName != "" {
		t.Fatalf("vllm_array_uint64 stored: %+v", e)
	}
	if e := b.Events[1]; !e.HasParent || e.Parent != exampleHash || e.BlockHashes[0] != childHash {
		t.Fatalf("child: %+v", e)
	}
	if e := b.Events[2]; !reflect.DeepEqual(e.BlockHashes, []uint64{childHash}) || e.Medium != "GPU" {
		t.Fatalf("removed: %+v", e)
	}

	b = load("vllm_array_legacy")
	if !reflect.DeepEqual(kinds(b), []EventKind{S, R, C}) || b.HasDPRank || b.Events[0].Medium != "" || b.Events[1].Medium != "" {
		t.Fatalf("vllm_array_legacy: %+v", b)
	}

	b = load("sglang_array_int64")
	if !reflect.DeepEqual(kinds(b), []EventKind{S, S, R}) {
		t.Fatalf("sglang: %+v", b)
	}
	if b.Events[0].BlockHashes[0] != exampleHash || b.Events[1].BlockHashes[0] != uint64(int64(sglangHash)) ||
		b.Events[1].Parent != exampleHash || b.Events[2].Medium != "CPU_PINNED" {
		t.Fatalf("sglang hashes: %+v", b.Events)
	}

	b = load("vllm_map_bytes32")
	if !reflect.DeepEqual(kinds(b), []EventKind{S, S, R, C, U}) || b.DPRank != 2 {
		t.Fatalf("vllm_map_bytes32: %+v", b)
	}
	if b.Events[0].BlockHashes[0] != exampleHash || b.Events[1].Parent != exampleHash || b.Events[1].BlockHashes[0] != childHash {
		t.Fatalf("32-byte hashes: %+v", b.Events[:2])
	}
	if e := b.Events[1]; !e.HasLoRAID || e.LoRAID != 3 || e.LoRAName != "sql-adapter" || !e.HasGroupIdx || e.GroupIdx != 0 {
		t.Fatalf("lora event: %+v", e)
	}
	if b.Events[4].Tag != "BlockPinned" {
		t.Fatalf("unknown: %+v", b.Events[4])
	}

	b = load("vllm_map_batch")
	if !reflect.DeepEqual(kinds(b), []EventKind{S}) || b.DPRank != 1 || b.TS != 1752000003 || b.Events[0].Medium != "" {
		t.Fatalf("map batch: %+v", b)
	}

	// The worked example converts to the same blocks whatever the hash
	// encoding: engine hash 3769069598958365908, content hash
	// 7652252100776996844.
	if got := router.SequenceHashes(exampleTokens, 16, ""); len(got) != 1 || got[0] != exampleContent {
		t.Fatalf("content hash of the example = %v", got)
	}
	for _, name := range []string{"vllm_array_uint64", "sglang_array_int64", "vllm_map_bytes32", "vllm_map_batch", "vllm_array_legacy"} {
		b := load(name)
		c := NewConverter(16, 0)
		out, err := c.Convert(&b.Events[0], nil)
		if err != nil || len(out) != 1 || out[0].Kind != router.EventStored ||
			!reflect.DeepEqual(out[0].Blocks, []router.StoredBlock{{EngineHash: exampleHash, ContentHash: exampleContent}}) {
			t.Fatalf("%s: converted %+v, %v", name, out, err)
		}
	}
}

func TestBridgeDecodeErrors(t *testing.T) {
	good := mp(t, batchArr(1, []any{storedArr(u64s(1), nil, tokens(0, 1), nil, nil, nil)}, 0))
	cases := map[string][]byte{
		"empty":          nil,
		"not a batch":    mp(t, "hello"),
		"short array":    mp(t, []any{1.0}),
		"events not arr": mp(t, []any{1.0, "x", 0}),
		"ts not number":  mp(t, []any{"x", []any{}, 0}),
		"negative rank":  mp(t, []any{1.0, []any{}, -1}),
		"map no events":  mp(t, omap{{"ts", 1.0}}),
		"trailing":       append(append([]byte{}, good...), 0xc0),
		"truncated":      good[:len(good)-3],
		"huge array":     {0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff},
		"bad code":       {0xc1},
	}
	for name, data := range cases {
		if _, err := DecodeBatch(data); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: err %v, want ErrMalformed", name, err)
		}
	}
	// Bad events are skipped one by one; the rest of the batch stays.
	data := mp(t, batchArr(1, []any{
		[]any{"BlockStored", u64s(1), nil, []any{[]any{1, 2}}, 16, nil}, // bigram token pairs
		[]any{"BlockStored", u64s(1), nil, []any{-5}, 16},               // negative token
		[]any{"BlockStored", u64s(1)},                                   // no block_size
		[]any{"BlockRemoved"},                                           // no hashes
		[]any{"BlockRemoved", []any{"x"}},                               // string hash
		[]any{"BlockRemoved", []any{make([]byte, 65)}},                  // oversized hash
		[]any{},                         // no tag
		[]any{7},                        // tag not a string
		omap{{"block_hashes", u64s(1)}}, // map without type
		omap{{"type", "BlockRemoved"}, {"block_hashes", u64s(1)}, {"block_hashes", u64s(2)}}, // duplicate key
		omap{{"type", "BlockStored"}, {"block_hashes", u64s(1)}, {"block_size", 16}, {"medium", 5}},
		"AllBlocksCleared", // not an event
		removedArr(u64s(9), nil),
		storedArr(u64s(8), nil, tokens(0, 1), nil, nil, nil),
	}, 0))
	b, err := DecodeBatch(data)
	if err != nil {
		t.Fatal(err)
	}
	if len(b.Bad) != 12 || len(b.Events) != 2 || b.Events[0].BlockHashes[0] != 9 || b.Events[1].BlockHashes[0] != 8 {
		t.Fatalf("bad %d events %d: %+v", len(b.Bad), len(b.Events), b)
	}
	// Unknown fields anywhere are skipped, ext types included.
	data = mp(t, omap{{"ts", 1.0}, {"future", omap{{"a", []any{1, "b", nil, true, 2.5}}}},
		{"events", []any{storedMap(u64s(5), nil, tokens(0, 1), "GPU", kv{"new_field", []byte{1, 2}})}},
		{"data_parallel_rank", nil}})
	b, err = DecodeBatch(data)
	if err != nil || len(b.Events) != 1 || b.HasDPRank || b.Events[0].BlockHashes[0] != 5 {
		t.Fatalf("unknown fields: %+v %v", b, err)
	}
	// Deep nesting is skipped without recursion.
	deep := append([]byte{0x92, 0x01, 0x91, 0x82, 0xa1, 'x'}, bytes.Repeat([]byte{0x91}, 1<<20)...)
	deep = append(deep, 0xc0, 0xa4, 't', 'y', 'p', 'e', 0xa1, 'Z')
	if b, err := DecodeBatch(deep); err != nil || len(b.Events) != 1 || b.Events[0].Kind != KindUnknown {
		t.Fatalf("deep nesting: %v", err)
	}
}

func TestBridgeHashEncodings(t *testing.T) {
	for name, v := range map[string]any{
		"fixint":  uint64(5),
		"uint64":  exampleHash,
		"int64":   int64Code(int64(exampleHash)),
		"neg":     int64(-2),
		"bytes32": hash32(exampleHash, 0xff),
		"bytes8":  hash32(exampleHash, 0)[24:],
		"bytes3":  []byte{1, 2, 3},
	} {
		r := newReader(mp(t, v))
		got, err := DecodeHash(r)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		want := map[string]uint64{"fixint": 5, "uint64": exampleHash, "int64": exampleHash, "neg": ^uint64(1),
			"bytes32": exampleHash, "bytes8": exampleHash, "bytes3": 0x010203}[name]
		if got != want {
			t.Errorf("%s: %d, want %d", name, got, want)
		}
	}
}

func TestBridgeFrames(t *testing.T) {
	seq := []byte{0, 0, 0, 0, 0, 0, 0, 7}
	f, err := ParseLive([][]byte{[]byte("kv"), seq, []byte("p")})
	if err != nil || f.Seq != 7 || string(f.Topic) != "kv" || string(f.Payload) != "p" {
		t.Fatalf("live: %+v %v", f, err)
	}
	for _, bad := range [][][]byte{{seq, []byte("p")}, {nil, seq[:4], []byte("p")}, {nil, seq, nil, nil}} {
		if _, err := ParseLive(bad); !errors.Is(err, ErrMalformed) {
			t.Errorf("live %q: %v", bad, err)
		}
	}
	end := []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
	for name, tc := range map[string]struct {
		frames [][]byte
		seq    uint64
		end    bool
	}{
		"old":     {[][]byte{{}, seq, []byte("p")}, 7, false},
		"new":     {[][]byte{{}, []byte("kv"), seq, []byte("p")}, 7, false},
		"old end": {[][]byte{{}, end, {}}, 0, true},
		"new end": {[][]byte{{}, {}, end, {}}, 0, true},
	} {
		f, isEnd, err := ParseReplay(tc.frames)
		if err != nil || isEnd != tc.end || (!isEnd && (f.Seq != tc.seq || string(f.Payload) != "p")) {
			t.Errorf("%s: %+v end=%v %v", name, f, isEnd, err)
		}
	}
	if _, _, err := ParseReplay([][]byte{{}, seq[:3], []byte("p")}); !errors.Is(err, ErrMalformed) {
		t.Errorf("short seq: %v", err)
	}
}

// FuzzDecodeBatch: the decoder never panics, never allocates beyond the
// payload's size class, and what it accepts converts without panicking,
// under every event schema; the schemas agree on whether the batch itself
// decodes (they differ only in how array-shaped events are read).
// Corpus: testdata/fuzz/FuzzDecodeBatch, the golden fixtures, and every
// layout of TestBridgeSchemaLayouts.
func FuzzDecodeBatch(f *testing.F) {
	for _, data := range goldenFixtures(f) {
		f.Add(data)
	}
	for _, data := range schemaSeeds(f) {
		f.Add(data)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var batchErr error
		for i, schema := range Schemas {
			b, err := DecodeBatchAs(data, schema)
			if i == 0 {
				batchErr = err
			} else if (err == nil) != (batchErr == nil) {
				t.Fatalf("schema %s: batch error %v, schema %s: %v", schema, err, Schemas[0], batchErr)
			}
			if err != nil {
				if !errors.Is(err, ErrMalformed) {
					t.Fatalf("error does not wrap ErrMalformed: %v", err)
				}
				continue
			}
			if len(b.Events)+len(b.Bad) > len(data) {
				t.Fatalf("%d events from %d bytes", len(b.Events)+len(b.Bad), len(data))
			}
			c := NewConverter(16, 64)
			for i := range b.Events {
				if len(b.Events[i].BlockHashes) > len(data) || len(b.Events[i].TokenIDs) > len(data) {
					t.Fatalf("event larger than its payload")
				}
				_, _ = c.Convert(&b.Events[i], nil)
			}
			_ = c.Snapshot(7)
		}
	})
}
