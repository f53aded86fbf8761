package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/router"
)

// send posts body to url with the given headers.
func send(t *testing.T, url string, body any, h map[string]string) (*http.Response, []byte) {
	t.Helper()
	data, _ := json.Marshal(body)
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range h {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp, out
}

// kvmock --api-key answers 401 (counted) to a request without its bearer
// token or with another; open endpoints stay open.
func TestMockAPIKey(t *testing.T) {
	tm := startMock(t, func(c *config) { c.APIKey = "worker-secret" }, true)
	body := chatBody(words("key", 20), 2, false)
	cases := []struct {
		name   string
		auth   string
		status int
	}{
		{"no key", "", http.StatusUnauthorized},
		{"wrong key", "Bearer client-secret", http.StatusUnauthorized},
		{"not bearer", "Basic d29ya2VyLXNlY3JldA==", http.StatusUnauthorized},
		{"its key", "Bearer worker-secret", http.StatusOK},
	}
	refused := uint64(0)
	for _, c := range cases {
		h := map[string]string{}
		if c.auth != "" {
			h["Authorization"] = c.auth
		}
		resp, out := send(t, tm.url+"/v1/chat/completions", body, h)
		if resp.StatusCode != c.status {
			t.Fatalf("%s: HTTP %d, want %d: %s", c.name, resp.StatusCode, c.status, out)
		}
		if c.status == http.StatusUnauthorized {
			refused++
			if !strings.Contains(string(out), "invalid_api_key") {
				t.Fatalf("%s: 401 body %s is not OpenAI's error shape", c.name, out)
			}
		}
	}
	if got := statsOf(t, tm.url).Requests.Unauthorized; got != refused {
		t.Fatalf("unauthorized counted %d, want %d", got, refused)
	}
	if resp, err := http.Get(tm.url + "/health"); err != nil || resp.StatusCode != 200 {
		t.Fatalf("/health without a key: %v %v", resp, err)
	}
}

// Through the real API server: the worker receives the router's worker
// key (never the client's Authorization), the client's X-Request-Id (or
// the one the router made) and its traceparent; with the wrong worker key
// the worker refuses and the client is told.
func TestMockAPIKeyThroughRouter(t *testing.T) {
	const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	for _, c := range []struct {
		name      string
		routerKey string
		requestID string
		ok        bool
	}{
		{"right key, client's request id", "worker-secret", "client-req-17", true},
		{"right key, router's request id", "worker-secret", "", true},
		{"wrong key", "stale-secret", "client-req-18", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			rep := newOneReplica(t, "kvmock")
			srv := api.New(api.Config{Tokenizer: tokenize.Builtin(), ChatTemplate: tokenize.Plain, Logger: testLog(t),
				AllowLoopbackWorkers: true, WorkerAPIKey: c.routerKey}, rep)
			front := httptest.NewServer(srv.Handler())
			defer front.Close()
			tm := startMock(t, func(cfg *config) { cfg.APIKey = "worker-secret"; cfg.Register = []string{front.URL} }, true)
			checkFor(t, 5*time.Second, 5*time.Millisecond, func() error {
				if _, ok := rep.WorkerURL("mock-1"); !ok {
					return io.EOF
				}
				return nil
			})
			h := map[string]string{"Authorization": "Bearer client-secret", "Traceparent": traceparent}
			if c.requestID != "" {
				h["X-Request-Id"] = c.requestID
			}
			resp, out := send(t, front.URL+"/v1/chat/completions", chatBody(words("fwd", 30), 2, false), h)
			st := statsOf(t, tm.url)
			if !c.ok {
				if resp.StatusCode == http.StatusOK || st.Requests.Unauthorized != 1 || st.Requests.Chat != 0 {
					t.Fatalf("wrong worker key: HTTP %d (%s), worker refused %d, served %d", resp.StatusCode, out, st.Requests.Unauthorized, st.Requests.Chat)
				}
				return
			}
			if resp.StatusCode != http.StatusOK || st.Requests.Unauthorized != 0 {
				t.Fatalf("HTTP %d: %s (worker refused %d)", resp.StatusCode, out, st.Requests.Unauthorized)
			}
			id := resp.Header.Get("X-Request-Id")
			if (c.requestID != "" && id != c.requestID) || id == "" {
				t.Fatalf("answer's X-Request-Id %q, client sent %q", id, c.requestID)
			}
			if f := st.Forwarded; f.LastRequestID != id || f.LastTraceparent != traceparent || f.WithRequestID != 1 || f.WithTraceparent != 1 {
				t.Fatalf("worker saw %+v, want request id %q and traceparent %q once", f, id, traceparent)
			}
		})
	}
}

// Per-worker keys (api.Config.WorkerAPIKeys, kvrouter serve
// --worker-api-keys-file): two workers started with different --api-key
// each receive only their own key (a wrong one would be refused and
// counted), a worker not in the map gets the default key.
func TestMockPerWorkerKeysThroughRouter(t *testing.T) {
	rep := newOneReplica(t, "kvmock")
	cfg := rep.rt.Config()
	cfg.Mode = router.ModeRoundRobin // every worker gets requests, in turn
	if err := rep.rt.SetConfig(cfg); err != nil {
		t.Fatal(err)
	}
	srv := api.New(api.Config{Tokenizer: tokenize.Builtin(), ChatTemplate: tokenize.Plain, Logger: testLog(t), AllowLoopbackWorkers: true,
		WorkerAPIKey: "default-secret", WorkerAPIKeys: map[string]string{"mock-a": "secret-of-a", "mock-b": "secret-of-b"}}, rep)
	front := httptest.NewServer(srv.Handler())
	defer front.Close()
	mocks := map[string]*testMock{}
	for id, key := range map[string]string{"mock-a": "secret-of-a", "mock-b": "secret-of-b", "mock-c": "default-secret"} {
		mocks[id] = startMock(t, func(c *config) { c.ID, c.APIKey, c.Register = id, key, []string{front.URL} }, true)
	}
	checkFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		if len(rep.rt.Workers()) != len(mocks) {
			return io.EOF
		}
		return nil
	})
	for i := range 6 {
		resp, out := send(t, front.URL+"/v1/chat/completions", chatBody(words(fmt.Sprint("k", i), 20), 2, false), nil)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: HTTP %d %s", i, resp.StatusCode, out)
		}
	}
	for id, tm := range mocks {
		st := statsOf(t, tm.url)
		if st.Requests.Unauthorized != 0 || st.Requests.Chat != 2 {
			t.Fatalf("%s: refused %d, served %d of 6 (round-robin: 2)", id, st.Requests.Unauthorized, st.Requests.Chat)
		}
	}
}
