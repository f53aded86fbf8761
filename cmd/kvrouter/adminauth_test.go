package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api/prompt"
	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/internal/pki"
	"github.com/kvrouter/kvrouter/internal/poll"
)

// TestServeAdminAndClusterCredentials is issue 26's "make run keeps
// strangers out", on one replica started as run.sh starts it (TLS
// material, admin token and worker API key from files,
// --admin-open-to-loopback /busy_threshold, plaintext allowed on loopback):
//   - registering a worker without the token (or with a wrong one) is 401,
//     over plaintext from this host and over HTTPS; deregistering too;
//   - /cluster/raft_groups (GET and POST) is 401 without a member
//     certificate: over plaintext, and over HTTPS without a client
//     certificate, the admin token notwithstanding; a member's passes;
//   - /busy_threshold alone answers a loopback caller without the token
//     (the exemption, warned about in the log); /cluster/status is open;
//   - the tokenizer self-check reaches a worker that requires the worker
//     API key ("ok", not "unavailable").
func TestServeAdminAndClusterCredentials(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica with TLS")
	}
	dir := t.TempDir()
	l := pki.Layout{Dir: filepath.Join(dir, "certs")}
	if _, err := l.Ensure([]pki.Holder{{Identity: pki.Node("r1"), Hosts: []string{"127.0.0.1"}}}); err != nil {
		t.Fatal(err)
	}
	mat := l.Material(pki.Node("r1"))
	secret := func(name, v string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(v+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	const adminToken, workerKey = "admin-secret-1", "worker-secret-2"

	// A worker started with an API key: 401 on every path without it.
	m := prompt.Legacy("m", tokenize.Builtin(), tokenize.Plain, "builtin")
	var refused, tokenized atomic.Int64
	worker := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+workerKey {
			refused.Add(1)
			http.Error(w, `{"error":"Unauthorized"}`, http.StatusUnauthorized)
			return
		}
		if r.URL.Path != "/tokenize" {
			http.NotFound(w, r)
			return
		}
		body, _ := io.ReadAll(r.Body)
		ids, err := m.Tokenize(body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		tokenized.Add(1)
		_ = json.NewEncoder(w).Encode(map[string]any{"count": len(ids), "tokens": ids})
	}))
	defer worker.Close()

	ports := freePorts(t, 4)
	addr := fmt.Sprintf("127.0.0.1:%d", ports[0])
	args := []string{"--single-node", "--node-id", "r1", "--model", "m", "--data-dir", filepath.Join(dir, "r1"),
		"--http-addr", addr, "--raft-addr", fmt.Sprintf("127.0.0.1:%d", ports[1]),
		"--nats-addr", fmt.Sprintf("127.0.0.1:%d", ports[2]), "--nats-cluster-addr", fmt.Sprintf("127.0.0.1:%d", ports[3]),
		"--tls-ca", mat.CAFile, "--tls-cert", mat.CertFile, "--tls-key", mat.KeyFile,
		"--admin-token-file", secret("admin-token", adminToken), "--worker-api-key-file", secret("worker-api-key", workerKey),
		"--admin-open-to-loopback", "/busy_threshold"}
	logs := &logSink{t: t}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int)
	go func() { done <- runServe(ctx, args, nil, logs) }()
	t.Cleanup(func() {
		cancel()
		if code := <-done; code != 0 {
			t.Errorf("runServe exited %d", code)
		}
	})
	plain, tlsBase := "http://"+addr, "https://"+addr
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error {
		s, err := status(plain) // open: no credential
		if err == nil && s.State != "leader" {
			err = fmt.Errorf("state %q", s.State)
		}
		return err
	})

	pool, err := pki.LoadPool(mat.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	bundle, err := pki.LoadBundle(mat)
	if err != nil {
		t.Fatal(err)
	}
	noCert := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: pki.TrustOnlyTLS(pool, pki.AllowRoles(pki.RoleNode))}}
	member := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: bundle.ClientTLS(pki.AllowRoles(pki.RoleNode))}}
	call := func(c *http.Client, method, url, body, token string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(method, url, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, url, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}

	reg := fmt.Sprintf(`{"id":"w1","url":%q,"model":"m","block_size":16,"total_kv_blocks":1000}`, worker.URL)
	for _, base := range []struct {
		name string
		c    *http.Client
		url  string
	}{{"plaintext", http.DefaultClient, plain}, {"https", noCert, tlsBase}, {"https with a member certificate", member, tlsBase}} {
		for _, tok := range []string{"", "wrong"} {
			if code, body := call(base.c, "POST", base.url+"/workers/register", reg, tok); code != http.StatusUnauthorized {
				t.Errorf("register over %s, token %q: %d %s, want 401", base.name, tok, code, body)
			}
			if code, body := call(base.c, "POST", base.url+"/workers/deregister", `{"id":"w1"}`, tok); code != http.StatusUnauthorized {
				t.Errorf("deregister over %s, token %q: %d %s, want 401", base.name, tok, code, body)
			}
			if code, _ := call(base.c, "GET", base.url+"/workers", "", tok); code != http.StatusUnauthorized {
				t.Errorf("GET /workers over %s, token %q: %d, want 401 (not exempt)", base.name, tok, code)
			}
		}
	}
	if code, body := call(http.DefaultClient, "POST", plain+"/workers/register", reg, adminToken); code != http.StatusOK {
		t.Fatalf("register with the token: %d %s", code, body)
	}

	for _, rg := range []struct{ method, body string }{{"GET", ""}, {"POST", `{"groups":2}`}} {
		for _, tc := range []struct {
			name string
			c    *http.Client
			url  string
		}{{"plaintext", http.DefaultClient, plain}, {"https without a client certificate", noCert, tlsBase}} {
			for _, tok := range []string{"", adminToken} {
				code, body := call(tc.c, rg.method, tc.url+"/cluster/raft_groups", rg.body, tok)
				if code != http.StatusUnauthorized || !strings.Contains(body, "client certificate") {
					t.Errorf("%s /cluster/raft_groups over %s, admin token %v: %d %s, want 401 naming the certificate", rg.method, tc.name, tok != "", code, body)
				}
			}
		}
	}
	if code, body := call(member, "GET", tlsBase+"/cluster/raft_groups", "", ""); code != http.StatusOK || !strings.Contains(body, `"running"`) {
		t.Errorf("GET /cluster/raft_groups with a member certificate: %d %s", code, body)
	}

	// The exemption: /busy_threshold from this host without the token.
	if code, body := call(http.DefaultClient, "POST", plain+"/busy_threshold", `{"model":"m","active_decode_blocks_threshold":0.77}`, ""); code != http.StatusOK {
		t.Errorf("POST /busy_threshold from loopback without the token: %d %s, want 200 (--admin-open-to-loopback)", code, body)
	}
	if code, body := call(http.DefaultClient, "GET", plain+"/busy_threshold", "", ""); code != http.StatusOK || !strings.Contains(body, "0.77") {
		t.Errorf("GET /busy_threshold from loopback without the token: %d %s", code, body)
	}

	// The self-check with the worker's key.
	poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
		checks, err := tokenizerChecks(plain)
		if err != nil {
			return err
		}
		if checks["w1"] == "ok" {
			return nil
		}
		return fmt.Errorf("tokenizer checks %v (worker refused %d requests)", checks, refused.Load())
	})
	if tokenized.Load() == 0 {
		t.Error("the worker tokenized nothing")
	}

	out := logs.String()
	for _, want := range []string{"open WITHOUT the admin token to callers on this host", "served WITHOUT the admin token to a loopback caller", "refused cluster request"} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %q", want)
		}
	}
	if strings.Contains(out, "NO ADMIN TOKEN") {
		t.Error("warned of no admin token although one is set")
	}
	for _, s := range []string{adminToken, workerKey} {
		if strings.Contains(out, s) {
			t.Errorf("a secret reached the log: %s", s)
		}
	}
}

// TestServeSecurityFlags: --admin-open-to-loopback in its spellings and
// from the environment, refused for paths that must keep their credential
// and off loopback; the warnings each replica logs about admin access.
func TestServeSecurityFlags(t *testing.T) {
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	for _, tc := range []struct {
		args     []string
		env      map[string]string
		rest     []string
		open     []string
		errMatch string
	}{
		{args: []string{"--node-id", "r1", "--admin-open-to-loopback", "/busy_threshold", "--model", "m"}, rest: []string{"--node-id", "r1", "--model", "m"}, open: []string{"/busy_threshold"}},
		{args: []string{"-admin-open-to-loopback=/busy_threshold,/workers"}, open: []string{"/busy_threshold", "/workers"}},
		{args: []string{"--admin-open-to-loopback=/busy_threshold", "--admin-open-to-loopback", "/debug/route"}, open: []string{"/busy_threshold", "/debug/route"}},
		{args: []string{"--single-node"}, env: map[string]string{adminOpenEnv: "/busy_threshold"}, rest: []string{"--single-node"}, open: []string{"/busy_threshold"}},
		{args: []string{"--admin-open-to-loopback", "/workers"}, env: map[string]string{adminOpenEnv: "/busy_threshold"}, open: []string{"/workers"}},
		{args: []string{"--model", "m", "--", "--admin-open-to-loopback", "/x"}, rest: []string{"--model", "m", "--", "--admin-open-to-loopback", "/x"}},
		{args: []string{"--admin-open-to-loopback", "/workers/register"}, errMatch: "cannot be left open"},
		{args: []string{"--admin-open-to-loopback=/cluster/raft_groups"}, errMatch: "cannot be left open"},
		{env: map[string]string{adminOpenEnv: "/busy_threshold,/workers/deregister"}, errMatch: "cannot be left open"},
		{args: []string{"--admin-open-to-loopback"}, errMatch: "needs an argument"},
	} {
		rest, open, err := takeSecurityFlags(tc.args, env(tc.env))
		if tc.errMatch != "" {
			if err == nil || !strings.Contains(err.Error(), tc.errMatch) {
				t.Errorf("%q %v: err %v, want %q", tc.args, tc.env, err, tc.errMatch)
			}
			continue
		}
		if err != nil {
			t.Errorf("%q %v: %v", tc.args, tc.env, err)
			continue
		}
		if fmt.Sprint(rest) != fmt.Sprint(tc.rest) || fmt.Sprint(open) != fmt.Sprint(tc.open) {
			t.Errorf("%q %v: rest %q open %q, want %q %q", tc.args, tc.env, rest, open, tc.rest, tc.open)
		}
	}

	c := serveConfig{}
	c.HTTPAddr = "10.0.0.1:8001"
	if err := applySecurityFlags(&c, []string{"/busy_threshold"}); err == nil || !strings.Contains(err.Error(), "loopback --http-addr") {
		t.Errorf("off loopback: %v", err)
	}
	c.HTTPAddr = "127.0.0.1:8001"
	if err := applySecurityFlags(&c, []string{"/busy_threshold"}); err != nil || len(c.AdminOpenToLoopback) != 1 {
		t.Errorf("on loopback: %v %v", err, c.AdminOpenToLoopback)
	}

	// Every replica without an admin token says so, loudly.
	logs := &logSink{t: t}
	warnAdminAccess(c, newLogger("info", "r1", logs))
	if out := logs.String(); !strings.Contains(out, "NO ADMIN TOKEN") || !strings.Contains(out, "has no effect") {
		t.Errorf("no admin token: %s", out)
	}
	// --help lists the flag.
	var help strings.Builder
	if code := runServe(context.Background(), []string{"--help"}, nil, &help); code != 0 || !strings.Contains(help.String(), "-admin-open-to-loopback") {
		t.Errorf("--help: %d %s", code, help.String())
	}
}
