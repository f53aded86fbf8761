package router

import (
	"math"
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
	// held counts the holders' keys by their hash's low 16 bits (a
	// counting filter, saturating at 255: a full counter stays full):
	// 0 says a block has no holder without a map lookup, which is the
	// answer for most of a prompt's blocks on the decision path. Made
	// with the first key.
	held []uint8
	// spare holds the holder lists of keys that left holders, emptied,
	// for Add to reuse: a request brings about one new key per prompt
	// block, each an allocation otherwise (issue 31: the proxy's path).
	// At most maxSpareHolders.
	spare [][]blockHolder
	order []string // request ids by add time, for expiry (lazily cleaned)
	// tracked counts the requests with output blocks booked (every
	// workerLoad.tracked together): 0 lets kv-pooled skip them at once.
	tracked int
	// workersGen counts the changes of the workers map's keys (a worker's
	// first booking, its last one ending): a LoadRowsCache built at this
	// generation still points at the right workerLoads.
	workersGen uint64
}

type blockHolder struct {
	worker WorkerID
	n      int32 // in-flight requests on worker holding the block
	// decay is how much of the block no longer counts (1 − Dynamo's
	// decay fraction), set by output tracking (SetOutput) while one
	// request held it alone. Like Dynamo's it stays when the block becomes
	// shared afterwards; 0 (the zero value) is a whole block.
	decay float32
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
	firstToken    time.Time      // PrefillDoneAt's time; zero: unknown (PrefillDone), kv-pooled's wait uses added
	promptTokens  int            // prompt length: where the output blocks start
	expected      int            // expected output tokens per sequence (0: unknown)
	out           OutputProgress // output blocks tracked so far (SetOutput)
	outDecay      float64        // out's decay: each of its blocks counts 1 − outDecay
}

type workerLoad struct {
	prefillTokens int
	requests      int // sequences in flight: a request with n > 1 counts n
	blocks        int // distinct blocks held by in-flight requests
	// Output tracking (Dynamo's --router-track-output-blocks): the
	// placeholder blocks of the requests' outputs, and how much the decay
	// toward the expected output takes off prompt and output blocks.
	// ActiveBlocks = round(blocks + outBlocks − decayed), as Dynamo rounds
	// its fractional sum. decayed is reset to exactly 0 when no decayed
	// entry (nDecayed: prompt blocks and requests' outputs) is left, so
	// float drift never outlives the requests that caused it and a worker
	// without output tracking counts whole blocks exactly.
	outBlocks int
	decayed   float64
	nDecayed  int
	// tracked holds the worker's requests with output blocks booked, for
	// kv-pooled's decode reserve (trackedOutputs); nil until one is.
	tracked map[*activeRequest]struct{}
	// reqs holds the worker's requests, for kv-pooled's expected wait
	// (runningFrees): which of them decode and when they end.
	reqs map[*activeRequest]struct{}
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
	// PromptTokens is the prompt's length, where output blocks start
	// (Router.Generated); ExpectedOutput the output tokens per sequence
	// the client announced (nvext.agent_hints.osl; 0: unknown, no decay).
	PromptTokens   int
	ExpectedOutput int
	// Output is the output tracked so far (a re-added or announced
	// booking keeps it); the zero value is none.
	Output OutputProgress
}

// OutputProgress is a request's generated output as output-block tracking
// sees it (Dynamo's --router-track-output-blocks): Blocks placeholder
// blocks (all sequences together) and, for the decay, the tokens each
// sequence had generated when the last of them appeared and the output
// expected. It is absolute, so replaying or repeating it is harmless.
type OutputProgress struct {
	Blocks    int
	Generated int // per sequence, when Blocks last grew
	Expected  int // 0: unknown, blocks count whole
}

// Decay is how much of each of the request's exclusive blocks no longer
// counts: Dynamo's decay fraction is max(0, 1 − generated/expected)
// (lib/llm/src/kv_router/push_router.rs, RequestGuard::on_item), and a
// block counts that fraction, so this is min(1, generated/expected). An
// unknown expectation (0) does not decay, as Dynamo's None does not.
func (o OutputProgress) Decay() float64 {
	if o.Expected <= 0 || o.Generated <= 0 {
		return 0
	}
	return min(1, float64(o.Generated)/float64(o.Expected))
}

// OutputBlocks is how many output blocks a sequence that generated
// generated tokens after a promptTokens-token prompt has started:
// ceil((prompt + generated)/bs) − ceil(prompt/bs), Dynamo's boundary rule.
// The partial last prompt block fills first and is not counted (the
// prompt's full blocks are; Dynamo's prompt hashes are full blocks too).
func OutputBlocks(promptTokens, generated, blockSize int) int {
	if blockSize <= 0 || generated <= 0 {
		return 0
	}
	p := max(promptTokens, 0)
	return (p+generated+blockSize-1)/blockSize - (p+blockSize-1)/blockSize
}

// Add books a request. Re-adding a known id replaces the old booking.
func (a *ActiveLoad) Add(b Booking) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.removeLocked(b.ID)
	r := &activeRequest{
		id: b.ID, origin: b.Origin, worker: b.Worker, hashes: b.Hashes,
		prefillTokens: max(b.PrefillTokens, 0), prefillDone: b.PrefillDone, added: b.Added,
		seqs: max(b.Sequences, 1), promptTokens: max(b.PromptTokens, 0), expected: max(b.ExpectedOutput, 0),
	}
	wl := a.workers[b.Worker]
	if wl == nil {
		wl = &workerLoad{reqs: make(map[*activeRequest]struct{})}
		a.workers[b.Worker] = wl
		a.workersGen++
	}
	wl.reqs[r] = struct{}{}
	wl.requests += r.seqs
	if !r.prefillDone {
		wl.prefillTokens += r.prefillTokens
	}
	for _, h := range r.hashes {
		hs := a.holders[h]
		i := holderIndex(hs, b.Worker)
		if i < 0 {
			if len(hs) == 0 {
				a.holdFilterAdd(h)
				if n := len(a.spare); n > 0 {
					hs, a.spare = a.spare[n-1], a.spare[:n-1]
				}
			}
			a.holders[h] = append(hs, blockHolder{worker: b.Worker, n: 1})
			wl.blocks++
		} else {
			hs[i].n++
		}
	}
	a.reqs[b.ID] = r
	a.order = append(a.order, b.ID)
	if b.Output.Blocks > 0 {
		a.setOutputLocked(r, wl, b.Output)
	}
}

// Generated records that request id has generated tokens output tokens so
// far (all its sequences together) and, when that starts a new output
// block, books it on the worker and returns the new progress with true
// (the caller announces it to the other replicas: at most one message per
// new block, never one per token). blockSize is the model's. Unknown ids
// and progress that starts no block return false.
func (a *ActiveLoad) Generated(id string, tokens, blockSize int) (OutputProgress, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	r := a.reqs[id]
	if r == nil {
		return OutputProgress{}, false
	}
	perSeq := max(tokens, 0) / r.seqs
	o := OutputProgress{Blocks: OutputBlocks(r.promptTokens, perSeq, blockSize) * r.seqs, Generated: perSeq, Expected: r.expected}
	if o.Blocks <= r.out.Blocks {
		return r.out, false
	}
	a.setOutputLocked(r, a.workers[r.worker], o)
	return o, true
}

// SetOutput applies progress another replica announced for request id.
// Progress only grows: a stale or repeated announcement (fewer or as many
// blocks as booked) changes nothing and returns false.
func (a *ActiveLoad) SetOutput(id string, o OutputProgress) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	r := a.reqs[id]
	if r == nil || o.Blocks <= r.out.Blocks {
		return false
	}
	a.setOutputLocked(r, a.workers[r.worker], o)
	return true
}

// setOutputLocked replaces r's output progress on its worker wl. As
// Dynamo's add_output_block does, the decay is applied to every block r
// holds alone at this moment, prompt and output, and stays on a prompt
// block that becomes shared later. a.mu must be held.
func (a *ActiveLoad) setOutputLocked(r *activeRequest, wl *workerLoad, o OutputProgress) {
	o.Blocks, o.Generated, o.Expected = max(o.Blocks, 0), max(o.Generated, 0), max(o.Expected, 0)
	a.dropOutputLocked(r, wl)
	r.out, r.outDecay = o, o.Decay()
	wl.outBlocks += o.Blocks
	if o.Blocks > 0 {
		if wl.tracked == nil {
			wl.tracked = make(map[*activeRequest]struct{})
		}
		wl.tracked[r] = struct{}{}
		a.tracked++
	}
	if r.outDecay > 0 && o.Blocks > 0 {
		wl.decayed += float64(o.Blocks) * r.outDecay
		wl.nDecayed++
	}
	if r.outDecay == 0 {
		return // Dynamo's None: no fraction is set
	}
	d := float32(r.outDecay)
	for _, h := range r.hashes {
		hs := a.holders[h]
		i := holderIndex(hs, r.worker)
		if i < 0 || hs[i].n != 1 || hs[i].decay == d {
			continue
		}
		if hs[i].decay == 0 {
			wl.nDecayed++
		}
		wl.decayed += float64(d) - float64(hs[i].decay)
		hs[i].decay = d
	}
}

// dropOutputLocked takes r's output blocks off wl. a.mu must be held.
func (a *ActiveLoad) dropOutputLocked(r *activeRequest, wl *workerLoad) {
	wl.outBlocks -= r.out.Blocks
	if r.out.Blocks > 0 {
		delete(wl.tracked, r)
		a.tracked--
	}
	if r.outDecay > 0 && r.out.Blocks > 0 {
		wl.decayed -= float64(r.out.Blocks) * r.outDecay
		wl.nDecayed--
	}
	r.out, r.outDecay = OutputProgress{}, 0
	if wl.nDecayed == 0 {
		wl.decayed = 0
	}
}

// PrefillDone marks a request's first token: its prompt no longer loads the
// worker's prefill. Unknown ids are ignored.
func (a *ActiveLoad) PrefillDone(id string) { a.PrefillDoneAt(id, time.Time{}) }

// PrefillDoneAt is PrefillDone at a known time (the caller's clock): the
// request's decode started then, which kv-pooled's expected wait reads. A
// repeated call changes nothing; a zero time is PrefillDone.
func (a *ActiveLoad) PrefillDoneAt(id string, now time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	r := a.reqs[id]
	if r == nil || r.prefillDone {
		return
	}
	r.prefillDone, r.firstToken = true, now
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
	delete(wl.reqs, r)
	wl.requests -= r.seqs
	if !r.prefillDone {
		wl.prefillTokens -= r.prefillTokens
	}
	a.dropOutputLocked(r, wl)
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
		if hs[i].decay != 0 {
			wl.decayed -= float64(hs[i].decay)
			if wl.nDecayed--; wl.nDecayed == 0 {
				wl.decayed = 0
			}
		}
		if len(hs) == 1 {
			delete(a.holders, h)
			a.holdFilterDrop(h)
			if len(a.spare) < maxSpareHolders {
				clear(hs)
				a.spare = append(a.spare, hs[:0])
			}
		} else {
			hs[i] = hs[len(hs)-1]
			a.holders[h] = hs[:len(hs)-1]
		}
	}
	if wl.requests == 0 && wl.blocks == 0 {
		delete(a.workers, r.worker)
		a.workersGen++
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
func (a *ActiveLoad) loadLocked(w WorkerID) WorkerLoad { return a.workers[w].load() }

// load is the worker's load (nil: none). Its ActiveLoad's mu must be held.
func (wl *workerLoad) load() WorkerLoad {
	if wl == nil {
		return WorkerLoad{}
	}
	return WorkerLoad{ActivePrefillTokens: wl.prefillTokens, ActiveBlocks: wl.activeBlocks(), Requests: wl.requests}
}

// activeBlocks is the worker's active blocks as Dynamo counts them: the
// distinct prompt blocks plus the output blocks, less the decay, rounded.
func (wl *workerLoad) activeBlocks() int {
	if wl.nDecayed == 0 {
		return wl.blocks + wl.outBlocks
	}
	return max(int(math.Round(float64(wl.blocks+wl.outBlocks)-wl.decayed)), 0)
}

const holdFilterMask = 1<<16 - 1

// maxSpareHolders bounds ActiveLoad.spare: the blocks of a few dozen
// requests in flight, ~200 KiB.
const maxSpareHolders = 4096

// holdFilterAdd counts a new key of holders. a.mu must be held.
func (a *ActiveLoad) holdFilterAdd(h uint64) {
	if a.held == nil {
		a.held = make([]uint8, holdFilterMask+1)
	}
	if c := &a.held[h&holdFilterMask]; *c < 255 {
		*c++
	}
}

// holdFilterDrop uncounts a key that left holders; a saturated counter
// stays (it no longer knows its count). a.mu must be held.
func (a *ActiveLoad) holdFilterDrop(h uint64) {
	if c := &a.held[h&holdFilterMask]; *c < 255 {
		*c--
	}
}

// mayHold is false when no in-flight request holds h (true: look it up).
// a.mu must be held.
func (a *ActiveLoad) mayHold(h uint64) bool {
	return a.held != nil && a.held[h&holdFilterMask] != 0
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
func (a *ActiveLoad) Rows(workers []WorkerInfo, pos map[WorkerID]int, hashes []uint64, dst []LoadRow) []LoadRow {
	return a.RowsCached(workers, pos, hashes, dst, nil)
}

// LoadRowsCache remembers, for one list of workers, each one's load entry,
// so RowsCached reads a fleet's loads without a lookup by id while no
// worker's load appeared or went away. The zero value is empty; Reset it
// when the list of workers changes. A router owns one (under its lock).
type LoadRowsCache struct {
	valid bool
	gen   uint64        // ActiveLoad.workersGen it was built at
	wls   []*workerLoad // parallel to the workers; nil: no load
}

// Reset forgets the cached entries (the workers changed).
func (c *LoadRowsCache) Reset() { c.valid = false }

// RowsCached is Rows reading the workers' entries through cache (nil: by
// id, as Rows), rebuilt when stale.
func (a *ActiveLoad) RowsCached(workers []WorkerInfo, pos map[WorkerID]int, hashes []uint64, dst []LoadRow, cache *LoadRowsCache) []LoadRow {
	a.mu.Lock()
	defer a.mu.Unlock()
	dst = slices.Grow(dst[:0], len(workers))[:len(workers)]
	if cache != nil {
		if !cache.valid || cache.gen != a.workersGen || len(cache.wls) != len(workers) {
			cache.wls = slices.Grow(cache.wls[:0], len(workers))[:len(workers)]
			for i, w := range workers {
				cache.wls[i] = a.workers[w.ID]
			}
			cache.valid, cache.gen = true, a.workersGen
		}
		for i, wl := range cache.wls {
			dst[i] = LoadRow{WorkerLoad: wl.load(), NewBlocks: len(hashes)}
		}
	} else {
		for i, w := range workers {
			dst[i] = LoadRow{WorkerLoad: a.loadLocked(w.ID), NewBlocks: len(hashes)}
		}
	}
	if len(a.holders) == 0 {
		return dst
	}
	for _, h := range hashes {
		if !a.mayHold(h) {
			continue
		}
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
				PrefillTokens: r.prefillTokens, PrefillDone: r.prefillDone, Sequences: r.seqs, Added: r.added,
				PromptTokens: r.promptTokens, ExpectedOutput: r.expected, Output: r.out})
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
