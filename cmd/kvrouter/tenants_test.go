package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/internal/poll"
)

// tenantsOf is the "tenants" part of a replica's /cluster/status.
func tenantsOf(base string) (map[string]api.TenantStatus, error) {
	resp, err := http.Get(base + "/cluster/status")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var doc struct {
		Tenants []api.TenantStatus `json:"tenants"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
		return nil, err
	}
	out := map[string]api.TenantStatus{}
	for _, t := range doc.Tenants {
		out[t.Tenant] = t
	}
	return out, nil
}

// Three in-process replicas with --tenant-from header in front of a real
// kvmock: a tenant's requests through one replica are charged there, and
// replica sync (NATS) brings its usage to the other two, whose fleet-wide
// count then equals the first's own; an invalid strict priority is a 400.
func TestServeTenantsShareUsage(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas and a worker process")
	}
	t.Parallel()
	bin := buildKvmock(t, t.TempDir())
	reps := newTestCluster(t, func(c *serveConfig) {
		c.Models = []string{"kvmock"}
		c.Tenants.From = api.TenantHeader
		c.TenantSyncInterval = 50 * time.Millisecond
	})
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(reps); return err })
	st, err := status(reps[0].url())
	if err != nil {
		t.Fatal(err)
	}
	port := freePorts(t, 1)[0]
	startKvmock(t, bin, "--id", "tn-1", "--addr", fmt.Sprintf("127.0.0.1:%d", port), "--model", "kvmock", "--speedup", "4",
		"--nats", st.NATS, "--register", reps[0].url(), "--log-level", "warn")
	poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
		if activeRequests(t, reps[0].url(), "tn-1") < 0 {
			return fmt.Errorf("r1 does not route to tn-1 yet")
		}
		return nil
	})
	post := func(body string, header map[string]string) (int, string) {
		req, _ := http.NewRequest("POST", reps[0].url()+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		for k, v := range header {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for i := range 3 {
		body := fmt.Sprintf(`{"model":"kvmock","max_tokens":4,"messages":[{"role":"user","content":"tenant request %d"}]}`, i)
		if code, b := post(body, map[string]string{api.DefaultTenantHeader: "acme"}); code != 200 {
			t.Fatalf("request %d: %d %s", i, code, b)
		}
	}
	if code, b := post(`{"model":"kvmock","messages":[{"role":"user","content":"x"}],"nvext":{"agent_hints":{"strict_priority":-1}}}`,
		map[string]string{api.DefaultTenantHeader: "acme"}); code != 400 || !strings.Contains(b, "strict_priority") {
		t.Fatalf("invalid strict priority: %d %s", code, b)
	}
	var here uint64
	poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
		ts, err := tenantsOf(reps[0].url())
		if err != nil {
			return err
		}
		a := ts["acme"]
		if a.Here == 0 || a.Tokens != a.Here || a.Inflight != 0 {
			return fmt.Errorf("r1's acme: %+v", a)
		}
		here = a.Here
		return nil
	})
	for _, r := range reps[1:] {
		poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
			ts, err := tenantsOf(r.url())
			if err != nil {
				return err
			}
			if a := ts["acme"]; a.Tokens != here || a.Here != 0 {
				return fmt.Errorf("%s's acme %+v, want %d tokens charged elsewhere", r.cfg.NodeID, a, here)
			}
			return nil
		})
	}
}
