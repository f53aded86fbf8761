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
