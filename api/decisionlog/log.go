// Package decisionlog records every routing decision a replica makes with
// the inputs it used and, once known, what came of it — the answer to "why
// did this request go to that worker?" that a counter cannot give. A
// decision carries the cost table the router computed (every candidate's
// cached blocks, load and cost), the Raft applied index of the index view
// it was made against (its epoch: two decisions with the same epoch saw
// the same replicated cache state) and how old the newest replica-sync
// data was; the outcome adds the engine's own account (status, time to
// first byte, prompt and cached tokens) or the error.
//
// The log is a fixed ring in memory (the newest N decisions, queried by
// GET /debug/decisions) and, optionally, a JSON-lines file rotated by size.
// Recording costs one ring slot and the cost table the router already
// built; the conversion to JSON happens only when someone reads it.
package decisionlog

import (
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/router"
)

// Candidate is one worker's row of a decision's cost table.
type Candidate struct {
	Worker              string  `json:"worker"`
	CachedBlocks        int     `json:"cached_blocks"`
	ActivePrefillTokens int     `json:"active_prefill_tokens"`
	ActiveBlocks        int     `json:"active_blocks"`
	ActiveRequests      int     `json:"active_requests"`
	Cost                float64 `json:"cost"`
	Busy                bool    `json:"busy,omitempty"`
	BusyReason          string  `json:"busy_reason,omitempty"`
}

// Decision is one routing decision. Attempt counts the tries of one
// request (a retry on another worker is a new decision with the same
// RequestID).
type Decision struct {
	Seq          uint64      `json:"seq"`
	Time         time.Time   `json:"time"`
	RequestID    string      `json:"request_id"`
	Model        string      `json:"model"`
	Mode         string      `json:"mode"`
	Attempt      int         `json:"attempt"`
	PromptTokens int         `json:"prompt_tokens"`
	PromptBlocks int         `json:"prompt_blocks"`
	Worker       string      `json:"worker,omitempty"`
	CachedBlocks int         `json:"cached_blocks"`
	RouteError   string      `json:"route_error,omitempty"`
	IndexEpoch   uint64      `json:"index_epoch"`
	SyncAgeMs    float64     `json:"sync_age_ms"` // -1: no replica-sync data (a single replica, or none heard yet)
	Candidates   []Candidate `json:"candidates"`
	// Disagg is a two-stage request's plan (nil: aggregated). Candidates
	// are then the prefill router's table when it disaggregated, the
	// aggregated one otherwise; Worker is the worker that decodes.
	Disagg  *Disagg  `json:"disagg,omitempty"`
	Outcome *Outcome `json:"outcome,omitempty"`

	rows    []router.WorkerCost // the router's table, converted when read
	outcome Outcome             // Outcome's value while in the ring (done: known)
	done    bool
}

// Disagg is the disaggregation planner's choice for one request: whether
// the prompt is computed on a prefill worker, which, why, and the TTFT it
// estimated each way.
type Disagg struct {
	Disaggregated bool    `json:"disaggregated"`
	Fallback      bool    `json:"fallback,omitempty"` // asked for, served aggregated
	Reason        string  `json:"reason,omitempty"`
	PrefillWorker string  `json:"prefill_worker,omitempty"`
	DecodeWorker  string  `json:"decode_worker"`
	AggTTFTMs     float64 `json:"aggregated_ttft_estimate_ms"`
	DisaggTTFTMs  float64 `json:"disaggregated_ttft_estimate_ms,omitempty"` // 0: not estimated (no prefill worker or link)
}

// Outcome is what came of a decision.
type Outcome struct {
	Status       int       `json:"status,omitempty"`
	TTFTMs       float64   `json:"ttft_ms,omitempty"`
	PromptTokens int       `json:"prompt_tokens,omitempty"` // as the engine reported them (usage)
	CachedTokens int       `json:"cached_tokens,omitempty"` // as the engine reported them (usage)
	Error        string    `json:"error,omitempty"`
	Finished     time.Time `json:"finished"`
}

// Entry is what a caller hands to Add.
type Entry struct {
	Time         time.Time
	RequestID    string
	Model        string
	Mode         string
	Attempt      int
	PromptTokens int
	PromptBlocks int
	Worker       string
	CachedBlocks int
	RouteError   string
	IndexEpoch   uint64
	SyncAge      time.Duration // negative: unknown
	Rows         []router.WorkerCost
	Disagg       *Disagg
}

// Log is the ring of recent decisions and the optional file sink. A nil
// *Log records nothing (the log is off).
type Log struct {
	mu   sync.Mutex // guards ring and next
	ring []Decision // by value: recording allocates nothing
	next uint64     // the next sequence number; the ring holds next-len(ring) .. next-1
	sink *Sink
}

// New returns a log of the newest size decisions (size ≤ 0: nil, off),
// writing completed decisions to sink when it is not nil.
func New(size int, sink *Sink) *Log {
	if size <= 0 {
		return nil
	}
	return &Log{ring: make([]Decision, size), next: 1, sink: sink}
}

// Add records a decision and returns its sequence number, for Complete.
// The rows slice is kept, not copied: the router builds a new one per
// decision.
func (l *Log) Add(e Entry) uint64 {
	if l == nil {
		return 0
	}
	age := -1.0
	if e.SyncAge >= 0 {
		age = float64(e.SyncAge) / float64(time.Millisecond)
	}
	l.mu.Lock()
	seq := l.next
	l.next++
	l.ring[seq%uint64(len(l.ring))] = Decision{Seq: seq, Time: e.Time, RequestID: e.RequestID, Model: e.Model, Mode: e.Mode,
		Attempt: e.Attempt, PromptTokens: e.PromptTokens, PromptBlocks: e.PromptBlocks, Worker: e.Worker,
		CachedBlocks: e.CachedBlocks, RouteError: e.RouteError, IndexEpoch: e.IndexEpoch, SyncAgeMs: age, Disagg: e.Disagg, rows: e.Rows}
	l.mu.Unlock()
	return seq
}

// Complete attaches the outcome to decision seq and writes the decision,
// now whole, to the sink. A decision pushed out of the ring before its
// request finished (more than the ring's size decided meanwhile) is not
// written: size the ring above the requests in flight.
func (l *Log) Complete(seq uint64, o Outcome) {
	if l == nil || seq == 0 {
		return
	}
	l.mu.Lock()
	d := &l.ring[seq%uint64(len(l.ring))]
	if d.Seq != seq {
		l.mu.Unlock()
		return // overwritten by newer decisions
	}
	d.outcome, d.done = o, true
	var out *Decision
	if l.sink != nil {
		e := d.export()
		out = &e
	}
	l.mu.Unlock()
	if out != nil {
		l.sink.Write(out)
	}
}

// export is d as it is read: candidates converted. l.mu must be held.
func (d *Decision) export() Decision {
	out := *d
	out.rows, out.outcome, out.done = nil, Outcome{}, false
	out.Candidates = make([]Candidate, 0, len(d.rows))
	for _, r := range d.rows {
		out.Candidates = append(out.Candidates, Candidate{Worker: string(r.Worker), CachedBlocks: r.Overlap,
			ActivePrefillTokens: r.ActivePrefillTokens, ActiveBlocks: r.ActiveBlocks, ActiveRequests: r.ActiveRequests,
			Cost: r.Cost, Busy: r.Busy, BusyReason: r.Reason()})
	}
	if d.done {
		o := d.outcome
		out.Outcome = &o
	}
	return out
}

// Filter selects decisions; zero fields match everything.
type Filter struct {
	RequestID string
	Worker    string // the chosen worker
	Model     string
	Since     time.Time
	Until     time.Time
	Limit     int // newest first; ≤ 0: all that match
}

func (f Filter) match(d *Decision) bool {
	switch {
	case f.RequestID != "" && d.RequestID != f.RequestID,
		f.Model != "" && d.Model != f.Model,
		f.Worker != "" && d.Worker != f.Worker,
		!f.Since.IsZero() && d.Time.Before(f.Since),
		!f.Until.IsZero() && d.Time.After(f.Until):
		return false
	}
	return true
}

// Query returns the decisions in the ring that match f, newest first.
func (l *Log) Query(f Filter) []Decision {
	if l == nil {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []Decision
	n := uint64(len(l.ring))
	for seq := l.next - 1; seq >= 1 && l.next-seq <= n; seq-- {
		d := &l.ring[seq%n]
		if d.Seq != seq || !f.match(d) {
			continue
		}
		out = append(out, d.export())
		if f.Limit > 0 && len(out) == f.Limit {
			break
		}
	}
	return out
}

// Size is the ring's capacity (0 when off).
func (l *Log) Size() int {
	if l == nil {
		return 0
	}
	return len(l.ring)
}
