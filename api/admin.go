package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
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
		c.JSON(http.StatusServiceUnavailable, gin.H{"error": "cannot read the committed state now: " + err.Error()})
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

// parseThresholdUpdate reads {"model": …, optional thresholds}; a field set
// to null turns that threshold off, an absent field leaves it alone.
func parseThresholdUpdate(body []byte) (string, ThresholdUpdate, error) {
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(body, &raw); err != nil {
		return "", ThresholdUpdate{}, fmt.Errorf("invalid JSON body: %w", err)
	}
	var model string
	if err := json.Unmarshal(raw["model"], &model); err != nil || model == "" {
		return "", ThresholdUpdate{}, errors.New("model is required")
	}
	var u ThresholdUpdate
	for key, v := range raw {
		null := string(v) == "null"
		var err error
		switch key {
		case "model":
		case "active_decode_blocks_threshold":
			u.ClearActiveDecodeBlocks = null
			if !null {
				u.ActiveDecodeBlocks = new(float64)
				err = json.Unmarshal(v, u.ActiveDecodeBlocks)
			}
		case "active_prefill_tokens_threshold":
			u.ClearActivePrefillTokens = null
			if !null {
				u.ActivePrefillTokens = new(int64)
				err = json.Unmarshal(v, u.ActivePrefillTokens)
			}
		case "active_prefill_tokens_threshold_frac":
			u.ClearActivePrefillTokensFrac = null
			if !null {
				u.ActivePrefillTokensFrac = new(float64)
				err = json.Unmarshal(v, u.ActivePrefillTokensFrac)
			}
		default:
			return "", u, fmt.Errorf("unknown field %q", key)
		}
		if err != nil {
			return "", u, fmt.Errorf("%s: %w", key, err)
		}
	}
	return model, u, (router.Thresholds{ActiveDecodeBlocks: u.ActiveDecodeBlocks,
		ActivePrefillTokens: u.ActivePrefillTokens, ActivePrefillTokensFrac: u.ActivePrefillTokensFrac}).Validate()
}

func (s *Server) postBusyThreshold(c *gin.Context) {
	body, err := io.ReadAll(c.Request.Body)
	if err != nil {
		c.JSON(http.StatusRequestEntityTooLarge, gin.H{"error": "request body too large"})
		return
	}
	model, upd, err := parseThresholdUpdate(body)
	if err != nil {
		c.JSON(http.StatusBadRequest, gin.H{"error": err.Error()})
		return
	}
	if upd.Empty() && !s.readBarrier(c) {
		return
	}
	cur, ok := s.rep.Thresholds(model)
	if !ok {
		c.JSON(http.StatusNotFound, gin.H{"error": fmt.Sprintf("model %q not found", model)})
		return
	}
	if !upd.Empty() {
		if cur, err = s.rep.SetThresholds(c.Request.Context(), model, upd); err != nil {
			c.JSON(statusOf(err), gin.H{"error": err.Error()})
			return
		}
		s.log.Info("busy thresholds changed", "model", model, "decode", fmtPtr(cur.ActiveDecodeBlocks),
			"prefill", fmtPtr(cur.ActivePrefillTokens), "prefill_frac", fmtPtr(cur.ActivePrefillTokensFrac))
	}
	c.JSON(http.StatusOK, toJSON(model, cur))
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
			"active_blocks": r.ActiveBlocks, "new_blocks": r.NewBlocks, "prefill_blocks": r.PrefillBlocks,
			"decode_blocks": r.DecodeBlocks, "cost": r.Cost, "busy": r.Busy, "busy_reason": r.BusyReason,
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
	if err := s.rep.RegisterWorker(c.Request.Context(), w); err != nil {
		c.JSON(statusOf(err), gin.H{"error": err.Error()})
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
		c.JSON(statusOf(err), gin.H{"error": err.Error()})
		return
	}
	c.JSON(http.StatusOK, gin.H{"deregistered": body.ID})
}
