package api

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// storeBlocks puts the blocks of tokens, hashed under lora and salt as an
// engine's events would carry them, on worker w.
func storeBlocks(t *testing.T, rep *fakeReplica, w router.WorkerID, tokens []uint32, bs int, lora, salt string) {
	t.Helper()
	seq := router.SaltedSequenceHashes(tokens, bs, lora, salt)
	if len(seq) < 2 {
		t.Fatal("prompt shorter than two blocks")
	}
	blocks := make([]router.StoredBlock, len(seq))
	for i, h := range seq {
		blocks[i] = router.StoredBlock{EngineHash: h, ContentHash: h}
	}
	if err := rep.index.Apply(w, router.KVEvent{Kind: router.EventStored, Blocks: blocks}); err != nil {
		t.Fatal(err)
	}
}

// cachedBlocks is /debug/route's cached blocks per worker for body.
func cachedBlocks(t *testing.T, s *Server, body string) map[string]int {
	t.Helper()
	var table struct {
		Workers []struct {
			Worker       string `json:"worker"`
			CachedBlocks int    `json:"cached_blocks"`
		} `json:"workers"`
	}
	if rec := do(s, "POST", "/debug/route", body); rec.Code != 200 || json.Unmarshal(rec.Body.Bytes(), &table) != nil {
		t.Fatalf("debug/route: %d %s", rec.Code, rec.Body)
	}
	out := map[string]int{}
	for _, r := range table.Workers {
		out[r.Worker] = r.CachedBlocks
	}
	return out
}

const longPrompt = "a prompt long enough to fill several blocks of sixteen builtin tokens each: one two three four five six "

// cache_salt (vLLM) is hashed into the blocks' seed as Dynamo does: a salted
// request matches only its own salt's blocks, never unsalted ones.
func TestAPICacheSalt(t *testing.T) {
	cfg := router.DefaultConfig()
	rep := newFakeReplica("m", cfg)
	for _, id := range []router.WorkerID{"w1", "w2", "w3"} {
		rep.addWorker("m", id, "http://127.0.0.1:1")
	}
	prompt := strings.Repeat(longPrompt, 4)
	tokens := tokenize.Builtin().EncodeSpecial(prompt)
	storeBlocks(t, rep, "w1", tokens, cfg.BlockSize, "", "")
	storeBlocks(t, rep, "w2", tokens, cfg.BlockSize, "", "tenant-a")
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true}, rep)
	tests := []struct {
		name, salt string
		hit        string // the one worker with cached blocks
	}{
		{"unsalted", "", "w1"},
		{"tenant-a", `,"cache_salt":"tenant-a"`, "w2"},
		{"tenant-b", `,"cache_salt":"tenant-b"`, ""},
	}
	for _, tc := range tests {
		got := cachedBlocks(t, s, fmt.Sprintf(`{"model":"m","prompt":%q%s}`, prompt, tc.salt))
		for w, n := range got {
			if (w == tc.hit) != (n >= 2) {
				t.Errorf("%s: cached blocks %v, want hits on %q only", tc.name, got, tc.hit)
				break
			}
		}
	}
}

// A request is booked, while it runs, as every sequence it generates: n
// for each prompt of a completions batch, with every prompt's tokens as
// prefill (the test's tokenizer: one token per word; token ids as given).
func TestAPINSequencesBooked(t *testing.T) {
	cases := []struct {
		name, path, body  string
		requests, prefill int
	}{
		{"n=3", "/v1/completions", `{"model":"m","prompt":"hello","n":3}`, 3, 1},
		{"batch of 2", "/v1/completions", `{"model":"m","prompt":["hello","hi"]}`, 2, 1 + 1},
		{"batch of 2, n=2", "/v1/completions", `{"model":"m","prompt":["hello","hi"],"n":2}`, 4, 1 + 1},
		{"token batch", "/v1/completions", `{"model":"m","prompt":[[1,2,3],[4,5],[6]]}`, 3, 3 + 2 + 1},
		{"chat n=2", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hello"}],"n":2}`, 2, -1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := router.DefaultConfig()
			rep := newFakeReplica("m", cfg)
			release := make(chan struct{})
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				<-release
				w.Header().Set("Content-Type", "application/json")
				fmt.Fprint(w, `{"choices":[{"text":"a"},{"text":"b"},{"text":"c"}]}`)
			}))
			t.Cleanup(srv.Close)
			var once sync.Once
			free := func() { once.Do(func() { close(release) }) }
			t.Cleanup(free) // before srv.Close (LIFO): a failed wait must not hang the handler
			rep.addWorker("m", "w1", srv.URL)
			s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true}, rep)
			rt, _ := rep.Router("m")
			done := make(chan int, 1)
			go func() { done <- do(s, "POST", c.path, c.body).Code }()
			poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
				l := rt.Load().Load("w1")
				if l.Requests != c.requests || (c.prefill >= 0 && l.ActivePrefillTokens != c.prefill) {
					return fmt.Errorf("booked %+v, want %d requests and %d prefill tokens", l, c.requests, c.prefill)
				}
				return nil
			})
			free()
			if code := <-done; code != 200 {
				t.Fatalf("status %d", code)
			}
			if l := rt.Load().Load("w1"); l.Requests != 0 {
				t.Errorf("after the answer: %+v", l)
			}
		})
	}
}

// seen is what a recording worker got.
type seen struct {
	path, body string
}

// recordingWorkers starts n workers answering every path with JSON and
// recording what they got; they are w1…wn of model "m".
func recordingWorkers(t *testing.T, rep *fakeReplica, n int) chan seen {
	t.Helper()
	got := make(chan seen, 64)
	for i := range n {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			got <- seen{r.URL.Path, string(b)}
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprint(w, `{"object":"list","data":[],"usage":{"prompt_tokens":1}}`)
		}))
		t.Cleanup(srv.Close)
		rep.addWorker("m", router.WorkerID(fmt.Sprintf("w%d", i+1)), srv.URL)
	}
	return got
}

// Embeddings, responses: prefix-routed to the worker holding the prompt's
// blocks (embeddings input encoded as vLLM does, add_special_tokens true;
// responses rendered as the equivalent chat), forwarded to the same path
// with the body unchanged.
func TestAPIEndpointsPrefixRouted(t *testing.T) {
	cfg := router.DefaultConfig()
	prompt := strings.Repeat(longPrompt, 4)
	s0 := New(Config{Registry: prometheus.NewRegistry()}, newFakeReplica("m", cfg))
	m, _ := s0.cfg.Prompts.Lookup("m")
	equivalentChat := fmt.Sprintf(`{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":%q}]}`, prompt)
	chatTokens, err := m.Chat([]byte(equivalentChat))
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, path, body string
		tokens           []uint32
	}{
		{"embeddings string", "/v1/embeddings", fmt.Sprintf(`{"model":"m","input":%q}`, prompt), tokenize.Builtin().EncodeSpecial(prompt)},
		{"embeddings batch: routed by the first", "/v1/embeddings", fmt.Sprintf(`{"model":"m","input":[%q,"other"]}`, prompt), tokenize.Builtin().EncodeSpecial(prompt)},
		{"embeddings without special tokens", "/v1/embeddings", fmt.Sprintf(`{"model":"m","input":%q,"add_special_tokens":false}`, prompt), tokenize.Builtin().Encode(prompt)},
		{"embeddings token ids", "/v1/embeddings", `{"model":"m","input":[` + strings.Repeat("7,", 63) + `7]}`, func() []uint32 {
			ids := make([]uint32, 64)
			for i := range ids {
				ids[i] = 7
			}
			return ids
		}()},
		{"responses string input", "/v1/responses", fmt.Sprintf(`{"model":"m","instructions":"be brief","input":%q}`, prompt), chatTokens},
		{"responses message items", "/v1/responses", fmt.Sprintf(`{"model":"m","instructions":"be brief","input":[{"type":"message","role":"user","content":[{"type":"input_text","text":%q}]}]}`, prompt), chatTokens},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rep := newFakeReplica("m", cfg)
			got := recordingWorkers(t, rep, 3)
			storeBlocks(t, rep, "w2", tc.tokens, cfg.BlockSize, "", "")
			s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true}, rep)
			rec := do(s, "POST", tc.path, tc.body)
			if rec.Code != 200 || rec.Header().Get("X-Worker-Id") != "w2" {
				t.Fatalf("%d worker %q: %s", rec.Code, rec.Header().Get("X-Worker-Id"), rec.Body)
			}
			if g := <-got; g.path != tc.path || g.body != tc.body {
				t.Errorf("worker got %s %s", g.path, g.body)
			}
		})
	}
}

// The Responses input items become vLLM's chat messages: same ids as the
// chat body written by hand.
func TestAPIResponsesToChat(t *testing.T) {
	s := New(Config{Registry: prometheus.NewRegistry()}, newFakeReplica("m", router.DefaultConfig()))
	m, _ := s.cfg.Prompts.Lookup("m")
	resp := `{"model":"m","input":[
		{"role":"user","content":"weather in Paris?"},
		{"type":"function_call","call_id":"c1","name":"get_weather","arguments":"{\"city\":\"Paris\"}"},
		{"type":"function_call_output","call_id":"c1","output":"sunny"}],
		"tools":[{"type":"function","name":"get_weather","parameters":{"type":"object"}},{"type":"web_search"}]}`
	chat := `{"messages":[
		{"role":"user","content":"weather in Paris?"},
		{"role":"assistant","tool_calls":[{"id":"c1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},
		{"role":"tool","content":"sunny","tool_call_id":"c1"}],
		"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}}]}`
	conv, err := responsesToChat([]byte(resp))
	if err != nil {
		t.Fatal(err)
	}
	a, errA := m.Chat(conv)
	b, errB := m.Chat([]byte(chat))
	if errA != nil || errB != nil || !slices.Equal(a, b) {
		t.Fatalf("responses %v (%v) != chat %v (%v); converted %s", a, errA, b, errB, conv)
	}
}

// Score and rerank are load-aware (pairs are not hashed): with w1 loaded,
// they go to w2.
func TestAPIScoreRerankLoadAware(t *testing.T) {
	cfg := router.DefaultConfig()
	rep := newFakeReplica("m", cfg)
	got := recordingWorkers(t, rep, 2)
	rt, _ := rep.Router("m")
	rt.Load().Add(router.Booking{ID: "busy", Worker: "w1", Hashes: []uint64{1, 2, 3}, PrefillTokens: 4000, Added: time.Now()})
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true}, rep)
	for _, tc := range []struct{ path, body string }{
		{"/v1/score", `{"model":"m","text_1":"what is kv cache?","text_2":["a cache of keys","and values"]}`},
		{"/v1/score", `{"model":"m","text_1":["a","b"],"text_2":["c","d"]}`},
		{"/v1/rerank", `{"model":"m","query":"what is kv cache?","documents":["a cache of keys",{"text":"and values"}],"top_n":1}`},
	} {
		rec := do(s, "POST", tc.path, tc.body)
		if rec.Code != 200 || rec.Header().Get("X-Worker-Id") != "w2" {
			t.Fatalf("%s: %d worker %q: %s", tc.path, rec.Code, rec.Header().Get("X-Worker-Id"), rec.Body)
		}
		if g := <-got; g.path != tc.path || g.body != tc.body {
			t.Errorf("worker got %s %s", g.path, g.body)
		}
	}
	if l := rt.Load().Load("w2"); l.Requests != 0 {
		t.Errorf("bookings left on w2: %+v", l)
	}
}

// Shapes the router cannot read are 400 in OpenAI's error JSON, naming
// what is wanted; nothing reaches a worker.
func TestAPIEndpointsBadShapes(t *testing.T) {
	rep := newFakeReplica("m", router.DefaultConfig())
	got := recordingWorkers(t, rep, 1)
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true}, rep)
	tests := []struct{ path, body, want string }{
		{"/v1/embeddings", `{"model":"m"}`, `want \"input\"`},
		{"/v1/embeddings", `{"model":"m","input":42}`, "embeddings input"},
		{"/v1/embeddings", `{"model":"m","input":[]}`, "embeddings input"},
		{"/v1/score", `{"model":"m","text_1":"q"}`, "text_2"},
		{"/v1/score", `{"model":"m","text_1":["a","b"],"text_2":["c","d","e"]}`, "2 first texts against 3"},
		{"/v1/rerank", `{"model":"m","query":"q","documents":[1,2]}`, "documents"},
		{"/v1/responses", `{"model":"m"}`, `"input\" is required`},
		{"/v1/responses", `{"model":"m","input":[]}`, "empty list"},
		{"/v1/responses", `{"model":"m","input":[{"type":"computer_call"}]}`, `unsupported input item type \"computer_call\"`},
		{"/v1/responses", `{"model":"m","input":[{"type":"reasoning","encrypted_content":"x"}]}`, "encrypted"},
		{"/v1/responses", `{"model":"m","input":{"role":"user"}}`, "string or a list"},
	}
	for _, tc := range tests {
		rec := do(s, "POST", tc.path, tc.body)
		if rec.Code != 400 || !strings.Contains(rec.Body.String(), tc.want) || !strings.Contains(rec.Body.String(), `"error"`) {
			t.Errorf("%s %s: %d %s, want 400 with %q", tc.path, tc.body, rec.Code, rec.Body, tc.want)
		}
	}
	select {
	case g := <-got:
		t.Errorf("a bad request reached the worker: %v", g)
	default:
	}
}
