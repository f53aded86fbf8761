package api

// HTTP fuzz targets: every handler that reads input, driven through the
// real gin engine (middleware included) over the fake replica. Each input
// gets a fresh server, so a failing input replays on its own.
//
// Invariants, for every target:
//   - no handler panics (gin.Recovery would hide it as an empty 500: its
//     log is captured and checked);
//   - the status is one the endpoint documents, and every status >= 400
//     carries a JSON error body (OpenAI's shape on /v1/* and /debug/route,
//     {"error": "..."} on the admin endpoints);
//   - a JSON answer is valid JSON;
//   - an input the handler rejects never reaches a write on the replica
//     (SetThresholds, RegisterWorker, DeregisterWorker): a write call may
//     precede an error status only when the replica itself refused it, and
//     whatever reaches a write is well formed;
//   - requests leave no load booked behind, and rejected inference
//     requests never reach a worker.
//
// `go test ./api/` runs the seeds below and testdata/fuzz/Fuzz*;
// .ci/fuzz-all fuzzes each target.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api/decisionlog"
	"github.com/kvrouter/kvrouter/router"
)

// fuzzMaxBody is the fuzz servers' body limit: small, so fuzzed inputs reach
// the 413 paths (Content-Length over the limit, and reading past it).
const fuzzMaxBody = 4096

// --- the replica: the fake, with its writes recorded ------------------------

// writeCall is one write that reached the replica.
type writeCall struct {
	op  string // set_thresholds, register, deregister
	arg string
	err error // what the replica answered
}

// recordingReplica is the fake replica with every write recorded, and every
// write checked for what the API layer must have validated before it.
type recordingReplica struct {
	*fakeReplica
	wmu       sync.Mutex // writes, malformed (the fake's own mu guards its events)
	writes    []writeCall
	malformed []string // writes the handler should never have made
}

func (r *recordingReplica) record(c writeCall, malformed string) {
	r.wmu.Lock()
	defer r.wmu.Unlock()
	r.writes = append(r.writes, c)
	if malformed != "" {
		r.malformed = append(r.malformed, c.op+" "+c.arg+": "+malformed)
	}
}

func (r *recordingReplica) calls() []writeCall {
	r.wmu.Lock()
	defer r.wmu.Unlock()
	return append([]writeCall(nil), r.writes...)
}

func (r *recordingReplica) SetThresholds(ctx context.Context, m string, u ThresholdUpdate) (router.Thresholds, error) {
	var bad string
	switch {
	case m == "":
		bad = "empty model"
	case u.Empty():
		bad = "empty update (a read must not be proposed)"
	default:
		if err := (router.Thresholds{ActiveDecodeBlocks: u.ActiveDecodeBlocks, ActivePrefillTokens: u.ActivePrefillTokens,
			ActivePrefillTokensFrac: u.ActivePrefillTokensFrac}).Validate(); err != nil {
			bad = "invalid value: " + err.Error()
		}
	}
	t, err := r.fakeReplica.SetThresholds(ctx, m, u)
	r.record(writeCall{op: "set_thresholds", arg: m, err: err}, bad)
	return t, err
}

func (r *recordingReplica) RegisterWorker(ctx context.Context, w WorkerSpec) error {
	bad := ""
	if err := w.Validate(); err != nil {
		bad = err.Error()
	}
	err := r.fakeReplica.RegisterWorker(ctx, w)
	r.record(writeCall{op: "register", arg: w.ID, err: err}, bad)
	return err
}

func (r *recordingReplica) DeregisterWorker(ctx context.Context, id string) error {
	bad := ""
	if id == "" {
		bad = "empty id"
	}
	err := r.fakeReplica.DeregisterWorker(ctx, id)
	r.record(writeCall{op: "deregister", arg: id, err: err}, bad)
	return err
}

// --- the workers: in memory --------------------------------------------------

const (
	fuzzLiveWorker    = "http://w1.fuzz.invalid"
	fuzzDeadWorker    = "http://w0.fuzz.invalid"
	fuzzPrefillWorker = "http://p.fuzz.invalid"
	fuzzDecodeWorker  = "http://d.fuzz.invalid"
)

// fuzzWorkers answers for the workers without a socket: w1 like a vLLM
// worker (plain JSON, or an SSE stream when the body asks for one), w0 as a
// connection that cannot be made (the router retries elsewhere), and for
// disaggregated serving p and d behind vLLM's NIXL proxy protocol (p
// answers kv_transfer_params, d pulls the KV), with the faults the setup
// asks for.
type fuzzWorkers struct {
	hits        atomic.Int64
	failPrefill bool         // p answers 500
	noParams    bool         // p answers without kv_transfer_params
	failPulls   atomic.Int64 // d fails this many pulls with kv_transfer_failed
}

func (f *fuzzWorkers) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Body != nil {
		defer req.Body.Close()
	}
	host := "http://" + req.URL.Host
	if host != fuzzLiveWorker && host != fuzzPrefillWorker && host != fuzzDecodeWorker {
		return nil, errors.New("dial tcp: connection refused")
	}
	f.hits.Add(1)
	var body map[string]any
	_ = json.NewDecoder(req.Body).Decode(&body)
	params, _ := body["kv_transfer_params"].(map[string]any)
	rec := httptest.NewRecorder()
	rec.Header().Set("Content-Type", "application/json")
	switch {
	case host == fuzzPrefillWorker && f.failPrefill:
		rec.WriteHeader(http.StatusInternalServerError)
		rec.WriteString(`{"error":{"message":"boom","type":"internal_error","code":500}}`)
	case host == fuzzPrefillWorker && f.noParams:
		rec.WriteString(`{"choices":[{"message":{"content":"x"}}],"usage":{"prompt_tokens":40,"completion_tokens":1}}`)
	case host == fuzzPrefillWorker:
		rec.WriteString(`{"choices":[{"message":{"content":"x"}}],"usage":{"prompt_tokens":40,"completion_tokens":1},` +
			`"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"p","remote_url":"` + fuzzPrefillWorker + `","transfer_id":"t1","num_tokens":40}}`)
	case host == fuzzDecodeWorker && params["do_remote_prefill"] == true && f.failPulls.Add(-1) >= 0:
		rec.WriteHeader(http.StatusBadGateway)
		rec.WriteString(`{"error":{"message":"pull from prefill failed","type":"kv_transfer_failed","code":502}}`)
	case body["stream"] == true:
		rec.Header().Set("Content-Type", "text/event-stream")
		rec.WriteString("data: {\"choices\":[{\"delta\":{\"content\":\"t\"}}]}\n\n")
		rec.WriteString("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\ndata: [DONE]\n\n")
	default:
		rec.WriteString(`{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":40,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}`)
	}
	resp := rec.Result()
	resp.Request = req
	return resp, nil
}

// --- panics hidden by gin.Recovery -------------------------------------------

// recoveryLog receives what gin.Recovery writes when it catches a panic
// (it reads gin.DefaultErrorWriter when the engine is built).
var recoveryLog struct {
	once sync.Once
	mu   sync.Mutex
	buf  bytes.Buffer
}

type recoveryWriter struct{}

func (recoveryWriter) Write(p []byte) (int, error) {
	recoveryLog.mu.Lock()
	defer recoveryLog.mu.Unlock()
	recoveryLog.buf.Write(p)
	return len(p), nil
}

func takeRecoveryLog() string {
	recoveryLog.mu.Lock()
	defer recoveryLog.mu.Unlock()
	s := recoveryLog.buf.String()
	recoveryLog.buf.Reset()
	return s
}

// --- the server under test ---------------------------------------------------

type fuzzServer struct {
	s   *Server
	rep *recordingReplica
	dr  *router.DisaggRouter // nil: the model routes aggregated
	// preloaded: bookings on w1 made before the request (fuzzPreload).
	preloaded int
	workers   *fuzzWorkers
	cluster   atomic.Int64 // requests that reached the cluster handler
}

const (
	fuzzPreload    = "fuzz-preload" // a booking that makes w1 the dearer worker
	fuzzAdminToken = "adm-token"
	fuzzAPIKey     = "api-key"
)

// fuzzSetup is how the inference targets' replica serves model "m",
// decoded from one fuzzed byte: bits 0-1 aggregated (0) or disaggregated
// with mode off, always, auto; bit 2 aggregated: the dead worker w0 is
// the cheaper one (w1 carries a preloaded booking), so every request
// first fails over; disaggregated: a prefill worker; bit 3 it fails; bit 4
// it answers without kv_transfer_params; bits 5-6 the pulls the decode
// worker fails.
type fuzzSetup struct {
	mode        router.DisaggMode // "": aggregated, no two-stage router
	withPrefill bool              // aggregated: w0 first
	failPrefill bool
	noParams    bool
	failPulls   int64
}

func decodeSetup(b uint8) fuzzSetup {
	modes := []router.DisaggMode{"", router.DisaggOff, router.DisaggAlways, router.DisaggAuto}
	return fuzzSetup{mode: modes[b&3], withPrefill: b&4 != 0, failPrefill: b&8 != 0, noParams: b&16 != 0, failPulls: int64(b >> 5 & 3)}
}

// fuzzDisaggReplica adds the two-stage router to the recording replica.
type fuzzDisaggReplica struct {
	*recordingReplica
	dr *router.DisaggRouter
}

func (f *fuzzDisaggReplica) Disagg(model string) (*router.DisaggRouter, bool) {
	return f.dr, model == "m"
}

// newFuzzServer builds a replica serving model "m" (block size 16) with a
// live worker w1 and a dead one w0. With auth, admin endpoints need
// fuzzAdminToken and /v1 needs fuzzAPIKey, and a stub cluster handler is
// mounted (it counts what reaches it).
func newFuzzServer(auth bool) *fuzzServer { return newFuzzServerSetup(auth, fuzzSetup{}) }

// newFuzzServerSetup: with a disaggregation mode, model "m" has decode
// worker d (and prefill worker p) behind a two-stage router instead.
func newFuzzServerSetup(auth bool, setup fuzzSetup) *fuzzServer {
	recoveryLog.once.Do(func() { gin.DefaultErrorWriter = recoveryWriter{} })
	takeRecoveryLog()
	cfg := router.DefaultConfig()
	cfg.BlockSize = 16
	fs := &fuzzServer{rep: &recordingReplica{fakeReplica: newFakeReplica("m", cfg)},
		workers: &fuzzWorkers{failPrefill: setup.failPrefill, noParams: setup.noParams}}
	fs.workers.failPulls.Store(setup.failPulls)
	var rep Replica = fs.rep
	if setup.mode == "" {
		fs.rep.addWorker("m", "w0", fuzzDeadWorker)
		fs.rep.addWorker("m", "w1", fuzzLiveWorker)
		if setup.withPrefill {
			rt, _ := fs.rep.Router("m")
			rt.Load().Add(router.Booking{ID: fuzzPreload, Worker: "w1", PrefillTokens: 4096, Added: time.Now()})
			fs.preloaded = 1
		}
	} else {
		dr, err := router.NewDisaggRouter(cfg, fs.rep.index, router.DisaggConfig{
			Mode: setup.mode, KV: router.KVQwen3_0_6B, TransferRetries: 1,
			Timing: router.StepTiming{
				PrefillMs: func(n int) float64 { return 0.1 * float64(n) },
				DecodeMs:  func(float64) float64 { return 5 },
			},
			Topology: router.SingleLink("link", router.Link{ThroughputBytesPerS: 104e6}),
		}, 1)
		if err != nil {
			panic(err)
		}
		ws := []router.RoleWorker{{WorkerInfo: router.WorkerInfo{ID: "d", TotalBlocks: 1000, MaxBatchedTokens: 8192}, Role: router.RoleDecode}}
		if setup.withPrefill {
			ws = append(ws, router.RoleWorker{WorkerInfo: router.WorkerInfo{ID: "p", TotalBlocks: 1000, MaxBatchedTokens: 8192}, Role: router.RolePrefill})
			fs.rep.urls["p"] = fuzzPrefillWorker
		}
		dr.SetWorkers(ws)
		fs.rep.addWorker("m", "d", fuzzDecodeWorker)
		fs.dr = dr
		rep = &fuzzDisaggReplica{recordingReplica: fs.rep, dr: dr}
	}
	c := Config{Registry: prometheus.NewRegistry(), Retries: 2, MaxBodyBytes: fuzzMaxBody, AllowLoopbackWorkers: true,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Decisions: decisionlog.New(64, nil)}
	if auth {
		c.AdminToken, c.APIKeys = fuzzAdminToken, []string{fuzzAPIKey}
		c.ClusterHandler = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			fs.cluster.Add(1)
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"ok":true}`)
		})
	}
	fs.s = New(c, rep)
	fs.s.client = &http.Client{Transport: fs.workers}
	return fs
}

// request builds a request as the net/http server would hand it over;
// chunked leaves the length unknown (the handler then hits the body limit
// while reading).
func fuzzRequest(method, target string, body []byte, chunked bool) *http.Request {
	req := httptest.NewRequest(method, "http://replica.fuzz"+target, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if chunked {
		req.ContentLength = -1
		req.Body = io.NopCloser(bytes.NewReader(body))
	}
	return req
}

func (fs *fuzzServer) serve(t *testing.T, req *http.Request) *httptest.ResponseRecorder {
	t.Helper()
	rec := httptest.NewRecorder()
	fs.s.Handler().ServeHTTP(rec, req)
	if p := takeRecoveryLog(); p != "" {
		t.Fatalf("%s %s: handler panicked (gin.Recovery answered %d):\n%s", req.Method, req.URL, rec.Code, p)
	}
	fs.rep.wmu.Lock()
	malformed := fs.rep.malformed
	fs.rep.wmu.Unlock()
	for _, m := range malformed {
		t.Errorf("%s %s: malformed write reached the replica: %s", req.Method, req.URL, m)
	}
	return rec
}

// --- shared checks -------------------------------------------------------------

type errShape int

const (
	openAIShape errShape = iota // {"error": {"message": …, "type": …, "code": status}}
	adminShape                  // {"error": "…"}
)

func snippet(b []byte) string {
	if len(b) > 300 {
		return string(b[:300]) + "…"
	}
	return string(b)
}

// checkStatus: status is one of allowed; an error status has an error body
// of the endpoint's shape; a JSON answer is valid JSON.
func checkStatus(t *testing.T, what string, rec *httptest.ResponseRecorder, shape errShape, allowed ...int) {
	t.Helper()
	body := rec.Body.Bytes()
	ok := false
	for _, a := range allowed {
		ok = ok || rec.Code == a
	}
	if !ok {
		t.Fatalf("%s: status %d, documented %v: %s", what, rec.Code, allowed, snippet(body))
	}
	if strings.HasPrefix(rec.Header().Get("Content-Type"), "application/json") && !json.Valid(body) {
		t.Fatalf("%s: %d with invalid JSON: %s", what, rec.Code, snippet(body))
	}
	if rec.Code < 400 {
		return
	}
	if !strings.HasPrefix(rec.Header().Get("Content-Type"), "application/json") {
		t.Fatalf("%s: error %d is not JSON (Content-Type %q): %s", what, rec.Code, rec.Header().Get("Content-Type"), snippet(body))
	}
	checkErrorBody(t, what, rec.Code, body, shape)
}

func checkErrorBody(t *testing.T, what string, code int, body []byte, shape errShape) {
	t.Helper()
	var doc struct {
		Error json.RawMessage `json:"error"`
	}
	if err := json.Unmarshal(body, &doc); err != nil || len(doc.Error) == 0 {
		t.Fatalf("%s: error %d without an error member: %s", what, code, snippet(body))
	}
	switch shape {
	case openAIShape:
		var e struct {
			Message string `json:"message"`
			Type    string `json:"type"`
			Code    int    `json:"code"`
		}
		if err := json.Unmarshal(doc.Error, &e); err != nil || e.Message == "" || e.Type == "" || e.Code != code {
			t.Fatalf("%s: error %d not in OpenAI's shape: %s", what, code, snippet(body))
		}
	case adminShape:
		// {"error": "…"}; the body limit (middleware) answers in OpenAI's
		// shape on every route.
		var msg string
		var e struct {
			Message string `json:"message"`
		}
		if json.Unmarshal(doc.Error, &msg) != nil && json.Unmarshal(doc.Error, &e) == nil {
			msg = e.Message
		}
		if msg == "" {
			t.Fatalf("%s: error %d without a message: %s", what, code, snippet(body))
		}
	}
}

// checkWrites: a rejected request made no write, unless the replica itself
// refused it (then the status is the replica's error's); a 2xx made at
// most max writes, none refused.
func checkWrites(t *testing.T, what string, fs *fuzzServer, code int, max int) []writeCall {
	t.Helper()
	calls := fs.rep.calls()
	if len(calls) > max {
		t.Fatalf("%s: %d writes reached the replica, at most %d expected: %+v", what, len(calls), max, calls)
	}
	for _, c := range calls {
		switch {
		case code < 300 && c.err != nil:
			t.Fatalf("%s: answered %d although the replica refused %s %q: %v", what, code, c.op, c.arg, c.err)
		case code >= 400 && c.err == nil:
			t.Fatalf("%s: rejected with %d after %s %q reached the replica and succeeded", what, code, c.op, c.arg)
		case code >= 400 && statusOf(c.err) != code:
			t.Fatalf("%s: rejected with %d, but the replica's error %v maps to %d", what, code, c.err, statusOf(c.err))
		}
	}
	return calls
}

// checkNoLoad: every booked request was freed: the router holds no load,
// the two-stage router tracks nothing, and every booking announced to the
// other replicas was freed again.
func checkNoLoad(t *testing.T, what string, fs *fuzzServer) {
	t.Helper()
	rt, _ := fs.rep.Router("m")
	if n := rt.Load().Len() - fs.preloaded; n != 0 {
		t.Fatalf("%s: %d requests still booked after the answer", what, n)
	}
	if fs.dr != nil {
		if n := fs.dr.InFlight(); n != 0 {
			t.Fatalf("%s: %d requests still tracked by the two-stage router", what, n)
		}
	}
	open := map[string]bool{}
	fs.rep.fakeReplica.mu.Lock()
	for _, e := range fs.rep.events {
		if id, ok := strings.CutPrefix(e, "add "); ok {
			open[id] = true
		} else if id, ok := strings.CutPrefix(e, "free "); ok {
			delete(open, id)
		}
	}
	fs.rep.fakeReplica.mu.Unlock()
	if len(open) > 0 {
		t.Fatalf("%s: bookings announced to the other replicas and never freed: %v", what, open)
	}
}

// --- inference: /v1/chat/completions, /v1/completions --------------------------

var chatSeeds = []string{
	`{"model":"m","messages":[{"role":"user","content":"hello there, a prompt long enough to fill a couple of blocks of sixteen tokens each, yes"}]}`,
	`{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Summarise RFC 793."}],"stream":true,"max_tokens":64}`,
	`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"part one"},{"type":"text","text":"part two"}]}],"temperature":0.2}`,
	`{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function"}]},{"role":"user","content":"go on"}]}`,
	`{"model":"m","messages":[{"role":"user","content":"x"}],"nvext":{"agent_hints":{"priority":3}}}`,
	`{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"u"},{"role":"assistant","content":"a"},{"role":"user","content":"again"}]}`,
	`{"model":"kvmock","max_tokens":4,"messages":[{"content":"chaos prefix 3: lorem ipsum dolor / client 0 request 7","role":"user"}]}`,
	`{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:,"}}]}]}`,
	`{"model":"m","messages":[{"role":"","content":"no role"}]}`,
	`{"model":"m","messages":[]}`,
	`{"messages":[{"role":"user","content":"x"}]}`,
	`{"model":"m","messages":{"role":"user"}}`,
	`{"model":"m","messages":[{"role":"user","content":"x"}],"nvext":{"agent_hints":{"priority":1e99}}}`,
	`{"model":"m","messages":[{"role":"user","content":"x"}],"nvext":{"agent_hints":{"priority":-2,"strict_priority":4294967295}}}`,
	`{"model":"m","messages":[{"role":"user","content":"x"}],"nvext":{"agent_hints":{"strict_priority":-1,"priority":"high"}}}`,
	`{"model":"m","messages":[{"role":"user","content":"x"}],"nvext":{"agent_hints":{"latency_sensitivity":1.2,"osl":64,"speculative_prefill":true}}}`,
	`{"model":"m","messages":[{"role":"user","content":"x"}],"nvext":{"agent_hints":{"latency_sensitivity":-3}}}`,
	`{"model":"m","messages":[{"role":"user","content":"x"}],"nvext":{"cache_control":{"type":"ephemeral","ttl":"5m"}}}`,
	`{"model":`,
	`[]`,
	`null`,
	``,
	"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe invalid utf-8\"}]}",
}

var completionSeeds = []string{
	`{"model":"m","prompt":"once upon a time"}`,
	`{"model":"m","prompt":"once upon a time","stream":true,"max_tokens":16}`,
	`{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}`,
	`{"model":"m","prompt":["one string in an array"]}`,
	`{"model":"m","prompt":["two","strings"]}`,
	`{"model":"m","prompt":[4294967295,0]}`,
	`{"model":"m","prompt":[-1]}`,
	`{"model":"m","prompt":[]}`,
	`{"model":"m","prompt":""}`,
	`{"model":"m","prompt":null}`,
	`{"model":"m","prompt":{"a":1}}`,
	`{"model":"m"}`,
	`{"model":"nope","prompt":"x"}`,
	`{"model":"m","prompt":"x","messages":[{"role":"user","content":"ignored"}]}`,
}

// setupSeeds: aggregated; aggregated with the dead worker first; disaggregated (always) with a prefill worker;
// the same with a failing prefill, with a prefill that answers no
// kv_transfer_params, with two failed pulls; auto; off; no prefill worker.
var setupSeeds = []uint8{0, 4, 2 | 4, 2 | 4 | 8, 2 | 4 | 16, 2 | 4 | 2<<5, 3 | 4, 1 | 4, 2}

func FuzzHTTPChatCompletions(f *testing.F) {
	for _, s := range chatSeeds {
		f.Add([]byte(s), false, uint8(0))
	}
	for _, st := range setupSeeds {
		f.Add([]byte(chatSeeds[1]), false, st)
	}
	f.Add([]byte(chatSeeds[0]), true, uint8(0))
	f.Fuzz(func(t *testing.T, body []byte, chunked bool, setup uint8) {
		fuzzInference(t, "/v1/chat/completions", body, chunked, setup)
	})
}

func FuzzHTTPCompletions(f *testing.F) {
	for _, s := range completionSeeds {
		f.Add([]byte(s), false, uint8(0))
	}
	for _, st := range setupSeeds {
		f.Add([]byte(completionSeeds[0]), false, st)
	}
	f.Add([]byte(completionSeeds[0]), true, uint8(0))
	f.Fuzz(func(t *testing.T, body []byte, chunked bool, setup uint8) {
		fuzzInference(t, "/v1/completions", body, chunked, setup)
	})
}

func fuzzInference(t *testing.T, path string, body []byte, chunked bool, setup uint8) {
	st := decodeSetup(setup)
	fs := newFuzzServerSetup(false, st)
	rec := fs.serve(t, fuzzRequest("POST", path, body, chunked))
	what := fmt.Sprintf("POST %s (setup %+v)", path, st)
	// Live workers and no busy thresholds: nothing but the input decides.
	// A failed prefill or transfer is recovered (aggregated on the decode
	// worker), never the client's problem.
	checkStatus(t, what, rec, openAIShape, 200, 400, 404, 413)
	checkWrites(t, what, fs, rec.Code, 0)
	checkNoLoad(t, what, fs)
	hits := fs.workers.hits.Load()
	if rec.Code != 200 {
		if hits != 0 {
			t.Fatalf("%s: rejected with %d but reached a worker %d times", what, rec.Code, hits)
		}
		return
	}
	want := "w1"
	if st.mode != "" {
		want = "d"
	}
	if hits < 1 || rec.Header().Get("X-Worker-Id") != want {
		t.Fatalf("%s: 200 after %d worker hits via %q", what, hits, rec.Header().Get("X-Worker-Id"))
	}
	if ct := rec.Header().Get("Content-Type"); ct == "text/event-stream" {
		if !bytes.HasSuffix(rec.Body.Bytes(), []byte("data: [DONE]\n\n")) {
			t.Fatalf("%s: stream not relayed whole: %s", what, snippet(rec.Body.Bytes()))
		}
	} else if !json.Valid(rec.Body.Bytes()) {
		t.Fatalf("%s: worker answer not relayed as JSON: %s", what, snippet(rec.Body.Bytes()))
	}
}

// --- POST /busy_threshold --------------------------------------------------------

var thresholdSeeds = []string{
	`{"model":"m"}`,
	`{"model":"m","active_decode_blocks_threshold":0.85}`,
	`{"model":"m","active_decode_blocks_threshold":0.85,"active_prefill_tokens_threshold":10000}`,
	`{"model":"m","active_prefill_tokens_threshold_frac":1.5}`,
	`{"model":"m","active_decode_blocks_threshold":null,"active_prefill_tokens_threshold":null,"active_prefill_tokens_threshold_frac":null}`,
	`{"model":"m","active_decode_blocks_threshold":0}`,
	`{"model":"m","active_decode_blocks_threshold":1}`,
	`{"model":"ledger","active_decode_blocks_threshold":0.100042}`,
	`{"model":"m","active_decode_blocks_threshold":1.5}`,
	`{"model":"m","active_decode_blocks_threshold":-0.1}`,
	`{"model":"m","active_decode_blocks_threshold":1e400}`,
	`{"model":"m","active_decode_blocks_threshold":"0.5"}`,
	`{"model":"m","active_prefill_tokens_threshold":-3}`,
	`{"model":"m","active_prefill_tokens_threshold":1.5}`,
	`{"model":"m","active_prefill_tokens_threshold":9223372036854775808}`,
	`{"model":"m","active_prefill_tokens_threshold_frac":-0.1}`,
	`{"model":"m","threshold":1}`,
	`{"model":"m","clear":["active_decode_blocks_threshold"],"active_prefill_tokens_threshold":7}`,
	`{"model":"m","clear":["x"]}`,
	`{"model":"m","clear":"active_decode_blocks_threshold"}`,
	`{"model":"zz"}`,
	`{"model":"","active_decode_blocks_threshold":0.5}`,
	`{"model":null}`,
	`{"model":5}`,
	`{"active_decode_blocks_threshold":0.5}`,
	`{"model":"m","model":"zz","active_decode_blocks_threshold":0.5}`,
	`{"model":"m","active_decode_blocks_threshold":0.5,"active_decode_blocks_threshold":null}`,
	`{"model":`,
	`[{"model":"m"}]`,
	`null`,
	``,
}

func FuzzHTTPBusyThresholdPost(f *testing.F) {
	for _, s := range thresholdSeeds {
		f.Add([]byte(s), false)
	}
	f.Add([]byte(thresholdSeeds[1]), true)
	f.Fuzz(func(t *testing.T, body []byte, chunked bool) {
		fs := newFuzzServer(false)
		before := thresholdsJSON(t, fs)
		rec := fs.serve(t, fuzzRequest("POST", "/busy_threshold", body, chunked))
		what := "POST /busy_threshold"
		checkStatus(t, what, rec, adminShape, 200, 400, 404, 413, 422)
		calls := checkWrites(t, what, fs, rec.Code, 1)
		after := thresholdsJSON(t, fs)
		if rec.Code != 200 {
			if after != before {
				t.Fatalf("%s: rejected with %d but the thresholds changed: %s → %s", what, rec.Code, before, after)
			}
			return
		}
		var got thresholdJSON
		if err := json.Unmarshal(rec.Body.Bytes(), &got); err != nil {
			t.Fatalf("%s: 200 answer is not thresholds: %s", what, snippet(rec.Body.Bytes()))
		}
		if got.Model != "m" {
			// A read of a model the replica does not serve: nulls, as
			// Dynamo answers, and nothing written.
			if got.ActiveDecodeBlocksThreshold != nil || got.ActivePrefillTokensThreshold != nil ||
				got.ActivePrefillTokensThresholdFrac != nil || len(calls) != 0 || after != before {
				t.Fatalf("%s: read of unknown model %q answered %s with %d writes", what, got.Model, snippet(rec.Body.Bytes()), len(calls))
			}
			return
		}
		// The answer is the state now, and it holds every value the body set.
		if want := mustJSON(t, []thresholdJSON{got}); after != want {
			t.Fatalf("%s: answered %s, GET reads %s", what, want, after)
		}
		var raw map[string]json.RawMessage
		if err := json.Unmarshal(body, &raw); err != nil {
			t.Fatalf("%s: 200 for a body that is not a JSON object: %s", what, snippet(body))
		}
		set := 0
		for k, v := range raw {
			if k == "model" || string(v) == "null" || !slices.Contains(thresholdFields, k) {
				var names []string
				if k == "clear" && json.Unmarshal(v, &names) == nil && len(names) > 0 {
					set++ // checked below: each named threshold answered null
				}
				continue // null and unknown fields leave the thresholds as they are (Dynamo)
			}
			set++
			var sent, answered any
			_ = json.Unmarshal(v, &sent)
			_ = json.Unmarshal(mustJSONRaw(t, got, k), &answered)
			if fmt.Sprint(sent) != fmt.Sprint(answered) {
				t.Fatalf("%s: %s sent %s, answered %v", what, k, v, answered)
			}
		}
		var clear []string
		if err := json.Unmarshal(raw["clear"], &clear); err == nil {
			for _, k := range clear {
				if string(mustJSONRaw(t, got, k)) != "null" {
					t.Fatalf("%s: %s cleared, answered %s", what, k, mustJSONRaw(t, got, k))
				}
			}
		}
		if (set > 0) != (len(calls) == 1) {
			t.Fatalf("%s: %d fields set, %d writes", what, set, len(calls))
		}
	})
}

// thresholdsJSON is the GET /busy_threshold answer's thresholds.
func thresholdsJSON(t *testing.T, fs *fuzzServer) string {
	t.Helper()
	rec := httptest.NewRecorder()
	fs.s.Handler().ServeHTTP(rec, fuzzRequest("GET", "/busy_threshold", nil, false))
	var doc struct {
		Thresholds json.RawMessage `json:"thresholds"`
	}
	if rec.Code != 200 || json.Unmarshal(rec.Body.Bytes(), &doc) != nil {
		t.Fatalf("GET /busy_threshold: %d %s", rec.Code, snippet(rec.Body.Bytes()))
	}
	var v any
	_ = json.Unmarshal(doc.Thresholds, &v)
	return mustJSON(t, v)
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var norm any // map keys sorted, numbers as float64: one spelling per value
	_ = json.Unmarshal(b, &norm)
	b, _ = json.Marshal(norm)
	return string(b)
}

func mustJSONRaw(t *testing.T, v any, key string) json.RawMessage {
	t.Helper()
	b, _ := json.Marshal(v)
	var m map[string]json.RawMessage
	_ = json.Unmarshal(b, &m)
	return m[key]
}

// --- GET /busy_threshold?… ---------------------------------------------------------

func FuzzHTTPBusyThresholdGet(f *testing.F) {
	for _, q := range []string{"", "model=m", "model=zz", "digest=0", "model=m&model=n", "%zz", "a=%00&b=\xff", strings.Repeat("k=v&", 100)} {
		f.Add(q)
	}
	want := `[{"active_decode_blocks_threshold":null,"active_prefill_tokens_threshold":null,"active_prefill_tokens_threshold_frac":null,"model":"m"}]`
	f.Fuzz(func(t *testing.T, query string) {
		fs := newFuzzServer(false)
		req := fuzzRequest("GET", "/busy_threshold", nil, false)
		req.URL.RawQuery = query
		rec := fs.serve(t, req)
		checkStatus(t, "GET /busy_threshold?"+query, rec, adminShape, 200)
		checkWrites(t, "GET /busy_threshold", fs, rec.Code, 0)
		var doc struct {
			Thresholds any `json:"thresholds"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &doc); err != nil || mustJSON(t, doc.Thresholds) != want {
			t.Fatalf("GET /busy_threshold?%s: %s", query, snippet(rec.Body.Bytes()))
		}
	})
}

// --- POST /debug/route -----------------------------------------------------------------

func FuzzHTTPDebugRoute(f *testing.F) {
	for _, s := range chatSeeds {
		f.Add("", []byte(s), uint8(0))
	}
	for _, s := range completionSeeds {
		f.Add("endpoint=completions", []byte(s), uint8(0))
	}
	for _, st := range setupSeeds {
		f.Add("", []byte(chatSeeds[0]), st)
	}
	f.Add("endpoint=chat", []byte(completionSeeds[0]), uint8(0))
	f.Add("endpoint=%zz", []byte(chatSeeds[0]), uint8(0))
	f.Fuzz(func(t *testing.T, query string, body []byte, setup uint8) {
		st := decodeSetup(setup)
		fs := newFuzzServerSetup(false, st)
		req := fuzzRequest("POST", "/debug/route", body, false)
		req.URL.RawQuery = query
		rec := fs.serve(t, req)
		what := fmt.Sprintf("POST /debug/route?%s (setup %+v)", query, st)
		checkStatus(t, what, rec, openAIShape, 200, 400, 404, 413)
		checkWrites(t, what, fs, rec.Code, 0)
		// It only explains: nothing booked, nothing announced, no worker.
		fs.rep.fakeReplica.mu.Lock()
		events := len(fs.rep.events)
		fs.rep.fakeReplica.mu.Unlock()
		rt, _ := fs.rep.Router("m")
		inflight := 0
		if fs.dr != nil {
			inflight = fs.dr.InFlight()
		}
		if events != 0 || rt.Load().Len() != fs.preloaded || inflight != 0 || fs.workers.hits.Load() != 0 {
			t.Fatalf("%s: side effects: %d notifications, %d booked, %d tracked, %d worker hits",
				what, events, rt.Load().Len()-fs.preloaded, inflight, fs.workers.hits.Load())
		}
		if rec.Code != 200 {
			return
		}
		var doc struct {
			Model   string            `json:"model"`
			Workers []json.RawMessage `json:"workers"`
			Chosen  *string           `json:"chosen"`
			Error   *string           `json:"error"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &doc); err != nil || doc.Model != "m" || len(doc.Workers) == 0 || (doc.Chosen == nil) == (doc.Error == nil) {
			t.Fatalf("%s: 200 without the cost table: %s", what, snippet(rec.Body.Bytes()))
		}
	})
}

// --- POST /workers/register, /workers/deregister --------------------------------------

var registerSeeds = []string{
	`{"id":"w9","url":"http://10.0.0.9:8000","model":"m","block_size":16,"total_kv_blocks":1024,"max_num_batched_tokens":8192}`,
	`{"id":"w9","url":"http://10.0.0.9:8000","model":"m","block_size":16,"total_kv_blocks":1024,"max_num_batched_tokens":8192,"dp_ranks":4}`,
	`{"id":"ledger-1","url":"http://10.77.0.1:1","model":"ledger","block_size":16,"total_kv_blocks":1048576,"max_num_batched_tokens":8192}`,
	`{"id":"mock-1","url":"http://10.77.0.1:9101","model":"m","block_size":16,"total_kv_blocks":1024}`,
	`{"id":"p1","url":"http://10.0.0.7:8000","model":"m","block_size":16,"total_kv_blocks":1024,"role":"prefill"}`,
	`{"id":"d1","url":"http://10.0.0.8:8000","model":"m","block_size":16,"total_kv_blocks":1024,"role":"decode"}`,
	`{"id":"b1","url":"http://10.0.0.9:8000","model":"m","block_size":16,"role":"both"}`,
	`{"id":"x1","url":"http://10.0.0.9:8000","model":"m","block_size":16,"role":"Prefill"}`,
	`{"id":"w9","url":"http://x","model":"m","block_size":0}`,
	`{"id":"w9","url":"http://x","model":"m","block_size":16,"total_kv_blocks":-1}`,
	`{"id":"w9","url":"http://x","model":"m","block_size":16,"dp_ranks":-2}`,
	`{"id":"","url":"http://x","model":"m","block_size":16}`,
	`{"id":"w9","url":"","model":"m","block_size":16}`,
	`{"id":"w9","url":"http://x","model":"","block_size":16}`,
	`{"id":"w9","url":"http://x","model":"zz","block_size":16}`,
	`{"id":"w9","url":"http://x","model":"m","block_size":"16"}`,
	`{"id":"w9","url":"http://x","model":"m","block_size":1e10}`,
	`{"id":7}`,
	`{"id":`,
	`[]`,
	``,
}

func FuzzHTTPWorkersRegister(f *testing.F) {
	for _, s := range registerSeeds {
		f.Add([]byte(s), false)
	}
	f.Add([]byte(registerSeeds[0]), true)
	f.Fuzz(func(t *testing.T, body []byte, chunked bool) {
		fs := newFuzzServer(false)
		rec := fs.serve(t, fuzzRequest("POST", "/workers/register", body, chunked))
		what := "POST /workers/register"
		checkStatus(t, what, rec, adminShape, 200, 400, 404, 413, 422)
		calls := checkWrites(t, what, fs, rec.Code, 1)
		if rec.Code != 200 {
			return
		}
		var doc struct {
			Registered string `json:"registered"`
		}
		if json.Unmarshal(rec.Body.Bytes(), &doc) != nil || len(calls) != 1 || doc.Registered != calls[0].arg {
			t.Fatalf("%s: 200 %s after writes %+v", what, snippet(rec.Body.Bytes()), calls)
		}
		if _, ok := fs.rep.WorkerURL(router.WorkerID(doc.Registered)); !ok {
			t.Fatalf("%s: worker %q not registered after 200", what, doc.Registered)
		}
	})
}

func FuzzHTTPWorkersDeregister(f *testing.F) {
	for _, s := range []string{`{"id":"w1"}`, `{"id":"ledger-1"}`, `{"id":"unknown"}`, `{"id":""}`, `{"id":null}`, `{"id":5}`,
		`{"ID":"w1"}`, `{}`, `{"id":"w1","extra":true}`, `{"id":`, `"w1"`, ``} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		fs := newFuzzServer(false)
		rec := fs.serve(t, fuzzRequest("POST", "/workers/deregister", body, false))
		what := "POST /workers/deregister"
		checkStatus(t, what, rec, adminShape, 200, 400, 404, 413, 422)
		calls := checkWrites(t, what, fs, rec.Code, 1)
		if rec.Code != 200 {
			return
		}
		var doc struct {
			Deregistered string `json:"deregistered"`
		}
		if json.Unmarshal(rec.Body.Bytes(), &doc) != nil || len(calls) != 1 || doc.Deregistered != calls[0].arg || doc.Deregistered == "" {
			t.Fatalf("%s: 200 %s after writes %+v", what, snippet(rec.Body.Bytes()), calls)
		}
	})
}

// --- any request: routing, auth, the read-only endpoints -------------------------------

// FuzzHTTPRequest sends an arbitrary request line, Authorization header
// and body, parsed the way net/http's server parses them, to a replica
// with an admin token, API keys and the cluster endpoints mounted. Beyond
// the common invariants: nothing is written, routed or handed to the
// cluster layer without the right credential.
func FuzzHTTPRequest(f *testing.F) {
	admin, key := "Bearer "+fuzzAdminToken, "Bearer "+fuzzAPIKey
	seeds := []struct{ method, target, auth, body string }{
		{"GET", "/health", "", ""},
		{"GET", "/ready", "", ""},
		{"GET", "/metrics", "", ""},
		{"GET", "/cluster/status", "", ""},
		{"GET", "/cluster/status?digest=0", "", ""},
		{"GET", "/v1/models", key, ""},
		{"GET", "/v1/models", "", ""},
		{"GET", "/workers", admin, ""},
		{"GET", "/workers", "Bearer wrong", ""},
		{"GET", "/workers?model=m", "", ""},
		{"POST", "/workers/register?id=w9", "Bearer " + fuzzAPIKey, registerSeeds[0]},
		{"POST", "/busy_threshold?model=m", "Bearer", thresholdSeeds[1]},
		{"GET", "/busy_threshold?model=m", admin, ""},
		{"POST", "/busy_threshold", admin, thresholdSeeds[1]},
		{"POST", "/busy_threshold", "", thresholdSeeds[1]},
		{"POST", "/busy_threshold/", admin, thresholdSeeds[1]},
		{"POST", "/workers/register", admin, registerSeeds[0]},
		{"POST", "/workers/register", "bearer " + fuzzAdminToken, registerSeeds[0]},
		{"POST", "/workers/deregister", admin, `{"id":"w1"}`},
		{"POST", "/v1/chat/completions", key, chatSeeds[0]},
		{"POST", "/v1/chat/completions", admin, chatSeeds[0]},
		{"POST", "/v1/completions", key, completionSeeds[0]},
		{"POST", "/debug/route", admin, chatSeeds[0]},
		{"POST", "/debug/route", admin, `{"model":`},
		{"POST", "/debug/route", "", chatSeeds[0]},
		{"POST", "/cluster/join", admin, `{"node_id":"r4","raft_addr":"10.77.0.14:7000","http_addr":"10.77.0.14:8080"}`},
		{"POST", "/cluster/join", "", `{"node_id":"r4","raft_addr":"10.77.0.14:7000"}`},
		{"POST", "/cluster/remove", admin, `{"node_id":"r3"}`},
		{"POST", "/cluster/apply", admin, "\x01\x01"},
		{"GET", "/cluster/commit", admin, ""},
		{"GET", "/cluster/commit", "", ""},
		{"POST", "/cluster//join", "", `{}`},
		{"POST", "/Cluster/join", "", `{}`},
		{"POST", "/workers/../workers/register", "", registerSeeds[0]},
		{"DELETE", "/busy_threshold", admin, ""},
		{"PUT", "/v1/chat/completions", key, chatSeeds[0]},
		{"OPTIONS", "*", "", ""},
		{"GET", "/nope", "", ""},
		{"GET", "http://replica.fuzz/health", "", ""},
		{"POST", "/select", key, `{"model_name":"m","sequence_hashes":[1,2],"isl_tokens":40}`},
		{"POST", "/select_and_reserve", key, `{"model_name":"m","selection_id":"s1","block_hashes":[1,2]}`},
		{"POST", "/select_and_reserve", "", `{"model_name":"m"}`},
		{"POST", "/reservations", key, `{"model_name":"m","selection_id":"s2","worker_id":"w1","isl_tokens":16,"effective_prefill_tokens":8}`},
		{"POST", "/reservations/s1/prefill_complete", key, ""},
		{"POST", "/reservations/s1/output_block", key, `{"decay_fraction":0.5}`},
		{"DELETE", "/reservations/s1", key, ""},
	}
	for _, s := range seeds {
		f.Add(s.method, s.target, s.auth, []byte(s.body), uint8(0))
	}
	for st := range uint8(4) {
		f.Add("GET", "/ready?draining=404", "", []byte(nil), st)
		f.Add("GET", "/ready", "", []byte(nil), st)
	}
	// state: bit 0 the replica is not ready, bit 1 it is draining (SIGTERM).
	f.Fuzz(func(t *testing.T, method, target, auth string, body []byte, state uint8) {
		var raw bytes.Buffer
		fmt.Fprintf(&raw, "%s %s HTTP/1.1\r\nHost: replica.fuzz\r\nContent-Type: application/json\r\nContent-Length: %d\r\n", method, target, len(body))
		if auth != "" {
			fmt.Fprintf(&raw, "Authorization: %s\r\n", auth)
		}
		raw.WriteString("\r\n")
		raw.Write(body)
		req, err := http.ReadRequest(bufio.NewReader(&raw))
		if err != nil || req.Method != method || req.Header.Get("Authorization") != auth || req.ContentLength != int64(len(body)) {
			return // net/http's server would not hand this to a handler
		}
		req.RemoteAddr = "192.0.2.1:1234"
		path := req.URL.Path                        // before gin's redirect rewrites it
		draining := req.URL.Query().Get("draining") // before the handler sees the request
		fs := newFuzzServer(true)
		fs.rep.ready, fs.rep.drain = state&1 == 0, state&2 != 0
		rec := fs.serve(t, req)
		what := fmt.Sprintf("%s %s (Authorization %q)", method, target, auth)
		// OpenAI's shape on /v1 and for unknown routes; on admin routes
		// requireAdmin's {"error": "…"} or, from /debug/route's handler,
		// OpenAI's (adminShape takes both).
		shape := adminShape
		if strings.HasPrefix(path, "/v1/") || !knownRoute(method, path) {
			shape = openAIShape
		}
		reserved := false // a reservation made (selection.go) holds its booking until released
		if selectionRoute(method, path) {
			shape = adminShape
			reserved = rec.Code == http.StatusCreated || (rec.Code == http.StatusOK && path == "/select_and_reserve")
		}
		switch rec.Code {
		case http.StatusMovedPermanently, http.StatusTemporaryRedirect:
			// gin's RedirectTrailingSlash: only to the same path without
			// (or with) its trailing slash, and nothing ran.
			loc, err := url.Parse(rec.Header().Get("Location"))
			if err != nil || strings.TrimSuffix(loc.Path, "/") != strings.TrimSuffix(path, "/") || loc.Path == path {
				t.Fatalf("%s: redirect %d to %q", what, rec.Code, rec.Header().Get("Location"))
			}
		case http.StatusServiceUnavailable, http.StatusNotFound:
			if method+" "+path != "GET /ready" {
				checkStatus(t, what, rec, shape, 404) // 503 only from /ready
				break
			}
			// /ready: 503 while not ready; 404 instead for HAProxy's
			// disable-on-404 while draining, asked for by ?draining=404.
			var doc struct {
				Ready  *bool  `json:"ready"`
				Reason string `json:"reason"`
			}
			want := http.StatusServiceUnavailable
			if state&2 != 0 && draining == "404" {
				want = http.StatusNotFound
			}
			if state&1 == 0 || rec.Code != want || json.Unmarshal(rec.Body.Bytes(), &doc) != nil || doc.Ready == nil || *doc.Ready || doc.Reason == "" {
				t.Fatalf("%s (state %d): /ready answered %d, want %d with ready false and a reason: %s", what, state, rec.Code, want, snippet(rec.Body.Bytes()))
			}
		default:
			checkStatus(t, what, rec, shape, 200, 201, 400, 401, 404, 409, 413)
			if method+" "+path == "GET /ready" && (rec.Code == 200) != (state&1 == 0) {
				t.Fatalf("%s (state %d): /ready answered %d", what, state, rec.Code)
			}
		}
		if !reserved {
			checkNoLoad(t, what, fs)
		}
		adminOK := authorized(auth, fuzzAdminToken)
		keyOK := authorized(auth, fuzzAPIKey)
		if n := len(fs.rep.calls()); n > 0 && !adminOK {
			t.Fatalf("%s: %d writes without the admin token", what, n)
		}
		if n := fs.cluster.Load(); n > 0 && !adminOK {
			t.Fatalf("%s: the cluster layer got the request without the admin token", what)
		}
		if n := fs.workers.hits.Load(); n > 0 && !keyOK {
			t.Fatalf("%s: routed to a worker without an API key", what)
		}
		// The credential each route needs decides 401, before anything else
		// but the body limit.
		if known := knownRoute(method, path); known && rec.Code != http.StatusRequestEntityTooLarge {
			need := adminOK
			if strings.HasPrefix(path, "/v1/") || selectionRoute(method, path) {
				need = keyOK
			} else if !adminRoute(path) {
				need = true
			}
			if (rec.Code == http.StatusUnauthorized) == need {
				t.Fatalf("%s: status %d, credential valid: %v", what, rec.Code, need)
			}
		}
		checkWrites(t, what, fs, rec.Code, 1)
	})
}

// authorized mirrors bearer(): "Bearer " then the token, spaces trimmed.
func authorized(header, token string) bool {
	t, ok := strings.CutPrefix(header, "Bearer ")
	return ok && strings.TrimSpace(t) == token
}

// adminRoute: behind requireAdmin.
func adminRoute(path string) bool {
	switch path {
	case "/busy_threshold", "/debug/route", "/workers", "/workers/register", "/workers/deregister",
		"/cluster/join", "/cluster/remove", "/cluster/apply", "/cluster/commit":
		return true
	}
	return false
}

// knownRoute: the routes server.go mounts; anything else is NoRoute's
// OpenAI-shaped 404.
func knownRoute(method, path string) bool {
	switch method + " " + path {
	case "POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health", "GET /ready",
		"GET /metrics", "GET /cluster/status", "GET /busy_threshold", "POST /busy_threshold", "POST /debug/route",
		"GET /workers", "POST /workers/register", "POST /workers/deregister", "POST /cluster/join",
		"POST /cluster/remove", "POST /cluster/apply", "GET /cluster/commit":
		return true
	}
	return selectionRoute(method, path)
}

// selectionRoute: Dynamo's selection API (selection.go), behind the API
// keys, answering {"error": "…"}.
func selectionRoute(method, path string) bool {
	switch method + " " + path {
	case "POST /select", "POST /select_and_reserve", "POST /reservations":
		return true
	}
	rest, ok := strings.CutPrefix(path, "/reservations/")
	if !ok || rest == "" {
		return false
	}
	if method == "DELETE" {
		return !strings.Contains(rest, "/")
	}
	id, ok := strings.CutSuffix(rest, "/prefill_complete")
	if !ok {
		id, ok = strings.CutSuffix(rest, "/output_block")
	}
	return method == "POST" && ok && id != "" && !strings.Contains(id, "/")
}
