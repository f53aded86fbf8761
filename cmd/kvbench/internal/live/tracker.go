package live

import (
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// Tracker follows the event cursors (last_event_id) of a set of workers on
// every replica, as the replicas' /cluster/status reports them, and keeps
// each replica's history of cursor values with the time they were first
// seen. From it, the time an event became visible on a replica is the first
// observation whose cursor reached the event's id; on every replica, the
// latest of those.
//
// Observation times are when the status answer arrived, so a visibility
// time is an upper bound, late by at most one poll period plus the status
// request's own latency.
type Tracker struct {
	workers  []string
	index    map[string]int
	replicas int

	mu     sync.Mutex
	hist   [][][]Obs // [replica][worker] increasing cursors
	blocks [][]int   // [replica][worker] latest block count
	polls  []PollStats

	// minCursor[w] is the lowest latest cursor over replicas (lock-free
	// reads for the publishers' back-pressure).
	minCursor []atomic.Uint64
}

// Obs is one observed cursor value.
type Obs struct {
	Cursor uint64
	At     time.Time
}

// PollStats describe one replica's polling.
type PollStats struct {
	Polls    int
	Errors   int
	TotalRTT time.Duration
	MaxRTT   time.Duration
	First    time.Time
	Last     time.Time
}

// MeanRTT is the mean status round trip.
func (p PollStats) MeanRTT() time.Duration {
	if p.Polls == 0 {
		return 0
	}
	return p.TotalRTT / time.Duration(p.Polls)
}

// MeanPeriod is the mean time between two answers: the resolution of the
// visibility times.
func (p PollStats) MeanPeriod() time.Duration {
	if p.Polls < 2 {
		return 0
	}
	return p.Last.Sub(p.First) / time.Duration(p.Polls-1)
}

// NewTracker tracks workers on n replicas.
func NewTracker(workers []string, replicas int) *Tracker {
	t := &Tracker{workers: workers, index: map[string]int{}, replicas: replicas,
		hist: make([][][]Obs, replicas), blocks: make([][]int, replicas),
		polls: make([]PollStats, replicas), minCursor: make([]atomic.Uint64, len(workers))}
	for i, w := range workers {
		t.index[w] = i
	}
	for r := range replicas {
		t.hist[r] = make([][]Obs, len(workers))
		t.blocks[r] = make([]int, len(workers))
	}
	return t
}

// Observe records replica r's status answer, received at `at` after rtt.
// A nil status counts a failed poll.
func (t *Tracker) Observe(r int, at time.Time, rtt time.Duration, st *Status) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := &t.polls[r]
	if st == nil {
		p.Errors++
		return
	}
	p.Polls++
	p.TotalRTT += rtt
	p.MaxRTT = max(p.MaxRTT, rtt)
	if p.First.IsZero() {
		p.First = at
	}
	p.Last = at
	for _, w := range st.Workers {
		i, ok := t.index[w.ID]
		if !ok || len(w.Ranks) == 0 {
			continue
		}
		c := w.Ranks[0].LastEventID
		h := t.hist[r][i]
		if len(h) == 0 || c > h[len(h)-1].Cursor {
			t.hist[r][i] = append(h, Obs{Cursor: c, At: at})
		}
		t.blocks[r][i] = w.Ranks[0].Blocks
	}
	for i := range t.workers {
		lo := uint64(0)
		for rr := range t.replicas {
			h := t.hist[rr][i]
			if len(h) == 0 {
				lo = 0
				break
			}
			if rr == 0 || h[len(h)-1].Cursor < lo {
				lo = h[len(h)-1].Cursor
			}
		}
		t.minCursor[i].Store(lo)
	}
}

// MinCursor is worker i's lowest cursor over the replicas (0 until every
// replica has reported it).
func (t *Tracker) MinCursor(i int) uint64 { return t.minCursor[i].Load() }

// VisibleOn is when replica r first showed worker i's cursor at or past id.
func (t *Tracker) VisibleOn(r, i int, id uint64) (time.Time, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.visibleOnLocked(r, i, id)
}

func (t *Tracker) visibleOnLocked(r, i int, id uint64) (time.Time, bool) {
	h := t.hist[r][i]
	k := sort.Search(len(h), func(k int) bool { return h[k].Cursor >= id })
	if k == len(h) {
		return time.Time{}, false
	}
	return h[k].At, true
}

// Visible is when worker i's event id was visible on every replica.
func (t *Tracker) Visible(i int, id uint64) (time.Time, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var latest time.Time
	for r := range t.replicas {
		at, ok := t.visibleOnLocked(r, i, id)
		if !ok {
			return time.Time{}, false
		}
		if at.After(latest) {
			latest = at
		}
	}
	return latest, true
}

// Polls returns each replica's polling figures.
func (t *Tracker) Polls() []PollStats {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]PollStats(nil), t.polls...)
}

// Sample is one published event whose visibility is measured.
type Sample struct {
	Worker int // index into the tracker's workers
	ID     uint64
	Sent   time.Time
}

// Latencies returns, in milliseconds, publish-to-visible-everywhere of each
// sample that became visible, and how many did not.
func (t *Tracker) Latencies(samples []Sample) (ms []float64, invisible int) {
	ms = make([]float64, 0, len(samples))
	for _, s := range samples {
		at, ok := t.Visible(s.Worker, s.ID)
		if !ok {
			invisible++
			continue
		}
		ms = append(ms, float64(at.Sub(s.Sent))/float64(time.Millisecond))
	}
	return ms, invisible
}
