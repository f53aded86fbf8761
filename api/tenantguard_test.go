package api

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// TestAPITenantLatencyGuard: with --tenant-latency-guard a request of a
// tenant over its share goes only to a worker whose predicted TTFT for a
// fresh request is within the factor of its idle value, and waits in the
// queue while there is none (counted once in
// kvrouter_tenant_guard_held_total), going on once a worker is back within
// it; a tenant under its share is never held.
func TestAPITenantLatencyGuard(t *testing.T) {
	cfg := router.DefaultConfig()
	cfg.QueueThreshold = ptr(1.0) // the threshold itself never queues here
	cfg.LearnLatency = true
	rep := newFakeReplica("m", cfg)
	tw := startTenantWorkers(t, rep, []router.WorkerID{"w1", "w2"})
	l, err := NewTenantLedger(TenantConfig{From: TenantHeader, LatencyGuard: 1.5})
	if err != nil {
		t.Fatal(err)
	}
	l.Charge("m", "heavy", 50_000) // heavy is far over its share while light is active
	l.Begin("m", "heavy")
	l.Begin("m", "light")
	reg := prometheus.NewRegistry()
	s := New(Config{Registry: reg, AllowLoopbackWorkers: true, Tenants: l}, rep)
	srv := httptest.NewServer(s.Handler())
	defer srv.Close()
	send := func(tenant string) <-chan int { return sendTenantChat(srv.URL, tenant) }
	rt, _ := rep.Router("m")
	// w1 has a prefill queue many times a fresh request's own prefill; w2
	// none, but 200 blocks decoding, so kv's cost prefers w1: heavy goes
	// to w2 all the same, light (not guarded) to w1.
	rt.Load().Add(router.Booking{ID: "backlog1", Worker: "w1", PrefillTokens: 400, Added: time.Now()})
	hs := make([]uint64, 200)
	for i := range hs {
		hs[i] = uint64(i + 1)
	}
	rt.Load().Add(router.Booking{ID: "decoding", Worker: "w2", Hashes: hs, Added: time.Now()})
	rt.PrefillDone("decoding")
	if c := <-send("heavy"); c != 200 {
		t.Fatalf("heavy with w2 within the guard: %d", c)
	}
	if c := <-send("light"); c != 200 {
		t.Fatalf("light: %d", c)
	}
	served := tw.take()
	if w1, w2 := strings.Join(served["w1"], ","), strings.Join(served["w2"], ","); w1 != "light" || w2 != "heavy" {
		t.Errorf("served: w1 %q, w2 %q; want light on w1 (kv's pick), heavy on w2 (the guard's)", w1, w2)
	}
	// Both workers backlogged: heavy waits; light (under its share) does not.
	rt.Load().Add(router.Booking{ID: "backlog2", Worker: "w2", PrefillTokens: 4000, Added: time.Now()})
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
	tw.take() // forget light's: the last check counts heavy's alone
	var m dto.Metric
	_ = s.tenantMetrics.guardHeld.WithLabelValues("m").Write(&m)
	if n := m.GetCounter().GetValue(); n != 1 {
		t.Errorf("guard held %v requests, want 1", n)
	}
	select {
	case c := <-heavy:
		t.Fatalf("heavy answered %d while every worker is over the guard", c)
	default:
	}
	rt.PrefillDone("backlog1") // w1 back within the factor
	s.gates.wake("m")
	if c := <-heavy; c != 200 {
		t.Errorf("heavy after w1 cleared: %d", c)
	}
	if got := tw.take()["w1"]; len(got) != 1 || got[0] != "heavy" {
		t.Errorf("w1 served %v, want the held heavy request", got)
	}
}

// sendTenantChat sends a chat request of tenant (its header, and
// X-Test-Tenant for the fake workers) in the background; the channel gets
// its status code (0 when it got no answer).
func sendTenantChat(base, tenant string) <-chan int {
	code := make(chan int, 1)
	body := fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":%q}]}`, tenant+strings.Repeat(" word", 20))
	req, _ := http.NewRequest("POST", base+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set(DefaultTenantHeader, tenant)
	req.Header.Set("X-Test-Tenant", tenant)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			code <- 0
			return
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		code <- resp.StatusCode
	}()
	return code
}

// tenantWorkers are fake workers recording which tenant (X-Test-Tenant)
// each request they served came from.
type tenantWorkers struct {
	mu     sync.Mutex
	served map[string][]string // worker → tenants served
}

func startTenantWorkers(t *testing.T, rep *fakeReplica, ids []router.WorkerID) *tenantWorkers {
	t.Helper()
	tw := &tenantWorkers{served: map[string][]string{}}
	for _, id := range ids {
		worker := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			tw.mu.Lock()
			tw.served[string(id)] = append(tw.served[string(id)], r.Header.Get("X-Test-Tenant"))
			tw.mu.Unlock()
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprint(w, `{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":40,"completion_tokens":1}}`)
		}))
		t.Cleanup(worker.Close)
		rep.addWorker("m", id, worker.URL)
	}
	return tw
}

// take returns what each worker served since the last take, and forgets it.
func (tw *tenantWorkers) take() map[string][]string {
	tw.mu.Lock()
	defer tw.mu.Unlock()
	got := tw.served
	tw.served = map[string][]string{}
	return got
}
