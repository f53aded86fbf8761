package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/warmup"
	"github.com/kvrouter/kvrouter/router"
)

// Shadow prefills of a warming worker (issue 29; DESIGN.md, "Warm-up by
// shadow prefills"): with Config.WarmUpShadow, while a worker warms
// (warmup.go decides which and until when), a request whose prefix some
// worker holds and the warming worker holds less of is copied to the
// warming worker as a prefill-only request — the same body with
// max_tokens 1, not streamed, its answer read and thrown away — once per
// prefix, while the fleet is under 0.8 of its busy thresholds and the
// warming worker is not busy and stays under 0.8 with the copy's own load
// (copyRoom); the client's own request goes where routing sends it, and
// when that is the warming worker (the least loaded) without the prefix,
// to routing's choice among the holders of the deepest prefix that were
// not busy instead. So the new
// worker's cache fills by recomputation on a worker with time to spare,
// before requests need it, instead of in their TTFT. Measured in kvbench
// sim (--warmup-shadow): the time-to-warm bar met with no TTFT
// spike where steering missed it (BENCHMARKS.md).
//
// A copy is off the client's path: it is routed and booked on the warming
// worker's load (and announced to the other replicas like any booking),
// sent on its own goroutine with its own deadline, and freed when its
// answer ends. At most Config.ShadowInflight copies run at once (a copy
// that finds no slot is not sent); a failure is logged and counted
// (kvrouter_shadow_prefill_failures_total) and never touches the client's
// request.

// shadowPaths are the endpoints whose bodies a copy can be made of (the
// body's output length is max_tokens / max_completion_tokens).
var shadowPaths = map[string]bool{"/v1/chat/completions": true, "/v1/completions": true}

// defaultShadowInflight bounds the copies running at once by default.
const defaultShadowInflight = 8

// shadowTimeout bounds one copy: a prefill of the longest prompts.
const shadowTimeout = 2 * time.Minute

// shadowCopiedMax bounds the prefixes remembered as copied; past it the
// memory is cleared (a prefix copied twice costs a prefill, no more).
const shadowCopiedMax = 1 << 14

// shadowKey is a prefix copied to a worker: the hash of the deepest block
// its holders had.
type shadowKey struct {
	worker router.WorkerID
	hash   uint64
}

// shadows is the server's shadow prefills. mu guards copied.
type shadows struct {
	slots      chan struct{}
	timeout    time.Duration
	sent       *prometheus.CounterVec // kvrouter_shadow_prefills_total{worker}
	failed     *prometheus.CounterVec // kvrouter_shadow_prefill_failures_total{worker}
	redirected *prometheus.CounterVec // kvrouter_warmup_redirected_total{worker}
	used       *prometheus.CounterVec // kvrouter_warmup_copy_used_total{worker}
	mu         sync.Mutex
	copied     map[shadowKey]bool
	wg         sync.WaitGroup // copies on their way (tests wait on it)
}

func newShadows(cfg Config) *shadows {
	if !cfg.WarmUpShadow {
		return nil
	}
	n := cfg.ShadowInflight
	if n <= 0 {
		n = defaultShadowInflight
	}
	sh := &shadows{
		slots: make(chan struct{}, n), timeout: shadowTimeout, copied: map[shadowKey]bool{},
		sent: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_shadow_prefills_total",
			Help: "Prefill-only copies of requests this replica sent to a warming worker to fill its cache (--router-warmup-shadow), failed ones included."}, []string{"worker"}),
		failed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_shadow_prefill_failures_total",
			Help: "Shadow prefills that failed (no answer, or not 2xx); the clients' requests are never affected."}, []string{"worker"}),
		redirected: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_warmup_redirected_total",
			Help: "Requests routing sent to a warming worker without their prefix that went to the prefix's holder instead, their copy sent to the warming worker."}, []string{"worker"}),
		used: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_warmup_copy_used_total",
			Help: "Requests sent to a warming worker because a shadow prefill had brought it their prefix (the policy had picked another holder)."}, []string{"worker"}),
	}
	cfg.Registry.MustRegister(sh.sent, sh.failed, sh.redirected, sh.used)
	return sh
}

// claim marks (worker, hash) copied; false when it already was.
func (sh *shadows) claim(k shadowKey) bool {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sh.copied[k] {
		return false
	}
	if len(sh.copied) >= shadowCopiedMax {
		clear(sh.copied)
	}
	sh.copied[k] = true
	return true
}

// wasCopied reports whether a copy of k was sent (or is on its way).
func (sh *shadows) wasCopied(k shadowKey) bool {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	return sh.copied[k]
}

// unclaim forgets a copy that was not sent after all.
func (sh *shadows) unclaim(k shadowKey) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	delete(sh.copied, k)
}

// shadowBody is body rewritten as a prefill-only request: max_tokens 1
// (and max_completion_tokens 1 when the body has it), no stream, no
// stream_options, one sample, no min_tokens; everything else as sent, so
// the prompt, and the KV it makes, is the client's.
func shadowBody(body []byte) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, fmt.Errorf("shadow body: %w", err)
	}
	if m == nil {
		return nil, errors.New("shadow body: not a JSON object")
	}
	one := json.RawMessage("1")
	m["max_tokens"] = one
	if _, ok := m["max_completion_tokens"]; ok {
		m["max_completion_tokens"] = one
	}
	m["stream"] = json.RawMessage("false")
	delete(m, "stream_options")
	delete(m, "min_tokens")
	for _, k := range []string{"n", "best_of"} {
		if _, ok := m[k]; ok {
			m[k] = one
		}
	}
	out, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("shadow body: %w", err)
	}
	return out, nil
}

// onlyWorker is every worker of ws but w: an Exclude that leaves w alone.
func onlyWorker(ws []router.WorkerInfo, w router.WorkerID) []router.WorkerID {
	out := make([]router.WorkerID, 0, len(ws))
	for _, x := range ws {
		if x.ID != w {
			out = append(out, x.ID)
		}
	}
	return out
}

// shadowWarm applies the shadow warm-up to the decision d Route booked
// for p: it may send a copy of p to the warming worker, may send p there
// when a copy brought it p's prefix, and may move p to the holder of its
// prefix. The decision p goes by is returned; an error
// only when p's booking was freed and could not be made again.
func (s *Server) shadowWarm(p *prepared, d router.Decision, now time.Time) (router.Decision, error) {
	w, sh := s.warm, s.shadow
	ws := p.rt.Workers()
	target, ok := w.target(p.model, ws, w.clock())
	if !ok || slices.Contains(p.req.Exclude, target) {
		return d, nil // none warming, or not one this request may use (a LoRA adapter, a failed attempt)
	}
	var holder router.WorkerCost
	var mine *router.WorkerCost
	for i, r := range d.Rows {
		if slices.Contains(p.req.Exclude, r.Worker) {
			continue
		}
		if r.Worker == target {
			mine = &d.Rows[i]
		} else if r.Overlap > holder.Overlap {
			holder = r
		}
	}
	if mine != nil && mine.Overlap > 0 && mine.Overlap >= holder.Overlap && mine.Overlap <= len(p.req.Hashes) &&
		d.Worker != target && !mine.Busy && sh.wasCopied(shadowKey{worker: target, hash: p.req.Hashes[mine.Overlap-1]}) &&
		copyRoom(p.rt, ws, target, p.req, mine.Overlap) {
		// A copy brought the warming worker this prefix: the request goes
		// there, or the copy sits unused until it ages out (kv-pooled
		// sends a prefix two workers hold to its rendezvous home, the old
		// holder; kvbench sim, BENCHMARKS.md).
		used := p.req
		used.Exclude = onlyWorker(ws, target)
		p.rt.Free(p.req.ID)
		if d2, err := p.rt.Route(used, now); err == nil {
			sh.used.WithLabelValues(string(target)).Inc()
			return d2, nil
		}
		return p.rt.Route(p.req, now) // the warming worker refused it after all: as decided first
	}
	if mine == nil || holder.Overlap == 0 || mine.Overlap >= holder.Overlap || holder.Overlap > len(p.req.Hashes) {
		return d, nil
	}
	t := p.rt.Config().Thresholds
	if shadowPaths[p.path] && !mine.Busy && warmup.Utilization(t, ws, p.rt.Load().Load) < warmup.DefaultHeadroom &&
		copyRoom(p.rt, ws, target, p.req, mine.Overlap) {
		s.sendShadow(p, ws, target, shadowKey{worker: target, hash: p.req.Hashes[holder.Overlap-1]})
	}
	if d.Worker != target {
		return d, nil
	}
	// The policy's choice among the workers holding the deepest prefix
	// that were not busy in d, not the first of them: when they all hold
	// only a shared system prompt, every request meant for the warming
	// worker went to one (kvbench sim, Mooncake conversation trace); and
	// only one that stays under the headroom with the request, as a copy
	// must (a holder not busy but full of its clients' blocks made a
	// redirected request wait 0.5–0.96 s on the seed-002 shape, kvbench
	// sim, BENCHMARKS.md).
	moved := p.req
	moved.Exclude = slices.Clone(p.req.Exclude)
	free := 0
	for _, r := range d.Rows {
		switch {
		case r.Worker == target || r.Overlap < holder.Overlap || r.Busy || !copyRoom(p.rt, ws, r.Worker, p.req, r.Overlap):
			if !slices.Contains(moved.Exclude, r.Worker) {
				moved.Exclude = append(moved.Exclude, r.Worker)
			}
		case !slices.Contains(p.req.Exclude, r.Worker):
			free++
		}
	}
	if free == 0 {
		return d, nil
	}
	p.rt.Free(p.req.ID)
	if d2, err := p.rt.Route(moved, now); err == nil {
		sh.redirected.WithLabelValues(string(target)).Inc()
		return d2, nil
	}
	return p.rt.Route(p.req, now) // the holder refused it after all: as decided first
}

// copyRoom reports whether target stays under the warm-up's headroom once
// it also runs a copy of req (the blocks it lacks, their prefill, one
// sequence): a copy the worker had room for before it started could fill
// its KV cache, so that a client's request sent there waited for blocks
// (kvbench sim: 1.8 s on the seed-002 shape under kv-pooled; BENCHMARKS.md).
func copyRoom(rt *router.Router, ws []router.WorkerInfo, target router.WorkerID, req router.Request, mine int) bool {
	for _, w := range ws {
		if w.ID != target {
			continue
		}
		l := rt.Load().Load(target)
		l.ActiveBlocks += max(len(req.Hashes)-mine, 0)
		l.ActivePrefillTokens += max(req.Tokens-mine*rt.Config().BlockSize, 0)
		l.Requests++
		return warmup.WorkerUtilization(rt.Config().Thresholds, w, l) < warmup.DefaultHeadroom
	}
	return false
}

// sendShadow copies p to target once per key, when a slot is free: the
// copy is routed to target alone and booked there, then sent on its own
// goroutine.
func (s *Server) sendShadow(p *prepared, ws []router.WorkerInfo, target router.WorkerID, key shadowKey) {
	sh := s.shadow
	if !sh.claim(key) {
		return
	}
	select {
	case sh.slots <- struct{}{}:
	default:
		sh.unclaim(key) // no slot: a later request of the prefix may copy it
		return
	}
	release := func() { <-sh.slots }
	body, err := shadowBody(p.body)
	if err != nil {
		release()
		sh.failed.WithLabelValues(string(target)).Inc()
		s.log.Warn("shadow prefill not sent", "request", p.req.ID, "worker", target, "err", err)
		return
	}
	req := p.req
	req.ID = p.req.ID + "/shadow"
	req.Exclude = onlyWorker(ws, target)
	req.Sequences, req.ExpectedOutputTokens = 1, 1
	rt, model, path := p.rt, p.model, p.path
	d, err := rt.Route(req, time.Now())
	if err != nil {
		release()
		sh.unclaim(key)
		return // target busy by now: no copy
	}
	booking := router.Booking{ID: req.ID, Worker: d.Worker, Hashes: d.ActiveHashes,
		PrefillTokens: req.Tokens - d.Overlap*rt.Config().BlockSize, Sequences: 1, Added: time.Now()}
	sh.wg.Add(1)
	go func() {
		defer sh.wg.Done()
		defer release()
		s.rep.Booked(model, booking)
		ctx, cancel := context.WithTimeout(context.Background(), sh.timeout)
		err := s.postShadow(ctx, target, path, body)
		cancel()
		rt.Free(req.ID)
		s.rep.Freed(model, req.ID)
		sh.sent.WithLabelValues(string(target)).Inc()
		if err != nil {
			sh.failed.WithLabelValues(string(target)).Inc()
			s.log.Warn("shadow prefill failed", "request", req.ID, "worker", target, "err", err)
		}
	}()
}

// postShadow sends a copy to worker and reads its answer to the end.
func (s *Server) postShadow(ctx context.Context, worker router.WorkerID, path string, body []byte) error {
	base, ok := s.rep.WorkerURL(worker)
	if !ok {
		return errors.New("no address registered")
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("building the request: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	s.setWorkerHeaders(req.Header, worker)
	resp, err := s.client.Do(req)
	if err != nil {
		return fmt.Errorf("post: %w", err)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20)); err != nil {
		return fmt.Errorf("reading the answer: %w", err)
	}
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("status %d", resp.StatusCode)
	}
	return nil
}
