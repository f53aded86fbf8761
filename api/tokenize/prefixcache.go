package tokenize

import (
	"hash/maphash"
	"slices"
	"strings"
	"sync"
)

// Splitter is a Tokenizer whose ids can be computed piece by piece: there
// are places in a text after which nothing that follows changes a token
// before, so the ids of a prompt's leading bytes can be kept and reused
// (PrefixCache).
type Splitter interface {
	Tokenizer
	// Cut returns the largest p <= len(s) (0: none) such that a text may
	// be split right after s[:p] wherever s appears in it: for all strings
	// x and y, with a = x + s[:p],
	//
	//	Encode(a + y) == Encode(a) ++ Encode(y)
	//	EncodeSpecial(a + y) == EncodeSpecial(a) ++ Encode(y)
	//
	// It reads only s.
	Cut(s string) int
	// AppendEncode appends Encode(text) to ids.
	AppendEncode(ids []uint32, text string) []uint32
	// A Splitter keeps nothing of the texts it encodes (no cache holding
	// their substrings), so a caller may encode bytes it does not own.
}

// PrefixCache keeps the ids of recent prompts' leading bytes, so a prompt
// that shares its beginning with an earlier one (the same system prompt and
// documents, the previous turns of a conversation) tokenizes only what
// differs. It is exact: a prefix is reused only when its bytes are those
// of the new prompt, compared byte for byte, and only up to a place its
// tokenizer's Cut vouches for, so the ids are those of tokenizing the whole
// prompt (FuzzPrefixCacheMatchesEncode).
//
// Candidate places are one per chunk bytes: Cut of each chunk of the
// prompt. The cache is a tree of places: a node is the piece of a prompt
// between one place and the next, with its ids, under the node of the
// piece before it; an index maps (hash, length, add_special_tokens) of the
// whole prefix up to each place to its node. Prompts that share a prefix
// share its nodes, so a new prompt adds only the pieces after the longest
// prefix found. Nodes are evicted least recently used first once their
// bytes pass the budget; a node is used whenever one below it is, so
// leaves go first. Safe for concurrent use.
type PrefixCache struct {
	tok    Splitter
	chunk  int
	budget int
	seed   maphash.Seed

	mu    sync.Mutex
	index map[prefixKey]*prefixNode
	// seen holds the first place of prompts that found nothing: a prompt
	// is added only when its first KiB comes a second time, so prompts
	// that share nothing cost a plain Encode and a hash, not pieces.
	seen       map[prefixKey]struct{}
	head, tail *prefixNode // most and least recently used
	used       int         // bytes held by nodes
	nodes      int
}

// PrefixCacheChunk is the distance between a prompt's candidate places:
// 1 KiB, ~150 words of English, so a reused prefix stops at most that far
// before the shared bytes end, and looking one up hashes the prompt once
// with a map lookup per KiB.
const PrefixCacheChunk = 1 << 10

// prefixCacheMaxCuts bounds the places of one prompt: its first 256 KiB
// are cached, the rest is always tokenized.
const prefixCacheMaxCuts = 256

// maxSeen bounds PrefixCache.seen (~40 bytes each); full, it starts over.
const maxSeen = 1 << 16

type prefixKey struct {
	sum     uint64
	n       int // the prefix's length: this place
	special bool
}

// prefixNode is one piece of a cached prompt: its bytes from the place
// before (its parent's, 0 for a first piece) to its own, and their ids.
// Its places are those of any prompt with the same bytes up to them: a
// place is found from the bytes of the chunk it ends, all of which come
// before the next place. Fields other than the list links never change
// once the node is indexed.
type prefixNode struct {
	parent     *prefixNode
	key        prefixKey
	depth      int // place number
	from       int // where text starts in the prompt
	text       string
	ids        []uint32
	total      int // ids of the prompt up to this place
	prev, next *prefixNode
	live       bool // in the list (not evicted); mu guards it
}

func (n *prefixNode) size() int { return len(n.text) + 4*len(n.ids) + 128 }

// NewPrefixCache caches tok's ids within budget bytes (texts, ids and
// bookkeeping) with places every chunk bytes.
func NewPrefixCache(tok Splitter, chunk, budget int) *PrefixCache {
	return &PrefixCache{tok: tok, chunk: max(chunk, 1), budget: budget, seed: maphash.MakeSeed(),
		index: map[prefixKey]*prefixNode{}, seen: map[prefixKey]struct{}{}}
}

// Encode returns tok.Encode(text), or tok.EncodeSpecial(text) when
// special, reusing the ids of the longest cached prefix.
func (c *PrefixCache) Encode(text string, special bool) []uint32 {
	if len(text) < 2*c.chunk {
		return c.first(text, special)
	}
	places := make([]prefixKey, 0, min(len(text)/c.chunk, prefixCacheMaxCuts))
	var h maphash.Hash
	h.SetSeed(c.seed)
	prev := 0
	for at := c.chunk; at <= len(text) && len(places) < cap(places); at += c.chunk {
		p := prev + c.tok.Cut(text[prev:at])
		if p == prev {
			continue
		}
		h.WriteString(text[prev:p])
		places = append(places, prefixKey{sum: h.Sum64(), n: p, special: special})
		prev = p
	}
	if len(places) == 0 {
		return c.first(text, special)
	}

	// The longest prefix held: places are looked up in order, each one
	// extending the last, until one is missing.
	var hit *prefixNode
	c.mu.Lock()
	for i, k := range places {
		n := c.index[k]
		if n == nil || n.depth != i {
			break
		}
		hit = n
	}
	firstTime := false
	if hit != nil {
		c.touchLocked(hit)
	} else if _, ok := c.seen[places[0]]; !ok {
		if len(c.seen) >= maxSeen {
			clear(c.seen)
		}
		c.seen[places[0]] = struct{}{}
		firstTime = true
	}
	c.mu.Unlock()
	if firstTime {
		return c.first(text, special)
	}
	// Nodes never change once indexed: read without the lock. Equal
	// hashes are not trusted: the bytes are compared, piece by piece.
	for n := hit; n != nil; n = n.parent {
		if n.key != places[n.depth] || text[n.from:n.key.n] != n.text {
			hit = nil
			break
		}
	}

	var ids []uint32
	from, next := 0, 0 // bytes whose ids are in ids; the first place not held
	if hit != nil {
		ids = make([]uint32, hit.total, hit.total+(len(text)-hit.key.n)/4+4)
		for n := hit; n != nil; n = n.parent {
			copy(ids[n.total-len(n.ids):], n.ids)
		}
		from, next = hit.key.n, hit.depth+1
	} else {
		ids = make([]uint32, 0, len(text)/4+4)
	}
	counts := make([]int, len(places)) // ids up to each new place
	for i := next; i < len(places); i++ {
		if from == 0 {
			ids = append(ids, c.first(text[:places[i].n], special)...)
		} else {
			ids = c.tok.AppendEncode(ids, text[from:places[i].n])
		}
		from = places[i].n
		counts[i] = len(ids)
	}
	if next < len(places) {
		c.add(hit, text, ids, places, counts, next)
	}
	return c.tok.AppendEncode(ids, text[from:])
}

func (c *PrefixCache) first(text string, special bool) []uint32 {
	if special {
		return c.tok.EncodeSpecial(text)
	}
	return c.tok.Encode(text)
}

// add caches the pieces of text after parent (nil: from the start): one
// node per place from places[next] on, counts[i] ids up to place i.
func (c *PrefixCache) add(parent *prefixNode, text string, ids []uint32, places []prefixKey, counts []int, next int) {
	// Each node its own allocation: an evicted one is freed with its
	// text and ids once nothing below it is held.
	nodes := make([]*prefixNode, 0, len(places)-next)
	from, before := 0, 0
	if parent != nil {
		from, before = parent.key.n, parent.total
	}
	for i := next; i < len(places); i++ {
		n := &prefixNode{parent: parent, key: places[i], depth: i, from: from,
			text: strings.Clone(text[from:places[i].n]), ids: slices.Clone(ids[before:counts[i]]), total: counts[i]}
		nodes = append(nodes, n)
		parent, from, before = n, places[i].n, counts[i]
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, n := range nodes {
		c.index[n.key] = n // replaces an older node of the same prefix, if any
		n.live = true
		c.used += n.size()
		c.nodes++
	}
	// Leaves first in the list, then the pieces above them: the list
	// order keeps every node ahead of those below it.
	for i := len(nodes) - 1; i >= 0; i-- {
		c.pushLocked(nodes[i])
	}
	c.touchLocked(nodes[0].parent)
	for c.used > c.budget && c.tail != nil {
		c.evictLocked(c.tail)
	}
}

// touchLocked makes n and the nodes above it the most recently used, the
// first piece first. c.mu must be held.
func (c *PrefixCache) touchLocked(n *prefixNode) {
	for ; n != nil; n = n.parent {
		if !n.live {
			continue // evicted: its ids are still good for those below it
		}
		if c.head != n {
			c.unlinkLocked(n)
			c.pushLocked(n)
		}
	}
}

func (c *PrefixCache) pushLocked(n *prefixNode) {
	n.prev, n.next = nil, c.head
	if c.head != nil {
		c.head.prev = n
	}
	c.head = n
	if c.tail == nil {
		c.tail = n
	}
}

func (c *PrefixCache) unlinkLocked(n *prefixNode) {
	if n.prev != nil {
		n.prev.next = n.next
	} else {
		c.head = n.next
	}
	if n.next != nil {
		n.next.prev = n.prev
	} else {
		c.tail = n.prev
	}
	n.prev, n.next = nil, nil
}

// evictLocked drops n, and its key if it still leads to n. c.mu must be
// held.
func (c *PrefixCache) evictLocked(n *prefixNode) {
	c.unlinkLocked(n)
	n.live = false
	c.used -= n.size()
	c.nodes--
	if c.index[n.key] == n {
		delete(c.index, n.key)
	}
}

// Len is the number of pieces held (tests, status).
func (c *PrefixCache) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes
}
