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
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/router"
)

// fakeDrains is a fakeSessions that reports drains (api.DrainWatcher):
// drain drops the worker from the model's candidates, as the replica's
// refresh does, then tells the listeners.
type fakeDrains struct {
	*fakeSessions
	fns []func(string)
}

func (f *fakeDrains) OnWorkerDrained(fn func(string)) { f.fns = append(f.fns, fn) }

func (f *fakeDrains) drain(model string, w router.WorkerID) {
	rt := f.routers[model]
	rt.SetWorkers(slices.DeleteFunc(rt.Workers(), func(i router.WorkerInfo) bool { return i.ID == w }))
	for _, fn := range f.fns {
		fn(string(w))
	}
}

// seenRequest is one request a recording worker received.
type seenRequest struct {
	at   time.Time
	body map[string]any
}

// recordingWorker answers completions with status (200 unless set) and
// records every request; before, when set, runs first.
type recordingWorker struct {
	mu     sync.Mutex
	seen   []seenRequest
	status atomic.Int32
	before func()
}

func (rw *recordingWorker) start(t *testing.T) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		var m map[string]any
		_ = json.Unmarshal(b, &m)
		rw.mu.Lock()
		rw.seen = append(rw.seen, seenRequest{at: time.Now(), body: m})
		before := rw.before
		rw.mu.Unlock()
		if before != nil {
			before()
		}
		if st := int(rw.status.Load()); st != 0 && st != 200 {
			http.Error(w, "no", st)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"choices":[{"text":"x"}],"usage":{"prompt_tokens":8,"completion_tokens":1}}`)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

func (rw *recordingWorker) requests() []seenRequest {
	rw.mu.Lock()
	defer rw.mu.Unlock()
	return slices.Clone(rw.seen)
}

// drainServer: model m, workers w1..w3 (recording), session affinity on,
// --router-drain-shadow as on says.
func drainServer(t *testing.T, on bool, maxBytes int64) (*Server, *fakeDrains, []*recordingWorker, *prometheus.Registry) {
	t.Helper()
	rep := newFakeReplica("m", router.DefaultConfig())
	var ws []*recordingWorker
	for i := 1; i <= 3; i++ {
		rw := &recordingWorker{}
		rep.addWorker("m", router.WorkerID(fmt.Sprintf("w%d", i)), rw.start(t))
		ws = append(ws, rw)
	}
	fd := &fakeDrains{fakeSessions: newFakeSessions(rep, SessionPolicy{TTL: time.Minute})}
	reg := prometheus.NewRegistry()
	s := New(Config{Registry: reg, AllowLoopbackWorkers: true, DrainShadow: on, SessionBodiesMaxBytes: maxBytes}, fd)
	return s, fd, ws, reg
}

// TestAPIDrainShadowKeepsBodies: with --router-drain-shadow a replica keeps
// the last body of each session it served bound (not of requests without a
// session, not of a session's final turn, which drops the one kept), the
// total bounded by bytes with the least recently kept dropped first, a
// body over the bound never kept, and an expired session's body dropped;
// each drop counted by reason. Off, nothing is kept.
func TestAPIDrainShadowKeepsBodies(t *testing.T) {
	s, fd, _, reg := drainServer(t, true, 0)
	bodies := s.drainCopies.bodies
	turn := func(session, prompt string, final bool) {
		t.Helper()
		h := map[string]string{}
		if session != "" {
			h["X-Dynamo-Session-ID"] = session
		}
		if final {
			h["X-Dynamo-Session-Final"] = "true"
		}
		if rec := doWith(s, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":%q}`, prompt), h); rec.Code != 200 {
			t.Fatalf("%s: %d %s", session, rec.Code, rec.Body)
		}
	}
	kept := func() map[string]string {
		bodies.mu.Lock()
		defer bodies.mu.Unlock()
		out := map[string]string{}
		for el := bodies.lru.Front(); el != nil; el = el.Next() {
			e := el.Value.(*keptBody)
			out[e.session] = string(e.body)
		}
		return out
	}
	turn("", "no session", false)
	turn("a", "a first", false)
	turn("a", "a second", false)
	turn("b", "b first", false)
	got := kept()
	if len(got) != 2 || !strings.Contains(got["a"], "a second") || !strings.Contains(got["b"], "b first") {
		t.Fatalf("kept %v", got)
	}
	turn("b", "b last", true)
	if got := kept(); len(got) != 1 || got["b"] != "" {
		t.Fatalf("after b's final turn: %v", got)
	}
	if n := counter(t, reg, "kvrouter_session_bodies_dropped_total"); n != 1 {
		t.Errorf("drops %v, want 1 (b ended)", n)
	}

	// The bound, directly: each body costs its bytes, 8 per hash and the
	// overhead.
	small := newSessionBodies(3*(100+keptBodyOverhead+1), func(id string) bool { _, ok := fd.SessionBinding(id); return ok }, prometheus.NewRegistry())
	for _, id := range []string{"x", "y", "z"} {
		fd.bind(SessionBind{Session: id, Worker: "w1", TTL: time.Minute})
	}
	body := func(id string, n int) *keptBody {
		return &keptBody{session: id, body: []byte(strings.Repeat("b", n))}
	}
	small.keep(body("x", 100))
	small.keep(body("y", 100))
	small.keep(body("x", 100)) // x again: now the most recent
	small.keep(body("z", 100))
	if small.lru.Len() != 3 || small.bytes != 3*(101+keptBodyOverhead) {
		t.Fatalf("%d bodies, %d bytes", small.lru.Len(), small.bytes)
	}
	fd.bind(SessionBind{Session: "w", Worker: "w1", TTL: time.Minute})
	small.keep(body("w", 100)) // over the bound: y, the least recent, goes
	if _, ok := small.byID["y"]; ok || small.lru.Len() != 3 {
		t.Errorf("y kept past the bound: %d bodies", small.lru.Len())
	}
	small.keep(body("huge", 10_000))
	if _, ok := small.byID["huge"]; ok {
		t.Error("a body over the bound was kept")
	}
	fd.EndSession("x") // expired, say: the next keep looks at the oldest (x)
	small.keep(body("z", 50))
	if _, ok := small.byID["x"]; ok {
		t.Error("an unbound session's body stayed")
	}
	for reason, want := range map[string]float64{"evicted": 1, "too_large": 1, "unbound": 1} {
		if got := readCounter(small.dropped.WithLabelValues(reason)); got != want {
			t.Errorf("dropped{%s} = %v, want %v", reason, got, want)
		}
	}

	off, _, _, _ := drainServer(t, false, 0)
	if off.drainCopies != nil {
		t.Fatal("drain copies on without the flag")
	}
}

// TestAPIDrainShadowMovesSessions: session s is bound to w1; w3 holds its
// prompt's blocks, w2 none. When w1's drain commits, the replica sends w3
// a copy of s's last body (max_tokens 1, not streamed, the prompt as
// sent), booked on w3 and freed, and once it answers rebinds s to w3
// (Replace w1): s's next turn is answered by w3. w1 receives nothing after
// the drain. A failed copy rebinds nothing (the next turn then rebinds to
// the holder of most of its prefix, as a plain drain does); a copy whose
// session moved meanwhile (its next turn came first) changes nothing.
func TestAPIDrainShadowMovesSessions(t *testing.T) {
	for _, tc := range []struct {
		name          string
		status        int32
		nextTurnFirst bool
		wantBound     router.WorkerID
		moved, failed float64
	}{
		{"copy answered", 200, false, "w3", 1, 0},
		{"copy failed", 500, false, "w1", 0, 1},
		{"next turn first", 200, true, "w2", 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, fd, ws, reg := drainServer(t, true, 0)
			prompt := strings.Repeat(longPrompt, 4)
			tokens := tokenize.Builtin().EncodeSpecial(prompt)
			storeBlocks(t, fd.fakeReplica, "w3", tokens, router.DefaultConfig().BlockSize, "", "")
			fd.bind(SessionBind{Session: "s", Worker: "w1", TTL: time.Minute})
			before := fd.SessionBinding
			body := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":200,"stream":true}`, prompt)
			sess := map[string]string{"X-Dynamo-Session-ID": "s"}
			if rec := doWith(s, "/v1/completions", body, sess); rec.Code != 200 || rec.Header().Get("X-Worker-Id") != "w1" {
				t.Fatalf("bound turn: %d on %q", rec.Code, rec.Header().Get("X-Worker-Id"))
			}
			ws[2].status.Store(tc.status)
			if tc.nextTurnFirst {
				ws[2].before = func() { fd.bind(SessionBind{Session: "s", Worker: "w2", Replace: "w1", TTL: time.Minute}) }
			}
			drainedAt := time.Now()
			fd.drain("m", "w1")
			s.drainCopies.wg.Wait()

			copies := ws[2].requests()
			if len(copies) != 1 {
				t.Fatalf("w3 got %d requests, want one copy", len(copies))
			}
			c := copies[0].body
			if c["prompt"] != prompt || c["max_tokens"] != 1.0 || c["stream"] != false {
				t.Errorf("copy %v", c)
			}
			for _, r := range ws[0].requests() {
				if r.at.After(drainedAt) {
					t.Errorf("w1 got a request after its drain: %v", r.body)
				}
			}
			if len(ws[1].requests()) != 0 {
				t.Errorf("w2 got %d requests", len(ws[1].requests()))
			}
			fd.mu.Lock()
			var copyID string
			for _, b := range fd.booked {
				if strings.HasSuffix(b.ID, "/shadow") {
					copyID = b.ID
					if b.Worker != "w3" {
						t.Errorf("copy booked on %s", b.Worker)
					}
				}
			}
			events := slices.Clone(fd.events)
			fd.mu.Unlock()
			if copyID == "" || !slices.Contains(events, "free "+copyID) {
				t.Errorf("copy %q not booked and freed: %v", copyID, events)
			}
			if b, _ := before("s"); b.Worker != tc.wantBound {
				t.Errorf("bound to %s, want %s", b.Worker, tc.wantBound)
			}
			for name, want := range map[string]float64{"kvrouter_drain_copies_total": 1, "kvrouter_drain_copy_failures_total": tc.failed,
				"kvrouter_drain_sessions_moved_total": tc.moved} {
				if got := counter(t, reg, name); got != want {
					t.Errorf("%s = %v, want %v", name, got, want)
				}
			}
			if got := readCounter(s.sessMetrics.rebinds.WithLabelValues("drain_copy")); got != tc.moved {
				t.Errorf("rebinds{drain_copy} = %v", got)
			}

			// The next turn: on the copy's worker when the copy moved the
			// session; else rebound as a plain drain rebinds (w3 holds
			// most of the prefix) or where the session went meanwhile.
			ws[2].status.Store(200)
			ws[2].before = nil
			want := "w3"
			if tc.nextTurnFirst {
				want = "w2"
			}
			if rec := doWith(s, "/v1/completions", body, sess); rec.Code != 200 || rec.Header().Get("X-Worker-Id") != want {
				t.Fatalf("next turn: %d on %q, want %s", rec.Code, rec.Header().Get("X-Worker-Id"), want)
			}
			for _, r := range ws[0].requests() {
				if r.at.After(drainedAt) {
					t.Errorf("w1 got a request after its drain: %v", r.body)
				}
			}
		})
	}
}

// TestAPIDrainShadowOnlyBoundThere: a drain copies only the sessions bound
// to the drained worker; the others' bodies stay kept and nothing is sent
// for them; without session affinity the flag is off.
func TestAPIDrainShadowOnlyBoundThere(t *testing.T) {
	s, fd, ws, reg := drainServer(t, true, 0)
	fd.bind(SessionBind{Session: "on-w1", Worker: "w1", TTL: time.Minute})
	fd.bind(SessionBind{Session: "on-w2", Worker: "w2", TTL: time.Minute})
	for _, id := range []string{"on-w1", "on-w2"} {
		if rec := doWith(s, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"%s %s"}`, id, longPrompt), map[string]string{"X-Dynamo-Session-ID": id}); rec.Code != 200 {
			t.Fatalf("%s: %d", id, rec.Code)
		}
	}
	fd.drain("m", "w1")
	s.drainCopies.wg.Wait()
	if n := counter(t, reg, "kvrouter_drain_copies_total"); n != 1 {
		t.Errorf("%v copies, want 1", n)
	}
	if b, _ := fd.SessionBinding("on-w2"); b.Worker != "w2" || len(ws[1].requests())+len(ws[2].requests()) != 2 {
		t.Errorf("on-w2 bound to %s; w2 %d requests, w3 %d", b.Worker, len(ws[1].requests()), len(ws[2].requests()))
	}
	if _, ok := s.drainCopies.bodies.byID["on-w2"]; !ok {
		t.Error("on-w2's body dropped")
	}

	rep := newFakeReplica("m", router.DefaultConfig())
	noAffinity := &fakeDrains{fakeSessions: newFakeSessions(rep, SessionPolicy{})}
	if New(Config{Registry: prometheus.NewRegistry(), DrainShadow: true}, noAffinity).drainCopies != nil || len(noAffinity.fns) != 0 {
		t.Error("drain copies on without session affinity")
	}
}

// TestAPIDrainShadowCopyTarget: a copy goes to the worker with the most
// cached blocks among those not busy; a tie is broken by the session's
// rendezvous hash alone — the same worker whatever the rows' order and
// costs (replicas copying one session agree), and different sessions
// spread over the tied workers.
func TestAPIDrainShadowCopyTarget(t *testing.T) {
	rows := []router.WorkerCost{{Worker: "a", Overlap: 2, Cost: 1}, {Worker: "b", Overlap: 5, Cost: 9}, {Worker: "c", Overlap: 7, Busy: true}}
	if w, ok := copyTarget(rows, "s"); !ok || w != "b" {
		t.Fatalf("most prefix: %q %v", w, ok)
	}
	if _, ok := copyTarget([]router.WorkerCost{{Worker: "a", Busy: true}}, "s"); ok {
		t.Fatal("a busy worker chosen")
	}
	tied := []router.WorkerCost{{Worker: "w1", Overlap: 3, Cost: 1}, {Worker: "w2", Overlap: 3, Cost: 2}, {Worker: "w3", Overlap: 3, Cost: 3}, {Worker: "w4", Overlap: 1}}
	chosen := map[router.WorkerID]int{}
	for i := range 60 {
		session := fmt.Sprintf("session-%d", i)
		w, _ := copyTarget(tied, session)
		for k := range 5 { // other orders and costs: another replica's view
			other := slices.Clone(tied)
			for j := range other {
				other[j].Cost = float64((j*7 + k*3) % 5)
			}
			rotated := append(other[k%len(other):], other[:k%len(other)]...)
			if w2, _ := copyTarget(rotated, session); w2 != w {
				t.Fatalf("%s: %s in one view, %s in another", session, w, w2)
			}
		}
		chosen[w]++
	}
	if chosen["w4"] != 0 || len(chosen) != 3 {
		t.Errorf("tied sessions went to %v", chosen)
	}
}

// TestAPIDrainShadowCopyDelay: the newest of a session's turns waits
// least, whatever the ages (two turns a fixed gap apart stay ordered, the
// gap in waiting shrinking only as their ages' ratio does), and no turn
// waits past the bound.
func TestAPIDrainShadowCopyDelay(t *testing.T) {
	cases := []struct {
		newer, older time.Duration
		minGap       time.Duration // the older turn waits at least this much longer
	}{
		{0, 5 * time.Millisecond, 100 * time.Millisecond},
		{100 * time.Millisecond, 400 * time.Millisecond, 200 * time.Millisecond},
		{time.Second, 2 * time.Second, 150 * time.Millisecond},
		{5 * time.Second, 30 * time.Second, 400 * time.Millisecond},
		{30 * time.Second, 40 * time.Second, 50 * time.Millisecond},
	}
	for _, c := range cases {
		dn, do := copyDelay(c.newer), copyDelay(c.older)
		if do-dn < c.minGap {
			t.Errorf("ages %v and %v wait %v and %v: the older should wait at least %v longer", c.newer, c.older, dn, do, c.minGap)
		}
	}
	if d := copyDelay(0); d != 0 {
		t.Errorf("a turn routed just now waits %v", d)
	}
	if d := copyDelay(-time.Second); d != 0 {
		t.Errorf("a turn from the future (another clock) waits %v", d)
	}
	for _, age := range []time.Duration{time.Hour, 1000 * time.Hour} {
		if d := copyDelay(age); d != copyDelayMax {
			t.Errorf("age %v waits %v, want the bound %v", age, d, copyDelayMax)
		}
	}
}

// BenchmarkAPIKeepSessionBody is what --router-drain-shadow adds to a
// bound turn: keeping its body (the LRU under its lock, one binding read
// of the oldest body), at 10,000 sessions held.
func BenchmarkAPIKeepSessionBody(b *testing.B) {
	body := []byte(strings.Repeat("x", 16<<10))
	hashes := make([]uint64, 512)
	bodies := newSessionBodies(1<<40, func(string) bool { return true }, prometheus.NewRegistry())
	ids := make([]string, 10_000)
	for i := range ids {
		ids[i] = fmt.Sprintf("session-%05d", i)
		bodies.keep(&keptBody{session: ids[i], model: "m", path: "/v1/chat/completions", body: body, hashes: hashes})
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		bodies.keep(&keptBody{session: ids[i%len(ids)], model: "m", path: "/v1/chat/completions", body: body, hashes: hashes})
	}
}

// TestAPIDrainShadowLoRA: a session of a LoRA adapter is copied only to a
// worker serving the adapter, even when another holds more of its prefix.
func TestAPIDrainShadowLoRA(t *testing.T) {
	s, fd, ws, _ := drainServer(t, true, 0)
	fd.adapters = map[string]fakeAdapter{"ad": {base: "m", workers: []router.WorkerID{"w1", "w2"}}}
	prompt := strings.Repeat(longPrompt, 4)
	tokens := tokenize.Builtin().EncodeSpecial(prompt)
	storeBlocks(t, fd.fakeReplica, "w3", tokens, router.DefaultConfig().BlockSize, "ad", "")
	fd.bind(SessionBind{Session: "s", Worker: "w1", TTL: time.Minute})
	if rec := doWith(s, "/v1/completions", fmt.Sprintf(`{"model":"ad","prompt":%q}`, prompt), map[string]string{"X-Dynamo-Session-ID": "s"}); rec.Code != 200 || rec.Header().Get("X-Worker-Id") != "w1" {
		t.Fatalf("bound turn: %d on %q", rec.Code, rec.Header().Get("X-Worker-Id"))
	}
	fd.drain("m", "w1")
	s.drainCopies.wg.Wait()
	if n2, n3 := len(ws[1].requests()), len(ws[2].requests()); n2 != 1 || n3 != 0 {
		t.Fatalf("copies: w2 %d, w3 %d (w3 does not serve the adapter)", n2, n3)
	}
	if b, _ := fd.SessionBinding("s"); b.Worker != "w2" {
		t.Errorf("bound to %s", b.Worker)
	}
}
