package zmqbridge

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strings"

	"github.com/kvrouter/kvrouter/internal/msgpackread"
)

// EventKind is the type of one engine KV event.
type EventKind uint8

// Engine event kinds. KindUnknown is any other type tag (counted, ignored).
const (
	KindUnknown EventKind = iota
	KindBlockStored
	KindBlockRemoved
	KindAllBlocksCleared
)

func (k EventKind) String() string {
	switch k {
	case KindBlockStored:
		return "BlockStored"
	case KindBlockRemoved:
		return "BlockRemoved"
	case KindAllBlocksCleared:
		return "AllBlocksCleared"
	}
	return "unknown"
}

// MediumGPU is the medium of blocks in the engine's GPU prefix cache, the
// only tier the router indexes. A missing medium means GPU.
const MediumGPU = "GPU"

// Event is one engine KV event as vLLM and SGLang publish it, in either
// shape (tagged array or map tagged by "type"). Fields the bridge does not
// use are not kept.
type Event struct {
	Kind EventKind
	Tag  string // the type tag as sent

	BlockHashes []uint64 // engine block hashes, normalised to 64 bits (see DecodeHash)
	HasParent   bool
	Parent      uint64
	TokenIDs    []uint32
	BlockSize   int
	HasLoRAID   bool
	LoRAID      int64
	LoRAName    string
	Medium      string // "" when not sent (nil): GPU
	HasGroupIdx bool
	GroupIdx    int64
	// SpecKind is vLLM's kv_cache_spec_kind of the event's KV cache group
	// ("full_attention", "sliding_window", ...); "" when not sent.
	SpecKind         string
	HasSlidingWindow bool
	SlidingWindow    int64
	// HasExtraKeys: the event carried a non-nil extra_keys list. vLLM's
	// entries mix LoRA names, multimodal identifiers and cache salts and
	// are not interpreted; see Namespaced for SGLang's.
	HasExtraKeys bool
	// CacheSalt is SGLang's cache_salt (its metadata map at position 7, or
	// the map-shaped event's field); "" when not sent.
	CacheSalt string
	// Namespaced: SGLang said the blocks live in a cache namespace the
	// router's token hashes cannot name (a cache_salt, or a non-nil
	// extra_keys entry: salt and/or LoRA namespace).
	Namespaced bool
}

// Batch is one published message: [ts, events, dp_rank] or the map form
// {"ts", "events", "data_parallel_rank"}. Events that could not be decoded
// are left out and reported in Bad; the rest of the batch still counts.
type Batch struct {
	TS        float64
	Events    []Event
	HasDPRank bool
	DPRank    int64
	Bad       []EventError
}

// EventError is one event of a batch that could not be decoded.
type EventError struct {
	Index int
	Err   error
}

func (e EventError) Error() string { return fmt.Sprintf("event %d: %v", e.Index, e.Err) }

// ErrMalformed marks payloads and frames that do not follow the engines'
// wire format.
var ErrMalformed = errors.New("malformed")

// ErrUnknownLayout marks an array-shaped event that does not have the
// shape the worker's event schema says its engine sends (a field where the
// schema has none, or of another type): it is refused, never read by a
// guessed position.
var ErrUnknownLayout = errors.New("unknown event layout")

func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
}

// Limits on one decoded batch (beyond the payload's own size).
const (
	// MaxTokenID bounds token ids (u32, like the router's tokens).
	MaxTokenID = math.MaxUint32
	// MaxEventBlockSize bounds block_size.
	MaxEventBlockSize = 1 << 20
)

// DecodeBatch decodes one msgpack payload of the engines' KV event
// publisher. It accepts the batch as an array or a map and each event as a
// tagged array (older vLLM, SGLang) or a map tagged by "type" (newer vLLM);
// trailing fields that the sender omitted take their defaults and unknown
// fields are ignored. A batch that is not well formed is an error wrapping
// ErrMalformed; a single malformed event only lands in Batch.Bad.
//
// Array-shaped events are read by position with SchemaVLLM's table;
// DecodeBatchAs reads them with another engine's.
func DecodeBatch(payload []byte) (Batch, error) {
	return DecodeBatchAs(payload, SchemaVLLM)
}

// DecodeBatchAs is DecodeBatch with the positions of array-shaped events
// taken from schema (map-shaped events are read by name whatever the
// schema). An event that does not fit the schema lands in Batch.Bad with an
// error wrapping ErrUnknownLayout.
func DecodeBatchAs(payload []byte, schema Schema) (Batch, error) {
	lay, err := schema.layout()
	if err != nil {
		return Batch{}, err
	}
	r := newReader(payload)
	b, err := decodeBatch(r, lay)
	if err != nil {
		return Batch{}, fmt.Errorf("%w: batch: %v", ErrMalformed, err)
	}
	if r.Left() != 0 {
		return Batch{}, malformed("batch: %d trailing bytes", r.Left())
	}
	return b, nil
}

func decodeBatch(r *reader, lay *layout) (Batch, error) {
	var b Batch
	c, err := r.Peek()
	if err != nil {
		return b, err
	}
	if msgpackread.IsMap(c) {
		n, err := r.mapLen()
		if err != nil {
			return b, err
		}
		seenEvents := false
		for range n {
			key, err := r.str()
			if err != nil {
				return b, fmt.Errorf("key: %w", err)
			}
			switch string(key) {
			case "ts":
				b.TS, err = r.number()
			case "events":
				seenEvents = true
				err = decodeEvents(r, &b, lay)
			case "data_parallel_rank", "attn_dp_rank", "dp_rank":
				err = decodeRank(r, &b)
			default:
				err = r.Skip()
			}
			if err != nil {
				return b, fmt.Errorf("%s: %w", key, err)
			}
		}
		if !seenEvents {
			return b, errors.New("no events")
		}
		return b, nil
	}
	n, err := r.arrayLen()
	if err != nil {
		return b, err
	}
	if n < 2 {
		return b, fmt.Errorf("array of %d fields, want [ts, events, dp_rank]", n)
	}
	if b.TS, err = r.number(); err != nil {
		return b, fmt.Errorf("ts: %w", err)
	}
	if err := decodeEvents(r, &b, lay); err != nil {
		return b, fmt.Errorf("events: %w", err)
	}
	if n >= 3 {
		if err := decodeRank(r, &b); err != nil {
			return b, fmt.Errorf("dp_rank: %w", err)
		}
	}
	for i := 3; i < n; i++ {
		if err := r.Skip(); err != nil {
			return b, err
		}
	}
	return b, nil
}

func decodeRank(r *reader, b *Batch) error {
	if r.IsNil() {
		return nil
	}
	v, err := r.uint(math.MaxInt32)
	if err != nil {
		return err
	}
	b.HasDPRank, b.DPRank = true, int64(v)
	return nil
}

func decodeEvents(r *reader, b *Batch, lay *layout) error {
	n, err := r.arrayLen()
	if err != nil {
		return err
	}
	b.Events = make([]Event, 0, min(n, 1024))
	for i := range n {
		start := r.Offset()
		ev, err := decodeEvent(r, lay)
		if err != nil {
			// Skip exactly this event and go on with the next one.
			r.Seek(start)
			if serr := r.Skip(); serr != nil {
				return fmt.Errorf("event %d: %v", i, serr)
			}
			b.Bad = append(b.Bad, EventError{Index: i, Err: err})
			continue
		}
		b.Events = append(b.Events, ev)
	}
	return nil
}

func kindOf(tag string) EventKind {
	switch tag {
	case "BlockStored":
		return KindBlockStored
	case "BlockRemoved":
		return KindBlockRemoved
	case "AllBlocksCleared":
		return KindAllBlocksCleared
	}
	return KindUnknown
}

func decodeEvent(r *reader, lay *layout) (Event, error) {
	var ev Event
	c, err := r.Peek()
	if err != nil {
		return ev, err
	}
	seen := map[string]bool{}
	if msgpackread.IsMap(c) {
		n, err := r.mapLen()
		if err != nil {
			return ev, err
		}
		// The tag may come anywhere in the map: decode into a scratch
		// event and check the fields against the kind at the end.
		for range n {
			key, err := r.str()
			if err != nil {
				return ev, fmt.Errorf("key: %w", err)
			}
			k := string(key)
			if seen[k] {
				return ev, fmt.Errorf("duplicate key %q", k)
			}
			if k == "type" {
				tag, err := r.str()
				if err != nil {
					return ev, fmt.Errorf("type: %w", err)
				}
				ev.Tag = string(tag)
				seen[k] = true
				continue
			}
			if strings.HasPrefix(k, "\x00") {
				// Names only the array shape reaches (fieldSGLangExtraKeys).
				if err := r.Skip(); err != nil {
					return ev, err
				}
				continue
			}
			known, err := decodeField(r, k, &ev)
			if err != nil {
				return ev, fmt.Errorf("%s: %w", k, err)
			}
			if known {
				seen[k] = true
			}
		}
		if !seen["type"] {
			return ev, errors.New(`map event without "type"`)
		}
	} else {
		n, err := r.arrayLen()
		if err != nil {
			return ev, err
		}
		if n == 0 {
			return ev, errors.New("empty array event")
		}
		tag, err := r.str()
		if err != nil {
			return ev, fmt.Errorf("tag: %w", err)
		}
		ev.Tag = string(tag)
		var names []string
		switch kindOf(ev.Tag) {
		case KindBlockStored:
			names = lay.stored
		case KindBlockRemoved:
			names = lay.removed
		}
		for i := 1; i < n; i++ {
			if i-1 >= len(names) {
				if lay.strict && kindOf(ev.Tag) != KindUnknown {
					return ev, fmt.Errorf("%w: %s of %d fields under schema %s, which has %d",
						ErrUnknownLayout, ev.Tag, n, lay.schema, len(names)+1)
				}
				if err := r.Skip(); err != nil {
					return ev, err
				}
				continue
			}
			name := names[i-1]
			if _, err := decodeField(r, name, &ev); err != nil {
				if i >= firstVersionedPos {
					// Where engines and versions disagree: refuse, with
					// the schema named, rather than call it garbage.
					return ev, fmt.Errorf("%w: %s field %d read as %s under schema %s: %v",
						ErrUnknownLayout, ev.Tag, i, name, lay.schema, err)
				}
				return ev, fmt.Errorf("%s: %w", name, err)
			}
			seen[name] = true
		}
	}
	ev.Kind = kindOf(ev.Tag)
	switch ev.Kind {
	case KindBlockStored:
		if !seen["block_hashes"] || !seen["block_size"] {
			return ev, errors.New("BlockStored without block_hashes or block_size")
		}
	case KindBlockRemoved:
		if !seen["block_hashes"] {
			return ev, errors.New("BlockRemoved without block_hashes")
		}
	}
	return ev, nil
}

// decodeField decodes one named field into ev; unknown names are skipped
// (known false).
func decodeField(r *reader, name string, ev *Event) (known bool, err error) {
	switch name {
	case "block_hashes":
		ev.BlockHashes, err = decodeHashes(r)
	case "parent_block_hash":
		if r.IsNil() {
			ev.HasParent = false
			return true, nil
		}
		ev.Parent, err = DecodeHash(r)
		ev.HasParent = err == nil
	case "token_ids":
		ev.TokenIDs, err = decodeTokens(r)
	case "block_size":
		var v uint64
		v, err = r.uint(MaxEventBlockSize)
		ev.BlockSize = int(v)
	case "lora_id":
		if r.IsNil() {
			ev.HasLoRAID = false
			return true, nil
		}
		var v uint64
		var neg bool
		v, neg, err = r.integer()
		if err == nil && !neg && v > math.MaxInt64 {
			err = fmt.Errorf("lora_id %d out of range", v)
		}
		ev.HasLoRAID, ev.LoRAID = err == nil, int64(v)
	case "medium":
		ev.Medium, err = optString(r, 64)
	case "lora_name":
		ev.LoRAName, err = optString(r, 1024)
	case "group_idx":
		if r.IsNil() {
			ev.HasGroupIdx = false
			return true, nil
		}
		var v uint64
		v, err = r.uint(math.MaxInt32)
		ev.HasGroupIdx, ev.GroupIdx = err == nil, int64(v)
	case "kv_cache_spec_kind":
		ev.SpecKind, err = optString(r, 64)
	case "kv_cache_spec_sliding_window":
		if r.IsNil() {
			ev.HasSlidingWindow = false
			return true, nil
		}
		var v uint64
		v, err = r.uint(math.MaxInt32)
		ev.HasSlidingWindow, ev.SlidingWindow = err == nil, int64(v)
	case "extra_keys":
		ev.HasExtraKeys, _, err = decodeExtraKeys(r)
	case fieldSGLangExtraKeys:
		ev.HasExtraKeys, ev.Namespaced, err = decodeExtraKeys(r)
	case "cache_salt":
		ev.CacheSalt, err = optString(r, 1024)
		if ev.CacheSalt != "" {
			ev.Namespaced = true
		}
	case fieldSGLangMetadata:
		err = decodeSGLangMetadata(r, ev)
	default:
		return false, r.Skip()
	}
	return true, err
}

func optString(r *reader, max int) (string, error) {
	if r.IsNil() {
		return "", nil
	}
	s, err := r.str()
	if err != nil {
		return "", err
	}
	if len(s) > max {
		return "", fmt.Errorf("string of %d bytes (max %d)", len(s), max)
	}
	return string(s), nil
}

func decodeHashes(r *reader) ([]uint64, error) {
	n, err := r.arrayLen()
	if err != nil {
		return nil, err
	}
	out := make([]uint64, n)
	for i := range out {
		if out[i], err = DecodeHash(r); err != nil {
			return nil, fmt.Errorf("hash %d: %w", i, err)
		}
	}
	return out, nil
}

func decodeTokens(r *reader) ([]uint32, error) {
	n, err := r.arrayLen()
	if err != nil {
		return nil, err
	}
	out := make([]uint32, n)
	for i := range out {
		v, err := r.uint(MaxTokenID)
		if err != nil {
			return nil, fmt.Errorf("token %d: %w", i, err)
		}
		out[i] = uint32(v)
	}
	return out, nil
}

// MaxHashBytes bounds a raw block hash.
const MaxHashBytes = 64

// DecodeHash reads one engine block hash and normalises it to 64 bits, the
// way vLLM itself converts its hashes to integers: an unsigned integer as
// is, a signed one as its two's complement bits (SGLang's int64 hashes),
// raw bytes (vLLM's 32-byte SHA-256 block hashes) as their last 8 bytes
// read big-endian (shorter ones zero-extended).
func DecodeHash(r *reader) (uint64, error) {
	c, err := r.Peek()
	if err != nil {
		return 0, err
	}
	if msgpackread.IsBin(c) {
		p, err := r.bin()
		if err != nil {
			return 0, err
		}
		if len(p) == 0 || len(p) > MaxHashBytes {
			return 0, fmt.Errorf("hash of %d bytes", len(p))
		}
		return HashFromBytes(p), nil
	}
	v, _, err := r.integer()
	return v, err
}

// HashFromBytes is the 64-bit name of a raw hash: its last 8 bytes,
// big-endian (Python's int.from_bytes(h, "big") & (2**64 - 1)).
func HashFromBytes(p []byte) uint64 {
	if len(p) >= 8 {
		return binary.BigEndian.Uint64(p[len(p)-8:])
	}
	var b [8]byte
	copy(b[8-len(p):], p)
	return binary.BigEndian.Uint64(b[:])
}

// Frame is one published batch: its sequence number and msgpack payload.
type Frame struct {
	Topic   []byte
	Seq     uint64
	Payload []byte
}

// EndSeq is the sequence number vLLM puts on the end-of-replay marker
// ((-1).to_bytes(8, "big", signed=True)).
const EndSeq = math.MaxUint64

// ParseLive reads the frames of one PUB message: topic, 8-byte big-endian
// sequence number, payload.
func ParseLive(frames [][]byte) (Frame, error) {
	if len(frames) != 3 {
		return Frame{}, malformed("PUB message of %d frames, want 3 (topic, seq, payload)", len(frames))
	}
	if len(frames[1]) != 8 {
		return Frame{}, malformed("sequence frame of %d bytes, want 8", len(frames[1]))
	}
	return Frame{Topic: frames[0], Seq: binary.BigEndian.Uint64(frames[1]), Payload: frames[2]}, nil
}

// ParseReplay reads one reply of the engine's replay socket as a DEALER
// receives it: "", seq, payload (older vLLM, SGLang) or "", topic, seq,
// payload (newer vLLM). An empty last frame is the end of the replay.
func ParseReplay(frames [][]byte) (f Frame, end bool, err error) {
	if len(frames) > 0 && len(frames[0]) == 0 {
		frames = frames[1:] // the empty delimiter
	}
	if len(frames) > 0 && len(frames[len(frames)-1]) == 0 {
		return Frame{}, true, nil
	}
	switch len(frames) {
	case 2:
		f.Payload = frames[1]
	case 3:
		f.Topic, f.Payload = frames[0], frames[2]
		frames = frames[1:]
	default:
		return Frame{}, false, malformed("replay reply of %d frames", len(frames))
	}
	if len(frames[0]) != 8 {
		return Frame{}, false, malformed("replay sequence frame of %d bytes, want 8", len(frames[0]))
	}
	f.Seq = binary.BigEndian.Uint64(frames[0])
	if f.Seq == EndSeq {
		return Frame{}, true, nil
	}
	return f, false, nil
}
