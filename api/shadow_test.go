package api

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/router"
)

// TestAPIShadowBody: a copy is the client's body with one output token,
// not streamed, one sample: max_tokens 1 always, max_completion_tokens 1
// when present, stream false, stream_options and min_tokens removed, n and
// best_of 1 when present; the prompt and other fields as sent. Not an
// object: refused.
func TestAPIShadowBody(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		want     map[string]any
		gone     []string
	}{
		{"chat, streamed, max_completion_tokens",
			`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":500,"temperature":0.2}`,
			map[string]any{"model": "m", "max_tokens": 1.0, "max_completion_tokens": 1.0, "stream": false, "temperature": 0.2},
			[]string{"stream_options"}},
		{"completions, max_tokens, n, min_tokens",
			`{"model":"m","prompt":"once upon","max_tokens":64,"n":4,"best_of":5,"min_tokens":8}`,
			map[string]any{"prompt": "once upon", "max_tokens": 1.0, "n": 1.0, "best_of": 1.0, "stream": false},
			[]string{"min_tokens", "max_completion_tokens"}},
		{"no output length given",
			`{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
			map[string]any{"max_tokens": 1.0, "stream": false},
			[]string{"max_completion_tokens", "n"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := shadowBody([]byte(tc.in))
			if err != nil {
				t.Fatal(err)
			}
			var got, in map[string]any
			if err := json.Unmarshal(out, &got); err != nil {
				t.Fatalf("%s: %v", out, err)
			}
			_ = json.Unmarshal([]byte(tc.in), &in)
			for k, v := range tc.want {
				if fmt.Sprint(got[k]) != fmt.Sprint(v) {
					t.Errorf("%s = %v, want %v (%s)", k, got[k], v, out)
				}
			}
			for _, k := range tc.gone {
				if _, ok := got[k]; ok {
					t.Errorf("%s kept: %s", k, out)
				}
			}
			if fmt.Sprint(got["messages"]) != fmt.Sprint(in["messages"]) || fmt.Sprint(got["prompt"]) != fmt.Sprint(in["prompt"]) {
				t.Errorf("prompt changed: %s", out)
			}
		})
	}
	for _, bad := range []string{`[1,2]`, `null`, `{"model":`, ``} {
		if _, err := shadowBody([]byte(bad)); err == nil {
			t.Errorf("%q: accepted", bad)
		}
	}
}

// counter sums a counter family's series.
func counter(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

// TestAPIShadowWarmUp: w1 holds a prompt's blocks, w2 joins. With
// --router-warmup-shadow the next request with that prompt is answered by
// w1 (the client's answer is w1's, whether or not the copy succeeds) and
// w2 gets one copy of it: max_tokens 1, not streamed; the copy is booked
// on w2, announced, and freed when it ends; a failed copy is counted and
// changes nothing for the client. Off, w2 gets nothing.
func TestAPIShadowWarmUp(t *testing.T) {
	for _, tc := range []struct {
		name   string
		on     bool
		status int
		noRoom bool // the warming worker's cache would be over 0.8 full with the copy
	}{{"off", false, 200, false}, {"copy answered", true, 200, false}, {"copy failed", true, 500, false}, {"no room for the copy", true, 200, true}} {
		t.Run(tc.name, func(t *testing.T) {
			rep := newFakeReplica("m", router.DefaultConfig())
			var hits1 atomic.Int64
			rep.addWorker("m", "w1", fakeWorker(t, &hits1).URL)
			reg := prometheus.NewRegistry()
			s := New(Config{Registry: reg, AllowLoopbackWorkers: true, WarmUpShadow: tc.on}, rep)
			body := fmt.Sprintf(chatBody, `,"stream":true,"stream_options":{"include_usage":true},"max_tokens":300`)
			if rec := do(s, "POST", "/v1/chat/completions", body); rec.Code != 200 {
				t.Fatalf("first request: %d %s", rec.Code, rec.Body)
			}
			rep.mu.Lock()
			hs := rep.booked[len(rep.booked)-1].Hashes
			rep.mu.Unlock()
			if len(hs) == 0 {
				t.Fatal("the prompt fills no block: the test proves nothing")
			}
			blocks := make([]router.StoredBlock, len(hs))
			for i, h := range hs {
				blocks[i] = router.StoredBlock{EngineHash: h, ContentHash: h}
			}
			if err := rep.index.Apply("w1", router.KVEvent{Kind: router.EventStored, Blocks: blocks}); err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var copies [][]byte
			w2 := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				b, _ := io.ReadAll(r.Body)
				mu.Lock()
				copies = append(copies, b)
				mu.Unlock()
				w.WriteHeader(tc.status)
				fmt.Fprint(w, `{"choices":[{"message":{"content":"x"}}],"usage":{"prompt_tokens":40,"completion_tokens":1}}`)
			}))
			t.Cleanup(w2.Close)
			rep.addWorker("m", "w2", w2.URL)
			if tc.noRoom {
				// Room for the copy's blocks and none to spare.
				rt, _ := rep.Router("m")
				ws := rt.Workers()
				for i := range ws {
					if ws[i].ID == "w2" {
						ws[i].TotalBlocks = len(hs)
					}
				}
				rt.SetWorkers(ws)
			}
			rec := do(s, "POST", "/v1/chat/completions", body)
			if rec.Code != 200 || rec.Header().Get("X-Worker-Id") != "w1" {
				t.Fatalf("client: %d from %q: %s", rec.Code, rec.Header().Get("X-Worker-Id"), rec.Body)
			}
			if s.shadow != nil {
				s.shadow.wg.Wait()
			}
			mu.Lock()
			defer mu.Unlock()
			if !tc.on {
				if len(copies) != 0 || s.shadow != nil {
					t.Fatalf("off: %d copies", len(copies))
				}
				return
			}
			if tc.noRoom {
				if len(copies) != 0 {
					t.Fatalf("no room: %d copies", len(copies))
				}
				return
			}
			if len(copies) != 1 {
				t.Fatalf("%d copies, want 1", len(copies))
			}
			var got map[string]any
			if err := json.Unmarshal(copies[0], &got); err != nil {
				t.Fatal(err)
			}
			if got["max_tokens"] != 1.0 || got["stream"] != false || got["stream_options"] != nil || got["messages"] == nil {
				t.Fatalf("copy body %s", copies[0])
			}
			rt, _ := rep.Router("m")
			if l := rt.Load().Load("w2"); l.ActiveBlocks != 0 || l.ActivePrefillTokens != 0 {
				t.Fatalf("the copy's booking was not freed: %+v", l)
			}
			rep.mu.Lock()
			ev := slices.Clone(rep.events)
			rep.mu.Unlock()
			var added, freed bool
			for _, e := range ev {
				added = added || (len(e) > 11 && e[:4] == "add " && e[len(e)-7:] == "/shadow")
				freed = freed || (len(e) > 12 && e[:5] == "free " && e[len(e)-7:] == "/shadow")
			}
			if !added || !freed {
				t.Fatalf("copy booking announced %v, freed %v: %v", added, freed, ev)
			}
			failures := counter(t, reg, "kvrouter_shadow_prefill_failures_total")
			if sent := counter(t, reg, "kvrouter_shadow_prefills_total"); sent != 1 || (tc.status == 200) != (failures == 0) {
				t.Fatalf("sent %v, failures %v, worker answered %d", sent, failures, tc.status)
			}
			// Once copied, the prefix is not copied again.
			mu.Unlock()
			if rec := do(s, "POST", "/v1/chat/completions", body); rec.Code != 200 {
				t.Fatalf("third request: %d", rec.Code)
			}
			s.shadow.wg.Wait()
			mu.Lock()
			if len(copies) != 1 {
				t.Fatalf("%d copies after a third request of the same prefix", len(copies))
			}
		})
	}
}

// FuzzAPIShadowBody: any body is refused or made a JSON object asking for
// one unstreamed token, with no stream_options.
func FuzzAPIShadowBody(f *testing.F) {
	for _, s := range []string{`{"model":"m","messages":[],"stream":true}`, `{"prompt":"x","max_completion_tokens":9,"n":3}`, `{}`, `[]`, `"x"`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		out, err := shadowBody(body)
		if err != nil {
			return
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal(out, &m); err != nil || m == nil {
			t.Fatalf("%q → %q: %v", body, out, err)
		}
		if string(m["max_tokens"]) != "1" || string(m["stream"]) != "false" || m["stream_options"] != nil {
			t.Fatalf("%q → %q", body, out)
		}
		if v, ok := m["max_completion_tokens"]; ok && string(v) != "1" {
			t.Fatalf("%q → %q", body, out)
		}
	})
}

// TestAPIShadowWarmUpUsesCopy: once a copy has brought the warming worker
// a prefix (its index holds it as deep as the old holder), a request of
// that prefix goes there although the policy picked the old holder; the
// copy is not left to age out unused. Without the rule the request below
// goes to w1 (w2 carries another request's load).
func TestAPIShadowWarmUpUsesCopy(t *testing.T) {
	rep, reg, s, body, stored := joiningWorkerFixture(t)
	if rec := do(s, "POST", "/v1/chat/completions", body); rec.Code != 200 || rec.Header().Get("X-Worker-Id") != "w1" {
		t.Fatalf("second request: %d from %q", rec.Code, rec.Header().Get("X-Worker-Id"))
	}
	s.shadow.wg.Wait()
	if sent := counter(t, reg, "kvrouter_shadow_prefills_total"); sent != 1 {
		t.Fatalf("%v copies sent, want 1", sent)
	}
	// The copy's KV events reach the index; another request keeps w2 busier
	// than w1 in the load view (well under the warm-up's headroom).
	if err := rep.index.Apply("w2", stored); err != nil {
		t.Fatal(err)
	}
	rt, _ := rep.Router("m")
	if _, err := rt.Route(router.Request{ID: "other", Hashes: []uint64{901, 902, 903, 904}, Tokens: 64, Exclude: []router.WorkerID{"w1"}}, time.Now()); err != nil {
		t.Fatal(err)
	}
	rec := do(s, "POST", "/v1/chat/completions", body)
	if rec.Code != 200 || rec.Header().Get("X-Worker-Id") != "w2" {
		t.Fatalf("third request: %d from %q, want w2 (the copy's worker)", rec.Code, rec.Header().Get("X-Worker-Id"))
	}
	if used := counter(t, reg, "kvrouter_warmup_copy_used_total"); used != 1 {
		t.Fatalf("kvrouter_warmup_copy_used_total %v, want 1", used)
	}
}

// TestAPIShadowWarmUpRedirectRoom: a request the policy sends the warming
// worker without its prefix goes to the holder instead only when the holder
// stays under the warm-up's headroom with it; a holder that would not
// (its KV cache nearly full of other requests' blocks) leaves it where the
// policy sent it. Without the room test the second case goes to w1.
func TestAPIShadowWarmUpRedirectRoom(t *testing.T) {
	for _, tc := range []struct {
		name        string
		holderTotal int // w1's KV blocks; 0: as registered
		want        router.WorkerID
	}{{"holder with room", 0, "w1"}, {"holder without room", -1, "w2"}} {
		t.Run(tc.name, func(t *testing.T) {
			rep, _, s, body, stored := joiningWorkerFixture(t)
			hs := make([]uint64, len(stored.Blocks))
			for i, b := range stored.Blocks {
				hs[i] = b.EngineHash
			}
			// w1 carries another request's load, so that the policy
			// prefers the empty w2 though w1 holds the prefix.
			rt, _ := rep.Router("m")
			other := make([]uint64, 40)
			for i := range other {
				other[i] = uint64(900 + i)
			}
			if _, err := rt.Route(router.Request{ID: "other", Hashes: other, Tokens: 40 * rt.Config().BlockSize, Exclude: []router.WorkerID{"w2"}}, time.Now()); err != nil {
				t.Fatal(err)
			}
			if tc.holderTotal < 0 {
				ws := rt.Workers()
				for i := range ws {
					if ws[i].ID == "w1" {
						ws[i].TotalBlocks = len(other) + 1 // the request's blocks would take it over 0.8
					}
				}
				rt.SetWorkers(ws)
			}
			d, err := rt.Route(router.Request{ID: "probe", Hashes: hs, Tokens: len(hs) * rt.Config().BlockSize}, time.Now())
			if err != nil {
				t.Fatal(err)
			}
			rt.Free("probe")
			if d.Worker != "w2" {
				t.Fatalf("the policy picked %s: the test proves nothing", d.Worker)
			}
			rec := do(s, "POST", "/v1/chat/completions", body)
			if rec.Code != 200 || router.WorkerID(rec.Header().Get("X-Worker-Id")) != tc.want {
				t.Fatalf("request: %d from %q, want %s", rec.Code, rec.Header().Get("X-Worker-Id"), tc.want)
			}
			s.shadow.wg.Wait()
		})
	}
}

// joiningWorkerFixture is the warm-up tests' start: a server with the
// shadow warm-up over one worker w1 that has served a chat request (its
// index holds the prompt's blocks), then w2 joining empty. It returns the
// request body and the stored event of its blocks (to apply to w2 when a
// copy is to reach it).
func joiningWorkerFixture(t *testing.T) (*fakeReplica, *prometheus.Registry, *Server, string, router.KVEvent) {
	t.Helper()
	rep := newFakeReplica("m", router.DefaultConfig())
	var hits1, hits2 atomic.Int64
	rep.addWorker("m", "w1", fakeWorker(t, &hits1).URL)
	reg := prometheus.NewRegistry()
	s := New(Config{Registry: reg, AllowLoopbackWorkers: true, WarmUpShadow: true}, rep)
	body := fmt.Sprintf(chatBody, `,"max_tokens":30`)
	if rec := do(s, "POST", "/v1/chat/completions", body); rec.Code != 200 {
		t.Fatalf("first request: %d %s", rec.Code, rec.Body)
	}
	rep.mu.Lock()
	hs := rep.booked[len(rep.booked)-1].Hashes
	rep.mu.Unlock()
	if len(hs) == 0 {
		t.Fatal("the prompt fills no block: the test proves nothing")
	}
	stored := router.KVEvent{Kind: router.EventStored}
	for _, h := range hs {
		stored.Blocks = append(stored.Blocks, router.StoredBlock{EngineHash: h, ContentHash: h})
	}
	if err := rep.index.Apply("w1", stored); err != nil {
		t.Fatal(err)
	}
	rep.addWorker("m", "w2", fakeWorker(t, &hits2).URL)
	return rep, reg, s, body, stored
}
