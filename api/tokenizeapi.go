package api

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"

	"github.com/gin-gonic/gin"

	"github.com/kvrouter/kvrouter/api/prompt"
)

// vLLM's /tokenize and /detokenize, answered by the replica itself with the
// same ids it hashes for routing: operators (and the engine self-check)
// compare them with the engine's own answer to the same body.

// tokenizeModel resolves the request's model to its tokenizing Model,
// answering the client itself when it cannot. As in vLLM, an absent model
// means the only served one.
func (s *Server) tokenizeModel(c *gin.Context, body []byte) (*prompt.Model, bool) {
	var in struct {
		Model string `json:"model"`
	}
	if err := json.Unmarshal(body, &in); err != nil {
		openAIError(c, http.StatusBadRequest, "invalid_request_error", "invalid JSON body: "+err.Error())
		return nil, false
	}
	models := s.rep.Models()
	if in.Model == "" {
		if len(models) != 1 {
			openAIError(c, http.StatusBadRequest, "invalid_request_error", fmt.Sprintf("model is required (served: %v)", models))
			return nil, false
		}
		in.Model = models[0]
	}
	if !slices.Contains(models, in.Model) {
		openAIError(c, http.StatusNotFound, "model_not_found", fmt.Sprintf("model %q is not served here", in.Model))
		return nil, false
	}
	m, ok := s.cfg.Prompts.Lookup(in.Model)
	if !ok {
		s.noTokenizer(in.Model)
		openAIError(c, http.StatusNotImplemented, "model_without_tokenizer",
			fmt.Sprintf("this replica has no tokenizer files for model %q (start it with --model-dir %s=DIR)", in.Model, in.Model))
		return nil, false
	}
	return m, true
}

func (s *Server) readBody(c *gin.Context) ([]byte, bool) {
	body, err := io.ReadAll(c.Request.Body)
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			openAIError(c, http.StatusRequestEntityTooLarge, "invalid_request_error", fmt.Sprintf("request body over %d bytes", s.cfg.MaxBodyBytes))
			return nil, false
		}
		openAIError(c, http.StatusBadRequest, "invalid_request_error", "reading body: "+err.Error())
		return nil, false
	}
	return body, true
}

// tokenize answers {"model", "prompt" | "messages", "add_special_tokens", …}
// with {"count", "max_model_len", "tokens", "token_strs"}.
func (s *Server) tokenize(c *gin.Context) {
	body, ok := s.readBody(c)
	if !ok {
		return
	}
	m, ok := s.tokenizeModel(c, body)
	if !ok {
		return
	}
	ids, err := m.Tokenize(body)
	if err != nil {
		openAIError(c, http.StatusBadRequest, "invalid_request_error", err.Error())
		return
	}
	if ids == nil {
		ids = []uint32{}
	}
	var maxLen any
	if n := m.MaxModelLen(); n > 0 {
		maxLen = n
	}
	c.JSON(http.StatusOK, gin.H{"count": len(ids), "max_model_len": maxLen, "tokens": ids, "token_strs": nil})
}

// detokenize answers {"model", "tokens"} with {"prompt"}.
func (s *Server) detokenize(c *gin.Context) {
	body, ok := s.readBody(c)
	if !ok {
		return
	}
	m, ok := s.tokenizeModel(c, body)
	if !ok {
		return
	}
	var in struct {
		Tokens *[]uint32 `json:"tokens"`
	}
	if err := json.Unmarshal(body, &in); err != nil || in.Tokens == nil {
		openAIError(c, http.StatusBadRequest, "invalid_request_error", "detokenize: want \"tokens\": a list of token ids")
		return
	}
	c.JSON(http.StatusOK, gin.H{"prompt": m.Tokenizer().Decode(*in.Tokens)})
}
