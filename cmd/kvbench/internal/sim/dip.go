package sim

import (
	"cmp"
	"slices"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/stats"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
)

// The dip a fleet event leaves: the cached-token ratio and TTFT of the
// requests sent in windows after it, against the window before it in the
// same run without the event (the steady state: the two runs are the same
// up to the event but for the requests the event re-sends), and the cached
// tokens lost against that run (paired request by request: the workload is
// the same). A request a removal re-sent counts at its re-send, in the
// windows after the event, with its TTFT from its first send.

// DipOptions say how a dip is measured.
type DipOptions struct {
	// Window is the width of the windows requests are grouped in by
	// send time; the steady state is the window before the event.
	Window time.Duration
	// Horizon is how long after the event the loss is counted (issue 29:
	// 5 simulated minutes) and windows are judged.
	Horizon time.Duration
	// Tolerance is how far below the steady cached-token ratio a window
	// may be and count as recovered (and a new worker as warm).
	Tolerance float64
	// TTFTFactor is how far above the steady p99 TTFT a window may be
	// and count as recovered.
	TTFTFactor float64
	// Timeout is a failed request's TTFT.
	Timeout time.Duration
}

// WindowFigures are the requests sent in one window.
type WindowFigures struct {
	StartS           float64         `json:"start_s"` // from the event (negative: before it)
	Requests         int             `json:"requests"`
	CachedTokenRatio float64         `json:"cached_token_ratio"`
	TTFT             stats.Quantiles `json:"ttft_ms"`
}

// EventFigures are one fleet event's dip.
type EventFigures struct {
	Kind    string  `json:"kind"`
	Chooser string  `json:"chooser,omitempty"`
	Worker  string  `json:"worker,omitempty"` // "" when the event took no worker (and in a mean over reps: see workers)
	AtS     float64 `json:"at_s"`
	// Steady is the window before the event in the run without it; After
	// is the whole horizon after it.
	Steady WindowFigures `json:"steady"`
	After  WindowFigures `json:"after"`
	// The dip's depth: the lowest window ratio and the highest window p99
	// TTFT within the horizon.
	MinCachedTokenRatio float64 `json:"min_cached_token_ratio"`
	MaxTTFTP99Ms        float64 `json:"max_ttft_p99_ms"`
	// Its duration: from the event to the end of the last window outside
	// the tolerance (0: none was); absent when the horizon's last window
	// is still outside. A window is judged against the same window of the
	// run without the event (its cached ratio minus Tolerance; TTFTFactor
	// times its p99, or the steady p99 when higher).
	RecoveredS     stats.Optional `json:"recovered_s,omitzero"`
	TTFTRecoveredS stats.Optional `json:"ttft_recovered_s,omitzero"`
	// LostCachedTokens is the baseline run's cached tokens minus this
	// run's, over the requests sent within the horizon after the event;
	// LostFraction divides it by the baseline's.
	LostCachedTokens     float64 `json:"lost_cached_tokens"`
	BaselineCachedTokens float64 `json:"baseline_cached_tokens"`
	LostFraction         float64 `json:"lost_fraction"`
	Resent               float64 `json:"resent"`
	// SessionsKept (remove, drain): the cached tokens of the worker's
	// sessions' later turns over the baseline's (absent without sessions).
	SessionsKept stats.Optional `json:"sessions_kept,omitzero"`
	// LeftS (drain): from the event to the worker leaving, idle.
	LeftS stats.Optional `json:"left_s,omitzero"`
	// WarmS (add): from the event to the end of the first window in which
	// the new worker's cached-token ratio came within the tolerance of the
	// fleet's steady state; NewWorkerShare: its share of the requests sent
	// within the horizon.
	WarmS          stats.Optional `json:"warm_s,omitzero"`
	NewWorkerShare stats.Optional `json:"new_worker_share,omitzero"`
	// Steered (add, with --warmup-share): the requests the warm-up sent
	// to the new worker on purpose; WarmUpEndS: from the event to when
	// the warm-up found it warm and stopped (absent when it never did).
	Steered    stats.Optional `json:"steered,omitzero"`
	WarmUpEndS stats.Optional `json:"warm_up_end_s,omitzero"`
	// WarmComparableS (add): WarmS judged like with like (warmComparable
	// below): from the event to the end of the first span in which the
	// new worker's cached share of its requests' held tokens (the longest
	// prefix some worker's engine held when each was routed: the most any
	// routing could have served from cache) came within the tolerance of
	// the other workers' share over the same span of the same run, the
	// span widened back window by window until the new worker had
	// warmMinRequests requests with held tokens in it. WarmS is kept beside it: it compares
	// the new worker's cached ratio over every token with the fleet's
	// before the event, which a worker given the new conversations (kv:
	// the empty worker is the least loaded) or the prefixes the fleet had
	// evicted can never reach, and which a cache-blind fleet's low ratio
	// lets a cold worker reach by chance in a window of 1–3 requests.
	WarmComparableS stats.Optional `json:"warm_comparable_s,omitzero"`
	// WarmComparableFineS (add): WarmComparableS's test made at each of
	// the new worker's requests with held tokens, not at the ends of the
	// windows (warmComparableFine): the span ends when that request was
	// sent and reaches back one window, widened to its last
	// warmMinRequests such requests. Kept beside WarmComparableS, which
	// counts a worker warm at 10.5 s as 20 s and can never be under one
	// window: round-robin's new worker is warm in the first window in
	// half the seeds of the seed-002 shape, so no policy could be
	// measured at under half its time there.
	WarmComparableFineS stats.Optional `json:"warm_comparable_fine_s,omitzero"`
	// The TTFT cost measured like with like: BaseMaxTTFTP99Ms is the
	// highest window p99 over the same windows in the run without the
	// event (the windows' own spread: MaxTTFTP99Ms over Steady's p99 is
	// the highest of many noisy p99s over one); WorstWindowP99VsBase the
	// highest window p99 over the same window's p99 in the run without
	// the event (windows of at least warmMinRequests requests in both);
	// TTFTP99VsBase the p99 of the requests sent within the horizon over
	// the same requests' p99 in the run without the event.
	// WarmUpTTFTP99Ms (add) is the p99 TTFT of the requests sent while
	// the new worker warmed (from the event to WarmComparableS, at least
	// one window; the horizon when it never warmed): the issue's "p99
	// TTFT no worse than 1.2× steady state" is this over Steady's p99;
	// WarmUpBaseTTFTP99Ms is the same requests' p99 in the run without
	// the event.
	WarmUpTTFTP99Ms      float64 `json:"warm_up_ttft_p99_ms,omitempty"`
	WarmUpBaseTTFTP99Ms  float64 `json:"warm_up_base_ttft_p99_ms,omitempty"`
	BaseMaxTTFTP99Ms     float64 `json:"base_max_ttft_p99_ms,omitempty"`
	WorstWindowP99VsBase float64 `json:"worst_window_p99_vs_base,omitempty"`
	TTFTP99VsBase        float64 `json:"ttft_p99_vs_base,omitempty"`
	// Shadow prefills (drain-shadow, --warmup-shadow; shadow.go): copies
	// sent and skipped for want of room, sessions rebound when their copy
	// ended, the prompt tokens their engines computed, that prefill's
	// time as steps of its own (an upper bound) and the computed tokens
	// over the fleet's over the horizon (the clients' requests sent
	// within it plus the copies): the extra work the copies cost.
	Shadows             stats.Optional  `json:"shadows,omitzero"`
	ShadowSkipped       stats.Optional  `json:"shadow_skipped,omitzero"`
	ShadowRebinds       stats.Optional  `json:"shadow_rebinds,omitzero"`
	ShadowRedirects     stats.Optional  `json:"shadow_redirects,omitzero"`
	ShadowUsed          stats.Optional  `json:"shadow_used,omitzero"`
	ShadowPrefillTokens stats.Optional  `json:"shadow_prefill_tokens,omitzero"`
	ShadowPrefillMs     stats.Optional  `json:"shadow_prefill_ms,omitzero"`
	ShadowPrefillShare  stats.Optional  `json:"shadow_prefill_share,omitzero"`
	Windows             []WindowFigures `json:"windows,omitempty"`
}

// MeasureEvents measures every event of res against base, the same run
// without events.
func MeasureEvents(w *workload.Workload, res, base *Result, o DipOptions) []EventFigures {
	out := make([]EventFigures, 0, len(res.Events))
	for _, ev := range res.Events {
		out = append(out, measureEvent(w, res, base, ev, o))
	}
	return out
}

// window sums the requests sent in [from, to) that keep(i) accepts.
func window(w *workload.Workload, res *Result, from, to time.Duration, timeout time.Duration, keep func(i int) bool) WindowFigures {
	var cached, prompt int64
	var ttft []float64
	n := 0
	for i, rr := range res.Requests {
		if at := sentKey(rr); at < from || at >= to || (keep != nil && !keep(i)) {
			continue
		}
		n++
		prompt += int64(w.Requests[i].PromptTokens)
		if rr.Done {
			cached += int64(rr.CachedTokens)
			ttft = append(ttft, ms(rr.FirstToken-rr.Sent))
		} else {
			ttft = append(ttft, ms(timeout))
		}
	}
	f := WindowFigures{Requests: n, TTFT: stats.Of(ttft)}
	if prompt > 0 {
		f.CachedTokenRatio = float64(cached) / float64(prompt)
	}
	return f
}

func measureEvent(w *workload.Workload, res, base *Result, ev EventRecord, o DipOptions) EventFigures {
	t := ev.At
	f := EventFigures{Kind: string(ev.Kind), AtS: t.Seconds(), Resent: float64(ev.Resent)}
	if ev.Kind != EventAdd {
		f.Chooser = string(ev.Chooser)
	}
	if ev.Worker >= 0 {
		f.Worker = string(res.Workers[ev.Worker])
	}
	f.Steady = window(w, base, max(t-o.Window, 0), t, o.Timeout, nil)
	f.Steady.StartS = -min(o.Window, t).Seconds()
	end := t + o.Horizon
	lastSent := time.Duration(0)
	for _, rr := range res.Requests {
		lastSent = max(lastSent, sentKey(rr))
	}
	f.After = window(w, res, t, end, o.Timeout, nil)
	ratioOut, ttftOut := time.Duration(0), time.Duration(0)
	ratioLast, ttftLast := true, true
	f.MinCachedTokenRatio = f.Steady.CachedTokenRatio
	for from := t; from < end && from <= lastSent; from += o.Window {
		wf := window(w, res, from, min(from+o.Window, end), o.Timeout, nil)
		wf.StartS = (from - t).Seconds()
		f.Windows = append(f.Windows, wf)
		if wf.Requests == 0 {
			continue
		}
		f.MinCachedTokenRatio = min(f.MinCachedTokenRatio, wf.CachedTokenRatio)
		f.MaxTTFTP99Ms = max(f.MaxTTFTP99Ms, wf.TTFT.P99)
		stop := min(from+o.Window, end) - t
		// Judged against the same window without the event, so that
		// what the workload does anyway (a 10-s p99 is nearly a
		// maximum) is not taken for the event's dip.
		bw := window(w, base, from, min(from+o.Window, end), o.Timeout, nil)
		f.BaseMaxTTFTP99Ms = max(f.BaseMaxTTFTP99Ms, bw.TTFT.P99)
		if wf.Requests >= warmMinRequests && bw.Requests >= warmMinRequests && bw.TTFT.P99 > 0 {
			f.WorstWindowP99VsBase = max(f.WorstWindowP99VsBase, wf.TTFT.P99/bw.TTFT.P99)
		}
		ratioLast = wf.CachedTokenRatio >= bw.CachedTokenRatio-o.Tolerance
		if !ratioLast {
			ratioOut = stop
		}
		ttftLast = wf.TTFT.P99 <= o.TTFTFactor*max(bw.TTFT.P99, f.Steady.TTFT.P99)
		if !ttftLast {
			ttftOut = stop
		}
		if ev.Kind == EventAdd && ev.Worker >= 0 && !f.WarmS.Valid {
			nw := window(w, res, from, min(from+o.Window, end), o.Timeout, func(i int) bool { return res.Requests[i].Worker == ev.Worker })
			if nw.Requests > 0 && nw.CachedTokenRatio >= f.Steady.CachedTokenRatio-o.Tolerance {
				f.WarmS = stats.Optional{Value: stop.Seconds(), Valid: true}
			}
		}
	}
	if ratioLast {
		f.RecoveredS = stats.Optional{Value: ratioOut.Seconds(), Valid: true}
	}
	if ttftLast {
		f.TTFTRecoveredS = stats.Optional{Value: ttftOut.Seconds(), Valid: true}
	}
	if ev.Kind == EventAdd && ev.Worker >= 0 && f.After.Requests > 0 {
		on := window(w, res, t, end, o.Timeout, func(i int) bool { return res.Requests[i].Worker == ev.Worker })
		f.NewWorkerShare = stats.Optional{Value: float64(on.Requests) / float64(f.After.Requests), Valid: true}
	}
	if ev.Kind == EventAdd && ev.Worker >= 0 {
		f.WarmComparableS = warmComparable(res, ev, o, min(end, lastSent+o.Window))
		f.WarmComparableFineS = warmComparableFine(res, ev, o, end)
		span := end
		if f.WarmComparableS.Valid {
			span = t + max(time.Duration(f.WarmComparableS.Value*float64(time.Second)), o.Window)
		}
		f.WarmUpTTFTP99Ms = horizonP99(res, res, t, span, o.Timeout)
		f.WarmUpBaseTTFTP99Ms = horizonP99(base, res, t, span, o.Timeout)
	}
	if p := horizonP99(base, res, t, end, o.Timeout); p > 0 {
		f.TTFTP99VsBase = horizonP99(res, res, t, end, o.Timeout) / p
	}
	if ev.Kind == EventAdd && (ev.Steered > 0 || ev.WarmUpEnd >= 0) {
		f.Steered = stats.Optional{Value: float64(ev.Steered), Valid: true}
	}
	if ev.Kind == EventAdd && ev.WarmUpEnd >= 0 {
		f.WarmUpEndS = stats.Optional{Value: (ev.WarmUpEnd - t).Seconds(), Valid: true}
	}
	if ev.Kind.drains() && ev.Left >= 0 {
		f.LeftS = stats.Optional{Value: (ev.Left - t).Seconds(), Valid: true}
	}
	var lost, baseCached, computed int64
	for i, rr := range res.Requests {
		if at := sentKey(rr); at < t || at >= end {
			continue
		}
		computed += int64(w.Requests[i].PromptTokens) - cachedOf(rr)
		b := cachedOf(base.Requests[i])
		baseCached += b
		lost += b - cachedOf(rr)
	}
	f.LostCachedTokens, f.BaselineCachedTokens = float64(lost), float64(baseCached)
	if baseCached > 0 {
		f.LostFraction = float64(lost) / float64(baseCached)
	}
	if ev.Shadows > 0 || ev.ShadowSkipped > 0 || ev.Kind == EventDrainShadow {
		opt := func(v float64) stats.Optional { return stats.Optional{Value: v, Valid: true} }
		f.Shadows, f.ShadowSkipped, f.ShadowRebinds = opt(float64(ev.Shadows)), opt(float64(ev.ShadowSkipped)), opt(float64(ev.ShadowRebinds))
		f.ShadowRedirects, f.ShadowUsed = opt(float64(ev.ShadowRedirects)), opt(float64(ev.ShadowUsed))
		f.ShadowPrefillTokens = opt(float64(ev.ShadowPrefillTokens))
		f.ShadowPrefillMs = opt(ms(ev.ShadowPrefillTime))
		if all := computed + ev.ShadowPrefillTokens; all > 0 {
			f.ShadowPrefillShare = opt(float64(ev.ShadowPrefillTokens) / float64(all))
		}
	}
	if len(ev.Sessions) > 0 {
		var kept, was int64
		for _, sess := range ev.Sessions {
			for _, i := range w.Sessions[sess] {
				if sentKey(res.Requests[i]) < t {
					continue
				}
				kept += cachedOf(res.Requests[i])
				was += cachedOf(base.Requests[i])
			}
		}
		if was > 0 {
			f.SessionsKept = stats.Optional{Value: float64(kept) / float64(was), Valid: true}
		}
	}
	return f
}

// sentKey is when a request counts as sent for the windows: its re-send,
// when a removal re-sent it.
func sentKey(rr RequestResult) time.Duration {
	if rr.ResentAt > 0 {
		return rr.ResentAt
	}
	return rr.Sent
}

// cachedOf is a request's cached tokens, 0 when it did not complete.
func cachedOf(rr RequestResult) int64 {
	if !rr.Done {
		return 0
	}
	return int64(rr.CachedTokens)
}

// SessionCachedFraction is the mean over sessions of each session's cached
// tokens over its prompt tokens (a failed turn counts 0 cached); false
// when the workload has no sessions.
func SessionCachedFraction(w *workload.Workload, res *Result) (float64, bool) {
	if len(w.Sessions) == 0 {
		return 0, false
	}
	sum := 0.0
	for _, turns := range w.Sessions {
		var cached, prompt int64
		for _, i := range turns {
			prompt += int64(w.Requests[i].PromptTokens)
			cached += cachedOf(res.Requests[i])
		}
		if prompt > 0 {
			sum += float64(cached) / float64(prompt)
		}
	}
	return sum / float64(len(w.Sessions)), true
}

// warmComparable is when the worker event ev added was first warm like
// with like (EventFigures.WarmComparableS): at the end of each window
// after the event (until end), over the requests sent in the span from
// that window's start (moved back by whole windows, not before the event,
// until the new worker has warmMinRequests requests with held tokens in
// it), the new worker's cached tokens over its held tokens against the other workers'
// (the fleet's hit rate now, under the same policy, over the tokens a
// cache could serve), less the tolerance. Invalid when it never was.
func warmComparable(res *Result, ev EventRecord, o DipOptions, end time.Duration) stats.Optional {
	t := ev.At
	type sums struct {
		cached, held int64
		n            int
	}
	sum := func(from, to time.Duration) (nw, others sums) {
		for _, rr := range res.Requests {
			if at := sentKey(rr); at < from || at >= to || rr.Worker < 0 {
				continue
			}
			h := int64(rr.HeldTokens)
			if h == 0 {
				continue // nothing to hit: new content tells nothing
			}
			c := min(cachedOf(rr), h)
			if rr.Worker == ev.Worker {
				nw.cached, nw.held, nw.n = nw.cached+c, nw.held+h, nw.n+1
			} else {
				others.cached, others.held, others.n = others.cached+c, others.held+h, others.n+1
			}
		}
		return nw, others
	}
	for stop := t + o.Window; stop-o.Window < end; stop += o.Window {
		from := stop - o.Window
		nw, others := sum(from, stop)
		for nw.n < warmMinRequests && from > t {
			from = max(from-o.Window, t)
			nw, others = sum(from, stop)
		}
		if nw.n < warmMinRequests || nw.held == 0 || others.held == 0 {
			continue
		}
		if float64(nw.cached)/float64(nw.held) >= float64(others.cached)/float64(others.held)-o.Tolerance {
			return stats.Optional{Value: (stop - t).Seconds(), Valid: true}
		}
	}
	return stats.Optional{}
}

// horizonP99 is the p99 TTFT in run of the requests that ref sent in
// [from, to) (pairing two runs of one workload request by request; a
// failed request counts the timeout).
func horizonP99(run, ref *Result, from, to, timeout time.Duration) float64 {
	var ttft []float64
	for i, rr := range ref.Requests {
		if at := sentKey(rr); at < from || at >= to {
			continue
		}
		if x := run.Requests[i]; x.Done {
			ttft = append(ttft, ms(x.FirstToken-x.Sent))
		} else {
			ttft = append(ttft, ms(timeout))
		}
	}
	return stats.Of(ttft).P99
}

// warmComparableFine is warmComparable tested at the sending of each of
// the new worker's requests with held tokens before end (inclusive): over
// the span from one window back (not before the event), widened back to
// its last warmMinRequests such requests, its cached share of held tokens
// against the other workers' over the same span, less the tolerance. The
// time from the event to that request; invalid when it never was.
func warmComparableFine(res *Result, ev EventRecord, o DipOptions, end time.Duration) stats.Optional {
	t := ev.At
	var mine []int // the new worker's requests with held tokens, by sending
	for i, rr := range res.Requests {
		if at := sentKey(rr); rr.Worker == ev.Worker && rr.HeldTokens > 0 && at >= t && at < end {
			mine = append(mine, i)
		}
	}
	slices.SortStableFunc(mine, func(a, b int) int { return cmp.Compare(sentKey(res.Requests[a]), sentKey(res.Requests[b])) })
	for j := warmMinRequests - 1; j < len(mine); j++ {
		stop := sentKey(res.Requests[mine[j]])
		from := max(min(stop-o.Window, sentKey(res.Requests[mine[j-warmMinRequests+1]])), t)
		var nc, nh, oc, oh int64
		for _, rr := range res.Requests {
			if at := sentKey(rr); at < from || at > stop || rr.Worker < 0 || rr.HeldTokens == 0 {
				continue
			}
			h := int64(rr.HeldTokens)
			c := min(cachedOf(rr), h)
			if rr.Worker == ev.Worker {
				nc, nh = nc+c, nh+h
			} else {
				oc, oh = oc+c, oh+h
			}
		}
		if nh > 0 && oh > 0 && float64(nc)/float64(nh) >= float64(oc)/float64(oh)-o.Tolerance {
			return stats.Optional{Value: (stop - t).Seconds(), Valid: true}
		}
	}
	return stats.Optional{}
}
