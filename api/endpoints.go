package api

import (
	"bytes"
	"encoding/json"
	"fmt"

	"github.com/gin-gonic/gin"

	"github.com/kvrouter/kvrouter/api/prompt"
)

// endpoint is the kind of inference request: what its body looks like, how
// its prompt is computed and whether it generates.
type endpoint uint8

const (
	epCompletions endpoint = iota
	epChat
	epEmbeddings // /v1/embeddings: vLLM's EmbeddingCompletionRequest or EmbeddingChatRequest
	epScore      // /v1/score: vLLM's ScoreRequest (text_1, text_2)
	epRerank     // /v1/rerank: vLLM's RerankRequest (query, documents)
	epResponses  // /v1/responses: OpenAI's Responses API, rendered as chat
)

// generates is true for endpoints that decode (n applies, two-stage serving
// applies); pooling endpoints (embeddings, score, rerank) only prefill.
func (e endpoint) generates() bool { return e == epCompletions || e == epChat || e == epResponses }

func (s *Server) embeddings(c *gin.Context) { s.inferPlain(c, epEmbeddings) }
func (s *Server) score(c *gin.Context)      { s.inferPlain(c, epScore) }
func (s *Server) rerank(c *gin.Context)     { s.inferPlain(c, epRerank) }
func (s *Server) responses(c *gin.Context)  { s.inferPlain(c, epResponses) }

// inferPlain serves an endpoint through the aggregated proxy loop only:
// vLLM's two-stage (NIXL proxy) protocol covers completions and chat, not
// pooling requests nor the Responses API.
func (s *Server) inferPlain(c *gin.Context, ep endpoint) {
	p, ok := s.prepareFor(c, ep)
	if !ok {
		return
	}
	if !s.admit(c, p) {
		return
	}
	defer p.settled()
	defer s.tenantEnd(p)
	s.forward(c, p)
}

// endpointTokens computes the prompt of the endpoints beyond completions and
// chat, as vLLM does:
//   - embeddings: `input` as a completions `prompt` (a string, a token list,
//     or a batch of those: routed by the first, booked for all), with
//     add_special_tokens defaulting to true; a `messages` body (vLLM's chat
//     embeddings) through the chat template, defaulting to false;
//   - responses: `instructions` and `input` converted to chat messages
//     (responsesToChat), then the chat template;
//   - score and rerank: pairs of texts, which the engine encodes as pairs:
//     not hashed (routed by load), booked with the tokens of every pair.
func endpointTokens(m *prompt.Model, ep endpoint, body []byte) (tokens []uint32, isl int, hashable bool, err error) {
	switch ep {
	case epEmbeddings:
		return embeddingTokens(m, body)
	case epResponses:
		chat, err := responsesToChat(body)
		if err != nil {
			return nil, 0, false, err
		}
		tokens, err := m.Chat(chat)
		return tokens, len(tokens), err == nil, err
	case epScore, epRerank:
		isl, err := pairTokens(m, ep, body)
		return nil, isl, false, err
	}
	return nil, 0, false, fmt.Errorf("endpoint %d has no prompt rule", ep)
}

func embeddingTokens(m *prompt.Model, body []byte) ([]uint32, int, bool, error) {
	var in struct {
		Input            json.RawMessage `json:"input"`
		Messages         json.RawMessage `json:"messages"`
		AddSpecialTokens *bool           `json:"add_special_tokens"`
	}
	if err := json.Unmarshal(body, &in); err != nil {
		return nil, 0, false, &prompt.RequestError{Msg: "invalid JSON body: " + err.Error()}
	}
	if len(in.Messages) > 0 && !isNull(in.Messages) {
		tokens, err := m.Chat(body)
		return tokens, len(tokens), err == nil, err
	}
	if len(in.Input) == 0 || isNull(in.Input) {
		return nil, 0, false, &prompt.RequestError{Msg: "embeddings: want \"input\" (a string, an array of token ids, or an array of those) or \"messages\""}
	}
	comp, _ := json.Marshal(struct {
		Prompt           json.RawMessage `json:"prompt"`
		AddSpecialTokens *bool           `json:"add_special_tokens,omitempty"`
	}{in.Input, in.AddSpecialTokens})
	prompts, err := m.Completion(comp)
	if err != nil {
		return nil, 0, false, &prompt.RequestError{Msg: "embeddings input: " + err.Error()}
	}
	isl := 0
	for _, p := range prompts {
		isl += len(p)
	}
	return prompts[0], isl, true, nil
}

// pairTokens is the prefill of a score or rerank request: every pair it
// scores, each the two texts' tokens (special tokens aside). A text that is
// not a string (vLLM's multimodal score parameters) counts by its JSON size.
func pairTokens(m *prompt.Model, ep endpoint, body []byte) (int, error) {
	var in struct {
		Text1     json.RawMessage `json:"text_1"`
		Text2     json.RawMessage `json:"text_2"`
		Data1     json.RawMessage `json:"data_1"`
		Data2     json.RawMessage `json:"data_2"`
		Query     json.RawMessage `json:"query"`
		Documents json.RawMessage `json:"documents"`
	}
	if err := json.Unmarshal(body, &in); err != nil {
		return 0, &prompt.RequestError{Msg: "invalid JSON body: " + err.Error()}
	}
	first, second, what := in.Text1, in.Text2, "score: want \"text_1\" and \"text_2\" (strings or arrays of strings)"
	if len(first) == 0 && len(second) == 0 {
		first, second = in.Data1, in.Data2
	}
	if ep == epRerank {
		first, second, what = in.Query, in.Documents, "rerank: want \"query\" (a string) and \"documents\" (an array of strings or of {\"text\": …})"
	}
	a, okA := textLengths(m, first)
	b, okB := textLengths(m, second)
	if !okA || !okB || len(a) == 0 || len(b) == 0 {
		return 0, &prompt.RequestError{Msg: what}
	}
	isl := 0
	switch {
	case len(a) == 1: // one query against every document
		for _, n := range b {
			isl += a[0] + n
		}
	case len(a) == len(b): // pairwise
		for i := range a {
			isl += a[i] + b[i]
		}
	default:
		return 0, &prompt.RequestError{Msg: fmt.Sprintf("%s: %d first texts against %d second texts (want 1 against N, or N against N)", what, len(a), len(b))}
	}
	return isl, nil
}

// textLengths reads a string, an array of strings or of {"text": …}
// objects, or one JSON object (a multimodal parameter, counted by size), and
// returns each text's token count.
func textLengths(m *prompt.Model, raw json.RawMessage) ([]int, bool) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || isNull(raw) {
		return nil, false
	}
	var text string
	if json.Unmarshal(raw, &text) == nil {
		return []int{len(m.Tokenizer().Encode(text))}, true
	}
	var items []json.RawMessage
	if json.Unmarshal(raw, &items) == nil {
		out := make([]int, 0, len(items))
		for _, it := range items {
			var doc struct {
				Text *string `json:"text"`
			}
			switch {
			case json.Unmarshal(it, &text) == nil:
			case json.Unmarshal(it, &doc) == nil && doc.Text != nil:
				text = *doc.Text
			default:
				return nil, false
			}
			out = append(out, len(m.Tokenizer().Encode(text)))
		}
		return out, true
	}
	if raw[0] == '{' {
		return []int{len(raw) / 4}, true
	}
	return nil, false
}

func isNull(raw json.RawMessage) bool { return string(bytes.TrimSpace(raw)) == "null" }
