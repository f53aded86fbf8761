package tokenize

import (
	"strings"
	"sync"
)

// wordCache remembers the ids of recently seen pre-tokens. Prompts repeat
// words heavily (system prompts, chat markup, code), and BPE on a cache hit
// is a map lookup instead of a merge loop. It belongs to one tokenizer (ids
// are only meaningful for that vocab) and is safe for concurrent use.
type wordCache struct {
	mu  sync.RWMutex // guards m (max is set once); hits take it for reading
	m   map[string][]uint32
	max int
}

const (
	cacheEntries = 1 << 16
	// Long words are rare and would pin memory; HF skips them too.
	cacheMaxWord = 256
)

func newWordCache(max int) *wordCache {
	return &wordCache{m: make(map[string][]uint32), max: max}
}

// get returns the cached ids; the slice must not be modified.
func (c *wordCache) get(word string) ([]uint32, bool) {
	c.mu.RLock()
	ids, ok := c.m[word]
	c.mu.RUnlock()
	return ids, ok
}

// put stores ids (which the cache now owns). When full the cache starts
// over: simpler than LRU, bounded, and it adapts when the traffic's
// vocabulary shifts, which a fill-once cache would not.
func (c *wordCache) put(word string, ids []uint32) {
	if len(word) > cacheMaxWord {
		return
	}
	c.mu.Lock()
	if len(c.m) >= c.max {
		c.m = make(map[string][]uint32, c.max/4)
	}
	// Clone: word is a substring of the caller's prompt, and a map key
	// would otherwise keep the whole prompt alive.
	c.m[strings.Clone(word)] = ids
	c.mu.Unlock()
}
