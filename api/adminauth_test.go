package api

import (
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/router"
)

// adminCall is one admin request.
type adminCall struct{ method, path, body string }

// everyAdminCall is every admin endpoint, with a body it would accept.
var everyAdminCall = []adminCall{
	{"GET", "/busy_threshold", ""},
	{"POST", "/busy_threshold", `{"model":"m","active_decode_blocks_threshold":0.5}`},
	{"POST", "/debug/route", `{"model":"m","prompt":"hi"}`},
	{"GET", "/debug/decisions", ""},
	{"GET", "/workers", ""},
	{"POST", "/workers/register", `{"id":"evil","url":"http://127.0.0.1:9999","model":"m","block_size":16}`},
	{"POST", "/workers/deregister", `{"id":"w1"}`},
	{"POST", "/workers/move", `{"id":"w1","group":2}`},
	{"POST", "/workers/rebalance", `{}`},
	{"GET", "/cluster/raft_groups", ""},
	{"POST", "/cluster/raft_groups", `{"groups":4}`},
}

// adminDo sends c from remote (host:port) with the given Authorization
// header ("" for none).
func adminDo(s *Server, c adminCall, remote, auth string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(c.method, c.path, strings.NewReader(c.body))
	req.RemoteAddr = remote
	req.Header.Set("Content-Type", "application/json")
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	rec := httptest.NewRecorder()
	s.Handler().ServeHTTP(rec, req)
	return rec
}

// TestAPIAdminTokenRequired: with an admin token, every admin endpoint and
// worker registration answers 401 without it or with a wrong one — from
// this host too (make run's strangers are local users) — and lets the
// right one through.
func TestAPIAdminTokenRequired(t *testing.T) {
	rep := newFakeReplica("m", router.DefaultConfig())
	rep.addWorker("m", "w1", "http://127.0.0.1:9001")
	s := New(Config{Registry: prometheus.NewRegistry(), AdminToken: "sekret", AllowLoopbackWorkers: true}, rep)
	for _, c := range everyAdminCall {
		for _, remote := range []string{"127.0.0.1:40000", "[::1]:40000", "192.0.2.1:40000"} {
			for _, auth := range []string{"", "Bearer wrong", "sekret", "Basic c2VrcmV0"} {
				if rec := adminDo(s, c, remote, auth); rec.Code != http.StatusUnauthorized {
					t.Errorf("%s %s from %s, Authorization %q: %d, want 401", c.method, c.path, remote, auth, rec.Code)
				}
			}
		}
		if rec := adminDo(s, c, "127.0.0.1:40000", "Bearer sekret"); rec.Code == http.StatusUnauthorized {
			t.Errorf("%s %s with the token: 401", c.method, c.path)
		}
	}
	rep.mu.Lock()
	_, evil := rep.urls["evil"]
	rep.mu.Unlock()
	if !evil {
		t.Error("the registration with the token did not reach the replica (the test's body is wrong)")
	}
}

// TestAPIAdminOpenToLoopback: the exemption serves only the paths it names,
// only to loopback connections (never on a forwarded-for header), counts
// each use, and refuses to name worker registration and the other paths
// that must keep their credential.
func TestAPIAdminOpenToLoopback(t *testing.T) {
	rep := newFakeReplica("m", router.DefaultConfig())
	rep.addWorker("m", "w1", "http://127.0.0.1:9001")
	reg := prometheus.NewRegistry()
	var logs strings.Builder
	s := New(Config{Registry: reg, AdminToken: "sekret", AllowLoopbackWorkers: true, AdminOpenToLoopback: []string{"/busy_threshold"},
		Logger: slog.New(slog.NewTextHandler(&logs, nil))}, rep)
	open := 0
	for _, c := range everyAdminCall {
		for _, remote := range []string{"127.0.0.1:40000", "127.0.0.2:40000", "[::1]:40000", "[::ffff:127.0.0.1]:40000"} {
			rec := adminDo(s, c, remote, "")
			if c.path == "/busy_threshold" {
				open++
				if rec.Code != http.StatusOK {
					t.Errorf("%s %s from %s without a token: %d %s, want 200 (exempt)", c.method, c.path, remote, rec.Code, rec.Body)
				}
			} else if rec.Code != http.StatusUnauthorized {
				t.Errorf("%s %s from %s without a token: %d, want 401 (not exempt)", c.method, c.path, remote, rec.Code)
			}
		}
		// Off loopback, or claiming loopback in a header: the token is needed.
		req := httptest.NewRequest(c.method, c.path, strings.NewReader(c.body))
		req.RemoteAddr = "192.0.2.1:40000"
		req.Header.Set("X-Forwarded-For", "127.0.0.1")
		req.Header.Set("X-Real-Ip", "127.0.0.1")
		rec := httptest.NewRecorder()
		s.Handler().ServeHTTP(rec, req)
		if rec.Code != http.StatusUnauthorized {
			t.Errorf("%s %s from 192.0.2.1 (forwarded for 127.0.0.1): %d, want 401", c.method, c.path, rec.Code)
		}
	}
	if got := s.exempt.used.Load(); int(got) != open {
		t.Errorf("kvrouter_admin_loopback_exempt_total %v, want %d", got, open)
	}
	for _, want := range []string{"WITHOUT the admin token", "/busy_threshold"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("log lacks %q:\n%s", want, logs.String())
		}
	}
	if strings.Count(logs.String(), "served WITHOUT the admin token") != 1 {
		t.Errorf("want one use warning per minute:\n%s", logs.String())
	}

	for _, bad := range [][]string{{"/workers/register"}, {"/workers/deregister"}, {"/workers/move"}, {"/debug/decisions"},
		{"/cluster/raft_groups"}, {"/busy_threshold", "/cluster/join"}, {"/busy_threshold/"}, {"busy_threshold"}} {
		if err := CheckAdminOpenToLoopback(bad); err == nil {
			t.Errorf("CheckAdminOpenToLoopback(%q) accepted", bad)
		}
	}
	if err := CheckAdminOpenToLoopback([]string{"/busy_threshold", "/workers", "/debug/route"}); err != nil {
		t.Error(err)
	}
	// A path that cannot be exempt is ignored by New (serve refuses it first).
	s2 := New(Config{Registry: prometheus.NewRegistry(), AdminToken: "sekret", AllowLoopbackWorkers: true,
		AdminOpenToLoopback: []string{"/workers/register"}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, rep)
	if rec := adminDo(s2, everyAdminCall[5], "127.0.0.1:40000", ""); rec.Code != http.StatusUnauthorized {
		t.Errorf("register exempted: %d", rec.Code)
	}
}

// TestAPIRaftGroupsPeerCredential: /cluster/raft_groups takes the cluster
// credential (Config.ClusterAuth), not the admin token; without
// ClusterAuth it falls back to the admin token.
func TestAPIRaftGroupsPeerCredential(t *testing.T) {
	rep := newFakeReplica("m", router.DefaultConfig())
	memberOnly := func(r *http.Request) (int, error) {
		if r.Header.Get("X-Test-Member") != "r1" {
			return http.StatusUnauthorized, errors.New("cluster endpoints need a node's client certificate: not a TLS connection")
		}
		return 0, nil
	}
	s := New(Config{Registry: prometheus.NewRegistry(), AdminToken: "sekret", ClusterAuth: memberOnly,
		AdminOpenToLoopback: []string{"/busy_threshold"}}, rep)
	for _, c := range everyAdminCall[9:] {
		for _, auth := range []string{"", "Bearer sekret"} {
			rec := adminDo(s, c, "127.0.0.1:40000", auth)
			if rec.Code != http.StatusUnauthorized || !strings.Contains(rec.Body.String(), "client certificate") {
				t.Errorf("%s %s, Authorization %q, no member credential: %d %s, want 401", c.method, c.path, auth, rec.Code, rec.Body)
			}
		}
		req := httptest.NewRequest(c.method, c.path, strings.NewReader(c.body))
		req.Header.Set("X-Test-Member", "r1")
		rec := httptest.NewRecorder()
		s.Handler().ServeHTTP(rec, req)
		if rec.Code != http.StatusNotFound { // the fake replica is not sharded: past the check
			t.Errorf("%s %s as a member: %d %s, want 404 from the handler", c.method, c.path, rec.Code, rec.Body)
		}
	}
	s = New(Config{Registry: prometheus.NewRegistry(), AdminToken: "sekret"}, rep)
	for _, c := range everyAdminCall[9:] {
		if rec := adminDo(s, c, "127.0.0.1:40000", ""); rec.Code != http.StatusUnauthorized {
			t.Errorf("%s %s without ClusterAuth or token: %d, want 401", c.method, c.path, rec.Code)
		}
		if rec := adminDo(s, c, "127.0.0.1:40000", "Bearer sekret"); rec.Code != http.StatusNotFound {
			t.Errorf("%s %s without ClusterAuth, with the token: %d, want 404", c.method, c.path, rec.Code)
		}
	}
}
