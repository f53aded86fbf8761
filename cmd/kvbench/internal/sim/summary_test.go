package sim

import (
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
)

// One denominator: of four equal requests, two complete fully cached and two
// fail. Every figure is over the four: hit rate 1/2, cached ratio 1/2 (not
// 1, the completed requests' own), and the failures' TTFT is the timeout,
// which the p99 then shows.
func TestSummaryCountsFailuresInEveryRatio(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{Prefixes: 1, PrefixTokens: 64, OutputTokens: 4, Requests: 4, Concurrency: 1, Seed: 1})
	res := &Result{Requests: make([]RequestResult, 4)}
	for i := range res.Requests {
		rr := &res.Requests[i]
		rr.Worker, rr.Sent = 0, time.Duration(i)*time.Second
		if i < 2 {
			rr.Done = true
			rr.FirstToken, rr.Finished = rr.Sent+10*time.Millisecond, rr.Sent+20*time.Millisecond
			rr.CachedTokens = w.Requests[i].PromptTokens
		} else {
			rr.Err = "route: no worker"
		}
	}
	s := Summarize(w, res, 30*time.Second)
	if s.Completed != 2 || s.Errors != 2 {
		t.Fatalf("completed %d, errors %d", s.Completed, s.Errors)
	}
	if s.RequestHitRate != 0.5 || s.CachedTokenRatio != 0.5 {
		t.Fatalf("hit rate %v, cached ratio %v: want 0.5 each (over all four requests)", s.RequestHitRate, s.CachedTokenRatio)
	}
	if s.TTFT.P50 != (10+30000)/2.0 || s.TTFT.P99 < 29000 || s.E2E.P99 < 29000 {
		t.Fatalf("TTFT %+v, E2E %+v: the failures should count at the 30 s timeout", s.TTFT, s.E2E)
	}
}

// SLO attainment is over all requests: a failure is a miss, a request over
// either limit is a miss; TPOT is the time per token after the first.
func TestSummarySLOAttainment(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{Prefixes: 1, PrefixTokens: 64, OutputTokens: 11, Requests: 4, Concurrency: 1, Seed: 1})
	res := &Result{Requests: make([]RequestResult, 4)}
	// TTFT / decode time of 10 tokens after the first: fine, slow first
	// token, slow decode, failed.
	for i, c := range []struct{ ttft, decode time.Duration }{{50, 100}, {500, 100}, {50, 400}, {-1, 0}} {
		rr := &res.Requests[i]
		rr.Sent = time.Duration(i) * time.Second
		if c.ttft < 0 {
			rr.Err = "route: no worker"
			continue
		}
		rr.Worker, rr.Done = 0, true
		rr.FirstToken = rr.Sent + c.ttft*time.Millisecond
		rr.Finished = rr.FirstToken + c.decode*time.Millisecond
	}
	slo := SLO{TTFT: 200 * time.Millisecond, TPOT: 20 * time.Millisecond}
	s := SummarizeSLO(w, res, 30*time.Second, slo)
	if !s.SLOAttainment.Valid || s.SLOAttainment.Value != 0.25 {
		t.Fatalf("attainment %+v, want 1 of 4", s.SLOAttainment)
	}
	if s.TPOT.P50 != 25 || !s.TPOT.P90.Valid || !s.TTFT.P90.Valid {
		t.Fatalf("TPOT %+v, TTFT %+v: want p50 25 ms per token (10, 10, 40 and the 30 s timeout) and p90s", s.TPOT, s.TTFT)
	}
	if s.OutputTokensPerS <= 0 {
		t.Fatalf("output tokens per second %v", s.OutputTokensPerS)
	}
	if got := Summarize(w, res, 30*time.Second); got.SLOAttainment.Valid {
		t.Fatalf("no SLO given, attainment %+v", got.SLOAttainment)
	}
	for _, tc := range []struct {
		slo        SLO
		ttft, tpot time.Duration
		want       bool
	}{
		{SLO{}, time.Hour, time.Hour, true},
		{SLO{TTFT: 100}, 100, time.Hour, true},
		{SLO{TTFT: 100}, 101, 0, false},
		{SLO{TPOT: 10}, time.Hour, 10, true},
		{SLO{TTFT: 100, TPOT: 10}, 50, 11, false},
	} {
		if got := tc.slo.Meets(tc.ttft, tc.tpot); got != tc.want {
			t.Errorf("%+v meets ttft %v tpot %v = %v", tc.slo, tc.ttft, tc.tpot, got)
		}
	}
	if TPOT(0, time.Second, 1) != 0 || TPOT(0, time.Second, 11) != 100*time.Millisecond {
		t.Fatal("TPOT: one token has none; 11 tokens over 1 s is 100 ms each")
	}
}

// TestSummaryTenantTTFTAfterStart: a tenant's ttft_after_start_ms counts
// only its requests sent StartTransient or more after the run's first
// request (whoever's), failures at the timeout, and is empty for a tenant
// with none.
func TestSummaryTenantTTFTAfterStart(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{Prefixes: 1, PrefixTokens: 64, OutputTokens: 4, Requests: 5, Concurrency: 1, Seed: 1})
	res := &Result{Requests: make([]RequestResult, 5), Tenants: []TenantTotals{{Name: "a"}, {Name: "b"}}}
	const first = 100 * time.Millisecond // the run's first request
	for i, c := range []struct {
		tenant int
		sent   time.Duration // after first
		ttft   time.Duration // -1: failed
	}{
		{0, 0, 900 * time.Millisecond},                                 // at the start: left out
		{0, StartTransient - time.Millisecond, 800 * time.Millisecond}, // just before: left out
		{0, StartTransient, 20 * time.Millisecond},                     // counts
		{0, 2 * time.Second, -1},                                       // counts, at the timeout
		{1, 10 * time.Millisecond, 50 * time.Millisecond},              // b: only at the start
	} {
		res.TenantOf = append(res.TenantOf, c.tenant)
		rr := &res.Requests[i]
		rr.Sent = first + c.sent
		if c.ttft < 0 {
			rr.Err = "route: no worker"
			continue
		}
		rr.Worker, rr.Done = 0, true
		rr.FirstToken, rr.Finished = rr.Sent+c.ttft, rr.Sent+c.ttft+time.Millisecond
	}
	s := Summarize(w, res, 30*time.Second)
	a, b := s.Tenants[0].TTFTAfterStart, s.Tenants[1].TTFTAfterStart
	if a.P50 < 10000 || a.P99 < 29000 || a.P99 > 30000 { // two values, 20 ms and 30 s: p50 between; with the start in it, 850
		t.Fatalf("a after start %+v: want the 20 ms request and the 30 s timeout only", a)
	}
	if all := s.Tenants[0].TTFT; all.P50 < 800 {
		t.Fatalf("a's whole-run TTFT %+v: want the start's slow requests in it", all)
	}
	if b.P50 != 0 || b.P99 != 0 {
		t.Fatalf("b after start %+v: want empty (its one request was at the start)", b)
	}
}
