package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/router"
)

// oneReplica is a minimal api.Replica: one model, one event-fed index, no
// Raft. Registration goes through the real HTTP handler.
type oneReplica struct {
	model string
	index *router.Index
	rt    *router.Router

	mu    sync.Mutex
	urls  map[router.WorkerID]string
	ranks map[router.WorkerID]int // the rank of each routable id of a worker with dp ranks
}

func newOneReplica(t *testing.T, model string) *oneReplica {
	cfg := router.DefaultConfig()
	cfg.BlockSize = 16
	ix := router.NewIndex(cfg.BlockSize)
	rt, err := router.New(cfg, ix, 1)
	if err != nil {
		t.Fatal(err)
	}
	return &oneReplica{model: model, index: ix, rt: rt, urls: map[router.WorkerID]string{}, ranks: map[router.WorkerID]int{}}
}

func (r *oneReplica) NodeID() string   { return "r1" }
func (r *oneReplica) Models() []string { return []string{r.model} }
func (r *oneReplica) Router(m string) (*router.Router, bool) {
	return r.rt, m == r.model
}
func (r *oneReplica) Adapter(string) (string, []router.WorkerID, bool) { return "", nil, false }
func (r *oneReplica) DPRank(id router.WorkerID) (int, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	n, ok := r.ranks[id]
	return n, ok
}
func (r *oneReplica) WorkerURL(id router.WorkerID) (string, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	u, ok := r.urls[id]
	return u, ok
}
func (r *oneReplica) Thresholds(string) (router.Thresholds, bool) {
	return r.rt.Config().Thresholds, true
}
func (r *oneReplica) SetThresholds(context.Context, string, api.ThresholdUpdate) (router.Thresholds, error) {
	return router.Thresholds{}, api.ErrInvalid
}
func (r *oneReplica) RegisterWorker(_ context.Context, w api.WorkerSpec) error {
	if w.Model != r.model {
		return api.ErrUnknownModel
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	// One routable id per data-parallel rank, as the replica folds them
	// (router.WorkerKey), each its own index entry and load.
	for rank := range max(w.DPRanks, 1) {
		id := router.WorkerKey(w.ID, uint32(rank))
		if _, ok := r.urls[id]; !ok {
			r.index.AddWorker(id)
			r.rt.SetWorkers(append(r.rt.Workers(), router.WorkerInfo{ID: id, TotalBlocks: w.TotalBlocks, MaxBatchedTokens: w.MaxBatchedTokens}))
		}
		r.urls[id] = w.URL
		if w.DPRanks > 1 {
			r.ranks[id] = rank
		}
	}
	return nil
}
func (r *oneReplica) DeregisterWorker(context.Context, string) error { return nil }
func (r *oneReplica) Ready() (bool, string)                          { return true, "" }
func (r *oneReplica) Status(bool) map[string]any                     { return map[string]any{"node_id": "r1"} }
func (r *oneReplica) ReadBarrier(context.Context) error              { return nil }
func (r *oneReplica) Audit(router.WorkerID, int, int, int)           {}
func (r *oneReplica) Booked(string, router.Booking)                  {}
func (r *oneReplica) PrefillDone(string, string)                     {}
func (r *oneReplica) Freed(string, string)                           {}

// The real router in front of kvmock: kvmock registers itself, its events
// (as the index would apply them) make the router see its cache, the
// router's overlap equals what kvmock reports as cached, and the router's
// usage audit finds cached tokens in the stream.
func TestMockRouterEndToEnd(t *testing.T) {
	rep := newOneReplica(t, "kvmock")
	// kvmock listens on loopback: allow it, as a local cluster does.
	srv := api.New(api.Config{Tokenizer: tokenize.Builtin(), ChatTemplate: tokenize.Plain, Logger: testLog(t), AllowLoopbackWorkers: true}, rep)
	front := httptest.NewServer(srv.Handler())
	defer front.Close()

	tm := startMock(t, func(c *config) { c.Register = []string{front.URL} }, false)
	checkFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		if _, ok := rep.WorkerURL("mock-1"); !ok {
			return io.EOF
		}
		return nil
	})

	body := chatBody(words("route", 120), 4, false)
	status, out := post(t, front.URL+"/v1/chat/completions", body)
	if status != 200 {
		t.Fatalf("through the router: HTTP %d: %s", status, out)
	}
	// Apply what kvmock published, as the cluster's consumer would.
	data, _ := json.Marshal(body)
	nBlocks := len(router.SequenceHashes(routerTokens(t, data), 16, ""))
	evs := waitEvents(t, tm.pub, 2)
	for _, ev := range evs {
		if err := rep.index.Apply(ev.WorkerID(), ev.KVEvent()); err != nil {
			t.Fatal(err)
		}
	}

	// The router now sees the prompt's blocks on kvmock.
	resp, err := http.Post(front.URL+"/debug/route", "application/json", bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	var dbg struct {
		PromptBlocks int `json:"prompt_blocks"`
		Workers      []struct {
			Worker       string `json:"worker"`
			CachedBlocks int    `json:"cached_blocks"`
		} `json:"workers"`
	}
	err = json.NewDecoder(resp.Body).Decode(&dbg)
	resp.Body.Close()
	if err != nil || len(dbg.Workers) != 1 {
		t.Fatalf("debug route: %+v %v", dbg, err)
	}
	if dbg.PromptBlocks != nBlocks || dbg.Workers[0].CachedBlocks != nBlocks {
		t.Fatalf("router sees %d of %d blocks cached on %s, want all %d", dbg.Workers[0].CachedBlocks, dbg.PromptBlocks, dbg.Workers[0].Worker, nBlocks)
	}

	// The same request again, streamed: the router's overlap (X-Cached-Blocks)
	// and kvmock's cached_tokens agree.
	body["stream"] = true
	data, _ = json.Marshal(body)
	resp, err = http.Post(front.URL+"/v1/chat/completions", "application/json", bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("X-Worker-Id") != "mock-1" {
		t.Fatalf("HTTP %d worker %q", resp.StatusCode, resp.Header.Get("X-Worker-Id"))
	}
	chunks, done := readSSE(t, resp.Body)
	if !done {
		t.Fatal("stream through the router: no [DONE]")
	}
	u := chunks[len(chunks)-1].Usage
	if u == nil {
		t.Fatal("no usage chunk")
	}
	routerCached := resp.Header.Get("X-Cached-Blocks")
	tokensCached := u.PromptTokensDetails.CachedTokens
	// The engine recomputes the last block of a prompt that is all whole
	// blocks; otherwise every block the router saw is a hit.
	want := min(nBlocks, (u.PromptTokens-1)/16) * 16
	if routerCached != itoa(nBlocks) || tokensCached != want || tokensCached == 0 {
		t.Fatalf("router predicted %s blocks, kvmock reports %d cached tokens (want %d)", routerCached, tokensCached, want)
	}
}

func itoa(n int) string {
	b, _ := json.Marshal(n)
	return string(b)
}
