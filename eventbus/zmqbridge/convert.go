package zmqbridge

import (
	"fmt"
	"slices"

	"github.com/kvrouter/kvrouter/router"
)

// SkipReason says why the converter dropped an engine event (or part of
// one). The values are Prometheus label values: append only.
type SkipReason string

// Skip reasons.
const (
	SkipOtherMedium       SkipReason = "other_medium"        // a medium not followed: unknown, or a lower tier not kept (Converter.KeepTiers)
	SkipOtherGroup        SkipReason = "other_group"         // a KV cache group the index does not follow (hybrid models: see groups.go)
	SkipUnknownParent     SkipReason = "unknown_parent"      // parent block never seen: its content hash is unknown
	SkipBadTokens         SkipReason = "bad_tokens"          // token_ids is not block_size tokens per block hash
	SkipBlockSizeMismatch SkipReason = "block_size_mismatch" // the engine's block size is not the router's
	SkipLoRAWithoutName   SkipReason = "lora_without_name"   // lora_id without lora_name: the hash seed is unknown
	SkipUnknownType       SkipReason = "unknown_type"        // event type this bridge does not know
	// SkipUnknownGroup: a hybrid model (KV cache groups besides 0) whose
	// events do not say which group is full attention, and no
	// kv_cache_group configured: no group is indexed rather than a guess.
	SkipUnknownGroup SkipReason = "unknown_group"
	// SkipUnknownLayout: an array-shaped event that does not fit the
	// worker's event schema (engine / engine_version / event_schema).
	SkipUnknownLayout SkipReason = "unknown_layout"
	// SkipNamespaced: blocks in a cache namespace (SGLang cache_salt or
	// extra_keys): the router's token hashes carry no salt, so indexing
	// them would credit requests that cannot reuse them.
	SkipNamespaced SkipReason = "namespaced"
)

// AllSkipReasons lists every reason (for metric labels).
var AllSkipReasons = []SkipReason{SkipOtherMedium, SkipOtherGroup, SkipUnknownParent, SkipBadTokens,
	SkipBlockSizeMismatch, SkipLoRAWithoutName, SkipUnknownType, SkipUnknownGroup, SkipUnknownLayout, SkipNamespaced}

// SkipError is an event the converter did not apply.
type SkipError struct {
	Reason SkipReason
	Detail string
}

func (e *SkipError) Error() string { return fmt.Sprintf("%s: %s", e.Reason, e.Detail) }

// Is makes errors.Is(err, router.ErrBlockSizeMismatch) hold for a block
// size mismatch.
func (e *SkipError) Is(target error) bool {
	return e.Reason == SkipBlockSizeMismatch && target == router.ErrBlockSizeMismatch
}

func skip(reason SkipReason, format string, args ...any) *SkipError {
	return &SkipError{Reason: reason, Detail: fmt.Sprintf(format, args...)}
}

// ConverterStats are a converter's cumulative counters.
type ConverterStats struct {
	StoredBlocks    uint64 // blocks published as stored
	RemovedBlocks   uint64 // engine hashes published as removed
	Clears          uint64 // cleared events published (engine clears and resets)
	UnknownRemovals uint64 // removed hashes the converter did not hold (ignored)
	Overflows       uint64 // resets because the mapping outgrew its bound
	Skipped         map[SkipReason]uint64
	// Group is the KV cache group indexed (see GroupState); -1: none yet.
	Group     int64
	GroupRule GroupState
}

// DefaultMaxEntries bounds a converter's engine→content mapping. It holds
// what the engine's GPU cache holds; only missed removals make it grow
// past that, and then it is reset (the index with it).
const DefaultMaxEntries = 1 << 22

type entry struct {
	content uint64
	refs    uint32 // times the engine stored this hash without removing it
}

// Converter turns one engine rank's KV events into the router's events.
// It keeps the engine→content mapping of every block the engine holds:
// content hashes are our chained hashes of the token ids
// (router.BlockHashes with the LoRA name mixed into the seed), so the
// parent's content hash is looked up by the parent's engine hash. Engine
// hashes stay the blocks' opaque names, used for removals.
//
// The engine may store the same hash more than once (two copies of a block)
// and different engine hashes may have the same content (token ids equal,
// different multimodal inputs or cache salt): the converter counts both, so
// a removal reaches the index only when no copy of that content is left.
//
// Not safe for concurrent use: one goroutine owns a converter.
type Converter struct {
	blockSize  int
	maxEntries int

	engines  map[uint64]entry    // engine hash → content hash, copies
	contents map[uint64]uint32   // content hash → live engine hashes naming it
	deferred map[uint64][]uint64 // content hash → engine hashes removed while the content was still held

	groups groupPolicy

	// lower are the converters of the lower storage tiers kept
	// (KeepTiers), by tier; each has its own engine→content mapping (a
	// block offloaded to host memory is another copy, removed on its own)
	// and resolves what it lacks from this, the device tier's (fallback).
	lower    [router.NumTiers]*Converter
	fallback *Converter
	tier     router.Tier

	stats ConverterStats
}

// NewConverter returns a converter for engines with blockSize tokens per
// block; maxEntries ≤ 0 means DefaultMaxEntries.
func NewConverter(blockSize, maxEntries int) *Converter {
	if maxEntries <= 0 {
		maxEntries = DefaultMaxEntries
	}
	c := &Converter{blockSize: blockSize, maxEntries: maxEntries, groups: newGroupPolicy()}
	c.stats.Skipped = map[SkipReason]uint64{}
	c.reset()
	return c
}

func (c *Converter) reset() {
	c.engines = map[uint64]entry{}
	c.contents = map[uint64]uint32{}
	c.deferred = map[uint64][]uint64{}
}

// KeepTiers makes the converter follow the engine's events of the lower
// storage tiers ts (vLLM's KV offloading and KVBM report CPU and DISK
// media, SGLang HiCache STORAGE: router.TierOfMedium) instead of skipping
// them: they are published with their tier, and every reset clears them
// too. Call it before the first event. Unknown media are always skipped.
func (c *Converter) KeepTiers(ts ...router.Tier) {
	for _, t := range ts {
		if t == router.TierDevice || !t.Valid() || c.lower[t] != nil {
			continue
		}
		l := NewConverter(c.blockSize, c.maxEntries)
		l.fallback, l.tier, l.groups = c, t, c.groups
		c.lower[t] = l
	}
}

// Len is the number of engine hashes the converter holds, every tier.
func (c *Converter) Len() int {
	n := len(c.engines)
	for _, l := range c.lower {
		if l != nil {
			n += len(l.engines)
		}
	}
	return n
}

// Stats returns a copy of the counters, every tier's summed.
func (c *Converter) Stats() ConverterStats {
	s := c.stats
	s.Group, s.GroupRule = c.groups.followed, c.groups.state
	s.Skipped = make(map[SkipReason]uint64, len(c.stats.Skipped))
	for k, v := range c.stats.Skipped {
		s.Skipped[k] = v
	}
	for _, l := range c.lower {
		if l == nil {
			continue
		}
		s.StoredBlocks += l.stats.StoredBlocks
		s.RemovedBlocks += l.stats.RemovedBlocks
		s.Clears += l.stats.Clears
		s.UnknownRemovals += l.stats.UnknownRemovals
		s.Overflows += l.stats.Overflows
		for k, v := range l.stats.Skipped {
			s.Skipped[k] += v
		}
	}
	return s
}

// Content returns the content hash of an engine hash the converter holds.
func (c *Converter) Content(engine uint64) (uint64, bool) {
	e, ok := c.engines[engine]
	return e.content, ok
}

// Reset forgets the device tier (or this lower tier) and returns the
// cleared event that tells the index so. The engine's "all blocks
// cleared" resets its GPU prefix cache, not its offload tiers, so it
// resets the device tier alone, as Dynamo's router does.
func (c *Converter) Reset() router.KVEvent {
	c.reset()
	c.stats.Clears++
	return router.KVEvent{Kind: router.EventCleared, BlockSize: c.blockSize, Tier: c.tier}
}

// ResetAll is Reset of every tier kept: the stream starts over (a new
// bridge, a restarted engine, lost history) and nothing any tier holds is
// known any more. With no lower tier kept it is [Reset()].
func (c *Converter) ResetAll() []router.KVEvent {
	out := []router.KVEvent{c.Reset()}
	for _, l := range c.lower {
		if l != nil {
			out = append(out, l.Reset())
		}
	}
	return out
}

// Convert applies one engine event and appends the router events it
// becomes to out. A skipped event (or the part of it that was skipped) is
// reported as a *SkipError; the events appended are still to be published.
func (c *Converter) Convert(ev *Event, out []router.KVEvent) ([]router.KVEvent, error) {
	switch ev.Kind {
	case KindAllBlocksCleared:
		return append(out, c.Reset()), nil
	case KindBlockStored, KindBlockRemoved:
		if ev.Medium != "" && ev.Medium != MediumGPU && c.fallback == nil {
			t, ok := router.TierOfMedium(ev.Medium)
			if ok && t != router.TierDevice && c.lower[t] != nil {
				start := len(out)
				out, err := c.lower[t].Convert(ev, out)
				for i := start; i < len(out); i++ {
					out[i].Tier = t
				}
				return out, err
			}
			if !ok || t != router.TierDevice {
				return out, c.skipped(skip(SkipOtherMedium, "%s of medium %q", ev.Kind, ev.Medium))
			}
		}
		var reset bool
		var err *SkipError
		if reset, err = c.groups.decide(ev); reset {
			// The indexed group changed (or none is left): what the index
			// holds came from another group.
			out = append(out, c.Reset())
		}
		if err != nil {
			return out, c.skipped(err)
		}
		if ev.Kind == KindBlockRemoved {
			return c.remove(ev.BlockHashes, out), nil
		}
		return c.store(ev, out)
	}
	return out, c.skipped(skip(SkipUnknownType, "event type %q", ev.Tag))
}

// FollowGroup makes the converter index KV cache group g and no other,
// whatever the events say (WorkerSpec.KVCacheGroup).
func (c *Converter) FollowGroup(g int64) {
	c.groups = groupPolicy{state: GroupConfigured, followed: g, kinds: c.groups.kinds}
	for _, l := range c.lower {
		if l != nil {
			l.groups = c.groups
		}
	}
}

// CountSkip counts an event refused before it reached the converter (a
// layout the decoder refused), so every refusal shows in the same counter.
func (c *Converter) CountSkip(reason SkipReason) { c.stats.Skipped[reason]++ }

func (c *Converter) skipped(e *SkipError) error {
	c.stats.Skipped[e.Reason]++
	return e
}

func (c *Converter) store(ev *Event, out []router.KVEvent) ([]router.KVEvent, error) {
	n := len(ev.BlockHashes)
	if n == 0 {
		return out, nil
	}
	if len(ev.TokenIDs) == 0 && c.fallback != nil {
		// vLLM's offloading connector reports the blocks it offloaded
		// without tokens (and with a block size): the same engine hashes
		// the GPU tier named, whose content the device tier knows.
		return c.storeKnown(ev, out)
	}
	if len(ev.TokenIDs) == 0 && ev.BlockSize == 0 {
		// A store without tokens names blocks the engine described
		// before (another copy): count the copies of those we know.
		unknown := 0
		for _, h := range ev.BlockHashes {
			if e, ok := c.engines[h]; ok {
				e.refs++
				c.engines[h] = e
			} else {
				unknown++
			}
		}
		if unknown > 0 {
			return out, c.skipped(skip(SkipUnknownParent, "token-less store of %d unknown blocks", unknown))
		}
		return out, nil
	}
	if ev.BlockSize != c.blockSize {
		return out, c.skipped(skip(SkipBlockSizeMismatch, "engine block size %d, router block size %d: every block would miss",
			ev.BlockSize, c.blockSize))
	}
	if len(ev.TokenIDs) != n*c.blockSize {
		return out, c.skipped(skip(SkipBadTokens, "%d token ids for %d blocks of %d", len(ev.TokenIDs), n, c.blockSize))
	}
	if ev.Namespaced {
		return out, c.skipped(skip(SkipNamespaced, "%d blocks in a cache namespace (cache_salt %q): no request the router hashes can reuse them", n, ev.CacheSalt))
	}
	if ev.HasLoRAID && ev.LoRAName == "" {
		return out, c.skipped(skip(SkipLoRAWithoutName, "lora_id %d without lora_name (upgrade the engine)", ev.LoRAID))
	}
	var prev uint64
	if ev.HasParent {
		p, ok := c.engines[ev.Parent]
		if !ok && c.fallback != nil {
			p, ok = c.fallback.engines[ev.Parent] // the parent stayed on the GPU
		}
		if !ok {
			return out, c.skipped(skip(SkipUnknownParent, "parent %d of %d blocks", ev.Parent, n))
		}
		prev = p.content
	}
	seed := router.LoRASeed(ev.LoRAName)
	kv := router.KVEvent{Kind: router.EventStored, HasParent: ev.HasParent, Parent: ev.Parent,
		BlockSize: c.blockSize, Blocks: make([]router.StoredBlock, n)}
	if c.fallback != nil {
		// A lower tier's blocks are keyed by content alone: their parent
		// may sit in another tier (the index does not check it there).
		kv.HasParent, kv.Parent = false, 0
	}
	var removed []uint64
	for i, h := range ev.BlockHashes {
		local := router.LocalBlockHash(ev.TokenIDs[i*c.blockSize:(i+1)*c.blockSize], seed)
		content := local
		if i > 0 || ev.HasParent {
			content = router.ChainHash(prev, local)
		}
		prev = content
		kv.Blocks[i] = router.StoredBlock{EngineHash: h, ContentHash: content}
		removed = c.hold(h, content, removed)
	}
	c.stats.StoredBlocks += uint64(n)
	if len(removed) > 0 {
		// An engine hash renamed to other content: the index drops the
		// old content on its own, the deferred names go with it.
		out = append(out, router.KVEvent{Kind: router.EventRemoved, Removed: removed})
		c.stats.RemovedBlocks += uint64(len(removed))
	}
	out = append(out, kv)
	if len(c.engines) > c.maxEntries {
		c.stats.Overflows++
		out = append(out, c.Reset())
	}
	return out, nil
}

// storeKnown stores, in a lower tier, blocks named by engine hashes only:
// each one's content is this tier's (another copy) or the device tier's.
// Blocks known to neither (the GPU evicted them before the bridge saw
// them stored) are skipped as unknown_parent.
func (c *Converter) storeKnown(ev *Event, out []router.KVEvent) ([]router.KVEvent, error) {
	kv := router.KVEvent{Kind: router.EventStored, BlockSize: c.blockSize}
	var removed []uint64
	unknown := 0
	for _, h := range ev.BlockHashes {
		content, ok := uint64(0), false
		if e, held := c.engines[h]; held {
			content, ok = e.content, true
		} else if e, held := c.fallback.engines[h]; held {
			content, ok = e.content, true
		}
		if !ok {
			unknown++
			continue
		}
		removed = c.hold(h, content, removed)
		kv.Blocks = append(kv.Blocks, router.StoredBlock{EngineHash: h, ContentHash: content})
	}
	c.stats.StoredBlocks += uint64(len(kv.Blocks))
	if len(removed) > 0 {
		out = append(out, router.KVEvent{Kind: router.EventRemoved, Removed: removed})
		c.stats.RemovedBlocks += uint64(len(removed))
	}
	if len(kv.Blocks) > 0 {
		out = append(out, kv)
	}
	if len(c.engines) > c.maxEntries {
		c.stats.Overflows++
		out = append(out, c.Reset())
	}
	if unknown > 0 {
		return out, c.skipped(skip(SkipUnknownParent, "token-less %s-tier store of %d blocks the GPU tier does not know", c.tier, unknown))
	}
	return out, nil
}

// hold records one more copy of engine hash h with content.
func (c *Converter) hold(h, content uint64, removed []uint64) []uint64 {
	if e, ok := c.engines[h]; ok {
		if e.content == content {
			e.refs++
			c.engines[h] = e
			return removed
		}
		// The engine reuses the name for other content: the old block is
		// gone, whatever its copy count said. The index drops the old
		// content itself when it sees the name stored again; names
		// deferred for that content are published so it forgets them too.
		delete(c.engines, h)
		if c.contents[e.content] > 1 {
			c.contents[e.content]--
		} else {
			delete(c.contents, e.content)
			removed = append(removed, c.deferred[e.content]...)
			delete(c.deferred, e.content)
		}
	}
	c.engines[h] = entry{content: content, refs: 1}
	c.contents[content]++
	if d := c.deferred[content]; len(d) > 0 {
		if i := slices.Index(d, h); i >= 0 {
			c.deferred[content] = slices.Delete(d, i, i+1)
		}
	}
	return removed
}

// release drops engine hash h of content. While other engine hashes still
// name the content, h's removal is deferred (the index keys blocks by
// content: removing h would drop the content); with the last one, h and the
// deferred names are appended to removed.
func (c *Converter) release(h, content uint64, removed []uint64) []uint64 {
	if c.contents[content] > 1 {
		c.contents[content]--
		c.deferred[content] = append(c.deferred[content], h)
		return removed
	}
	delete(c.contents, content)
	removed = append(removed, h)
	removed = append(removed, c.deferred[content]...)
	delete(c.deferred, content)
	return removed
}

func (c *Converter) remove(hashes []uint64, out []router.KVEvent) []router.KVEvent {
	var removed []uint64
	for _, h := range hashes {
		e, ok := c.engines[h]
		if !ok {
			c.stats.UnknownRemovals++
			continue
		}
		if e.refs > 1 {
			e.refs--
			c.engines[h] = e
			continue
		}
		delete(c.engines, h)
		removed = c.release(h, e.content, removed)
	}
	if len(removed) == 0 {
		return out
	}
	c.stats.RemovedBlocks += uint64(len(removed))
	return append(out, router.KVEvent{Kind: router.EventRemoved, Removed: removed})
}

// Snapshot is the converter's whole state as events: a cleared event, then
// every block it holds as stored chain roots (the index keys blocks by
// content hash and needs no parent for that), at most maxBlocks a event.
// It answers a resync request: the index ends up exactly where it would be
// had it applied every event. The state itself does not change.
func (c *Converter) Snapshot(maxBlocks int) []router.KVEvent {
	if maxBlocks <= 0 {
		maxBlocks = DefaultMaxEventBlocks
	}
	blocks := make([]router.StoredBlock, 0, len(c.engines))
	for h, e := range c.engines {
		blocks = append(blocks, router.StoredBlock{EngineHash: h, ContentHash: e.content})
	}
	for content, hs := range c.deferred {
		for _, h := range hs {
			blocks = append(blocks, router.StoredBlock{EngineHash: h, ContentHash: content})
		}
	}
	slices.SortFunc(blocks, func(a, b router.StoredBlock) int {
		switch {
		case a.EngineHash < b.EngineHash:
			return -1
		case a.EngineHash > b.EngineHash:
			return 1
		}
		return 0
	})
	c.stats.Clears++
	out := []router.KVEvent{{Kind: router.EventCleared, BlockSize: c.blockSize, Tier: c.tier}}
	for i := 0; i < len(blocks); i += maxBlocks {
		out = append(out, router.KVEvent{Kind: router.EventStored, BlockSize: c.blockSize, Tier: c.tier,
			Blocks: blocks[i:min(i+maxBlocks, len(blocks))]})
	}
	for _, l := range c.lower {
		if l != nil {
			out = append(out, l.Snapshot(maxBlocks)...)
		}
	}
	return out
}

// DefaultMaxEventBlocks is the most blocks (stored or removed) one
// published event carries; longer ones are split (eventbus.Validate
// rejects more than eventbus.DefaultMaxBlocks).
const DefaultMaxEventBlocks = 1024

// Split cuts events with more than maxBlocks blocks into parts; the parts
// of a stored chain are chained to the previous part's last block.
func Split(evs []router.KVEvent, maxBlocks int) []router.KVEvent {
	if maxBlocks <= 0 {
		maxBlocks = DefaultMaxEventBlocks
	}
	need := false
	for i := range evs {
		if len(evs[i].Blocks) > maxBlocks || len(evs[i].Removed) > maxBlocks {
			need = true
			break
		}
	}
	if !need {
		return evs
	}
	out := make([]router.KVEvent, 0, len(evs)+1)
	for _, kv := range evs {
		switch {
		case len(kv.Blocks) > maxBlocks:
			for i := 0; i < len(kv.Blocks); i += maxBlocks {
				part := kv
				part.Blocks = kv.Blocks[i:min(i+maxBlocks, len(kv.Blocks))]
				if i > 0 {
					part.HasParent, part.Parent = true, kv.Blocks[i-1].EngineHash
				}
				out = append(out, part)
			}
		case len(kv.Removed) > maxBlocks:
			for i := 0; i < len(kv.Removed); i += maxBlocks {
				part := kv
				part.Removed = kv.Removed[i:min(i+maxBlocks, len(kv.Removed))]
				out = append(out, part)
			}
		default:
			out = append(out, kv)
		}
	}
	return out
}
