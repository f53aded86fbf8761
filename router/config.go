package router

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// Mode is a routing policy.
type Mode string

// Routing modes; names are shared with kvbench policies and --router-mode.
const (
	ModeRoundRobin  Mode = "round-robin"
	ModeRandom      Mode = "random"
	ModeLeastLoaded Mode = "least-loaded"
	ModeKV          Mode = "kv"
	ModeKVApprox    Mode = "kv-approx"
	ModeLoadAware   Mode = "load-aware"
	// ModePowerOfTwo is Dynamo's power-of-two-choices: the fewer requests
	// in flight of two workers drawn at random.
	ModePowerOfTwo Mode = "power-of-two"
	// ModeKVPooled is kv plus placement that makes the workers' caches act
	// as one pooled cache (pooled.go, DESIGN.md).
	ModeKVPooled Mode = "kv-pooled"
)

// Modes lists every mode this package implements.
var Modes = []Mode{ModeRoundRobin, ModeRandom, ModeLeastLoaded, ModePowerOfTwo, ModeKV, ModeKVApprox, ModeLoadAware, ModeKVPooled}

// ParseMode accepts our names and Dynamo's spellings (round_robin, kv without events…).
func ParseMode(s string) (Mode, error) {
	switch s {
	case "round-robin", "round_robin", "roundrobin", "":
		return ModeRoundRobin, nil
	case "random":
		return ModeRandom, nil
	case "least-loaded", "least_loaded":
		return ModeLeastLoaded, nil
	case "power-of-two", "power_of_two", "power-of-two-choices":
		return ModePowerOfTwo, nil
	case "kv":
		return ModeKV, nil
	case "kv-approx", "kv_approx", "approx":
		return ModeKVApprox, nil
	case "load-aware", "load_aware":
		return ModeLoadAware, nil
	case "kv-pooled", "kv_pooled", "pooled":
		return ModeKVPooled, nil
	}
	return "", fmt.Errorf("unknown router mode %q (want one of %v): %w", s, Modes, ErrInvalidConfig)
}

// QueuePolicy orders requests waiting for a worker below the queue threshold.
type QueuePolicy string

// Queue policies, Dynamo's names.
const (
	QueueFCFS QueuePolicy = "fcfs" // arrival order: best tail TTFT
	QueueWSPT QueuePolicy = "wspt" // weighted shortest processing time: best mean TTFT
	QueueLCFS QueuePolicy = "lcfs" // newest first, for comparison only
)

// Thresholds mark a worker busy; any one exceeded is enough. Nil = off.
type Thresholds struct {
	// ActiveDecodeBlocks is a fraction in [0,1] of the worker's total KV blocks.
	ActiveDecodeBlocks *float64
	// ActivePrefillTokens is an absolute token count.
	ActivePrefillTokens *int64
	// ActivePrefillTokensFrac is a fraction of the worker's max batched tokens (may exceed 1).
	ActivePrefillTokensFrac *float64
}

// Validate rejects thresholds Dynamo would reject, and NaN/Inf.
func (t Thresholds) Validate() error {
	if v := t.ActiveDecodeBlocks; v != nil && (!finite(*v) || *v < 0 || *v > 1) {
		return fmt.Errorf("active_decode_blocks_threshold %v outside [0,1]: %w", *v, ErrInvalidConfig)
	}
	if v := t.ActivePrefillTokens; v != nil && *v < 0 {
		return fmt.Errorf("active_prefill_tokens_threshold %d is negative: %w", *v, ErrInvalidConfig)
	}
	if v := t.ActivePrefillTokensFrac; v != nil && (!finite(*v) || *v < 0) {
		return fmt.Errorf("active_prefill_tokens_threshold_frac %v must be a finite non-negative number: %w", *v, ErrInvalidConfig)
	}
	return nil
}

// Config holds every routing knob, with Dynamo's names in comments.
type Config struct {
	Mode      Mode
	BlockSize int // DYN_KV_CACHE_BLOCK_SIZE: must equal the engines'

	OverlapCredit      float64 // --router-kv-overlap-score-credit, [0,1], default 1
	PrefillLoadScale   float64 // --router-prefill-load-scale (legacy overlap_score_weight), default 1
	TrackPrefillTokens bool    // --no-router-track-prefill-tokens turns this off
	Temperature        float64 // --router-temperature, 0 = argmin
	// TrackOutputBlocks (--router-track-output-blocks, default off) grows
	// a worker's active blocks as its requests generate: one placeholder
	// block per block of output (Router.Generated), decayed toward the
	// request's expected output (Request.ExpectedOutputTokens) as Dynamo
	// does (load.go, OutputProgress).
	TrackOutputBlocks bool
	// OverlapCreditDecay (--router-kv-overlap-score-credit-decay, ≥ 0,
	// default 0 = off) shrinks the overlap credit of a worker whose active
	// prefill exceeds the least loaded eligible worker's (cost.go).
	OverlapCreditDecay float64
	// DecodeActiveRequestWeight (--router-decode-active-request-weight,
	// ≥ 0, default 0) adds this many blocks of cost per request (sequence)
	// a worker is decoding.
	DecodeActiveRequestWeight float64
	// DistinctActiveBlocks (--no-router-assume-kv-reuse) books every
	// request's blocks as its own: requests sharing a prefix on a worker do
	// not share active blocks. Off (false) is Dynamo's default.
	DistinctActiveBlocks bool
	// HostCacheHitWeight (--router-host-cache-hit-weight, default 0.75)
	// and DiskCacheHitWeight (--router-disk-cache-hit-weight, default
	// 0.25) credit blocks a worker holds in its host-memory or disk
	// (and external) offload tiers past its device prefix, per block,
	// as Dynamo does (tiers.go, cost.go). 0 turns a tier's credit off;
	// both 0 is routing on the device tier alone.
	HostCacheHitWeight float64
	DiskCacheHitWeight float64

	Thresholds Thresholds

	QueueThreshold *float64    // --router-queue-threshold: fraction of max batched tokens; nil = no queue
	QueuePolicy    QueuePolicy // --router-queue-policy

	ApproxTTL     time.Duration // --router-ttl-secs: lifetime of predicted blocks in kv-approx mode
	RequestExpiry time.Duration // in-flight requests older than this are dropped from the load view

	Pooled PooledConfig // kv-pooled's constants (pooled.go); the zero value is the defaults
	// SLO is the latency objective kv-pooled places requests against
	// (slo.go); the zero value sets none and kv-pooled decides as without
	// it. Other modes do not read it.
	SLO SLO
	// LearnLatency makes the router learn the SLO rule's rates (prefill
	// and decode rates, the TPOT line against the fill) from its own
	// bookings in every mode, not only kv-pooled with an SLO: the tenant
	// latency guard (guard.go, Router.LatencyGuard) predicts from them.
	LearnLatency bool
}

// DefaultConfig is Dynamo's defaults in kv mode with block size 16.
func DefaultConfig() Config {
	return Config{
		Mode:               ModeKV,
		BlockSize:          16,
		OverlapCredit:      1,
		PrefillLoadScale:   1,
		TrackPrefillTokens: true,
		HostCacheHitWeight: 0.75,
		DiskCacheHitWeight: 0.25,
		QueuePolicy:        QueueFCFS,
		ApproxTTL:          120 * time.Second,
		RequestExpiry:      300 * time.Second,
	}
}

// DecodeConfig is Dynamo's parameter set for choosing a decode worker in
// disaggregated serving: the KV arrives by transfer, so overlap earns no
// credit and prompt tokens are not prefill load on that worker.
func DecodeConfig(base Config) Config {
	base.OverlapCredit = 0
	base.TrackPrefillTokens = false
	return base
}

// ErrInvalidConfig marks a knob outside its domain.
var ErrInvalidConfig = errors.New("invalid router configuration")

// Validate checks every knob; NaN, ±Inf and negative values are errors.
func (c Config) Validate() error {
	if _, err := ParseMode(string(c.Mode)); err != nil {
		return err
	}
	if c.BlockSize <= 0 {
		return fmt.Errorf("block size %d must be positive: %w", c.BlockSize, ErrInvalidConfig)
	}
	if !finite(c.OverlapCredit) || c.OverlapCredit < 0 || c.OverlapCredit > 1 {
		return fmt.Errorf("overlap credit %v outside [0,1]: %w", c.OverlapCredit, ErrInvalidConfig)
	}
	if !finite(c.PrefillLoadScale) || c.PrefillLoadScale < 0 {
		return fmt.Errorf("prefill load scale %v must be finite and non-negative: %w", c.PrefillLoadScale, ErrInvalidConfig)
	}
	if !finite(c.OverlapCreditDecay) || c.OverlapCreditDecay < 0 {
		return fmt.Errorf("overlap credit decay %v must be finite and non-negative: %w", c.OverlapCreditDecay, ErrInvalidConfig)
	}
	if !finite(c.DecodeActiveRequestWeight) || c.DecodeActiveRequestWeight < 0 {
		return fmt.Errorf("decode active request weight %v must be finite and non-negative: %w", c.DecodeActiveRequestWeight, ErrInvalidConfig)
	}
	if !finite(c.HostCacheHitWeight) || c.HostCacheHitWeight < 0 {
		return fmt.Errorf("host cache hit weight %v must be finite and non-negative: %w", c.HostCacheHitWeight, ErrInvalidConfig)
	}
	if !finite(c.DiskCacheHitWeight) || c.DiskCacheHitWeight < 0 {
		return fmt.Errorf("disk cache hit weight %v must be finite and non-negative: %w", c.DiskCacheHitWeight, ErrInvalidConfig)
	}
	if !finite(c.Temperature) || c.Temperature < 0 {
		return fmt.Errorf("temperature %v must be finite and non-negative: %w", c.Temperature, ErrInvalidConfig)
	}
	if err := c.Thresholds.Validate(); err != nil {
		return err
	}
	if q := c.QueueThreshold; q != nil && (!finite(*q) || *q < 0) {
		return fmt.Errorf("queue threshold %v must be finite and non-negative: %w", *q, ErrInvalidConfig)
	}
	switch c.QueuePolicy {
	case QueueFCFS, QueueWSPT, QueueLCFS, "":
	default:
		return fmt.Errorf("queue policy %q (want fcfs, wspt or lcfs): %w", c.QueuePolicy, ErrInvalidConfig)
	}
	if c.ApproxTTL < 0 || c.RequestExpiry < 0 {
		return fmt.Errorf("negative ttl or expiry: %w", ErrInvalidConfig)
	}
	if err := c.SLO.Validate(); err != nil {
		return err
	}
	return c.Pooled.Validate()
}

func finite(f float64) bool { return !math.IsNaN(f) && !math.IsInf(f, 0) }
