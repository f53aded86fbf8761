package main

import (
	"sync/atomic"

	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/router"
)

// hostTier is the CPU offload tier (--host-tier-blocks N): an LRU of N
// blocks fed by the engine's GPU evictions. A block the engine evicts
// moves here (a stored event with the host tier, as vLLM reports medium
// CPU); the LRU's own evictions are removed events with the host tier. A
// request whose prefix continues here past its GPU hit gets those blocks
// loaded back (engine.Config.LowerTier is holds); they stay here too, as
// vLLM keeps its CPU copy, and a lookup refreshes them. Owned by the engine
// loop goroutine (the driver), like the engine.
type hostTier struct {
	capacity  int
	blockSize int
	// gpu maps the engine hash of every block the GPU caches to its content
	// hash, from the engine's stored events: its removed events name blocks
	// by engine hash only.
	gpu map[uint64]uint64
	// The LRU: byContent indexes entries, a ring through a sentinel
	// (next: towards older; the sentinel's prev is the oldest).
	byContent map[uint64]*hostEntry
	head      hostEntry // sentinel

	stored, evicted, hits atomic.Uint64 // blocks offloaded, dropped by the LRU, blocks found by lookups
	held                  atomic.Int64
}

type hostEntry struct {
	content, engine  uint64
	prev, next       *hostEntry
	pending, dropped bool // offloaded by the running offload call; dropped by it too
}

func newHostTier(capacity, blockSize int) *hostTier {
	h := &hostTier{capacity: capacity, blockSize: blockSize, gpu: map[uint64]uint64{}, byContent: map[uint64]*hostEntry{}}
	h.head.prev, h.head.next = &h.head, &h.head
	return h
}

func (h *hostTier) unlink(e *hostEntry) {
	e.prev.next, e.next.prev = e.next, e.prev
}

func (h *hostTier) pushFront(e *hostEntry) {
	e.prev, e.next = &h.head, h.head.next
	h.head.next.prev = e
	h.head.next = e
}

// holds is engine.Config.LowerTier: whether the tier holds the block of
// content hash c. A hit refreshes the block (vLLM's manager touches what a
// lookup finds).
func (h *hostTier) holds(c uint64) bool {
	e, ok := h.byContent[c]
	if ok {
		h.unlink(e)
		h.pushFront(e)
		h.hits.Add(1)
	}
	return ok
}

// observe follows the engine's events in order and returns them as wire
// events with the host tier's own after each GPU removal: the LRU's
// evictions (removed, host tier), then the newly offloaded blocks (stored,
// host tier, no parent: the index does not parent-check lower tiers).
func (h *hostTier) observe(evs []engine.Event) []eventbus.WireEvent {
	out := make([]eventbus.WireEvent, 0, len(evs)+2)
	for _, e := range evs {
		kv := e.KV
		out = appendWire(out, kv)
		switch kv.Kind {
		case router.EventStored:
			for _, b := range kv.Blocks {
				h.gpu[b.EngineHash] = b.ContentHash
			}
		case router.EventCleared:
			clear(h.gpu) // the GPU's; the host tier keeps its blocks
		case router.EventRemoved:
			out = h.offload(out, kv.Removed)
		}
	}
	return out
}

// offload moves the evicted GPU blocks ehs into the LRU and appends the
// events that say so. A block the LRU drops within the same call was never
// published: it gets no event at all.
func (h *hostTier) offload(out []eventbus.WireEvent, ehs []uint64) []eventbus.WireEvent {
	var fresh []*hostEntry
	var removed []uint64
	for _, eh := range ehs {
		c, ok := h.gpu[eh]
		if !ok {
			continue
		}
		delete(h.gpu, eh)
		if e, ok := h.byContent[c]; ok { // loaded back earlier: still here
			h.unlink(e)
			h.pushFront(e)
			continue
		}
		e := &hostEntry{content: c, engine: eh, pending: true}
		h.byContent[c] = e
		h.pushFront(e)
		fresh = append(fresh, e)
		for len(h.byContent) > h.capacity {
			old := h.head.prev
			h.unlink(old)
			delete(h.byContent, old.content)
			if old.pending {
				old.dropped = true
			} else {
				removed = append(removed, old.engine)
			}
			h.evicted.Add(1)
		}
	}
	if len(removed) > 0 {
		out = appendWire(out, router.KVEvent{Kind: router.EventRemoved, Tier: router.TierHost, BlockSize: h.blockSize, Removed: removed})
	}
	blocks := make([]router.StoredBlock, 0, len(fresh))
	for _, e := range fresh {
		e.pending = false
		if !e.dropped {
			blocks = append(blocks, router.StoredBlock{EngineHash: e.engine, ContentHash: e.content})
		}
	}
	h.stored.Add(uint64(len(fresh)))
	h.held.Store(int64(len(h.byContent)))
	return appendTierBlocks(out, router.TierHost, h.blockSize, blocks)
}

// appendTierBlocks appends stored events of a lower tier for blocks, at
// most maxEventBlocks each, none with a parent (they are not a chain).
func appendTierBlocks(out []eventbus.WireEvent, tier router.Tier, blockSize int, blocks []router.StoredBlock) []eventbus.WireEvent {
	for i := 0; i < len(blocks); i += maxEventBlocks {
		out = append(out, eventbus.FromKVEvent("", 0, 0, router.KVEvent{
			Kind: router.EventStored, Tier: tier, BlockSize: blockSize,
			Blocks: blocks[i:min(i+maxEventBlocks, len(blocks))],
		}))
	}
	return out
}

// snapshotEvents is the tier's full state: a cleared event of the host
// tier (it clears that tier only), then every block, oldest first.
func (h *hostTier) snapshotEvents() []eventbus.WireEvent {
	out := []eventbus.WireEvent{{Kind: eventbus.KindCleared, BlockSize: h.blockSize, Tier: uint8(router.TierHost)}}
	blocks := make([]router.StoredBlock, 0, len(h.byContent))
	for e := h.head.prev; e != &h.head; e = e.prev {
		blocks = append(blocks, router.StoredBlock{EngineHash: e.engine, ContentHash: e.content})
	}
	return appendTierBlocks(out, router.TierHost, h.blockSize, blocks)
}
