package eventbus

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"unicode/utf8"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"

	"github.com/kvrouter/kvrouter/router"
)

// Event kinds on the wire. They are the router's numbers (router.EventKind):
// append only, never renumber.
const (
	KindStored  uint8 = uint8(router.EventStored)
	KindRemoved uint8 = uint8(router.EventRemoved)
	KindCleared uint8 = uint8(router.EventCleared)
)

// Limits that hold for every event regardless of configuration: they bound
// what Decode allocates for hostile input and what Validate accepts.
const (
	MaxWorkerNameLen = 256     // bytes
	MaxBlockSize     = 1 << 20 // tokens per block
	// DefaultMaxBlocks is the default per-event cap on stored or removed
	// blocks (Validate's maxBlocks when a caller passes 0).
	DefaultMaxBlocks = 4096
)

// WireEvent is one KV event as workers publish it into the KV_EVENTS stream,
// encoded with msgpack (see Encode). The short tags are the wire format:
// append only; Decode rejects keys it does not know.
//
// (Worker, DPRank, EventID) names the event; it is also the stream's
// deduplication id (MsgID) and the state machine's idempotence key. EventIDs
// of one (Worker, DPRank) increase by one per event, starting at 1.
type WireEvent struct {
	Worker    string      `msgpack:"w"`
	DPRank    uint32      `msgpack:"r,omitempty"`
	EventID   uint64      `msgpack:"i"`
	Kind      uint8       `msgpack:"k"`
	BlockSize int         `msgpack:"bs,omitempty"` // tokens per block; 0 = not reported
	HasParent bool        `msgpack:"hp,omitempty"`
	Parent    uint64      `msgpack:"p,omitempty"` // engine hash of the parent block (stored)
	Blocks    []WireBlock `msgpack:"b,omitempty"` // stored, in chain order
	Removed   []uint64    `msgpack:"x,omitempty"` // engine hashes (removed)
	// Tier is the storage tier (router.Tier): absent, 0, for the device
	// tier, so device events encode as before tiers and an event of a
	// publisher that knows no tiers means GPU. Consumers of builds before
	// tiers refuse an event with it as undecodable (unknown key): publish
	// lower tiers only once every consumer knows them.
	Tier uint8 `msgpack:"t,omitempty"`
}

// WireBlock is one stored block: the engine's opaque hash and our content
// (sequence) hash, see router.StoredBlock.
type WireBlock struct {
	Engine  uint64 `msgpack:"e"`
	Content uint64 `msgpack:"c"`
}

// WorkerID is the router's id of the event's worker (rank folded in).
func (ev *WireEvent) WorkerID() router.WorkerID { return router.WorkerKey(ev.Worker, ev.DPRank) }

// MsgID is the event's JetStream deduplication id.
func (ev *WireEvent) MsgID() string { return MsgID(ev.Worker, ev.DPRank, ev.EventID) }

// KVEvent converts the event into the router's form. It does not validate;
// call Validate first.
func (ev *WireEvent) KVEvent() router.KVEvent {
	kv := router.KVEvent{
		Kind:      router.EventKind(ev.Kind),
		HasParent: ev.HasParent,
		Parent:    ev.Parent,
		BlockSize: ev.BlockSize,
		Tier:      router.Tier(ev.Tier),
	}
	if len(ev.Blocks) > 0 {
		kv.Blocks = make([]router.StoredBlock, len(ev.Blocks))
		for i, b := range ev.Blocks {
			kv.Blocks[i] = router.StoredBlock{EngineHash: b.Engine, ContentHash: b.Content}
		}
	}
	if len(ev.Removed) > 0 {
		kv.Removed = append([]uint64(nil), ev.Removed...)
	}
	return kv
}

// FromKVEvent builds the wire form of a router event of one worker rank.
// eventID 0 lets the Publisher assign the next id.
func FromKVEvent(worker string, dpRank uint32, eventID uint64, kv router.KVEvent) WireEvent {
	ev := WireEvent{
		Worker:    worker,
		DPRank:    dpRank,
		EventID:   eventID,
		Kind:      uint8(kv.Kind),
		BlockSize: kv.BlockSize,
		HasParent: kv.HasParent,
		Parent:    kv.Parent,
		Tier:      uint8(kv.Tier),
	}
	if len(kv.Blocks) > 0 {
		ev.Blocks = make([]WireBlock, len(kv.Blocks))
		for i, b := range kv.Blocks {
			ev.Blocks[i] = WireBlock{Engine: b.EngineHash, Content: b.ContentHash}
		}
	}
	if len(kv.Removed) > 0 {
		ev.Removed = append([]uint64(nil), kv.Removed...)
	}
	return ev
}

// Encode returns the msgpack encoding of ev.
func Encode(ev *WireEvent) ([]byte, error) {
	var buf bytes.Buffer
	buf.Grow(48 + 20*len(ev.Blocks) + 9*len(ev.Removed))
	enc := msgpack.GetEncoder()
	defer msgpack.PutEncoder(enc)
	enc.Reset(&buf)
	enc.UseCompactInts(true)
	if err := enc.Encode(ev); err != nil {
		return nil, fmt.Errorf("encode event %s: %w", ev.MsgID(), err)
	}
	return buf.Bytes(), nil
}

// ErrUndecodable marks payloads that are not a well-formed WireEvent.
var ErrUndecodable = errors.New("undecodable event")

// Decode parses one event strictly: the payload must be exactly one msgpack
// map with known keys, each at most once, with values of the right type and
// range, and nothing after it. Declared lengths are checked against the bytes
// that remain before anything is allocated, so hostile input cannot make it
// allocate more than a small multiple of its own size. Semantic checks
// (kind, sizes, worker name) are Validate's.
func Decode(data []byte) (WireEvent, error) {
	var ev WireEvent
	if err := decodeInto(data, &ev); err != nil {
		return WireEvent{}, fmt.Errorf("%w: %v", ErrUndecodable, err)
	}
	return ev, nil
}

func decodeInto(data []byte, ev *WireEvent) error {
	r := bytes.NewReader(data)
	d := msgpack.NewDecoder(r) // bytes.Reader is a ByteScanner: no extra buffering, r.Len() stays exact
	c, err := d.PeekCode()
	if err != nil {
		return err
	}
	if !msgpcode.IsFixedMap(c) && c != msgpcode.Map16 && c != msgpcode.Map32 {
		return fmt.Errorf("not a map (code 0x%02x)", c)
	}
	n, err := d.DecodeMapLen()
	if err != nil {
		return err
	}
	if n > 2*r.Len() { // a key and a value take at least a byte each
		return fmt.Errorf("map of %d entries in %d bytes", n, r.Len())
	}
	var seen uint16
	for range n {
		key, err := readString(d, r, 8)
		if err != nil {
			return fmt.Errorf("key: %w", err)
		}
		bit, ok := keyBits[key]
		if !ok {
			return fmt.Errorf("unknown key %q", key)
		}
		if seen&bit != 0 {
			return fmt.Errorf("duplicate key %q", key)
		}
		seen |= bit
		if err := decodeField(d, r, key, ev); err != nil {
			return fmt.Errorf("field %q: %w", key, err)
		}
	}
	if r.Len() != 0 {
		return fmt.Errorf("%d trailing bytes", r.Len())
	}
	return nil
}

var keyBits = map[string]uint16{"w": 1, "r": 2, "i": 4, "k": 8, "bs": 16, "hp": 32, "p": 64, "b": 128, "x": 256, "t": 512}

func decodeField(d *msgpack.Decoder, r *bytes.Reader, key string, ev *WireEvent) error {
	var err error
	switch key {
	case "w":
		ev.Worker, err = readString(d, r, MaxWorkerNameLen)
	case "r":
		var v uint64
		v, err = readUint(d, math.MaxUint32)
		ev.DPRank = uint32(v)
	case "i":
		ev.EventID, err = readUint(d, math.MaxUint64)
	case "k":
		var v uint64
		v, err = readUint(d, math.MaxUint8)
		ev.Kind = uint8(v)
	case "bs":
		var v uint64
		v, err = readUint(d, math.MaxInt32)
		ev.BlockSize = int(v)
	case "hp":
		var c byte
		if c, err = d.PeekCode(); err == nil {
			if c != msgpcode.True && c != msgpcode.False {
				return fmt.Errorf("not a bool (code 0x%02x)", c)
			}
			ev.HasParent, err = d.DecodeBool()
		}
	case "p":
		ev.Parent, err = readUint(d, math.MaxUint64)
	case "t":
		var v uint64
		v, err = readUint(d, math.MaxUint8)
		ev.Tier = uint8(v)
	case "b":
		var n int
		if n, err = readArrayLen(d, r, 1); err != nil || n == 0 {
			return err
		}
		ev.Blocks = make([]WireBlock, n)
		for i := range ev.Blocks {
			if err = readBlock(d, r, &ev.Blocks[i]); err != nil {
				return fmt.Errorf("block %d: %w", i, err)
			}
		}
	case "x":
		var n int
		if n, err = readArrayLen(d, r, 1); err != nil || n == 0 {
			return err
		}
		ev.Removed = make([]uint64, n)
		for i := range ev.Removed {
			if ev.Removed[i], err = readUint(d, math.MaxUint64); err != nil {
				return fmt.Errorf("removed %d: %w", i, err)
			}
		}
	}
	return err
}

// readBlock reads a WireBlock: a map with keys "e" and "c" (either may be
// absent, meaning zero).
func readBlock(d *msgpack.Decoder, r *bytes.Reader, b *WireBlock) error {
	c, err := d.PeekCode()
	if err != nil {
		return err
	}
	if !msgpcode.IsFixedMap(c) {
		return fmt.Errorf("not a small map (code 0x%02x)", c)
	}
	n, err := d.DecodeMapLen()
	if err != nil {
		return err
	}
	var seenE, seenC bool
	for range n {
		key, err := readString(d, r, 1)
		if err != nil {
			return err
		}
		switch {
		case key == "e" && !seenE:
			seenE = true
			b.Engine, err = readUint(d, math.MaxUint64)
		case key == "c" && !seenC:
			seenC = true
			b.Content, err = readUint(d, math.MaxUint64)
		default:
			return fmt.Errorf("unknown or duplicate key %q", key)
		}
		if err != nil {
			return fmt.Errorf("%q: %w", key, err)
		}
	}
	return nil
}

// readString reads a msgpack str of at most max bytes of valid UTF-8.
func readString(d *msgpack.Decoder, r *bytes.Reader, max int) (string, error) {
	c, err := d.PeekCode()
	if err != nil {
		return "", err
	}
	if !msgpcode.IsFixedString(c) && c != msgpcode.Str8 && c != msgpcode.Str16 && c != msgpcode.Str32 {
		return "", fmt.Errorf("not a string (code 0x%02x)", c)
	}
	n, err := d.DecodeBytesLen()
	if err != nil {
		return "", err
	}
	if n > max || n > r.Len() {
		return "", fmt.Errorf("string of %d bytes (max %d, %d left)", n, max, r.Len())
	}
	buf := make([]byte, n)
	if _, err := r.Read(buf); err != nil && n > 0 {
		return "", err
	}
	if !utf8.Valid(buf) {
		return "", errors.New("string is not UTF-8")
	}
	return string(buf), nil
}

// readUint reads a non-negative integer of any msgpack width, up to max.
// nil and negative numbers are rejected.
func readUint(d *msgpack.Decoder, max uint64) (uint64, error) {
	c, err := d.PeekCode()
	if err != nil {
		return 0, err
	}
	var v uint64
	switch {
	case msgpcode.IsFixedNum(c) && c <= msgpcode.PosFixedNumHigh,
		c == msgpcode.Uint8, c == msgpcode.Uint16, c == msgpcode.Uint32, c == msgpcode.Uint64:
		v, err = d.DecodeUint64()
	case c == msgpcode.Int8, c == msgpcode.Int16, c == msgpcode.Int32, c == msgpcode.Int64:
		var s int64
		if s, err = d.DecodeInt64(); err == nil {
			if s < 0 {
				return 0, fmt.Errorf("negative number %d", s)
			}
			v = uint64(s)
		}
	default:
		return 0, fmt.Errorf("not an unsigned integer (code 0x%02x)", c)
	}
	if err != nil {
		return 0, err
	}
	if v > max {
		return 0, fmt.Errorf("number %d out of range (max %d)", v, max)
	}
	return v, nil
}

// readArrayLen reads an array header whose elements take at least minElem
// bytes each; nil reads as an empty array.
func readArrayLen(d *msgpack.Decoder, r *bytes.Reader, minElem int) (int, error) {
	c, err := d.PeekCode()
	if err != nil {
		return 0, err
	}
	if c == msgpcode.Nil {
		_, err := d.DecodeArrayLen()
		return 0, err
	}
	if !msgpcode.IsFixedArray(c) && c != msgpcode.Array16 && c != msgpcode.Array32 {
		return 0, fmt.Errorf("not an array (code 0x%02x)", c)
	}
	n, err := d.DecodeArrayLen()
	if err != nil {
		return 0, err
	}
	if n < 0 || n > r.Len()/minElem {
		return 0, fmt.Errorf("array of %d elements in %d bytes", n, r.Len())
	}
	return n, nil
}

// Reason says why the consumer rejected an event. The values are Prometheus
// label values and log fields: append only.
type Reason string

// Rejection reasons.
const (
	ReasonUndecodable       Reason = "undecodable"         // not a WireEvent
	ReasonBadWorker         Reason = "bad_worker"          // empty, too long, unprintable or '#' in the worker name
	ReasonBadEventID        Reason = "bad_event_id"        // event id 0
	ReasonBadKind           Reason = "bad_kind"            // kind not stored/removed/cleared
	ReasonTooManyBlocks     Reason = "too_many_blocks"     // more blocks (stored or removed) than the cap
	ReasonBadBlockSize      Reason = "bad_block_size"      // block size outside [0, MaxBlockSize]
	ReasonInconsistent      Reason = "inconsistent"        // payload does not fit the kind (e.g. removed hashes on a stored event)
	ReasonSubjectMismatch   Reason = "subject_mismatch"    // published on another worker's subject
	ReasonMsgIDMismatch     Reason = "msg_id_mismatch"     // Nats-Msg-Id is not worker:dp_rank:event_id
	ReasonUnknownWorker     Reason = "unknown_worker"      // Validator: worker not registered
	ReasonBlockSizeMismatch Reason = "block_size_mismatch" // Validator: block size differs from the configured one
	ReasonRejected          Reason = "rejected"            // Validator: any other error
	ReasonTooLarge          Reason = "too_large"           // alone larger than one Raft entry may be (ConsumerConfig.MaxEntryBytes)
	ReasonBadTier           Reason = "bad_tier"            // a storage tier this build does not know
)

// AllReasons lists every reason (for pre-initialising metric labels).
var AllReasons = []Reason{
	ReasonUndecodable, ReasonBadWorker, ReasonBadEventID, ReasonBadKind, ReasonTooManyBlocks,
	ReasonBadBlockSize, ReasonInconsistent, ReasonSubjectMismatch, ReasonMsgIDMismatch,
	ReasonUnknownWorker, ReasonBlockSizeMismatch, ReasonRejected, ReasonTooLarge, ReasonBadTier,
}

// ErrInvalidEvent is the router's sentinel, aliased so errors.Is works
// across layers.
var ErrInvalidEvent = router.ErrInvalidEvent

// InvalidEventError is a rejected event: why, and the details for the log.
type InvalidEventError struct {
	Reason Reason
	Detail string
	Err    error // the cause, when there is one (decode or validator error)
}

func (e *InvalidEventError) Error() string {
	if e.Detail == "" {
		return fmt.Sprintf("%v: %s", ErrInvalidEvent, e.Reason)
	}
	return fmt.Sprintf("%v: %s: %s", ErrInvalidEvent, e.Reason, e.Detail)
}

// Is makes errors.Is(err, ErrInvalidEvent) true.
func (e *InvalidEventError) Is(target error) bool { return target == ErrInvalidEvent }

func (e *InvalidEventError) Unwrap() error { return e.Err }

// ReasonOf returns the rejection reason carried by err, or "" when err is
// not an *InvalidEventError.
func ReasonOf(err error) Reason {
	var ie *InvalidEventError
	if errors.As(err, &ie) {
		return ie.Reason
	}
	return ""
}

func invalid(r Reason, format string, args ...any) error {
	return &InvalidEventError{Reason: r, Detail: fmt.Sprintf(format, args...)}
}

// Validate checks what Decode cannot: a sane worker name, a non-zero event
// id, a known kind, sizes within bounds (maxBlocks ≤ 0 means
// DefaultMaxBlocks) and a payload that fits the kind. It returns nil or an
// *InvalidEventError. Harmless oddities (an empty stored event) pass: every
// rejected event leaves a hole in the worker's event ids, which costs the
// worker a resync.
func Validate(ev *WireEvent, maxBlocks int) error {
	if maxBlocks <= 0 {
		maxBlocks = DefaultMaxBlocks
	}
	if ev.Worker == "" || len(ev.Worker) > MaxWorkerNameLen || !printable(ev.Worker) {
		return invalid(ReasonBadWorker, "worker %q", ev.Worker)
	}
	if ev.EventID == 0 {
		return invalid(ReasonBadEventID, "worker %s: event id 0", ev.Worker)
	}
	if ev.BlockSize < 0 || ev.BlockSize > MaxBlockSize {
		return invalid(ReasonBadBlockSize, "%s: block size %d", ev.MsgID(), ev.BlockSize)
	}
	if !router.Tier(ev.Tier).Valid() {
		return invalid(ReasonBadTier, "%s: tier %d", ev.MsgID(), ev.Tier)
	}
	if len(ev.Blocks) > maxBlocks || len(ev.Removed) > maxBlocks {
		return invalid(ReasonTooManyBlocks, "%s: %d stored, %d removed blocks (max %d)", ev.MsgID(), len(ev.Blocks), len(ev.Removed), maxBlocks)
	}
	switch ev.Kind {
	case KindStored:
		if len(ev.Removed) > 0 {
			return invalid(ReasonInconsistent, "%s: stored event with %d removed hashes", ev.MsgID(), len(ev.Removed))
		}
	case KindRemoved:
		if len(ev.Blocks) > 0 || ev.HasParent {
			return invalid(ReasonInconsistent, "%s: removed event with stored blocks or a parent", ev.MsgID())
		}
	case KindCleared:
		if len(ev.Blocks) > 0 || len(ev.Removed) > 0 || ev.HasParent {
			return invalid(ReasonInconsistent, "%s: cleared event with a payload", ev.MsgID())
		}
	default:
		return invalid(ReasonBadKind, "%s: kind %d", ev.MsgID(), ev.Kind)
	}
	return nil
}

// printable: no control characters (they would corrupt logs), and no '#',
// which router.WorkerKey uses to fold in the dp rank ("a#1" rank 0 would
// collide with "a" rank 1).
func printable(s string) bool {
	for _, r := range s {
		if r < 0x20 || r == 0x7f || r == utf8.RuneError || r == '#' {
			return false
		}
	}
	return true
}
