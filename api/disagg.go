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

	"github.com/kvrouter/kvrouter/api/decisionlog"
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
// and kvrouter_disagg_recoveries_total). A failed decode worker is retried
// by the proxy loop's rule (proxy.go), like an aggregated one.
func (s *Server) forwardDisagg(c *gin.Context, p *prepared, dr *router.DisaggRouter) {
	// A session's final turn ends its binding after the answer; a turn
	// follows, makes or moves a two-stage binding in planDisagg
	// (sessionstages.go; api/DESIGN.md, Sessions).
	defer s.endSession(p)
	p.req.Exclude = append(p.req.Exclude, s.cool.excludeDisagg(dr.Workers(), time.Now())...)
	s.proxyLoop(c, p, func() error { return s.attemptDisagg(c, p, dr) })
}

// attemptDisagg is one try of a two-stage request: plan, prefill stage,
// decode stage, relay. It leaves nothing booked when it fails.
func (s *Server) attemptDisagg(c *gin.Context, p *prepared, dr *router.DisaggRouter) error {
	now := time.Now()
	dd, err := s.planDisagg(c.Request.Context(), p, dr, now)
	p.settled() // both stages booked by Route, or never to be
	p.attempts++
	s.recordDisaggDecision(p, dd, err, now)
	if err != nil {
		s.completeDecision(p, decisionlog.Outcome{Error: "routing: " + err.Error()})
		return fmt.Errorf("routing: %w", err)
	}
	plan := dd.DisaggPlan
	s.metrics.observePlan(p.model, plan)
	body, disagg, err := s.prefillStage(c, p, dr, plan)
	if err != nil {
		s.freeDisagg(p, dr)
		s.completeDecision(p, decisionlog.Outcome{Error: s.redact(err.Error())})
		return err
	}
	s.metrics.routed.WithLabelValues(p.model, string(plan.DecodeWorker)).Inc()
	resp, worker, disagg, err := s.sendDecode(c, p, dr, plan.DecodeWorker, body, disagg)
	if err != nil {
		s.freeDisagg(p, dr)
		s.completeDecision(p, decisionlog.Outcome{Error: s.redact(err.Error())})
		return err
	}
	p.worker = string(worker) // a fallback may have moved the decode
	return s.relay(c, p, worker, -1, resp, relayHooks{
		firstByte: func() {
			p.firstByteAt = time.Now()
			s.decodeStarted(p, dr, disagg)
		},
		// The tenant pays for the output as it streams (or as the usage
		// reports it at the end), as an aggregated request does.
		tokens: func(k int) {
			p.generated += k
			s.chargeOutput(p, p.generated)
		},
		done: func() {
			if p.outputTokensKnown {
				s.chargeOutput(p, p.outputTokens)
			}
			s.freeDisagg(p, dr)
			s.completeDecision(p, decisionlog.Outcome{Status: resp.StatusCode, PromptTokens: p.usagePrompt, CachedTokens: p.usageCached})
		},
	})
}

// prefillStage books the plan and, when it is disaggregated, runs the
// remote prefill. It returns the body for the decode worker and whether
// that worker is to pull the KV; a failed prefill is recovered here
// (served aggregated), so its error is only a client gone or an internal
// failure.
func (s *Server) prefillStage(c *gin.Context, p *prepared, dr *router.DisaggRouter, plan router.DisaggPlan) ([]byte, bool, error) {
	id := p.req.ID
	if !plan.Disaggregated {
		// The tenant pays for the prompt tokens the worker must compute,
		// each attempt (as an aggregated request, proxy.go).
		s.chargeTenant(p, plan.Agg.PrefillTokens, "prompt")
		s.rep.Booked(p.model, router.Booking{ID: id + DecodeBookingSuffix, Worker: plan.DecodeWorker, Hashes: s.activeHashes(p),
			PrefillTokens: plan.Agg.PrefillTokens, Sequences: p.req.Sequences, Added: p.start})
		return p.body, false, nil
	}
	// The prefill worker computes the prompt beyond its cached prefix; the
	// decode worker receives the rest (its one recomputed token is not
	// charged).
	s.chargeTenant(p, plan.Disagg.PrefillTokens, "prompt")
	s.bookDisagg(p, plan)
	params, err := s.remotePrefill(c, p, plan.PrefillWorker)
	if err != nil {
		return s.prefillFailed(c, p, dr, plan.PrefillWorker, err)
	}
	if _, err := dr.PrefillDone(id, time.Now()); err != nil {
		s.log.Warn("disaggregated prefill done", "request", id, "err", err)
	}
	s.rep.PrefillDone(p.model, id+PrefillBookingSuffix)
	body, err := withTransferParams(p.body, params)
	if err != nil {
		return nil, false, err
	}
	return body, true, nil
}

// prefillFailed recovers from a failed prefill: the worker cools down (so
// the next requests fall back at once) and the request is served
// aggregated on the decode worker. Running the prompt again there is not a
// repeated generation: the prefill stage's one token is never shown to
// the client.
func (s *Server) prefillFailed(c *gin.Context, p *prepared, dr *router.DisaggRouter, worker router.WorkerID, err error) ([]byte, bool, error) {
	if c.Request.Context().Err() != nil && !errors.Is(err, errClientGone) {
		err = fmt.Errorf("%w (prefill on %s): %w", errClientGone, worker, err)
	}
	if errors.Is(err, errClientGone) {
		return nil, false, err
	}
	s.cool.fail(worker, time.Now())
	rec, rerr := dr.PrefillFailed(p.req.ID, time.Now(), err)
	if rerr != nil {
		return nil, false, fmt.Errorf("recovering from a failed prefill: %w", rerr)
	}
	s.recovered(p, rec)
	return p.body, false, nil
}

// decodeStarted is the bookkeeping at the decode worker's first byte:
// after a transfer the KV has arrived (the prefill booking ends), without
// one the decode worker's own prefill is done.
func (s *Server) decodeStarted(p *prepared, dr *router.DisaggRouter, disagg bool) {
	id := p.req.ID
	if disagg {
		if err := dr.TransferDone(id, time.Now()); err != nil {
			s.log.Warn("disaggregated transfer done", "request", id, "err", err)
		}
		s.rep.Freed(p.model, id+PrefillBookingSuffix)
		return
	}
	if _, err := dr.PrefillDone(id, time.Now()); err != nil {
		s.log.Debug("aggregated prefill done", "request", id, "err", err)
	}
	s.rep.PrefillDone(p.model, id+DecodeBookingSuffix)
}

// freeDisagg ends both bookings of a two-stage request, here and on the
// other replicas, and wakes its model's queue.
func (s *Server) freeDisagg(p *prepared, dr *router.DisaggRouter) {
	id := p.req.ID
	dr.Free(id)
	s.rep.Freed(p.model, id+PrefillBookingSuffix)
	s.rep.Freed(p.model, id+DecodeBookingSuffix)
	s.gates.wake(p.model)
}

// bookDisagg publishes both bookings of a disaggregated plan to the other
// replicas (the router booked them locally in Route).
func (s *Server) bookDisagg(p *prepared, plan router.DisaggPlan) {
	id := p.req.ID
	s.rep.Booked(p.model, router.Booking{ID: id + PrefillBookingSuffix, Worker: plan.PrefillWorker, Hashes: s.activeHashes(p),
		PrefillTokens: plan.Disagg.PrefillTokens, Added: p.start})
	s.rep.Booked(p.model, router.Booking{ID: id + DecodeBookingSuffix, Worker: plan.DecodeWorker, Hashes: s.activeHashes(p),
		PrefillDone: true, Sequences: p.req.Sequences, Added: p.start})
}

// activeHashes are the hashes the disaggregated router booked p's active
// blocks under (router.Config.ActiveHashes), announced alike to peers.
func (s *Server) activeHashes(p *prepared) []uint64 { return p.rt.Config().ActiveHashes(p.req) }

// recovered logs and counts a recovery and moves the replicated bookings:
// the request is now aggregated on rec.Worker.
func (s *Server) recovered(p *prepared, rec router.Recovery) {
	s.metrics.disaggRecoveries.WithLabelValues(p.model, rec.Action.String()).Inc()
	s.log.Warn("disaggregated request recovered", "request", p.req.ID, "action", rec.Action.String(), "reason", rec.Reason)
	if rec.Action == router.RecoverAggregate {
		// The decode worker computes the prompt again, and is charged as
		// booked (a retried attempt is charged again: it computes again).
		s.chargeTenant(p, p.req.Tokens, "prompt")
		s.rep.Freed(p.model, p.req.ID+PrefillBookingSuffix)
		s.rep.Booked(p.model, router.Booking{ID: p.req.ID + DecodeBookingSuffix, Worker: rec.Worker, Hashes: s.activeHashes(p),
			PrefillTokens: p.req.Tokens, Sequences: p.req.Sequences, Added: p.start})
	}
}

// sendDecode sends the decode stage and handles a failed transfer: retried
// as the router says, then the whole request aggregated on the decode
// worker. It returns the response to relay, the worker that sent it, and
// whether the answer still follows a transfer (false once aggregated).
func (s *Server) sendDecode(c *gin.Context, p *prepared, dr *router.DisaggRouter, worker router.WorkerID, body []byte, disagg bool) (*http.Response, router.WorkerID, bool, error) {
	for {
		resp, err := s.send(c, worker, p.path, s.withEnginePriority(p, body))
		if err != nil {
			return nil, worker, disagg, err
		}
		if !disagg || !transferFailed(resp) {
			return resp, worker, disagg, nil
		}
		cause := fmt.Errorf("%w: %s", errTransfer, readError(resp))
		rec, rerr := dr.TransferFailed(p.req.ID, time.Now(), cause)
		if rerr != nil {
			return nil, worker, disagg, fmt.Errorf("recovering from a failed transfer: %w", rerr)
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
	body, err := prefillBody(p.body)
	if err != nil {
		return nil, err
	}
	resp, err := s.send(c, worker, p.path, s.withEnginePriority(p, body))
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
