package zmqbridge

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/kvrouter/kvrouter/internal/msgpackread"
)

// Schema names the positions of an engine's array-shaped KV events (msgspec
// array_like structs: fields in declaration order, trailing defaults left
// out). vLLM and SGLang share the first positions and disagree after them,
// so the bridge reads them by the schema the worker's config names, never
// by guessing from the values. Map-shaped events name their fields and are
// read the same under every schema.
type Schema string

// Event schemas.
const (
	// SchemaVLLM: vLLM's table, append-only across its releases (older
	// engines send shorter arrays): BlockStored block_hashes,
	// parent_block_hash, token_ids, block_size, lora_id, medium (#19737),
	// lora_name (#27577), extra_keys (#33304), group_idx (#37688),
	// kv_cache_spec_kind, kv_cache_spec_sliding_window (#40984);
	// BlockRemoved block_hashes, medium, group_idx. Later positions
	// (other producers' extensions) are skipped. vLLM ≥ #42892 sends maps.
	// The default: a worker whose config names no engine is read with it.
	SchemaVLLM Schema = "vllm"
	// SchemaSGLang: SGLang before 0.5.18: BlockStored block_hashes,
	// parent_block_hash, token_ids, block_size, lora_id, medium;
	// BlockRemoved block_hashes, medium. Anything after is refused.
	SchemaSGLang Schema = "sglang"
	// SchemaSGLangMetadata: SGLang ≥ 0.5.18 (sglang#30827): a salted
	// BlockStored carries a metadata map {"cache_salt", "session_id"} at
	// position 7.
	SchemaSGLangMetadata Schema = "sglang-metadata"
	// SchemaSGLangExtraKeys: SGLang with the unreleased extra_keys field at
	// position 7 (sglang#27735: one entry per block, the cache salt and/or
	// LoRA namespace on the first). No release number selects it; name it
	// with event_schema when running such a build.
	SchemaSGLangExtraKeys Schema = "sglang-extra-keys"
)

// Schemas lists every schema.
var Schemas = []Schema{SchemaVLLM, SchemaSGLang, SchemaSGLangMetadata, SchemaSGLangExtraKeys}

// firstVersionedPos is the first array position (the tag is 0) whose
// meaning depends on the engine and its version: lora_name in vLLM,
// metadata or extra_keys in SGLang. A value there that does not fit the
// schema is a layout error (ErrUnknownLayout), not a malformed event.
const firstVersionedPos = 7

// Field names that only the array shape reaches (a map's keys cannot start
// with NUL in practice, and map keys with that prefix are ignored).
const (
	fieldSGLangExtraKeys = "\x00sglang_extra_keys"
	fieldSGLangMetadata  = "metadata"
)

type layout struct {
	schema          Schema
	stored, removed []string
	// strict refuses positions past the table (SGLang, whose next field is
	// unknown); vLLM's later positions are other producers' appendices.
	strict bool
}

var (
	sglangStored = []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"}
	layouts      = map[Schema]*layout{
		SchemaVLLM: {schema: SchemaVLLM,
			stored: []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
				"lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"},
			removed: []string{"block_hashes", "medium", "group_idx"}},
		SchemaSGLang: {schema: SchemaSGLang, strict: true,
			stored: sglangStored, removed: []string{"block_hashes", "medium"}},
		SchemaSGLangMetadata: {schema: SchemaSGLangMetadata, strict: true,
			stored:  append(append([]string(nil), sglangStored...), fieldSGLangMetadata),
			removed: []string{"block_hashes", "medium"}},
		SchemaSGLangExtraKeys: {schema: SchemaSGLangExtraKeys, strict: true,
			stored:  append(append([]string(nil), sglangStored...), fieldSGLangExtraKeys),
			removed: []string{"block_hashes", "medium"}},
	}
)

func (s Schema) layout() (*layout, error) {
	if s == "" {
		s = SchemaVLLM
	}
	l, ok := layouts[s]
	if !ok {
		return nil, fmt.Errorf("unknown event schema %q (known: %v)", string(s), Schemas)
	}
	return l, nil
}

// Engines the config can name.
const (
	EngineVLLM   = "vllm"
	EngineSGLang = "sglang"
)

// sglangMetadataSince is the first SGLang release whose salted BlockStored
// carries the metadata map at position 7 (sglang#30827, per the Dynamo
// router's decoder fix ai-dynamo/dynamo#14530).
var sglangMetadataSince = [3]int{0, 5, 18}

// SchemaFor picks the event schema of an engine and version, as a worker
// spec gives them: engine "" means today's default (SchemaVLLM); "vllm"
// needs no version (its table only grows); "sglang" without a version gets
// SchemaSGLang, which refuses whatever comes at position 7 instead of
// guessing; with one, the releases decide. explicit, when set, wins and
// must belong to the engine.
func SchemaFor(engine, version string, explicit Schema) (Schema, error) {
	if explicit != "" {
		if _, err := explicit.layout(); err != nil {
			return "", err
		}
		if engine != "" && !strings.HasPrefix(string(explicit), engine) {
			return "", fmt.Errorf("event_schema %q is not one of engine %q's", explicit, engine)
		}
		return explicit, nil
	}
	switch engine {
	case "":
		if version != "" {
			return "", errors.New("engine_version without engine")
		}
		return SchemaVLLM, nil
	case EngineVLLM:
		if version != "" {
			if _, err := parseVersion(version); err != nil {
				return "", err
			}
		}
		return SchemaVLLM, nil
	case EngineSGLang:
		if version == "" {
			return SchemaSGLang, nil
		}
		v, err := parseVersion(version)
		if err != nil {
			return "", err
		}
		if !v.less(sglangMetadataSince) {
			return SchemaSGLangMetadata, nil
		}
		return SchemaSGLang, nil
	}
	return "", fmt.Errorf("unknown engine %q (known: %s, %s)", engine, EngineVLLM, EngineSGLang)
}

// version is a release number major.minor.patch; pre marks a pre-release
// of it (rc, dev, a, b: PEP 440), which sorts before the release itself.
type version struct {
	n   [3]int
	pre bool
}

func (v version) less(rel [3]int) bool {
	for i := range v.n {
		if v.n[i] != rel[i] {
			return v.n[i] < rel[i]
		}
	}
	return v.pre
}

// parseVersion reads "0.5.18", "v0.5.18", "0.5.18.post1", "0.5.19rc0",
// "0.5.19.dev12+gabc": up to three numbers, then a suffix. A post-release
// is the release; rc, dev, a and b are before it.
func parseVersion(s string) (version, error) {
	var v version
	rest := strings.TrimPrefix(strings.TrimSpace(s), "v")
	for i := range v.n {
		j := 0
		for j < len(rest) && rest[j] >= '0' && rest[j] <= '9' {
			j++
		}
		if j == 0 || j > 6 {
			if i == 0 {
				return version{}, fmt.Errorf("engine_version %q: want a release number like 0.5.18", s)
			}
			break
		}
		v.n[i], _ = strconv.Atoi(rest[:j])
		rest = rest[j:]
		if i < 2 && strings.HasPrefix(rest, ".") && len(rest) > 1 && rest[1] >= '0' && rest[1] <= '9' {
			rest = rest[1:]
			continue
		}
		break
	}
	rest = strings.TrimPrefix(strings.TrimPrefix(rest, "."), "-")
	for _, p := range []string{"rc", "dev", "a", "b", "alpha", "beta", "pre"} {
		if strings.HasPrefix(rest, p) {
			v.pre = true
		}
	}
	return v, nil
}

// decodeExtraKeys reads extra_keys: nil, or one entry per block, each nil
// or an array (vLLM's tuple of hash inputs; SGLang's namespace tuple).
// present: the list was sent; namespaced: some entry was not nil.
func decodeExtraKeys(r *reader) (present, namespaced bool, err error) {
	if r.IsNil() {
		return false, false, nil
	}
	n, err := r.arrayLen()
	if err != nil {
		return false, false, err
	}
	for i := range n {
		if r.IsNil() {
			continue
		}
		c, err := r.Peek()
		if err != nil {
			return false, false, err
		}
		if !msgpackread.IsArray(c) {
			return false, false, fmt.Errorf("extra_keys entry %d is not an array or nil", i)
		}
		if err := r.Skip(); err != nil {
			return false, false, err
		}
		namespaced = true
	}
	return true, namespaced, nil
}

// decodeSGLangMetadata reads SGLang's BlockStoredMetadata map: cache_salt
// (required by SGLang, a string), session_id and later keys ignored.
func decodeSGLangMetadata(r *reader, ev *Event) error {
	if r.IsNil() {
		return nil
	}
	n, err := r.mapLen()
	if err != nil {
		return err
	}
	for range n {
		key, err := r.str()
		if err != nil {
			return fmt.Errorf("metadata key: %w", err)
		}
		if string(key) != "cache_salt" {
			if err := r.Skip(); err != nil {
				return err
			}
			continue
		}
		if ev.CacheSalt, err = optString(r, 1024); err != nil {
			return fmt.Errorf("metadata cache_salt: %w", err)
		}
	}
	if ev.CacheSalt != "" {
		ev.Namespaced = true
	}
	return nil
}
