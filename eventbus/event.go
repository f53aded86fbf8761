package eventbus

import (
	"bytes"
	"errors"
	"fmt"
	"unicode/utf8"

	"github.com/vmihailenco/msgpack/v5"

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
	ReasonBadBatch          Reason = "bad_batch"           // a batch message whose members are not one worker rank's contiguous event ids
)

// AllReasons lists every reason (for pre-initialising metric labels).
var AllReasons = []Reason{
	ReasonUndecodable, ReasonBadWorker, ReasonBadEventID, ReasonBadKind, ReasonTooManyBlocks,
	ReasonBadBlockSize, ReasonInconsistent, ReasonSubjectMismatch, ReasonMsgIDMismatch,
	ReasonUnknownWorker, ReasonBlockSizeMismatch, ReasonRejected, ReasonTooLarge, ReasonBadTier,
	ReasonBadBatch,
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
	if err := validateWorker(ev); err != nil {
		return err
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

// validateWorker is Validate's check of the worker name.
func validateWorker(ev *WireEvent) error {
	if ev.Worker == "" || len(ev.Worker) > MaxWorkerNameLen || !printable(ev.Worker) {
		return invalid(ReasonBadWorker, "worker %q", ev.Worker)
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
