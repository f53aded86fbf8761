package api

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// The request and response bodies below are Dynamo's, from
// docs/components/router/standalone-selection.md in ai-dynamo/dynamo at
// commit 1081193be92344fa22c61a4c048134ec626840c4 ("Selection API" and
// "Ray Select-Then-Reserve Flow").
const (
	dynamoSelectBody = `{
  "selection_id": "select-123",
  "model_name": "model",
  "routing_group": "default",
  "block_hashes": [11, 12, 13, 14, 15, 16, 17, 18],
  "sequence_hashes": [21, 22, 23, 24, 25, 26, 27, 28],
  "isl_tokens": 512
}`
	dynamoSelectAnswer = `{
  "selection_id": "select-123",
  "model_name": "model",
  "routing_group": "default",
  "worker_id": 1,
  "dp_rank": 0,
  "endpoint": "http://worker:8000",
  "block_size": 16,
  "overlap": {
    "longest_matched": 128,
    "gpu": 64,
    "dp": {"0": 64, "1": 32},
    "cpu": 96,
    "disk": 128
  },
  "effective_prefill_tokens": 384
}`
	dynamoReserveBody = `{
  "selection_id": "request-123",
  "model_name": "model",
  "routing_group": "default",
  "worker_id": 1,
  "dp_rank": 0,
  "sequence_hashes": [21, 22, 23, 24, 25, 26, 27, 28],
  "isl_tokens": 512,
  "effective_prefill_tokens": 384
}`
)

// selectionServer is Dynamo's example fleet: worker 1 with two
// data-parallel ranks behind http://worker:8000, block size 16; rank 0
// holds the prompt's first four blocks on the GPU, two more in host memory
// and two on disk, rank 1 the first two.
func selectionServer(t *testing.T, ttl time.Duration) (*Server, *fakeReplica) {
	t.Helper()
	cfg := router.DefaultConfig()
	cfg.BlockSize = 16
	cfg.TrackOutputBlocks = true
	rep := newFakeReplica("model", cfg)
	rep.ranks = map[router.WorkerID]int{"1#0": 0, "1#1": 1}
	rep.addWorker("model", "1#0", "http://worker:8000")
	rep.addWorker("model", "1#1", "http://worker:8000")
	store := func(w router.WorkerID, tier router.Tier, hs ...uint64) {
		blocks := make([]router.StoredBlock, len(hs))
		for i, h := range hs {
			blocks[i] = router.StoredBlock{EngineHash: h, ContentHash: h}
		}
		if err := rep.index.Apply(w, router.KVEvent{Kind: router.EventStored, Blocks: blocks, Tier: tier}); err != nil {
			t.Fatal(err)
		}
	}
	store("1#0", router.TierDevice, 21, 22, 23, 24)
	store("1#0", router.TierHost, 21, 22, 23, 24, 25, 26)
	store("1#0", router.TierDisk, 21, 22, 23, 24, 25, 26, 27, 28)
	store("1#1", router.TierDevice, 21, 22)
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, ReservationTTL: ttl}, rep)
	return s, rep
}

// sameShape fails unless got has every key of want, recursively, with a
// value of the same JSON type.
func sameShape(t *testing.T, path string, want, got any) {
	t.Helper()
	switch w := want.(type) {
	case map[string]any:
		g, ok := got.(map[string]any)
		if !ok {
			t.Fatalf("%s: %T, want an object", path, got)
		}
		for k, v := range w {
			gv, ok := g[k]
			if !ok {
				t.Fatalf("%s.%s missing", path, k)
			}
			sameShape(t, path+"."+k, v, gv)
		}
	default:
		if fmt.Sprintf("%T", want) != fmt.Sprintf("%T", got) {
			t.Fatalf("%s: %T, want %T", path, got, want)
		}
	}
}

func decodeJSON(t *testing.T, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("answer %q: %v", b, err)
	}
	return m
}

// /select answers Dynamo's documented shape for Dynamo's documented
// request, with the values the example fleet gives, and books nothing;
// /select_and_reserve answers the same and books.
func TestAPISelectionDynamoShapes(t *testing.T) {
	s, rep := selectionServer(t, time.Hour)
	want := decodeJSON(t, []byte(dynamoSelectAnswer))
	for _, path := range []string{"/select", "/select_and_reserve"} {
		t.Run(path, func(t *testing.T) {
			rec := do(s, "POST", path, dynamoSelectBody)
			if rec.Code != http.StatusOK {
				t.Fatalf("%d %s", rec.Code, rec.Body)
			}
			got := decodeJSON(t, rec.Body.Bytes())
			sameShape(t, "", want, got)
			// Every documented value but effective_prefill_tokens, which is
			// what this router books: the prompt less its GPU-cached tokens
			// (512 − 64); Dynamo's 384 weighs lower tiers in by its credit.
			g, w := copyMap(got), copyMap(want)
			delete(g, "effective_prefill_tokens")
			delete(w, "effective_prefill_tokens")
			gb, _ := json.Marshal(g)
			wb, _ := json.Marshal(w)
			if string(gb) != string(wb) {
				t.Fatalf("answer\n%s\nwant\n%s", gb, wb)
			}
			if got["effective_prefill_tokens"] != float64(448) {
				t.Fatalf("effective_prefill_tokens %v, want 448", got["effective_prefill_tokens"])
			}
			booked := rep.routers["model"].Load().Load("1#0").Requests
			if want := map[string]int{"/select": 0, "/select_and_reserve": 1}[path]; booked != want {
				t.Fatalf("%d requests booked on 1#0, want %d", booked, want)
			}
		})
	}
}

func copyMap(m map[string]any) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// The lifecycle: select_and_reserve books (and announces) under the
// selection id, prefill_complete and release reach the replica sync, a
// released id is gone, a reserved id cannot be reserved twice; Ray's
// select-then-reserve books the caller's effective_prefill_tokens.
func TestAPISelectionReserveRelease(t *testing.T) {
	s, rep := selectionServer(t, time.Hour)
	load := func() router.WorkerLoad { return rep.routers["model"].Load().Load("1#0") }
	if rec := do(s, "POST", "/select_and_reserve", dynamoSelectBody); rec.Code != 200 {
		t.Fatalf("reserve: %d %s", rec.Code, rec.Body)
	}
	if rec := do(s, "POST", "/select_and_reserve", dynamoSelectBody); rec.Code != http.StatusConflict {
		t.Fatalf("second reserve of one id: %d, want 409", rec.Code)
	}
	if rec := do(s, "POST", "/reservations/select-123/prefill_complete", ""); rec.Code != 200 {
		t.Fatalf("prefill_complete: %d %s", rec.Code, rec.Body)
	}
	before := load()
	if before.Requests != 1 || before.ActivePrefillTokens != 0 {
		t.Fatalf("load after prefill_complete %+v, want one request, no prefill", before)
	}
	for _, body := range []string{"", `{"decay_fraction":0.5}`} {
		if rec := do(s, "POST", "/reservations/select-123/output_block", body); rec.Code != 200 {
			t.Fatalf("output_block %q: %d %s", body, rec.Code, rec.Body)
		}
	}
	if l := load(); l.ActiveBlocks != before.ActiveBlocks+2 {
		t.Fatalf("active blocks %d after two output blocks, want %d", l.ActiveBlocks, before.ActiveBlocks+2)
	}
	for body, want := range map[string]int{`{"decay_fraction":1.5}`: 400, `{"decay_fraction":`: 400} {
		if rec := do(s, "POST", "/reservations/select-123/output_block", body); rec.Code != want {
			t.Fatalf("output_block %q: %d, want %d", body, rec.Code, want)
		}
	}
	if rec := do(s, "POST", "/reservations/nope/output_block", ""); rec.Code != http.StatusNotFound {
		t.Fatalf("output_block of an unknown id: %d", rec.Code)
	}
	if rec := do(s, "DELETE", "/reservations/select-123", ""); rec.Code != 200 {
		t.Fatalf("release: %d %s", rec.Code, rec.Body)
	}
	if rec := do(s, "DELETE", "/reservations/select-123", ""); rec.Code != http.StatusNotFound {
		t.Fatalf("second release: %d, want 404", rec.Code)
	}
	if l := load(); l.Requests != 0 {
		t.Fatalf("load after release %+v", l)
	}
	for _, ev := range []string{"add sel:select-123", "prefill sel:select-123", "free sel:select-123"} {
		if !slices.Contains(rep.events, ev) {
			t.Fatalf("replica sync missed %q: %v", ev, rep.events)
		}
	}

	// Ray: /select, then /reservations with the worker and its prefill.
	if rec := do(s, "POST", "/select", strings.Replace(dynamoSelectBody, "select-123", "request-123", 1)); rec.Code != 200 {
		t.Fatalf("select: %d", rec.Code)
	}
	rec := do(s, "POST", "/reservations", dynamoReserveBody)
	if rec.Code != http.StatusCreated {
		t.Fatalf("reservations: %d %s", rec.Code, rec.Body)
	}
	if l := load(); l.Requests != 1 || l.ActivePrefillTokens != 384 {
		t.Fatalf("load after /reservations %+v, want one request with 384 prefill tokens", l)
	}
	if rec := do(s, "DELETE", "/reservations/request-123", ""); rec.Code != 200 || load().Requests != 0 {
		t.Fatalf("release: %d, load %+v", rec.Code, load())
	}
}

// A reservation nobody releases is freed by its TTL, here and (Freed) on
// the other replicas, and counted.
func TestAPISelectionReservationExpires(t *testing.T) {
	s, rep := selectionServer(t, 20*time.Millisecond)
	if rec := do(s, "POST", "/select_and_reserve", dynamoSelectBody); rec.Code != 200 {
		t.Fatalf("%d %s", rec.Code, rec.Body)
	}
	rep.mu.Lock()
	booked := slices.Contains(rep.events, "add sel:select-123")
	rep.mu.Unlock()
	if !booked {
		t.Fatal("not booked")
	}
	poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
		rep.mu.Lock()
		defer rep.mu.Unlock()
		if !slices.Contains(rep.events, "free sel:select-123") {
			return fmt.Errorf("not freed yet: %v", rep.events)
		}
		return nil
	})
	if l := rep.routers["model"].Load().Load("1#0"); l.Requests != 0 {
		t.Fatalf("load after expiry %+v", l)
	}
	var m dto.Metric
	if err := s.resv.expired.Write(&m); err != nil || m.GetCounter().GetValue() != 1 {
		got := m.GetCounter().GetValue()
		t.Fatalf("expired counter %v, want 1", got)
	}
	if rec := do(s, "DELETE", "/reservations/select-123", ""); rec.Code != http.StatusNotFound {
		t.Fatalf("release after expiry: %d, want 404", rec.Code)
	}
}

// Bad input is a 4xx with a JSON error and books nothing.
func TestAPISelectionBadInput(t *testing.T) {
	s, rep := selectionServer(t, time.Hour)
	cases := []struct {
		name, path, body string
		want             int
	}{
		{"not JSON", "/select", `{"model_name":`, 400},
		{"unknown model", "/select", `{"model_name":"other","sequence_hashes":[1]}`, 404},
		{"unknown routing group", "/select_and_reserve", `{"model_name":"model","routing_group":"blue"}`, 404},
		{"hash lists differ", "/select", `{"model_name":"model","block_hashes":[1,2],"sequence_hashes":[3]}`, 400},
		{"isl shorter than the blocks", "/select_and_reserve", `{"model_name":"model","sequence_hashes":[1,2],"isl_tokens":20}`, 400},
		{"negative isl", "/select", `{"model_name":"model","isl_tokens":-1}`, 400},
		{"reservation without id", "/reservations", `{"model_name":"model","worker_id":1}`, 400},
		{"reservation of an unknown worker", "/reservations", `{"selection_id":"x","model_name":"model","worker_id":7}`, 404},
		{"prefill beyond isl", "/reservations", `{"selection_id":"x","model_name":"model","worker_id":1,"dp_rank":0,"isl_tokens":32,"effective_prefill_tokens":33}`, 400},
		{"selection id too long", "/select_and_reserve", `{"model_name":"model","selection_id":"` + strings.Repeat("x", 300) + `"}`, 400},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rec := do(s, "POST", tc.path, tc.body)
			var e struct {
				Error string `json:"error"`
			}
			if rec.Code != tc.want || json.Unmarshal(rec.Body.Bytes(), &e) != nil || e.Error == "" {
				t.Fatalf("%d %s, want %d with a JSON error", rec.Code, rec.Body, tc.want)
			}
		})
	}
	if len(rep.events) != 0 {
		t.Fatalf("bad input reached the replica: %v", rep.events)
	}
}

// Local block hashes alone are chained into the sequence hashes the index
// is keyed by, as the engines chain them.
func TestAPISelectionChainsBlockHashes(t *testing.T) {
	cfg := router.DefaultConfig()
	tokens := make([]uint32, 3*cfg.BlockSize)
	for i := range tokens {
		tokens[i] = uint32(i * 7)
	}
	local, seq := router.BlockHashes(tokens, cfg.BlockSize, "")
	if got := chainHashes(local); !slices.Equal(got, seq) {
		t.Fatalf("chained %v, want %v", got, seq)
	}
}

// FuzzHTTPSelection: any body to /select, /select_and_reserve or
// /reservations is answered in Dynamo's shape or with a JSON error; a
// refused one books nothing and reaches no replica; a reservation books
// exactly one request, which its release (by the id answered) frees here
// and on the other replicas.
func FuzzHTTPSelection(f *testing.F) {
	f.Add(uint8(0), []byte(dynamoSelectBody))
	f.Add(uint8(1), []byte(dynamoSelectBody))
	f.Add(uint8(1), []byte(`{"model_name":"model","block_hashes":[11,12]}`))
	f.Add(uint8(2), []byte(dynamoReserveBody))
	f.Add(uint8(2), []byte(`{"selection_id":"a","model_name":"model","worker_id":"1","isl_tokens":16}`))
	f.Add(uint8(1), []byte(`{"model_name":"model","sequence_hashes":[1],"isl_tokens":1}`))
	f.Add(uint8(1), []byte(`{"model_name":"model","selection_id":"a/b"}`))
	f.Add(uint8(2), []byte(`{"model_name":"model","selection_id":"%2F ?#","worker_id":1}`))
	f.Fuzz(func(t *testing.T, which uint8, body []byte) {
		s, rep := selectionServer(t, time.Hour)
		path := []string{"/select", "/select_and_reserve", "/reservations"}[which%3]
		rec := do(s, "POST", path, string(body))
		rt := rep.routers["model"]
		ok := rec.Code == http.StatusOK || rec.Code == http.StatusCreated
		if !ok {
			checkErrorBody(t, path, rec.Code, rec.Body.Bytes(), adminShape)
			if rt.Load().Len() != 0 || len(rep.events) != 0 {
				t.Fatalf("%s refused with %d but booked: %v", path, rec.Code, rep.events)
			}
			return
		}
		var out struct {
			SelectionID string          `json:"selection_id"`
			WorkerID    json.RawMessage `json:"worker_id"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil || len(out.WorkerID) == 0 {
			t.Fatalf("%s answered %d %s", path, rec.Code, rec.Body)
		}
		want := map[string]int{"/select": 0, "/select_and_reserve": 1, "/reservations": 1}[path]
		if n := rt.Load().Len(); n != want {
			t.Fatalf("%s booked %d requests, want %d", path, n, want)
		}
		if want == 0 {
			return
		}
		if del := do(s, "DELETE", "/reservations/"+url.PathEscape(out.SelectionID), ""); del.Code != http.StatusOK {
			t.Fatalf("release of %q: %d %s", out.SelectionID, del.Code, del.Body)
		}
		if n := rt.Load().Len(); n != 0 || !slices.Contains(rep.events, "free sel:"+out.SelectionID) {
			t.Fatalf("after release: %d booked, events %v", n, rep.events)
		}
	})
}
