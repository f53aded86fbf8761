package sim

import (
	"fmt"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/router"
)

// Reference cache figures of a workload, independent of any routing policy.
type Reference struct {
	// PooledLRU is the cached-token ratio of the request sequence on one LRU
	// prefix cache holding every worker's blocks together.
	PooledLRU float64
	// Ideal is the cached-token ratio with an infinite cache.
	Ideal float64
	// OneEngine is the cached-token ratio of one engine holding every
	// worker's blocks, running the same requests at the same concurrency
	// (EngineReference); 0 when not computed. Unlike PooledLRU it pays
	// for what running requests pin (their partial last block, their
	// output blocks) and for the order in which requests finish.
	OneEngine float64
}

// EngineReference runs w on one engine of capacity blocks with cfg's engine
// settings (round-robin over that one worker) and returns its cached-token
// ratio over all prompt tokens: what the fleet's capacity caches as one
// engine, with the pins and the finishing order a fleet has too.
func EngineReference(w *workload.Workload, cfg Config, capacity int) (float64, error) {
	cfg.Workers, cfg.KVBlocks = 1, []int{capacity}
	cfg.Router.Mode = router.ModeRoundRobin
	cfg.Progress = nil
	res, err := Run(w, cfg)
	if err != nil {
		return 0, fmt.Errorf("one-engine reference: %w", err)
	}
	var cached, prompt int64
	for i, rr := range res.Requests {
		prompt += int64(w.Requests[i].PromptTokens)
		if rr.Done {
			cached += int64(rr.CachedTokens)
		}
	}
	if prompt == 0 {
		return 0, nil
	}
	return float64(cached) / float64(prompt), nil
}

// ComputeReference processes w's requests in order, one at a time, on a
// single block-level LRU prefix cache of capacity blocks and on an infinite
// cache. Like vLLM, a request takes its cached prefix out of the free queue,
// fills the rest from the queue's head (evicting), and when it finishes frees
// its blocks in reverse order, so its tail is evicted before its prefix; a
// prompt that is entirely cached still recomputes its last block.
func ComputeReference(w *workload.Workload, capacity int) Reference {
	var prompt, pooled, ideal int64
	lru := newLRU(capacity)
	seen := newHashSet()
	for i := range w.Requests {
		r := &w.Requests[i]
		prompt += int64(r.PromptTokens)
		pooled += int64(cachedTokens(lru.admit(r.Hashes), r, w.BlockSize))

		m := 0
		for m < len(r.Hashes) {
			if !seen.has(r.Hashes[m]) {
				break
			}
			m++
		}
		ideal += int64(cachedTokens(m, r, w.BlockSize))
		for _, h := range r.Hashes[m:] {
			seen.add(h)
		}
	}
	if prompt == 0 {
		return Reference{}
	}
	return Reference{PooledLRU: float64(pooled) / float64(prompt), Ideal: float64(ideal) / float64(prompt)}
}

// cachedTokens converts m matched blocks into cached tokens; a fully cached
// prompt still computes its last block (an engine must run at least one
// token to produce the first output token).
func cachedTokens(m int, r *workload.Request, bs int) int {
	if m > 0 && m*bs >= r.PromptTokens {
		m--
	}
	return m * bs
}

// lru is a block-level prefix cache: a hash → node map and a free queue
// (evicted from the head, freed blocks appended at the tail).
type lru struct {
	capacity int
	byHash   *blockMap
	nodes    []lruNode // node 0 is the queue's sentinel
	inUse    []int32   // scratch: the current request's nodes
}

type lruNode struct {
	hash       uint64
	prev, next int32
}

func newLRU(capacity int) *lru {
	return &lru{capacity: capacity, byHash: newBlockMap(min(capacity, 1<<20)), nodes: make([]lruNode, 1)}
}

// match is the number of leading hashes cached.
func (c *lru) match(hashes []uint64) int {
	m := 0
	for m < len(hashes) {
		if _, ok := c.byHash.get(hashes[m]); !ok {
			break
		}
		m++
	}
	return m
}

func (c *lru) unlink(n int32) {
	p, q := c.nodes[n].prev, c.nodes[n].next
	c.nodes[p].next, c.nodes[q].prev = q, p
}

func (c *lru) pushTail(n int32) {
	last := c.nodes[0].prev
	c.nodes[n].prev, c.nodes[n].next = last, 0
	c.nodes[last].next = n
	c.nodes[0].prev = n
}

// admit runs one request through the cache: hold every block (cached ones
// leave the free queue, missing ones are allocated, evicting the queue's
// head), then free them tail first. It returns how many leading blocks were
// cached on arrival.
func (c *lru) admit(hashes []uint64) int {
	c.inUse = c.inUse[:0]
	m := -1
	for i, h := range hashes {
		if n, ok := c.byHash.get(h); ok {
			c.unlink(n)
			c.inUse = append(c.inUse, n)
			continue
		}
		if m < 0 {
			m = i
		}
		n := c.alloc()
		if n < 0 {
			break // the request alone overflows the cache: the rest is not cached
		}
		c.nodes[n].hash = h
		c.byHash.put(h, n)
		c.inUse = append(c.inUse, n)
	}
	for i := len(c.inUse) - 1; i >= 0; i-- {
		c.pushTail(c.inUse[i])
	}
	if m < 0 {
		m = len(hashes)
	}
	return m
}

// alloc returns a node for a new block, evicting the least recently freed
// block when the cache is full; -1 when every block is held.
func (c *lru) alloc() int32 {
	if len(c.nodes)-1 < c.capacity {
		c.nodes = append(c.nodes, lruNode{}) // the sentinel's zero links are an empty queue
		return int32(len(c.nodes) - 1)
	}
	head := c.nodes[0].next
	if head == 0 {
		return -1
	}
	c.unlink(head)
	c.byHash.del(c.nodes[head].hash)
	return head
}
