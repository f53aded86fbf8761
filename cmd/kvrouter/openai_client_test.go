package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"

	"github.com/kvrouter/kvrouter/internal/poll"
)

// activeRequests is the requests (sequences) replica base books on worker,
// read from its /debug/route cost table.
func activeRequests(t *testing.T, base, worker string) int {
	t.Helper()
	resp, err := http.Post(base+"/debug/route", "application/json",
		strings.NewReader(`{"model":"kvmock","messages":[{"role":"user","content":"probe"}]}`))
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	var doc struct {
		Workers []struct {
			Worker         string `json:"worker"`
			ActiveRequests int    `json:"active_requests"`
		} `json:"workers"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
		return -1
	}
	for _, w := range doc.Workers {
		if w.Worker == worker {
			return w.ActiveRequests
		}
	}
	return -1
}

// The official OpenAI Go client through two replicas of a three-replica
// cluster in front of a real kvmock process: the Responses API, embeddings
// (floats and the client's base64), a batch of prompts and n > 1 each get
// the answer they asked for; an n = 3 request sent to one replica is
// booked as three sequences there and, through replica sync, at the other.
func TestServeOpenAIClientTwoReplicas(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas and a worker process")
	}
	t.Parallel() // its own replicas, ports and workers; it mostly waits (elections, workers)
	bin := buildKvmock(t, t.TempDir())
	reps := newTestCluster(t, func(c *serveConfig) { c.Models = []string{"kvmock"} })
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(reps); return err })
	st, err := status(reps[0].url())
	if err != nil {
		t.Fatal(err)
	}
	port := freePorts(t, 1)[0]
	startKvmock(t, bin, "--id", "oc-1", "--addr", fmt.Sprintf("127.0.0.1:%d", port), "--model", "kvmock", "--speedup", "2",
		"--nats", st.NATS, "--register", reps[0].url()+","+reps[1].url(), "--log-level", "warn")
	for _, r := range reps[:2] {
		poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
			if activeRequests(t, r.url(), "oc-1") < 0 {
				return fmt.Errorf("%s does not route to oc-1 yet", r.cfg.NodeID)
			}
			return nil
		})
	}
	ctx := t.Context()
	client := func(i int) openai.Client {
		return openai.NewClient(option.WithBaseURL(reps[i].url()+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	}
	c1, c2 := client(0), client(1)

	// The Responses API (the OpenAI Agents SDK's), through r1.
	var httpResp *http.Response
	resp, err := c1.Responses.New(ctx, responses.ResponseNewParams{
		Model:           "kvmock",
		Instructions:    openai.String("You are terse."),
		Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String("Name three colours.")},
		MaxOutputTokens: openai.Int(6),
	}, option.WithResponseInto(&httpResp))
	if err != nil {
		t.Fatalf("responses: %v", err)
	}
	if resp.OutputText() == "" || resp.Usage.OutputTokens != 6 || resp.Usage.InputTokens == 0 || resp.Status != "completed" {
		t.Fatalf("responses: %q usage %+v status %q", resp.OutputText(), resp.Usage, resp.Status)
	}
	if w := httpResp.Header.Get("X-Worker-Id"); w != "oc-1" {
		t.Fatalf("responses routed to %q", w)
	}

	// Embeddings through r2: floats, and base64 (the encoding the client
	// decodes itself).
	for _, format := range []openai.EmbeddingNewParamsEncodingFormat{openai.EmbeddingNewParamsEncodingFormatFloat, openai.EmbeddingNewParamsEncodingFormatBase64} {
		emb, err := c2.Embeddings.New(ctx, openai.EmbeddingNewParams{
			Model:          "kvmock",
			Input:          openai.EmbeddingNewParamsInputUnion{OfArrayOfStrings: []string{"first text", "second text"}},
			EncodingFormat: format,
		})
		if err != nil {
			t.Fatalf("embeddings (%s): %v", format, err)
		}
		if len(emb.Data) != 2 || len(emb.Data[0].Embedding) != 8 || emb.Data[1].Index != 1 || emb.Usage.PromptTokens == 0 {
			t.Fatalf("embeddings (%s): %+v", format, emb)
		}
		if fmt.Sprint(emb.Data[0].Embedding) == fmt.Sprint(emb.Data[1].Embedding) {
			t.Fatalf("embeddings (%s): two texts, one vector", format)
		}
	}

	// A batch of prompts through r1: one choice per prompt, in order.
	batch, err := c1.Completions.New(ctx, openai.CompletionNewParams{
		Model:     openai.CompletionNewParamsModel("kvmock"),
		Prompt:    openai.CompletionNewParamsPromptUnion{OfArrayOfStrings: []string{"Once upon a time", "In a galaxy far away", "It was a dark night"}},
		MaxTokens: openai.Int(4),
	})
	if err != nil {
		t.Fatalf("batch: %v", err)
	}
	if len(batch.Choices) != 3 || batch.Usage.CompletionTokens != 12 {
		t.Fatalf("batch: %d choices, usage %+v", len(batch.Choices), batch.Usage)
	}
	for i, ch := range batch.Choices {
		if ch.Index != int64(i) || ch.Text == "" {
			t.Fatalf("batch choice %d: %+v", i, ch)
		}
	}

	// The requests above are finished, but their bookings reach the other
	// replica, and leave it, through replica sync: wait until neither
	// replica counts any on oc-1, or the n = 3 count below would include
	// them (r2 once counted 6: its three and the batch's three from r1).
	for _, r := range reps[:2] {
		poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error {
			if n := activeRequests(t, r.url(), "oc-1"); n != 0 {
				return fmt.Errorf("%s still counts %d requests on oc-1", r.cfg.NodeID, n)
			}
			return nil
		})
	}

	// n = 3 through r2: three choices; while it runs, r2 books three
	// sequences on oc-1 and r1 learns the same count through replica sync.
	type result struct {
		chat *openai.ChatCompletion
		err  error
	}
	done := make(chan result, 1)
	go func() {
		chat, err := c2.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
			Model:     "kvmock",
			Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Tell a long story.")},
			MaxTokens: openai.Int(600),
			N:         openai.Int(3),
		})
		done <- result{chat, err}
	}()
	local, peer := 0, 0
	for local != 3 || peer != 3 {
		select {
		case r := <-done:
			t.Fatalf("the n=3 request ended (%v) before both replicas booked it: r2 %d, r1 %d", r.err, local, peer)
		case <-time.After(10 * time.Millisecond):
		}
		local, peer = activeRequests(t, reps[1].url(), "oc-1"), activeRequests(t, reps[0].url(), "oc-1")
		if local > 3 || peer > 3 {
			t.Fatalf("booked r2 %d, r1 %d: want 3", local, peer)
		}
	}
	r := <-done
	if r.err != nil {
		t.Fatalf("n=3: %v", r.err)
	}
	if len(r.chat.Choices) != 3 || r.chat.Usage.CompletionTokens != 1800 {
		t.Fatalf("n=3: %d choices, usage %+v", len(r.chat.Choices), r.chat.Usage)
	}
	texts := map[string]bool{}
	for _, ch := range r.chat.Choices {
		texts[ch.Message.Content] = true
	}
	if len(texts) != 3 {
		t.Fatalf("n=3: %d distinct answers", len(texts))
	}

	// n = 2 streamed through r1: the client's accumulator assembles both
	// choices from chunks that carry their index, usage from the last.
	stream := c1.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
		Model:         "kvmock",
		Messages:      []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Two short stories, streamed.")},
		MaxTokens:     openai.Int(8),
		N:             openai.Int(2),
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	})
	acc := openai.ChatCompletionAccumulator{}
	for stream.Next() {
		acc.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("streamed n=2: %v", err)
	}
	if len(acc.Choices) != 2 || acc.Choices[0].Message.Content == "" || acc.Choices[0].Message.Content == acc.Choices[1].Message.Content ||
		acc.Usage.CompletionTokens != 16 {
		t.Fatalf("streamed n=2: %d choices, usage %+v: %+v", len(acc.Choices), acc.Usage, acc.Choices)
	}
	poll.Until(t, 10*time.Second, 50*time.Millisecond, func() error {
		if a, b := activeRequests(t, reps[0].url(), "oc-1"), activeRequests(t, reps[1].url(), "oc-1"); a != 0 || b != 0 {
			return fmt.Errorf("still booked: r1 %d, r2 %d", a, b)
		}
		return nil
	})
}
