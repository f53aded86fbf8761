package sim

import (
	"encoding/json"
	"fmt"
	"io"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
)

// RequestRecord is one request of one run as `kvbench sim --requests-out`
// writes it: the evidence behind a quantile (which requests set a p99,
// where they waited, which router sent them where), so an explanation of
// a figure can be checked with a command rather than a throwaway test.
// Times are virtual, in ms from the run's start.
type RequestRecord struct {
	Policy       string  `json:"policy"`
	Rep          int     `json:"rep"`
	Seed         uint64  `json:"seed"`
	ID           string  `json:"id"`
	Tenant       string  `json:"tenant,omitempty"`
	Session      int     `json:"session"` // -1: none
	PromptTokens int     `json:"prompt_tokens"`
	OutputTokens int     `json:"output_tokens"`
	CachedTokens int     `json:"cached_tokens"`
	Charged      int     `json:"charged_tokens,omitempty"` // to its tenant's ledger
	Router       int     `json:"router"`
	Worker       string  `json:"worker,omitempty"` // absent: never routed
	SentMs       float64 `json:"sent_ms"`
	RoutedMs     float64 `json:"routed_ms,omitzero"`
	FirstTokenMs float64 `json:"first_token_ms,omitzero"`
	FinishedMs   float64 `json:"finished_ms,omitzero"`
	// TTFTMs and QueueMs are set for a completed request only (the
	// summaries count a failed one at the timeout instead); a queue of 0
	// is a request routed on arrival.
	TTFTMs      *float64 `json:"ttft_ms,omitempty"`
	QueueMs     *float64 `json:"queue_ms,omitempty"`
	Done        bool     `json:"done"`
	Error       string   `json:"error,omitempty"`
	Preemptions int      `json:"preemptions,omitempty"`
	ResentMs    float64  `json:"resent_ms,omitzero"`
}

// Records are res's requests in workload order, labelled with the run
// (policy, rep, seed) they came from.
func Records(w *workload.Workload, res *Result, rep int, seed uint64) []RequestRecord {
	out := make([]RequestRecord, len(res.Requests))
	for i, rr := range res.Requests {
		r := w.Requests[i]
		rec := RequestRecord{
			Policy: res.Policy, Rep: rep, Seed: seed, ID: r.ID, Session: r.Session,
			PromptTokens: r.PromptTokens, OutputTokens: r.OutputTokens, CachedTokens: rr.CachedTokens,
			Charged: rr.Charged, Router: rr.Router, SentMs: ms(rr.Sent), Done: rr.Done, Error: rr.Err,
			Preemptions: rr.Preemptions, ResentMs: ms(rr.ResentAt),
		}
		if res.TenantOf != nil {
			rec.Tenant = res.Tenants[res.TenantOf[i]].Name
		}
		if rr.Worker >= 0 && rr.Worker < len(res.Workers) {
			rec.Worker = string(res.Workers[rr.Worker])
			rec.RoutedMs = ms(rr.Routed)
		}
		if rr.Done {
			rec.FirstTokenMs, rec.FinishedMs = ms(rr.FirstToken), ms(rr.Finished)
			ttft, queue := ms(rr.FirstToken-rr.Sent), ms(rr.Routed-rr.Sent)
			rec.TTFTMs, rec.QueueMs = &ttft, &queue
		}
		out[i] = rec
	}
	return out
}

// WriteRecords writes recs as JSON Lines, one request per line.
func WriteRecords(out io.Writer, recs []RequestRecord) error {
	enc := json.NewEncoder(out)
	for i := range recs {
		if err := enc.Encode(&recs[i]); err != nil {
			return fmt.Errorf("request %s: %w", recs[i].ID, err)
		}
	}
	return nil
}
