package api

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/api/decisionlog"
	"github.com/kvrouter/kvrouter/router"
)

// Gateways: a request placed for a gateway that sends it to the worker
// itself (the Gateway API Inference Extension's endpoint picker protocol,
// served over Envoy's ext_proc by api/extproc). The routing step is the
// proxy's own — prepareBody, wait, routeAndBook — so a request gets the
// same worker whichever way it arrives; only the bytes take another path.
// The answer is observed through the Pick's methods, which keep the load
// bookkeeping, the cache audit, the decision log and the hit rates as the
// proxy's relay does.

// PickRequest is one request a gateway asks this replica to place.
type PickRequest struct {
	// Path is the request's :path without its query: one of the
	// inference endpoints under /v1 (chat/completions, completions,
	// embeddings, score, rerank, responses).
	Path string
	// Header holds the client's headers: Authorization (the API key, as
	// on /v1/*) and X-Request-Id are read.
	Header http.Header
	Body   []byte
	// Subset, when HasSubset, is the gateway's subset hint: the only
	// endpoints (host:port) to pick among. An empty hint leaves none.
	Subset    []string
	HasSubset bool
	// Fallbacks is how many endpoints to rank after the chosen one, for
	// the gateway to try in order should it fail to connect (0: none).
	Fallbacks int
}

// PickError is a request refused before any worker saw it. Status and
// Body (OpenAI's error JSON, as the proxy answers) are its client's answer.
type PickError struct {
	Status int
	Body   []byte
	// RetryAfter: seconds the client should wait before retrying (a full
	// queue, a tenant over budget); 0: none.
	RetryAfter int
}

func (e *PickError) Error() string { return fmt.Sprintf("HTTP %d: %s", e.Status, e.Body) }

// HTTPStatus and ResponseBody let a caller outside this package answer
// the refusal without knowing its type.
func (e *PickError) HTTPStatus() int    { return e.Status }
func (e *PickError) AnswerBody() []byte { return e.Body }

func pickError(r *refusal) *PickError {
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"message": r.msg, "type": r.kind, "code": r.status}})
	return &PickError{Status: r.status, Body: b, RetryAfter: r.retryAfter}
}

// gatewayEndpoints are the paths a gateway may ask to place.
var gatewayEndpoints = map[string]endpoint{
	"/v1/chat/completions": epChat, "/v1/completions": epCompletions, "/v1/embeddings": epEmbeddings,
	"/v1/score": epScore, "/v1/rerank": epRerank, "/v1/responses": epResponses,
}

// pathOfBody names the endpoint of a request whose path the gateway did
// not send (Envoy always does; some test clients, GAIE's request builders
// among them, do not): chat when the body has messages, else completions.
func pathOfBody(body []byte) string {
	var probe struct {
		Messages json.RawMessage `json:"messages"`
	}
	if json.Unmarshal(body, &probe) == nil && len(probe.Messages) > 0 {
		return "/v1/chat/completions"
	}
	return "/v1/completions"
}

// Pick places one request: parsed and tokenized, admitted through the
// model's queue, routed and booked, here and on the other replicas. The
// booking lasts until Finish or Cancel (or the router's request expiry,
// should neither come). ctx bounds the wait in the queue.
func (s *Server) Pick(ctx context.Context, r PickRequest) (*Pick, error) {
	start := time.Now()
	key := bearerOf(r.Header)
	if !s.keyAccepted(key) {
		return nil, pickError(&refusal{status: http.StatusUnauthorized, kind: "authentication_error", msg: "missing or invalid API key"})
	}
	if r.Path == "" {
		r.Path = pathOfBody(r.Body)
	}
	ep, ok := gatewayEndpoints[r.Path]
	if !ok {
		return nil, pickError(&refusal{status: http.StatusNotFound, kind: "not_found_error", msg: "no inference endpoint at " + r.Path})
	}
	if int64(len(r.Body)) > s.cfg.MaxBodyBytes {
		s.metrics.rejected.WithLabelValues("body_too_large").Inc()
		return nil, pickError(&refusal{status: http.StatusRequestEntityTooLarge, kind: "invalid_request_error",
			msg: fmt.Sprintf("request body over %d bytes", s.cfg.MaxBodyBytes)})
	}
	p, ref := s.prepareBody(r.Body, r.Path, ep, key, r.Header, start)
	if ref != nil {
		return nil, pickError(ref)
	}
	p.requestID = r.Header.Get("X-Request-Id")
	pk := &Pick{s: s, p: p}
	workers := p.rt.Workers()
	if r.HasSubset {
		out := outsideSubset(workers, r.Subset, s.rep.WorkerURL)
		if len(out) == len(workers) {
			return nil, pickError(&refusal{status: http.StatusServiceUnavailable, kind: "service_unavailable",
				msg: "no worker of model " + p.model + " is in the gateway's endpoint subset"})
		}
		p.req.Exclude = append(p.req.Exclude, out...)
	}
	p.req.Exclude = append(p.req.Exclude, s.cool.exclude(workerIDs(workers), time.Now())...)
	admitted, ref := s.wait(ctx, p)
	if ref != nil {
		if ref.kind == "service_overloaded" {
			// The queue timed out: the protocol's status for a request
			// dropped under load is 429, whatever the proxy answers.
			ref.status, ref.retryAfter = http.StatusTooManyRequests, max(ref.retryAfter, 1)
		}
		return nil, pickError(ref)
	}
	if !admitted {
		return nil, fmt.Errorf("waiting for admission: %w", context.Cause(ctx))
	}
	defer p.settled()
	d, booked, err := s.routeAndBook(ctx, p)
	if err != nil {
		return nil, pickError(s.pickRefusal(err))
	}
	<-booked // the other replicas hear of the booking before anything later about it (release, Freed)
	pk.d, pk.served = d, d.Worker
	pk.Endpoints = s.rankEndpoints(d, r.Fallbacks)
	if len(pk.Endpoints) == 0 {
		s.free(p)
		s.completeDecision(p, decisionlog.Outcome{Error: "no address registered for " + string(d.Worker)})
		return nil, pickError(&refusal{status: http.StatusServiceUnavailable, kind: "service_unavailable",
			msg: "worker " + string(d.Worker) + " has no address"})
	}
	pk.Rank, pk.HasRank = s.rep.DPRank(d.Worker)
	pk.audit = newUsageScanner(p.stream)
	if p.stream {
		pk.toks = &tokenScanner{}
	}
	return pk, nil
}

// pickRefusal maps a routing failure to the protocol's statuses: nothing
// to serve is 503; every worker over its busy thresholds is shedding, 429.
func (s *Server) pickRefusal(err error) *refusal {
	if errors.Is(err, router.ErrAllBusy) {
		s.metrics.rejected.WithLabelValues("all_busy").Inc()
		return &refusal{status: http.StatusTooManyRequests, kind: "service_overloaded", msg: err.Error(), retryAfter: 1}
	}
	if errors.Is(err, router.ErrNoWorkers) {
		s.metrics.rejected.WithLabelValues("no_workers").Inc()
	}
	return &refusal{status: http.StatusServiceUnavailable, kind: "service_unavailable", msg: err.Error()}
}

// keyAccepted is requireKey's check on a key already read.
func (s *Server) keyAccepted(key string) bool {
	if len(s.cfg.APIKeys) == 0 {
		return true
	}
	for _, k := range s.cfg.APIKeys {
		if subtle.ConstantTimeCompare([]byte(key), []byte(k)) == 1 {
			return true
		}
	}
	return false
}

func bearerOf(h http.Header) string {
	if t, ok := strings.CutPrefix(h.Get("Authorization"), "Bearer "); ok {
		return strings.TrimSpace(t)
	}
	return ""
}

// outsideSubset lists the workers whose endpoint is not in subset.
func outsideSubset(ws []router.WorkerInfo, subset []string, addr func(router.WorkerID) (string, bool)) []router.WorkerID {
	var out []router.WorkerID
	for _, w := range ws {
		u, ok := addr(w.ID)
		ep, okEP := WorkerEndpoint(u)
		if !ok || !okEP || !slices.Contains(subset, ep) {
			out = append(out, w.ID)
		}
	}
	return out
}

// AnyEndpoint places a request without a body (GET /v1/models through a
// gateway): nothing to route by and nothing booked, so the worker with the
// fewest requests in flight, over every model (ties by id), as GAIE's
// picker sends such requests to any endpoint. False when no worker has an
// address.
func (s *Server) AnyEndpoint() (string, bool) {
	best, bestN, found := "", 0, false
	for _, m := range s.rep.Models() {
		rt, ok := s.rep.Router(m)
		if !ok {
			continue
		}
		for _, w := range rt.Workers() {
			ep, ok := s.endpointOf(w.ID)
			if !ok {
				continue
			}
			n := rt.Load().Load(w.ID).Requests
			if !found || n < bestN || (n == bestN && ep < best) {
				best, bestN, found = ep, n, true
			}
		}
	}
	return best, found
}

// WorkerEndpoint is a worker base URL's host:port, the form gateways name
// endpoints in (the scheme's default port when the URL has none).
func WorkerEndpoint(base string) (string, bool) {
	u, err := url.Parse(base)
	if err != nil || u.Hostname() == "" {
		return "", false
	}
	port := u.Port()
	if port == "" {
		switch u.Scheme {
		case "https":
			port = "443"
		case "http":
			port = "80"
		default:
			return "", false
		}
	}
	return net.JoinHostPort(u.Hostname(), port), true
}

// rankEndpoints is the chosen worker's endpoint, then up to fallbacks more
// from the decision's other eligible workers, cheapest first (ties by
// id), each endpoint once (data-parallel ranks share their engine's).
func (s *Server) rankEndpoints(d router.Decision, fallbacks int) []string {
	first, ok := s.endpointOf(d.Worker)
	if !ok {
		return nil
	}
	out := []string{first}
	var rest []router.WorkerCost
	for _, r := range d.Rows {
		if !r.Busy && r.Worker != d.Worker {
			rest = append(rest, r)
		}
	}
	slices.SortStableFunc(rest, func(a, b router.WorkerCost) int {
		if a.Cost != b.Cost {
			if a.Cost < b.Cost {
				return -1
			}
			return 1
		}
		return strings.Compare(string(a.Worker), string(b.Worker))
	})
	for _, r := range rest {
		if len(out) > fallbacks {
			break
		}
		if ep, ok := s.endpointOf(r.Worker); ok && !slices.Contains(out, ep) {
			out = append(out, ep)
		}
	}
	return out
}

func (s *Server) endpointOf(w router.WorkerID) (string, bool) {
	u, ok := s.rep.WorkerURL(w)
	if !ok {
		return "", false
	}
	return WorkerEndpoint(u)
}

// Pick is a request placed for a gateway: booked on its worker until
// Finish or Cancel. Its methods observe the answer as the gateway relays
// it; they are safe for concurrent use, and every call after Finish or
// Cancel does nothing.
type Pick struct {
	s *Server
	p *prepared
	d router.Decision
	// Endpoints are the chosen worker's host:port, then the fallbacks.
	Endpoints []string
	// Rank is the data-parallel rank booked, when the worker is one of
	// several ranks behind one engine (HasRank): the gateway should send
	// it as X-Data-Parallel-Rank, as the proxy does.
	Rank    int
	HasRank bool

	mu        sync.Mutex
	served    router.WorkerID // the booking's worker: the chosen one until Served says otherwise
	status    int
	started   bool
	ended     bool
	lastToken time.Time
	audit     *usageScanner
	toks      *tokenScanner
}

// Worker is the worker the request is booked on.
func (k *Pick) Worker() router.WorkerID {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.served
}

// RequestID is the router's id of the request (its booking's).
func (k *Pick) RequestID() string { return k.p.req.ID }

// Served reports the endpoint the gateway sent the request to. When it is
// a fallback, the booking moves to that endpoint's worker, here and on
// the other replicas, with the prefill the decision's table gave it.
func (k *Pick) Served(endpoint string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.ended || k.started || endpoint == "" {
		return
	}
	if ep, ok := k.s.endpointOf(k.served); ok && ep == endpoint {
		return
	}
	// The eligible row first: ranks of one engine share its endpoint, and
	// the fallback listed was an eligible one.
	for _, eligible := range []bool{true, false} {
		for _, r := range k.d.Rows {
			if r.Busy == eligible {
				continue
			}
			if ep, ok := k.s.endpointOf(r.Worker); ok && ep == endpoint {
				k.rebookLocked(r)
				return
			}
		}
	}
	k.s.log.Warn("gateway served the request on an endpoint outside the decision", "request", k.p.req.ID, "endpoint", endpoint)
}

// rebookLocked moves the booking to row's worker. k.mu must be held.
func (k *Pick) rebookLocked(row router.WorkerCost) {
	p := k.p
	p.rt.Free(p.req.ID)
	k.s.rep.Freed(p.model, p.req.ID)
	b := router.Booking{ID: p.req.ID, Worker: row.Worker, Hashes: k.d.ActiveHashes,
		PrefillTokens: p.req.Tokens - row.Overlap*p.rt.Config().BlockSize, Sequences: p.req.Sequences, Added: p.start,
		PromptTokens: p.req.Tokens, ExpectedOutput: p.req.ExpectedOutputTokens}
	p.rt.Load().Add(b)
	k.s.rep.Booked(p.model, router.Booking{ID: b.ID, Worker: b.Worker, Hashes: b.Hashes, PrefillTokens: b.PrefillTokens,
		Sequences: b.Sequences, Added: b.Added})
	k.served, p.worker = row.Worker, string(row.Worker)
	k.d.Overlap = row.Overlap
}

// ResponseHeaders records the answer's status.
func (k *Pick) ResponseHeaders(status int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !k.ended {
		k.status = status
	}
}

// ResponseBody observes one chunk of the answer's body: the first marks
// the prefill done (here and on the other replicas), a stream's tokens
// feed output-block tracking and token timing, and the usage is kept for
// the cache audit at Finish.
func (k *Pick) ResponseBody(chunk []byte) {
	if len(chunk) == 0 {
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.ended {
		return
	}
	p, s := k.p, k.s
	now := time.Now()
	if !k.started {
		k.started = true
		p.firstByteAt = now
		p.rt.PrefillDoneAt(p.req.ID, now)
		s.rep.PrefillDone(p.model, p.req.ID)
	}
	if k.toks != nil {
		n := k.toks.write(chunk)
		s.metrics.observeTokens(p, nil, n, now, &k.lastToken)
		if n > 0 {
			s.generated(p, n)
		}
	}
	k.audit.write(chunk)
}

// Finish ends the request at the end of its answer: the usage audited,
// the booking freed here and on the other replicas, the decision
// completed with the answer's status.
func (k *Pick) Finish() {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.ended {
		return
	}
	k.ended = true
	p, s := k.p, k.s
	status := k.status
	if status == 0 {
		status = http.StatusOK
	}
	s.metrics.requests.WithLabelValues(p.model, strconv.Itoa(status)).Inc()
	s.metrics.e2e.WithLabelValues(p.model).Observe(time.Since(p.start).Seconds())
	s.auditUsage(p, k.served, k.d.Overlap, k.audit, nil)
	s.free(p)
	s.tenantEnd(p) // counted in flight since its admission (wait)
	s.completeDecision(p, decisionlog.Outcome{Status: status, PromptTokens: p.usagePrompt, CachedTokens: p.usageCached})
}

// Cancel ends a request whose answer will not complete (the gateway's
// stream closed, the client went away): the booking is freed here and on
// the other replicas, nothing audited.
func (k *Pick) Cancel() {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.ended {
		return
	}
	k.ended = true
	p, s := k.p, k.s
	s.metrics.requests.WithLabelValues(p.model, "client_gone").Inc()
	s.free(p)
	s.tenantEnd(p) // counted in flight since its admission (wait)
	s.completeDecision(p, decisionlog.Outcome{Error: "the gateway's stream ended before the answer did"})
}
