package eventbus

import (
	"bytes"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/kvrouter/kvrouter/internal/msgpackread"
)

// The batch message form: several KV events of one worker rank in one NATS
// message (issue 31 item 3). JetStream's costs (a file-store write and an
// fsync per message on every replica with SyncAlways, NATS's own Raft entry,
// the work-queue delete after the ack, TLS records) are per message, so a
// publisher that sends n events per message pays them once per n events,
// as vLLM's own KVEventBatch carries many events per engine step.
//
// Wire: a msgpack array of 1..MaxBatchEvents members, each member exactly
// the map a single-event message carries (WireEvent, Decode's rules). The
// first byte tells the two forms apart: a single event is a map, a batch an
// array. A publisher that sends one event per message is unchanged; a
// consumer of a build before batches refuses a batch as undecodable, so
// publish batches only once every consumer knows them (as for tiers).
//
// A batch covers a contiguous run of event ids of one (worker, dp_rank):
// members name the same worker and rank, and their ids are first, first+1,
// …, last (CheckBatch). Its Nats-Msg-Id is BatchMsgID(worker, rank, first,
// last), "worker:dp_rank:first-last": a retry re-sends the same message with
// the same id, so JetStream's duplicate window still stores it once.

// MaxBatchEvents caps the members of one batch message. Publishers cut
// batches far below it (WithBatching); it bounds what a hostile message
// makes the consumer allocate.
const MaxBatchEvents = 4096

// minBatchMemberBytes is the size of the smallest member that can pass
// Validate: a fixmap header (1), "w" with a one-byte name (2 + 2), "i" and
// "k" with one-byte values (2 + 1 each; kinds start at 1, so "k" is never
// left out). DecodeBatch refuses a count the bytes cannot hold at this
// size before allocating the members: members too small to be valid could
// otherwise make a message allocate a hundred times its size.
const minBatchMemberBytes = 11

// IsBatch reports whether data is in the batch form (a msgpack array). It
// looks at the first byte only; DecodeBatch decides whether it is one.
func IsBatch(data []byte) bool { return len(data) > 0 && msgpackread.IsArray(data[0]) }

// DecodeBatch parses a batch message strictly: exactly one msgpack array of
// 1..MaxBatchEvents members, each accepted by Decode's rules, and nothing
// after it. The count is checked against the bytes that remain (at
// minBatchMemberBytes a member) before the members are allocated, so the
// allocation stays a small multiple of the message. Whether the members
// form a batch (one worker rank, contiguous ids) is CheckBatch's;
// Validate's checks are per member.
func DecodeBatch(data []byte) ([]WireEvent, error) {
	evs, err := decodeBatch(data)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUndecodable, err)
	}
	return evs, nil
}

func decodeBatch(data []byte) ([]WireEvent, error) {
	r := &wireReader{Reader: msgpackread.New(data, errShort)}
	n, ok, err := r.ArrayHeader()
	if err != nil {
		return nil, err
	}
	if !ok {
		c, _ := r.Peek()
		return nil, fmt.Errorf("not a batch (code 0x%02x)", c)
	}
	switch {
	case n == 0:
		return nil, fmt.Errorf("empty batch")
	case n > MaxBatchEvents:
		return nil, fmt.Errorf("batch of %d events (max %d)", n, MaxBatchEvents)
	case n > uint64(r.Left()/minBatchMemberBytes):
		return nil, fmt.Errorf("batch of %d events in %d bytes", n, r.Left())
	}
	evs := make([]WireEvent, n)
	for i := range evs {
		if err := r.event(&evs[i]); err != nil {
			return nil, fmt.Errorf("event %d: %w", i, err)
		}
	}
	if r.Left() != 0 {
		return nil, fmt.Errorf("%d trailing bytes", r.Left())
	}
	return evs, nil
}

// CheckBatch checks that decoded members form a batch: at least one, at
// most MaxBatchEvents, one worker and dp rank, event ids first, first+1, …
// with first ≥ 1. It returns nil or an *InvalidEventError with
// ReasonBadBatch. Each member's own validity is Validate's.
func CheckBatch(evs []WireEvent) error {
	if len(evs) == 0 || len(evs) > MaxBatchEvents {
		return invalid(ReasonBadBatch, "batch of %d events (want 1..%d)", len(evs), MaxBatchEvents)
	}
	first := &evs[0]
	if first.EventID == 0 || first.EventID > math.MaxUint64-uint64(len(evs)-1) {
		return invalid(ReasonBadBatch, "batch of %d events from event id %d", len(evs), first.EventID)
	}
	for i := 1; i < len(evs); i++ {
		ev := &evs[i]
		if ev.Worker != first.Worker || ev.DPRank != first.DPRank {
			return invalid(ReasonBadBatch, "event %d is %s, the batch's first %s", i, ev.MsgID(), first.MsgID())
		}
		if ev.EventID != first.EventID+uint64(i) {
			return invalid(ReasonBadBatch, "event %d has id %d, want %d (ids not contiguous)", i, ev.EventID, first.EventID+uint64(i))
		}
	}
	return nil
}

// EncodeBatch returns the batch encoding of evs. It refuses what the
// consumer refuses as a whole message: members that do not form a batch
// (CheckBatch). Members are encoded as Encode encodes single events.
func EncodeBatch(evs []WireEvent) ([]byte, error) {
	if err := CheckBatch(evs); err != nil {
		return nil, fmt.Errorf("encode batch: %w", err)
	}
	var buf bytes.Buffer
	buf.Write(appendArrayHeader(nil, len(evs)))
	for i := range evs {
		b, err := Encode(&evs[i])
		if err != nil {
			return nil, err
		}
		buf.Write(b)
	}
	return buf.Bytes(), nil
}

// appendArrayHeader appends a msgpack array header for n elements (n ≤
// MaxBatchEvents, so never array32).
func appendArrayHeader(b []byte, n int) []byte {
	if n <= 15 {
		return append(b, msgpackread.FixArrayMin|byte(n))
	}
	return append(b, msgpackread.Array16, byte(n>>8), byte(n))
}

// BatchMsgID is the JetStream deduplication id of a batch message:
// worker:dp_rank:first-last. It differs from every single event's MsgID
// (those have no '-' after the last ':'), so the two forms never
// deduplicate against each other.
func BatchMsgID(worker string, dpRank uint32, first, last uint64) string {
	return worker + ":" + strconv.FormatUint(uint64(dpRank), 10) + ":" +
		strconv.FormatUint(first, 10) + "-" + strconv.FormatUint(last, 10)
}

// isBatchMsgID reports whether id == BatchMsgID(worker, dpRank, first,
// last), without building it.
func isBatchMsgID(id, worker string, dpRank uint32, first, last uint64) bool {
	rest, ok := strings.CutPrefix(id, worker)
	if !ok {
		return false
	}
	var buf [2 + 10 + 20 + 1 + 20]byte // ':' rank ':' first '-' last
	b := append(buf[:0], ':')
	b = strconv.AppendUint(b, uint64(dpRank), 10)
	b = append(b, ':')
	b = strconv.AppendUint(b, first, 10)
	b = append(b, '-')
	b = strconv.AppendUint(b, last, 10)
	return rest == string(b)
}
