package main

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/router"
)

// maxEventBlocks bounds the blocks (stored or removed) of one published
// event; eventbus.Validate rejects more than eventbus.DefaultMaxBlocks, and
// smaller messages keep the stream's per-message size low.
const maxEventBlocks = 1024

// Publisher is what kvmock needs of *eventbus.Publisher (tests use a fake).
type Publisher interface {
	// PublishAsync sends ev (EventID 0: the publisher assigns the next id)
	// and returns without waiting for the stream's ack.
	PublishAsync(ctx context.Context, ev eventbus.WireEvent) (uint64, error)
	NextEventID() uint64
	Flush(ctx context.Context) error
	Stats() eventbus.PublisherStats
	Close()
}

// toWire converts engine events into wire events without ids (the publisher
// numbers them when it sends them), splitting oversized ones: a long stored
// chain becomes several events, each chained to the previous part's last
// block.
func toWire(evs []engine.Event) []eventbus.WireEvent {
	out := make([]eventbus.WireEvent, 0, len(evs))
	for _, e := range evs {
		out = appendWire(out, e.KV)
	}
	return out
}

func appendWire(out []eventbus.WireEvent, kv router.KVEvent) []eventbus.WireEvent {
	switch {
	case kv.Kind == router.EventStored && len(kv.Blocks) > maxEventBlocks:
		for i := 0; i < len(kv.Blocks); i += maxEventBlocks {
			part := kv
			part.Blocks = kv.Blocks[i:min(i+maxEventBlocks, len(kv.Blocks))]
			if i > 0 {
				part.HasParent, part.Parent = true, kv.Blocks[i-1].EngineHash
			}
			out = append(out, eventbus.FromKVEvent("", 0, 0, part))
		}
	case kv.Kind == router.EventRemoved && len(kv.Removed) > maxEventBlocks:
		for i := 0; i < len(kv.Removed); i += maxEventBlocks {
			part := kv
			part.Removed = kv.Removed[i:min(i+maxEventBlocks, len(kv.Removed))]
			out = append(out, eventbus.FromKVEvent("", 0, 0, part))
		}
	default:
		out = append(out, eventbus.FromKVEvent("", 0, 0, kv))
	}
	return out
}

// snapshotEvents is the full state of a cache: a cleared event, then the
// cached blocks in the order given (parents before children). The engine
// does not say which block is whose parent, so each part is published as a
// chain root (HasParent false); the index keys blocks by content hash and
// needs no parent for that.
func snapshotEvents(blocks []router.StoredBlock, blockSize int) []eventbus.WireEvent {
	out := []eventbus.WireEvent{{Kind: eventbus.KindCleared, BlockSize: blockSize}}
	for i := 0; i < len(blocks); i += maxEventBlocks {
		out = append(out, eventbus.FromKVEvent("", 0, 0, router.KVEvent{
			Kind: router.EventStored, BlockSize: blockSize,
			Blocks: blocks[i:min(i+maxEventBlocks, len(blocks))],
		}))
	}
	return out
}

// queued is one event waiting for the publisher; seq tells a superseded
// head from the current one.
type queued struct {
	seq uint64
	ev  eventbus.WireEvent
}

// eventQueue is the bounded, ordered buffer between the engine loop (which
// must never wait for NATS) and the publisher. The loop pushes; one pump
// goroutine publishes from the head and removes an event only once the
// publisher has taken it. A full queue is never trimmed: the loop replaces
// its content by a full-state resync (reset) instead.
type eventQueue struct {
	max int
	log *slog.Logger

	mu    sync.Mutex
	items []queued // head first
	seq   uint64   // last seq handed out
	wake  chan struct{}

	enqueued, published, superseded, snapshots, overflows atomic.Uint64
	publishErrors, lost, unconfirmed, duplicates          atomic.Uint64
}

func newEventQueue(max int, log *slog.Logger) *eventQueue {
	return &eventQueue{max: max, log: log, wake: make(chan struct{}, 1)}
}

func (q *eventQueue) signal() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

func (q *eventQueue) appendLocked(evs []eventbus.WireEvent) {
	for _, ev := range evs {
		q.seq++
		q.items = append(q.items, queued{seq: q.seq, ev: ev})
	}
}

// push appends evs in order; false (nothing appended) when they do not fit.
func (q *eventQueue) push(evs []eventbus.WireEvent) bool {
	q.mu.Lock()
	if len(q.items)+len(evs) > q.max {
		q.mu.Unlock()
		return false
	}
	q.appendLocked(evs)
	q.mu.Unlock()
	q.enqueued.Add(uint64(len(evs)))
	q.signal()
	return true
}

// reset replaces every unpublished event by evs (a full-state snapshot,
// which supersedes them) and returns how many were dropped. It ignores the
// limit: a snapshot is bounded by the cache size.
func (q *eventQueue) reset(evs []eventbus.WireEvent) int {
	q.mu.Lock()
	n := len(q.items)
	q.items = make([]queued, 0, len(evs))
	q.appendLocked(evs)
	q.mu.Unlock()
	q.superseded.Add(uint64(n))
	q.snapshots.Add(1)
	q.enqueued.Add(uint64(len(evs)))
	q.signal()
	return n
}

// head returns the oldest unpublished event.
func (q *eventQueue) head() (queued, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.items) == 0 {
		return queued{}, false
	}
	return q.items[0], true
}

// isHead: seq is still the oldest unpublished event (not superseded).
func (q *eventQueue) isHead(seq uint64) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.items) > 0 && q.items[0].seq == seq
}

// pop removes the head if it is still seq.
func (q *eventQueue) pop(seq uint64) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.items) > 0 && q.items[0].seq == seq {
		q.items[0] = queued{}
		q.items = q.items[1:]
	}
}

func (q *eventQueue) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.items)
}

// pump publishes the queue in order until ctx ends or the publisher
// closes. A send the publisher refuses is retried (same event, in place)
// with backoff: nothing behind it overtakes it, nothing is dropped. The
// publisher itself re-sends what it accepted but the stream did not
// acknowledge, with the same Nats-Msg-Id.
func (q *eventQueue) pump(ctx context.Context, pub Publisher, onInvalid func(error)) {
	const backoffMin, backoffMax = 50 * time.Millisecond, 2 * time.Second
	for {
		it, ok := q.head()
		if !ok {
			select {
			case <-q.wake:
				continue
			case <-ctx.Done():
				return
			}
		}
		backoff := backoffMin
		for attempt := 1; ; attempt++ {
			_, err := pub.PublishAsync(ctx, it.ev)
			if err == nil {
				q.published.Add(1)
				q.pop(it.seq)
				break
			}
			if ctx.Err() != nil || errors.Is(err, eventbus.ErrPublisherClosed) {
				return
			}
			q.publishErrors.Add(1)
			if errors.Is(err, eventbus.ErrInvalidEvent) {
				// A bug, not an outage: retrying cannot help. Skip it and
				// have the full state republished so the index stays right.
				q.log.Error("KV event rejected by the publisher; republishing the full state", "err", err)
				q.pop(it.seq)
				onInvalid(err)
				break
			}
			if attempt == 1 || attempt%20 == 0 {
				q.log.Error("publishing KV event failed; retrying in order (events are buffered, none dropped)",
					"attempt", attempt, "queued", q.len(), "err", err)
			}
			wait := backoff/2 + rand.N(backoff/2+1)
			backoff = min(2*backoff, backoffMax)
			select {
			case <-time.After(wait):
			case <-ctx.Done():
				return
			}
			if !q.isHead(it.seq) {
				break // superseded by a snapshot meanwhile
			}
		}
	}
}

// waitEmpty waits until every queued event has been handed to the
// publisher, or ctx ends.
func (q *eventQueue) waitEmpty(ctx context.Context) error {
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for q.len() > 0 {
		select {
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}
