package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/engine"
)

const (
	defaultMaxTokens = 16
	maxBodyBytes     = 32 << 20
)

// Handler serves the OpenAI-compatible API and the worker's own endpoints.
func (m *Mock) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { m.generate(w, r, true) })
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { m.generate(w, r, false) })
	mux.HandleFunc("POST /v1/embeddings", m.embeddings)
	mux.HandleFunc("POST /v1/responses", m.responses)
	mux.HandleFunc("GET /v1/models", m.models)
	mux.HandleFunc("GET /health", m.health)
	mux.HandleFunc("GET /stats", m.stats)
	mux.HandleFunc("GET /metrics", m.metrics)
	mux.HandleFunc("GET /kv/pull", m.kvPull)
	mux.HandleFunc("POST /tokenize", m.tokenize)
	mux.HandleFunc("POST /detokenize", m.detokenize)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "invalid_request_error", "not_found", fmt.Sprintf("no route %s %s", r.Method, r.URL.Path))
	})
	return mux
}

// genRequest is the part of an OpenAI chat or completions body kvmock reads.
type genRequest struct {
	Model string `json:"model"`
	// Messages and Prompt are only looked at here: prompt.Model reads the
	// body itself, as the router does.
	Messages      json.RawMessage `json:"messages"`
	Prompt        json.RawMessage `json:"prompt"`
	Stream        bool            `json:"stream"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	MaxTokens           *int `json:"max_tokens"`
	MaxCompletionTokens *int `json:"max_completion_tokens"`
	N                   *int `json:"n"`
	// Priority is vLLM's request priority (lower first), read under a
	// priority --scheduling-policy; a non-zero one under fcfs is a 400.
	Priority *int64 `json:"priority"`
	// KVTransferParams asks for a disaggregation stage (disagg.go).
	KVTransferParams *kvTransferParams `json:"kv_transfer_params"`
}

// OpenAI response shapes.
type (
	usageDoc struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		TotalTokens         int `json:"total_tokens"`
		PromptTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	}
	messageDoc struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	deltaDoc struct {
		Role    string  `json:"role,omitempty"`
		Content *string `json:"content,omitempty"`
	}
	choiceDoc struct {
		Index        int         `json:"index"`
		Message      *messageDoc `json:"message,omitempty"`
		Delta        *deltaDoc   `json:"delta,omitempty"`
		Text         *string     `json:"text,omitempty"`
		Logprobs     any         `json:"logprobs"` // always null
		FinishReason *string     `json:"finish_reason"`
	}
	responseDoc struct {
		ID      string      `json:"id"`
		Object  string      `json:"object"`
		Created int64       `json:"created"`
		Model   string      `json:"model"`
		Choices []choiceDoc `json:"choices"`
		Usage   *usageDoc   `json:"usage,omitempty"`
		// KVTransferParams: the prefill stage's answer (disagg.go).
		KVTransferParams *kvTransferParams `json:"kv_transfer_params,omitempty"`
	}
)

// writeError answers in OpenAI's error shape.
func writeError(w http.ResponseWriter, status int, typ, code, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	var c any
	if code != "" {
		c = code
	}
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{"message": msg, "type": typ, "param": nil, "code": c}})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func (m *Mock) badRequest(w http.ResponseWriter, msg string) {
	m.ctr.badRequests.Add(1)
	writeError(w, http.StatusBadRequest, "invalid_request_error", "", msg)
}

// promptTokens tokenizes the request exactly as the router does (see
// api/openai.go requestTokens), with the same code: prompt.Model. Chat: the
// chat template renders the conversation with the generation prompt, then
// it is encoded (add_special_tokens false unless the body says otherwise);
// completions: each string of a batch encoded with the tokenizer's special
// tokens (BOS), or the token ids as given.
func (m *Mock) promptTokens(body []byte, in *genRequest, chat bool) ([][]uint32, error) {
	if chat {
		if len(bytes.TrimSpace(in.Messages)) == 0 || string(bytes.TrimSpace(in.Messages)) == "null" {
			return nil, errors.New("messages must not be empty")
		}
		p, err := m.prompt.Chat(body)
		return [][]uint32{p}, err
	}
	return m.prompt.Completion(body)
}

// generation is one request on its way through the engine.
type generation struct {
	id      string // response id
	object  string // chat.completion(.chunk) or text_completion
	chat    bool
	created int64
	model   string
	pieces  []string // output text, one piece per token
	usage   usageDoc
	// offer, when set (prefill stage), is called as the request finishes,
	// before the answer is written; it returns the kv_transfer_params.
	offer func() *kvTransferParams
}

func (m *Mock) generate(w http.ResponseWriter, r *http.Request, chat bool) {
	if chat {
		m.ctr.chat.Add(1)
	} else {
		m.ctr.completions.Add(1)
	}
	body, ok := m.readBody(w, r)
	if !ok {
		return
	}
	m.generateBody(w, r, chat, body)
}

// generateBody serves a chat or completions body already read.
func (m *Mock) generateBody(w http.ResponseWriter, r *http.Request, chat bool, body []byte) {
	var in genRequest
	if err := json.Unmarshal(body, &in); err != nil {
		m.badRequest(w, "invalid JSON body: "+err.Error())
		return
	}
	if in.Model != "" && in.Model != m.cfg.Model {
		m.ctr.badRequests.Add(1)
		writeError(w, http.StatusNotFound, "invalid_request_error", "model_not_found", fmt.Sprintf("the model %q does not exist (this worker serves %q)", in.Model, m.cfg.Model))
		return
	}
	prompts, err := m.promptTokens(body, &in, chat)
	if err != nil {
		m.badRequest(w, err.Error())
		return
	}
	for _, p := range prompts {
		if len(p) == 0 {
			m.badRequest(w, "prompt is empty (no tokens)")
			return
		}
	}
	tokens := prompts[0]
	maxTokens := defaultMaxTokens
	switch {
	case in.MaxCompletionTokens != nil:
		maxTokens = *in.MaxCompletionTokens
	case in.MaxTokens != nil:
		maxTokens = *in.MaxTokens
	}
	if maxTokens <= 0 {
		m.badRequest(w, fmt.Sprintf("max_tokens must be at least 1, got %d", maxTokens))
		return
	}
	var priority int
	if in.Priority != nil {
		if *in.Priority != 0 && m.engCfg.Scheduling == engine.SchedulingFCFS {
			m.badRequest(w, fmt.Sprintf("Got priority %d but Priority scheduling is not enabled.", *in.Priority))
			return
		}
		priority = int(*in.Priority)
	}
	n := 1
	if in.N != nil {
		n = *in.N
	}
	if n < 1 || n*len(prompts) > maxSequences {
		m.badRequest(w, fmt.Sprintf("n must be in [1, %d] per request (with %d prompts), got %d", maxSequences/len(prompts), len(prompts), n))
		return
	}
	for _, p := range prompts {
		if total := len(p) + maxTokens; total > m.engCfg.MaxModelLen {
			m.badRequest(w, fmt.Sprintf("this model's maximum context length is %d tokens; the request has %d prompt tokens and asks for %d output tokens",
				m.engCfg.MaxModelLen, len(p), maxTokens))
			return
		}
	}
	if n > 1 || len(prompts) > 1 {
		if in.KVTransferParams != nil {
			m.badRequest(w, "kvmock disaggregates one sequence: n > 1 and batches of prompts are served aggregated")
			return
		}
		m.generateMany(w, r, chat, prompts, n, maxTokens, priority, in.Stream)
		return
	}
	kv := in.KVTransferParams
	stage, err := m.stageOf(kv, in.Stream)
	if err != nil {
		m.badRequest(w, err.Error())
		return
	}
	if stage == stageDecode && kv.NumTokens > 0 && kv.NumTokens != len(tokens) {
		m.badRequest(w, fmt.Sprintf("kv_transfer_params.num_tokens is %d but the prompt has %d tokens (another prompt, or another tokenizer or chat template)",
			kv.NumTokens, len(tokens)))
		return
	}

	reqID := fmt.Sprintf("%s-%d", m.cfg.ID, m.reqSeq.Add(1))
	wt, err := m.drv.submit(r.Context(), engine.Request{ID: reqID, Tokens: tokens, OutputTokens: maxTokens,
		RemotePrefill: stage == stageDecode, Priority: priority})
	if m.submitFailed(w, r, err) {
		return
	}
	m.ctr.inflight.Add(1)
	defer m.ctr.inflight.Add(-1)
	finished, failed := false, false
	defer func() {
		if !finished {
			m.drv.cancel(reqID)
			if !failed {
				m.ctr.cancelled.Add(1)
			}
		}
	}()
	if stage == stageDecode {
		var ok bool
		if ok, failed = m.receiveKV(w, r, wt, reqID, kv, len(tokens)); !ok {
			return
		}
	}

	g := &generation{
		id: "cmpl-" + reqID, object: "text_completion", chat: chat,
		created: time.Now().Unix(), model: m.cfg.Model,
		pieces: outputPieces(m.tok, outputIDs(m.cfg.Seed, tokens, maxTokens)),
	}
	if chat {
		g.id, g.object = "chatcmpl-"+reqID, "chat.completion"
	}
	if stage == stagePrefill {
		g.offer = func() *kvTransferParams { return m.offerKV(reqID, len(tokens)) }
	}
	if in.Stream {
		m.ctr.streams.Add(1)
		finished = m.streamAnswer(w, r, wt, g)
	} else {
		finished = m.plainAnswer(w, r, wt, g)
	}
	if finished {
		m.ctr.completed.Add(1)
		m.ctr.promptTokens.Add(uint64(g.usage.PromptTokens))
		m.ctr.cachedTokens.Add(uint64(g.usage.PromptTokensDetails.CachedTokens))
		m.ctr.outputToks.Add(uint64(g.usage.CompletionTokens))
	}
}

func (g *generation) setUsage(o engine.Output) {
	g.usage.PromptTokens = o.PromptTokens
	g.usage.CompletionTokens = len(g.pieces)
	g.usage.TotalTokens = o.PromptTokens + len(g.pieces)
	g.usage.PromptTokensDetails.CachedTokens = o.CachedTokens
}

func strPtr(s string) *string { return &s }

// plainAnswer waits for the request to finish and writes the whole answer.
// False: the client went away or the engine stopped.
func (m *Mock) plainAnswer(w http.ResponseWriter, r *http.Request, wt *waiter, g *generation) bool {
	for {
		ups, stopped := wt.take()
		for _, u := range ups {
			if u.out.Kind != engine.Finished {
				continue
			}
			g.setUsage(u.out)
			text := strings.Join(g.pieces, "")
			choice := choiceDoc{FinishReason: strPtr("stop")}
			if g.chat {
				choice.Message = &messageDoc{Role: "assistant", Content: text}
			} else {
				choice.Text = &text
			}
			doc := responseDoc{ID: g.id, Object: g.object, Created: g.created, Model: g.model,
				Choices: []choiceDoc{choice}, Usage: &g.usage}
			if g.offer != nil {
				doc.KVTransferParams = g.offer()
			}
			writeJSON(w, http.StatusOK, doc)
			return true
		}
		if stopped {
			m.ctr.serverErrors.Add(1)
			writeError(w, http.StatusServiceUnavailable, "server_error", "shutting_down", "the worker shut down before the request finished")
			return false
		}
		select {
		case <-wt.notify:
		case <-r.Context().Done():
			return false
		}
	}
}

// startSSE answers 200 with an event stream's headers, flushed.
func startSSE(w http.ResponseWriter) *sse {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	s := &sse{w: w, rc: http.NewResponseController(w)}
	s.flush()
	return s
}

// sse writes server-sent events.
type sse struct {
	w   io.Writer
	rc  *http.ResponseController
	err error
}

func (s *sse) data(v any) {
	if s.err != nil {
		return
	}
	b, err := json.Marshal(v)
	if err != nil {
		s.err = err
		return
	}
	_, s.err = fmt.Fprintf(s.w, "data: %s\n\n", b)
}

func (s *sse) done() {
	if s.err == nil {
		_, s.err = io.WriteString(s.w, "data: [DONE]\n\n")
	}
}

func (s *sse) flush() {
	if s.err == nil {
		s.err = s.rc.Flush()
	}
}

// chunk is one streamed piece (final: the finish chunk, with no text).
func (g *generation) chunk(i int, final bool) responseDoc {
	choice := choiceDoc{}
	var text string
	if !final {
		text = g.pieces[i]
	} else {
		choice.FinishReason = strPtr("stop")
	}
	object := "text_completion"
	if g.chat {
		object = "chat.completion.chunk"
		choice.Delta = &deltaDoc{}
		if !final {
			choice.Delta.Content = &text
		}
		if i == 0 && !final {
			choice.Delta.Role = "assistant"
		}
	} else {
		choice.Text = &text
	}
	return responseDoc{ID: g.id, Object: object, Created: g.created, Model: g.model, Choices: []choiceDoc{choice}}
}

// streamAnswer streams the answer as SSE: nothing is sent in the body
// before the engine's first token (the router takes the first body bytes
// as the end of prefill); the other tokens follow at the engine's decode
// pace, the rest at once when the engine finishes; then the finish chunk,
// a usage chunk (always: the router audits cached tokens from it) and
// [DONE]. False: the client went away or the engine stopped.
func (m *Mock) streamAnswer(w http.ResponseWriter, r *http.Request, wt *waiter, g *generation) bool {
	s := startSSE(w)

	n := len(g.pieces)
	emitted := 0
	var (
		firstAt time.Time
		itl     time.Duration
		final   *engine.Output
	)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		ups, stopped := wt.take()
		for _, u := range ups {
			switch u.out.Kind {
			case engine.FirstToken:
				if emitted == 0 {
					firstAt, itl = time.Now(), u.itl
					s.data(g.chunk(0, false))
					emitted = 1
				}
			case engine.Finished:
				o := u.out
				final = &o
			}
		}
		if final != nil {
			for ; emitted < n; emitted++ {
				s.data(g.chunk(emitted, false))
			}
			g.setUsage(*final)
			s.data(g.chunk(0, true))
			s.data(responseDoc{ID: g.id, Object: g.chunk(0, true).Object, Created: g.created, Model: g.model,
				Choices: []choiceDoc{}, Usage: &g.usage})
			s.done()
			s.flush()
			return s.err == nil
		}
		if stopped {
			m.ctr.serverErrors.Add(1)
			s.data(map[string]any{"error": map[string]any{"message": "the worker shut down before the request finished", "type": "server_error", "code": 503}})
			s.flush()
			return false
		}
		// Pace the middle tokens; the last one waits for Finished.
		var tick <-chan time.Time
		if emitted > 0 && emitted < n-1 {
			for emitted < n-1 && !time.Now().Before(firstAt.Add(time.Duration(emitted)*itl)) {
				s.data(g.chunk(emitted, false))
				emitted++
			}
			if emitted < n-1 {
				timer.Reset(time.Until(firstAt.Add(time.Duration(emitted) * itl)))
				tick = timer.C
			}
		}
		s.flush()
		if s.err != nil {
			return false // the client went away
		}
		select {
		case <-wt.notify:
		case <-tick:
		case <-r.Context().Done():
			return false
		}
	}
}

// receiveKV is the decode stage's transfer. It waits for the engine to
// admit the request (AwaitingKV: blocks allocated, its local prefix hit
// known), pulls the KV of the other prompt tokens from the prefill worker
// and hands the request back to the engine, which then computes only the
// last prompt token. The client's TTFT therefore includes the queueing
// here, the transfer and that one-token step.
//
// ok: the request goes on (nothing was written; the response headers say
// what was pulled). Otherwise answered says whether it answered (502 for
// a failed pull, before any body byte, so the router can retry or fall
// back; 503 at shutdown); not answered means the client went away.
//
// usage.prompt_tokens_details.cached_tokens of the answer counts the
// prompt tokens this worker did not compute: its own prefix hit plus the
// transferred tokens, less the last prompt token, which it recomputes to
// sample the first token. That is what vLLM reports for a NIXL decode
// (its scheduler sets num_computed_tokens = prompt − 1 when the received
// blocks cover the whole prompt, and cached_tokens is taken from it).
func (m *Mock) receiveKV(w http.ResponseWriter, r *http.Request, wt *waiter, reqID string, kv *kvTransferParams, promptTokens int) (ok, answered bool) {
	local := -1
	for local < 0 {
		ups, stopped := wt.take()
		for _, u := range ups {
			if u.out.Kind == engine.AwaitingKV { // nothing else comes before KVReceived
				local = u.out.CachedTokens
			}
		}
		if local >= 0 {
			break
		}
		if stopped {
			m.ctr.serverErrors.Add(1)
			writeError(w, http.StatusServiceUnavailable, "server_error", "shutting_down", "the worker shut down before the request was admitted")
			return false, true
		}
		select {
		case <-wt.notify:
		case <-r.Context().Done():
			return false, false
		}
	}
	need := promptTokens - local
	pulled, err := m.pullKV(r.Context(), kv, need)
	if err != nil {
		if r.Context().Err() != nil {
			return false, false
		}
		m.ctr.serverErrors.Add(1)
		m.log.Warn("KV transfer failed", "request", reqID, "transfer", kv.TransferID, "err", err)
		writeKVTransferFailed(w, err.Error())
		return false, true
	}
	switch received, err := m.drv.kvReceived(r.Context(), reqID); {
	case errors.Is(err, errStopped):
		m.ctr.serverErrors.Add(1)
		writeError(w, http.StatusServiceUnavailable, "server_error", "shutting_down", "the worker is shutting down")
		return false, true
	case err != nil:
		return false, false // the client went away
	case !received:
		m.ctr.serverErrors.Add(1)
		writeError(w, http.StatusInternalServerError, "server_error", "", "the engine lost the request while its KV was transferred")
		return false, true
	}
	h := w.Header()
	h.Set("X-Kvmock-Kv-Local-Tokens", strconv.Itoa(local))
	h.Set("X-Kvmock-Kv-Pulled-Tokens", strconv.Itoa(need))
	h.Set("X-Kvmock-Kv-Pull-Seconds", strconv.FormatFloat(pulled.Seconds, 'f', -1, 64))
	return true, false
}

func (m *Mock) models(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []map[string]any{
		{"id": m.cfg.Model, "object": "model", "created": m.started.Unix(), "owned_by": "kvmock",
			"max_model_len": m.engCfg.MaxModelLen},
	}})
}

func (m *Mock) health(w http.ResponseWriter, _ *http.Request) {
	if isClosed(m.drv.done) {
		writeJSON(w, http.StatusServiceUnavailable, map[string]any{"status": "stopped", "id": m.cfg.ID})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": "ok", "id": m.cfg.ID, "model": m.cfg.Model})
}

// submitFailed answers the client, counts and reports true when the
// engine refused a request (err from drv.submit): 400 for a request it
// cannot serve, 503 when shutting down, nothing when the client left, 500
// otherwise.
func (m *Mock) submitFailed(w http.ResponseWriter, r *http.Request, err error) bool {
	switch {
	case err == nil:
		return false
	case errors.Is(err, engine.ErrRequest):
		m.badRequest(w, err.Error())
	case errors.Is(err, errStopped):
		m.ctr.serverErrors.Add(1)
		writeError(w, http.StatusServiceUnavailable, "server_error", "shutting_down", "the worker is shutting down")
	case r.Context().Err() != nil:
		m.ctr.cancelled.Add(1)
	default:
		m.ctr.serverErrors.Add(1)
		writeError(w, http.StatusInternalServerError, "server_error", "", err.Error())
	}
	return true
}
