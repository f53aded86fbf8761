package api

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/router"
)

// The fairness check, in process (issue 28 item 3): two tenants,
// the heavy one sending ten times the steady one's load spread over every
// replica, the steady one through one replica. Each scenario runs real
// api.Servers on real TCP in front of simulated workers, in real time:
//
//   - workers: two; each computes one prompt at a time (fairBenchPrefill),
//     then streams fairBenchOutput tokens fairBenchTPOT apart; decoding is
//     not limited. So the fleet computes 2 prompts per fairBenchPrefill.
//   - replicas: 1 or 3 Servers over ONE router (one load view: the load
//     part of replica sync is perfect here, so what is measured is the
//     tenant part). Each has its own TenantLedger; "shared-Δ" exchanges
//     every ledger's Usage into the others' Remote every Δ (what the
//     Syncer carries every --tenant-sync-interval, without NATS), "local"
//     never.
//   - latency: the steady tenant open loop (Poisson) at 30 % of the
//     fleet's measured capacity through replica 0; the heavy one closed
//     loop, 30 clients over every replica (10× the steady tenant's
//     concurrency; always backlogged). The figure is the steady tenant's
//     p99 TTFT (time to the answer's headers, which leave with the first
//     token) against the same with the steady tenant alone.
//     TestAPITenantFairnessSimulation runs the open-loop 10× rate in
//     virtual time, where a flood costs no CPU.
//   - shares: closed loop, both backlogged: 6 steady clients, 60 heavy
//     ones; the figure is the steady tenant's share of the tokens charged
//     (uncached prompt + output) over the run's middle.
//
// Run: go test ./api/ -run XXX -bench BenchmarkAPITenantFairness -benchtime 1x
// (BENCHMARKS.md, "Fair tenants across replicas"). A benchmark, not a
// test: the figures are timings on a shared machine.
const (
	fairBenchPrefill = 20 * time.Millisecond
	fairBenchOutput  = 8
	fairBenchTPOT    = 2 * time.Millisecond
	fairBenchSync    = 100 * time.Millisecond
	fairBenchRun     = 12 * time.Second
	fairBenchWarmup  = 2 * time.Second
)

// fairBenchWorker simulates an engine: prompts computed one at a time,
// then a stream of tokens.
func fairBenchWorker() *httptest.Server {
	var prefill sync.Mutex
	return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		prefill.Lock()
		time.Sleep(fairBenchPrefill) // the simulated prompt computation
		prefill.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		fl := w.(http.Flusher)
		for i := range fairBenchOutput {
			if i > 0 {
				time.Sleep(fairBenchTPOT)
			}
			fmt.Fprint(w, `data: {"choices":[{"delta":{"content":"t"}}]}`+"\n\n")
			fl.Flush()
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
}

// namedReplica gives each Server over the shared fake its own node id (the
// request ids' prefix).
type namedReplica struct {
	*fakeReplica
	id string
}

func (n namedReplica) NodeID() string { return n.id }

type fairBench struct {
	urls    []string
	ledgers []*TenantLedger
	client  *http.Client
	stop    func()
}

func newFairBench(b *testing.B, replicas int, every time.Duration) *fairBench {
	cfg := router.DefaultConfig()
	cfg.QueueThreshold = ptr(0.05) // queue once every worker has a prompt (≈ 400 tokens of 8192) booked
	rep := newFakeReplica("m", cfg)
	var workers []*httptest.Server
	for i := range 2 {
		w := fairBenchWorker()
		workers = append(workers, w)
		rep.addWorker("m", router.WorkerID(fmt.Sprintf("w%d", i)), w.URL)
	}
	fb := &fairBench{client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 512}}}
	var servers []*httptest.Server
	for i := range replicas {
		l, err := NewTenantLedger(TenantConfig{From: TenantHeader})
		if err != nil {
			b.Fatal(err)
		}
		s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, MaxQueue: 64, Tenants: l,
			Logger: slog.New(slog.DiscardHandler)}, namedReplica{rep, fmt.Sprintf("r%d", i)})
		srv := httptest.NewServer(s.Handler())
		servers = append(servers, srv)
		fb.urls = append(fb.urls, srv.URL)
		fb.ledgers = append(fb.ledgers, l)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	if every > 0 && replicas > 1 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t := time.NewTicker(every)
			defer t.Stop()
			changed := make(chan struct{}, 1)
			for _, l := range fb.ledgers {
				go func() { // the Syncer's nudge: a tenant started waiting
					for {
						select {
						case <-ctx.Done():
							return
						case <-l.Changed():
							select {
							case changed <- struct{}{}:
							default:
							}
						}
					}
				}()
			}
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				case <-changed:
				}
				for i, from := range fb.ledgers {
					u := from.Usage()
					for j, to := range fb.ledgers {
						if i != j {
							to.Remote(fmt.Sprintf("r%d", i), u)
						}
					}
				}
			}
		}()
	}
	fb.stop = func() {
		cancel()
		wg.Wait()
		fb.client.CloseIdleConnections()
		for _, s := range servers {
			s.Close()
		}
		for _, w := range workers {
			w.Close()
		}
	}
	return fb
}

// send posts one streamed request for tenant to replica i and returns its
// TTFT (time to the answer's headers) and status.
func (fb *fairBench) send(i int, tenant string, rng *rand.Rand) (time.Duration, int) {
	// Distinct prompts of one length: nothing cached, every prompt costs
	// the same.
	words := make([]string, 300)
	for k := range words {
		words[k] = fmt.Sprintf("w%d", rng.IntN(1000))
	}
	body := fmt.Sprintf(`{"model":"m","stream":true,"messages":[{"role":"user","content":%q}]}`, strings.Join(words, " "))
	req, _ := http.NewRequest("POST", fb.urls[i]+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set(DefaultTenantHeader, tenant)
	start := time.Now()
	resp, err := fb.client.Do(req)
	if err != nil {
		return 0, 0
	}
	ttft := time.Since(start)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return ttft, resp.StatusCode
}

// tokens is a tenant's tokens charged over the fleet (every ledger's own).
func (fb *fairBench) tokens(tenant string) uint64 {
	var n uint64
	for _, l := range fb.ledgers {
		for _, u := range l.Usage() {
			if u.Tenant == tenant {
				n += u.Tokens
			}
		}
	}
	return n
}

// openLoop sends Poisson arrivals at rate (per second) for tenant, spread
// over replicas, until the deadline; TTFTs of 200 answers after warmup are
// returned.
func (fb *fairBench) openLoop(wg *sync.WaitGroup, tenant string, rate float64, replicas []int, start time.Time, seed uint64, out *[]time.Duration, mu *sync.Mutex, refused *atomic.Int64) {
	defer wg.Done()
	rng := rand.New(rand.NewPCG(seed, 1))
	var inner sync.WaitGroup
	next := start
	for n := 0; ; n++ {
		next = next.Add(time.Duration(rng.ExpFloat64() / rate * float64(time.Second)))
		if next.After(start.Add(fairBenchRun)) {
			break
		}
		time.Sleep(time.Until(next)) // the load generator's own pacing
		inner.Add(1)
		replica := replicas[n%len(replicas)]
		sent := time.Now()
		go func(seed uint64) {
			defer inner.Done()
			ttft, code := fb.send(replica, tenant, rand.New(rand.NewPCG(seed, 2)))
			if code != 200 {
				refused.Add(1)
				return
			}
			if out != nil && sent.After(start.Add(fairBenchWarmup)) {
				mu.Lock()
				*out = append(*out, ttft)
				mu.Unlock()
			}
		}(rng.Uint64())
	}
	inner.Wait()
}

func p99(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	return ds[min(len(ds)-1, len(ds)*99/100)]
}

// fairBenchCapacity measures what the fleet serves through one replica,
// closed loop and saturated, in requests per second: the simulated
// workers' 2 / fairBenchPrefill minus the proxy's overheads on this
// machine. The open-loop rates are fractions of it.
func fairBenchCapacity(b *testing.B) float64 {
	fb := newFairBench(b, 1, 0)
	defer fb.stop()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	var done atomic.Int64
	var wg sync.WaitGroup
	measuring := time.Now().Add(time.Second)
	for i := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(i), 9))
			for ctx.Err() == nil {
				if _, code := fb.send(0, "calibration", rng); code == 200 && time.Now().After(measuring) {
					done.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	return float64(done.Load()) / 2
}

// latency runs the open-loop scenario and returns the steady tenant's p99
// TTFT (heavy false: the steady tenant alone).
func latencyRun(b *testing.B, replicas int, every time.Duration, heavy bool, capacity float64) (time.Duration, int, int64) {
	fb := newFairBench(b, replicas, every)
	defer fb.stop()
	var wg sync.WaitGroup
	var mu sync.Mutex
	var ttfts []time.Duration
	var refusedSteady, refusedHeavy atomic.Int64
	start := time.Now().Add(50 * time.Millisecond)
	all := make([]int, replicas)
	for i := range all {
		all[i] = i
	}
	wg.Add(1)
	go fb.openLoop(&wg, "steady", 0.3*capacity, []int{0}, start, 1, &ttfts, &mu, &refusedSteady)
	if heavy {
		// Closed loop: 30 clients over every replica keep the heavy
		// tenant backlogged without an open-loop flood of refusals, which
		// on a shared 2-core machine starves the proxies themselves.
		ctx, cancel := context.WithTimeout(context.Background(), fairBenchRun+50*time.Millisecond)
		defer cancel()
		for i := range 30 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(200+i), 4))
				for ctx.Err() == nil {
					if _, code := fb.send(all[i%len(all)], "heavy", rng); code != 200 {
						refusedHeavy.Add(1)
					}
				}
			}()
		}
	}
	wg.Wait()
	b.Logf("served over the run: steady %.1f/s, heavy %.1f/s (requests at ~%d tokens)", float64(fb.tokens("steady"))/fairBenchRun.Seconds()/310,
		float64(fb.tokens("heavy"))/fairBenchRun.Seconds()/310, 310)
	slices.Sort(ttfts)
	if len(ttfts) > 0 {
		b.Logf("steady TTFT p50 %v p90 %v p99 %v max %v", ttfts[len(ttfts)/2], ttfts[len(ttfts)*9/10], p99(ttfts), ttfts[len(ttfts)-1])
	}
	return p99(ttfts), len(ttfts), refusedSteady.Load()
}

// sharesRun runs the closed-loop scenario and returns the steady tenant's
// share of the tokens charged in the run's middle.
func sharesRun(b *testing.B, replicas int, every time.Duration) float64 {
	fb := newFairBench(b, replicas, every)
	defer fb.stop()
	ctx, cancel := context.WithTimeout(context.Background(), fairBenchRun)
	defer cancel()
	var wg sync.WaitGroup
	client := func(tenant string, replica int, seed uint64) {
		defer wg.Done()
		rng := rand.New(rand.NewPCG(seed, 3))
		for ctx.Err() == nil {
			fb.send(replica, tenant, rng)
		}
	}
	for i := range 6 {
		wg.Add(1)
		go client("steady", 0, uint64(i))
	}
	for i := range 60 {
		wg.Add(1)
		go client("heavy", i%replicas, uint64(100+i))
	}
	time.Sleep(fairBenchWarmup) // the measurement window opens
	s0, h0 := fb.tokens("steady"), fb.tokens("heavy")
	time.Sleep(fairBenchRun - fairBenchWarmup - time.Second)
	s1, h1 := fb.tokens("steady"), fb.tokens("heavy")
	cancel()
	wg.Wait()
	return float64(s1-s0) / float64(s1-s0+h1-h0)
}

func BenchmarkAPITenantFairness(b *testing.B) {
	capacity := fairBenchCapacity(b)
	b.Logf("fleet capacity through the proxy: %.1f requests/s (workers alone: %.0f)", capacity, 2/fairBenchPrefill.Seconds())
	for _, sc := range []struct {
		name     string
		replicas int
		sync     time.Duration // 0: counters not shared
	}{{"replicas=1", 1, 0}, {"replicas=3/shared-100ms", 3, fairBenchSync}, {"replicas=3/shared-20ms", 3, 20 * time.Millisecond},
		{"replicas=3/local", 3, 0}} {
		b.Run(sc.name, func(b *testing.B) {
			for range b.N {
				alone, nAlone, _ := latencyRun(b, sc.replicas, sc.sync, false, capacity)
				with, nWith, refused := latencyRun(b, sc.replicas, sc.sync, true, capacity)
				share := sharesRun(b, sc.replicas, sc.sync)
				b.ReportMetric(float64(alone.Microseconds())/1000, "alone_p99_ms")
				b.ReportMetric(float64(with.Microseconds())/1000, "with_heavy_p99_ms")
				b.ReportMetric(with.Seconds()/alone.Seconds(), "p99_ratio")
				b.ReportMetric(share, "steady_share")
				b.Logf("%s: steady p99 TTFT alone %v (%d answers), with the heavy tenant %v (%d answers, %d steady refused); steady share of tokens while both backlogged %.3f",
					sc.name, alone, nAlone, with, nWith, refused, share)
			}
		})
	}
}
