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
	TTFT, E2E stats.Quantiles
	// TPOT is the time per output token after the first, (finish − first
	// token) ÷ (output tokens − 1), over all requests: a failed one at the
	// timeout, a one-token answer at 0 (it has no second token to wait for).
	TPOT stats.Quantiles
	// SLOAttainment is the share of all requests that completed within
	// both limits of the SLO (failures are misses); valid when an SLO was
	// given.
	SLOAttainment stats.Optional
	// OutputTokensPerS is the output tokens of completed requests over
	// VirtualSeconds.
	OutputTokensPerS float64
	ThroughputRPS    float64
	Preemptions      float64
	IndexErrors      float64
	// WorkersPerPrefix is how many distinct workers a synthetic prefix was
	// sent to, averaged over the prefixes that occur (seed 002 §4).
	WorkersPerPrefix float64
	// VirtualSeconds is the span from the first request sent to the last
	// one finished.
	VirtualSeconds float64
	// SessionCachedFraction is the mean over sessions of each session's
	// cached over prompt tokens (SessionCachedFraction); valid when the
	// workload has sessions.
	SessionCachedFraction stats.Optional
	// PinnedSessions and UnpinnedSessions are the later turns (2nd on) of
	// the session trees that pin their prompts (Config.PinEvery) and of
	// the others; nil when no request is pinned.
	PinnedSessions, UnpinnedSessions *SessionTurns
	// Tenants are each tenant's figures (Config.Tenants; nil without),
	// every one over the tenant's requests; BackloggedSeconds is the time
	// every tenant had a request queued in some router.
	Tenants           []TenantFigures
	BackloggedSeconds float64
	// Events are the fleet events' dips (MeasureEvents; the caller fills
	// them in, it needs the run without events).
	Events []EventFigures
}

// SLO is a latency objective a request meets when its TTFT and its TPOT
// are both within their limits; a zero limit does not judge that figure.
type SLO struct {
	TTFT, TPOT time.Duration
}

// Set reports whether the SLO judges anything.
func (o SLO) Set() bool { return o.TTFT > 0 || o.TPOT > 0 }

// Meets reports whether a request with this TTFT and TPOT meets o.
func (o SLO) Meets(ttft, tpot time.Duration) bool {
	return (o.TTFT <= 0 || ttft <= o.TTFT) && (o.TPOT <= 0 || tpot <= o.TPOT)
}

// TPOT is the time per output token after the first of a request that
// produced outputTokens between its first token and its end (0 for one
// token or fewer).
func TPOT(first, end time.Duration, outputTokens int) time.Duration {
	if outputTokens <= 1 {
		return 0
	}
	return (end - first) / time.Duration(outputTokens-1)
}

// Summarize computes res's figures against its workload; timeout is the
// TTFT and E2E a failed request counts with.
func Summarize(w *workload.Workload, res *Result, timeout time.Duration) Summary {
	return SummarizeSLO(w, res, timeout, SLO{})
}

// SummarizeSLO is Summarize that also judges every request against slo
// (when set): SLOAttainment.
func SummarizeSLO(w *workload.Workload, res *Result, timeout time.Duration, slo SLO) Summary {
	s := Summary{Requests: len(w.Requests), Preemptions: float64(res.Preemptions), IndexErrors: float64(res.IndexErrors)}
	var cached, prompt, output int64
	var ttft, e2e, tpot []float64
	met := 0
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
			tpot = append(tpot, ms(timeout))
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
		t := TPOT(rr.FirstToken, rr.Finished, r.OutputTokens)
		tpot = append(tpot, ms(t))
		output += int64(r.OutputTokens)
		if slo.Meets(rr.FirstToken-rr.Sent, t) {
			met++
		}
	}
	if s.Requests > 0 {
		s.RequestHitRate = float64(hits) / float64(s.Requests)
	}
	if prompt > 0 {
		s.CachedTokenRatio = float64(cached) / float64(prompt)
	}
	s.TTFT, s.E2E, s.TPOT = stats.WithP90(ttft), stats.Of(e2e), stats.WithP90(tpot)
	if slo.Set() && s.Requests > 0 {
		s.SLOAttainment = stats.Optional{Value: float64(met) / float64(s.Requests), Valid: true}
	}
	if s.Completed > 0 && last > first {
		s.VirtualSeconds = (last - first).Seconds()
		s.ThroughputRPS = float64(s.Completed) / s.VirtualSeconds
		s.OutputTokensPerS = float64(output) / s.VirtualSeconds
	}
	s.Tenants, s.BackloggedSeconds = summarizeTenants(w, res, timeout, slo)
	if f, ok := SessionCachedFraction(w, res); ok {
		s.SessionCachedFraction = stats.Optional{Value: f, Valid: true}
	}
	s.PinnedSessions, s.UnpinnedSessions = laterTurns(w, res, timeout, true), laterTurns(w, res, timeout, false)
	if s.PinnedSessions == nil {
		s.UnpinnedSessions = nil
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

// SessionTurns are figures of a group of session turns: how many, their
// TTFT (ms; a failed turn at the timeout) and their cached over prompt
// tokens.
type SessionTurns struct {
	Turns          int             `json:"turns"`
	TTFT           stats.Quantiles `json:"ttft_ms"`
	CachedFraction float64         `json:"cached_fraction"`
}

// laterTurns is SessionTurns over the later turns (2nd on: a first turn
// has nothing of its own cached yet) of the session trees pinned or not;
// nil when there are none.
func laterTurns(w *workload.Workload, res *Result, timeout time.Duration, pinned bool) *SessionTurns {
	var ttft []float64
	var cached, prompt int64
	for i, r := range w.Requests {
		rr := res.Requests[i]
		if rr.Pinned != pinned || r.Session == workload.NoSession || w.Sessions[r.Session][0] == i {
			continue
		}
		prompt += int64(r.PromptTokens)
		if !rr.Done {
			ttft = append(ttft, ms(timeout))
			continue
		}
		cached += int64(rr.CachedTokens)
		ttft = append(ttft, ms(rr.FirstToken-rr.Sent))
	}
	if len(ttft) == 0 {
		return nil
	}
	return &SessionTurns{Turns: len(ttft), TTFT: stats.WithP90(ttft), CachedFraction: float64(cached) / float64(max(prompt, 1))}
}

// TenantFigures are one tenant's figures over its requests (the
// Denominator's rule: a failed request at the timeout, a miss).
type TenantFigures struct {
	Tenant   string          `json:"tenant"`
	Requests int             `json:"requests"`
	TTFT     stats.Quantiles `json:"ttft_ms"`
	// TTFTAfterStart is TTFT over its requests sent StartTransient or
	// more after the run's first request: the figure without the
	// start, when every worker is busy with the first, cold prompts.
	TTFTAfterStart stats.Quantiles `json:"ttft_after_start_ms"`
	// Queue is its requests' wait in the routers' admission queues, from
	// arrival to routing (completed requests).
	Queue stats.Quantiles `json:"queue_ms"`
	// SLOAttainment is the share of its requests within the SLO (valid
	// when an SLO was given).
	SLOAttainment stats.Optional `json:"slo_attainment,omitzero"`
	// Tokens are the tokens charged to it (uncached prompt and output);
	// BackloggedShare its share of the tokens charged while every tenant
	// had a request queued (valid when that happened).
	Tokens          int64          `json:"tokens"`
	BackloggedShare stats.Optional `json:"backlogged_token_share,omitzero"`
	// SharedRPS and SharedOutputTPS are the requests and output tokens
	// per second it completed while every tenant was sending: from the
	// last tenant's first request to the first tenant's last request
	// (valid when that stretch is not empty). The throughput a tenant
	// gets beside the others, not the run's, which ends with the
	// backlog of whoever is left.
	SharedRPS       stats.Optional `json:"shared_rps,omitzero"`
	SharedOutputTPS stats.Optional `json:"shared_output_tokens_per_s,omitzero"`
}

// StartTransient is how much of a run's start TenantFigures.TTFTAfterStart
// leaves out.
const StartTransient = 500 * time.Millisecond

// summarizeTenants is each tenant's figures (nil without tenants).
func summarizeTenants(w *workload.Workload, res *Result, timeout time.Duration, slo SLO) ([]TenantFigures, float64) {
	if res.TenantOf == nil {
		return nil, 0
	}
	out := make([]TenantFigures, len(res.Tenants))
	ttft := make([][]float64, len(res.Tenants))
	after := make([][]float64, len(res.Tenants))
	start := time.Duration(-1)
	for _, rr := range res.Requests {
		if start < 0 || rr.Sent < start {
			start = rr.Sent
		}
	}
	met := make([]int, len(res.Tenants))
	queue := make([][]float64, len(res.Tenants))
	for i, rr := range res.Requests {
		t := res.TenantOf[i]
		out[t].Requests++
		late := rr.Sent-start >= StartTransient
		if !rr.Done {
			ttft[t] = append(ttft[t], ms(timeout))
			if late {
				after[t] = append(after[t], ms(timeout))
			}
			continue
		}
		ttft[t] = append(ttft[t], ms(rr.FirstToken-rr.Sent))
		if late {
			after[t] = append(after[t], ms(rr.FirstToken-rr.Sent))
		}
		queue[t] = append(queue[t], ms(rr.Routed-rr.Sent))
		if slo.Meets(rr.FirstToken-rr.Sent, TPOT(rr.FirstToken, rr.Finished, w.Requests[i].OutputTokens)) {
			met[t]++
		}
	}
	// The stretch every tenant was sending: from the last first arrival
	// to the first last arrival.
	first := make([]time.Duration, len(res.Tenants))
	last := make([]time.Duration, len(res.Tenants))
	for t := range first {
		first[t], last[t] = -1, -1
	}
	for i, rr := range res.Requests {
		t := res.TenantOf[i]
		if first[t] < 0 || rr.Sent < first[t] {
			first[t] = rr.Sent
		}
		last[t] = max(last[t], rr.Sent)
	}
	from, to := time.Duration(-1), time.Duration(-1)
	for t := range first {
		if first[t] < 0 {
			from, to = -1, -1
			break
		}
		from = max(from, first[t])
		if to < 0 || last[t] < to {
			to = last[t]
		}
	}
	shared := to - from
	done := make([]int, len(res.Tenants))
	outTokens := make([]int64, len(res.Tenants))
	if from >= 0 && shared > 0 {
		for i, rr := range res.Requests {
			if rr.Done && rr.Finished >= from && rr.Finished <= to {
				t := res.TenantOf[i]
				done[t]++
				outTokens[t] += int64(w.Requests[i].OutputTokens)
			}
		}
	}
	var backlogged int64
	for _, tt := range res.Tenants {
		backlogged += tt.Backlogged
	}
	for t, tt := range res.Tenants {
		f := &out[t]
		f.Tenant, f.Tokens = tt.Name, tt.Tokens
		f.TTFT, f.Queue = stats.WithP90(ttft[t]), stats.WithP90(queue[t])
		f.TTFTAfterStart = stats.WithP90(after[t])
		if slo.Set() && f.Requests > 0 {
			f.SLOAttainment = stats.Optional{Value: float64(met[t]) / float64(f.Requests), Valid: true}
		}
		if from >= 0 && shared > 0 {
			f.SharedRPS = stats.Optional{Value: float64(done[t]) / shared.Seconds(), Valid: true}
			f.SharedOutputTPS = stats.Optional{Value: float64(outTokens[t]) / shared.Seconds(), Valid: true}
		}
		if backlogged > 0 {
			f.BackloggedShare = stats.Optional{Value: float64(tt.Backlogged) / float64(backlogged), Valid: true}
		}
	}
	return out, res.Backlogged.Seconds()
}
