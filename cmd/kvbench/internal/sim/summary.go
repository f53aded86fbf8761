package sim

import (
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/stats"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
)

// Denominator is what every figure of a Summary is over, as the reports'
// JSON says it (config.denominator). One denominator for every ratio: a
// policy that fails requests cannot look better by leaving them out.
const Denominator = "all requests: a failed or unsent request counts as a miss with 0 cached tokens, " +
	"its TTFT and E2E as the timeout (timeout_s); throughput counts completed requests"

// Summary is one run's figures, every one over all the workload's requests
// (Denominator).
type Summary struct {
	Requests  int
	Completed int
	Errors    int
	// RequestHitRate is the share of all requests whose cached prefix
	// reached their HitTokens.
	RequestHitRate float64
	// CachedTokenRatio is engine-reported cached prompt tokens of the
	// completed requests over the prompt tokens of all requests.
	CachedTokenRatio float64
	// TTFT and E2E are over all requests, a failed one at the timeout.
	TTFT, E2E     stats.Quantiles
	ThroughputRPS float64
	Preemptions   float64
	IndexErrors   float64
	// WorkersPerPrefix is how many distinct workers a synthetic prefix was
	// sent to, averaged over the prefixes that occur (seed 002 §4).
	WorkersPerPrefix float64
	// VirtualSeconds is the span from the first request sent to the last
	// one finished.
	VirtualSeconds float64
}

// Summarize computes res's figures against its workload; timeout is the
// TTFT and E2E a failed request counts with.
func Summarize(w *workload.Workload, res *Result, timeout time.Duration) Summary {
	s := Summary{Requests: len(w.Requests), Preemptions: float64(res.Preemptions), IndexErrors: float64(res.IndexErrors)}
	var cached, prompt int64
	var ttft, e2e []float64
	hits := 0
	first, last := time.Duration(-1), time.Duration(0)
	perPrefix := map[int]map[int]bool{}
	for i, rr := range res.Requests {
		r := &w.Requests[i]
		if first < 0 || rr.Sent < first {
			first = rr.Sent
		}
		if r.Prefix >= 0 && rr.Worker >= 0 {
			m := perPrefix[r.Prefix]
			if m == nil {
				m = map[int]bool{}
				perPrefix[r.Prefix] = m
			}
			m[rr.Worker] = true
		}
		prompt += int64(r.PromptTokens)
		if !rr.Done {
			s.Errors++
			ttft = append(ttft, ms(timeout))
			e2e = append(e2e, ms(timeout))
			continue
		}
		s.Completed++
		last = max(last, rr.Finished)
		cached += int64(rr.CachedTokens)
		if rr.CachedTokens >= r.HitTokens {
			hits++
		}
		ttft = append(ttft, ms(rr.FirstToken-rr.Sent))
		e2e = append(e2e, ms(rr.Finished-rr.Sent))
	}
	if s.Requests > 0 {
		s.RequestHitRate = float64(hits) / float64(s.Requests)
	}
	if prompt > 0 {
		s.CachedTokenRatio = float64(cached) / float64(prompt)
	}
	s.TTFT, s.E2E = stats.Of(ttft), stats.Of(e2e)
	if s.Completed > 0 && last > first {
		s.VirtualSeconds = (last - first).Seconds()
		s.ThroughputRPS = float64(s.Completed) / s.VirtualSeconds
	}
	if len(perPrefix) > 0 {
		n := 0
		for _, m := range perPrefix {
			n += len(m)
		}
		s.WorkersPerPrefix = float64(n) / float64(len(perPrefix))
	}
	return s
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
