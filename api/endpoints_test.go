package api

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
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

// A request with n > 1 is booked as n sequences while it runs.
func TestAPINSequencesBooked(t *testing.T) {
	cfg := router.DefaultConfig()
	rep := newFakeReplica("m", cfg)
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-release
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"choices":[{"text":"a"},{"text":"b"},{"text":"c"}]}`)
	}))
	t.Cleanup(srv.Close)
	rep.addWorker("m", "w1", srv.URL)
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true}, rep)
	rt, _ := rep.Router("m")
	done := make(chan int)
	go func() { done <- do(s, "POST", "/v1/completions", `{"model":"m","prompt":"hello","n":3}`).Code }()
	poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
		if l := rt.Load().Load("w1"); l.Requests != 3 {
			return fmt.Errorf("booked %+v, want 3 requests", l)
		}
		return nil
	})
	close(release)
	if code := <-done; code != 200 {
		t.Fatalf("status %d", code)
	}
	if l := rt.Load().Load("w1"); l.Requests != 0 {
		t.Errorf("after the answer: %+v", l)
	}
}
