package main

import (
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/internal/splitmix"
)

// Requests of several sequences, embeddings and the Responses API: what
// the router routes (api/endpoints.go) and an OpenAI client sends.
//
// n > 1, or a completions batch of prompts: every (prompt, sample) pair is
// one engine request, all submitted at once, as vLLM schedules a request's
// sequences together; the answer has one choice per pair, indexed
// prompt·n + sample (OpenAI's order), usage summed. Streamed, each
// sequence's chunks carry its choice index: its first token when the
// engine produces it, the rest when the sequence finishes (kvmock paces
// the tokens of a single sequence only), then its finish chunk; one usage
// chunk for all of them and [DONE] end the stream.

// maxSequences caps n·prompts (the router books at most this many).
const maxSequences = 1024

// finished waits for one engine request to finish (false: the client went
// away or the engine stopped).
func finished(ctx context.Context, wt *waiter) (engine.Output, bool) {
	for {
		ups, stopped := wt.take()
		for _, u := range ups {
			if u.out.Kind == engine.Finished {
				return u.out, true
			}
		}
		if stopped {
			return engine.Output{}, false
		}
		select {
		case <-wt.notify:
		case <-ctx.Done():
			return engine.Output{}, false
		}
	}
}

// generateMany answers prompts × n sequences in one answer, streamed or
// whole.
func (m *Mock) generateMany(w http.ResponseWriter, r *http.Request, chat bool, prompts [][]uint32, n, maxTokens, priority int, stream bool) {
	type seq struct {
		id     string
		tokens []uint32
		sample int
		wt     *waiter
	}
	var seqs []seq
	defer func() {
		for _, s := range seqs {
			m.drv.cancel(s.id) // a no-op for finished ones
		}
	}()
	for _, p := range prompts {
		for j := range n {
			id := fmt.Sprintf("%s-%d", m.cfg.ID, m.reqSeq.Add(1))
			wt, err := m.drv.submit(r.Context(), engine.Request{ID: id, Tokens: p, OutputTokens: maxTokens, Priority: priority})
			if m.submitFailed(w, r, err) {
				return
			}
			seqs = append(seqs, seq{id: id, tokens: p, sample: j, wt: wt})
		}
	}
	m.ctr.inflight.Add(1)
	defer m.ctr.inflight.Add(-1)
	reqID := seqs[0].id
	if stream {
		gens := make([]*generation, len(seqs))
		waiters := make([]*waiter, len(seqs))
		for i, s := range seqs {
			gens[i] = &generation{id: "cmpl-" + reqID, object: "text_completion", chat: chat, created: time.Now().Unix(), model: m.cfg.Model,
				pieces: outputPieces(m.tok, outputIDs(m.cfg.Seed+uint64(s.sample), s.tokens, maxTokens))}
			if chat {
				gens[i].id, gens[i].object = "chatcmpl-"+reqID, "chat.completion"
			}
			waiters[i] = s.wt
		}
		m.ctr.streams.Add(1)
		if usage, ok := m.streamMany(w, r, waiters, gens); ok {
			m.ctr.completed.Add(1)
			m.ctr.promptTokens.Add(uint64(usage.PromptTokens))
			m.ctr.cachedTokens.Add(uint64(usage.PromptTokensDetails.CachedTokens))
			m.ctr.outputToks.Add(uint64(usage.CompletionTokens))
		}
		return
	}
	doc := responseDoc{ID: "cmpl-" + reqID, Object: "text_completion", Created: time.Now().Unix(), Model: m.cfg.Model, Usage: &usageDoc{}}
	if chat {
		doc.ID, doc.Object = "chatcmpl-"+reqID, "chat.completion"
	}
	for i, s := range seqs {
		out, ok := finished(r.Context(), s.wt)
		if !ok {
			if r.Context().Err() == nil {
				m.ctr.serverErrors.Add(1)
				writeError(w, http.StatusServiceUnavailable, "server_error", "shutting_down", "the worker shut down before the request finished")
			} else {
				m.ctr.cancelled.Add(1)
			}
			return
		}
		// Each sample of a prompt its own text: the seed moves with it.
		text := strings.Join(outputPieces(m.tok, outputIDs(m.cfg.Seed+uint64(s.sample), s.tokens, maxTokens)), "")
		choice := choiceDoc{Index: i, FinishReason: strPtr("stop")}
		if chat {
			choice.Message = &messageDoc{Role: "assistant", Content: text}
		} else {
			choice.Text = &text
		}
		doc.Choices = append(doc.Choices, choice)
		u := doc.Usage
		u.PromptTokens += out.PromptTokens
		u.CompletionTokens += maxTokens
		u.PromptTokensDetails.CachedTokens += out.CachedTokens
	}
	doc.Usage.TotalTokens = doc.Usage.PromptTokens + doc.Usage.CompletionTokens
	writeJSON(w, http.StatusOK, doc)
	m.ctr.completed.Add(1)
	m.ctr.promptTokens.Add(uint64(doc.Usage.PromptTokens))
	m.ctr.cachedTokens.Add(uint64(doc.Usage.PromptTokensDetails.CachedTokens))
	m.ctr.outputToks.Add(uint64(doc.Usage.CompletionTokens))
}

// streamMany streams several sequences of one request as SSE (see the
// comment at the top of this file). The usage returned sums every
// sequence's; false: the client went away or the engine stopped.
func (m *Mock) streamMany(w http.ResponseWriter, r *http.Request, waiters []*waiter, gens []*generation) (usageDoc, bool) {
	s := startSSE(w)

	// One wake-up channel for all sequences: a forwarder per waiter.
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	wake := make(chan struct{}, 1)
	for _, wt := range waiters {
		go func() {
			for {
				select {
				case <-wt.notify:
					select {
					case wake <- struct{}{}:
					default:
					}
				case <-ctx.Done():
					return
				}
			}
		}()
	}
	indexed := func(c responseDoc, i int) responseDoc {
		c.Choices[0].Index = i
		return c
	}
	var usage usageDoc
	started := make([]bool, len(gens))
	done := make([]bool, len(gens))
	left := len(gens)
	for {
		for i, wt := range waiters {
			if done[i] {
				continue
			}
			ups, stopped := wt.take()
			for _, u := range ups {
				g := gens[i]
				switch u.out.Kind {
				case engine.FirstToken:
					if !started[i] {
						s.data(indexed(g.chunk(0, false), i))
						started[i] = true
					}
				case engine.Finished:
					if !started[i] {
						s.data(indexed(g.chunk(0, false), i))
						started[i] = true
					}
					for k := 1; k < len(g.pieces); k++ {
						s.data(indexed(g.chunk(k, false), i))
					}
					s.data(indexed(g.chunk(0, true), i))
					g.setUsage(u.out)
					usage.PromptTokens += g.usage.PromptTokens
					usage.CompletionTokens += g.usage.CompletionTokens
					usage.PromptTokensDetails.CachedTokens += g.usage.PromptTokensDetails.CachedTokens
					done[i] = true
					left--
				}
			}
			if stopped && !done[i] {
				m.ctr.serverErrors.Add(1)
				s.data(map[string]any{"error": map[string]any{"message": "the worker shut down before the request finished", "type": "server_error", "code": 503}})
				s.flush()
				return usage, false
			}
		}
		if left == 0 {
			usage.TotalTokens = usage.PromptTokens + usage.CompletionTokens
			g := gens[0]
			s.data(responseDoc{ID: g.id, Object: g.chunk(0, true).Object, Created: g.created, Model: g.model,
				Choices: []choiceDoc{}, Usage: &usage})
			s.done()
			s.flush()
			return usage, s.err == nil
		}
		s.flush()
		if s.err != nil {
			return usage, false // the client went away
		}
		select {
		case <-wake:
		case <-r.Context().Done():
			return usage, false
		}
	}
}

// embeddingDims is the length of kvmock's embedding vectors.
const embeddingDims = 8

// embeddings answers /v1/embeddings: the input tokenized as a completions
// prompt (as the router does), one deterministic unit vector per input
// (from its token ids), float or base64 (little-endian float32, what
// OpenAI's clients ask for by default). No engine step: pooling models do
// not decode, and kvmock does not model their prefill.
func (m *Mock) embeddings(w http.ResponseWriter, r *http.Request) {
	body, ok := m.readBody(w, r)
	if !ok {
		return
	}
	var in struct {
		Model          string          `json:"model"`
		Input          json.RawMessage `json:"input"`
		EncodingFormat string          `json:"encoding_format"`
	}
	if err := json.Unmarshal(body, &in); err != nil || len(in.Input) == 0 {
		m.badRequest(w, "embeddings: want a JSON body with \"input\"")
		return
	}
	if in.Model != "" && in.Model != m.cfg.Model {
		m.ctr.badRequests.Add(1)
		writeError(w, http.StatusNotFound, "invalid_request_error", "model_not_found", fmt.Sprintf("the model %q does not exist (this worker serves %q)", in.Model, m.cfg.Model))
		return
	}
	comp, _ := json.Marshal(map[string]json.RawMessage{"prompt": in.Input})
	prompts, err := m.prompt.Completion(comp)
	if err != nil {
		m.badRequest(w, "embeddings input: "+err.Error())
		return
	}
	type item struct {
		Object    string `json:"object"`
		Index     int    `json:"index"`
		Embedding any    `json:"embedding"`
	}
	var data []item
	tokens := 0
	for i, p := range prompts {
		tokens += len(p)
		vec := embed(p)
		var e any = vec
		if in.EncodingFormat == "base64" {
			buf := make([]byte, 4*len(vec))
			for j, f := range vec {
				binary.LittleEndian.PutUint32(buf[4*j:], math.Float32bits(f))
			}
			e = base64.StdEncoding.EncodeToString(buf)
		}
		data = append(data, item{Object: "embedding", Index: i, Embedding: e})
	}
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "model": m.cfg.Model, "data": data,
		"usage": map[string]int{"prompt_tokens": tokens, "total_tokens": tokens}})
}

// embed is a unit vector determined by the token ids.
func embed(ids []uint32) []float32 {
	v := make([]float32, embeddingDims)
	h := splitmix.Next(uint64(len(ids)))
	norm := 0.0
	for i := range v {
		for _, t := range ids {
			h = splitmix.Next(h ^ uint64(t) ^ uint64(i)<<32)
		}
		v[i] = float32(int64(h>>11)%2001-1000) / 1000
		norm += float64(v[i]) * float64(v[i])
	}
	if norm == 0 {
		v[0], norm = 1, 1
	}
	for i := range v {
		v[i] /= float32(math.Sqrt(norm))
	}
	return v
}

// responses answers /v1/responses (not streamed): the input rendered as
// chat messages exactly as the router renders it (api.ResponsesToChat),
// generated as a chat completion, answered as a Response object.
func (m *Mock) responses(w http.ResponseWriter, r *http.Request) {
	body, ok := m.readBody(w, r)
	if !ok {
		return
	}
	var in struct {
		Model           string `json:"model"`
		Stream          bool   `json:"stream"`
		MaxOutputTokens *int   `json:"max_output_tokens"`
	}
	if err := json.Unmarshal(body, &in); err != nil {
		m.badRequest(w, "invalid JSON body: "+err.Error())
		return
	}
	if in.Stream {
		m.badRequest(w, "responses: kvmock does not stream the Responses API")
		return
	}
	chatBody, err := api.ResponsesToChat(body)
	if err != nil {
		m.badRequest(w, err.Error())
		return
	}
	var chat map[string]any
	_ = json.Unmarshal(chatBody, &chat)
	chat["model"] = in.Model
	if in.MaxOutputTokens != nil {
		chat["max_tokens"] = *in.MaxOutputTokens
	}
	chatBody, _ = json.Marshal(chat)
	rec := httptest.NewRecorder() // the chat answer, reshaped below
	m.ctr.chat.Add(1)
	m.generateBody(rec, r, true, chatBody)
	if rec.Code != http.StatusOK {
		for k, vs := range rec.Header() {
			w.Header()[k] = vs
		}
		w.WriteHeader(rec.Code)
		_, _ = w.Write(rec.Body.Bytes())
		return
	}
	var doc responseDoc
	if err := json.Unmarshal(rec.Body.Bytes(), &doc); err != nil || len(doc.Choices) == 0 || doc.Choices[0].Message == nil || doc.Usage == nil {
		m.ctr.serverErrors.Add(1)
		writeError(w, http.StatusInternalServerError, "server_error", "", "responses: no chat answer to reshape")
		return
	}
	id := strings.TrimPrefix(doc.ID, "chatcmpl-")
	u := doc.Usage
	writeJSON(w, http.StatusOK, map[string]any{
		"id": "resp_" + id, "object": "response", "created_at": doc.Created, "model": doc.Model, "status": "completed",
		"output": []any{map[string]any{
			"type": "message", "id": "msg_" + id, "status": "completed", "role": "assistant",
			"content": []any{map[string]any{"type": "output_text", "text": doc.Choices[0].Message.Content, "annotations": []any{}}},
		}},
		"usage": map[string]any{
			"input_tokens": u.PromptTokens, "input_tokens_details": map[string]int{"cached_tokens": u.PromptTokensDetails.CachedTokens},
			"output_tokens": u.CompletionTokens, "output_tokens_details": map[string]int{"reasoning_tokens": 0},
			"total_tokens": u.TotalTokens,
		},
		"parallel_tool_calls": true, "tool_choice": "auto", "tools": []any{},
	})
}
