package api

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/router"
)

// A request naming a LoRA adapter goes only to the base model's workers
// that serve it, its blocks hashed with the adapter's seed: w2 holds the
// adapter's blocks (hashed as the engine's events would be), w3 serves the
// adapter too but holds nothing, w1 holds the same prompt's base-model
// blocks and does not serve the adapter.
func TestAPILoRAAdapterRouting(t *testing.T) {
	cfg := router.DefaultConfig()
	rep := newFakeReplica("m", cfg)
	var hits [3]atomic.Int64
	for i, id := range []router.WorkerID{"w1", "w2", "w3"} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			hits[i].Add(1)
			var body struct {
				Model string `json:"model"`
			}
			_ = json.NewDecoder(r.Body).Decode(&body)
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"model":%q,"choices":[{"text":"x"}]}`, body.Model)
		}))
		t.Cleanup(srv.Close)
		rep.addWorker("m", id, srv.URL)
	}
	rep.adapters = map[string]fakeAdapter{"sql-lora": {base: "m", workers: []router.WorkerID{"w2", "w3"}}}

	prompt := strings.Repeat("a prompt long enough to fill several blocks of sixteen builtin tokens each: one two three four five six ", 4)
	tokens := tokenize.Builtin().EncodeSpecial(prompt)
	store := func(w router.WorkerID, lora string) {
		seq := router.SequenceHashes(tokens, cfg.BlockSize, lora)
		blocks := make([]router.StoredBlock, len(seq))
		for i, h := range seq {
			blocks[i] = router.StoredBlock{EngineHash: h, ContentHash: h}
		}
		if err := rep.index.Apply(w, router.KVEvent{Kind: router.EventStored, Blocks: blocks}); err != nil {
			t.Fatal(err)
		}
	}
	store("w1", "")
	store("w2", "sql-lora")
	if len(router.SequenceHashes(tokens, cfg.BlockSize, "")) < 2 {
		t.Fatal("prompt shorter than two blocks")
	}

	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true}, rep)
	body := fmt.Sprintf(`{"model":"sql-lora","prompt":%q}`, prompt)
	// The cost table: w2's adapter blocks match (adapter seed); w1's base
	// blocks of the same tokens do not.
	var table struct {
		Workers []struct {
			Worker       string `json:"worker"`
			CachedBlocks int    `json:"cached_blocks"`
		} `json:"workers"`
	}
	if rec := do(s, "POST", "/debug/route", body); rec.Code != 200 || json.Unmarshal(rec.Body.Bytes(), &table) != nil {
		t.Fatalf("debug/route: %d %s", rec.Code, rec.Body)
	}
	cached := map[string]int{}
	for _, r := range table.Workers {
		cached[r.Worker] = r.CachedBlocks
	}
	if cached["w1"] != 0 || cached["w2"] < 2 || cached["w3"] != 0 {
		t.Fatalf("adapter cost table: %v", cached)
	}
	for range 5 {
		rec := do(s, "POST", "/v1/completions", body)
		if rec.Code != 200 || rec.Header().Get("X-Worker-Id") != "w2" {
			t.Fatalf("adapter request: %d worker %q %s", rec.Code, rec.Header().Get("X-Worker-Id"), rec.Body)
		}
		var out struct{ Model string }
		if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil || out.Model != "sql-lora" {
			t.Fatalf("the worker did not get the adapter's name: %s", rec.Body)
		}
	}
	// The base model's request finds the base blocks on w1.
	rec := do(s, "POST", "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":%q}`, prompt))
	if rec.Code != 200 || rec.Header().Get("X-Worker-Id") != "w1" {
		t.Fatalf("base request: %d worker %q", rec.Code, rec.Header().Get("X-Worker-Id"))
	}
	if hits[0].Load() != 1 || hits[1].Load() != 5 || hits[2].Load() != 0 {
		t.Errorf("hits w1=%d w2=%d w3=%d", hits[0].Load(), hits[1].Load(), hits[2].Load())
	}
	// An adapter no worker serves is an unknown model.
	if rec := do(s, "POST", "/v1/completions", `{"model":"nope","prompt":"x"}`); rec.Code != 404 {
		t.Errorf("unknown adapter: %d", rec.Code)
	}
}

func TestLoRANotServing(t *testing.T) {
	ws := []router.WorkerInfo{{ID: "a"}, {ID: "b"}, {ID: "c"}}
	if got := notServing(ws, nil); got != nil {
		t.Errorf("no adapter: %v", got)
	}
	if got := notServing(ws, []router.WorkerID{"b"}); len(got) != 2 || got[0] != "a" || got[1] != "c" {
		t.Errorf("adapter on b: %v", got)
	}
}
