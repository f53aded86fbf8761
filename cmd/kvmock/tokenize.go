package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
)

// vLLM's POST /tokenize and POST /detokenize, answered with the ids this
// worker computes for its prompts (promptTokens' code: prompt.Model). The
// kvrouter replicas send canary requests here and compare the ids with
// their own; a real vLLM or SGLang engine answers the same JSON.

// readSmallBody reads a tokenize/detokenize body (readBody) and checks
// its model, answering the client itself when it cannot.
func (m *Mock) readSmallBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	body, ok := m.readBody(w, r)
	if !ok {
		return nil, false
	}
	var in struct {
		Model string `json:"model"`
	}
	if err := json.Unmarshal(body, &in); err != nil {
		m.badRequest(w, "invalid JSON body: "+err.Error())
		return nil, false
	}
	// As in vLLM: no model means the served one.
	if in.Model != "" && in.Model != m.cfg.Model {
		m.ctr.badRequests.Add(1)
		writeError(w, http.StatusNotFound, "invalid_request_error", "model_not_found", fmt.Sprintf("the model %q does not exist (this worker serves %q)", in.Model, m.cfg.Model))
		return nil, false
	}
	return body, true
}

// tokenize answers {"model", "prompt" | "messages", "add_special_tokens",
// "add_generation_prompt", "chat_template_kwargs", …} with {"count",
// "max_model_len", "tokens", "token_strs"}. Chat bodies default to
// add_special_tokens false, prompts to true, as in vLLM.
func (m *Mock) tokenize(w http.ResponseWriter, r *http.Request) {
	body, ok := m.readSmallBody(w, r)
	if !ok {
		return
	}
	ids, err := m.prompt.Tokenize(body)
	if err != nil {
		m.badRequest(w, err.Error())
		return
	}
	if ids == nil {
		ids = []uint32{}
	}
	// token_strs needs the vocabulary's id → token map, which the
	// tokenizers do not keep; vLLM sends null unless return_token_strs.
	writeJSON(w, http.StatusOK, map[string]any{"count": len(ids), "max_model_len": m.engCfg.MaxModelLen, "tokens": ids, "token_strs": nil})
}

// detokenize answers {"model", "tokens"} with {"prompt"}.
func (m *Mock) detokenize(w http.ResponseWriter, r *http.Request) {
	body, ok := m.readSmallBody(w, r)
	if !ok {
		return
	}
	var in struct {
		Tokens *[]uint32 `json:"tokens"`
	}
	if err := json.Unmarshal(body, &in); err != nil || in.Tokens == nil {
		m.badRequest(w, "detokenize: want \"tokens\": a list of token ids")
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"prompt": m.prompt.Tokenizer().Decode(*in.Tokens)})
}

// readBody reads a request body of at most maxBodyBytes, answering the
// client itself when it cannot: 413 over the cap, 400 otherwise.
func (m *Mock) readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			m.ctr.badRequests.Add(1)
			writeError(w, http.StatusRequestEntityTooLarge, "invalid_request_error", "", fmt.Sprintf("request body over %d bytes", maxBodyBytes))
			return nil, false
		}
		m.badRequest(w, "reading body: "+err.Error())
		return nil, false
	}
	return body, true
}
