package api

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvrouter/kvrouter/router"
)

// Replica is what the HTTP layer needs from the replica it serves. The
// composition in cmd/kvrouter/internal/replica implements it over the Raft
// node, the FSM and the event bus; tests use a fake. Writes go through Raft,
// so any replica can take them.
//
// Two more abilities are optional: the server finds them by type assertion
// on the Replica it was given, so a fake need not implement them, and a
// replica without them behaves as described.
//   - DisaggReplica (disagg.go): per-model two-stage prefill/decode routers.
//     Without it every model routes aggregated through Router; the load
//     metrics read Router alone and no disaggregation series is reported
//     (metrics.go).
//   - Drainer (server.go): SIGTERM received. Without it /ready?draining=404
//     never answers 404; a replica that is not ready answers 503 as usual.
//
// The replica in cmd/kvrouter implements both (asserted at compile time
// there).
type Replica interface {
	NodeID() string
	// Models lists the served models, sorted.
	Models() []string
	// Router returns the router of a model.
	Router(model string) (*router.Router, bool)
	// WorkerURL is the OpenAI base URL of a worker (http://host:port).
	WorkerURL(id router.WorkerID) (string, bool)
	// DPRank is the data-parallel rank id stands for, ok only when its
	// engine runs several ranks behind one URL: the proxy then sends it as
	// X-data-parallel-rank (vLLM and SGLang honour it), so the engine's own
	// balancer does not move the request off the rank the router booked.
	DPRank(id router.WorkerID) (rank int, ok bool)
	// Adapter resolves a LoRA adapter name (a request's "model") to the
	// base model whose workers serve it and those workers' ranks; ok is
	// false when no worker serves such an adapter.
	Adapter(name string) (base string, workers []router.WorkerID, ok bool)

	// ReadBarrier returns once this replica reflects every write committed
	// before the call, so the admin reads after it are linearizable.
	ReadBarrier(ctx context.Context) error
	// Thresholds are the busy thresholds of a model as replicated.
	Thresholds(model string) (router.Thresholds, bool)
	// SetThresholds proposes a threshold change and waits for its commit.
	SetThresholds(ctx context.Context, model string, upd ThresholdUpdate) (router.Thresholds, error)

	RegisterWorker(ctx context.Context, w WorkerSpec) error
	DeregisterWorker(ctx context.Context, id string) error

	// Ready says whether this replica can route: knows a leader, caught up,
	// has workers. The string is the reason when it cannot.
	Ready() (bool, string)
	// Status is the /cluster/status document; without the digest (costly:
	// a pass over the whole index) when digest is false.
	Status(digest bool) map[string]any

	// Audit receives, per answered request, the cached tokens the router
	// predicted from its index and those the worker reported, so drift
	// between index and engine (tokenizer, template or block size mismatch,
	// missing events) is visible.
	Audit(worker router.WorkerID, predicted, reported, prompt int)

	// Load notifications, published to the other replicas (replica sync).
	Booked(model string, b router.Booking)
	PrefillDone(model, id string)
	Freed(model, id string)
}

// ThresholdUpdate is a partial change of busy thresholds: a nil Set* leaves
// the value alone, Clear* turns a threshold off (JSON null).
type ThresholdUpdate struct {
	ActiveDecodeBlocks           *float64
	ClearActiveDecodeBlocks      bool
	ActivePrefillTokens          *int64
	ClearActivePrefillTokens     bool
	ActivePrefillTokensFrac      *float64
	ClearActivePrefillTokensFrac bool
}

// Empty reports whether the update changes nothing (a read).
func (u ThresholdUpdate) Empty() bool {
	return u.ActiveDecodeBlocks == nil && u.ActivePrefillTokens == nil && u.ActivePrefillTokensFrac == nil &&
		!u.ClearActiveDecodeBlocks && !u.ClearActivePrefillTokens && !u.ClearActivePrefillTokensFrac
}

// Apply returns t changed by u.
func (u ThresholdUpdate) Apply(t router.Thresholds) router.Thresholds {
	if u.ClearActiveDecodeBlocks {
		t.ActiveDecodeBlocks = nil
	}
	if u.ActiveDecodeBlocks != nil {
		t.ActiveDecodeBlocks = u.ActiveDecodeBlocks
	}
	if u.ClearActivePrefillTokens {
		t.ActivePrefillTokens = nil
	}
	if u.ActivePrefillTokens != nil {
		t.ActivePrefillTokens = u.ActivePrefillTokens
	}
	if u.ClearActivePrefillTokensFrac {
		t.ActivePrefillTokensFrac = nil
	}
	if u.ActivePrefillTokensFrac != nil {
		t.ActivePrefillTokensFrac = u.ActivePrefillTokensFrac
	}
	return t
}

// WorkerSpec registers a worker.
type WorkerSpec struct {
	ID               string `json:"id"`
	URL              string `json:"url"`
	Model            string `json:"model"`
	BlockSize        int    `json:"block_size"`
	TotalBlocks      int    `json:"total_kv_blocks"`
	MaxBatchedTokens int    `json:"max_num_batched_tokens"`
	DPRanks          int    `json:"dp_ranks,omitempty"`
	// Role in disaggregated serving: prefill, decode or both ("" = both).
	Role string `json:"role,omitempty"`
}

// Validate rejects a spec the router could not use.
func (w WorkerSpec) Validate() error {
	switch {
	case w.ID == "":
		return errors.New("worker id is required")
	case w.URL == "":
		return errors.New("worker url is required")
	case w.Model == "":
		return errors.New("worker model is required")
	case w.BlockSize <= 0:
		return errors.New("block_size must be positive")
	case w.TotalBlocks < 0 || w.MaxBatchedTokens < 0 || w.DPRanks < 0:
		return errors.New("sizes must not be negative")
	}
	switch w.Role {
	case "", string(router.RolePrefill), string(router.RoleDecode), string(router.RoleBoth):
	default:
		return fmt.Errorf("role %q must be prefill, decode or both", w.Role)
	}
	return nil
}

// Errors the Replica returns that map to HTTP statuses.
var (
	ErrUnknownModel = errors.New("unknown model")
	ErrInvalid      = errors.New("invalid request")
	ErrUnavailable  = errors.New("cluster unavailable")
)
