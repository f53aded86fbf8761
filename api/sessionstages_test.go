package api

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/router"
)

// stagedFleet is model "m"'s two-stage router over fake vLLM workers:
// prefill workers p1, p2, decode workers d1, d2.
type stagedFleet struct {
	dr      *router.DisaggRouter
	workers map[router.WorkerID]*pdWorker
	roles   []router.RoleWorker
}

func newStagedFleet(t *testing.T, rep *fakeReplica) *stagedFleet {
	t.Helper()
	dr, err := router.NewDisaggRouter(router.DefaultConfig(), rep.index, testDisaggConfig(router.DisaggAlways), 1)
	if err != nil {
		t.Fatal(err)
	}
	f := &stagedFleet{dr: dr, workers: map[router.WorkerID]*pdWorker{}}
	for _, w := range []struct {
		id   router.WorkerID
		role router.Role
	}{{"p1", router.RolePrefill}, {"p2", router.RolePrefill}, {"d1", router.RoleDecode}, {"d2", router.RoleDecode}} {
		pw := newPDWorker(t, string(w.id))
		f.workers[w.id] = pw
		rep.urls[w.id] = pw.srv.URL
		rep.index.AddWorker(w.id)
		f.roles = append(f.roles, router.RoleWorker{WorkerInfo: router.WorkerInfo{ID: w.id, TotalBlocks: 1000, MaxBatchedTokens: 8192}, Role: w.role})
		if w.role == router.RoleDecode {
			rep.addWorker("m", w.id, pw.srv.URL)
		}
	}
	dr.SetWorkers(f.roles)
	return f
}

func (f *stagedFleet) Disagg(model string) (*router.DisaggRouter, bool) {
	return f.dr, model == "m"
}

// remove takes a worker out of the two-stage router (deregistered,
// drained, dead).
func (f *stagedFleet) remove(w router.WorkerID) {
	var ws []router.RoleWorker
	for _, r := range f.roles {
		if r.ID != w {
			ws = append(ws, r)
		}
	}
	f.roles = ws
	f.dr.SetWorkers(ws)
}

// stagedSessions is a fake replica with session bindings and a two-stage
// router for model "m".
type stagedSessions struct {
	*fakeSessions
	*stagedFleet
}

func newStagedSessionServer(t *testing.T, pol SessionPolicy) (*Server, *stagedSessions) {
	t.Helper()
	rep := newFakeReplica("m", router.DefaultConfig())
	f := &stagedSessions{fakeSessions: newFakeSessions(rep, pol), stagedFleet: newStagedFleet(t, rep)}
	return New(Config{Registry: prometheus.NewRegistry(), Retries: 1, AllowLoopbackWorkers: true}, f), f
}

// served is the prefill and decode worker each worker's last request shows:
// the worker that got a prefill body, the worker that answered.
func (f *stagedFleet) counts() map[router.WorkerID]int {
	out := map[router.WorkerID]int{}
	for id, w := range f.workers {
		out[id] = len(w.bodies())
	}
	return out
}

// lastStages is the workers a turn reached, from the request counts
// before and after it.
func lastStages(before, after map[router.WorkerID]int) (prefill, decode router.WorkerID) {
	for id, n := range after {
		if n > before[id] {
			if strings.HasPrefix(string(id), "p") {
				prefill = id
			} else {
				decode = id
			}
		}
	}
	return prefill, decode
}

// TestAPISessionStages: a session's turns on a two-stage model follow one
// binding of both stages; a one-stage binding gains a prefill stage; a
// stage's worker gone moves that stage to the worker holding most of the
// prompt's prefix and keeps the other; another replica's binding committed
// first is followed; a final turn ends it.
func TestAPISessionStages(t *testing.T) {
	prompt := strings.Repeat(longPrompt, 4)
	body := fmt.Sprintf(`{"model":"m","max_tokens":5,"prompt":%q}`, prompt)
	tokens := tokenize.Builtin().EncodeSpecial(prompt)
	bs := router.DefaultConfig().BlockSize
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, f *stagedSessions)
		// what the turn did
		prefill, decode router.WorkerID
		bound           SessionBinding // Prefill and Worker of the binding after
		outcome         string
		aggregated      bool // the next turn is served aggregated too (no prefill stage runs)
	}{
		{name: "first turn binds both stages by cost", setup: func(t *testing.T, f *stagedSessions) {
			storeBlocks(t, f.fakeReplica, "p2", tokens, bs, "", "")
			_, dc := f.dr.Routers()
			dc.Load().Add(router.Booking{ID: "other", Worker: "d2", Hashes: seqHashes(8), PrefillDone: true, Added: time.Now()})
		}, prefill: "p2", decode: "d1", bound: SessionBinding{Prefill: "p2", Worker: "d1"}, outcome: "bind"},
		{name: "a bound turn follows the binding against the cost", setup: func(t *testing.T, f *stagedSessions) {
			storeBlocks(t, f.fakeReplica, "p2", tokens, bs, "", "")
			f.bind(SessionBind{Session: "s", Prefill: "p1", Worker: "d2", TTL: time.Minute})
		}, prefill: "p1", decode: "d2", bound: SessionBinding{Prefill: "p1", Worker: "d2"}, outcome: "bound"},
		{name: "a one-stage binding gains the prefill stage", setup: func(t *testing.T, f *stagedSessions) {
			storeBlocks(t, f.fakeReplica, "p2", tokens, bs, "", "")
			f.bind(SessionBind{Session: "s", Worker: "d2", TTL: time.Minute})
		}, prefill: "p2", decode: "d2", bound: SessionBinding{Prefill: "p2", Worker: "d2"}, outcome: "bind"},
		{name: "prefill worker gone: rebound to the most prefix, decode kept", setup: func(t *testing.T, f *stagedSessions) {
			storeBlocks(t, f.fakeReplica, "p2", tokens[:2*bs], bs, "", "")
			f.bind(SessionBind{Session: "s", Prefill: "p1", Worker: "d2", TTL: time.Minute})
			f.remove("p1")
		}, prefill: "p2", decode: "d2", bound: SessionBinding{Prefill: "p2", Worker: "d2"}, outcome: "rebind"},
		{name: "decode worker gone: rebound to the most prefix, prefill kept", setup: func(t *testing.T, f *stagedSessions) {
			storeBlocks(t, f.fakeReplica, "d2", tokens, bs, "", "")
			f.bind(SessionBind{Session: "s", Prefill: "p1", Worker: "d9", TTL: time.Minute})
			// d2 is loaded: the decode router alone would choose d1.
			_, dc := f.dr.Routers()
			dc.Load().Add(router.Booking{ID: "heavy", Worker: "d2", Hashes: []uint64{1, 2, 3, 4, 5, 6}, PrefillDone: true, Added: time.Now()})
		}, prefill: "p1", decode: "d2", bound: SessionBinding{Prefill: "p1", Worker: "d2"}, outcome: "rebind"},
		{name: "no prefill worker left: aggregated on the bound decode worker, nothing rebound", setup: func(t *testing.T, f *stagedSessions) {
			f.bind(SessionBind{Session: "s", Prefill: "p1", Worker: "d2", TTL: time.Minute})
			f.remove("p1")
			f.remove("p2")
		}, prefill: "", decode: "d2", bound: SessionBinding{Prefill: "p1", Worker: "d2"}, outcome: "bound", aggregated: true},
		{name: "another replica's binding committed first: followed", setup: func(t *testing.T, f *stagedSessions) {
			storeBlocks(t, f.fakeReplica, "p2", tokens, bs, "", "")
			f.beforeBind = func(b SessionBind) {
				f.beforeBind = nil
				f.bind(SessionBind{Session: "s", Prefill: "p1", Worker: "d2", TTL: time.Minute})
			}
		}, prefill: "p1", decode: "d2", bound: SessionBinding{Prefill: "p1", Worker: "d2"}, outcome: "follow"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, f := newStagedSessionServer(t, SessionPolicy{TTL: time.Minute})
			tc.setup(t, f)
			before := f.counts()
			rec := doWith(s, "/v1/completions", body, map[string]string{"X-Dynamo-Session-ID": "s"})
			if rec.Code != http.StatusOK {
				t.Fatalf("%d %s", rec.Code, rec.Body)
			}
			pf, dc := lastStages(before, f.counts())
			if pf != tc.prefill || dc != tc.decode || rec.Header().Get("X-Worker-Id") != string(tc.decode) {
				t.Fatalf("served %s → %s (answered by %q), want %s → %s", pf, dc, rec.Header().Get("X-Worker-Id"), tc.prefill, tc.decode)
			}
			b, ok := f.SessionBinding("s")
			if !ok || b.Prefill != tc.bound.Prefill || b.Worker != tc.bound.Worker {
				t.Fatalf("bound %+v, want %s → %s", b, tc.bound.Prefill, tc.bound.Worker)
			}
			if got := readCounter(s.sessMetrics.turns.WithLabelValues(tc.outcome)); got != 1 {
				t.Errorf("turns{%s} = %v", tc.outcome, got)
			}
			// The next turn follows the binding, whatever the cost says.
			storeBlocks(t, f.fakeReplica, "p1", tokens, bs, "", "")
			storeBlocks(t, f.fakeReplica, "p2", tokens, bs, "", "")
			before = f.counts()
			rec = doWith(s, "/v1/completions", body, map[string]string{"X-Dynamo-Session-ID": "s", "X-Dynamo-Session-Final": "true"})
			wantPrefill := tc.bound.Prefill
			if tc.aggregated {
				wantPrefill = ""
			}
			if pf, dc := lastStages(before, f.counts()); rec.Code != 200 || pf != wantPrefill || dc != tc.bound.Worker {
				t.Fatalf("next turn %d: %s → %s, want %s → %s", rec.Code, pf, dc, wantPrefill, tc.bound.Worker)
			}
			if _, ok := f.SessionBinding("s"); ok {
				t.Error("the final turn did not end the binding")
			}
		})
	}
}

// TestAPISessionStagesModes: busy bound workers answer busy in hard mode,
// and yield to normal planning and a rebind in soft mode.
func TestAPISessionStagesModes(t *testing.T) {
	for _, soft := range []bool{false, true} {
		t.Run(fmt.Sprintf("soft=%v", soft), func(t *testing.T) {
			s, f := newStagedSessionServer(t, SessionPolicy{TTL: time.Minute, Soft: soft})
			cfg := router.DefaultConfig()
			cfg.Thresholds.ActiveDecodeBlocks = ptrTo(0.5)
			if err := f.dr.SetBaseConfig(cfg); err != nil {
				t.Fatal(err)
			}
			_, dc := f.dr.Routers()
			dc.Load().Add(router.Booking{ID: "heavy", Worker: "d2", Hashes: seqHashes(800), PrefillDone: true, Added: time.Now()})
			f.bind(SessionBind{Session: "s", Prefill: "p1", Worker: "d2", TTL: time.Minute})
			rec := doWith(s, "/v1/completions", disaggBody, map[string]string{"X-Dynamo-Session-ID": "s"})
			b, _ := f.SessionBinding("s")
			if !soft {
				if rec.Code == http.StatusOK || b.Worker != "d2" {
					t.Fatalf("hard mode: %d, bound %+v", rec.Code, b)
				}
				// Its prefill worker gone too: the busy decode worker
				// is still the answer, nothing rebound.
				f.bind(SessionBind{Session: "s2", Prefill: "p9", Worker: "d2", TTL: time.Minute})
				rec = doWith(s, "/v1/completions", disaggBody, map[string]string{"X-Dynamo-Session-ID": "s2"})
				if b, _ := f.SessionBinding("s2"); rec.Code == http.StatusOK || b.Worker != "d2" || b.Prefill != "p9" {
					t.Fatalf("hard mode, prefill gone: %d, bound %+v", rec.Code, b)
				}
				return
			}
			if rec.Code != http.StatusOK || rec.Header().Get("X-Worker-Id") != "d1" || b.Worker != "d1" {
				t.Fatalf("soft mode: %d by %q, bound %+v", rec.Code, rec.Header().Get("X-Worker-Id"), b)
			}
			if got := readCounter(s.sessMetrics.rebinds.WithLabelValues("busy")); got != 1 {
				t.Errorf("rebinds{busy} = %v", got)
			}
		})
	}
}

func ptrTo[T any](v T) *T { return &v }

func seqHashes(n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = uint64(i + 1)
	}
	return out
}

// TestAPISessionStagesAdmin: GET /sessions/{id} names both stages of a
// two-stage binding.
func TestAPISessionStagesAdmin(t *testing.T) {
	s, f := newStagedSessionServer(t, SessionPolicy{TTL: time.Minute})
	f.bind(SessionBind{Session: "s", Prefill: "p1", Worker: "d2", TTL: time.Minute})
	rec := do(s, http.MethodGet, "/sessions/s", "")
	var got map[string]any
	if err := json.Unmarshal(rec.Body.Bytes(), &got); rec.Code != 200 || err != nil ||
		got["worker"] != "d2" || got["prefill_worker"] != "p1" || got["decode_worker"] != "d2" {
		t.Fatalf("%d %s", rec.Code, rec.Body)
	}
}

// stagedPins is a fake replica with prefix pins and a two-stage router for
// model "m".
type stagedPins struct {
	*fakePins
	*stagedFleet
}

// TestAPIPinStages: a pinned prefix on a two-stage model steers the
// prefill stage to its holders against the cost; a prefix pinned on a
// decode worker (while the plan served it aggregated there) steers the
// decode stage; with every holder gone the plan decides and the pin moves
// to the worker that computed the prompt; cache_control pins the prefix on
// the prefill worker chosen, and a session turn's on its bound prefill
// worker.
func TestAPIPinStages(t *testing.T) {
	prompt := strings.Repeat(longPrompt, 4)
	tokens := tokenize.Builtin().EncodeSpecial(prompt)
	bs := router.DefaultConfig().BlockSize
	hashes := router.SaltedSequenceHashes(tokens, bs, "", "")
	plain := fmt.Sprintf(`{"model":"m","max_tokens":5,"prompt":%q}`, prompt)
	cached := fmt.Sprintf(`{"model":"m","max_tokens":5,"prompt":%q,"nvext":{"cache_control":{"type":"ephemeral","ttl":"5m"}}}`, prompt)
	holder := func(w router.WorkerID) PinHolder {
		return PinHolder{Worker: w, Until: time.Now().Add(5 * time.Minute), TTL: 5 * time.Minute}
	}
	for _, tc := range []struct {
		name            string
		body            string
		setup           func(f *stagedPins)
		prefill, decode router.WorkerID
		routed          string // kvrouter_pin_routed_total outcome counted once; "" none
		write           string // the pin written: its worker; "" none
		replace         router.WorkerID
	}{
		{name: "holder steers the prefill stage", body: plain, setup: func(f *stagedPins) {
			f.put("m", hashes[:2], holder("p1"))
		}, prefill: "p1", decode: "d1", routed: "holder"},
		{name: "a decode holder steers the decode stage", body: plain, setup: func(f *stagedPins) {
			f.put("m", hashes[:2], holder("d2"))
		}, prefill: "p2", decode: "d2", routed: "holder"},
		{name: "holder gone: the pin moves to the prefill worker chosen", body: plain, setup: func(f *stagedPins) {
			f.put("m", hashes[:2], holder("p1"))
			f.remove("p1")
		}, prefill: "p2", decode: "d1", routed: "moved", write: "p2", replace: "p1"},
		{name: "cache_control pins on the prefill worker", body: cached, prefill: "p2", decode: "d1", write: "p2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := newFakeReplica("m", router.DefaultConfig())
			f := &stagedPins{fakePins: &fakePins{fakeReplica: rep, enabled: true}, stagedFleet: newStagedFleet(t, rep)}
			s := New(Config{Registry: prometheus.NewRegistry(), Retries: 1, AllowLoopbackWorkers: true}, f)
			storeBlocks(t, rep, "p2", tokens, bs, "", "") // the cost prefers p2
			_, dc := f.dr.Routers()
			dc.Load().Add(router.Booking{ID: "other", Worker: "d2", Hashes: seqHashes(8), PrefillDone: true, Added: time.Now()})
			if tc.setup != nil {
				tc.setup(f)
			}
			before := f.counts()
			rec := doWith(s, "/v1/completions", tc.body, nil)
			if pf, dc := lastStages(before, f.counts()); rec.Code != 200 || pf != tc.prefill || dc != tc.decode {
				t.Fatalf("%d: served %s → %s, want %s → %s (%s)", rec.Code, pf, dc, tc.prefill, tc.decode, rec.Body)
			}
			for _, o := range []string{"holder", "moved"} {
				want := 0.0
				if o == tc.routed {
					want = 1
				}
				if got := readCounter(s.pinMetrics.routed.WithLabelValues(o)); got != want {
					t.Errorf("routed{%s} = %v, want %v", o, got, want)
				}
			}
			ws := f.takeWrites()
			switch {
			case tc.write == "" && len(ws) != 0:
				t.Errorf("writes %+v, want none", ws)
			case tc.write != "" && (len(ws) != 1 || ws[0].Worker != router.WorkerID(tc.write) || ws[0].Replace != tc.replace):
				t.Errorf("writes %+v, want one on %s replacing %q", ws, tc.write, tc.replace)
			}
		})
	}
}

// TestAPISelectPins: Dynamo's selection API honours prefix pins by the
// sequence hashes it carries: /select and /select_and_reserve answer a
// pinned prefix's holder against the cost; /select writes nothing; with the
// holder gone both answer by the cost, and only /select_and_reserve (which
// places a request) moves the pin.
func TestAPISelectPins(t *testing.T) {
	body := `{"model_name":"m","sequence_hashes":[21,22,23,24],"isl_tokens":64,"selection_id":"%s"}`
	for _, tc := range []struct {
		name, path string
		gone       bool
		worker     string
		writes     int
	}{
		{"select: the holder", "/select", false, "w2", 0},
		{"select_and_reserve: the holder", "/select_and_reserve", false, "w2", 0},
		{"select: holder gone, by cost, nothing written", "/select", true, "w1", 0},
		{"select_and_reserve: holder gone, the pin moves", "/select_and_reserve", true, "w1", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, fp, _ := newPinServer(t, 2, true)
			blocks := make([]router.StoredBlock, 4)
			for i := range blocks {
				blocks[i] = router.StoredBlock{EngineHash: uint64(21 + i), ContentHash: uint64(21 + i)}
			}
			if err := fp.index.Apply("w1", router.KVEvent{Kind: router.EventStored, Blocks: blocks}); err != nil {
				t.Fatal(err)
			}
			holder := router.WorkerID("w2")
			if tc.gone {
				holder = "w9"
			}
			fp.put("m", []uint64{21, 22}, PinHolder{Worker: holder, Until: time.Now().Add(time.Minute), TTL: time.Minute})
			rec := do(s, http.MethodPost, tc.path, fmt.Sprintf(body, strings.ReplaceAll(tc.name, " ", "-")))
			var out struct {
				WorkerID string `json:"worker_id"`
			}
			if err := json.Unmarshal(rec.Body.Bytes(), &out); rec.Code != 200 || err != nil || out.WorkerID != tc.worker {
				t.Fatalf("%d %s, want %s", rec.Code, rec.Body, tc.worker)
			}
			if ws := fp.takeWrites(); len(ws) != tc.writes || (tc.writes == 1 && (ws[0].Worker != "w1" || ws[0].Replace != "w9")) {
				t.Fatalf("writes %+v, want %d", ws, tc.writes)
			}
		})
	}
}

// stagedSessionPins is a fake replica with sessions, pins and a two-stage
// router for model "m".
type stagedSessionPins struct {
	*fakeSessions
	*stagedFleet
	pins *fakePins
}

func (f *stagedSessionPins) PinsEnabled() bool { return true }
func (f *stagedSessionPins) PinCount() int     { return f.pins.PinCount() }
func (f *stagedSessionPins) Pins() []PinInfo   { return nil }
func (f *stagedSessionPins) Pin(w PinWrite)    { f.pins.Pin(w) }
func (f *stagedSessionPins) PinLookup(m string, h []uint64) (PinMatch, bool) {
	return f.pins.PinLookup(m, h)
}
func (f *stagedSessionPins) Unpin(ctx context.Context, u PinUnpin) (int, error) {
	return f.pins.Unpin(ctx, u)
}

// TestAPISessionStagesPin: a session turn's binding decides its workers
// before any pin (a pin held elsewhere does not move it), and its
// cache_control pins the prompt on the bound prefill worker.
func TestAPISessionStagesPin(t *testing.T) {
	prompt := strings.Repeat(longPrompt, 4)
	tokens := tokenize.Builtin().EncodeSpecial(prompt)
	hashes := router.SaltedSequenceHashes(tokens, router.DefaultConfig().BlockSize, "", "")
	rep := newFakeReplica("m", router.DefaultConfig())
	f := &stagedSessionPins{fakeSessions: newFakeSessions(rep, SessionPolicy{TTL: time.Minute}), stagedFleet: newStagedFleet(t, rep),
		pins: &fakePins{fakeReplica: rep, enabled: true}}
	s := New(Config{Registry: prometheus.NewRegistry(), Retries: 1, AllowLoopbackWorkers: true}, f)
	f.pins.put("m", hashes[:2], PinHolder{Worker: "p2", Until: time.Now().Add(time.Minute), TTL: time.Minute})
	f.bind(SessionBind{Session: "s", Prefill: "p1", Worker: "d2", TTL: time.Minute})
	before := f.counts()
	body := fmt.Sprintf(`{"model":"m","max_tokens":5,"prompt":%q,"nvext":{"cache_control":{"type":"ephemeral"}}}`, prompt)
	rec := doWith(s, "/v1/completions", body, map[string]string{"X-Dynamo-Session-ID": "s"})
	if pf, dc := lastStages(before, f.counts()); rec.Code != 200 || pf != "p1" || dc != "d2" {
		t.Fatalf("%d: served %s → %s, want the binding p1 → d2", rec.Code, pf, dc)
	}
	if ws := f.pins.takeWrites(); len(ws) != 1 || ws[0].Worker != "p1" || len(ws[0].Blocks) != len(hashes) {
		t.Fatalf("pin writes %+v, want the prompt pinned on p1", ws)
	}
}
