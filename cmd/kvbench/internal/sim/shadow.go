package sim

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/internal/warmup"
	"github.com/kvrouter/kvrouter/router"
)

// Shadow prefills (issue 29): the router sends a prefill-only copy of a
// request (same prompt, one output token, the output thrown away, never
// seen by the client) to a second worker, off the client's path, when that
// worker has headroom, so that a cache is copied by recomputation before it
// is needed. The engine pays the copy's real prefill (it is an engine
// request like any other, batched with the rest); the router books it on
// the second worker's load like any decision, and frees it when it ends.
//
// Two uses:
//   - drain-shadow (EventDrainShadow): while a worker drains, a bound
//     session's turn still goes to the draining worker (its cache is
//     there) and a shadow of that turn goes to the session's new worker
//     (the holder of most of its prefix, else the policy's choice); when
//     the shadow ends the session moves there, so its next turn hits
//     (each session on its own: a subagent shares its top-level session's
//     binding but not its context). When no shadow can be sent (the new
//     worker has no headroom, or too many shadows are running there) the
//     turn moves at once, as a plain drain moves it. It leaves when it is
//     idle and every session whose latest turn ran there has moved or
//     ended. ShadowPolicy.Eager copies those sessions' latest turns at
//     the drain instead of at their next turns.
//   - shadow warm-up (Config.ShadowWarmUp): instead of steering clients'
//     requests to a cold worker (their TTFT pays for its cache), the
//     router sends it shadows of the duplicated prefixes (two workers or
//     more hold some of it: the hot ones) it does not hold, while the
//     fleet and the worker have headroom, until it is warm; normal routing
//     then finds the prefixes there.
//
// Shadow work is counted per event (EventRecord.Shadow*): copies sent,
// skipped, the prompt tokens they carried, the prompt tokens their engines
// computed (what was not cached there) and that work's prefill time as a
// step of its own would take (a bound: batched, it costs less).

// ShadowPolicy bounds shadow prefills; the zero value takes the defaults.
type ShadowPolicy struct {
	// Headroom is the utilization (warmup.WorkerUtilization: load over
	// the busy thresholds, or active blocks over capacity without any)
	// under which a worker takes a shadow, in the sending router's view;
	// the shadow warm-up also needs the fleet's mean under it.
	Headroom float64
	// Inflight is the most shadows running on one worker at once.
	Inflight int
	// MinHolders (shadow warm-up) is how many workers must hold some of
	// a request's prefix for it to be copied: 1 (the default) copies every
	// prefix held somewhere, 2 only the duplicated (hot) ones.
	MinHolders int
	// FreshShare (shadow warm-up) is the share of new content sent to
	// the warming worker on purpose: requests no other worker holds more
	// of than it does (a new conversation: nothing held beyond what every
	// worker has, a shared system prompt), while it is not busy in the
	// decision's rows and it and the fleet are under Headroom. Copies
	// bring it the prefixes the fleet holds; only new content brings it
	// the conversations whose later turns will hit there, and costs no
	// prefill the fleet would not do anyway (the content is computed
	// somewhere). 0: the policy places new content (kv-pooled: by its
	// rendezvous home, a 1/N share; kv: by load).
	FreshShare float64
	// Eager (drain-shadow) copies, at the drain, the latest turn of every
	// session that ran on the worker (its prompt is what the worker holds
	// for the session's next turn), instead of waiting for each session's
	// next turn: the worker can leave about one turn after the drain. The
	// router must keep each bound session's latest request to do this.
	Eager bool
}

// Defaults of ShadowPolicy.
const (
	DefaultShadowHeadroom   = warmup.DefaultHeadroom
	DefaultShadowInflight   = 8
	DefaultShadowMinHolders = 1
)

func (p ShadowPolicy) withDefaults() ShadowPolicy {
	if p.Headroom == 0 {
		p.Headroom = DefaultShadowHeadroom
	}
	if p.Inflight == 0 {
		p.Inflight = DefaultShadowInflight
	}
	if p.MinHolders == 0 {
		p.MinHolders = DefaultShadowMinHolders
	}
	return p
}

func (p ShadowPolicy) check() error {
	if !(p.FreshShare >= 0 && p.FreshShare <= 1) {
		return fmt.Errorf("shadow fresh share %v: want 0..1: %w", p.FreshShare, ErrConfig)
	}
	if p.Headroom < 0 || p.Inflight < 0 || p.MinHolders < 0 {
		return fmt.Errorf("shadow headroom %v, inflight %d, min holders %d: must not be negative: %w", p.Headroom, p.Inflight, p.MinHolders, ErrConfig)
	}
	return nil
}

// ShadowIDPrefix starts a shadow's engine request id; the rest is the
// copied request's id and a serial.
const ShadowIDPrefix = "shadow/"

// shadowJob is one shadow on its way.
type shadowJob struct {
	turn   int // the request copied
	k      int // the router that booked it
	worker int // where it runs
	sess   int // the session that moves when it ends; -1: none
	rec    int // the event it counts under
	prompt int
}

// shadowState is the shadows running and what they copied.
type shadowState struct {
	policy   ShadowPolicy
	jobs     map[string]shadowJob
	inflight []int        // per worker
	bySess   map[int]bool // sessions with a shadow running
	// moved: sessions of a draining worker whose copy ended, and the
	// worker they moved to (their turns go there from now on).
	moved  map[int]int
	copied map[uint64]bool
	serial int
}

func (h *shadowState) init(s *state, n int) {
	h.policy = s.cfg.Shadow.withDefaults()
	h.jobs = map[string]shadowJob{}
	h.inflight = make([]int, n)
	h.bySess = map[int]bool{}
	h.moved = map[int]int{}
	h.copied = map[uint64]bool{}
}

// headroom reports whether worker w is under the policy's headroom in
// router k's view, once it also runs extra (a warm-up copy's own load:
// a copy the worker had room for before it started could fill its KV
// cache, so that a client's request sent there waited for blocks; zero
// for the drain's copies and the fresh share).
func (h *shadowState) headroom(s *state, k int, w router.WorkerID, extra router.WorkerLoad) bool {
	rt := s.rts[k]
	for _, info := range rt.Workers() {
		if info.ID == w {
			l := rt.Load().Load(w)
			l.ActiveBlocks += extra.ActiveBlocks
			l.ActivePrefillTokens += extra.ActivePrefillTokens
			l.Requests += extra.Requests
			return warmup.WorkerUtilization(rt.Config().Thresholds, info, l) < h.policy.Headroom
		}
	}
	return false
}

// send copies request i to worker target through router k; false when the
// target has no room for it (nothing sent, the skip counted).
func (h *shadowState) send(s *state, k, i, target, sess, rec int) bool {
	id := s.ids[target]
	r := &s.w.Requests[i]
	var extra router.WorkerLoad
	if s.fleet.records[rec].Kind == EventAdd {
		extra = router.WorkerLoad{ActiveBlocks: len(r.Hashes), ActivePrefillTokens: r.PromptTokens, Requests: 1}
	}
	if !s.fleet.routable(target) || h.inflight[target] >= h.policy.Inflight || !h.headroom(s, k, id, extra) {
		s.fleet.records[rec].ShadowSkipped++
		return false
	}
	h.serial++
	sid := fmt.Sprintf("%s%s/%d", ShadowIDPrefix, r.ID, h.serial)
	req := router.Request{ID: sid, Hashes: r.Hashes, Tokens: r.PromptTokens, ExpectedOutputTokens: 1}
	d, err := routeTo(s, k, id, req)
	if err != nil {
		s.fleet.records[rec].ShadowSkipped++
		return false
	}
	s.announce(k, syncMsg{kind: syncBook, booking: router.Booking{
		ID: sid, Origin: fmt.Sprint(k), Worker: d.Worker, Hashes: d.ActiveHashes,
		PrefillTokens: max(r.PromptTokens-d.Overlap*s.w.BlockSize, 0),
	}})
	if err := s.engines[target].Submit(s.now, engine.Request{ID: sid, NumTokens: r.PromptTokens, BlockHashes: r.Hashes, OutputTokens: 1}); err != nil {
		s.rts[k].Free(sid)
		s.announce(k, syncMsg{kind: syncFree, id: sid})
		s.fleet.records[rec].ShadowSkipped++
		return false
	}
	s.dirty[target] = true
	h.jobs[sid] = shadowJob{turn: i, k: k, worker: target, sess: sess, rec: rec, prompt: r.PromptTokens}
	h.inflight[target]++
	if sess >= 0 {
		h.bySess[sess] = true
	}
	er := &s.fleet.records[rec]
	er.Shadows++
	er.ShadowPromptTokens += int64(r.PromptTokens)
	return true
}

// handle takes an engine output of a shadow; false when o is not one.
func (h *shadowState) handle(s *state, o engine.Output) bool {
	if !strings.HasPrefix(o.RequestID, ShadowIDPrefix) {
		return false
	}
	j, ok := h.jobs[o.RequestID]
	if !ok {
		return true
	}
	rt := s.rts[j.k]
	switch o.Kind {
	case engine.FirstToken:
		computed := max(j.prompt-o.CachedTokens, 0)
		er := &s.fleet.records[j.rec]
		er.ShadowPrefillTokens += int64(computed)
		e := s.engines[j.worker]
		er.ShadowPrefillTime += msToDuration(e.Profile().PrefillMs(computed), e.Config().Speedup)
		rt.PrefillDoneAt(o.RequestID, epoch.Add(s.now))
		s.announce(j.k, syncMsg{kind: syncPrefillDone, id: o.RequestID})
	case engine.Finished:
		rt.FinishedAt(o.RequestID, o.OutputTokens, epoch.Add(s.now))
		s.announce(j.k, syncMsg{kind: syncFree, id: o.RequestID})
		h.end(s, o.RequestID, j)
		if j.sess >= 0 {
			// The copy is there: the session's next turn goes there.
			h.moved[j.sess] = j.worker
			s.fleet.records[j.rec].ShadowRebinds++
		}
	}
	return true
}

// end forgets a shadow.
func (h *shadowState) end(s *state, sid string, j shadowJob) {
	delete(h.jobs, sid)
	h.inflight[j.worker]--
	if j.sess >= 0 {
		delete(h.bySess, j.sess)
	}
}

// left forgets the shadows running on worker wi, which left with them
// (their sessions stay where they are bound).
func (h *shadowState) left(s *state, wi int) {
	for sid, j := range h.jobs {
		if j.worker == wi {
			s.rts[j.k].Free(sid)
			s.announce(j.k, syncMsg{kind: syncFree, id: sid})
			h.end(s, sid, j)
		}
	}
}

// msToDuration is ms of step time divided by the engine's speedup.
func msToDuration(ms, speedup float64) time.Duration {
	return time.Duration(ms / speedup * float64(time.Millisecond))
}

// drainTurn routes request i, a turn of a session bound to worker bound,
// which drains with shadows. Sessions move one by one (subagents share
// their top-level session's binding, but each has its own context): a
// session whose copy is on its new worker goes there; one whose copy is
// on its way stays; any other stays too, and a copy of this turn goes to
// its new worker (the holder of most of its prefix, else the policy's
// pick) — or, with no room for a copy, it moves there at once, as a plain
// drain moves it. The binding itself is left to the draining worker: when
// it leaves, the sessions rebind to the holder of their prefix, their
// copy's worker. ok false: no worker took the turn.
func (h *shadowState) drainTurn(s *state, k, i int, bound router.WorkerID, req router.Request) (router.Decision, bool) {
	sess := s.w.Requests[i].Session
	stay := func() (router.Decision, bool) {
		d, err := routeTo(s, k, bound, req)
		return d, err == nil
	}
	if to, ok := h.moved[sess]; ok && s.fleet.routable(to) {
		if d, err := routeTo(s, k, s.ids[to], req); err == nil {
			return d, true
		}
	}
	if h.bySess[sess] {
		return stay()
	}
	target, ok := s.aff.bestHolder(s, req.Hashes)
	if to, moved := h.moved[s.sessionKey(i)]; !ok && moved && s.fleet.routable(to) {
		// No index to ask (a cache-blind policy): a subagent's context
		// starts with its top-level session's, which moved there.
		target, ok = s.ids[to], true
	}
	if !ok {
		probe := req
		probe.Exclude = s.fleet.keepingIDs(s)
		d, err := s.rts[k].Decide(probe, epoch.Add(s.now))
		if err != nil {
			return stay()
		}
		target = d.Worker
	}
	rec := s.fleet.drainRecord(s.byWorker[bound])
	if rec >= 0 && h.send(s, k, i, s.byWorker[target], sess, rec) {
		return stay()
	}
	// No room for a copy: move now, as a plain drain does.
	if d, err := routeTo(s, k, target, req); err == nil {
		h.moved[sess] = s.byWorker[target]
		return d, true
	}
	return stay()
}

// movedTo is where request i's session moved by its copy, or, for a
// session without a copy of its own, its top-level session (a subagent's
// context starts with its parent's); false when neither moved.
func (h *shadowState) movedTo(s *state, i int) (int, bool) {
	if to, ok := h.moved[s.w.Requests[i].Session]; ok {
		return to, true
	}
	to, ok := h.moved[s.sessionKey(i)]
	return to, ok
}

// copyAll (ShadowPolicy.Eager) copies, at the drain recorded at rec, the
// latest turn of each session whose latest turn ran on the drained worker
// to the session's new worker (as drainTurn picks it).
func (h *shadowState) copyAll(s *state, rec int) {
	for _, sess := range s.fleet.records[rec].Sessions {
		i := s.fleet.lastTurn[sess]
		if h.bySess[sess] {
			continue
		}
		hashes := s.w.Requests[i].Hashes
		target, ok := s.aff.bestHolder(s, hashes)
		if !ok {
			probe := router.Request{ID: s.w.Requests[i].ID, Hashes: hashes, Tokens: s.w.Requests[i].PromptTokens, Exclude: s.fleet.keepingIDs(s)}
			d, err := s.rts[0].Decide(probe, epoch.Add(s.now))
			if err != nil {
				continue
			}
			target = d.Worker
		}
		h.send(s, s.owner[i], i, s.byWorker[target], sess, rec)
	}
}

// shadowWarm applies the shadow warm-up to router k's decision d for
// request i while worker w.worker warms (Config.ShadowWarmUp): when the
// request's prefix is held somewhere and the warming worker holds less of
// it than the best holder, a shadow of the request copies it there (once
// per prefix, while the fleet and the worker have headroom); and when d
// sent the request to the warming worker all the same (it is the least
// loaded), the request goes to the policy's choice among the workers
// holding the deepest prefix instead, when one of them is not busy, so the
// client hits and the copy pays for the warming worker's cache. With room
// for clients and a fresh share (above). The decision the request goes by
// is returned.
func (w *warmState) shadowWarm(s *state, k, i int, req router.Request, d router.Decision) router.Decision {
	h := &s.shadow
	id := s.ids[w.worker]
	hashes := s.w.Requests[i].Hashes
	holders, best, mine := 0, 0, 0
	var holder router.WorkerCost
	for _, row := range d.Rows {
		if row.Overlap > 0 {
			holders++
		}
		if row.Worker != id && row.Overlap > best {
			best, holder = row.Overlap, row
		}
		if row.Worker == id {
			mine = row.Overlap
		}
	}
	if d.Worker == id && (h.inflight[w.worker] > 0 &&
		!h.headroom(s, k, id, router.WorkerLoad{ActiveBlocks: len(hashes) - mine, ActivePrefillTokens: req.Tokens - mine*s.w.BlockSize, Requests: 1}) ||
		mine <= best && w.backlogged(d.Rows, id)) {
		// The copies running there leave no room for this request (it
		// would wait for KV blocks), or it holds no more of it than the
		// others and has more prefill queued than one of them: the
		// policy's choice among the others. (kv-pooled fills empty caches
		// first: a burst of four new conversations of 15–40 k tokens went
		// to the new worker at once on the trace, TTFT 1.2–1.9 s against
		// 0.3–0.9 s without the event.)
		rt := s.rts[k]
		rt.Free(req.ID)
		other := req
		other.Exclude = append(slices.Clone(req.Exclude), id)
		if d2, err := rt.Route(other, epoch.Add(s.now)); err == nil {
			s.fleet.records[w.rec].ShadowRedirects++
			return d2
		}
		if d2, err := routeTo(s, k, id, req); err == nil {
			return d2
		}
		return d // cannot happen: it took it a moment ago
	}
	if mine > 0 && mine >= best && h.copied[hashes[mine-1]] {
		return w.useCopy(s, k, req, d)
	}
	if holders == 0 || mine >= best {
		return w.fresh(s, k, req, d) // new content, or nothing the others hold more of
	}
	if holders < h.policy.MinHolders {
		return d
	}
	key := hashes[best-1] // the prefix the holders have
	rt := s.rts[k]
	if !h.copied[key] && w.copyRoom(s) && warmup.Utilization(rt.Config().Thresholds, rt.Workers(), rt.Load().Load) < h.policy.Headroom &&
		h.send(s, k, i, w.worker, -1, w.rec) {
		h.copied[key] = true
	}
	if d.Worker != id || holder.Worker == "" {
		return d
	}
	// The policy's choice among the workers holding the deepest prefix
	// that were not busy in d (not the first of them: when they all hold
	// only a shared system prompt, every request kv-pooled sent to the new
	// worker went to the lowest-numbered one, four at once on the trace,
	// p99 2.4 × the same requests without the event; and not one d found
	// busy: kv-pooled marks busy a worker where the request would wait
	// while another starts it now, which, the new worker excluded, it
	// might no longer), and only a holder that stays under the headroom
	// with the request (as a copy must: a holder not busy in d but full of
	// its clients' blocks made a redirected request wait 0.5–0.96 s for
	// them on the seed-002 shape, a p99 while warming of 1.3–4.8 × steady
	// once the warm-up ran longer; kv had sent it to the idle worker for
	// a reason).
	among := req
	among.Exclude = slices.Clone(req.Exclude)
	free := 0
	for _, row := range d.Rows {
		switch {
		case row.Worker == id || row.Overlap < best || row.Busy ||
			!h.headroom(s, k, row.Worker, router.WorkerLoad{ActiveBlocks: len(hashes) - row.Overlap, ActivePrefillTokens: max(req.Tokens-row.Overlap*s.w.BlockSize, 0), Requests: 1}):
			if !slices.Contains(among.Exclude, row.Worker) {
				among.Exclude = append(among.Exclude, row.Worker)
			}
		case !slices.Contains(req.Exclude, row.Worker):
			free++
		}
	}
	if free == 0 {
		return d
	}
	rt.Free(req.ID)
	if d2, err := rt.Route(among, epoch.Add(s.now)); err == nil {
		s.fleet.records[w.rec].ShadowRedirects++
		return d2
	}
	d2, err := routeTo(s, k, id, req)
	if err != nil {
		return d // cannot happen: it took it a moment ago
	}
	return d2
}

// useCopy sends req, whose prefix a copy brought to the warming worker
// (it holds as much of it as any worker), there instead of d's choice,
// when it is not busy in d's rows, has no prefill backlog and stays under
// the headroom with req (counted as ShadowUsed). Why: a copy is worth its
// prefill only if the requests it was made for hit it. kv-pooled sends a
// prefix held by two workers to its rendezvous home (the home price of the
// request's own new blocks, a few blocks' worth, decides between equal
// holders), which is the old holder three times in four: on the Zipf
// shape the copies of the hottest prefixes sat unused, the later copies
// of colder ones evicted them, and the new worker had 4 requests with a
// held prefix in its first 10 s (kvbench sim, BENCHMARKS.md). kv mostly
// picks the warming worker anyway (the least loaded holder).
func (w *warmState) useCopy(s *state, k int, req router.Request, d router.Decision) router.Decision {
	id := s.ids[w.worker]
	if d.Worker == id || w.backlogged(d.Rows, id) {
		return d
	}
	for _, row := range d.Rows {
		if row.Worker == id && row.Busy {
			return d
		}
	}
	if !s.shadow.headroom(s, k, id, router.WorkerLoad{ActiveBlocks: len(req.Hashes), ActivePrefillTokens: req.Tokens, Requests: 1}) {
		return d
	}
	rt := s.rts[k]
	rt.Free(req.ID)
	if d2, err := routeTo(s, k, id, req); err == nil {
		s.fleet.records[w.rec].ShadowUsed++
		return d2
	}
	d2, err := routeTo(s, k, d.Worker, req)
	if err != nil {
		return d // cannot happen: it took it a moment ago
	}
	return d2
}

// fresh applies ShadowPolicy.FreshShare to router k's decision d for req,
// new content for the warming worker: with that probability, when the
// worker is not busy in d's rows, has no more prefill queued than every
// other worker not busy (backlogged), and it and the fleet are under the
// headroom with req, req goes there instead (counted as steered). The decision
// req goes by is returned.
func (w *warmState) fresh(s *state, k int, req router.Request, d router.Decision) router.Decision {
	h := &s.shadow
	id := s.ids[w.worker]
	if h.policy.FreshShare == 0 || d.Worker == id || w.rng.Float64() >= h.policy.FreshShare || w.backlogged(d.Rows, id) {
		return d
	}
	for _, row := range d.Rows {
		if row.Worker == id && row.Busy {
			return d
		}
	}
	rt := s.rts[k]
	if warmup.Utilization(rt.Config().Thresholds, rt.Workers(), rt.Load().Load) >= h.policy.Headroom || !h.headroom(s, k, id, router.WorkerLoad{ActiveBlocks: len(req.Hashes), ActivePrefillTokens: req.Tokens, Requests: 1}) {
		return d
	}
	rt.Free(req.ID)
	if d2, err := routeTo(s, k, id, req); err == nil {
		s.fleet.records[w.rec].Steered++
		return d2
	}
	d2, err := routeTo(s, k, d.Worker, req)
	if err != nil {
		return d // cannot happen: it took it a moment ago
	}
	return d2
}

// backlogged reports whether, in rows, worker id has prefill queued and
// some other worker not busy has less.
func (w *warmState) backlogged(rows []router.WorkerCost, id router.WorkerID) bool {
	mine := -1
	for _, r := range rows {
		if r.Worker == id {
			mine = r.ActivePrefillTokens
		}
	}
	if mine <= 0 {
		return false
	}
	for _, r := range rows {
		if r.Worker != id && !r.Busy && r.ActivePrefillTokens < mine {
			return true
		}
	}
	return false
}
