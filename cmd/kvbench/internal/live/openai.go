package live

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/api/tokenize"
)

// PromptText renders token ids as text that the builtin tokenizer (the
// router's and kvmock's default) encodes back to exactly len(ids) tokens:
// each id becomes one builtin word, the canonical spelling of word
// (id+salt) mod the builtin word count. Equal id sequences give equal text,
// so the workload's shared prefixes stay shared; a different salt gives
// different text with the same structure (a run that does not hit the
// caches an earlier run filled).
func PromptText(ids []uint32, salt uint32) string {
	const wordBase, words = 384, tokenize.BuiltinVocabSize - 384
	w := make([]uint32, len(ids))
	for i, id := range ids {
		w[i] = wordBase + uint32((uint64(id)+uint64(salt))%words)
	}
	return builtinTok.Decode(w)
}

var builtinTok = tokenize.Builtin()

// CountTokens is the builtin tokenizer's token count of text.
func CountTokens(text string) int { return len(builtinTok.Encode(text)) }

// Completion is one timed streaming completion.
type Completion struct {
	Status       int
	Worker       string // X-Worker-Id (through a router)
	TTFT         time.Duration
	E2E          time.Duration
	PromptTokens int // usage.prompt_tokens
	CachedTokens int // usage.prompt_tokens_details.cached_tokens
	OutputChunks int
	HasUsage     bool
}

// CompletionRequest is the body kvbench sends to /v1/completions.
type CompletionRequest struct {
	Model         string        `json:"model,omitempty"`
	Prompt        string        `json:"prompt"`
	MaxTokens     int           `json:"max_tokens"`
	Stream        bool          `json:"stream"`
	StreamOptions *streamOption `json:"stream_options,omitempty"`
}

type streamOption struct {
	IncludeUsage bool `json:"include_usage"`
}

// NewCompletionRequest is a streaming request that asks for usage.
func NewCompletionRequest(model, prompt string, maxTokens int) CompletionRequest {
	return CompletionRequest{Model: model, Prompt: prompt, MaxTokens: maxTokens, Stream: true,
		StreamOptions: &streamOption{IncludeUsage: true}}
}

// NewInferenceClient returns an HTTP client for up to conns concurrent
// streams to local endpoints; tlsConf (nil: the defaults) checks https
// ones.
func NewInferenceClient(conns int, tlsConf *tls.Config) *http.Client {
	tr := &http.Transport{
		TLSClientConfig:     tlsConf,
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        4 * conns,
		MaxIdleConnsPerHost: conns,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
	return &http.Client{Transport: tr}
}

// ErrStream marks a response that was not a well-formed completion stream.
var ErrStream = errors.New("bad completion stream")

// Complete sends body to base's /v1/completions and reads the SSE stream:
// TTFT is the time to the first data chunk, E2E to [DONE] (or the end of
// the body). A non-200 answer returns an *HTTPError.
func Complete(ctx context.Context, hc *http.Client, base, apiKey string, body CompletionRequest) (Completion, error) {
	return complete(ctx, hc, base, apiKey, body, time.Now)
}

// complete is Complete reading the time from now (a test's clock).
func complete(ctx context.Context, hc *http.Client, base, apiKey string, body CompletionRequest, now func() time.Time) (Completion, error) {
	var c Completion
	b, err := json.Marshal(body)
	if err != nil {
		return c, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, BaseURL(base)+"/v1/completions", bytes.NewReader(b))
	if err != nil {
		return c, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "text/event-stream")
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	start := now()
	resp, err := hc.Do(req)
	if err != nil {
		return c, err
	}
	defer resp.Body.Close()
	c.Status = resp.StatusCode
	c.Worker = resp.Header.Get("X-Worker-Id")
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return c, &HTTPError{URL: req.URL.String(), Status: resp.StatusCode, Body: string(msg)}
	}
	err = readStream(resp.Body, start, now, &c)
	c.E2E = now().Sub(start)
	// Read what follows [DONE] (the end of the chunked body) so the
	// connection goes back to the pool: a body closed early closes the
	// connection, and every request would pay a new TCP and, over HTTPS, a
	// new TLS handshake — a cost real clients, which read to the end, do
	// not pay.
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	return c, err
}

// streamChunk is the part of a chunk kvbench reads.
type streamChunk struct {
	Choices []json.RawMessage `json:"choices"`
	Usage   *struct {
		PromptTokens        int `json:"prompt_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	Error json.RawMessage `json:"error"`
}

func readStream(r io.Reader, start time.Time, now func() time.Time, c *Completion) error {
	br := bufio.NewReaderSize(r, 64<<10)
	for {
		line, err := br.ReadString('\n')
		if line = strings.TrimRight(line, "\r\n"); strings.HasPrefix(line, "data:") {
			data := strings.TrimSpace(strings.TrimPrefix(line, "data:"))
			if data == "[DONE]" {
				return nil
			}
			if c.TTFT == 0 {
				c.TTFT = now().Sub(start)
			}
			var ch streamChunk
			if jerr := json.Unmarshal([]byte(data), &ch); jerr != nil {
				return fmt.Errorf("%w: chunk %q: %v", ErrStream, truncate(data, 120), jerr)
			}
			if len(ch.Error) > 0 && string(ch.Error) != "null" {
				return fmt.Errorf("%w: error in stream: %s", ErrStream, truncate(string(ch.Error), 200))
			}
			if len(ch.Choices) > 0 {
				c.OutputChunks++
			}
			if ch.Usage != nil {
				c.HasUsage = true
				c.PromptTokens = ch.Usage.PromptTokens
				if ch.Usage.PromptTokensDetails != nil {
					c.CachedTokens = ch.Usage.PromptTokensDetails.CachedTokens
				}
			}
		}
		if err == io.EOF {
			if c.TTFT == 0 {
				return fmt.Errorf("%w: stream ended before any data", ErrStream)
			}
			return nil // no [DONE], but the data came
		}
		if err != nil {
			return err
		}
	}
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// WorkerIdentity asks a kvmock worker for its id (GET /health).
func WorkerIdentity(ctx context.Context, hc *http.Client, base string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, BaseURL(base)+"/health", nil)
	if err != nil {
		return "", err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var h struct {
		ID string `json:"id"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&h); err != nil {
		return "", err
	}
	return h.ID, nil
}

// Models lists base's /v1/models ids.
func Models(ctx context.Context, hc *http.Client, base, apiKey string) ([]string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, BaseURL(base)+"/v1/models", nil)
	if err != nil {
		return nil, err
	}
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, &HTTPError{URL: req.URL.String(), Status: resp.StatusCode}
	}
	var m struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
		return nil, err
	}
	out := make([]string, len(m.Data))
	for i, d := range m.Data {
		out[i] = d.ID
	}
	return out, nil
}

// Capacity sums the KV capacity (blocks) of a model's workers as a router
// lists them (GET /workers, an admin endpoint), leaving out kvbench
// ingest's synthetic workers.
func (c *Client) Capacity(ctx context.Context, base, model string) (int, error) {
	var out struct {
		Models map[string][]struct {
			ID          string `json:"id"`
			URL         string `json:"url"`
			TotalBlocks int    `json:"total_kv_blocks"`
		} `json:"models"`
	}
	if err := c.do(ctx, http.MethodGet, BaseURL(base)+"/workers", nil, &out); err != nil {
		return 0, err
	}
	n := 0
	for _, w := range out.Models[model] {
		if w.URL == "http://127.0.0.1:1" { // a kvbench ingest worker
			continue
		}
		n += w.TotalBlocks
	}
	return n, nil
}

// MockCapacity reads a kvmock worker's KV capacity (GET /stats).
func MockCapacity(ctx context.Context, hc *http.Client, base string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, BaseURL(base)+"/stats", nil)
	if err != nil {
		return 0, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var s struct {
		Engine struct {
			CapacityBlocks int `json:"capacity_blocks"`
		} `json:"engine"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&s); err != nil {
		return 0, err
	}
	return s.Engine.CapacityBlocks, nil
}
