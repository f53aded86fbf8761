package zmqbridge

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

// vllmStoredArr is vLLM's BlockStored as an array_like msgspec struct
// writes it, cut after its last field that is not a default (msgspec
// omits only trailing defaults): tag, block_hashes, parent_block_hash,
// token_ids, block_size, lora_id, medium, lora_name, extra_keys,
// group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window.
func vllmStoredArr(h uint64, fields ...any) []any {
	return append([]any{"BlockStored", u64s(h), nil, tokens(0, 1), 16}, fields...)
}

// sglangStoredArr is SGLang's BlockStored: tag, block_hashes,
// parent_block_hash, token_ids, block_size, lora_id, medium, then what the
// version puts at position 7 (a metadata map since 0.5.18; extra_keys in
// sglang#27735).
func sglangStoredArr(h int64, at7 ...any) []any {
	return append([]any{"BlockStored", []any{int64Code(h)}, nil, tokens(0, 1), 16, nil, "GPU"}, at7...)
}

// schemaSeeds are batches of every layout TestBridgeSchemaLayouts reads,
// for the fuzz corpus: vLLM arrays with group_idx and kinds, SGLang
// metadata and extra_keys at position 7, removals with a group.
func schemaSeeds(tb testing.TB) [][]byte {
	evs := [][]any{
		{vllmStoredArr(1, nil, "GPU", nil, nil, 1), vllmStoredArr(2, 3, "GPU", "sql", []any{[]any{"sql", "salt"}}, 0)},
		{vllmStoredArr(1, nil, "GPU", nil, []any{nil}, 2, "sliding_window", 1024), []any{"BlockRemoved", u64s(1), "GPU", 3}},
		{vllmStoredArr(1, nil, "GPU", nil, nil, 0, "full_attention", nil, 96)},
		{sglangStoredArr(-5), sglangStoredArr(-6, omap{{"cache_salt", "tenant-a"}, {"session_id", "s1"}})},
		{sglangStoredArr(-5, []any{[]any{"tenant-a"}, nil}), []any{"BlockRemoved", []any{int64Code(-5)}, "GPU"}},
		{sglangStoredArr(-5, "sql"), sglangStoredArr(-5, omap{{"cache_salt", "t"}}, 1)},
	}
	out := make([][]byte, len(evs))
	for i, e := range evs {
		out[i] = mp(tb, batchArr(1, []any{e[0]}, 0))
		if len(e) > 1 {
			out[i] = mp(tb, batchArr(1, []any{e[0], e[1]}, 0))
		}
	}
	return out
}

// TestBridgeSchemaLayouts decodes every array layout of both engines, by
// position, under each schema that should read it, and the near misses
// each schema must refuse (ErrUnknownLayout) rather than misread.
func TestBridgeSchemaLayouts(t *testing.T) {
	type want struct {
		layoutErr bool // refused as an unknown layout
		check     func(ev Event) bool
	}
	cases := []struct {
		name   string
		schema Schema
		ev     any
		want   want
	}{
		// vLLM, oldest to newest array shapes.
		{"vllm 5 fields", SchemaVLLM, vllmStoredArr(1, nil),
			want{check: func(ev Event) bool { return !ev.HasGroupIdx && ev.Medium == "" && ev.BlockSize == 16 }}},
		{"vllm lora_name", SchemaVLLM, vllmStoredArr(1, 3, "GPU", "sql"),
			want{check: func(ev Event) bool { return ev.LoRAName == "sql" && ev.LoRAID == 3 && !ev.HasExtraKeys }}},
		{"vllm group_idx, nil extra_keys", SchemaVLLM, vllmStoredArr(1, nil, "GPU", nil, nil, 1),
			want{check: func(ev Event) bool {
				return ev.HasGroupIdx && ev.GroupIdx == 1 && !ev.HasExtraKeys && ev.SpecKind == ""
			}}},
		{"vllm extra_keys and group 0", SchemaVLLM, vllmStoredArr(1, 3, "GPU", "sql", []any{[]any{"sql", "salt"}}, 0),
			want{check: func(ev Event) bool {
				return ev.HasGroupIdx && ev.GroupIdx == 0 && ev.HasExtraKeys && !ev.Namespaced && ev.LoRAName == "sql"
			}}},
		{"vllm kv_cache_spec_kind", SchemaVLLM, vllmStoredArr(1, nil, "GPU", nil, []any{nil}, 2, "sliding_window", 1024),
			want{check: func(ev Event) bool {
				return ev.GroupIdx == 2 && ev.SpecKind == "sliding_window" && ev.HasSlidingWindow && ev.SlidingWindow == 1024
			}}},
		{"vllm other producers' trailing fields", SchemaVLLM, vllmStoredArr(1, nil, "GPU", nil, nil, 0, "full_attention", nil, 96),
			want{check: func(ev Event) bool { return ev.SpecKind == "full_attention" && !ev.HasSlidingWindow }}},
		{"vllm removed with group_idx", SchemaVLLM, []any{"BlockRemoved", u64s(1), "GPU", 3},
			want{check: func(ev Event) bool { return ev.Kind == KindBlockRemoved && ev.HasGroupIdx && ev.GroupIdx == 3 }}},
		{"vllm map with group and kind", SchemaVLLM,
			storedMap(u64s(1), nil, tokens(0, 1), "GPU", kv{"group_idx", 1}, kv{"kv_cache_spec_kind", "full_attention"}),
			want{check: func(ev Event) bool { return ev.GroupIdx == 1 && ev.SpecKind == "full_attention" }}},
		{"vllm extra_keys entry not a tuple", SchemaVLLM, vllmStoredArr(1, nil, "GPU", nil, []any{"x"}, 0),
			want{layoutErr: true}},
		// SGLang shapes read as vLLM (no engine configured): refused, not
		// taken for a LoRA name.
		{"sglang metadata read as vllm", SchemaVLLM, sglangStoredArr(-5, omap{{"cache_salt", "tenant-a"}}),
			want{layoutErr: true}},
		{"sglang extra_keys read as vllm", SchemaVLLM, sglangStoredArr(-5, []any{[]any{"tenant-a"}}),
			want{layoutErr: true}},
		// SGLang before 0.5.18.
		{"sglang base", SchemaSGLang, sglangStoredArr(-5),
			want{check: func(ev Event) bool { return ev.BlockHashes[0] == uint64(1<<64-5) && ev.Medium == "GPU" }}},
		{"sglang base, something at 7", SchemaSGLang, sglangStoredArr(-5, omap{{"cache_salt", "t"}}),
			want{layoutErr: true}},
		{"sglang base removed, extra field", SchemaSGLang, []any{"BlockRemoved", u64s(1), "GPU", 3},
			want{layoutErr: true}},
		// SGLang ≥ 0.5.18: metadata at 7 on salted stores.
		{"sglang metadata", SchemaSGLangMetadata, sglangStoredArr(-5, omap{{"cache_salt", "tenant-a"}, {"session_id", "s1"}}),
			want{check: func(ev Event) bool { return ev.CacheSalt == "tenant-a" && ev.Namespaced && ev.LoRAName == "" }}},
		{"sglang metadata, unsalted", SchemaSGLangMetadata, sglangStoredArr(-5),
			want{check: func(ev Event) bool { return ev.CacheSalt == "" && !ev.Namespaced }}},
		{"sglang metadata, a list at 7", SchemaSGLangMetadata, sglangStoredArr(-5, []any{[]any{"t"}}),
			want{layoutErr: true}},
		{"sglang metadata, a string at 7", SchemaSGLangMetadata, sglangStoredArr(-5, "sql"),
			want{layoutErr: true}},
		{"sglang metadata, position 8", SchemaSGLangMetadata, sglangStoredArr(-5, omap{{"cache_salt", "t"}}, 1),
			want{layoutErr: true}},
		// SGLang with extra_keys at 7 (sglang#27735).
		{"sglang extra_keys salted", SchemaSGLangExtraKeys, sglangStoredArr(-5, []any{[]any{"tenant-a"}, nil}),
			want{check: func(ev Event) bool { return ev.HasExtraKeys && ev.Namespaced && ev.LoRAName == "" }}},
		{"sglang extra_keys none", SchemaSGLangExtraKeys, sglangStoredArr(-5, []any{nil}),
			want{check: func(ev Event) bool { return ev.HasExtraKeys && !ev.Namespaced }}},
		{"sglang extra_keys, a string at 7", SchemaSGLangExtraKeys, sglangStoredArr(-5, "sql"),
			want{layoutErr: true}},
		{"sglang extra_keys, a map at 7", SchemaSGLangExtraKeys, sglangStoredArr(-5, omap{{"cache_salt", "t"}}),
			want{layoutErr: true}},
		// SGLang's map-shaped events (sglang#37482) read by name anywhere.
		{"sglang map cache_salt", SchemaSGLang,
			omap{{"type", "BlockStored"}, {"block_hashes", u64s(1)}, {"parent_block_hash", nil}, {"token_ids", tokens(0, 1)},
				{"block_size", 16}, {"medium", "GPU"}, {"cache_salt", "tenant-a"}, {"session_id", "s"}},
			want{check: func(ev Event) bool { return ev.CacheSalt == "tenant-a" && ev.Namespaced }}},
		{"map key only arrays reach", SchemaVLLM,
			storedMap(u64s(1), nil, tokens(0, 1), "GPU", kv{fieldSGLangExtraKeys, []any{[]any{"x"}}}),
			want{check: func(ev Event) bool { return !ev.Namespaced && !ev.HasExtraKeys }}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b, err := DecodeBatchAs(mp(t, batchArr(1, []any{c.ev}, 0)), c.schema)
			if err != nil {
				t.Fatal(err)
			}
			if c.want.layoutErr {
				if len(b.Bad) != 1 || !errors.Is(b.Bad[0].Err, ErrUnknownLayout) || len(b.Events) != 0 {
					t.Fatalf("want a refused layout, got events %+v bad %v", b.Events, b.Bad)
				}
				if !strings.Contains(b.Bad[0].Error(), string(c.schema)) {
					t.Fatalf("refusal does not name the schema: %v", b.Bad[0])
				}
				return
			}
			if len(b.Bad) != 0 || len(b.Events) != 1 || !c.want.check(b.Events[0]) {
				t.Fatalf("events %+v bad %v", b.Events, b.Bad)
			}
		})
	}
	if _, err := DecodeBatchAs(mp(t, batchArr(1, nil, 0)), "tgi"); err == nil || errors.Is(err, ErrMalformed) {
		t.Fatalf("unknown schema: %v", err)
	}
}

func TestBridgeSchemaFor(t *testing.T) {
	cases := []struct {
		engine, version string
		explicit        Schema
		want            Schema // "" = error
	}{
		{"", "", "", SchemaVLLM},
		{"", "0.5.18", "", ""},
		{"vllm", "", "", SchemaVLLM},
		{"vllm", "0.11.0", "", SchemaVLLM},
		{"vllm", "latest", "", ""},
		{"sglang", "", "", SchemaSGLang},
		{"sglang", "0.5.9", "", SchemaSGLang},
		{"sglang", "0.5.17.post2", "", SchemaSGLang},
		{"sglang", "0.5.18rc1", "", SchemaSGLang},
		{"sglang", "0.5.18", "", SchemaSGLangMetadata},
		{"sglang", "v0.5.18.post1", "", SchemaSGLangMetadata},
		{"sglang", "0.5.19.dev12+gabc", "", SchemaSGLangMetadata},
		{"sglang", "0.6", "", SchemaSGLangMetadata},
		{"sglang", "1", "", SchemaSGLangMetadata},
		{"sglang", "0.4.99", "", SchemaSGLang},
		{"sglang", "0.5.18", SchemaSGLangExtraKeys, SchemaSGLangExtraKeys},
		{"", "", SchemaSGLangMetadata, SchemaSGLangMetadata},
		{"vllm", "", SchemaSGLang, ""},
		{"sglang", "", SchemaVLLM, ""},
		{"", "", "bogus", ""},
		{"tgi", "", "", ""},
	}
	for _, c := range cases {
		got, err := SchemaFor(c.engine, c.version, c.explicit)
		if got != c.want || (err != nil) != (c.want == "") {
			t.Errorf("SchemaFor(%q, %q, %q) = %q, %v; want %q", c.engine, c.version, c.explicit, got, err, c.want)
		}
	}
}

// TestBridgeConfigEngine: the worker spec's engine fields and
// kv_cache_group parse, normalise, are checked and survive a JSON round
// trip; absent, they keep the old behaviour (vLLM schema, group chosen
// from the events).
func TestBridgeConfigEngine(t *testing.T) {
	c, err := ParseConfig([]byte(`{"workers":[
		{"id":"a","url":"http://a","events":"tcp://a:1"},
		{"id":"b","url":"http://b","events":"tcp://b:1","engine":" SGLang ","engine_version":"0.5.18"},
		{"id":"c","url":"http://c","events":"tcp://c:1","engine":"vllm","kv_cache_group":3},
		{"id":"d","url":"http://d","events":"tcp://d:1","event_schema":"sglang-extra-keys","kv_cache_group":null}]}`))
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		schema Schema
		group  int
		set    bool
	}{{SchemaVLLM, 0, false}, {SchemaSGLangMetadata, 0, false}, {SchemaVLLM, 3, true}, {SchemaSGLangExtraKeys, 0, false}}
	for i, w := range c.Workers {
		s, err := w.Schema()
		g, set := w.KVCacheGroup.Get()
		if err != nil || s != want[i].schema || g != want[i].group || set != want[i].set {
			t.Errorf("worker %s: schema %q (%v), group %d set %v", w.ID, s, err, g, set)
		}
	}
	if c.Workers[1].Engine != "sglang" {
		t.Errorf("engine not normalised: %q", c.Workers[1].Engine)
	}
	enc, _ := json.Marshal(c)
	if strings.Contains(string(enc), `"kv_cache_group":null`) || !strings.Contains(string(enc), `"kv_cache_group":3`) {
		t.Errorf("re-encoded: %s", enc)
	}
	back, err := ParseConfig(enc)
	if err != nil || back.Workers[2] != c.Workers[2] || back.Workers[0] != c.Workers[0] {
		t.Fatalf("round trip: %+v %v", back, err)
	}
	for _, bad := range []string{
		`{"workers":[{"id":"a","url":"http://a","events":"tcp://a:1","engine":"tgi"}]}`,
		`{"workers":[{"id":"a","url":"http://a","events":"tcp://a:1","engine_version":"0.5.18"}]}`,
		`{"workers":[{"id":"a","url":"http://a","events":"tcp://a:1","engine":"sglang","engine_version":"new"}]}`,
		`{"workers":[{"id":"a","url":"http://a","events":"tcp://a:1","engine":"vllm","event_schema":"sglang"}]}`,
		`{"workers":[{"id":"a","url":"http://a","events":"tcp://a:1","kv_cache_group":-1}]}`,
		`{"workers":[{"id":"a","url":"http://a","events":"tcp://a:1","kv_cache_group":1.5}]}`,
		`{"workers":[{"id":"a","url":"http://a","events":"tcp://a:1","kv_cache_group":"0"}]}`,
	} {
		if _, err := ParseConfig([]byte(bad)); err == nil {
			t.Errorf("accepted %s", bad)
		}
	}
}
