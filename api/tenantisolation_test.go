package api

import (
	"fmt"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/api/tenant"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// TestAPITenantIsolation: with --tenant-isolation a request of a tenant
// over its share never goes to the worker reserved for the tenant under
// its share, even where kv's cost prefers it, and waits in the queue while
// every other worker is over the queue threshold (counted once in
// kvrouter_tenant_isolation_held_total), going on once one has room; a
// request of the tenant under its share goes to the reserved worker while
// it has room, even where kv's cost prefers another, and is never held.
func TestAPITenantIsolation(t *testing.T) {
	cfg := router.DefaultConfig()
	cfg.QueueThreshold = ptr(1.0)
	rep := newFakeReplica("m", cfg)
	ids := []router.WorkerID{"w1", "w2", "w3"}
	tw := startTenantWorkers(t, rep, ids)
	l, err := NewTenantLedger(TenantConfig{From: TenantHeader, Isolation: 1})
	if err != nil {
		t.Fatal(err)
	}
	l.Charge("m", "heavy", 50_000) // heavy is far over its share while light is active
	l.Begin("m", "heavy")
	l.Begin("m", "light")
	// heavy has requests queued on another replica: the fleet cannot serve
	// it in full.
	l.Remote("r2", []TenantUsage{{Model: "m", Tenant: "heavy", Tokens: 1, Waiting: 5}})
	if k, over := l.Isolation("m", "heavy", len(ids)); k != 1 || !over {
		t.Fatalf("Isolation(heavy) = %d, %v; want 1 worker reserved, heavy over its share", k, over)
	}
	reserved := tenant.ReservedWorkers("m", ids, 1, nil)[0]
	var others []router.WorkerID
	for _, id := range ids {
		if id != reserved {
			others = append(others, id)
		}
	}
	reg := prometheus.NewRegistry()
	s := New(Config{Registry: reg, AllowLoopbackWorkers: true, Tenants: l}, rep)
	srv := httptest.NewServer(s.Handler())
	defer srv.Close()
	send := func(tenant string) <-chan int { return sendTenantChat(srv.URL, tenant) }
	rt, _ := rep.Router("m")
	// The unreserved workers decode 200 blocks each, the reserved one is
	// idle: kv's cost prefers the reserved worker for heavy, which must go
	// elsewhere all the same.
	hs := make([]uint64, 200)
	for i := range hs {
		hs[i] = uint64(i + 1)
	}
	for _, w := range others {
		rt.Load().Add(router.Booking{ID: "decoding-" + string(w), Worker: w, Hashes: hs, Added: time.Now()})
		rt.PrefillDone("decoding-" + string(w))
	}
	for range 4 {
		if c := <-send("heavy"); c != 200 {
			t.Fatalf("heavy with unreserved workers free: %d", c)
		}
	}
	if got := tw.take()[string(reserved)]; len(got) != 0 {
		t.Errorf("the reserved worker %s served %v; want no heavy request", reserved, got)
	}
	// Now the reserved worker decodes more than the others: light goes
	// there all the same (its preference) while it has room.
	more := make([]uint64, 600)
	for i := range more {
		more[i] = uint64(i + 1000)
	}
	rt.Load().Add(router.Booking{ID: "decoding-reserved", Worker: reserved, Hashes: more, Added: time.Now()})
	rt.PrefillDone("decoding-reserved")
	for range 3 {
		if c := <-send("light"); c != 200 {
			t.Fatalf("light: %d", c)
		}
	}
	served := tw.take()
	if got := served[string(reserved)]; len(got) != 3 || slices.ContainsFunc(got, func(s string) bool { return s != "light" }) {
		t.Errorf("the reserved worker %s served %v (all: %v); want the three light requests", reserved, got, served)
	}
	// Every unreserved worker over the threshold: heavy waits although the
	// reserved worker has room; light does not.
	for _, w := range others {
		rt.Load().Add(router.Booking{ID: "backlog-" + string(w), Worker: w, PrefillTokens: 9000, Added: time.Now()})
	}
	heavy := send("heavy")
	poll.Until(t, 5*time.Second, 2*time.Millisecond, func() error {
		if g := testutilGauge(s); g != 1 {
			return fmt.Errorf("queued gauge %v, want heavy waiting", g)
		}
		return nil
	})
	if c := <-send("light"); c != 200 {
		t.Errorf("light (under its share) answered %d with heavy held", c)
	}
	var m dto.Metric
	_ = s.tenantMetrics.isolationHeld.WithLabelValues("m").Write(&m)
	if n := m.GetCounter().GetValue(); n != 1 {
		t.Errorf("isolation held %v requests, want 1", n)
	}
	select {
	case c := <-heavy:
		t.Fatalf("heavy answered %d while every unreserved worker is over the threshold", c)
	default:
	}
	rt.PrefillDone("backlog-" + string(others[0])) // room again outside the reserved set
	s.gates.wake("m")
	if c := <-heavy; c != 200 {
		t.Errorf("heavy after %s cleared: %d", others[0], c)
	}
	served = tw.take()
	if got := served[string(others[0])]; len(got) != 1 || got[0] != "heavy" {
		t.Errorf("%s served %v (all: %v), want the held heavy request", others[0], got, served)
	}
}

// TestAPITenantIsolationFirstToken: with isolation and the latency guard
// both on, a request of the tenant under its share goes to the worker
// quickest to its first token (router.Router.FirstTokenOrder): the
// reserved one while it is among the quickest (an idle fleet), an
// unreserved one once the reserved worker has a prefill queued, although
// the reserved worker still has room under the threshold (where, without
// the guard, it goes).
func TestAPITenantIsolationFirstToken(t *testing.T) {
	cfg := router.DefaultConfig()
	cfg.QueueThreshold = ptr(1.0)
	cfg.LearnLatency = true
	rep := newFakeReplica("m", cfg)
	ids := []router.WorkerID{"w1", "w2", "w3"}
	tw := startTenantWorkers(t, rep, ids)
	l, err := NewTenantLedger(TenantConfig{From: TenantHeader, Isolation: 1, LatencyGuard: 1})
	if err != nil {
		t.Fatal(err)
	}
	l.Charge("m", "heavy", 50_000)
	l.Begin("m", "heavy")
	l.Begin("m", "light")
	l.Remote("r2", []TenantUsage{{Model: "m", Tenant: "heavy", Tokens: 1, Waiting: 5}})
	if k, over := l.Isolation("m", "heavy", len(ids)); k != 1 || !over {
		t.Fatalf("Isolation(heavy) = %d, %v; want 1 worker reserved, heavy over its share", k, over)
	}
	reserved := tenant.ReservedWorkers("m", ids, 1, nil)[0]
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, Tenants: l}, rep)
	srv := httptest.NewServer(s.Handler())
	defer srv.Close()
	rt, _ := rep.Router("m")
	if c := <-sendTenantChat(srv.URL, "light"); c != 200 {
		t.Fatalf("light on an idle fleet: %d", c)
	}
	if got := tw.take()[string(reserved)]; len(got) != 1 {
		t.Errorf("idle fleet: the reserved worker %s served %v; want the light request (reserved first among the quickest)", reserved, got)
	}
	rt.Load().Add(router.Booking{ID: "backlog", Worker: reserved, PrefillTokens: 400, Added: time.Now()})
	if c := <-sendTenantChat(srv.URL, "light"); c != 200 {
		t.Fatalf("light with the reserved worker prefilling: %d", c)
	}
	served := tw.take()
	if got := served[string(reserved)]; len(got) != 0 {
		t.Errorf("the reserved worker %s, 400 prefill tokens queued, served %v (all: %v); want light on an idle unreserved worker", reserved, got, served)
	}
}
