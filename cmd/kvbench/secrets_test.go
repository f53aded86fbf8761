package main

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
)

// writeRunSecrets makes dir look like the repository root after make run:
// tmp/run/secrets/{admin-token,worker-api-key}.
func writeRunSecrets(t *testing.T, dir, admin, worker string) {
	t.Helper()
	sec := filepath.Join(dir, "tmp", "run", "secrets")
	if err := os.MkdirAll(sec, 0o700); err != nil {
		t.Fatal(err)
	}
	for name, v := range map[string]string{"admin-token": admin, "worker-api-key": worker} {
		if err := os.WriteFile(filepath.Join(sec, name), []byte(v), 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSecretsFromMakeRun: ingest and load find make run's admin token (and
// load its worker key) with no flag when run from the repository root; an
// inline token or a file (flag or variable) wins; inline and file together
// are refused; an explicit file that is missing is an error.
func TestSecretsFromMakeRun(t *testing.T) {
	for _, env := range []string{"KVROUTER_ADMIN_TOKEN", "KVROUTER_ADMIN_TOKEN_FILE", "KVROUTER_WORKER_API_KEY", "KVROUTER_WORKER_API_KEY_FILE"} {
		t.Setenv(env, "")
	}
	dir := t.TempDir()
	t.Chdir(dir)
	// Nothing there: no secret, no error.
	o, err := parseIngestFlags([]string{"--target", "http://127.0.0.1:8001"}, io.Discard)
	if err != nil || o.AdminToken != "" || o.AdminTokenFrom != "" {
		t.Fatalf("no secrets anywhere: %v %q %q", err, o.AdminToken, o.AdminTokenFrom)
	}

	writeRunSecrets(t, dir, "run-admin\n", "run-worker\n")
	o, err = parseIngestFlags([]string{"--target", "http://127.0.0.1:8001"}, io.Discard)
	if err != nil || o.AdminToken != "run-admin" || !strings.Contains(o.AdminTokenFrom, "make run") {
		t.Fatalf("ingest with make run's files: %v %q %q", err, o.AdminToken, o.AdminTokenFrom)
	}
	lo, err := parseLoadFlags([]string{"--target", "http://127.0.0.1:8001", "--direct", "http://127.0.0.1:9001"}, io.Discard)
	if err != nil || lo.Token != "run-admin" || lo.WorkerKey != "run-worker" {
		t.Fatalf("load with make run's files: %v %q %q", err, lo.Token, lo.WorkerKey)
	}
	if lo.keyFor("http://127.0.0.1:9001") != "run-worker" || lo.keyFor("http://127.0.0.1:8001") != "" {
		t.Errorf("keys: direct %q, replica %q", lo.keyFor("http://127.0.0.1:9001"), lo.keyFor("http://127.0.0.1:8001"))
	}

	own := filepath.Join(dir, "own-token")
	os.WriteFile(own, []byte("file-admin\n"), 0o600)
	o, _ = parseIngestFlags([]string{"--target", "http://127.0.0.1:8001", "--admin-token", "inline-admin"}, io.Discard)
	if o.AdminToken != "inline-admin" {
		t.Errorf("inline token lost to make run's: %q", o.AdminToken)
	}
	o, _ = parseIngestFlags([]string{"--target", "http://127.0.0.1:8001", "--admin-token-file", own}, io.Discard)
	if o.AdminToken != "file-admin" || o.AdminTokenFrom != own {
		t.Errorf("--admin-token-file: %q from %q", o.AdminToken, o.AdminTokenFrom)
	}
	t.Setenv("KVROUTER_ADMIN_TOKEN_FILE", own)
	lo, _ = parseLoadFlags([]string{"--target", "http://127.0.0.1:8001"}, io.Discard)
	if lo.Token != "file-admin" {
		t.Errorf("$KVROUTER_ADMIN_TOKEN_FILE: %q", lo.Token)
	}
	for _, args := range [][]string{
		{"--target", "http://127.0.0.1:8001", "--admin-token", "a"}, // and the variable's file
		{"--target", "http://127.0.0.1:8001", "--admin-token-file", filepath.Join(dir, "missing")},
	} {
		if _, err := parseIngestFlags(args, io.Discard); !errors.Is(err, cli.ErrUsage) {
			t.Errorf("ingest %q: %v, want a usage error", args, err)
		}
	}
	t.Setenv("KVROUTER_ADMIN_TOKEN_FILE", "")
	if _, err := parseLoadFlags([]string{"--direct", "http://127.0.0.1:9001", "--worker-api-key", "k", "--worker-api-key-file", own}, io.Discard); !errors.Is(err, cli.ErrUsage) {
		t.Errorf("load with both worker key flags: %v", err)
	}
}

// TestLoadDirectSendsWorkerKey: the direct pass sends the worker's key and
// the routed pass the API key, each to its own endpoint only.
func TestLoadDirectSendsWorkerKey(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]map[string]bool{}
	endpoint := func(name, key string) *httptest.Server {
		fw := &fakeWorker{id: name, blockSize: 16, seen: map[string]bool{}}
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if !strings.HasPrefix(r.URL.Path, "/v1/") { // /health, /stats, /workers: no key
				fw.ServeHTTP(w, r)
				return
			}
			mu.Lock()
			if seen[name] == nil {
				seen[name] = map[string]bool{}
			}
			seen[name][r.Header.Get("Authorization")] = true
			mu.Unlock()
			if r.Header.Get("Authorization") != "Bearer "+key {
				http.Error(w, `{"error":"unauthorized"}`, http.StatusUnauthorized)
				return
			}
			fw.ServeHTTP(w, r)
		}))
		t.Cleanup(srv.Close)
		return srv
	}
	replica, worker := endpoint("replica", "api-key-1"), endpoint("worker", "worker-key-2")
	t.Chdir(t.TempDir())
	t.Setenv("KVROUTER_WORKER_API_KEY", "worker-key-2")
	o, err := parseLoadFlags([]string{"--target", replica.URL, "--direct", worker.URL, "--api-key", "api-key-1", "--model", "fake-model",
		"--prefixes", "2", "--prefix-tokens", "32", "--tail-tokens", "8", "--output-tokens", "2", "--requests", "6", "--concurrency", "2"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := executeLoad(context.Background(), o, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rep.Results {
		if r.Errors != 0 || r.Completed != 6 {
			t.Errorf("%s: %d errors, %d completed %v", r.Policy, r.Errors, r.Completed, r.ErrorSamples)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen["worker"]) != 1 || !seen["worker"]["Bearer worker-key-2"] {
		t.Errorf("the worker saw %v", seen["worker"])
	}
	if len(seen["replica"]) != 1 || !seen["replica"]["Bearer api-key-1"] {
		t.Errorf("the replica saw %v", seen["replica"])
	}
}
