package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvrouter/kvrouter/api/tokenize"
)

func words(prefix string, n int) string {
	ws := make([]string, n)
	for i := range ws {
		ws[i] = fmt.Sprintf("%s%d", prefix, i)
	}
	return strings.Join(ws, " ")
}

func chatBody(content string, maxTokens int, stream bool) map[string]any {
	b := map[string]any{
		"model":      "kvmock",
		"messages":   []map[string]any{{"role": "system", "content": "You are terse."}, {"role": "user", "content": content}},
		"max_tokens": maxTokens,
	}
	if stream {
		b["stream"] = true
	}
	return b
}

func TestMockChatPlain(t *testing.T) {
	tm := startMock(t, nil, false)
	status, body := post(t, tm.url+"/v1/chat/completions", chatBody("Say hello.", 7, false))
	if status != http.StatusOK {
		t.Fatalf("HTTP %d: %s", status, body)
	}
	a := decodeAnswer(t, body)
	if a.Object != "chat.completion" || !strings.HasPrefix(a.ID, "chatcmpl-") || a.Model != "kvmock" || a.Created == 0 {
		t.Fatalf("bad envelope: %s", body)
	}
	if len(a.Choices) != 1 || a.Choices[0].Message == nil || a.Choices[0].Message.Role != "assistant" {
		t.Fatalf("bad choices: %s", body)
	}
	content := a.Choices[0].Message.Content
	if got := len(tokenize.Builtin().Encode(content)); got != 7 {
		t.Fatalf("content %q is %d tokens, want 7", content, got)
	}
	if fr := a.Choices[0].FinishReason; fr == nil || *fr != "stop" {
		t.Fatalf("finish_reason: %s", body)
	}
	want := len(tokenize.Builtin().Encode("system: You are terse.\nuser: Say hello.\nassistant:"))
	if u := a.Usage; u == nil || u.PromptTokens != want || u.CompletionTokens != 7 || u.TotalTokens != want+7 {
		t.Fatalf("usage: %s (want %d prompt tokens)", body, want)
	}
	// Deterministic: the same prompt gets the same answer.
	_, body2 := post(t, tm.url+"/v1/chat/completions", chatBody("Say hello.", 7, false))
	if c2 := decodeAnswer(t, body2).Choices[0].Message.Content; c2 != content {
		t.Fatalf("answers differ: %q vs %q", content, c2)
	}
	// No model given: served by the only model.
	b := chatBody("Say hello.", 3, false)
	delete(b, "model")
	if status, body := post(t, tm.url+"/v1/chat/completions", b); status != http.StatusOK {
		t.Fatalf("without model: HTTP %d: %s", status, body)
	}
}

func TestMockChatStream(t *testing.T) {
	tm := startMock(t, nil, false)
	_, plain := post(t, tm.url+"/v1/chat/completions", chatBody("Count to five.", 6, false))
	want := decodeAnswer(t, plain).Choices[0].Message.Content

	resp, chunks, done := postStream(t, tm.url+"/v1/chat/completions", chatBody("Count to five.", 6, true))
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		t.Fatalf("content type %q", ct)
	}
	if !done {
		t.Fatal("no [DONE]")
	}
	// 6 content chunks, a finish chunk, a usage chunk.
	if len(chunks) != 8 {
		t.Fatalf("%d chunks, want 8", len(chunks))
	}
	var text strings.Builder
	for i, c := range chunks[:6] {
		if c.Object != "chat.completion.chunk" || len(c.Choices) != 1 || c.Choices[0].Delta == nil || c.Choices[0].Delta.Content == nil {
			t.Fatalf("chunk %d: %+v", i, c)
		}
		if (i == 0) != (c.Choices[0].Delta.Role == "assistant") {
			t.Fatalf("chunk %d: role %q", i, c.Choices[0].Delta.Role)
		}
		if c.Choices[0].FinishReason != nil || c.Usage != nil {
			t.Fatalf("chunk %d finishes early", i)
		}
		text.WriteString(*c.Choices[0].Delta.Content)
	}
	if text.String() != want {
		t.Fatalf("streamed %q, plain %q", text.String(), want)
	}
	fin := chunks[6]
	if len(fin.Choices) != 1 || fin.Choices[0].FinishReason == nil || *fin.Choices[0].FinishReason != "stop" {
		t.Fatalf("finish chunk: %+v", fin)
	}
	u := chunks[7]
	if len(u.Choices) != 0 || u.Usage == nil || u.Usage.CompletionTokens != 6 || u.Usage.PromptTokens == 0 {
		t.Fatalf("usage chunk: %+v", u)
	}
	for _, c := range chunks {
		if c.ID != chunks[0].ID {
			t.Fatalf("ids differ: %q %q", c.ID, chunks[0].ID)
		}
	}
}

// The middle tokens of a stream are spaced at the engine's decode pace,
// not sent in one burst: token k (0 < k < n-1) leaves at the first token's
// time plus k × the ITL the engine loop reported with it (the profile's
// decode time at the KV fill then), and the last one waits for the engine
// to finish. The test runs in a synctest bubble over memNet, so the clock
// is the bubble's: a chunk's arrival time is exactly when the server sent
// it, however loaded the host (no wall-clock bounds; docs/STYLE.md).
func TestMockStreamPacing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const tokens, speedup = 12, 1
		n := newMemNet()
		tm := startMock(t, func(c *config) { c.Speedup = speedup }, true, n.serveOn)
		body := chatBody("pace me", tokens, true)
		body["stream_options"] = map[string]any{"include_usage": true}
		data, _ := json.Marshal(body)
		start := time.Now()
		resp, err := n.client(t).Post(tm.url+"/v1/chat/completions", "application/json", bytes.NewReader(data))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var (
			at     []time.Duration // each data line's arrival
			chunks []answer
		)
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			line, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok {
				continue
			}
			at = append(at, time.Since(start))
			if line != "[DONE]" {
				chunks = append(chunks, decodeAnswer(t, []byte(line)))
			}
		}
		if err := sc.Err(); err != nil {
			t.Fatal(err)
		}
		t.Logf("arrivals: %v", at)
		// 12 tokens, the finish chunk, the usage chunk, [DONE].
		if len(at) != tokens+3 || len(chunks) != tokens+2 || chunks[tokens+1].Usage == nil {
			t.Fatalf("%d data lines, %d chunks: %+v", len(at), len(chunks), chunks)
		}
		// The prompt fits in one KV block: the loop's ITL is the decode
		// time at one block's fill, divided by the speedup (driver.dispatch).
		if p := chunks[tokens+1].Usage.PromptTokens; p >= tm.m.engCfg.BlockSize {
			t.Fatalf("prompt of %d tokens: more than one block", p)
		}
		ms := tm.m.drv.eng.Profile().DecodeMs(1 / float64(tm.m.engCfg.CapacityBlocks))
		itl := time.Duration(ms / speedup * float64(time.Millisecond))
		if at[0] <= 0 {
			t.Errorf("first token at %v: before any prefill time", at[0])
		}
		for k := 1; k < tokens-1; k++ {
			if want := at[0] + time.Duration(k)*itl; at[k] != want {
				t.Errorf("token %d at %v, want the first token's time + %d × %v = %v", k, at[k], k, itl, want)
			}
		}
		// The last token comes with the engine's Finished, after the paced
		// ones, and the finish chunk, the usage chunk and [DONE] with it.
		last := at[tokens-1]
		if last <= at[tokens-2] {
			t.Errorf("last token at %v, not after token %d (%v)", last, tokens-2, at[tokens-2])
		}
		for i := tokens; i < len(at); i++ {
			if at[i] != last {
				t.Errorf("data line %d at %v, want with the last token at %v", i, at[i], last)
			}
		}
	})
}

func TestMockCompletions(t *testing.T) {
	tm := startMock(t, nil, false)
	status, body := post(t, tm.url+"/v1/completions", map[string]any{"model": "kvmock", "prompt": "Once upon a time", "max_tokens": 5})
	if status != http.StatusOK {
		t.Fatalf("HTTP %d: %s", status, body)
	}
	a := decodeAnswer(t, body)
	if a.Object != "text_completion" || !strings.HasPrefix(a.ID, "cmpl-") || len(a.Choices) != 1 || a.Choices[0].Text == nil {
		t.Fatalf("bad answer: %s", body)
	}
	if a.Usage == nil || a.Usage.PromptTokens != 4 || a.Usage.CompletionTokens != 5 {
		t.Fatalf("usage: %s", body)
	}
	text := *a.Choices[0].Text

	// Token ids and a one-string array are prompts too.
	ids := tokenize.Builtin().Encode("Once upon a time")
	for _, p := range []any{ids, []string{"Once upon a time"}} {
		status, body := post(t, tm.url+"/v1/completions", map[string]any{"prompt": p, "max_tokens": 5})
		if status != http.StatusOK {
			t.Fatalf("prompt %v: HTTP %d: %s", p, status, body)
		}
		if got := *decodeAnswer(t, body).Choices[0].Text; got != text {
			t.Fatalf("prompt %v: %q, want %q", p, got, text)
		}
	}

	_, chunks, done := postStream(t, tm.url+"/v1/completions", map[string]any{"prompt": "Once upon a time", "max_tokens": 5, "stream": true,
		"stream_options": map[string]any{"include_usage": true}})
	if !done || len(chunks) != 7 {
		t.Fatalf("done %v, %d chunks", done, len(chunks))
	}
	var sb strings.Builder
	for _, c := range chunks[:5] {
		if c.Object != "text_completion" || c.Choices[0].Text == nil {
			t.Fatalf("chunk %+v", c)
		}
		sb.WriteString(*c.Choices[0].Text)
	}
	if sb.String() != text {
		t.Fatalf("streamed %q, want %q", sb.String(), text)
	}
	if fr := chunks[5].Choices[0].FinishReason; fr == nil || *fr != "stop" {
		t.Fatalf("finish chunk %+v", chunks[5])
	}
	if chunks[6].Usage == nil || chunks[6].Usage.CompletionTokens != 5 {
		t.Fatalf("usage chunk %+v", chunks[6])
	}
}

func TestMockModelsHealthStats(t *testing.T) {
	tm := startMock(t, func(c *config) { c.Model = "mock-model" }, false)
	status, body := get(t, tm.url+"/v1/models")
	var models struct {
		Object string `json:"object"`
		Data   []struct {
			ID, Object, OwnedBy string
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &models); err != nil || status != 200 {
		t.Fatalf("HTTP %d %s: %v", status, body, err)
	}
	if models.Object != "list" || len(models.Data) != 1 || models.Data[0].ID != "mock-model" || models.Data[0].Object != "model" {
		t.Fatalf("models: %s", body)
	}
	if status, body := get(t, tm.url+"/health"); status != 200 || !strings.Contains(string(body), `"ok"`) {
		t.Fatalf("health: %d %s", status, body)
	}
	post(t, tm.url+"/v1/completions", map[string]any{"prompt": words("w", 40), "max_tokens": 2})
	status, body = get(t, tm.url+"/stats")
	var st statsDoc
	if err := json.Unmarshal(body, &st); err != nil || status != 200 {
		t.Fatalf("stats: %d %s %v", status, body, err)
	}
	if st.Engine.Finished != 1 || st.Engine.PromptTokens != 40 || st.Requests.Completed != 1 || st.Config.BlockSize != 16 || !st.Events.Enabled {
		t.Fatalf("stats: %s", body)
	}
	status, body = get(t, tm.url+"/metrics")
	if status != 200 || !strings.Contains(string(body), `kvmock_requests_completed_total{worker="mock-1",model="mock-model"} 1`) {
		t.Fatalf("metrics: %d %s", status, body)
	}
	if status, body := get(t, tm.url+"/nope"); status != 404 || !strings.Contains(string(body), `"error"`) {
		t.Fatalf("unknown path: %d %s", status, body)
	}
}

func TestMockBadInput(t *testing.T) {
	tm := startMock(t, func(c *config) { c.KVBlocks = 8 }, false) // max model len 128 tokens
	chat, comp := tm.url+"/v1/chat/completions", tm.url+"/v1/completions"
	cases := []struct {
		name   string
		url    string
		body   any
		status int
	}{
		{"bad json", chat, []byte(`{"messages": [`), 400},
		{"no messages", chat, map[string]any{"model": "kvmock", "messages": []any{}}, 400},
		{"message without role", chat, map[string]any{"messages": []any{map[string]any{"content": "hi"}}}, 400},
		{"image content", chat, map[string]any{"messages": []any{map[string]any{"role": "user", "content": []any{map[string]any{"type": "image_url"}}}}}, 400},
		{"max_tokens 0", chat, chatBody("hi", 0, false), 400},
		{"max_tokens negative", chat, chatBody("hi", -3, false), 400},
		{"max_completion_tokens 0", chat, map[string]any{"messages": []any{map[string]any{"role": "user", "content": "hi"}}, "max_completion_tokens": 0, "max_tokens": 5}, 400},
		{"n 0", chat, map[string]any{"messages": []any{map[string]any{"role": "user", "content": "hi"}}, "n": 0}, 400},
		{"n 2 disaggregated", chat, map[string]any{"messages": []any{map[string]any{"role": "user", "content": "hi"}}, "n": 2,
			"kv_transfer_params": map[string]any{"do_remote_decode": true}}, 400},
		{"n beyond the cap", chat, map[string]any{"messages": []any{map[string]any{"role": "user", "content": "hi"}}, "n": 1025}, 400},
		{"unknown model", chat, map[string]any{"model": "gpt-9", "messages": []any{map[string]any{"role": "user", "content": "hi"}}}, 404},
		{"too long", chat, chatBody(words("w", 200), 4, false), 400},
		{"no prompt", comp, map[string]any{"max_tokens": 3}, 400},
		{"null prompt", comp, map[string]any{"prompt": nil}, 400},
		{"empty prompt", comp, map[string]any{"prompt": ""}, 400},
		{"blank prompt", comp, map[string]any{"prompt": "   "}, 400},
		{"empty id prompt", comp, map[string]any{"prompt": []int{}}, 400},
		{"a batch with an empty prompt", comp, map[string]any{"prompt": []string{"a", ""}}, 400},
		{"object prompt", comp, map[string]any{"prompt": map[string]any{"a": 1}}, 400},
		{"completion max_tokens 0", comp, map[string]any{"prompt": "hi", "max_tokens": 0}, 400},
		{"output beyond the context", comp, map[string]any{"prompt": "hi", "max_tokens": 500}, 400},
	}
	for _, c := range cases {
		status, body := post(t, c.url, c.body)
		if status != c.status {
			t.Errorf("%s: HTTP %d, want %d: %s", c.name, status, c.status, body)
			continue
		}
		var e struct {
			Error *struct {
				Message string `json:"message"`
				Type    string `json:"type"`
			} `json:"error"`
		}
		if err := json.Unmarshal(body, &e); err != nil || e.Error == nil || e.Error.Message == "" || e.Error.Type == "" {
			t.Errorf("%s: not an OpenAI error: %s", c.name, body)
		}
	}
	if status, _ := get(t, chat); status != http.StatusMethodNotAllowed && status != http.StatusNotFound {
		t.Errorf("GET on chat: HTTP %d", status)
	}
	// Still serving afterwards.
	if status, body := post(t, chat, chatBody("hi", 2, false)); status != 200 {
		t.Fatalf("HTTP %d: %s", status, body)
	}
}

// A repeated prompt hits the prefix cache, and usage says so.
func TestMockCachedTokens(t *testing.T) {
	tm := startMock(t, nil, false)
	body := chatBody(words("tok", 90), 4, false)
	_, first := post(t, tm.url+"/v1/chat/completions", body)
	a1 := decodeAnswer(t, first)
	if a1.Usage.PromptTokensDetails.CachedTokens != 0 {
		t.Fatalf("first request cached %d tokens", a1.Usage.PromptTokensDetails.CachedTokens)
	}
	n := a1.Usage.PromptTokens
	_, second := post(t, tm.url+"/v1/chat/completions", body)
	a2 := decodeAnswer(t, second)
	// vLLM's rule: whole blocks, at most n-1 tokens.
	want := (n - 1) / 16 * 16
	if got := a2.Usage.PromptTokensDetails.CachedTokens; got != want || got == 0 {
		t.Fatalf("second request cached %d of %d tokens, want %d", got, n, want)
	}
	// And in a stream's usage chunk.
	_, chunks, _ := postStream(t, tm.url+"/v1/chat/completions", chatBody(words("tok", 90), 4, true))
	if u := chunks[len(chunks)-1].Usage; u == nil || u.PromptTokensDetails.CachedTokens != want {
		t.Fatalf("stream usage %+v, want %d cached", u, want)
	}
}

// A client that goes away cancels its request in the engine.
func TestMockClientCancel(t *testing.T) {
	tm := startMock(t, func(c *config) { c.Speedup = 1 }, false)
	ctx, cancel := context.WithCancel(context.Background())
	data, _ := json.Marshal(chatBody("a long answer please", 2000, true))
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, tm.url+"/v1/chat/completions", strings.NewReader(string(data)))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 256)
	if _, err := resp.Body.Read(buf); err != nil { // the first token
		t.Fatal(err)
	}
	cancel()
	resp.Body.Close()
	checkFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		st, err := tm.m.drv.stats(context.Background())
		if err != nil {
			return err
		}
		if st.Cancelled != 1 || st.Running != 0 {
			return fmt.Errorf("engine: %d cancelled, %d running", st.Cancelled, st.Running)
		}
		return nil
	})
	if got := tm.m.ctr.cancelled.Load(); got != 1 {
		t.Fatalf("cancelled counter %d", got)
	}
}

// Concurrent requests all complete (the engine batches them).
func TestMockConcurrent(t *testing.T) {
	tm := startMock(t, nil, false)
	const n = 24
	errs := make(chan error, n)
	for i := range n {
		go func() {
			body, _ := json.Marshal(map[string]any{"prompt": words(fmt.Sprintf("p%d-", i%3), 50), "max_tokens": 8, "stream": i%2 == 0})
			resp, err := http.Post(tm.url+"/v1/completions", "application/json", strings.NewReader(string(body)))
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != 200 || !strings.Contains(string(b), `"cached_tokens"`) {
				errs <- fmt.Errorf("HTTP %d: %s", resp.StatusCode, b)
				return
			}
			errs <- nil
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	st, _ := tm.m.drv.stats(context.Background())
	if st.Finished != n || st.CachedTokens == 0 {
		t.Fatalf("engine finished %d (want %d), cached %d", st.Finished, n, st.CachedTokens)
	}
}

// Requests in flight at shutdown are allowed to finish.
func TestMockGracefulShutdown(t *testing.T) {
	tm := startMock(t, func(c *config) { c.Speedup = 1 }, false)
	res := make(chan int, 1)
	go func() {
		status, _ := post(t, tm.url+"/v1/completions", map[string]any{"prompt": "finish me", "max_tokens": 10})
		res <- status
	}()
	checkFor(t, 5*time.Second, 2*time.Millisecond, func() error {
		if tm.m.ctr.inflight.Load() == 0 {
			return fmt.Errorf("not in flight yet")
		}
		return nil
	})
	tm.stop()
	if status := <-res; status != 200 {
		t.Fatalf("in-flight request: HTTP %d", status)
	}
	if tm.pub.flushes == 0 || !tm.pub.closed {
		t.Fatalf("publisher not flushed and closed: %d flushes, closed %v", tm.pub.flushes, tm.pub.closed)
	}
}

// n > 1 and batches of prompts stream: every sequence's chunks carry its
// choice index, each ends with its own finish chunk, and the texts are the
// ones the same request answers whole.
func TestMockStreamManySequences(t *testing.T) {
	tm := startMock(t, nil, false)
	chat, comp := tm.url+"/v1/chat/completions", tm.url+"/v1/completions"
	msgs := []any{map[string]any{"role": "user", "content": "stream several"}}
	cases := []struct {
		name string
		url  string
		body map[string]any
		want int // choices
	}{
		{"chat n 3", chat, map[string]any{"messages": msgs, "n": 3, "max_tokens": 5}, 3},
		{"completions two prompts n 2", comp, map[string]any{"prompt": []string{"one prompt", "another prompt"}, "n": 2, "max_tokens": 4}, 4},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			status, body := post(t, c.url, c.body)
			if status != 200 {
				t.Fatalf("whole: HTTP %d: %s", status, body)
			}
			whole := decodeAnswer(t, body)
			if len(whole.Choices) != c.want {
				t.Fatalf("whole: %d choices, want %d", len(whole.Choices), c.want)
			}
			streamed := maps.Clone(c.body)
			streamed["stream"] = true
			_, chunks, done := postStream(t, c.url, streamed)
			if !done {
				t.Fatal("stream did not end with [DONE]")
			}
			texts := make([]string, c.want)
			finished := make([]int, c.want)
			var usage int
			for _, ch := range chunks {
				if ch.Usage != nil {
					usage++
					if ch.Usage.CompletionTokens != whole.Usage.CompletionTokens || ch.Usage.PromptTokens != whole.Usage.PromptTokens {
						t.Errorf("usage %+v, whole answer's %+v", *ch.Usage, *whole.Usage)
					}
					continue
				}
				if len(ch.Choices) != 1 {
					t.Fatalf("chunk with %d choices", len(ch.Choices))
				}
				x := ch.Choices[0]
				if x.Index < 0 || x.Index >= c.want {
					t.Fatalf("choice index %d of %d", x.Index, c.want)
				}
				if finished[x.Index] > 0 {
					t.Errorf("choice %d: a chunk after its finish chunk", x.Index)
				}
				if x.FinishReason != nil {
					finished[x.Index]++
					continue
				}
				switch {
				case x.Delta != nil && x.Delta.Content != nil:
					texts[x.Index] += *x.Delta.Content
				case x.Text != nil:
					texts[x.Index] += *x.Text
				}
			}
			if usage != 1 {
				t.Errorf("%d usage chunks, want 1", usage)
			}
			for i := range c.want {
				want := ""
				if m := whole.Choices[i].Message; m != nil {
					want = m.Content
				} else if whole.Choices[i].Text != nil {
					want = *whole.Choices[i].Text
				}
				if texts[i] != want || finished[i] != 1 {
					t.Errorf("choice %d: streamed %q (%d finish chunks), whole %q", i, texts[i], finished[i], want)
				}
			}
		})
	}
}
