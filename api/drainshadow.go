package api

import (
	"container/list"
	"context"
	"fmt"
	"hash/fnv"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/router"
)

// Moving a drained worker's sessions by shadow prefills (issue 29;
// DESIGN.md, "Drain by shadow prefills"): with Config.DrainShadow and
// session affinity on, each replica keeps the last request body of every
// bound session whose turn it served (sessionBodies, bounded by bytes,
// least recently used first out). When a drain of worker W commits, the
// replica hears it (DrainWatcher) once its routers dropped W, and for each
// session still bound to W whose body it holds it sends a copy of that
// body (shadowBody: max_tokens 1, not streamed, the answer thrown away) to
// the worker the session's next turn would be rebound to — the holder of
// most of its prefix (ties by the session's rendezvous hash, so replicas
// agree: routeCopy), never W or another drained or dead worker (the
// routers' candidates) — and, when the copy answers,
// rebinds the session there through Raft (BindSession with Replace W, so
// every replica follows). The session's next turn then finds its
// conversation cached on its new worker instead of recomputing it. A copy
// that fails, or a next turn that arrives first (it rebinds as a plain
// drain does, and the copy's rebind then changes nothing), leaves the
// session exactly where a plain drain would. Nothing is sent to W.

// defaultSessionBodiesMaxBytes bounds the kept bodies by default.
const defaultSessionBodiesMaxBytes = 64 << 20

// keptBodyOverhead is what a kept body costs beyond its bytes and hashes
// (the entry, its list element, the map's slot and the strings' headers),
// counted so a flood of tiny bodies stays bounded too.
const keptBodyOverhead = 256

// DrainWatcher is the optional part of a Replica that tells the API when
// a worker's drain commits (fsm.SetWorkerDrain applied here, after the
// routers dropped the worker from their candidates). fn must not block:
// it runs on the replica's apply path.
type DrainWatcher interface {
	OnWorkerDrained(fn func(worker string))
}

// keptBody is a session's last request as this replica routed it.
type keptBody struct {
	session string
	model   string // the router's model (a LoRA adapter's base)
	adapter string // the LoRA adapter named, "" none
	path    string
	body    []byte
	hashes  []uint64
	tokens  int
	size    int64
	kept    time.Time // when this replica routed the turn: the newest turn's replica copies first
}

// sessionBodies holds the last body of each bound session this replica
// served, at most max bytes in all; mu guards the rest.
type sessionBodies struct {
	max     int64
	bound   func(id string) bool // the session still has a binding
	dropped *prometheus.CounterVec

	mu    sync.Mutex
	bytes int64
	byID  map[string]*list.Element // of *keptBody
	lru   *list.List               // most recently kept at the front
}

func newSessionBodies(max int64, bound func(string) bool, reg prometheus.Registerer) *sessionBodies {
	b := &sessionBodies{max: max, bound: bound, byID: map[string]*list.Element{}, lru: list.New(),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_session_bodies_dropped_total",
			Help: "Session bodies kept for drain copies (--router-drain-shadow) dropped, by reason: evicted (over --router-session-bodies-max-bytes, least recently used first), unbound (the session ended or expired), too_large (one body over the bound)."}, []string{"reason"}),
	}
	reg.MustRegister(b.dropped,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvrouter_session_bodies_bytes",
			Help: "Bytes of session bodies this replica keeps for drain copies (bodies, block hashes and a fixed overhead each)."},
			func() float64 { b.mu.Lock(); defer b.mu.Unlock(); return float64(b.bytes) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvrouter_session_bodies",
			Help: "Sessions whose last body this replica keeps for drain copies."},
			func() float64 { b.mu.Lock(); defer b.mu.Unlock(); return float64(b.lru.Len()) }))
	return b
}

// keep stores e as its session's last body, then evicts the least recently
// kept bodies while over the bound, and drops the oldest one if its session
// is no longer bound (one look per keep: expired sessions leave without a
// sweep).
func (b *sessionBodies) keep(e *keptBody) {
	e.size = int64(len(e.body)) + 8*int64(len(e.hashes)) + int64(len(e.session)+len(e.model)+len(e.adapter)+len(e.path)) + keptBodyOverhead
	b.mu.Lock()
	defer b.mu.Unlock()
	b.removeLocked(e.session)
	if e.size > b.max {
		b.dropped.WithLabelValues("too_large").Inc()
		return
	}
	b.byID[e.session] = b.lru.PushFront(e)
	b.bytes += e.size
	for b.bytes > b.max {
		b.removeLocked(b.lru.Back().Value.(*keptBody).session)
		b.dropped.WithLabelValues("evicted").Inc()
	}
	if old := b.lru.Back(); old != nil && old != b.lru.Front() {
		if id := old.Value.(*keptBody).session; !b.bound(id) {
			b.removeLocked(id)
			b.dropped.WithLabelValues("unbound").Inc()
		}
	}
}

// drop forgets a session's body (its binding ended).
func (b *sessionBodies) drop(id string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.removeLocked(id) {
		b.dropped.WithLabelValues("unbound").Inc()
	}
}

// removeLocked removes id's body; b.mu held.
func (b *sessionBodies) removeLocked(id string) bool {
	el, ok := b.byID[id]
	if !ok {
		return false
	}
	b.lru.Remove(el)
	delete(b.byID, id)
	b.bytes -= el.Value.(*keptBody).size
	return true
}

// boundTo is the kept bodies of sessions bound to worker (any of its
// ranks), most recently kept first; bodies of sessions no longer bound
// are dropped on the way.
func (b *sessionBodies) boundTo(worker string, binding func(string) (SessionBinding, bool)) []*keptBody {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []*keptBody
	for el := b.lru.Front(); el != nil; {
		next := el.Next()
		e := el.Value.(*keptBody)
		bd, ok := binding(e.session)
		switch {
		case !ok:
			b.removeLocked(e.session)
			b.dropped.WithLabelValues("unbound").Inc()
		case baseWorker(bd.Worker) == worker:
			out = append(out, e)
		}
		el = next
	}
	return out
}

// baseWorker is a worker id without its DP rank ("w#1" → "w").
func baseWorker(id router.WorkerID) string {
	s, _, _ := strings.Cut(string(id), "#")
	return s
}

// drainCopies is the server's drain-shadow state: the kept bodies, the
// copies' concurrency and their counters.
type drainCopies struct {
	bodies   *sessionBodies
	inflight int
	seq      atomic.Uint64
	sent     prometheus.Counter // kvrouter_drain_copies_total
	failed   prometheus.Counter // kvrouter_drain_copy_failures_total
	moved    prometheus.Counter // kvrouter_drain_sessions_moved_total
	rounds   prometheus.Counter // kvrouter_drain_copy_rounds_total
	timeout  time.Duration
	wg       sync.WaitGroup // drains being handled (tests wait on it)
}

// newDrainCopies turns drain copies on when asked and the replica keeps
// session bindings and reports drains; nil otherwise (logged).
func newDrainCopies(cfg Config, s *Server) *drainCopies {
	if !cfg.DrainShadow {
		return nil
	}
	sr, isSess := s.rep.(SessionReplica)
	dw, isDrain := s.rep.(DrainWatcher)
	if !isSess || !isDrain || sr.SessionAffinity().TTL <= 0 {
		s.log.Warn("--router-drain-shadow needs session affinity (--router-session-affinity-ttl-secs) and worker drains: off")
		return nil
	}
	max := cfg.SessionBodiesMaxBytes
	if max <= 0 {
		max = defaultSessionBodiesMaxBytes
	}
	n := cfg.ShadowInflight
	if n <= 0 {
		n = defaultShadowInflight
	}
	dc := &drainCopies{
		bodies:   newSessionBodies(max, func(id string) bool { _, ok := sr.SessionBinding(id); return ok }, cfg.Registry),
		inflight: n, timeout: shadowTimeout,
		sent: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_drain_copies_total",
			Help: "Shadow prefills this replica sent at worker drains to move a bound session's context to its new worker (--router-drain-shadow), failed ones included."}),
		failed: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_drain_copy_failures_total",
			Help: "Drain copies that failed (no answer, or not 2xx): their sessions move at their next turn, as with a plain drain."}),
		moved: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_drain_sessions_moved_total",
			Help: "Sessions this replica's drain copies moved: its rebind after the copy answered left the session on the copy's worker (a session several replicas copied to the same worker counts on each)."}),
	}
	dc.rounds = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_drain_copy_rounds_total",
		Help: "Worker drains whose session copies this replica finished handling (every kept session bound there copied, skipped or failed; copies wait up to 3 s, staggered by their turn's age)."})
	cfg.Registry.MustRegister(dc.sent, dc.failed, dc.moved, dc.rounds)
	dw.OnWorkerDrained(func(worker string) {
		dc.wg.Add(1)
		go func() {
			defer dc.wg.Done()
			s.moveSessionsByCopy(dc, sr, worker) // dc, not s.drainCopies: New may not have set it yet
		}()
	})
	return dc
}

// keepSessionBody keeps p's body as its session's last when p was routed
// bound (called once an attempt is routed, before it is sent: a drain
// during a long turn copies that turn's prompt): the body a drain would
// copy.
func (s *Server) keepSessionBody(p *prepared) {
	dc := s.drainCopies
	if dc == nil || p.sess == nil || p.sess.worker == "" || p.sess.key.Final || !shadowPaths[p.path] {
		return
	}
	dc.bodies.keep(&keptBody{session: p.sess.key.ID, model: p.model, adapter: p.adapter, path: p.path,
		body: p.body, hashes: p.req.Hashes, tokens: p.req.Tokens, kept: time.Now()})
}

// dropSessionBody forgets an ended session's body.
func (s *Server) dropSessionBody(id string) {
	if s.drainCopies != nil {
		s.drainCopies.bodies.drop(id)
	}
}

// copyOutcome is what one session's copy came to.
type copyOutcome int

const (
	copySkipped    copyOutcome = iota // not bound to the worker any more, model gone, no worker could take it
	copyFailed                        // sent, no 2xx answer
	copyMoved                         // sent, answered, rebound by this replica
	copySuperseded                    // sent and answered, but the binding had moved meanwhile (its next turn, another replica's copy)
)

// Copies staggered by the age of the turn they carry. With a session's
// turns spread over the replicas, every replica holds the last turn it saw
// and would copy it; only the newest matters (the older ones are prefixes
// of it). No replica knows which turn is newest, but each knows how long
// ago it routed its own, and turns of one conversation are ordered in time.
// So a replica waits copyDelay(age) before copying: the newest turn's
// replica starts first, and once its copy answers and the session is
// rebound, the others find it moved and skip (copySkipped). A logarithm
// keeps turns ordered whatever their age (what separates two turns is the
// ratio of their ages) while bounding the wait; a replica that holds the
// newest turn and dies leaves the session to the next one after its wait.
// When the replicas' copies overlap anyway (a copy slower than the gap),
// both go to the same worker (routeCopy), as before the stagger.
const (
	copyDelayScale = 250 * time.Millisecond // the wait per e-fold of a turn's age
	copyDelayAge   = 10 * time.Millisecond  // ages below this hardly wait
	copyDelayMax   = 3 * time.Second
)

// copyDelay is how long a replica waits before copying a turn routed age
// ago: copyDelayScale × ln(1 + age/copyDelayAge), at most copyDelayMax.
// It grows with age, so the newest of a session's turns is copied first.
func copyDelay(age time.Duration) time.Duration {
	if age <= 0 {
		return 0
	}
	d := time.Duration(float64(copyDelayScale) * math.Log1p(float64(age)/float64(copyDelayAge)))
	return min(d, copyDelayMax)
}

// moveSessionsByCopy handles worker's drain: a copy of each kept session
// bound there, at most dc.inflight at once, each after copyDelay of its
// turn's age (most recently active first); one log line with the counts.
func (s *Server) moveSessionsByCopy(dc *drainCopies, sr SessionReplica, worker string) {
	start := time.Now()
	todo := dc.bodies.boundTo(worker, sr.SessionBinding)
	due := make(map[*keptBody]time.Time, len(todo))
	for _, e := range todo {
		due[e] = start.Add(copyDelay(start.Sub(e.kept)))
	}
	slices.SortStableFunc(todo, func(a, b *keptBody) int { return due[a].Compare(due[b]) })
	var counts [4]int
	var mu sync.Mutex
	next := make(chan *keptBody)
	var wg sync.WaitGroup
	for range min(dc.inflight, len(todo)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for e := range next {
				if wait := time.Until(due[e]); wait > 0 {
					time.Sleep(wait) // the stagger itself, not a synchronisation: older turns' replicas let the newest copy first
				}
				o := s.copySession(dc, sr, worker, e)
				mu.Lock()
				counts[o]++
				mu.Unlock()
			}
		}()
	}
	for _, e := range todo {
		next <- e
	}
	close(next)
	wg.Wait()
	dc.rounds.Inc()
	s.log.Info("drain: sessions moved by copy", "worker", worker, "sessions", len(todo),
		"moved", counts[copyMoved], "failed", counts[copyFailed], "superseded", counts[copySuperseded],
		"skipped", counts[copySkipped], "took", time.Since(start))
}

// copySession copies e to the worker its session would be rebound to and
// rebinds the session there once the copy answered.
func (s *Server) copySession(dc *drainCopies, sr SessionReplica, worker string, e *keptBody) copyOutcome {
	b, ok := sr.SessionBinding(e.session)
	if !ok || baseWorker(b.Worker) != worker {
		return copySkipped // its next turn came first, or it ended
	}
	rt, ok := s.rep.Router(e.model)
	if !ok {
		return copySkipped
	}
	ws := rt.Workers()
	var exclude []router.WorkerID
	for _, w := range ws {
		if baseWorker(w.ID) == worker {
			exclude = append(exclude, w.ID) // the routers dropped it already; never send it anything
		}
	}
	if e.adapter != "" {
		_, only, isAdapter := s.rep.Adapter(e.adapter)
		if !isAdapter {
			return copySkipped
		}
		exclude = append(exclude, notServing(ws, only)...)
	}
	req := router.Request{ID: fmt.Sprintf("%s-drain-%d/shadow", s.rep.NodeID(), dc.seq.Add(1)),
		Hashes: e.hashes, Tokens: e.tokens, Sequences: 1, ExpectedOutputTokens: 1, Exclude: exclude}
	d, err := routeCopy(rt, req, e.session, time.Now())
	if err != nil || baseWorker(d.Worker) == worker || slices.Contains(exclude, d.Worker) {
		if err == nil {
			rt.Free(req.ID) // cannot happen (W is no candidate): never send it there
		}
		return copySkipped // every other worker busy: the next turn moves it
	}
	body, err := shadowBody(e.body)
	if err != nil {
		rt.Free(req.ID)
		return copySkipped
	}
	s.rep.Booked(e.model, router.Booking{ID: req.ID, Worker: d.Worker, Hashes: d.ActiveHashes,
		PrefillTokens: req.Tokens - d.Overlap*rt.Config().BlockSize, Sequences: 1, Added: time.Now()})
	ctx, cancel := context.WithTimeout(context.Background(), dc.timeout)
	err = s.postShadow(ctx, d.Worker, e.path, body)
	cancel()
	rt.Free(req.ID)
	s.rep.Freed(e.model, req.ID)
	dc.sent.Inc()
	if err != nil {
		dc.failed.Inc()
		s.log.Warn("drain copy failed: the session moves at its next turn", "session", e.session, "from", worker, "to", d.Worker, "err", err)
		return copyFailed
	}
	if now, ok := sr.SessionBinding(e.session); !ok || now.Worker != b.Worker {
		return copySuperseded
	}
	ttl := max(time.Until(b.Until), time.Second) // the binding keeps its expiry
	ctx, cancel = context.WithTimeout(context.Background(), sessionRebindWait)
	got, err := sr.BindSession(ctx, SessionBind{Session: e.session, Parent: b.Parent, Worker: d.Worker, Replace: b.Worker, TTL: ttl})
	cancel()
	switch {
	case err != nil:
		s.log.Warn("drain copy answered but the rebind failed: the session moves at its next turn", "session", e.session, "to", d.Worker, "err", err)
		return copyFailed
	case got.Worker != d.Worker:
		return copySuperseded
	}
	dc.moved.Inc()
	if s.sessMetrics != nil {
		s.sessMetrics.rebinds.WithLabelValues("drain_copy").Inc()
	}
	return copyMoved
}

// routeCopy books a session's drain copy on the worker holding most of its
// prefix among those that can take it — the rebinding rule — with ties
// broken by the session's rendezvous hash over the tied workers rather
// than by cost: every replica holding one of the session's turns copies it
// (their copies book load, so costs differ between them), and they must
// send their copies to the same worker, or the first to answer could move
// the session away from the one that got its newest turn. Without any
// worker able to take it: where the router's policy puts it.
func routeCopy(rt *router.Router, req router.Request, session string, now time.Time) (router.Decision, error) {
	d, err := rt.Decide(req, now)
	if err != nil {
		return rt.Route(req, now)
	}
	if w, ok := copyTarget(d.Rows, session); ok {
		if d2, err := rt.Route(pinned(req, rt, w), now); err == nil {
			return d2, nil
		}
	}
	return rt.Route(req, now)
}

// copyTarget is the worker of rows (not busy) with the most cached blocks,
// ties broken by the highest rendezvous hash of (session, worker): the
// same choice on every replica that sees the same rows, whatever their
// order and costs.
func copyTarget(rows []router.WorkerCost, session string) (router.WorkerID, bool) {
	var best router.WorkerID
	bestOverlap, bestScore, found := -1, uint64(0), false
	for _, r := range rows {
		if r.Busy {
			continue
		}
		score := rendezvous(session, r.Worker)
		if r.Overlap > bestOverlap || (r.Overlap == bestOverlap && score > bestScore) {
			best, bestOverlap, bestScore, found = r.Worker, r.Overlap, score, true
		}
	}
	return best, found
}

// rendezvous is FNV-1a over session, a zero byte and worker.
func rendezvous(session string, worker router.WorkerID) uint64 {
	h := fnv.New64a()
	h.Write([]byte(session))
	h.Write([]byte{0})
	h.Write([]byte(worker))
	return h.Sum64()
}

// sessionRebindWait bounds a drain copy's rebind (BindSession retries
// through an election up to its own limit).
const sessionRebindWait = 10 * time.Second
