package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/router"
)

// fakeSessions is a fakeReplica that keeps session bindings in memory with
// the replicated state's rules (first commit wins; Replace moves one).
type fakeSessions struct {
	*fakeReplica
	policy SessionPolicy

	smu       sync.Mutex
	bindings  map[string]SessionBinding
	proposals int // every BindSession, TouchSession write and EndSession
	ended     []string
	// beforeBind runs inside BindSession before the commit: another
	// replica committing first.
	beforeBind func(b SessionBind)
	// bindErr, when set, decides BindSession's error (nil: commit).
	bindErr func(ctx context.Context) error
}

func newFakeSessions(rep *fakeReplica, pol SessionPolicy) *fakeSessions {
	return &fakeSessions{fakeReplica: rep, policy: pol, bindings: map[string]SessionBinding{}}
}

func (f *fakeSessions) SessionAffinity() SessionPolicy { return f.policy }
func (f *fakeSessions) SessionCount() int {
	f.smu.Lock()
	defer f.smu.Unlock()
	return len(f.bindings)
}
func (f *fakeSessions) SessionBinding(id string) (SessionBinding, bool) {
	f.smu.Lock()
	defer f.smu.Unlock()
	b, ok := f.bindings[id]
	return b, ok
}
func (f *fakeSessions) bind(b SessionBind) SessionBinding {
	f.smu.Lock()
	defer f.smu.Unlock()
	f.proposals++
	old, ok := f.bindings[b.Session]
	if b.Prefill != "" {
		// Two stages (command 21): a touch of the same pair, or a move
		// of exactly the binding seen.
		same := ok && old.Worker == b.Worker && old.Prefill == b.Prefill
		if ok && !same && (b.Replace == "" || old.Worker != b.Replace || old.Prefill != b.ReplacePrefill) {
			return old
		}
	} else if ok && old.Worker != b.Worker && old.Worker != b.Replace {
		return old
	}
	nb := SessionBinding{Session: b.Session, Worker: b.Worker, Prefill: b.Prefill, Parent: b.Parent, Until: time.Now().Add(b.TTL)}
	if ok && b.Prefill == "" && old.Worker == b.Worker {
		nb.Prefill = old.Prefill // a one-stage touch keeps the prefill stage
	}
	f.bindings[b.Session] = nb
	return nb
}
func (f *fakeSessions) BindSession(ctx context.Context, b SessionBind) (SessionBinding, error) {
	if f.beforeBind != nil {
		f.beforeBind(b)
	}
	if f.bindErr != nil {
		if err := f.bindErr(ctx); err != nil {
			return SessionBinding{}, err
		}
	}
	return f.bind(b), nil
}
func (f *fakeSessions) TouchSession(b SessionBinding, ttl time.Duration) {
	if time.Until(b.Until) < ttl/2 {
		f.bind(SessionBind{Session: b.Session, Worker: b.Worker, TTL: ttl})
	}
}
func (f *fakeSessions) EndSession(id string) {
	f.smu.Lock()
	defer f.smu.Unlock()
	f.proposals++
	f.ended = append(f.ended, id)
	delete(f.bindings, id)
}

// newSessionServer: model m with workers w1..wn, each a fake worker.
func newSessionServer(t *testing.T, n int, pol SessionPolicy) (*Server, *fakeSessions) {
	t.Helper()
	rep := newFakeReplica("m", router.DefaultConfig())
	var hits atomic.Int64
	for i := 1; i <= n; i++ {
		rep.addWorker("m", router.WorkerID(fmt.Sprintf("w%d", i)), fakeWorker(t, &hits).URL)
	}
	fs := newFakeSessions(rep, pol)
	return New(Config{Registry: prometheus.NewRegistry(), Retries: 2, AllowLoopbackWorkers: true}, fs), fs
}

func doWith(s *Server, path, body string, headers map[string]string) *httptest.ResponseRecorder {
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	s.Handler().ServeHTTP(rec, req)
	return rec
}

// TestAPISessionBadInput: malformed session input answers 400 with an
// OpenAI error naming the problem, reaches no worker and proposes nothing;
// unknown hint fields and a malformed Final header are ignored as Dynamo
// ignores them.
func TestAPISessionBadInput(t *testing.T) {
	s, fs := newSessionServer(t, 2, SessionPolicy{TTL: time.Minute})
	long := strings.Repeat("s", 257)
	chat := func(extra string) string {
		return `{"model":"m","messages":[{"role":"user","content":"hi"}]` + extra + `}`
	}
	for _, tc := range []struct {
		name    string
		path    string
		body    string
		headers map[string]string
		code    int
		msg     string
	}{
		{"oversized header id", "/v1/chat/completions", chat(""), map[string]string{"X-Dynamo-Session-ID": long}, 400, "257 bytes, limit 256"},
		{"oversized parent", "/v1/chat/completions", chat(""), map[string]string{"X-Dynamo-Session-ID": "s", "X-Dynamo-Parent-Session-ID": long}, 400, "limit 256"},
		{"oversized codex id", "/v1/completions", `{"model":"m","prompt":"x"}`, map[string]string{"session-id": long}, 400, "limit 256"},
		{"malformed header id", "/v1/chat/completions", chat(""), map[string]string{"x-session-id": "a\xffb"}, 400, "not valid UTF-8"},
		{"prompt_cache_key not a string", "/v1/chat/completions", chat(`,"prompt_cache_key":{"a":1}`), nil, 400, "prompt_cache_key must be a string"},
		{"oversized prompt_cache_key", "/v1/responses", `{"model":"m","input":"hi","prompt_cache_key":"` + long + `"}`, nil, 400, "limit 256"},
		{"control character", "/v1/completions", `{"model":"m","prompt":"x","prompt_cache_key":"a\u0000b"}`, nil, 400, "control character"},
		{"negative session TTL", "/v1/chat/completions", chat(`,"nvext":{"session_control":{"session_id":"s","action":"open","timeout":-1}}`), nil, 400, "nvext.session_control"},
		{"unknown action", "/v1/chat/completions", chat(`,"nvext":{"session_control":{"session_id":"s","action":"pause"}}`), nil, 400, "must be open or close"},
		{"session_control without id", "/v1/chat/completions", chat(`,"nvext":{"session_control":{"action":"open"}}`), nil, 400, "session_id is required"},
		{"unknown hint fields are ignored", "/v1/chat/completions", chat(`,"nvext":{"agent_hints":{"priority":0,"latency_class":"x"},"session_control":{"session_id":"ok-1","future_field":true}}`), nil, 200, ""},
		{"malformed final is ignored", "/v1/chat/completions", chat(""), map[string]string{"X-Dynamo-Session-ID": "ok-2", "X-Dynamo-Session-Final": "maybe"}, 200, ""},
	} {
		before := fs.proposals
		rec := doWith(s, tc.path, tc.body, tc.headers)
		if rec.Code != tc.code {
			t.Errorf("%s: %d %s", tc.name, rec.Code, rec.Body)
			continue
		}
		if tc.code != 400 {
			continue
		}
		var e struct {
			Error struct {
				Message, Type string
			} `json:"error"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || e.Error.Type != "invalid_request_error" || !strings.Contains(e.Error.Message, tc.msg) {
			t.Errorf("%s: body %s, want a message with %q", tc.name, rec.Body, tc.msg)
		}
		if fs.proposals != before || rec.Header().Get("X-Worker-Id") != "" {
			t.Errorf("%s: a refused request proposed %d writes or reached %q", tc.name, fs.proposals-before, rec.Header().Get("X-Worker-Id"))
		}
	}
	if n := fs.SessionCount(); n != 2 {
		t.Errorf("%d bindings, want the two accepted sessions", n)
	}
}

// TestAPISessionTurns: a session's turns (header, prompt_cache_key, the
// coding agents' headers) all go to the worker its first turn bound, even
// once another worker is cheaper; the final turn ends the binding.
func TestAPISessionTurns(t *testing.T) {
	s, fs := newSessionServer(t, 4, SessionPolicy{TTL: time.Minute})
	for _, tc := range []struct {
		name    string
		path    string
		body    string
		headers map[string]string
	}{
		{"dynamo header", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"turn %d"}]}`, map[string]string{"X-Dynamo-Session-ID": "dyn-1"}},
		{"prompt_cache_key chat", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"turn %d"}],"prompt_cache_key":"pck-1"}`, nil},
		{"prompt_cache_key completions", "/v1/completions", `{"model":"m","prompt":"turn %d","prompt_cache_key":"pck-2"}`, nil},
		{"prompt_cache_key responses", "/v1/responses", `{"model":"m","input":"turn %d","prompt_cache_key":"pck-3"}`, nil},
		{"claude code", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"turn %d"}]}`, map[string]string{"x-claude-code-session-id": "cc-1"}},
		{"opencode", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"turn %d"}]}`, map[string]string{"x-session-id": "oc-1"}},
	} {
		first := ""
		for turn := range 8 {
			rec := doWith(s, tc.path, fmt.Sprintf(tc.body, turn), tc.headers)
			w := rec.Header().Get("X-Worker-Id")
			if rec.Code != 200 || w == "" {
				t.Fatalf("%s turn %d: %d %s", tc.name, turn, rec.Code, rec.Body)
			}
			if turn == 0 {
				first = w
				// Make the bound worker the costliest: unbound, the next
				// turns would go elsewhere.
				rt, _ := fs.Router("m")
				rt.Load().Add(router.Booking{ID: "heavy-" + tc.name, Worker: router.WorkerID(w), PrefillTokens: 200000, Added: time.Now()})
				defer rt.Free("heavy-" + tc.name)
			} else if w != first {
				t.Errorf("%s: turn %d went to %s, the session is bound to %s", tc.name, turn, w, first)
			}
		}
	}
	proposals := fs.proposals
	// Bound turns write nothing (no refresh before half the TTL is gone).
	doWith(s, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"x"}]}`, map[string]string{"X-Dynamo-Session-ID": "dyn-1"})
	if fs.proposals != proposals {
		t.Errorf("a bound turn proposed %d writes", fs.proposals-proposals)
	}
	if got := readCounter(s.sessMetrics.binds); got != 6 {
		t.Errorf("binds %v, want 6", got)
	}
	rec := doWith(s, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"bye"}]}`,
		map[string]string{"X-Dynamo-Session-ID": "dyn-1", "X-Dynamo-Session-Final": "true"})
	if _, ok := fs.SessionBinding("dyn-1"); rec.Code != 200 || ok || len(fs.ended) != 1 {
		t.Fatalf("final turn: %d, still bound %v, ended %v", rec.Code, ok, fs.ended)
	}
}

// TestAPISessionFollowsTheFirstCommit: two replicas' first turns race;
// the one whose binding lost follows the committed one (its turn goes to
// the winner's worker) instead of splitting the session.
func TestAPISessionFollowsTheFirstCommit(t *testing.T) {
	s, fs := newSessionServer(t, 3, SessionPolicy{TTL: time.Minute})
	fs.beforeBind = func(b SessionBind) {
		other := router.WorkerID("w1")
		if b.Worker == "w1" {
			other = "w2"
		}
		fs.bind(SessionBind{Session: b.Session, Worker: other, TTL: time.Minute}) // the other replica's commit
	}
	rec := doWith(s, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, map[string]string{"X-Dynamo-Session-ID": "race"})
	b, ok := fs.SessionBinding("race")
	if rec.Code != 200 || !ok || rec.Header().Get("X-Worker-Id") != string(b.Worker) {
		t.Fatalf("%d: answered by %q, bound to %+v", rec.Code, rec.Header().Get("X-Worker-Id"), b)
	}
	if got := readCounter(s.sessMetrics.turns.WithLabelValues("follow")); got != 1 {
		t.Errorf("follows %v", got)
	}
	rt, _ := fs.Router("m")
	if n := rt.Load().Len(); n != 0 {
		t.Errorf("%d bookings left: the lost decision's booking was not freed", n)
	}
}

// TestAPISessionRebindsToMostPrefix: a session bound to a worker that is
// gone is rebound to the worker holding most of this turn's prefix, not a
// random one; a subagent's first turn goes to its parent's worker.
func TestAPISessionRebindsToMostPrefix(t *testing.T) {
	s, fs := newSessionServer(t, 4, SessionPolicy{TTL: time.Minute})
	prompt := strings.Repeat(longPrompt, 4)
	tokens := tokenize.Builtin().EncodeSpecial(prompt)
	bs := router.DefaultConfig().BlockSize
	storeBlocks(t, fs.fakeReplica, "w3", tokens, bs, "", "")
	storeBlocks(t, fs.fakeReplica, "w2", tokens[:2*bs], bs, "", "")
	// w3 is the most loaded: the cost function alone would go elsewhere.
	rt, _ := fs.Router("m")
	rt.Load().Add(router.Booking{ID: "heavy", Worker: "w3", PrefillTokens: 200000, Added: time.Now()})
	fs.bind(SessionBind{Session: "lost", Worker: "dead-worker", TTL: time.Minute})
	rec := doWith(s, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":%q}`, prompt), map[string]string{"X-Dynamo-Session-ID": "lost"})
	if b, _ := fs.SessionBinding("lost"); rec.Code != 200 || rec.Header().Get("X-Worker-Id") != "w3" || b.Worker != "w3" {
		t.Fatalf("%d: answered by %q, bound to %+v", rec.Code, rec.Header().Get("X-Worker-Id"), b)
	}
	if got := readCounter(s.sessMetrics.rebinds.WithLabelValues("worker_gone")); got != 1 {
		t.Errorf("rebinds %v", got)
	}
	fs.bind(SessionBind{Session: "parent", Worker: "w4", TTL: time.Minute})
	rec = doWith(s, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"sub"}]}`,
		map[string]string{"X-Dynamo-Session-ID": "child", "X-Dynamo-Parent-Session-ID": "parent"})
	if b, _ := fs.SessionBinding("child"); rec.Header().Get("X-Worker-Id") != "w4" || b.Parent != "parent" {
		t.Fatalf("subagent went to %q, bound %+v", rec.Header().Get("X-Worker-Id"), b)
	}
}

// TestAPISessionAdmin: GET /sessions/{id} shows one binding (ids with a
// slash too), 404 for an unbound one, 400 for a malformed id.
func TestAPISessionAdmin(t *testing.T) {
	s, fs := newSessionServer(t, 1, SessionPolicy{TTL: 5 * time.Minute, Soft: true})
	fs.bind(SessionBind{Session: "claude/9f3c", Worker: "w1", Parent: "root", TTL: time.Minute})
	rec := do(s, "GET", "/sessions/claude/9f3c", "")
	var got map[string]any
	if err := json.Unmarshal(rec.Body.Bytes(), &got); rec.Code != 200 || err != nil || got["worker"] != "w1" || got["parent"] != "root" || got["mode"] != "soft" || got["ttl_seconds"] != 300.0 {
		t.Fatalf("%d %s", rec.Code, rec.Body)
	}
	if rec := do(s, "GET", "/sessions/nobody", ""); rec.Code != 404 {
		t.Errorf("unbound: %d %s", rec.Code, rec.Body)
	}
	if rec := do(s, "GET", "/sessions/"+strings.Repeat("x", 300), ""); rec.Code != 400 {
		t.Errorf("oversized: %d %s", rec.Code, rec.Body)
	}
}

// TestAPISessionOff: without a TTL session input is not read at all (as
// Dynamo: passive metadata): nothing bound, a malformed id not refused.
func TestAPISessionOff(t *testing.T) {
	s, fs := newSessionServer(t, 2, SessionPolicy{})
	rec := doWith(s, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
		map[string]string{"X-Dynamo-Session-ID": strings.Repeat("s", 300)})
	if rec.Code != 200 || fs.proposals != 0 || fs.SessionCount() != 0 {
		t.Fatalf("%d, %d proposals", rec.Code, fs.proposals)
	}
}

// TestAPISessionMissNeedsAClient: a first turn whose binding cannot be
// committed is served unbound and counted as a miss, but not when its
// client left while the bind waited (HAProxy cuts the connections of a
// replica that lost its leader, so every election produced such "misses":
// chaos AF1): that turn is answered 499, nothing counted as a miss.
func TestAPISessionMissNeedsAClient(t *testing.T) {
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	cases := []struct {
		name       string
		clientGone bool
		wantCode   int
		wantMisses float64
	}{
		{"no leader, client waiting", false, http.StatusOK, 1},
		{"no leader, client gone", true, 499, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, fs := newSessionServer(t, 2, SessionPolicy{TTL: time.Minute})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			fs.bindErr = func(bctx context.Context) error {
				if tc.clientGone {
					cancel() // the connection cut while the bind waited for a leader
					<-bctx.Done()
					return fmt.Errorf("bind session: %w (last: cluster: no leader)", bctx.Err())
				}
				return errors.New("bind session: context deadline exceeded (last: cluster: no leader)")
			}
			rec := httptest.NewRecorder()
			req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body)).WithContext(ctx)
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("X-Dynamo-Session-ID", "s1")
			s.Handler().ServeHTTP(rec, req)
			if rec.Code != tc.wantCode {
				t.Errorf("status %d, want %d: %s", rec.Code, tc.wantCode, rec.Body)
			}
			if got := readCounter(s.sessMetrics.misses.WithLabelValues("unavailable")); got != tc.wantMisses {
				t.Errorf("misses{unavailable} %v, want %v", got, tc.wantMisses)
			}
			if got := readCounter(s.sessMetrics.turns.WithLabelValues("miss")); got != tc.wantMisses {
				t.Errorf("turns{miss} %v, want %v", got, tc.wantMisses)
			}
			if fs.SessionCount() != 0 {
				t.Errorf("%d bindings, want none", fs.SessionCount())
			}
		})
	}
}

func readCounter(c prometheus.Counter) float64 {
	var m dto.Metric
	_ = c.Write(&m)
	return m.GetCounter().GetValue()
}

// TestAPISessionModes: the bound worker is busy. Hard mode keeps the
// session there: the turn gets the router's busy answer and the binding
// stays. Soft mode serves the turn elsewhere and rebinds the session.
func TestAPISessionModes(t *testing.T) {
	for _, soft := range []bool{false, true} {
		cfg := router.DefaultConfig()
		cfg.Thresholds.ActivePrefillTokens = ptr(int64(100000))
		rep := newFakeReplica("m", cfg)
		var hits atomic.Int64
		for _, id := range []router.WorkerID{"w1", "w2"} {
			rep.addWorker("m", id, fakeWorker(t, &hits).URL)
		}
		fs := newFakeSessions(rep, SessionPolicy{TTL: time.Minute, Soft: soft})
		s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true}, fs)
		fs.bind(SessionBind{Session: "s", Worker: "w1", TTL: time.Minute})
		rt, _ := fs.Router("m")
		rt.Load().Add(router.Booking{ID: "heavy", Worker: "w1", PrefillTokens: 200000, Added: time.Now()}) // w1 busy
		rec := doWith(s, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, map[string]string{"X-Dynamo-Session-ID": "s"})
		b, _ := fs.SessionBinding("s")
		switch {
		case !soft && (rec.Code != 529 || b.Worker != "w1" || hits.Load() != 0):
			t.Errorf("hard: %d %s, bound to %s, %d worker hits", rec.Code, rec.Body, b.Worker, hits.Load())
		case soft && (rec.Code != 200 || rec.Header().Get("X-Worker-Id") != "w2" || b.Worker != "w2" || readCounter(s.sessMetrics.rebinds.WithLabelValues("busy")) != 1):
			t.Errorf("soft: %d answered by %q, bound to %s", rec.Code, rec.Header().Get("X-Worker-Id"), b.Worker)
		}
	}
}
