package router

import (
	"slices"
	"sync"
	"time"
)

// ActiveLoad tracks the in-flight requests on every worker: the prompt tokens
// still to prefill and the distinct KV blocks the requests hold (a prefix
// shared by several requests counts once). Requests booked by other replicas
// (replica sync) live here too, tagged with their origin so a silent replica's
// entries can be dropped at once.
type ActiveLoad struct {
	// mu guards the maps and the order below (expiry is set once by
	// NewActiveLoad). Routing, the proxy's PrefillDone/Free and replica
	// sync use one ActiveLoad at once, so every exported method takes it;
	// the *Locked helpers expect it held.
	mu      sync.Mutex
	expiry  time.Duration
	reqs    map[string]*activeRequest
	workers map[WorkerID]*workerLoad
	// holders maps a block to the workers whose in-flight requests hold it:
	// one lookup per prompt block finds the shared blocks of every worker at
	// once, instead of one lookup per block per worker.
	holders map[uint64][]blockHolder
	order   []string // request ids by add time, for expiry (lazily cleaned)
}

type blockHolder struct {
	worker WorkerID
	n      int32 // in-flight requests on worker holding the block
}

type activeRequest struct {
	id            string
	origin        string
	worker        WorkerID
	hashes        []uint64
	prefillTokens int
	prefillDone   bool
	seqs          int // sequences generated (n), at least 1
	added         time.Time
}

type workerLoad struct {
	prefillTokens int
	requests      int // sequences in flight: a request with n > 1 counts n
	blocks        int // distinct blocks held by in-flight requests
}

// WorkerLoad is one worker's load as the cost function sees it.
type WorkerLoad struct {
	ActivePrefillTokens int
	ActiveBlocks        int
	Requests            int
}

// NewActiveLoad returns an empty tracker expiring requests older than expiry
// (0 = never).
func NewActiveLoad(expiry time.Duration) *ActiveLoad {
	return &ActiveLoad{
		expiry:  expiry,
		reqs:    make(map[string]*activeRequest),
		workers: make(map[WorkerID]*workerLoad),
		holders: make(map[uint64][]blockHolder),
	}
}

// Booking is one request's load on one worker.
type Booking struct {
	ID            string
	Origin        string // replica that routed it; "" = this one
	Worker        WorkerID
	Hashes        []uint64 // full-block sequence hashes of the prompt
	PrefillTokens int      // uncached prompt tokens still to compute
	PrefillDone   bool
	// Sequences is the number of sequences the request generates (OpenAI's
	// n): they share the prompt's blocks but each decodes, so the worker's
	// request count grows by n. 0 means 1.
	Sequences int
	Added     time.Time
}

// Add books a request. Re-adding a known id replaces the old booking.
func (a *ActiveLoad) Add(b Booking) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.removeLocked(b.ID)
	r := &activeRequest{
		id: b.ID, origin: b.Origin, worker: b.Worker, hashes: b.Hashes,
		prefillTokens: max(b.PrefillTokens, 0), prefillDone: b.PrefillDone, added: b.Added,
		seqs: max(b.Sequences, 1),
	}
	wl := a.workers[b.Worker]
	if wl == nil {
		wl = &workerLoad{}
		a.workers[b.Worker] = wl
	}
	wl.requests += r.seqs
	if !r.prefillDone {
		wl.prefillTokens += r.prefillTokens
	}
	for _, h := range r.hashes {
		hs := a.holders[h]
		i := holderIndex(hs, b.Worker)
		if i < 0 {
			a.holders[h] = append(hs, blockHolder{worker: b.Worker, n: 1})
			wl.blocks++
		} else {
			hs[i].n++
		}
	}
	a.reqs[b.ID] = r
	a.order = append(a.order, b.ID)
}

// PrefillDone marks a request's first token: its prompt no longer loads the
// worker's prefill. Unknown ids are ignored.
func (a *ActiveLoad) PrefillDone(id string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	r := a.reqs[id]
	if r == nil || r.prefillDone {
		return
	}
	r.prefillDone = true
	a.workers[r.worker].prefillTokens -= r.prefillTokens
}

// Free ends a request (finished, failed or cancelled). Unknown ids are ignored.
func (a *ActiveLoad) Free(id string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.removeLocked(id)
}

// removeLocked: a.mu must be held.
func (a *ActiveLoad) removeLocked(id string) {
	r := a.reqs[id]
	if r == nil {
		return
	}
	delete(a.reqs, id)
	wl := a.workers[r.worker]
	wl.requests -= r.seqs
	if !r.prefillDone {
		wl.prefillTokens -= r.prefillTokens
	}
	for _, h := range r.hashes {
		hs := a.holders[h]
		i := holderIndex(hs, r.worker)
		if i < 0 {
			continue // a hash repeated within one request was already released
		}
		if hs[i].n--; hs[i].n > 0 {
			continue
		}
		wl.blocks--
		if len(hs) == 1 {
			delete(a.holders, h)
		} else {
			hs[i] = hs[len(hs)-1]
			a.holders[h] = hs[:len(hs)-1]
		}
	}
	if wl.requests == 0 && wl.blocks == 0 {
		delete(a.workers, r.worker)
	}
}

// Expire drops requests added more than the expiry before now and returns
// their ids: a lost Free must not pin load forever.
func (a *ActiveLoad) Expire(now time.Time) []string {
	if a.expiry <= 0 {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	var gone []string
	cut := 0
	for _, id := range a.order {
		r := a.reqs[id]
		if r == nil {
			cut++
			continue
		}
		if now.Sub(r.added) <= a.expiry {
			break
		}
		gone = append(gone, id)
		a.removeLocked(id)
		cut++
	}
	a.order = a.order[cut:]
	if len(a.order) > 64 && len(a.order) > 4*len(a.reqs) {
		a.compactLocked()
	}
	return gone
}

// compactLocked drops ids of freed requests from the expiry order.
// a.mu must be held.
func (a *ActiveLoad) compactLocked() {
	live := a.order[:0]
	seen := make(map[string]bool, len(a.reqs))
	for _, id := range a.order {
		if a.reqs[id] != nil && !seen[id] {
			seen[id] = true
			live = append(live, id)
		}
	}
	a.order = live
}

// DropOrigin frees every request booked by origin (a replica gone silent).
func (a *ActiveLoad) DropOrigin(origin string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	var ids []string
	for id, r := range a.reqs {
		if r.origin == origin {
			ids = append(ids, id)
		}
	}
	for _, id := range ids {
		a.removeLocked(id)
	}
	return len(ids)
}

// Load returns w's current load.
func (a *ActiveLoad) Load(w WorkerID) WorkerLoad {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.loadLocked(w)
}

// loadLocked: a.mu must be held.
func (a *ActiveLoad) loadLocked(w WorkerID) WorkerLoad {
	wl := a.workers[w]
	if wl == nil {
		return WorkerLoad{}
	}
	return WorkerLoad{ActivePrefillTokens: wl.prefillTokens, ActiveBlocks: wl.blocks, Requests: wl.requests}
}

func holderIndex(hs []blockHolder, w WorkerID) int {
	for i := range hs {
		if hs[i].worker == w {
			return i
		}
	}
	return -1
}

// NewBlocks is how many of hashes w's in-flight requests do not already hold:
// the decode blocks a request would add there.
func (a *ActiveLoad) NewBlocks(w WorkerID, hashes []uint64) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.newBlocksLocked(w, hashes)
}

// newBlocksLocked: a.mu must be held.
func (a *ActiveLoad) newBlocksLocked(w WorkerID, hashes []uint64) int {
	n := 0
	for _, h := range hashes {
		if holderIndex(a.holders[h], w) < 0 {
			n++
		}
	}
	return n
}

// LoadRow is one worker's load and the blocks a request would add there.
type LoadRow struct {
	WorkerLoad
	NewBlocks int
}

// Rows fills dst with the load of each of workers and the new blocks hashes
// would add on each, under one lock and with one holder lookup per block.
// pos maps each worker to its position in workers.
func (a *ActiveLoad) Rows(workers []WorkerInfo, pos map[WorkerID]int, hashes []uint64, dst []LoadRow) []LoadRow {
	a.mu.Lock()
	defer a.mu.Unlock()
	dst = dst[:0]
	for _, w := range workers {
		dst = append(dst, LoadRow{WorkerLoad: a.loadLocked(w.ID), NewBlocks: len(hashes)})
	}
	for _, h := range hashes {
		for _, hd := range a.holders[h] {
			if i, ok := pos[hd.worker]; ok {
				dst[i].NewBlocks--
			}
		}
	}
	return dst
}

// Bookings lists the requests booked by origin, sorted by id: the full
// active set a replica publishes so peers can repair gaps.
func (a *ActiveLoad) Bookings(origin string) []Booking {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []Booking
	for _, r := range a.reqs {
		if r.origin == origin {
			out = append(out, Booking{ID: r.id, Origin: r.origin, Worker: r.worker, Hashes: r.hashes,
				PrefillTokens: r.prefillTokens, PrefillDone: r.prefillDone, Sequences: r.seqs, Added: r.added})
		}
	}
	slices.SortFunc(out, func(x, y Booking) int {
		switch {
		case x.ID < y.ID:
			return -1
		case x.ID > y.ID:
			return 1
		}
		return 0
	})
	return out
}

// Len is the number of in-flight requests.
func (a *ActiveLoad) Len() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.reqs)
}
