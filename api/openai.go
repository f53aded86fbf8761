package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/kvrouter/kvrouter/api/jsonscan"
	"github.com/kvrouter/kvrouter/api/prompt"
	"github.com/kvrouter/kvrouter/router"
)

// inferenceRequest is the part of an OpenAI request body the router reads.
// The body itself is forwarded to the worker unchanged.
type inferenceRequest struct {
	Model string `json:"model"`
	// Messages is decoded by encoding/json's path only (its type is
	// checked there); parseInference's hasMessages is what the proxy reads.
	Messages []json.RawMessage `json:"messages"`
	Stream   bool              `json:"stream"`
	// CacheSalt is vLLM's prefix-cache salt: blocks hashed under it match
	// only requests with the same salt (Dynamo's rule, router.CacheSeed).
	CacheSalt string `json:"cache_salt"`
	// N is the number of sequences to generate: booked as N decoding
	// requests sharing the prompt (router.Request.Sequences).
	N     int `json:"n"`
	Nvext struct {
		AgentHints struct {
			// priority and strict_priority (priority.go)
			agentHintPriorities
			// Osl is the output the client expects per sequence, in
			// tokens: Dynamo's expected_output_tokens, toward which
			// output-block tracking decays (router.Request).
			Osl int `json:"osl"`
			// LatencySensitivity is Dynamo's queue hint, in seconds
			// (readLatencySensitivity). speculative_prefill is not read:
			// accepted and ignored (DESIGN.md, Agent hints).
			LatencySensitivity json.RawMessage `json:"latency_sensitivity"`
		} `json:"agent_hints"`
		// CacheControl is Dynamo's prefix pin request (pins.go).
		CacheControl json.RawMessage `json:"cache_control"`
	} `json:"nvext"`
}

// inferenceKeys are the top-level keys parseInference takes out of a body:
// inferenceRequest's, then the prompt's (prompt.Fields).
var inferenceKeys = []string{"model", "messages", "stream", "cache_salt", "n", "nvext", "prompt", "add_special_tokens"}

// parseInference is json.Unmarshal of body into inferenceRequest, error
// included, plus whether it has messages (a non-empty array) and the
// prompt's values for tokenizing. A body jsonscan vouches for is read in
// one pass (its long prompt is the bulk of a request and was scanned four
// times before); anything else, or a field of an unexpected type, goes
// through encoding/json, whose answer is the contract. The fast path leaves
// in.Messages nil (hasMessages says what the proxy needs of it).
func parseInference(body []byte) (in inferenceRequest, hasMessages bool, f prompt.Fields, err error) {
	if vals, ok := jsonscan.Top(body, inferenceKeys); ok {
		if in, hasMessages, ok = decodeInference(vals); ok {
			return in, hasMessages, prompt.Fields{Known: true, Prompt: vals[6], AddSpecialTokens: vals[7]}, nil
		}
	}
	in = inferenceRequest{}
	if err := json.Unmarshal(body, &in); err != nil {
		return in, false, f, err
	}
	return in, len(in.Messages) > 0, f, nil
}

// decodeInference fills inferenceRequest from the raw values of
// inferenceKeys; false when one is of a type encoding/json would refuse
// (its error message is the slow path's).
func decodeInference(vals [][]byte) (in inferenceRequest, hasMessages, ok bool) {
	small := func(raw []byte, v any) bool { return raw == nil || json.Unmarshal(raw, v) == nil }
	if !small(vals[0], &in.Model) || !small(vals[3], &in.CacheSalt) || !small(vals[4], &in.N) || !small(vals[5], &in.Nvext) {
		return in, false, false
	}
	switch string(vals[2]) {
	case "", "null", "false":
	case "true":
		in.Stream = true
	default:
		return in, false, false
	}
	switch m := vals[1]; {
	case m == nil || string(m) == "null":
	case m[0] == '[':
		hasMessages = bytes.TrimLeft(m[1:], " \t\r\n")[0] != ']'
	default:
		return in, false, false
	}
	return in, hasMessages, true
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
	// outputTokens is the completion tokens the worker reported (usage),
	// when it did: the router learns the output lengths kv-pooled's
	// decode reserve plans for from them (router.Finished).
	outputTokens      int
	outputTokensKnown bool
	// generated is the output tokens the streamed answer has shown so far
	// (output-block tracking, Server.generated).
	generated int
	// The decision log's view of the request (decisions.go): attempts made,
	// the current attempt's decision, when the worker's answer began.
	attempts    int
	decision    uint64
	worker      string // the worker of the latest decision (the capture's)
	disagg      bool   // served in two stages: not captured (the decode worker's cached tokens include the pulled KV)
	firstByteAt time.Time
	usagePrompt int // prompt and cached tokens the worker reported (usage)
	usageCached int
	// settle, set when the request waited in the admission queue, lets
	// the next waiter go: called once its booking is in the load view
	// (after routing) or when it leaves without one.
	settle func()
	// hit is the hit-rate bookkeeping (hitrates.go).
	hit hitRequest
	// sess is the request's agent session when affinity is on (sessions.go).
	sess *sessionTurn
	// adapter is the LoRA adapter the body named ("" none; model is then
	// its base): a copy of the request (drainshadow.go) goes only to the
	// workers serving it.
	adapter string
	// class is the strict tier (nvext.agent_hints.strict_priority, after
	// the key's cap); tenant whose share serves the request ("" when
	// fairness is off); charged the output tokens already charged to it,
	// begun whether it counts in the tenant's requests in flight
	// (tenantgate.go).
	class   uint32
	tenant  string
	charged int
	begun   bool
	// guardOut is the workers the tenant latency guard keeps the request
	// off, as judged at its admission; guardHeld whether it held it in
	// the queue (tenantguard.go).
	guardOut  []router.WorkerID
	guardHeld bool
	// isoOut is the workers tenant isolation keeps the request off, as
	// judged at its admission (the reserved ones with isoOver, its tenant
	// over its share; the unreserved ones, preferring the reserved, without);
	// isoHeld whether it held it in the queue; isoIDs scratch
	// (tenantisolation.go).
	isoOut  []router.WorkerID
	isoIDs  []router.WorkerID
	isoOver bool
	isoHeld bool
	// requestID is the client's X-Request-Id (made when absent), named in
	// the decision log.
	requestID string
	// pin is the request's nvext.cache_control when prefix pinning is on
	// (pins.go); nil: none.
	pin *pinRequest
	// pinned: a pin decided the worker, or the request pinned its prefix
	// on the worker chosen (no warm-up steering after it).
	pinned bool
}

// settled reports the request's booking in place (or abandoned) to the
// admission queue it came through, if any. Idempotent.
func (p *prepared) settled() {
	if p.settle != nil {
		p.settle()
	}
}

// maxSequences caps the n a request is booked with: an absurd n (which the
// engine refuses anyway) must not make a worker look full until it answers.
const maxSequences = 1024

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
	defer p.settled()
	defer s.tenantEnd(p)
	if dr, ok := s.disaggRouter(p.model); ok {
		// Two stages: the tenant is charged each stage's computation as
		// the plan and its recoveries decide it (disagg.go).
		s.forwardDisagg(c, p, dr)
		return
	}
	s.forward(c, p)
}

// prepare reads, parses and tokenizes a chat or completions request,
// answering the client itself on any error.
func (s *Server) prepare(c *gin.Context, chat bool) (*prepared, bool) {
	if chat {
		return s.prepareFor(c, epChat)
	}
	return s.prepareFor(c, epCompletions)
}

// prepareFor is prepare for any endpoint (endpoints.go).
func (s *Server) prepareFor(c *gin.Context, ep endpoint) (*prepared, bool) {
	start := time.Now()
	body, err := readBody(c.Request)
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
	p, ref := s.prepareBody(body, c.Request.URL.Path, ep, bearer(c), c.Request.Header, start)
	if ref != nil {
		ref.answer(c)
		return nil, false
	}
	p.requestID = c.GetString(requestIDKey)
	return p, true
}

// refusal is a request turned away before any worker saw it: the status,
// OpenAI error type and message its client gets, from the proxy as JSON
// (answer) or from the endpoint picker as an immediate response.
type refusal struct {
	status     int
	kind, msg  string
	retryAfter int // Retry-After in seconds (a full queue, a tenant over budget); 0: none
}

func (r *refusal) answer(c *gin.Context) {
	if r.retryAfter > 0 {
		c.Header("Retry-After", strconv.Itoa(r.retryAfter))
	}
	openAIError(c, r.status, r.kind, r.msg)
}

// prepareBody parses and tokenizes a request body that arrived on path
// (the endpoint ep) with the client's bearer key: everything prepareFor
// does but reading the body, for the proxy and the endpoint picker alike.
func (s *Server) prepareBody(body []byte, path string, ep endpoint, key string, header http.Header, start time.Time) (*prepared, *refusal) {
	in, hasMessages, fields, err := parseInference(body)
	if err != nil {
		s.metrics.rejected.WithLabelValues("invalid_json").Inc()
		return nil, &refusal{status: http.StatusBadRequest, kind: "invalid_request_error", msg: "invalid JSON body: " + err.Error()}
	}
	if in.Model == "" {
		return nil, &refusal{status: http.StatusBadRequest, kind: "invalid_request_error", msg: "model is required"}
	}
	sess, ref := s.readSession(header, body)
	if ref != nil {
		return nil, ref
	}
	model, lora := in.Model, ""
	rt, ok := s.rep.Router(model)
	var only []router.WorkerID // a LoRA adapter: the base model's workers that serve it
	if !ok {
		if base, ws, isAdapter := s.rep.Adapter(in.Model); isAdapter {
			model, lora, only = base, in.Model, ws
			rt, ok = s.rep.Router(base)
		}
	}
	if !ok {
		s.metrics.rejected.WithLabelValues("unknown_model").Inc()
		return nil, &refusal{status: http.StatusNotFound, kind: "model_not_found", msg: fmt.Sprintf("model %q is not served here", in.Model)}
	}
	if ep == epChat && !hasMessages {
		return nil, &refusal{status: http.StatusBadRequest, kind: "invalid_request_error", msg: "messages must not be empty"}
	}
	prio, err := readPriority(header, in.Nvext.AgentHints.agentHintPriorities)
	if err != nil {
		s.metrics.rejected.WithLabelValues("invalid_priority").Inc()
		return nil, &refusal{status: http.StatusBadRequest, kind: "invalid_request_error", msg: err.Error()}
	}
	sensitivity, err := readLatencySensitivity(in.Nvext.AgentHints.LatencySensitivity)
	if err != nil {
		s.metrics.rejected.WithLabelValues("invalid_agent_hints").Inc()
		return nil, &refusal{status: http.StatusBadRequest, kind: "invalid_request_error", msg: err.Error()}
	}
	pin, err := s.readCacheControl(in.Nvext.CacheControl)
	if err != nil {
		s.metrics.rejected.WithLabelValues("invalid_cache_control").Inc()
		return nil, &refusal{status: http.StatusBadRequest, kind: "invalid_request_error", msg: err.Error()}
	}
	tokens, isl, prompts, hashable, err := s.requestTokens(model, body, ep, fields)
	if err != nil {
		return nil, &refusal{status: http.StatusBadRequest, kind: "invalid_request_error", msg: err.Error()}
	}
	bs := rt.Config().BlockSize
	id := fmt.Sprintf("%s-%d-%d", s.rep.NodeID(), start.UnixNano(), s.reqSeq.Add(1))
	s.metrics.inputTokens.WithLabelValues(in.Model).Add(float64(isl))
	seqs := 1
	if ep.generates() {
		// n sequences of each prompt of a batch, all decoding on the worker.
		seqs = min(max(in.N, 1)*max(prompts, 1), maxSequences)
	}
	var exclude []router.WorkerID
	if only != nil { // a LoRA adapter; otherwise no copy of the worker list
		exclude = notServing(rt.Workers(), only)
	}
	return &prepared{
		body: body, path: path, model: model, adapter: lora, stream: in.Stream, rt: rt, start: start, sess: sess,
		req: router.Request{ID: id, Hashes: hashes(tokens, bs, hashable, lora, in.CacheSalt), Tokens: isl, Sequences: seqs,
			Priority: s.capPriority(key, prio.Soft), Exclude: exclude,
			ExpectedOutputTokens: max(in.Nvext.AgentHints.Osl, 0), LatencySensitivity: sensitivity},
		class: s.capStrictPriority(key, prio.Strict), tenant: s.tenantOf(header, key, model), pin: pin,
	}, nil
}

// maxPresizedBody bounds the buffer readBody allocates on the strength of
// a Content-Length alone, before the bytes arrive: a client announcing the
// limit and sending nothing must not make the replica hold the limit.
const maxPresizedBody = 1 << 20

// readBody is io.ReadAll of the request's body, read into one buffer of
// the announced length (and bytes.MinRead to see EOF) instead of one grown
// by doubling, copy after copy: a 15 kB prompt took five allocations.
func readBody(r *http.Request) ([]byte, error) {
	if r.ContentLength <= 0 || r.ContentLength > maxPresizedBody {
		return io.ReadAll(r.Body)
	}
	b := bytes.NewBuffer(make([]byte, 0, r.ContentLength+bytes.MinRead))
	_, err := b.ReadFrom(r.Body)
	return b.Bytes(), err
}

// notServing lists the workers of ws outside only (nil only: none), so a
// LoRA request is routed only among the workers that load its adapter.
func notServing(ws []router.WorkerInfo, only []router.WorkerID) []router.WorkerID {
	if only == nil {
		return nil
	}
	var out []router.WorkerID
	for _, w := range ws {
		if !slices.Contains(only, w.ID) {
			out = append(out, w.ID)
		}
	}
	return out
}

// requestTokens returns the prompt token ids of a request as the model's
// engine computes them (chat: the first and only prompt; completions: the
// first prompt of a batch, which the request is routed by; the other
// endpoints: endpointTokens), isl, the prompt tokens it is booked with (a
// completions batch: every prompt's, all prefilled on the one worker), and
// prompts, how many prompts generate (a completions batch: each; else 1).
// hashable is false when the ids cannot be hashed: for a model this replica
// has no tokenizer for, isl is then a length estimate only, the request is
// routed by load alone, and that is counted and logged (a router that
// silently routes blind is the failure operators never see).
// fields are the body's prompt values when parseInference took them out.
func (s *Server) requestTokens(model string, body []byte, ep endpoint, fields prompt.Fields) (tokens []uint32, isl, prompts int, hashable bool, err error) {
	m, ok := s.cfg.Prompts.Lookup(model)
	if !ok {
		s.noTokenizer(model)
		return nil, len(body) / 4, 1, false, nil
	}
	switch ep {
	case epChat:
		tokens, err = m.ChatFields(body, fields)
		return tokens, len(tokens), 1, err == nil, err
	case epCompletions:
		batch, err := m.CompletionFields(body, fields)
		if err != nil {
			return nil, 0, 0, false, err
		}
		for _, p := range batch {
			isl += len(p)
		}
		return batch[0], isl, len(batch), true, nil
	}
	tokens, isl, hashable, err = endpointTokens(m, ep, body)
	return tokens, isl, 1, hashable, err
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

// hashes are the request's block hashes as the engine computes them: with
// Dynamo's LoRA seed when it names an adapter and Dynamo's salt seed for a
// cache_salt (the engines' events for such blocks carry the same seed).
func hashes(tokens []uint32, blockSize int, hashable bool, lora, salt string) []uint64 {
	if !hashable {
		return nil
	}
	return router.SaltedSequenceHashes(tokens, blockSize, lora, salt)
}

func (s *Server) listModels(c *gin.Context) {
	data := []gin.H{}
	for _, m := range s.rep.Models() {
		data = append(data, gin.H{"id": m, "object": "model", "created": 0, "owned_by": "kvrouter"})
	}
	c.JSON(http.StatusOK, gin.H{"object": "list", "data": data})
}
