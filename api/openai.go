package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/kvrouter/kvrouter/router"
)

// inferenceRequest is the part of an OpenAI request body the router reads.
// The body itself is forwarded to the worker unchanged.
type inferenceRequest struct {
	Model    string            `json:"model"`
	Messages []json.RawMessage `json:"messages"`
	Stream   bool              `json:"stream"`
	Nvext    struct {
		AgentHints struct {
			Priority int `json:"priority"`
		} `json:"agent_hints"`
	} `json:"nvext"`
}

// prepared is a parsed, tokenized request ready to route.
type prepared struct {
	body   []byte
	path   string
	model  string
	stream bool
	rt     *router.Router
	req    router.Request
	start  time.Time
}

var requestSeq atomic.Uint64

func (s *Server) chatCompletions(c *gin.Context) { s.infer(c, true) }
func (s *Server) completions(c *gin.Context)     { s.infer(c, false) }

func (s *Server) infer(c *gin.Context, chat bool) {
	p, ok := s.prepare(c, chat)
	if !ok {
		return
	}
	if !s.admit(c, p) {
		return
	}
	if dr, ok := s.disaggRouter(p.model); ok {
		s.forwardDisagg(c, p, dr)
		return
	}
	s.forward(c, p)
}

// prepare reads, parses and tokenizes the request, answering the client
// itself on any error.
func (s *Server) prepare(c *gin.Context, chat bool) (*prepared, bool) {
	start := time.Now()
	body, err := io.ReadAll(c.Request.Body)
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			s.metrics.rejected.WithLabelValues("body_too_large").Inc()
			openAIError(c, http.StatusRequestEntityTooLarge, "invalid_request_error", fmt.Sprintf("request body over %d bytes", s.cfg.MaxBodyBytes))
			return nil, false
		}
		openAIError(c, http.StatusBadRequest, "invalid_request_error", "reading body: "+err.Error())
		return nil, false
	}
	var in inferenceRequest
	if err := json.Unmarshal(body, &in); err != nil {
		s.metrics.rejected.WithLabelValues("invalid_json").Inc()
		openAIError(c, http.StatusBadRequest, "invalid_request_error", "invalid JSON body: "+err.Error())
		return nil, false
	}
	if in.Model == "" {
		openAIError(c, http.StatusBadRequest, "invalid_request_error", "model is required")
		return nil, false
	}
	rt, ok := s.rep.Router(in.Model)
	if !ok {
		s.metrics.rejected.WithLabelValues("unknown_model").Inc()
		openAIError(c, http.StatusNotFound, "model_not_found", fmt.Sprintf("model %q is not served here", in.Model))
		return nil, false
	}
	if chat && len(in.Messages) == 0 {
		openAIError(c, http.StatusBadRequest, "invalid_request_error", "messages must not be empty")
		return nil, false
	}
	tokens, hashable, err := s.requestTokens(in.Model, body, chat)
	if err != nil {
		openAIError(c, http.StatusBadRequest, "invalid_request_error", err.Error())
		return nil, false
	}
	bs := rt.Config().BlockSize
	id := fmt.Sprintf("%s-%d-%d", s.rep.NodeID(), start.UnixNano(), requestSeq.Add(1))
	s.metrics.inputTokens.WithLabelValues(in.Model).Add(float64(len(tokens)))
	return &prepared{
		body: body, path: c.Request.URL.Path, model: in.Model, stream: in.Stream, rt: rt, start: start,
		req: router.Request{ID: id, Hashes: hashes(tokens, bs, hashable), Tokens: len(tokens), Priority: in.Nvext.AgentHints.Priority},
	}, true
}

// requestTokens returns the prompt token ids of a request as the model's
// engine computes them (chat: the first and only prompt; completions: the
// first prompt of a batch, which the request is routed by). hashable is
// false for a model this replica has no tokenizer for: the ids are then a
// length estimate only, the request is routed by load alone, and that is
// counted and logged (a router that silently routes blind is the failure
// operators never see).
func (s *Server) requestTokens(model string, body []byte, chat bool) (tokens []uint32, hashable bool, err error) {
	m, ok := s.cfg.Prompts.Lookup(model)
	if !ok {
		s.noTokenizer(model)
		return make([]uint32, len(body)/4), false, nil
	}
	if chat {
		tokens, err = m.Chat(body)
		return tokens, true, err
	}
	prompts, err := m.Completion(body)
	if err != nil {
		return nil, false, err
	}
	return prompts[0], true, nil
}

// noTokenizer makes a request for a model without model files loud: a
// counter per model and a warning the first time.
func (s *Server) noTokenizer(model string) {
	s.metrics.noTokenizer.WithLabelValues(model).Inc()
	if _, seen := s.warnedNoTokenizer.LoadOrStore(model, true); !seen {
		s.log.Warn("model has no tokenizer on this replica: routing its requests by load only, without prefix hits",
			"model", model, "fix", "--model-dir "+model+"=DIR")
	}
}

func hashes(tokens []uint32, blockSize int, hashable bool) []uint64 {
	if !hashable {
		return nil
	}
	return router.SequenceHashes(tokens, blockSize, "")
}

// forward routes the request and proxies it, retrying on another worker when
// the connection fails before the worker answered.
func (s *Server) forward(c *gin.Context, p *prepared) {
	p.req.Exclude = append(p.req.Exclude, s.cool.exclude(workerIDs(p.rt.Workers()), time.Now())...)
	for attempt := 0; ; attempt++ {
		d, err := p.rt.Route(p.req, time.Now())
		if err != nil {
			s.routeError(c, p, err, attempt)
			return
		}
		s.metrics.routed.WithLabelValues(p.model, string(d.Worker)).Inc()
		booking := router.Booking{ID: p.req.ID, Worker: d.Worker, Hashes: p.req.Hashes,
			PrefillTokens: p.req.Tokens - d.Overlap*p.rt.Config().BlockSize, Added: p.start}
		s.rep.Booked(p.model, booking)
		base, ok := s.rep.WorkerURL(d.Worker)
		if !ok {
			s.free(p)
			p.req.Exclude = append(p.req.Exclude, d.Worker)
			continue
		}
		resp, err := s.send(c, base+p.path, p.body)
		if err != nil {
			s.free(p)
			if c.Request.Context().Err() == nil {
				s.cool.fail(d.Worker, time.Now())
			}
			s.metrics.retries.WithLabelValues(string(d.Worker)).Inc()
			s.log.Warn("worker connection failed", "worker", d.Worker, "attempt", attempt, "err", err)
			if c.Request.Context().Err() != nil {
				return
			}
			p.req.Exclude = append(p.req.Exclude, d.Worker)
			if attempt >= s.cfg.Retries {
				openAIError(c, http.StatusBadGateway, "worker_unavailable", fmt.Sprintf("worker %s: %v", d.Worker, err))
				return
			}
			continue
		}
		s.relay(c, p, d.Worker, d.Overlap, resp, relayHooks{
			firstByte: func() {
				p.rt.PrefillDone(p.req.ID)
				s.rep.PrefillDone(p.model, p.req.ID)
			},
			done: func() { s.free(p) },
		})
		return
	}
}

func (s *Server) routeError(c *gin.Context, p *prepared, err error, attempt int) {
	switch {
	case errors.Is(err, router.ErrAllBusy) && attempt == 0:
		s.metrics.rejected.WithLabelValues("all_busy").Inc()
		openAIError(c, s.cfg.BusyStatus, "service_overloaded", "all workers are busy; retry later")
	case errors.Is(err, router.ErrAllBusy):
		openAIError(c, http.StatusBadGateway, "worker_unavailable", "no other worker could take the request")
	case errors.Is(err, router.ErrNoWorkers):
		s.metrics.rejected.WithLabelValues("no_workers").Inc()
		openAIError(c, http.StatusServiceUnavailable, "no_workers", fmt.Sprintf("no workers registered for model %q", p.model))
	default:
		openAIError(c, http.StatusInternalServerError, "internal_error", err.Error())
	}
}

func (s *Server) send(c *gin.Context, url string, body []byte) (*http.Response, error) {
	req, err := http.NewRequestWithContext(c.Request.Context(), http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if a := c.GetHeader("Accept"); a != "" {
		req.Header.Set("Accept", a)
	}
	return s.client.Do(req)
}

// relayHooks are the load bookkeeping around a relayed answer: firstByte
// runs at the first body bytes (prefill done), done at the end, on error, or
// when the client goes away (free).
type relayHooks struct {
	firstByte func()
	done      func()
}

// relay streams the worker's answer back byte for byte. overlap is the
// cached blocks the router predicted on worker, audited against the usage
// the worker reports; negative skips the audit (a disaggregated decode
// worker reports transferred tokens as cached).
func (s *Server) relay(c *gin.Context, p *prepared, worker router.WorkerID, overlap int, resp *http.Response, hooks relayHooks) {
	defer resp.Body.Close()
	defer hooks.done()
	h := c.Writer.Header()
	for k, vs := range resp.Header {
		if k == "Content-Length" {
			continue
		}
		for _, v := range vs {
			h.Add(k, v)
		}
	}
	h.Set("X-Worker-Id", string(worker))
	if overlap >= 0 {
		h.Set("X-Cached-Blocks", strconv.Itoa(overlap))
	}
	c.Status(resp.StatusCode)

	audit := newUsageScanner(p.stream)
	buf := make([]byte, 32<<10)
	first := true
	last := time.Now()
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			now := time.Now()
			if first {
				first = false
				hooks.firstByte()
				s.metrics.ttft.WithLabelValues(p.model).Observe(now.Sub(p.start).Seconds())
			} else if p.stream {
				s.metrics.itl.WithLabelValues(p.model).Observe(now.Sub(last).Seconds())
			}
			last = now
			audit.write(buf[:n])
			if _, werr := c.Writer.Write(buf[:n]); werr != nil {
				s.metrics.requests.WithLabelValues(p.model, "client_gone").Inc()
				return
			}
			c.Writer.Flush()
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			s.metrics.requests.WithLabelValues(p.model, "upstream_error").Inc()
			s.log.Warn("worker stream broke", "worker", worker, "err", err)
			return
		}
	}
	s.metrics.requests.WithLabelValues(p.model, strconv.Itoa(resp.StatusCode)).Inc()
	s.metrics.e2e.WithLabelValues(p.model).Observe(time.Since(p.start).Seconds())
	if u, ok := audit.usage(); ok {
		bs := p.rt.Config().BlockSize
		s.metrics.observeUsage(p.model, string(worker), u, max(overlap, 0)*bs)
		if u.Details != nil && overlap >= 0 {
			s.rep.Audit(worker, overlap*bs, u.Details.CachedTokens, u.PromptTokens)
		}
	}
}

func (s *Server) free(p *prepared) {
	p.rt.Free(p.req.ID)
	s.rep.Freed(p.model, p.req.ID)
	s.gates.wake(p.model)
}

func (s *Server) listModels(c *gin.Context) {
	data := []gin.H{}
	for _, m := range s.rep.Models() {
		data = append(data, gin.H{"id": m, "object": "model", "created": 0, "owned_by": "kvrouter"})
	}
	c.JSON(http.StatusOK, gin.H{"object": "list", "data": data})
}
