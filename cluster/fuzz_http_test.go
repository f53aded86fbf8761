package cluster_test

// Fuzz targets for the internal HTTP endpoints (Node.Handler, http.go),
// driven in process with httptest against two real nodes built once per
// target:
//
//   - a ready single-node leader (clustertest, real boltdb, real fsm), where
//     requests reach Raft: every input there must leave the log exactly as
//     the contract says (nothing proposed for a rejected request, one entry
//     per apply);
//   - an idle node: started but never formed, so it knows no leader. Every
//     input reaches its decoding, and a well-formed join or remove ends in
//     "no leader" instead of changing a membership a fuzzer could break for
//     good (a join of an unreachable voter costs a single-node cluster its
//     quorum).
//
// `go test ./cluster/` runs the seeds; .ci/fuzz-all fuzzes each target.

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/cluster/clustertest"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// fuzzToken is both nodes' bearer token.
const fuzzToken = "s3cret"

type httpFixture struct {
	leader, idle   *cluster.Node
	leaderH, idleH http.Handler
	sm             *fsm.FSM // the leader's
}

// newHTTPFixture builds the two nodes for one fuzz target; tb's cleanup
// shuts them down. Snapshots are rare (a long run appends thousands of
// entries) and logs are dropped.
func newHTTPFixture(tb testing.TB) *httpFixture {
	tb.Helper()
	var sm *fsm.FSM
	c := clustertest.New(tb, 1, clustertest.Options{
		Quiet:             true,
		SnapshotThreshold: 8192,
		TrailingLogs:      1024,
		SnapshotInterval:  10 * time.Second,
		NewFSM: func(int) cluster.StateMachine {
			f, err := fsm.NewFSM(router.DefaultConfig())
			if err != nil {
				tb.Fatalf("fsm.NewFSM: %v", err)
			}
			sm = f
			return f
		},
		// Wired as the composition layer wires the real fsm.
		Configure: func(_ int, c *cluster.Config, _ cluster.StateMachine) {
			c.AuthToken = fuzzToken
			c.ResponseError = fsm.ResponseError
			c.DecodeResult = fsm.DecodeResult
			c.ForwardErrors = fsm.ForwardErrors()
		},
	})
	leader := c.WaitLeader().Node()

	var idle *cluster.Node
	poll.Until(tb, 10*time.Second, 50*time.Millisecond, func() error {
		addr, err := freeLoopbackAddr()
		if err != nil {
			return err
		}
		// Another process may take the port between release and bind.
		idle, err = cluster.New(cluster.Config{
			NodeID: "idle", RaftAddr: addr, DataDir: tb.TempDir(), AuthToken: fuzzToken,
			Logger: slog.New(slog.DiscardHandler), Registry: prometheus.NewRegistry(),
		}, clustertest.NewFSM())
		return err
	})
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = idle.Shutdown(ctx)
	})
	return &httpFixture{leader: leader, idle: idle, leaderH: leader.Handler(), idleH: idle.Handler(), sm: sm}
}

func freeLoopbackAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// raftView is what a request must not change unless it was accepted: the
// log's end and the configuration. Read from raft's Stats, which waits for
// the configuration (Status gives up on it after a second, which a loaded
// CI host could turn into a false "configuration changed").
type raftView struct {
	last   uint64
	config string
}

func viewOf(t testing.TB, n *cluster.Node) raftView {
	st := n.Stats()
	last, err := strconv.ParseUint(st["last_log_index"], 10, 64)
	if err != nil || st["latest_configuration"] == "" {
		t.Fatalf("raft stats %v: %v", st, err)
	}
	return raftView{last: last, config: st["latest_configuration"]}
}

// envelope is the union of the JSON answers of join, remove and apply
// (adminResponse, applyEnvelope); unknown keys are a shape change.
type envelope struct {
	OK       bool            `json:"ok"`
	Result   json.RawMessage `json:"result"`
	Error    string          `json:"error"`
	Code     string          `json:"code"`
	Sentinel string          `json:"sentinel"`
}

// post sends body to path with the token (and X-Kvrouter-Forwarded-By when
// forwardedBy is set) and decodes the envelope, failing t on any answer
// that is not one.
func post(t *testing.T, h http.Handler, path string, body []byte, forwardedBy string) (int, envelope) {
	t.Helper()
	req := httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+fuzzToken)
	if forwardedBy != "" {
		req.Header.Set("X-Kvrouter-Forwarded-By", forwardedBy)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec.Code, decodeEnvelope(t, path, rec)
}

func decodeEnvelope(t *testing.T, what string, rec *httptest.ResponseRecorder) envelope {
	t.Helper()
	if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
		t.Fatalf("%s: %d with Content-Type %q: %q", what, rec.Code, ct, rec.Body.Bytes())
	}
	var env envelope
	dec := json.NewDecoder(bytes.NewReader(rec.Body.Bytes()))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&env); err != nil {
		t.Fatalf("%s: %d answer is not an envelope (%v): %q", what, rec.Code, err, rec.Body.Bytes())
	}
	if rec.Code != http.StatusOK && (env.Error == "" || env.Code == "") {
		t.Fatalf("%s: %d without error and code: %q", what, rec.Code, rec.Body.Bytes())
	}
	return env
}

// wellFormedAdmin reports whether body is what the handlers accept: a JSON
// value (the first one; the handler's json.Decoder reads no further) that
// decodes into the request with the required fields non-empty.
func wellFormedAdmin(body []byte, join bool) bool {
	var req struct {
		NodeID   string `json:"node_id"`
		RaftAddr string `json:"raft_addr"`
		HTTPAddr string `json:"http_addr"`
	}
	if json.NewDecoder(bytes.NewReader(body)).Decode(&req) != nil || req.NodeID == "" {
		return false
	}
	if !join {
		return true
	}
	// The handler refuses a raft_addr that is not host:port with a port in
	// 1..65535: such a voter would cost the cluster its quorum.
	host, port, err := net.SplitHostPort(req.RaftAddr)
	p, perr := strconv.Atoi(port)
	return err == nil && host != "" && perr == nil && p >= 1 && p <= 65535
}

// fuzzAdmin checks one join or remove body against both nodes.
func fuzzAdmin(t *testing.T, fx *httpFixture, path string, join bool, body []byte, forwarded bool) {
	by := ""
	if forwarded {
		by = "n9"
	}
	ok := wellFormedAdmin(body, join)

	before := viewOf(t, fx.idle)
	code, env := post(t, fx.idleH, path, body, by)
	switch {
	case !ok && (code != http.StatusBadRequest || env.Code != "bad_request"):
		t.Fatalf("idle %s %q: %d %+v, want 400 bad_request", path, body, code, env)
	case ok && (code != http.StatusServiceUnavailable || env.Code != "no_leader"):
		t.Fatalf("idle %s %q: %d %+v, want 503 no_leader", path, body, code, env)
	}
	if after := viewOf(t, fx.idle); after != before {
		t.Fatalf("idle %s %q changed raft: %+v → %+v", path, body, before, after)
	}
	if ok {
		return // a real membership change: only the idle node sees it
	}

	before = viewOf(t, fx.leader)
	code, env = post(t, fx.leaderH, path, body, by)
	if code != http.StatusBadRequest || env.Code != "bad_request" || env.OK {
		t.Fatalf("leader %s %q: %d %+v, want 400 bad_request", path, body, code, env)
	}
	if after := viewOf(t, fx.leader); after != before {
		t.Fatalf("leader %s %q: rejected, yet raft changed: %+v → %+v", path, body, before, after)
	}
}

var joinSeeds = []string{
	`{"node_id":"n2","raft_addr":"127.0.0.1:7002","http_addr":"http://127.0.0.1:8002"}`,
	`{"node_id":"n2","raft_addr":"10.0.0.2:7000"}`,
	`{"node_id":"n2","raft_addr":"10.0.0.2:7000"} trailing`,
	`{"node_id":"n2","raft_addr":"10.0.0.2:7000","extra":[1,2]}`,
	`{"NODE_ID":"n2","Raft_Addr":"10.0.0.2:7000"}`,
	`{"node_id":"","raft_addr":"10.0.0.2:7000"}`,
	`{"node_id":"n2"}`,
	`{"node_id":"n2","raft_addr":""}`,
	`{"node_id":"x","raft_addr":"garbage"}`, // once made the leader a candidate for good
	`{"node_id":"x","raft_addr":":7000"}`,
	`{"node_id":"x","raft_addr":"h:0"}`,
	`{"node_id":7,"raft_addr":"10.0.0.2:7000"}`,
	`{"node_id":"n2","raft_addr":null}`,
	`{"node_id":"n2","raft_addr":"10.0.0.2:7000"`,
	`[{"node_id":"n2","raft_addr":"10.0.0.2:7000"}]`,
	`null`, `{}`, ``, "\xff",
}

// FuzzClusterHTTPJoin: POST /cluster/join with any body never panics and
// always answers an envelope. A body that is not a JSON object with
// non-empty node_id and raft_addr gets 400 bad_request and proposes
// nothing: the leader's log and configuration are unchanged. A well-formed
// one is routed on (503 no_leader on the idle node, forwarded or not).
// Whether raft_addr is a dialable host:port is not checked by the handler,
// so not here either.
func FuzzClusterHTTPJoin(f *testing.F) {
	for _, s := range joinSeeds {
		f.Add([]byte(s), false)
	}
	f.Add([]byte(joinSeeds[0]), true)
	fx := newHTTPFixture(f)
	f.Fuzz(func(t *testing.T, body []byte, forwarded bool) {
		fuzzAdmin(t, fx, "/cluster/join", true, body, forwarded)
	})
}

// FuzzClusterHTTPRemove: POST /cluster/remove, with the invariants of
// FuzzClusterHTTPJoin for a body that must carry a non-empty node_id.
func FuzzClusterHTTPRemove(f *testing.F) {
	for _, s := range []string{
		`{"node_id":"n2"}`,
		`{"node_id":"n0"}`,
		`{"node_id":"n2","raft_addr":"ignored"}`,
		`{"node_id":"n2"}{"node_id":""}`,
		`{"node_id":""}`,
		`{"node_id":false}`,
		`{"id":"n2"}`,
		`"n2"`, `null`, `{}`, ``, `{"node_id":"n2"`,
	} {
		f.Add([]byte(s), false)
	}
	f.Add([]byte(`{"node_id":"n2"}`), true)
	fx := newHTTPFixture(f)
	f.Fuzz(func(t *testing.T, body []byte, forwarded bool) {
		fuzzAdmin(t, fx, "/cluster/remove", false, body, forwarded)
	})
}

// applySeeds are commands of the real fsm (a worker registration, a KV
// batch for it and for an unknown worker, a refused model config, a node
// registration, a clock tick), an entry of an unknown type with and
// without the ignore bit, and bytes that are no command.
func applySeeds(tb testing.TB) [][]byte {
	must := func(b []byte, err error) []byte {
		if err != nil {
			tb.Fatal(err)
		}
		return b
	}
	big := 2.0
	return [][]byte{
		must(fsm.EncodeRegisterWorker(fsm.RegisterWorker{ID: "w1", DPRanks: 1, Address: "http://w1", Model: "m", TotalBlocks: 1000})),
		kvBatchB(tb, "w1", 1, 2, 2),
		kvBatchB(tb, "ghost", 1, 1, 1),
		must(fsm.EncodeSetModelConfig(fsm.SetModelConfig{Model: "m", Thresholds: router.Thresholds{ActiveDecodeBlocks: &big}})),
		must(fsm.EncodeRegisterNode(fsm.RegisterNode{NodeID: "n0", RaftAddr: "127.0.0.1:7000", HTTPAddr: "http://127.0.0.1:8000"})),
		must(fsm.EncodeTick(fsm.Tick{Now: 1752000000000000000})),
		must(fsm.EncodeDeregisterWorker(fsm.DeregisterWorker{ID: "w1"})),
		{77 | 0x80, 1, 0},
		{77, 1, 0},
		[]byte(`{"not":"a command"}`),
		{},
	}
}

// FuzzClusterHTTPApply: POST /cluster/apply with any body never panics and
// always answers an envelope. The cluster layer does not know command
// formats, so on the leader every body becomes exactly one log entry
// (forwarded header or not) and the answer is the fsm's: a result, or
// "rejected" with the fsm's error, and then the fsm state is unchanged
// (fsm/DESIGN.md: every Err leaves the state as it was). On the idle node
// every body gets 503 no_leader and nothing reaches its log.
func FuzzClusterHTTPApply(f *testing.F) {
	for _, s := range applySeeds(f) {
		f.Add(s, false)
	}
	f.Add(applySeeds(f)[0], true)
	fx := newHTTPFixture(f)
	f.Fuzz(func(t *testing.T, body []byte, forwarded bool) {
		by := ""
		if forwarded {
			by = "n9"
		}
		before := viewOf(t, fx.idle)
		code, env := post(t, fx.idleH, "/cluster/apply", body, by)
		if code != http.StatusServiceUnavailable || env.Code != "no_leader" {
			t.Fatalf("idle apply %q: %d %+v, want 503 no_leader", body, code, env)
		}
		if after := viewOf(t, fx.idle); after != before {
			t.Fatalf("idle apply %q changed raft: %+v → %+v", body, before, after)
		}

		before = viewOf(t, fx.leader)
		digest := fx.sm.Digest()
		code, env = post(t, fx.leaderH, "/cluster/apply", body, by)
		after := viewOf(t, fx.leader)
		if code != http.StatusOK {
			t.Fatalf("leader apply %q: %d %+v", body, code, env)
		}
		if after.last != before.last+1 || after.config != before.config {
			t.Fatalf("leader apply %q: log %d → %d, want exactly one entry", body, before.last, after.last)
		}
		switch env.Code {
		case "":
			var res fsm.ApplyResult
			if err := json.Unmarshal(env.Result, &res); err != nil {
				t.Fatalf("leader apply %q: result %s is not an ApplyResult: %v", body, env.Result, err)
			}
		case "rejected":
			if env.Error == "" {
				t.Fatalf("leader apply %q: rejected without the error", body)
			}
			if d := fx.sm.Digest(); d != digest {
				t.Fatalf("leader apply %q: rejected (%s), yet the fsm state changed", body, env.Error)
			}
		default:
			t.Fatalf("leader apply %q: code %q (%s)", body, env.Code, env.Error)
		}
	})
}

// FuzzClusterHTTPRoute sends any method, target, Authorization header and
// body to the whole handler. Invariants: no panic; a wrong or missing token
// → 401 unauthorized on every route, before anything else; every JSON
// answer is valid JSON, and one of at least 400 is an envelope with an
// error and a code; nothing ever changes either node's log or
// configuration (the idle node knows no leader; a non-POST request cannot
// reach join, remove or apply, so the leader gets only those);
// GET /cluster/commit answers 503 no_leader on the idle node and, on the
// leader, 200 with its current term and a commit index inside its log.
func FuzzClusterHTTPRoute(f *testing.F) {
	auth := "Bearer " + fuzzToken
	for _, s := range []struct{ method, target, auth, body string }{
		{"GET", "/cluster/commit", auth, ""},
		{"GET", "/cluster/status", auth, ""},
		{"HEAD", "/cluster/commit", auth, ""},
		{"GET", "/cluster/commit?x=1#f", auth, ""},
		{"GET", "/cluster/../cluster/commit", auth, ""},
		{"GET", "/cluster//commit", auth, ""},
		{"POST", "/cluster/commit", auth, "{}"},
		{"POST", "/cluster/apply", auth, "x"},
		{"POST", "/cluster/join", auth, joinSeeds[0]},
		{"POST", "/cluster/remove", auth, `{"node_id":"n2"}`},
		{"PUT", "/cluster/join", auth, joinSeeds[0]},
		{"post", "/cluster/join", auth, joinSeeds[0]},
		{"DELETE", "/cluster/remove", auth, `{"node_id":"n0"}`},
		{"GET", "/cluster/nope", auth, ""},
		{"GET", "/", auth, ""},
		{"GET", "/cluster/commit", "Bearer wrong", ""},
		{"GET", "/cluster/commit", fuzzToken, ""},
		{"POST", "/cluster/apply", "", "x"},
		{"GET", "/cluster/status", "bearer " + fuzzToken, ""},
	} {
		f.Add(s.method, s.target, s.auth, []byte(s.body))
	}
	fx := newHTTPFixture(f)
	f.Fuzz(func(t *testing.T, method, target, auth string, body []byte) {
		req, err := http.NewRequest(method, "http://node"+target, nil)
		if err != nil {
			return // not a request a client could send
		}
		serve := func(name string, n *cluster.Node, h http.Handler) *httptest.ResponseRecorder {
			r := req.Clone(context.Background())
			r.Body = io.NopCloser(bytes.NewReader(body))
			r.Header.Set("Authorization", auth)
			what := name + " " + method + " " + target
			before := viewOf(t, n)
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, r)
			if after := viewOf(t, n); after != before {
				t.Fatalf("%s: raft changed: %+v → %+v", what, before, after)
			}
			if rec.Header().Get("Content-Type") == "application/json" {
				if !json.Valid(rec.Body.Bytes()) {
					t.Fatalf("%s: %d invalid JSON: %q", what, rec.Code, rec.Body.Bytes())
				}
				if rec.Code >= 400 {
					decodeEnvelope(t, what, rec)
				}
			}
			if auth != "Bearer "+fuzzToken && rec.Code != http.StatusUnauthorized {
				t.Fatalf("%s with Authorization %q: %d, want 401", what, auth, rec.Code)
			}
			return rec
		}
		rec := serve("idle", fx.idle, fx.idleH)
		if method == http.MethodPost || auth != "Bearer "+fuzzToken {
			return // POST may reach join, remove or apply: the leader's log is the other targets'
		}
		// Of the routes a non-POST request can reach, only commit answers
		// 503 on the idle node.
		isCommit := rec.Code == http.StatusServiceUnavailable
		if isCommit && rec.Body.Len() > 0 && !bytes.Contains(rec.Body.Bytes(), []byte(`"code":"no_leader"`)) {
			t.Fatalf("idle %s %s: 503 %q", method, target, rec.Body.Bytes())
		}
		rec = serve("leader", fx.leader, fx.leaderH)
		if !isCommit {
			return
		}
		if rec.Code != http.StatusOK {
			t.Fatalf("leader %s %s: %d %q, want the commit position", method, target, rec.Code, rec.Body.Bytes())
		}
		var cr struct {
			CommitIndex uint64 `json:"commit_index"`
			Term        uint64 `json:"term"`
		}
		dec := json.NewDecoder(bytes.NewReader(rec.Body.Bytes()))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&cr); err != nil {
			t.Fatalf("leader %s %s: %v: %q", method, target, err, rec.Body.Bytes())
		}
		if last := viewOf(t, fx.leader).last; cr.Term != fx.leader.Term() || cr.CommitIndex == 0 || cr.CommitIndex > last {
			t.Fatalf("leader %s %s: %+v (term %d, log end %d)", method, target, cr, fx.leader.Term(), last)
		}
	})
}
