// Package registrar keeps a worker registered with the kvrouter replicas:
// POST /workers/register until one accepts, renewed every interval (the
// registration is a lease the replicas expire), POST /workers/deregister
// when the worker leaves. Any replica will do (each forwards to the Raft
// leader), so it tries them in turn, starting with the one that answered
// last.
//
// It is the one registration client of the workers' side: kvmock and the
// ZMQ bridge both use it. It imports the standard library only: Spec is
// api.WorkerSpec's JSON, restated, so the worker side does not depend on
// the HTTP API's package.
package registrar

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

// Spec is the body of POST /workers/register (api.WorkerSpec).
type Spec struct {
	ID               string `json:"id"`
	URL              string `json:"url"`
	Model            string `json:"model"`
	BlockSize        int    `json:"block_size"`
	TotalBlocks      int    `json:"total_kv_blocks"`
	MaxBatchedTokens int    `json:"max_num_batched_tokens"`
	// Role is prefill, decode or both; "" leaves it out (the router's
	// default, both). A router that predates roles ignores it.
	Role string `json:"role,omitempty"`
	// DPRanks is the engine's data-parallel ranks; 0 leaves it out (one).
	DPRanks int `json:"dp_ranks,omitempty"`
}

// Defaults of Config's zero values.
const (
	DefaultInterval   = 30 * time.Second
	DefaultTimeout    = 5 * time.Second // of the client made when Config.Client is nil
	DefaultBackoffMin = 200 * time.Millisecond
	DefaultBackoffMax = 5 * time.Second
)

// Config configures a Registrar.
type Config struct {
	URLs     []string      // replica base URLs, e.g. http://router-1:8001
	Token    string        // bearer token of the replicas' /workers endpoints; "" = none
	Spec     Spec          // what to register
	Interval time.Duration // lease renewal (default 30s)
	Client   *http.Client  // default: a client with a 5s timeout
	Logger   *slog.Logger  // default: slog.Default()
	// BackoffMin and BackoffMax bound the retry delay after a failure: it
	// doubles from BackoffMin to BackoffMax and is jittered down to half
	// (defaults 200ms and 5s).
	BackoffMin, BackoffMax time.Duration
	// LenientDeregister counts a definite refusal of the deregistration as
	// done: a 4xx other than 401, 403 and 429 (a replica answers "worker
	// not registered" with 400 or 404). Otherwise only a 200 is.
	LenientDeregister bool
}

// Stats are a Registrar's counters.
type Stats struct {
	Registered bool   // the last attempt succeeded
	Renewals   uint64 // successful registrations, the first included
	Failures   uint64 // failed attempts
	LastError  string // of the last attempt; "" after a success
}

// Registrar keeps one worker registered. Run it once; Deregister may be
// called after Run returns (or without Run).
type Registrar struct {
	cfg        Config
	log        *slog.Logger
	registered chan struct{} // closed at the first successful registration
	once       sync.Once
	preferred  atomic.Int64 // index into cfg.URLs of the replica that answered last

	mu      sync.Mutex
	spec    Spec   // mu must be held: SetTotalBlocks runs beside Run
	lastErr string // mu must be held

	renewals, failures atomic.Uint64
	ok                 atomic.Bool
}

// New returns a Registrar; Run starts it.
func New(cfg Config) *Registrar {
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultInterval
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{Timeout: DefaultTimeout}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.BackoffMin <= 0 {
		cfg.BackoffMin = DefaultBackoffMin
	}
	if cfg.BackoffMax < cfg.BackoffMin {
		cfg.BackoffMax = max(DefaultBackoffMax, cfg.BackoffMin)
	}
	cfg.URLs = append([]string(nil), cfg.URLs...)
	return &Registrar{cfg: cfg, spec: cfg.Spec, log: cfg.Logger.With("component", "registrar"),
		registered: make(chan struct{})}
}

// Registered is closed at the first successful registration.
func (r *Registrar) Registered() <-chan struct{} { return r.registered }

// URLs are the replicas it registers with.
func (r *Registrar) URLs() []string { return append([]string(nil), r.cfg.URLs...) }

// Spec is what the next attempt registers.
func (r *Registrar) Spec() Spec {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.spec
}

// SetTotalBlocks changes the capacity the next attempt registers (learnt
// from the engine after the start).
func (r *Registrar) SetTotalBlocks(n int) {
	r.mu.Lock()
	r.spec.TotalBlocks = n
	r.mu.Unlock()
}

// Stats returns the counters.
func (r *Registrar) Stats() Stats {
	r.mu.Lock()
	lastErr := r.lastErr
	r.mu.Unlock()
	return Stats{Registered: r.ok.Load(), Renewals: r.renewals.Load(), Failures: r.failures.Load(), LastError: lastErr}
}

// Run registers, retrying with backoff until it succeeds, then renews the
// registration every interval, until ctx ends. before, when not nil, runs
// ahead of each attempt (it may call SetTotalBlocks).
//
// A restarted worker needs no special step: its first KV event (a cleared
// one, with an id past the previous run's) shows the cluster a gap, and
// the leader resyncs it.
func (r *Registrar) Run(ctx context.Context, before func()) {
	failing := 0 // consecutive failures
	for {
		if before != nil {
			before()
		}
		spec := r.Spec()
		err := r.post(ctx, "/workers/register", spec, false)
		wait := r.cfg.Interval
		if err != nil {
			r.ok.Store(false)
			r.failures.Add(1)
			r.setLastErr(err.Error())
			if ctx.Err() != nil {
				return
			}
			failing++
			level := slog.LevelWarn
			if failing >= 5 { // not a blip: a wrong URL, token or block size
				level = slog.LevelError
			}
			backoff := retryDelay(failing, r.cfg.BackoffMin, r.cfg.BackoffMax)
			r.log.Log(ctx, level, "registration failed; retrying", "err", err, "failures", failing, "in", backoff)
			wait = jitter(backoff)
		} else {
			failing = 0
			r.setLastErr("")
			if !r.ok.Swap(true) {
				attrs := []any{"worker", spec.ID, "url", spec.URL, "model", spec.Model,
					"block_size", spec.BlockSize, "total_kv_blocks", spec.TotalBlocks}
				if spec.Role != "" {
					attrs = append(attrs, "role", spec.Role)
				}
				if spec.DPRanks != 0 {
					attrs = append(attrs, "dp_ranks", spec.DPRanks)
				}
				r.log.Info("registered", attrs...)
			}
			r.renewals.Add(1)
			r.once.Do(func() { close(r.registered) })
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// Deregister tells the replicas the worker is leaving.
func (r *Registrar) Deregister(ctx context.Context) error {
	return r.post(ctx, "/workers/deregister", map[string]string{"id": r.Spec().ID}, r.cfg.LenientDeregister)
}

func (r *Registrar) setLastErr(s string) {
	r.mu.Lock()
	r.lastErr = s
	r.mu.Unlock()
}

// retryDelay is the nominal wait after the n-th consecutive failure (n ≥ 1):
// lo doubled n-1 times, at most hi.
func retryDelay(n int, lo, hi time.Duration) time.Duration {
	d := lo
	for i := 1; i < n && d < hi; i++ {
		d *= 2
	}
	return min(d, hi)
}

// jitter is a random wait in [d/2, d]: workers that failed together (a
// replica restart) do not retry together.
func jitter(d time.Duration) time.Duration { return d/2 + rand.N(d/2+1) }

// post sends body to path on each replica in turn until one answers 200.
// With lenient, a definite refusal counts as done too: a 4xx other than
// 401, 403 and 429.
func (r *Registrar) post(ctx context.Context, path string, body any, lenient bool) error {
	data, err := json.Marshal(body)
	if err != nil {
		return err
	}
	urls := r.cfg.URLs
	var errs []error
	first := int(r.preferred.Load())
	for i := range urls {
		idx := (first + i) % len(urls)
		base := urls[idx]
		status, msg, err := r.send(ctx, base+path, data)
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("%s: %w", base, err))
		case status == http.StatusOK || (lenient && refused(status)):
			r.preferred.Store(int64(idx))
			return nil
		default:
			errs = append(errs, fmt.Errorf("%s: HTTP %d: %s", base, status, msg))
		}
		if ctx.Err() != nil {
			break
		}
	}
	if len(urls) == 0 {
		errs = append(errs, errors.New("no replica URLs"))
	}
	return fmt.Errorf("POST %s: %w", path, errors.Join(errs...))
}

// refused: the replica answered for certain; asking another one would not
// change its answer (unlike an auth failure or a rate limit).
func refused(status int) bool {
	return status >= 400 && status < 500 &&
		status != http.StatusUnauthorized && status != http.StatusForbidden && status != http.StatusTooManyRequests
}

func (r *Registrar) send(ctx context.Context, url string, data []byte) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(data))
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("Content-Type", "application/json")
	if r.cfg.Token != "" {
		req.Header.Set("Authorization", "Bearer "+r.cfg.Token)
	}
	resp, err := r.cfg.Client.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	return resp.StatusCode, strings.TrimSpace(string(msg)), nil
}
