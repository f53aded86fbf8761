package fsm

import (
	"encoding/binary"
	"fmt"

	"github.com/kvrouter/kvrouter/router"
)

// KVEventBatch payload (after the type byte and envelope version), version 1:
//
//	uvarint  nWorkers                      string table of worker ids
//	nWorkers × (uvarint len, bytes)
//	uvarint  nEvents
//	nEvents × event:
//	  uvarint workerIdx (< nWorkers)
//	  uvarint dpRank    (fits uint32)
//	  uvarint eventID   (0 = unsequenced)
//	  byte    kind      (router.EventKind: 1 stored, 2 removed, 3 cleared)
//	  byte    flags     (stored only: bit0 has parent, bit1 engine hashes follow)
//	  uvarint blockSize (0 = not reported)
//	  stored:  [u64 parent] uvarint n, n × (u64 content [u64 engine])
//	  removed: uvarint n, n × u64 engine hash
//	  cleared: nothing
//
// KVEventBatchTiered (type 12) has the same payload, with one more flag, of
// any kind: bit2 a tier byte follows the flags byte (before the block
// size), set exactly for events of a lower tier (router.Tier 1–3; the
// device tier is the absence of the byte). So a type-12 entry's device
// events encode as in type 3, and a batch whose events are all of the
// device tier is written as type 3: builds without tiers apply it. A tier
// number above those this build knows is undecodable here; a new tier takes
// a new command type, so that older builds halt on it.
//
// Hashes are fixed 8-byte little endian (they are uniformly random, so a
// varint would take 9–10 bytes). Engines that name blocks by our content hash
// (kvmock) cost 8 bytes per block; others 16. Fields an event kind does not use
// are not encoded. Every count is checked against the bytes left before
// anything is allocated from it.
const (
	kvFlagParent  = 1 << 0
	kvFlagAliased = 1 << 1
	kvFlagTier    = 1 << 2 // type 12 only
	kvMinEvent    = 6      // idx, rank, id, kind, flags, block size: one byte each at least
)

// KVBatchOverhead bounds the bytes of a KVEventBatch entry that belong to
// no event: type, envelope version and the two counts. An entry of events
// e₁…eₙ encodes in at most KVBatchOverhead + Σ KVBatchEventBytes(eᵢ) bytes.
const KVBatchOverhead = 2 + 2*binary.MaxVarintLen64

// KVEventShape is what an event's size in a KVEventBatch entry depends on,
// so a proposer can size an event it holds in another form (the ingest
// consumer's wire events) without converting it.
type KVEventShape struct {
	WorkerLen int // bytes of the worker id
	DPRank    uint32
	EventID   uint64
	Kind      router.EventKind
	BlockSize int
	HasParent bool // stored
	Blocks    int  // stored
	Aliased   bool // stored: some block's engine hash differs from its content hash
	Removed   int  // removed
	Tier      router.Tier
}

// Bytes is an upper bound on the bytes the event adds to an entry: its own
// encoding, exactly, plus its worker id's place in the string table (paid
// once per entry, counted here for every event) and the widest worker
// index a batch of up to 2³² names needs.
func (s KVEventShape) Bytes() int {
	n := uvarintLen(uint64(s.WorkerLen)) + s.WorkerLen + // string table entry
		binary.MaxVarintLen32 + // worker index
		uvarintLen(uint64(s.DPRank)) + uvarintLen(s.EventID) +
		2 + uvarintLen(uint64(s.BlockSize)) // kind, flags, block size
	if s.Tier != router.TierDevice {
		n++ // the tier byte
	}
	switch s.Kind {
	case router.EventStored:
		if s.HasParent {
			n += 8
		}
		per := 8
		if s.Aliased {
			per = 16
		}
		n += uvarintLen(uint64(s.Blocks)) + per*s.Blocks
	case router.EventRemoved:
		n += uvarintLen(uint64(s.Removed)) + 8*s.Removed
	}
	return n
}

// KVBatchEventBytes is KVEventShape.Bytes of e.
func KVBatchEventBytes(e *KVBatchEvent) int {
	ev := &e.Event
	s := KVEventShape{WorkerLen: len(e.Worker), DPRank: e.DPRank, EventID: e.EventID, Kind: ev.Kind,
		BlockSize: ev.BlockSize, HasParent: ev.HasParent, Blocks: len(ev.Blocks), Removed: len(ev.Removed), Tier: ev.Tier}
	for _, b := range ev.Blocks {
		if b.EngineHash != b.ContentHash {
			s.Aliased = true
			break
		}
	}
	return s.Bytes()
}

func uvarintLen(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}

// kvBatchTiered reports whether an event is of a lower tier: the batch
// is then a KVEventBatchTiered.
func kvBatchTiered(events []KVBatchEvent) bool {
	for i := range events {
		if events[i].Event.Tier != router.TierDevice {
			return true
		}
	}
	return false
}

// AppendKVBatch appends a complete KVEventBatch log entry (type byte,
// envelope version, payload) to dst: type 12 when an event is of a lower
// tier, else type 3. It refuses events the decoder would refuse: unknown
// kinds and tiers, negative or huge block sizes, over-long worker ids.
func AppendKVBatch(dst []byte, events []KVBatchEvent) ([]byte, error) {
	var tab nameTable
	typ := CmdKVEventBatch
	for i := range events {
		e := &events[i]
		if err := checkString("worker id", e.Worker); err != nil {
			return nil, err
		}
		if t := e.Event.Tier; t != router.TierDevice {
			if !t.Valid() {
				return nil, fmt.Errorf("event %d of worker %s: %v: %w", i, e.Worker, t, ErrInvalidCommand)
			}
			typ = CmdKVEventBatchTiered
		}
		switch e.Event.Kind {
		case router.EventStored, router.EventRemoved, router.EventCleared:
		default:
			return nil, fmt.Errorf("event %d of worker %s: kind %d: %w", i, e.Worker, e.Event.Kind, ErrInvalidCommand)
		}
		if err := checkInt("block size", e.Event.BlockSize); err != nil {
			return nil, err
		}
		tab.index(e.Worker)
	}
	dst = append(dst, byte(typ), EnvelopeVersion)
	dst = binary.AppendUvarint(dst, uint64(len(tab.names)))
	for _, n := range tab.names {
		dst = appendString(dst, n)
	}
	dst = binary.AppendUvarint(dst, uint64(len(events)))
	for i := range events {
		e := &events[i]
		ev := &e.Event
		dst = binary.AppendUvarint(dst, uint64(tab.index(e.Worker)))
		dst = binary.AppendUvarint(dst, uint64(e.DPRank))
		dst = binary.AppendUvarint(dst, e.EventID)
		dst = append(dst, byte(ev.Kind))
		switch ev.Kind {
		case router.EventStored:
			flags := byte(0)
			if ev.HasParent {
				flags |= kvFlagParent
			}
			for _, b := range ev.Blocks {
				if b.EngineHash != b.ContentHash {
					flags |= kvFlagAliased
					break
				}
			}
			dst = appendFlagsTier(dst, flags, ev.Tier)
			dst = binary.AppendUvarint(dst, uint64(ev.BlockSize))
			if ev.HasParent {
				dst = appendU64(dst, ev.Parent)
			}
			dst = binary.AppendUvarint(dst, uint64(len(ev.Blocks)))
			for _, b := range ev.Blocks {
				dst = appendU64(dst, b.ContentHash)
				if flags&kvFlagAliased != 0 {
					dst = appendU64(dst, b.EngineHash)
				}
			}
		case router.EventRemoved:
			dst = appendFlagsTier(dst, 0, ev.Tier)
			dst = binary.AppendUvarint(dst, uint64(ev.BlockSize))
			dst = binary.AppendUvarint(dst, uint64(len(ev.Removed)))
			for _, h := range ev.Removed {
				dst = appendU64(dst, h)
			}
		case router.EventCleared:
			dst = appendFlagsTier(dst, 0, ev.Tier)
			dst = binary.AppendUvarint(dst, uint64(ev.BlockSize))
		}
	}
	return dst, nil
}

// appendFlagsTier appends an event's flags byte and, for a lower tier,
// kvFlagTier and the tier byte.
func appendFlagsTier(dst []byte, flags byte, t router.Tier) []byte {
	if t == router.TierDevice {
		return append(dst, flags)
	}
	return append(dst, flags|kvFlagTier, byte(t))
}

// nameTable numbers worker ids in order of first appearance. Batches name
// few workers, usually in runs, so a last-hit check and a linear scan beat a
// map until the table grows.
type nameTable struct {
	names []string
	last  int
	m     map[string]int
}

func (t *nameTable) index(s string) int {
	if t.last < len(t.names) && t.names[t.last] == s {
		return t.last
	}
	if t.m != nil {
		if i, ok := t.m[s]; ok {
			t.last = i
			return i
		}
	} else {
		for i, n := range t.names {
			if n == s {
				t.last = i
				return i
			}
		}
	}
	t.names = append(t.names, s)
	t.last = len(t.names) - 1
	if t.m == nil && len(t.names) > 16 {
		t.m = make(map[string]int, 32)
		for i, n := range t.names {
			t.m[n] = i
		}
	} else if t.m != nil {
		t.m[s] = t.last
	}
	return t.last
}

// kvDecoder decodes KVEventBatch payloads into buffers it reuses from batch
// to batch (the FSM keeps one), so the hot path allocates only the worker
// id strings. Events' slices point into the buffers until the next decode.
type kvDecoder struct {
	events []KVBatchEvent
	blocks []router.StoredBlock
	hashes []uint64
	names  []string
}

// decodeKVBatchPayload decodes into fresh buffers (for callers that keep
// the result).
func decodeKVBatchPayload(p []byte, tiered bool) ([]KVBatchEvent, error) {
	var d kvDecoder
	return d.decode(p, tiered)
}

// decode reads a type 3 payload, or a type 12 one when tiered.
func (d *kvDecoder) decode(p []byte, tiered bool) ([]KVBatchEvent, error) {
	r := &reader{b: p}
	nNames := r.count("worker ids", 1)
	d.names = d.names[:0]
	for range nNames {
		d.names = append(d.names, r.string("worker id"))
	}
	nEvents := r.count("events", kvMinEvent)
	if r.err != nil {
		return nil, fmt.Errorf("decode kv batch: %w", r.err)
	}
	if cap(d.events) < nEvents {
		d.events = make([]KVBatchEvent, nEvents)
	}
	evs := d.events[:nEvents]
	blocks, hashes := d.blocks[:0], d.hashes[:0]
	for i := range evs {
		e := &evs[i]
		wi := r.uvarint()
		if r.err == nil && wi >= uint64(len(d.names)) {
			r.fail("event %d: worker index %d of %d", i, wi, len(d.names))
		}
		if r.err != nil {
			break
		}
		*e = KVBatchEvent{Worker: d.names[wi], DPRank: r.u32("dp rank"), EventID: r.uvarint()}
		ev := &e.Event
		ev.Kind = router.EventKind(r.byte())
		flags := r.byte()
		if tiered && flags&kvFlagTier != 0 {
			flags &^= kvFlagTier
			// The flag is set only for a lower tier: a device tier byte is
			// an encoding this format does not write, so it is refused
			// (each state has one encoding).
			if ev.Tier = router.Tier(r.byte()); r.err == nil && (ev.Tier == router.TierDevice || !ev.Tier.Valid()) {
				r.fail("event %d: tier %d", i, ev.Tier)
			}
		}
		ev.BlockSize = r.int("block size")
		switch ev.Kind {
		case router.EventStored:
			if flags&^(kvFlagParent|kvFlagAliased) != 0 {
				r.fail("event %d: flags %#x", i, flags)
			}
			if flags&kvFlagParent != 0 {
				ev.HasParent, ev.Parent = true, r.u64()
			}
			size := 8
			if flags&kvFlagAliased != 0 {
				size = 16
			}
			n := r.count("blocks", size)
			start := len(blocks)
			for range n {
				ch := r.u64()
				eh := ch
				if flags&kvFlagAliased != 0 {
					eh = r.u64()
				}
				blocks = append(blocks, router.StoredBlock{EngineHash: eh, ContentHash: ch})
			}
			if n > 0 {
				ev.Blocks = blocks[start:len(blocks):len(blocks)]
			}
		case router.EventRemoved:
			if flags != 0 {
				r.fail("event %d: flags %#x", i, flags)
			}
			n := r.count("removed", 8)
			start := len(hashes)
			for range n {
				hashes = append(hashes, r.u64())
			}
			if n > 0 {
				ev.Removed = hashes[start:len(hashes):len(hashes)]
			}
		case router.EventCleared:
			if flags != 0 {
				r.fail("event %d: flags %#x", i, flags)
			}
		default:
			r.fail("event %d: kind %d", i, ev.Kind)
		}
	}
	d.blocks, d.hashes = blocks, hashes
	if err := r.done(); err != nil {
		return nil, fmt.Errorf("decode kv batch: %w", err)
	}
	return evs, nil
}
