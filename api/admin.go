package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/kvrouter/kvrouter/router"
)

// thresholdJSON is Dynamo's /busy_threshold document for one model.
type thresholdJSON struct {
	Model                            string   `json:"model"`
	ActiveDecodeBlocksThreshold      *float64 `json:"active_decode_blocks_threshold"`
	ActivePrefillTokensThreshold     *int64   `json:"active_prefill_tokens_threshold"`
	ActivePrefillTokensThresholdFrac *float64 `json:"active_prefill_tokens_threshold_frac"`
}

func toJSON(model string, t router.Thresholds) thresholdJSON {
	return thresholdJSON{Model: model, ActiveDecodeBlocksThreshold: t.ActiveDecodeBlocks,
		ActivePrefillTokensThreshold: t.ActivePrefillTokens, ActivePrefillTokensThresholdFrac: t.ActivePrefillTokensFrac}
}

// readBarrier makes an admin read linearizable; false when it answered 503.
func (s *Server) readBarrier(c *gin.Context) bool {
	ctx, cancel := context.WithTimeout(c.Request.Context(), 3*time.Second)
	defer cancel()
	if err := s.rep.ReadBarrier(ctx); err != nil {
		c.JSON(http.StatusServiceUnavailable, gin.H{"error": s.redact("cannot read the committed state now: " + err.Error())})
		return false
	}
	return true
}

func (s *Server) getBusyThreshold(c *gin.Context) {
	if !s.readBarrier(c) {
		return
	}
	out := []thresholdJSON{}
	for _, m := range s.rep.Models() {
		if t, ok := s.rep.Thresholds(m); ok {
			out = append(out, toJSON(m, t))
		}
	}
	c.JSON(http.StatusOK, gin.H{"thresholds": out})
}

// thresholdFields are the three thresholds by their JSON names.
var thresholdFields = []string{"active_decode_blocks_threshold", "active_prefill_tokens_threshold", "active_prefill_tokens_threshold_frac"}

// errThresholdType is a well-formed body whose value has the wrong type
// (a string threshold, a fractional token count): 422, as Dynamo answers.
var errThresholdType = errors.New("wrong type")

// thresholdRequest is a parsed POST /busy_threshold body.
type thresholdRequest struct {
	model   string
	upd     ThresholdUpdate
	ignored []string // fields Dynamo ignores too (unknown names), reported back
}

// parseThresholdUpdate reads {"model": …, optional thresholds} with
// Dynamo's semantics: a threshold that is absent or null is left as it is,
// unknown fields are ignored (and reported back in "ignored_fields", so a
// typo is visible). Turning a threshold off is our extension, which Dynamo
// ignores: "clear": ["active_decode_blocks_threshold", …].
func parseThresholdUpdate(body []byte) (thresholdRequest, error) {
	var req thresholdRequest
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(body, &raw); err != nil {
		return req, fmt.Errorf("invalid JSON body: %w", err)
	}
	if err := json.Unmarshal(raw["model"], &req.model); err != nil || req.model == "" {
		return req, errors.New("model is required")
	}
	u := &req.upd
	var clear json.RawMessage
	for key, v := range raw {
		if string(v) == "null" {
			continue
		}
		var err error
		switch key {
		case "model":
		case "active_decode_blocks_threshold":
			u.ActiveDecodeBlocks = new(float64)
			err = json.Unmarshal(v, u.ActiveDecodeBlocks)
		case "active_prefill_tokens_threshold":
			u.ActivePrefillTokens = new(int64)
			err = json.Unmarshal(v, u.ActivePrefillTokens)
		case "active_prefill_tokens_threshold_frac":
			u.ActivePrefillTokensFrac = new(float64)
			err = json.Unmarshal(v, u.ActivePrefillTokensFrac)
		case "clear":
			clear = v // after the values, so a field both set and cleared is refused whatever the key order
		default:
			req.ignored = append(req.ignored, key)
		}
		if err != nil {
			return req, fmt.Errorf("%s: %w: %v", key, errThresholdType, err)
		}
	}
	if clear != nil {
		if err := parseClear(clear, u); err != nil {
			return req, err
		}
	}
	slices.Sort(req.ignored)
	return req, (router.Thresholds{ActiveDecodeBlocks: u.ActiveDecodeBlocks,
		ActivePrefillTokens: u.ActivePrefillTokens, ActivePrefillTokensFrac: u.ActivePrefillTokensFrac}).Validate()
}

// parseClear reads "clear": the thresholds to turn off.
func parseClear(v json.RawMessage, u *ThresholdUpdate) error {
	var names []string
	if err := json.Unmarshal(v, &names); err != nil {
		return fmt.Errorf("clear: want a list of threshold names: %w", errThresholdType)
	}
	for _, n := range names {
		set := false
		switch n {
		case "active_decode_blocks_threshold":
			set, u.ClearActiveDecodeBlocks = u.ActiveDecodeBlocks != nil, true
		case "active_prefill_tokens_threshold":
			set, u.ClearActivePrefillTokens = u.ActivePrefillTokens != nil, true
		case "active_prefill_tokens_threshold_frac":
			set, u.ClearActivePrefillTokensFrac = u.ActivePrefillTokensFrac != nil, true
		default:
			return fmt.Errorf("clear: unknown threshold %q (want one of %v)", n, thresholdFields)
		}
		if set {
			return fmt.Errorf("clear: %s is both set and cleared", n)
		}
	}
	return nil
}

func (s *Server) postBusyThreshold(c *gin.Context) {
	body, err := io.ReadAll(c.Request.Body)
	if err != nil {
		c.JSON(http.StatusRequestEntityTooLarge, gin.H{"error": "request body too large"})
		return
	}
	req, err := parseThresholdUpdate(body)
	if err != nil {
		status := http.StatusBadRequest
		if errors.Is(err, errThresholdType) {
			status = http.StatusUnprocessableEntity
		}
		c.JSON(status, gin.H{"error": err.Error()})
		return
	}
	model, upd := req.model, req.upd
	if upd.Empty() && !s.readBarrier(c) {
		return
	}
	cur, ok := s.rep.Thresholds(model)
	switch {
	case !ok && !upd.Empty():
		c.JSON(http.StatusNotFound, gin.H{"error": fmt.Sprintf("model %q not found: thresholds can only be set for served models", model)})
		return
	case !ok:
		// Dynamo answers a read of a model it does not know with nulls.
		c.JSON(http.StatusOK, withIgnored(toJSON(model, router.Thresholds{}), req.ignored))
		return
	}
	if !upd.Empty() {
		if cur, err = s.rep.SetThresholds(c.Request.Context(), model, upd); err != nil {
			c.JSON(statusOf(err), gin.H{"error": s.redact(err.Error())})
			return
		}
		s.log.Info("busy thresholds changed", "model", model, "decode", fmtPtr(cur.ActiveDecodeBlocks),
			"prefill", fmtPtr(cur.ActivePrefillTokens), "prefill_frac", fmtPtr(cur.ActivePrefillTokensFrac))
	}
	c.JSON(http.StatusOK, withIgnored(toJSON(model, cur), req.ignored))
}

// withIgnored adds "ignored_fields" to an answer when the body had fields
// that are not thresholds.
func withIgnored(t thresholdJSON, ignored []string) any {
	if len(ignored) == 0 {
		return t
	}
	return struct {
		thresholdJSON
		Ignored []string `json:"ignored_fields"`
	}{t, ignored}
}

func fmtPtr[T any](p *T) string {
	if p == nil {
		return "null"
	}
	return fmt.Sprint(*p)
}

// costRows is a decision's per-worker cost table as JSON rows.
func costRows(d router.Decision, cfg router.Config) []gin.H {
	rows := make([]gin.H, 0, len(d.Rows))
	for _, r := range d.Rows {
		rows = append(rows, gin.H{"worker": r.Worker, "cached_blocks": r.Overlap, "active_prefill_tokens": r.ActivePrefillTokens,
			"active_blocks": r.ActiveBlocks, "active_requests": r.ActiveRequests, "new_blocks": r.NewBlocks, "prefill_blocks": r.PrefillBlocks,
			"decode_blocks": r.DecodeBlocks, "cost": r.Cost, "busy": r.Busy, "busy_reason": r.Reason(),
			"host_blocks": r.HostOverlap, "disk_blocks": r.DiskOverlap, "tier_credit": r.TierCredit,
			"formula": r.Formula(cfg.PrefillLoadScale)})
	}
	return rows
}

// debugRoute answers the cost table for an OpenAI body without sending it.
func (s *Server) debugRoute(c *gin.Context) {
	chat := true
	if c.Query("endpoint") == "completions" {
		chat = false
	}
	// Accept either body shape: a prompt means completions.
	body, err := io.ReadAll(c.Request.Body)
	if err != nil {
		openAIError(c, http.StatusRequestEntityTooLarge, "invalid_request_error", "request body too large")
		return
	}
	var probe struct {
		Prompt json.RawMessage `json:"prompt"`
	}
	if json.Unmarshal(body, &probe) == nil && len(probe.Prompt) > 0 {
		chat = false
	}
	c.Request.Body = io.NopCloser(bytesReader(body))
	p, ok := s.prepare(c, chat)
	if !ok {
		return
	}
	cfg := p.rt.Config()
	if dr, ok := s.disaggRouter(p.model); ok {
		// Two-stage: the prefill, decode and aggregated tables, both TTFT
		// estimates and the choice, without booking anything.
		dd, err := dr.Plan(p.req, time.Now())
		out := gin.H{"model": p.model, "mode": cfg.Mode, "prompt_tokens": p.req.Tokens, "prompt_blocks": len(p.req.Hashes),
			"block_size": cfg.BlockSize, "workers": costRows(dd.Aggregated, cfg), "prefill_workers": costRows(dd.Prefill, cfg),
			"decode_workers": costRows(dd.Decode, cfg), "disagg": planJSON(dd.DisaggPlan), "explain": dd.Explain()}
		if dd.PrefillErr != nil {
			out["prefill_error"] = dd.PrefillErr.Error()
		}
		if err != nil {
			out["error"] = err.Error()
		} else {
			out["chosen"] = dd.DecodeWorker
			if dd.Disaggregated {
				out["chosen_prefill"] = dd.PrefillWorker
			}
		}
		c.JSON(http.StatusOK, out)
		return
	}
	d, err := p.rt.Decide(p.req, time.Now())
	out := gin.H{"model": p.model, "mode": cfg.Mode, "prompt_tokens": p.req.Tokens, "prompt_blocks": len(p.req.Hashes),
		"block_size": cfg.BlockSize, "workers": costRows(d, cfg), "explain": d.Explain()}
	if err != nil {
		out["error"] = err.Error()
	} else {
		out["chosen"] = d.Worker
	}
	c.JSON(http.StatusOK, out)
}

func (s *Server) listWorkers(c *gin.Context) {
	out := gin.H{}
	for _, m := range s.rep.Models() {
		rt, _ := s.rep.Router(m)
		var ws []gin.H
		for _, w := range rt.Workers() {
			url, _ := s.rep.WorkerURL(w.ID)
			ws = append(ws, gin.H{"id": w.ID, "url": url, "total_kv_blocks": w.TotalBlocks, "max_num_batched_tokens": w.MaxBatchedTokens})
		}
		out[m] = ws
	}
	c.JSON(http.StatusOK, gin.H{"models": out})
}

func (s *Server) registerWorker(c *gin.Context) {
	var w WorkerSpec
	if err := c.ShouldBindJSON(&w); err != nil {
		c.JSON(http.StatusBadRequest, gin.H{"error": "invalid JSON body: " + err.Error()})
		return
	}
	if err := w.Validate(); err != nil {
		c.JSON(http.StatusBadRequest, gin.H{"error": err.Error()})
		return
	}
	if err := checkWorkerURL(w.URL, s.cfg.AllowLoopbackWorkers); err != nil {
		s.metrics.rejected.WithLabelValues("worker_url").Inc()
		c.JSON(http.StatusBadRequest, gin.H{"error": s.redact(err.Error())})
		return
	}
	// The caps are checked against this replica's view, so replicas taking
	// registrations at the same moment may pass a few beyond them: a bound
	// on growth, not an exact quota (DESIGN.md, Bounds).
	workers, models, knownWorker, knownModel := s.registryCounts(w.ID, w.Model)
	switch {
	case !knownWorker && workers >= s.cfg.MaxWorkers:
		s.metrics.rejected.WithLabelValues("max_workers").Inc()
		c.JSON(http.StatusTooManyRequests, gin.H{"error": fmt.Sprintf("%d workers registered, the cap (MaxWorkers): deregister one first", workers)})
		return
	case !knownModel && models >= s.cfg.MaxModels:
		s.metrics.rejected.WithLabelValues("max_models").Inc()
		c.JSON(http.StatusTooManyRequests, gin.H{"error": fmt.Sprintf("%d models served, the cap (MaxModels): model %q refused", models, w.Model)})
		return
	}
	if err := s.rep.RegisterWorker(c.Request.Context(), w); err != nil {
		c.JSON(statusOf(err), gin.H{"error": s.redact(err.Error())})
		return
	}
	c.JSON(http.StatusOK, gin.H{"registered": w.ID})
}

func (s *Server) deregisterWorker(c *gin.Context) {
	var body struct {
		ID string `json:"id"`
	}
	if err := c.ShouldBindJSON(&body); err != nil || body.ID == "" {
		c.JSON(http.StatusBadRequest, gin.H{"error": "body must be {\"id\": worker}"})
		return
	}
	if err := s.rep.DeregisterWorker(c.Request.Context(), body.ID); err != nil {
		c.JSON(statusOf(err), gin.H{"error": s.redact(err.Error())})
		return
	}
	c.JSON(http.StatusOK, gin.H{"deregistered": body.ID})
}

// moveWorker is POST /workers/move {"id", "group"}: the worker's blocks,
// registration and events move to data group "group" (WorkerMover). It
// answers once this replica sees the move done, or 504 when it is still
// running after moveWait (it goes on; the placement is committed).
func (s *Server) moveWorker(c *gin.Context) {
	var body struct {
		ID    string `json:"id"`
		Group int    `json:"group"`
	}
	if err := c.ShouldBindJSON(&body); err != nil || body.ID == "" || body.Group < 1 {
		c.JSON(http.StatusBadRequest, gin.H{"error": "body must be {\"id\": worker, \"group\": data group from 1}"})
		return
	}
	m, ok := s.rep.(WorkerMover)
	if !ok {
		c.JSON(http.StatusNotFound, gin.H{"error": "this replica cannot move workers"})
		return
	}
	ctx, cancel := context.WithTimeout(c.Request.Context(), moveWait)
	defer cancel()
	from, err := m.MoveWorker(ctx, body.ID, body.Group)
	if errors.Is(err, context.DeadlineExceeded) {
		c.JSON(http.StatusGatewayTimeout, gin.H{"error": s.redact(err.Error()), "from": from, "to": body.Group})
		return
	}
	if err != nil {
		c.JSON(statusOf(err), gin.H{"error": s.redact(err.Error())})
		return
	}
	c.JSON(http.StatusOK, gin.H{"moved": body.ID, "from": from, "to": body.Group})
}

// moveWait bounds how long POST /workers/move waits for the hand-over: the
// old group's backlog of the worker committed, its blocks copied (seconds
// for a full GPU's worth).
const moveWait = 30 * time.Second

// shardAdmin is the replica's ShardAdmin, or a 404 answered.
func (s *Server) shardAdmin(c *gin.Context) (ShardAdmin, bool) {
	a, ok := s.rep.(ShardAdmin)
	if !ok {
		c.JSON(http.StatusNotFound, gin.H{"error": "this replica's index is not sharded"})
	}
	return a, ok
}

// getRaftGroups is GET /cluster/raft_groups: {"groups": the cluster's
// data-group count (0 before any placement), "running": this replica's}.
func (s *Server) getRaftGroups(c *gin.Context) {
	a, ok := s.shardAdmin(c)
	if !ok {
		return
	}
	cluster, running := a.RaftGroups()
	c.JSON(http.StatusOK, gin.H{"groups": cluster, "running": running})
}

// setRaftGroups is POST /cluster/raft_groups {"groups": N}: the cluster's
// data-group count grows to N, once every replica runs N.
func (s *Server) setRaftGroups(c *gin.Context) {
	var body struct {
		Groups int `json:"groups"`
	}
	if err := c.ShouldBindJSON(&body); err != nil || body.Groups < 2 {
		c.JSON(http.StatusBadRequest, gin.H{"error": "body must be {\"groups\": N} with N >= 2"})
		return
	}
	a, ok := s.shardAdmin(c)
	if !ok {
		return
	}
	if err := a.SetRaftGroups(c.Request.Context(), body.Groups); err != nil {
		c.JSON(statusOf(err), gin.H{"error": s.redact(err.Error())})
		return
	}
	cluster, running := a.RaftGroups()
	c.JSON(http.StatusOK, gin.H{"groups": cluster, "running": running})
}

// rebalanceWorkers is POST /workers/rebalance: {"moves": [...]} once every
// data group holds within one worker of the others.
func (s *Server) rebalanceWorkers(c *gin.Context) {
	a, ok := s.shardAdmin(c)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(c.Request.Context(), rebalanceWait)
	defer cancel()
	moves, err := a.Rebalance(ctx)
	if moves == nil {
		moves = []WorkerMove{}
	}
	if err != nil {
		c.JSON(statusOf(err), gin.H{"error": s.redact(err.Error()), "moves": moves})
		return
	}
	c.JSON(http.StatusOK, gin.H{"moves": moves})
}

// rebalanceWait bounds one rebalance: moveWait per move, a few moves.
const rebalanceWait = 5 * time.Minute
