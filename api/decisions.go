package api

import (
	"errors"
	"net/http"
	"strconv"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/kvrouter/kvrouter/api/capture"
	"github.com/kvrouter/kvrouter/api/decisionlog"
	"github.com/kvrouter/kvrouter/router"
)

// IndexView is an optional ability of a Replica (found by type assertion,
// like DisaggReplica): what the decision log records about the state a
// decision was made against. Without it decisions carry epoch 0 and an
// unknown sync age.
type IndexView interface {
	// IndexEpoch is the Raft applied index of the replica's index view.
	IndexEpoch() uint64
	// SyncAge is how long ago the newest replica-sync message arrived
	// (false: none yet, e.g. a single replica).
	SyncAge(now time.Time) (time.Duration, bool)
}

// recordDecision logs one routing decision of p (nothing when the log is
// off) and remembers its sequence for the outcome.
func (s *Server) recordDecision(p *prepared, d router.Decision, routeErr error, now time.Time) {
	s.hitRouted(p, d, routeErr, now) // hit rates are kept with the decision log off too
	p.worker = string(d.Worker)
	s.addDecision(p, d, nil, routeErr, now)
}

// recordDisaggDecision logs a two-stage request's decision: the prefill
// router's table when it disaggregates (the cache that matters is the
// prefill worker's), the aggregated one otherwise, and the plan. Hit rates
// are not kept for it: the decode worker's cached tokens include the KV it
// pulled, not what its own cache held.
func (s *Server) recordDisaggDecision(p *prepared, dd router.DisaggDecision, routeErr error, now time.Time) {
	plan := dd.DisaggPlan
	p.worker, p.disagg = string(plan.DecodeWorker), true
	d := dd.Aggregated
	if plan.Disaggregated {
		d = dd.Prefill
	}
	d.Worker = plan.DecodeWorker
	info := &decisionlog.Disagg{Disaggregated: plan.Disaggregated, Fallback: plan.Fallback, Reason: plan.Reason,
		DecodeWorker: string(plan.DecodeWorker), AggTTFTMs: ms(plan.Agg.Total)}
	if plan.Disaggregated {
		info.PrefillWorker = string(plan.PrefillWorker)
	}
	if plan.DisaggOK {
		info.DisaggTTFTMs = ms(plan.Disagg.Total)
	}
	if routeErr != nil {
		info = nil
	}
	s.addDecision(p, d, info, routeErr, now)
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// addDecision puts one decision into the log (nothing when it is off).
func (s *Server) addDecision(p *prepared, d router.Decision, disagg *decisionlog.Disagg, routeErr error, now time.Time) {
	l := s.cfg.Decisions
	if l == nil {
		return
	}
	e := decisionlog.Entry{Time: now, RequestID: p.requestID, Model: p.model, Mode: string(d.Mode),
		Attempt: p.attempts, PromptTokens: p.req.Tokens, PromptBlocks: len(p.req.Hashes), Worker: string(d.Worker),
		CachedBlocks: d.Overlap, SyncAge: -1, Rows: d.Rows, Disagg: disagg}
	if routeErr != nil {
		e.RouteError, e.Worker = routeErr.Error(), ""
	}
	if v, ok := s.rep.(IndexView); ok {
		e.IndexEpoch = v.IndexEpoch()
		if age, known := v.SyncAge(now); known {
			e.SyncAge = age
		}
	}
	p.decision = l.Add(e)
}

// completeDecision attaches the outcome of p's current decision, and
// captures an answered aggregated request.
func (s *Server) completeDecision(p *prepared, o decisionlog.Outcome) {
	s.hitDone(p, o)
	if s.cfg.Capture != nil && o.Status >= 200 && o.Status < 300 && !p.disagg {
		s.cfg.Capture.Record(capture.Request{Start: p.start, Model: p.model, Hashes: p.req.Hashes, BlockTokens: p.rt.Config().BlockSize,
			InputTokens: p.req.Tokens, OutputTokens: p.outputTokens, OutputKnown: p.outputTokensKnown, Sequences: p.req.Sequences,
			Worker: p.worker, CachedTokens: p.usageCached})
	}
	if p.decision == 0 {
		return
	}
	o.Finished = time.Now()
	if !p.firstByteAt.IsZero() {
		o.TTFTMs = float64(p.firstByteAt.Sub(p.start)) / float64(time.Millisecond)
	}
	s.cfg.Decisions.Complete(p.decision, o)
	p.decision = 0
}

// maxDecisionsAnswer caps one /debug/decisions answer.
const maxDecisionsAnswer = 1000

// debugDecisions answers GET /debug/decisions: the recent routing decisions,
// newest first, filtered by request_id, worker, model, since and until
// (RFC 3339 times, or a duration before now such as 5m), limit (default
// 100, at most 1000).
func (s *Server) debugDecisions(c *gin.Context) {
	l := s.cfg.Decisions
	if l == nil {
		openAIError(c, http.StatusNotFound, "not_found_error", "the decision log is off (--decision-log-size 0)")
		return
	}
	f := decisionlog.Filter{RequestID: c.Query("request_id"), Worker: c.Query("worker"), Model: c.Query("model"), Limit: 100}
	now := time.Now()
	var err error
	if f.Since, err = queryTime(c.Query("since"), now); err == nil {
		f.Until, err = queryTime(c.Query("until"), now)
	}
	if v := c.Query("limit"); err == nil && v != "" {
		if f.Limit, err = strconv.Atoi(v); err == nil && (f.Limit < 1 || f.Limit > maxDecisionsAnswer) {
			err = errors.New("limit must be 1 to 1000")
		}
	}
	if err != nil {
		openAIError(c, http.StatusBadRequest, "invalid_request_error", err.Error())
		return
	}
	ds := l.Query(f)
	if ds == nil {
		ds = []decisionlog.Decision{}
	}
	c.JSON(http.StatusOK, gin.H{"node_id": s.rep.NodeID(), "ring_size": l.Size(), "decisions": ds})
}

// queryTime reads an RFC 3339 time or a duration before now ("" = zero).
func queryTime(v string, now time.Time) (time.Time, error) {
	if v == "" {
		return time.Time{}, nil
	}
	if d, err := time.ParseDuration(v); err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339Nano, v)
	if err != nil {
		return time.Time{}, errors.New("since/until: want an RFC 3339 time or a duration such as 5m")
	}
	return t, nil
}
