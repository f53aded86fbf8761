package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/kvrouter/kvrouter/router"
)

// DisaggReplica is implemented by a replica that serves some models
// disaggregated (prefill and decode on different workers). Disagg returns
// the model's two-stage router, or false when the model routes aggregated
// through Router alone (--disagg off, or no prefill-capable worker).
type DisaggReplica interface {
	Disagg(model string) (*router.DisaggRouter, bool)
}

// Replica-sync ids of the two bookings of a disaggregated request: the
// receivers book "…|p" on the prefill router and "…|d" on the decode router
// of the model, so every replica sees both stages' load.
const (
	PrefillBookingSuffix = "|p"
	DecodeBookingSuffix  = "|d"
)

// errTransfer is a decode worker's report that pulling the KV failed
// (HTTP 502 with error type kv_transfer_failed, before any body byte).
var errTransfer = errors.New("kv transfer failed")

func (s *Server) disaggRouter(model string) (*router.DisaggRouter, bool) {
	dr, ok := s.rep.(DisaggReplica)
	if !ok {
		return nil, false
	}
	return dr.Disagg(model)
}

// forwardDisagg serves a request through the two-stage router: the plan
// (disaggregated or aggregated, by mode and estimate), the remote prefill on
// the prefill worker, then the decode worker with the prefill's
// kv_transfer_params (vLLM's NIXL proxy protocol). No stage loses the
// request: a failed prefill is served aggregated on the decode worker, a
// failed transfer is retried and then served aggregated, loudly (a warning
// and kvrouter_disagg_recoveries_total).
func (s *Server) forwardDisagg(c *gin.Context, p *prepared, dr *router.DisaggRouter) {
	id := p.req.ID
	p.req.Exclude = append(p.req.Exclude, s.cool.excludeDisagg(dr.Workers(), time.Now())...)
	for attempt := 0; ; attempt++ {
		dd, err := dr.Route(p.req, time.Now())
		if err != nil {
			s.routeError(c, p, err, attempt)
			return
		}
		plan := dd.DisaggPlan
		s.metrics.observePlan(p.model, plan)
		freeAll := func() {
			dr.Free(id)
			s.rep.Freed(p.model, id+PrefillBookingSuffix)
			s.rep.Freed(p.model, id+DecodeBookingSuffix)
			s.gates.wake(p.model)
		}
		body, disagg := p.body, false
		if plan.Disaggregated {
			s.bookDisagg(p, plan)
			params, err := s.remotePrefill(c, p, plan.PrefillWorker)
			if err != nil {
				if c.Request.Context().Err() != nil {
					freeAll()
					return
				}
				s.cool.fail(plan.PrefillWorker, time.Now())
				rec, rerr := dr.PrefillFailed(id, time.Now(), err)
				if rerr != nil {
					freeAll()
					openAIError(c, http.StatusInternalServerError, "internal_error", rerr.Error())
					return
				}
				s.recovered(p, rec)
			} else {
				if _, err := dr.PrefillDone(id, time.Now()); err != nil {
					s.log.Warn("disaggregated prefill done", "request", id, "err", err)
				}
				s.rep.PrefillDone(p.model, id+PrefillBookingSuffix)
				if body, err = withTransferParams(p.body, params); err != nil {
					freeAll()
					openAIError(c, http.StatusInternalServerError, "internal_error", err.Error())
					return
				}
				disagg = true
			}
		} else {
			s.rep.Booked(p.model, router.Booking{ID: id + DecodeBookingSuffix, Worker: plan.DecodeWorker, Hashes: p.req.Hashes,
				PrefillTokens: plan.Agg.PrefillTokens, Added: p.start})
		}
		s.metrics.routed.WithLabelValues(p.model, string(plan.DecodeWorker)).Inc()

		resp, worker, disagg, err := s.sendDecode(c, p, dr, plan.DecodeWorker, body, disagg)
		if err != nil {
			freeAll()
			if c.Request.Context().Err() != nil {
				return
			}
			s.cool.fail(worker, time.Now())
			s.metrics.retries.WithLabelValues(string(worker)).Inc()
			s.log.Warn("decode worker connection failed", "worker", worker, "attempt", attempt, "err", err)
			p.req.Exclude = append(p.req.Exclude, worker)
			if attempt >= s.cfg.Retries {
				openAIError(c, http.StatusBadGateway, "worker_unavailable", fmt.Sprintf("worker %s: %v", worker, err))
				return
			}
			continue
		}
		s.relay(c, p, worker, -1, resp, relayHooks{
			firstByte: func() {
				if disagg {
					// The decode worker answers only once the KV arrived.
					if err := dr.TransferDone(id, time.Now()); err != nil {
						s.log.Warn("disaggregated transfer done", "request", id, "err", err)
					}
					s.rep.Freed(p.model, id+PrefillBookingSuffix)
				} else {
					if _, err := dr.PrefillDone(id, time.Now()); err != nil {
						s.log.Debug("aggregated prefill done", "request", id, "err", err)
					}
					s.rep.PrefillDone(p.model, id+DecodeBookingSuffix)
				}
			},
			done: freeAll,
		})
		return
	}
}

// bookDisagg publishes both bookings of a disaggregated plan to the other
// replicas (the router booked them locally in Route).
func (s *Server) bookDisagg(p *prepared, plan router.DisaggPlan) {
	id := p.req.ID
	s.rep.Booked(p.model, router.Booking{ID: id + PrefillBookingSuffix, Worker: plan.PrefillWorker, Hashes: p.req.Hashes,
		PrefillTokens: plan.Disagg.PrefillTokens, Added: p.start})
	s.rep.Booked(p.model, router.Booking{ID: id + DecodeBookingSuffix, Worker: plan.DecodeWorker, Hashes: p.req.Hashes,
		PrefillDone: true, Added: p.start})
}

// recovered logs and counts a recovery and moves the replicated bookings:
// the request is now aggregated on rec.Worker.
func (s *Server) recovered(p *prepared, rec router.Recovery) {
	s.metrics.disaggRecoveries.WithLabelValues(p.model, rec.Action.String()).Inc()
	s.log.Warn("disaggregated request recovered", "request", p.req.ID, "action", rec.Action.String(), "reason", rec.Reason)
	if rec.Action == router.RecoverAggregate {
		s.rep.Freed(p.model, p.req.ID+PrefillBookingSuffix)
		s.rep.Booked(p.model, router.Booking{ID: p.req.ID + DecodeBookingSuffix, Worker: rec.Worker, Hashes: p.req.Hashes,
			PrefillTokens: p.req.Tokens, Added: p.start})
	}
}

// sendDecode sends the decode stage and handles a failed transfer: retried
// as the router says, then the whole request aggregated on the decode
// worker. It returns the response to relay, the worker that sent it, and
// whether the answer still follows a transfer (false once aggregated).
func (s *Server) sendDecode(c *gin.Context, p *prepared, dr *router.DisaggRouter, worker router.WorkerID, body []byte, disagg bool) (*http.Response, router.WorkerID, bool, error) {
	for {
		base, ok := s.rep.WorkerURL(worker)
		if !ok {
			return nil, worker, disagg, fmt.Errorf("worker %s has no address", worker)
		}
		resp, err := s.send(c, base+p.path, body)
		if err != nil {
			return nil, worker, disagg, err
		}
		if !disagg || !transferFailed(resp) {
			return resp, worker, disagg, nil
		}
		cause := fmt.Errorf("%w: %s", errTransfer, readError(resp))
		rec, rerr := dr.TransferFailed(p.req.ID, time.Now(), cause)
		if rerr != nil {
			return nil, worker, disagg, rerr
		}
		s.recovered(p, rec)
		if rec.Action == router.RecoverAggregate {
			body, worker, disagg = p.body, rec.Worker, false
		}
	}
}

// transferFailed reports a decode worker's kv_transfer_failed answer; the
// body is kept readable for readError.
func transferFailed(resp *http.Response) bool {
	if resp.StatusCode != http.StatusBadGateway {
		return false
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	resp.Body = io.NopCloser(bytes.NewReader(b))
	var e struct {
		Error struct {
			Type string `json:"type"`
		} `json:"error"`
	}
	return json.Unmarshal(b, &e) == nil && e.Error.Type == "kv_transfer_failed"
}

func readError(resp *http.Response) string {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	resp.Body.Close()
	return fmt.Sprintf("HTTP %d: %s", resp.StatusCode, bytes.TrimSpace(b))
}

// remotePrefill runs the prefill stage on worker: the client's body with
// stream off, one output token and kv_transfer_params asking for a remote
// decode. It returns the kv_transfer_params the worker answered, which the
// decode worker needs to pull the KV.
func (s *Server) remotePrefill(c *gin.Context, p *prepared, worker router.WorkerID) (json.RawMessage, error) {
	base, ok := s.rep.WorkerURL(worker)
	if !ok {
		return nil, fmt.Errorf("prefill worker %s has no address", worker)
	}
	body, err := prefillBody(p.body)
	if err != nil {
		return nil, err
	}
	resp, err := s.send(c, base+p.path, body)
	if err != nil {
		return nil, fmt.Errorf("prefill on %s: %w", worker, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return nil, fmt.Errorf("prefill on %s: reading the answer: %w", worker, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("prefill on %s: HTTP %d: %s", worker, resp.StatusCode, bytes.TrimSpace(b[:min(len(b), 512)]))
	}
	var out struct {
		Params json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, fmt.Errorf("prefill on %s: answer is not JSON: %w", worker, err)
	}
	if p := bytes.TrimSpace(out.Params); len(p) == 0 || p[0] != '{' {
		return nil, fmt.Errorf("prefill on %s: no kv_transfer_params in the answer (not a disaggregation-capable prefill engine)", worker)
	}
	return out.Params, nil
}

// prefillBody is the client's body for the prefill stage: not streamed, one
// token, and vLLM's request for a remote decode.
func prefillBody(body []byte) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, fmt.Errorf("prefill body: %w", err)
	}
	m["stream"] = json.RawMessage("false")
	delete(m, "stream_options")
	m["max_tokens"] = json.RawMessage("1")
	if _, ok := m["max_completion_tokens"]; ok {
		m["max_completion_tokens"] = json.RawMessage("1")
	}
	m["kv_transfer_params"] = json.RawMessage(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)
	return json.Marshal(m)
}

// withTransferParams is the client's body for the decode stage: unchanged
// but for the prefill's kv_transfer_params.
func withTransferParams(body []byte, params json.RawMessage) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, fmt.Errorf("decode body: %w", err)
	}
	m["kv_transfer_params"] = params
	return json.Marshal(m)
}

// planJSON is a plan as /debug/route shows it.
func planJSON(p router.DisaggPlan) gin.H {
	est := func(e router.TTFTEstimate) gin.H {
		return gin.H{"worker": e.Worker, "decode_worker": e.Decode, "prefill_tokens": e.PrefillTokens,
			"queue_s": e.QueueWait.Seconds(), "prefill_s": e.Prefill.Seconds(), "transfer_tokens": e.TransferTokens,
			"transfer_bytes": e.TransferBytes, "link": e.Link, "transfer_s": e.Transfer.Seconds(),
			"transfer_alone_s": e.TransferAlone.Seconds(), "first_decode_s": e.FirstDecode.Seconds(),
			"ttft_s": e.Total.Seconds(), "decode_seqs": e.DecodeSeqs, "stall_per_seq_s": e.StallPerSeq.Seconds()}
	}
	out := gin.H{"mode": p.Mode, "disaggregated": p.Disaggregated, "fallback": p.Fallback, "reason": p.Reason,
		"prefill_worker": p.PrefillWorker, "decode_worker": p.DecodeWorker, "aggregated": est(p.Agg),
		"estimated_ttft_s": p.Estimate.Seconds()}
	if p.DisaggOK {
		out["disaggregated_estimate"] = est(p.Disagg)
	}
	return out
}
