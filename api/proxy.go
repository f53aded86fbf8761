package api

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/kvrouter/kvrouter/api/decisionlog"
	"github.com/kvrouter/kvrouter/router"
)

// The proxy loop (see DESIGN.md): proxyLoop calls one attempt function until
// it succeeds or fails in a way retryable refuses; every failure is recorded
// by recordFailure and answered by answerFailure (failure.go), so the rules
// live in one place each whatever the serving path (aggregated here,
// two-stage in disagg.go).

// forward serves the request aggregated on one worker.
func (s *Server) forward(c *gin.Context, p *prepared) {
	defer s.endSession(p)
	if s.cool.cooling() {
		p.req.Exclude = append(p.req.Exclude, s.cool.exclude(workerIDs(p.rt.Workers()), time.Now())...)
	}
	s.proxyLoop(c, p, func() error { return s.attempt(c, p) })
}

// proxyLoop runs try, one attempt per call, until an attempt succeeds or
// fails in a way that must not be retried, then answers that failure. try
// must leave nothing booked when it fails, and must fail only before the
// client was sent anything.
func (s *Server) proxyLoop(c *gin.Context, p *prepared, try func() error) {
	if dyn := s.metrics.dynamo.begin(p); dyn != nil {
		c.Set(dynamoKey, dyn)
		defer func() { dyn.end(c.Writer.Status(), !c.Writer.Written() && c.Request.Context().Err() != nil) }()
	}
	var prev error // the last worker failure that was retried
	for attempt := 0; ; attempt++ {
		err := c.Request.Context().Err()
		if err != nil {
			err = fmt.Errorf("%w before attempt %d: %w", errClientGone, attempt, err)
		} else if err = try(); err == nil {
			return
		}
		retry := s.retryable(err, attempt)
		s.recordFailure(p, err, attempt, retry)
		if !retry {
			s.answerFailure(c, p, err, prev, attempt)
			return
		}
		prev = err
	}
}

// attempt is one try of an aggregated request: route, book, send, relay.
// The booking is announced to the other replicas on this goroutine just
// before the request is handed to the transport (issue 31 item 4): the
// bus's work (the client's flusher, the embedded server) then runs while
// the request travels, not while the worker computes, and peers learn of
// the booking before anything else about the request (PrefillDone, Freed).
func (s *Server) attempt(c *gin.Context, p *prepared) error {
	d, now, err := s.routeStep(c.Request.Context(), p)
	if err != nil {
		return err
	}
	s.recordRouted(p, d, now)
	s.keepSessionBody(p) // drainshadow.go: the body a drain would copy
	s.rep.Booked(p.model, s.booking(p, d))
	resp, err := s.send(c, d.Worker, p.path, s.withEnginePriority(p, p.body))
	if err != nil {
		s.free(p)
		s.completeDecision(p, decisionlog.Outcome{Error: s.redact(err.Error())})
		return err
	}
	return s.relay(c, p, d.Worker, d.Overlap, resp, relayHooks{
		firstByte: func() {
			p.firstByteAt = time.Now()
			p.rt.PrefillDoneAt(p.req.ID, p.firstByteAt) // kv-pooled's wait price learns the worker's prefill rate
			s.rep.PrefillDone(p.model, p.req.ID)
			s.tenantFirstByte(p)
			// The prompt's tokens left the worker's prefill load: a load
			// drop, so the queue looks now rather than at its next tick.
			s.gates.wake(p.model)
		},
		tokens: func(k int) { s.generated(p, k) },
		done: func() {
			s.free(p)
			s.completeDecision(p, decisionlog.Outcome{Status: resp.StatusCode, PromptTokens: p.usagePrompt, CachedTokens: p.usageCached})
		},
	})
}

// routeAndBook is the routing step of a request picked for a gateway
// (Pick, the selection API): route and book here, record the decision,
// announce the booking to the other replicas. On error nothing is booked
// and the decision is completed as failed. The announcement (encoding and
// publishing on the bus) runs on its own goroutine; booked is closed once
// it is done, and a caller waits for it before announcing anything later
// about the request (PrefillDone, Freed), so peers see the same order.
func (s *Server) routeAndBook(ctx context.Context, p *prepared) (d router.Decision, booked <-chan struct{}, err error) {
	d, now, err := s.routeStep(ctx, p)
	if err != nil {
		return d, nil, err
	}
	s.recordRouted(p, d, now)
	booking := s.booking(p, d)
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.rep.Booked(p.model, booking)
	}()
	return d, done, nil
}

// routeStep routes and books p here (by the session's binding, the
// warm-up share) and charges its tenant the prompt; recordRouted then
// records the decision. On error nothing is booked and the decision is
// recorded and completed as failed.
func (s *Server) routeStep(ctx context.Context, p *prepared) (d router.Decision, now time.Time, err error) {
	now = time.Now()
	d, err = s.route(ctx, p, now) // by the session's binding, if any (sessions.go)
	if err == nil && s.warm != nil && p.sess == nil && !p.pinned {
		// warmup.go: a joining worker's share, on purpose; not for a
		// session's turn, whose worker the binding decided (a first turn
		// is bound to the pick before this point), nor for a pinned
		// prefix's (pins.go: its holder, or the worker just pinned)
		if s.shadow != nil {
			d, err = s.shadowWarm(p, d, now) // shadow.go: copies instead of steering
		} else {
			d, err = s.warmUp(p, d, now)
		}
	}
	p.settled() // booked in the load view by Route, or never to be
	p.attempts++
	if err != nil {
		s.recordDecision(p, d, err, now)
		s.completeDecision(p, decisionlog.Outcome{Error: "routing: " + err.Error()})
		return d, now, fmt.Errorf("routing: %w", err)
	}
	// The tenant pays for the prompt tokens the worker must compute (before
	// the request leaves: its engine priority reads the tenant's share).
	s.chargeTenant(p, p.req.Tokens-d.Overlap*p.rt.Config().BlockSize, "prompt")
	return d, now, nil
}

// recordRouted records a routed decision of p: the decision log, hit
// rates, the routed count.
func (s *Server) recordRouted(p *prepared, d router.Decision, now time.Time) {
	s.recordDecision(p, d, nil, now)
	s.metrics.routed.WithLabelValues(p.model, string(d.Worker)).Inc()
}

// booking is what the other replicas are told of p's routed decision d:
// the hashes Route booked (distinct ones under
// --no-router-assume-kv-reuse), so peers book what this replica booked.
func (s *Server) booking(p *prepared, d router.Decision) router.Booking {
	return router.Booking{ID: p.req.ID, Worker: d.Worker, Hashes: d.ActiveHashes,
		PrefillTokens: p.req.Tokens - d.Overlap*p.rt.Config().BlockSize, Sequences: p.req.Sequences, Added: p.start}
}

// recordFailure does what every failed attempt needs whether or not it is
// retried: a worker that failed leaves this request's candidates, one whose
// connection failed cools down, and the failure is counted and logged.
// A client that went away is nobody's fault: no cool-down, no exclusion.
func (s *Server) recordFailure(p *prepared, err error, attempt int, retry bool) {
	if errors.Is(err, errClientGone) {
		s.log.Info("client went away", "request", p.req.ID, "attempt", attempt, "err", err)
		return
	}
	var we *workerError
	if !errors.As(err, &we) {
		return // a routing or internal error: answered as such
	}
	p.req.Exclude = append(p.req.Exclude, we.worker)
	if we.coolsDown() {
		s.cool.fail(we.worker, time.Now())
	}
	s.metrics.workerFailures.WithLabelValues(string(we.worker), we.kind.String()).Inc()
	if retry {
		s.metrics.retries.WithLabelValues(string(we.worker)).Inc()
	}
	s.log.Warn("worker attempt failed", "request", p.req.ID, "worker", we.worker, "failure", we.kind.String(),
		"attempt", attempt, "retry", retry, "err", we.err)
}

// send posts body to worker. Its error is a *workerError that says how far
// the request got (the retry rule needs to know whether the worker could
// have started work), or errClientGone. A 503 or 529 answer is such an
// error too: the worker refused the work before generating anything.
func (s *Server) send(c *gin.Context, worker router.WorkerID, path string, body []byte) (*http.Response, error) {
	base, ok := s.rep.WorkerURL(worker)
	if !ok {
		return nil, &workerError{worker: worker, kind: failNoAddress, err: errors.New("no address registered")}
	}
	ctx := c.Request.Context()
	var written atomic.Bool
	trace := &httptrace.ClientTrace{WroteRequest: func(i httptrace.WroteRequestInfo) {
		if i.Err == nil {
			written.Store(true)
		}
	}}
	// The attempt has its own context, so a worker that goes quiet can be
	// cut (idleBody) without the client's request looking cancelled: the
	// failure stays the worker's. Closing the answer's body releases it.
	actx, cancel := context.WithCancelCause(ctx)
	req, err := http.NewRequestWithContext(httptrace.WithClientTrace(actx, trace), http.MethodPost, base+path, bytes.NewReader(body))
	if err != nil {
		cancel(nil)
		return nil, &workerError{worker: worker, kind: failConnect, err: fmt.Errorf("building the request: %w", err)}
	}
	req.Header = outboundHeader(c.Request.Header)
	s.setWorkerHeaders(req.Header, worker)
	resp, err := s.client.Do(req)
	if err != nil {
		cancel(nil)
		return nil, sendFailure(ctx, worker, err, written.Load())
	}
	resp.Body = newIdleBody(actx, resp.Body, s.cfg.WorkerIdleTimeout, cancel)
	if refusedWork(resp.StatusCode) {
		return nil, unavailable(worker, resp)
	}
	return resp, nil
}

// workerKey is the bearer token for worker (any of its ranks): its own
// key, else the one for every worker, else none.
func (s *Server) workerKey(worker router.WorkerID) string {
	base, _, _ := strings.Cut(string(worker), "#")
	if k, ok := s.cfg.WorkerAPIKeys[base]; ok {
		return k
	}
	return s.cfg.WorkerAPIKey
}

// sendFailure classifies a failed round trip. written is whether the whole
// request went out: from then on the worker may be generating, and only the
// client's own cancel is not the worker's failure.
func sendFailure(ctx context.Context, worker router.WorkerID, err error, written bool) error {
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("%w (worker %s): %w", errClientGone, worker, err)
	case written:
		return &workerError{worker: worker, kind: failDropped, err: err}
	default:
		return &workerError{worker: worker, kind: failConnect, err: err}
	}
}

// unavailable turns a worker's 503/529 answer into its failure, keeping
// the worker's own message for the client should no other worker take
// the request.
func unavailable(worker router.WorkerID, resp *http.Response) error {
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	return &workerError{worker: worker, kind: failUnavailable, status: resp.StatusCode,
		err: fmt.Errorf("HTTP %d: %s", resp.StatusCode, bytes.TrimSpace(b))}
}

// relayHooks are the load bookkeeping around a relayed answer: firstByte
// runs at the first body bytes (prefill done), done at the end, on error, or
// when the client goes away (free).
type relayHooks struct {
	firstByte func()
	done      func()
	// tokens, when set, receives the output tokens each read of a
	// streamed answer brought (tokenScanner's count).
	tokens func(k int)
}

// OutputReporter is the optional side of a Replica that announces output
// progress to the other replicas (Dynamo's --router-track-output-blocks):
// the API calls it once per new output block of a request, never per
// token. Found by type assertion, like the other optional interfaces.
type OutputReporter interface {
	Output(model, id string, o router.OutputProgress)
}

// generated counts k more output tokens of p's aggregated answer. With
// output-block tracking on, the router books a placeholder block each time
// the output crosses a block boundary; that progress, and only that, goes
// to the other replicas.
func (s *Server) generated(p *prepared, k int) {
	p.generated += k
	s.chargeOutput(p, p.generated)
	o, grew := p.rt.Generated(p.req.ID, p.generated)
	if !grew {
		return
	}
	if rep, ok := s.rep.(OutputReporter); ok {
		rep.Output(p.model, p.req.ID, o)
	}
}

// relay streams the worker's answer back byte for byte. overlap is the
// cached blocks the router predicted on worker, audited against the usage
// the worker reports; negative skips the audit (a disaggregated decode
// worker reports transferred tokens as cached). The status and headers go
// out with the first body bytes, so a worker that fails before sending any
// can still be answered as a failure: relay then returns its error (never
// retried: the worker had the request). Once bytes flowed it returns nil
// whatever happens, the client has its status already. hooks.done runs
// either way.
func (s *Server) relay(c *gin.Context, p *prepared, worker router.WorkerID, overlap int, resp *http.Response, hooks relayHooks) error {
	defer resp.Body.Close()
	defer hooks.done()
	audit := newUsageScanner(p.stream)
	var toks *tokenScanner // TTFT and ITL at tokens, streams only (metrics.go)
	if p.stream {
		toks = &tokenScanner{}
	}
	dyn := dynamoOf(c)
	var lastToken time.Time
	bufp := s.relayBufs.Get().(*[]byte)
	defer s.relayBufs.Put(bufp)
	buf := *bufp
	started := false
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			now := time.Now()
			first := !started
			if first {
				started = true
				s.writeHead(c, resp, worker, overlap)
			}
			// The client gets the bytes before the bookkeeping runs: it
			// is on their way (the first read is the time to first
			// token), and what it records does not depend on the write.
			_, werr := c.Writer.Write(buf[:n])
			if werr == nil {
				c.Writer.Flush()
			}
			if first {
				hooks.firstByte()
				dyn.firstByte(overlap * p.rt.Config().BlockSize)
			}
			if toks != nil {
				k := toks.write(buf[:n])
				s.metrics.observeTokens(p, dyn, k, now, &lastToken)
				if k > 0 && hooks.tokens != nil {
					hooks.tokens(k)
				}
			}
			audit.write(buf[:n])
			if werr != nil {
				s.metrics.requests.WithLabelValues(p.model, "client_gone").Inc()
				dyn.broke(true)
				return nil
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			if started {
				dyn.broke(c.Request.Context().Err() != nil)
			}
			return s.streamBroke(c, p, worker, started, err)
		}
	}
	if !started { // an empty body: the status and headers are the answer
		s.writeHead(c, resp, worker, overlap)
	}
	s.metrics.requests.WithLabelValues(p.model, strconv.Itoa(resp.StatusCode)).Inc()
	s.metrics.e2e.WithLabelValues(p.model).Observe(time.Since(p.start).Seconds())
	s.auditUsage(p, worker, overlap, audit, dyn)
	return nil
}

// writeHead sets the client's status and headers from the worker's answer:
// its end-to-end headers (hop-by-hop ones belong to the worker's
// connection, Content-Length to an answer relay may cut short) and ours.
func (s *Server) writeHead(c *gin.Context, resp *http.Response, worker router.WorkerID, overlap int) {
	h := c.Writer.Header()
	copyEndToEnd(h, resp.Header)
	h.Set("X-Worker-Id", string(worker))
	if overlap >= 0 {
		h.Set("X-Cached-Blocks", strconv.Itoa(overlap))
	}
	c.Status(resp.StatusCode)
}

// streamBroke handles a failed read of the worker's answer. Before the
// first byte it returns the failure for the loop to answer; after, it can
// only count it: the client sees a cut answer.
func (s *Server) streamBroke(c *gin.Context, p *prepared, worker router.WorkerID, started bool, err error) error {
	gone := c.Request.Context().Err() != nil
	switch {
	case !started && gone:
		return fmt.Errorf("%w (reading worker %s): %w", errClientGone, worker, err)
	case !started:
		return &workerError{worker: worker, kind: failDropped, err: fmt.Errorf("reading the answer: %w", err)}
	case gone:
		s.metrics.requests.WithLabelValues(p.model, "client_gone").Inc()
		s.log.Info("client went away mid-answer", "request", p.req.ID, "worker", worker)
	default:
		s.metrics.requests.WithLabelValues(p.model, "upstream_error").Inc()
		s.log.Warn("worker stream broke", "request", p.req.ID, "worker", worker, "err", err)
	}
	return nil
}

// auditUsage compares the usage the worker reported with the router's
// prediction (a negative overlap: no prediction to audit).
func (s *Server) auditUsage(p *prepared, worker router.WorkerID, overlap int, audit *usageScanner, dyn *dynamoRequest) {
	u, ok := audit.usage()
	if !ok {
		return
	}
	p.outputTokens, p.outputTokensKnown = u.CompletionTokens, true
	p.usagePrompt, p.usageCached = u.PromptTokens, u.cachedTokens()
	dyn.usage(u)
	bs := p.rt.Config().BlockSize
	s.metrics.observeUsage(p.model, string(worker), u, max(overlap, 0)*bs)
	if u.Details != nil && overlap >= 0 {
		s.rep.Audit(worker, overlap*bs, u.Details.CachedTokens, u.PromptTokens)
	}
}

// free ends an aggregated request's booking, here and on the other
// replicas, and wakes its model's queue.
func (s *Server) free(p *prepared) {
	if p.outputTokensKnown {
		s.chargeOutput(p, p.outputTokens)
		// Per sequence (n samples report their sum); at now, so kv-pooled's
		// wait price learns the worker's decode rate.
		p.rt.FinishedAt(p.req.ID, p.outputTokens/max(p.req.Sequences, 1), time.Now())
	} else {
		p.rt.Free(p.req.ID)
	}
	s.rep.Freed(p.model, p.req.ID)
	s.gates.wake(p.model)
}

// setWorkerHeaders sets what every request to a worker carries: its API key
// (when one is configured) and, for a data-parallel rank, vLLM's
// X-Data-Parallel-Rank. Shared by the proxy and the shadow copies.
func (s *Server) setWorkerHeaders(h http.Header, worker router.WorkerID) {
	if key := s.workerKey(worker); key != "" {
		h.Set("Authorization", "Bearer "+key)
	}
	if rank, ok := s.rep.DPRank(worker); ok {
		h.Set("X-Data-Parallel-Rank", strconv.Itoa(rank))
	}
}
