package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// workerSpec is the body of POST /workers/register (api.WorkerSpec).
type workerSpec struct {
	ID               string `json:"id"`
	URL              string `json:"url"`
	Model            string `json:"model"`
	BlockSize        int    `json:"block_size"`
	TotalBlocks      int    `json:"total_kv_blocks"`
	MaxBatchedTokens int    `json:"max_num_batched_tokens"`
	// Role is prefill, decode or both (api.WorkerSpec.Role); always sent,
	// a router that predates roles ignores it.
	Role string `json:"role,omitempty"`
}

// registrar keeps the worker registered with the kvrouter replicas: any
// replica will do (each forwards to the Raft leader), so it tries them in
// turn, starting with the one that answered last.
type registrar struct {
	urls       []string
	spec       workerSpec
	token      string // bearer token; "" = none
	client     *http.Client
	interval   time.Duration // lease renewal
	backoffMin time.Duration
	backoffMax time.Duration
	log        *slog.Logger

	registered chan struct{} // closed at the first successful registration
	once       sync.Once
	preferred  atomic.Int64 // index into urls of the replica that answered last

	renewals, failures atomic.Uint64
	ok                 atomic.Bool // the last attempt succeeded
}

func newRegistrar(urls []string, spec workerSpec, interval time.Duration, log *slog.Logger) *registrar {
	return &registrar{
		urls:       urls,
		spec:       spec,
		client:     &http.Client{Timeout: 5 * time.Second},
		interval:   interval,
		backoffMin: 200 * time.Millisecond,
		backoffMax: 5 * time.Second,
		log:        log.With("component", "registrar"),
		registered: make(chan struct{}),
	}
}

// run registers, retrying with backoff until it succeeds, then renews the
// registration every interval, until ctx ends.
//
// A restarted worker needs no special step: its first KV event (a cleared
// one, with an id past the previous run's) shows the cluster a gap, and
// the leader resyncs it.
func (r *registrar) run(ctx context.Context) {
	backoff := r.backoffMin
	failing := 0 // consecutive failures
	for {
		err := r.post(ctx, "/workers/register", r.spec, false)
		wait := r.interval
		if err != nil {
			r.ok.Store(false)
			r.failures.Add(1)
			if ctx.Err() != nil {
				return
			}
			failing++
			level := slog.LevelWarn
			if failing >= 5 { // not a blip: a wrong URL, token or block size
				level = slog.LevelError
			}
			r.log.Log(ctx, level, "registration failed; retrying", "err", err, "failures", failing, "in", backoff)
			wait = backoff/2 + rand.N(backoff/2+1)
			backoff = min(2*backoff, r.backoffMax)
		} else {
			backoff, failing = r.backoffMin, 0
			if !r.ok.Swap(true) {
				r.log.Info("registered", "worker", r.spec.ID, "url", r.spec.URL, "model", r.spec.Model,
					"block_size", r.spec.BlockSize, "total_kv_blocks", r.spec.TotalBlocks, "role", r.spec.Role)
			}
			r.renewals.Add(1)
			r.once.Do(func() { close(r.registered) })
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
	}
}

// deregister tells the replicas the worker is leaving.
func (r *registrar) deregister(ctx context.Context) error {
	return r.post(ctx, "/workers/deregister", map[string]string{"id": r.spec.ID}, true)
}

// post sends body to path on each replica in turn until one answers 200.
// With lenient, a definite refusal counts as done too: a 4xx other than
// 401, 403 and 429 (a replica says "worker not registered" with 400 or 404).
func (r *registrar) post(ctx context.Context, path string, body any, lenient bool) error {
	data, err := json.Marshal(body)
	if err != nil {
		return err
	}
	var errs []error
	first := int(r.preferred.Load())
	for i := range r.urls {
		idx := (first + i) % len(r.urls)
		base := r.urls[idx]
		status, msg, err := r.send(ctx, base+path, data)
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("%s: %w", base, err))
		case status == http.StatusOK || (lenient && status >= 400 && status < 500 &&
			status != http.StatusUnauthorized && status != http.StatusForbidden && status != http.StatusTooManyRequests):
			r.preferred.Store(int64(idx))
			return nil
		default:
			errs = append(errs, fmt.Errorf("%s: HTTP %d: %s", base, status, msg))
		}
		if ctx.Err() != nil {
			break
		}
	}
	return fmt.Errorf("POST %s: %w", path, errors.Join(errs...))
}

func (r *registrar) send(ctx context.Context, url string, data []byte) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(data))
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("Content-Type", "application/json")
	if r.token != "" {
		req.Header.Set("Authorization", "Bearer "+r.token)
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	return resp.StatusCode, strings.TrimSpace(string(msg)), nil
}
