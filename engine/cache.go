package engine

// The paged KV cache, modeled on vLLM v1's BlockPool: a fixed array of
// blocks, a free queue (doubly linked list) from whose head new blocks are
// taken, and a map from content hash to the block caching it. A free block
// keeps its hash (and stays a prefix-cache hit) until it is taken from the
// head of the queue for reuse: that is the eviction. Blocks held by running
// requests have ref > 0 and are not in the queue, so they are never evicted.

const nilBlock int32 = -1

type block struct {
	hash   uint64 // content (sequence) hash, valid when cached
	ehash  uint64 // the engine's name for the block, valid when cached
	depth  int32  // position in its chain (0 = first block of a prompt)
	ref    int32  // running requests holding the block
	prev   int32  // free-queue links
	next   int32
	cached bool
	free   bool
}

type pool struct {
	blocks   []block // len = capacity + 1; the last one is the queue sentinel
	sentinel int32
	nfree    int
	ncached  int
	byHash   map[uint64]int32
	evicted  []uint64 // engine hashes evicted since the caller last took them
}

func newPool(capacity int) *pool {
	p := &pool{
		blocks:   make([]block, capacity+1),
		sentinel: int32(capacity),
		byHash:   make(map[uint64]int32, capacity),
	}
	s := p.sentinel
	p.blocks[s].prev, p.blocks[s].next = s, s
	for i := int32(0); i < s; i++ {
		p.pushTail(i)
	}
	return p
}

func (p *pool) capacity() int { return len(p.blocks) - 1 }

// pushTail appends free block b at the tail of the queue (evicted last).
func (p *pool) pushTail(b int32) {
	s := p.sentinel
	last := p.blocks[s].prev
	p.blocks[b].prev, p.blocks[b].next = last, s
	p.blocks[last].next = b
	p.blocks[s].prev = b
	p.blocks[b].free = true
	p.nfree++
}

// pushHead puts free block b at the head of the queue (reused first).
func (p *pool) pushHead(b int32) {
	s := p.sentinel
	first := p.blocks[s].next
	p.blocks[b].prev, p.blocks[b].next = s, first
	p.blocks[first].prev = b
	p.blocks[s].next = b
	p.blocks[b].free = true
	p.nfree++
}

// unlink removes free block b from the queue.
func (p *pool) unlink(b int32) {
	blk := &p.blocks[b]
	p.blocks[blk.prev].next = blk.next
	p.blocks[blk.next].prev = blk.prev
	blk.prev, blk.next = nilBlock, nilBlock
	blk.free = false
	p.nfree--
}

// take pops the head of the free queue, evicting its cached content, and
// returns it with ref 1. The caller checked nfree > 0.
func (p *pool) take() int32 {
	b := p.blocks[p.sentinel].next
	p.unlink(b)
	if p.blocks[b].cached {
		p.uncache(b)
		p.evicted = append(p.evicted, p.blocks[b].ehash)
	}
	p.blocks[b].ref = 1
	return b
}

// touch takes a reference on cached block b (a prefix hit), pulling it out
// of the free queue if nobody held it.
func (p *pool) touch(b int32) {
	if p.blocks[b].ref == 0 {
		p.unlink(b)
	}
	p.blocks[b].ref++
}

// release drops one reference; a block nobody holds joins the queue tail.
func (p *pool) release(b int32) {
	p.blocks[b].ref--
	if p.blocks[b].ref == 0 {
		p.pushTail(b)
	}
}

// lookup returns the block caching content hash h.
func (p *pool) lookup(h uint64) (int32, bool) {
	b, ok := p.byHash[h]
	return b, ok
}

// cache registers block b as holding content h under engine name eh.
func (p *pool) cache(b int32, h, eh uint64, depth int) {
	blk := &p.blocks[b]
	blk.hash, blk.ehash, blk.depth, blk.cached = h, eh, int32(depth), true
	p.byHash[h] = b
	p.ncached++
}

func (p *pool) uncache(b int32) {
	blk := &p.blocks[b]
	delete(p.byHash, blk.hash)
	blk.cached = false
	p.ncached--
}

func (p *pool) used() int { return p.capacity() - p.nfree }

// takeEvicted returns the engine hashes evicted since the last call.
func (p *pool) takeEvicted() []uint64 {
	if len(p.evicted) == 0 {
		return nil
	}
	out := p.evicted
	p.evicted = nil
	return out
}
