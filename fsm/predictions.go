package fsm

import (
	"cmp"
	"slices"
	"strings"

	"github.com/kvrouter/kvrouter/router"
)

// predEntry is one prediction's expiry. The heap may hold entries that no
// longer match state.preds (the prediction was refreshed or its worker left);
// expiry recognises and skips them.
type predEntry struct {
	until int64
	key   router.WorkerID
	hash  uint64
}

// predHeap is a binary min-heap by until. Which of several equal-time
// entries pops first does not matter: a Tick expires all of them, and
// removals from the index commute.
type predHeap []predEntry

func (h *predHeap) push(e predEntry) {
	*h = append(*h, e)
	s := *h
	i := len(s) - 1
	for i > 0 {
		p := (i - 1) / 2
		if s[p].until <= s[i].until {
			break
		}
		s[p], s[i] = s[i], s[p]
		i = p
	}
}

func (h *predHeap) pop() predEntry {
	s := *h
	top := s[0]
	n := len(s) - 1
	s[0] = s[n]
	s[n] = predEntry{}
	s = s[:n]
	s.down(0)
	*h = s
	return top
}

func (h predHeap) down(i int) {
	n := len(h)
	for {
		l := 2*i + 1
		if l >= n {
			return
		}
		m := l
		if r := l + 1; r < n && h[r].until < h[l].until {
			m = r
		}
		if h[i].until <= h[m].until {
			return
		}
		h[i], h[m] = h[m], h[i]
		i = m
	}
}

// rebuildHeap makes the heap hold exactly the live predictions, in an
// order that depends only on the state (not on map iteration).
func (st *state) rebuildHeap() {
	h := make(predHeap, 0, st.live)
	for key, m := range st.preds {
		for hash, until := range m {
			h = append(h, predEntry{until: until, key: key, hash: hash})
		}
	}
	slices.SortFunc(h, func(a, b predEntry) int {
		return cmp.Or(cmp.Compare(a.until, b.until), strings.Compare(string(a.key), string(b.key)), cmp.Compare(a.hash, b.hash))
	})
	st.heap = h // sorted ascending is a valid min-heap
}

// compactHeap drops stale entries once they outnumber the live ones, so
// refreshed predictions cannot grow the heap without bound.
func (st *state) compactHeap() {
	if len(st.heap) > 2*st.live+1024 {
		st.rebuildHeap()
	}
}
