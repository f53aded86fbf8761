package tokenize

import (
	"hash/maphash"
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
// prompt. An entry is one prompt up to its last such place, with the ids
// at each place; an index maps (hash, length, add_special_tokens) of each
// place's prefix to the entry holding it. Entries are evicted least
// recently used first once their bytes pass the budget. Safe for
// concurrent use.
type PrefixCache struct {
	tok    Splitter
	chunk  int
	budget int
	seed   maphash.Seed

	mu         sync.Mutex
	index      map[prefixKey]prefixRef
	head, tail *prefixEntry // most and least recently used
	used       int          // bytes held by entries
}

// PrefixCacheChunk is the distance between a prompt's candidate places:
// 1 KiB, ~150 words of English, so a reused prefix stops at most that far
// before the shared bytes end, and looking one up hashes the prompt once
// with a map lookup per KiB.
const PrefixCacheChunk = 1 << 10

// prefixCacheMaxCuts bounds the places of one prompt: its first 256 KiB
// are cached, the rest is always tokenized.
const prefixCacheMaxCuts = 256

type prefixKey struct {
	sum     uint64
	n       int
	special bool
}

// prefixRef is the entry holding a prefix: its place number i there.
type prefixRef struct {
	e *prefixEntry
	i int
}

// prefixEntry is one prompt up to its last place. Its places are those of
// any prompt with the same bytes up to them: a place is found from the
// bytes up to the chunk it ends, all of which come before the next place.
type prefixEntry struct {
	text       string // the prompt up to its last place
	ids        []uint32
	keys       []prefixKey // each place's key
	counts     []int       // ids before each place
	prev, next *prefixEntry
}

func (e *prefixEntry) size() int { return len(e.text) + 4*len(e.ids) + 40*len(e.keys) }

// NewPrefixCache caches tok's ids within budget bytes (texts and ids)
// with places every chunk bytes.
func NewPrefixCache(tok Splitter, chunk, budget int) *PrefixCache {
	return &PrefixCache{tok: tok, chunk: max(chunk, 1), budget: budget, seed: maphash.MakeSeed(),
		index: map[prefixKey]prefixRef{}}
}

// place is one candidate place of a prompt being encoded.
type place struct {
	key prefixKey
	ids int // ids before it, once known
}

// Encode returns tok.Encode(text), or tok.EncodeSpecial(text) when
// special, reusing the ids of the longest cached prefix.
func (c *PrefixCache) Encode(text string, special bool) []uint32 {
	if len(text) < 2*c.chunk {
		return c.first(text, special)
	}
	places := make([]place, 0, min(len(text)/c.chunk, prefixCacheMaxCuts))
	var h maphash.Hash
	h.SetSeed(c.seed)
	prev := 0
	for at := c.chunk; at <= len(text) && len(places) < cap(places); at += c.chunk {
		p := prev + c.tok.Cut(text[prev:at])
		if p == prev {
			continue
		}
		h.WriteString(text[prev:p])
		places = append(places, place{key: prefixKey{sum: h.Sum64(), n: p, special: special}})
		prev = p
	}
	if len(places) == 0 {
		return c.first(text, special)
	}

	// The longest prefix held: places are looked up in order, each one
	// extending the last, until one is missing.
	hit, ref := -1, prefixRef{}
	c.mu.Lock()
	for i, pl := range places {
		r, ok := c.index[pl.key]
		if !ok {
			break
		}
		hit, ref = i, r
	}
	if hit >= 0 {
		c.touchLocked(ref.e)
	}
	c.mu.Unlock()
	// An entry's fields never change once indexed: read without the
	// lock. Equal hashes are not trusted: the bytes are compared.
	if hit >= 0 && (ref.i != hit || ref.e.text[:places[hit].key.n] != text[:places[hit].key.n]) {
		hit = -1
	}

	var ids []uint32
	from := 0 // bytes whose ids are in ids
	if hit >= 0 {
		n := ref.e.counts[hit]
		ids = make([]uint32, n, n+(len(text)-places[hit].key.n)/4+4)
		copy(ids, ref.e.ids[:n])
		for i := range hit + 1 {
			places[i].ids = ref.e.counts[i] // the same places, the same bytes before them
		}
		from = places[hit].key.n
	} else {
		ids = make([]uint32, 0, len(text)/4+4)
	}
	for i := hit + 1; i < len(places); i++ {
		if from == 0 {
			ids = append(ids, c.first(text[:places[i].key.n], special)...)
		} else {
			ids = c.tok.AppendEncode(ids, text[from:places[i].key.n])
		}
		from = places[i].key.n
		places[i].ids = len(ids)
	}
	last := len(ids)
	ids = c.tok.AppendEncode(ids, text[from:])
	if hit < len(places)-1 {
		c.add(text[:places[len(places)-1].key.n], ids[:last], places)
	}
	return ids
}

func (c *PrefixCache) first(text string, special bool) []uint32 {
	if special {
		return c.tok.EncodeSpecial(text)
	}
	return c.tok.Encode(text)
}

// add caches prefix (ending at the last of places) with its ids: every
// place becomes a key of the new entry, which replaces older entries for
// the places they share.
func (c *PrefixCache) add(prefix string, ids []uint32, places []place) {
	e := &prefixEntry{text: strings.Clone(prefix), ids: append([]uint32(nil), ids...),
		keys: make([]prefixKey, len(places)), counts: make([]int, len(places))}
	for i, pl := range places {
		e.keys[i], e.counts[i] = pl.key, pl.ids
	}
	if e.size() > c.budget {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, k := range e.keys {
		c.index[k] = prefixRef{e: e, i: i}
	}
	c.pushLocked(e)
	c.used += e.size()
	for c.used > c.budget && c.tail != nil {
		c.evictLocked(c.tail)
	}
}

// touchLocked makes e the most recently used. c.mu must be held.
func (c *PrefixCache) touchLocked(e *prefixEntry) {
	if c.head == e || (e.prev == nil && e.next == nil && c.tail != e) {
		return // first already, or evicted
	}
	c.unlinkLocked(e)
	c.pushLocked(e)
}

func (c *PrefixCache) pushLocked(e *prefixEntry) {
	e.prev, e.next = nil, c.head
	if c.head != nil {
		c.head.prev = e
	}
	c.head = e
	if c.tail == nil {
		c.tail = e
	}
}

func (c *PrefixCache) unlinkLocked(e *prefixEntry) {
	if e.prev != nil {
		e.prev.next = e.next
	} else {
		c.head = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else {
		c.tail = e.prev
	}
	e.prev, e.next = nil, nil
}

// evictLocked drops e and the keys that still lead to it. c.mu must be
// held.
func (c *PrefixCache) evictLocked(e *prefixEntry) {
	c.unlinkLocked(e)
	c.used -= e.size()
	for _, k := range e.keys {
		if r, ok := c.index[k]; ok && r.e == e {
			delete(c.index, k)
		}
	}
}

// Len is the number of prompts held (tests, status).
func (c *PrefixCache) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for e := c.head; e != nil; e = e.next {
		n++
	}
	return n
}
