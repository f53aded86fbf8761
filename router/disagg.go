package router

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"time"
)

// Disaggregated prefill/decode: the pure decision model.
//
// A request served disaggregated is prefilled on a prefill worker, its KV
// cache is moved to a decode worker over a link, and the decode worker
// produces the first token and the rest. Seed 001 measured what the move
// costs: on a 1 GbE-class link (104 MB/s per transfer) the extra TTFT was
// KV bytes ÷ link throughput, 1.7 s for 1,500 tokens and 3.4 s for 3,000 on
// Qwen3-0.6B (114,688 bytes per token), and four concurrent transfers split
// the link four ways. This file holds the arithmetic (ModelKV, Link,
// LinkState), the step-time model of a worker (StepTiming) and the planner
// that compares the aggregated and disaggregated TTFT of one request
// (DisaggPlanner). disagg_router.go drives it with two Routers.

// Role is what a worker does in disaggregated serving.
type Role string

// Worker roles (Dynamo's --is-prefill-worker / --is-decode-worker; neither
// flag is "both").
const (
	RolePrefill Role = "prefill"
	RoleDecode  Role = "decode"
	RoleBoth    Role = "both"
)

// ParseRole accepts prefill, decode and both ("" and "aggregated" are both).
func ParseRole(s string) (Role, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "prefill", "prefill-only", "is-prefill-worker":
		return RolePrefill, nil
	case "decode", "decode-only", "is-decode-worker":
		return RoleDecode, nil
	case "both", "", "aggregated", "agg":
		return RoleBoth, nil
	}
	return "", fmt.Errorf("unknown worker role %q (want prefill, decode or both): %w", s, ErrInvalidConfig)
}

// Prefills reports whether a worker of this role takes prefill-only work.
func (r Role) Prefills() bool { return r == RolePrefill || r == RoleBoth || r == "" }

// Decodes reports whether a worker of this role decodes (and so can also
// serve a request aggregated: prefill and decode on itself).
func (r Role) Decodes() bool { return r == RoleDecode || r == RoleBoth || r == "" }

// RoleWorker is a worker and its role.
type RoleWorker struct {
	WorkerInfo
	Role Role
}

// SplitByRole returns the prefill-capable (prefill, both) and the
// decode-capable (decode, both) workers, each sorted by id. A "both" worker
// is in both lists.
func SplitByRole(ws []RoleWorker) (prefill, decode []WorkerInfo) {
	for _, w := range ws {
		if w.Role.Prefills() {
			prefill = append(prefill, w.WorkerInfo)
		}
		if w.Role.Decodes() {
			decode = append(decode, w.WorkerInfo)
		}
	}
	byID := func(a, b WorkerInfo) int { return strings.Compare(string(a.ID), string(b.ID)) }
	slices.SortFunc(prefill, byID)
	slices.SortFunc(decode, byID)
	return prefill, decode
}

// ModelKV describes the size of one token's KV cache.
//
//	bytes per token = Layers × KVHeads × HeadDim × 2 (K and V) × DTypeBytes
//
// Qwen3-0.6B: 28 × 8 × 128 × 2 × 2 (bfloat16) = 114,688 bytes.
type ModelKV struct {
	Layers, KVHeads, HeadDim, DTypeBytes int
	// Given, when positive, is the bytes per token as is: for caches the
	// formula does not describe (MLA, sliding windows, quantised caches) or
	// a figure measured on the wire.
	Given int64
}

// KVQwen3_0_6B is seed 001's model: 114,688 bytes per token.
var KVQwen3_0_6B = ModelKV{Layers: 28, KVHeads: 8, HeadDim: 128, DTypeBytes: 2}

// BytesPerToken is the KV cache size of one token.
func (m ModelKV) BytesPerToken() int64 {
	if m.Given > 0 {
		return m.Given
	}
	return int64(m.Layers) * int64(m.KVHeads) * int64(m.HeadDim) * 2 * int64(m.DTypeBytes)
}

// Bytes is the KV cache size of tokens tokens.
func (m ModelKV) Bytes(tokens int) int64 { return int64(max(tokens, 0)) * m.BytesPerToken() }

// Validate rejects a model whose bytes per token are not positive.
func (m ModelKV) Validate() error {
	if m.Given < 0 || m.Layers < 0 || m.KVHeads < 0 || m.HeadDim < 0 || m.DTypeBytes < 0 {
		return fmt.Errorf("model KV %+v: negative dimension: %w", m, ErrInvalidConfig)
	}
	if m.BytesPerToken() <= 0 {
		return fmt.Errorf("model KV %+v: give layers, KV heads, head dim and dtype bytes, or the bytes per token: %w", m, ErrInvalidConfig)
	}
	return nil
}

// Link is a KV transfer path between prefill and decode workers: a network
// link, or a class of identical links (NVLink inside each node).
type Link struct {
	// ThroughputBytesPerS is the link's throughput, shared fairly by the
	// transfers on it (seed 001: 104 MB/s on 1 GbE-class TCP).
	ThroughputBytesPerS float64
	// PerTransferBytesPerS caps one transfer (0 = no cap): what one stream
	// reaches on a fast link (seed 001 §4.2: 608 MB/s inside one GPU).
	PerTransferBytesPerS float64
	// MaxConcurrent transfers share the link at once; later ones wait in
	// arrival order (0 = no limit).
	MaxConcurrent int
	// Latency is a fixed cost per transfer (handshake, descriptor
	// registration), spent before the bytes flow; it uses no throughput.
	Latency time.Duration
	// PerPair: every (prefill, decode) pair mapped to this link has its own
	// instance of it (a link class). Otherwise they all share one.
	PerPair bool
}

// Validate checks the link's numbers.
func (l Link) Validate() error {
	if !finite(l.ThroughputBytesPerS) || l.ThroughputBytesPerS <= 0 {
		return fmt.Errorf("link throughput %v B/s must be positive: %w", l.ThroughputBytesPerS, ErrInvalidConfig)
	}
	if !finite(l.PerTransferBytesPerS) || l.PerTransferBytesPerS < 0 {
		return fmt.Errorf("link per-transfer cap %v B/s must be finite and non-negative: %w", l.PerTransferBytesPerS, ErrInvalidConfig)
	}
	if l.MaxConcurrent < 0 || l.Latency < 0 {
		return fmt.Errorf("link max concurrent %d and latency %v must not be negative: %w", l.MaxConcurrent, l.Latency, ErrInvalidConfig)
	}
	return nil
}

// rate is one transfer's throughput when n transfers move bytes at once.
func (l Link) rate(n int) float64 {
	r := l.ThroughputBytesPerS / float64(max(n, 1))
	if l.PerTransferBytesPerS > 0 {
		r = min(r, l.PerTransferBytesPerS)
	}
	return r
}

// Alone is the time to move bytes over an idle link.
func (l Link) Alone(bytes int64) time.Duration {
	return l.Latency + secondsToDuration(float64(bytes)/l.rate(1))
}

// TransferTime is the time to move bytes when inflight other transfers
// share the link for the whole of it: each of the inflight+1 gets an equal
// share (seed 001: four concurrent 3,000-token transfers at 26–28 MB/s each
// on a 112 MB/s link). With MaxConcurrent set, transfers beyond it wait for
// the ones ahead to finish (each batch of MaxConcurrent takes as long as
// this one). LinkState.Estimate is the exact fluid model with the in-flight
// transfers' remaining bytes.
func (l Link) TransferTime(bytes int64, inflight int) time.Duration {
	n := max(inflight, 0) + 1
	share := n
	waves := 1
	if l.MaxConcurrent > 0 && n > l.MaxConcurrent {
		share = l.MaxConcurrent
		waves = (n + l.MaxConcurrent - 1) / l.MaxConcurrent
	}
	per := l.Latency + secondsToDuration(float64(bytes)/l.rate(share))
	return time.Duration(waves) * per
}

// secondsToDuration rounds up to the nanosecond: a transfer with bytes
// left never completes "now".
func secondsToDuration(s float64) time.Duration {
	if s <= 0 {
		return 0
	}
	if s > float64(math.MaxInt64)/1e9 {
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(math.Ceil(s * 1e9))
}

// LinkPair names a (prefill worker, decode worker) pair.
type LinkPair struct{ Prefill, Decode WorkerID }

// Topology maps prefill/decode pairs to links.
type Topology struct {
	Links   map[string]Link     // by name
	Pairs   map[LinkPair]string // pair → link name
	Default string              // link of pairs not listed; "" = those pairs cannot transfer
}

// SingleLink is a topology where every pair shares one link called name.
func SingleLink(name string, l Link) Topology {
	return Topology{Links: map[string]Link{name: l}, Default: name}
}

// LinkFor returns the name and parameters of the link between p and d.
func (t Topology) LinkFor(p, d WorkerID) (string, Link, bool) {
	name, ok := t.Pairs[LinkPair{p, d}]
	if !ok {
		name = t.Default
	}
	l, ok := t.Links[name]
	if name == "" || !ok {
		return "", Link{}, false
	}
	return name, l, true
}

// Validate checks every link and that every pair names a known link.
func (t Topology) Validate() error {
	for name, l := range t.Links {
		if err := l.Validate(); err != nil {
			return fmt.Errorf("link %q: %w", name, err)
		}
	}
	if _, ok := t.Links[t.Default]; t.Default != "" && !ok {
		return fmt.Errorf("default link %q is not defined: %w", t.Default, ErrInvalidConfig)
	}
	for p, name := range t.Pairs {
		if _, ok := t.Links[name]; !ok {
			return fmt.Errorf("pair %s→%s names undefined link %q: %w", p.Prefill, p.Decode, name, ErrInvalidConfig)
		}
	}
	return nil
}

// LinkState is a fluid model of the transfers on one link: the transfers
// that move bytes share the throughput equally (each capped at
// PerTransferBytesPerS), up to MaxConcurrent at once, the rest waiting in
// arrival order. It serves as the simulator's link and as the router's
// view of a real link (fed by transfer starts and ends). Not safe for
// concurrent use.
type LinkState struct {
	link   Link
	now    time.Time
	active []*linkTransfer // holding a slot, in start order
	queue  []*linkTransfer // waiting for a slot
	done   []TransferDone  // completed by an internal advance, not yet returned
	peak   int
}

type linkTransfer struct {
	id          string
	bytes       int64
	left        float64
	enqueued    time.Time
	began       time.Time // took a slot
	ready       time.Time // began + latency: bytes flow from here
	hasSlotTime bool
}

// TransferDone is one completed transfer.
type TransferDone struct {
	ID    string
	Bytes int64
	// Enqueued is when Start was called, Began when the transfer got a slot
	// on the link, At when its last byte arrived.
	Enqueued, Began, At time.Time
}

// Duration is the time from Start to the last byte.
func (d TransferDone) Duration() time.Duration { return d.At.Sub(d.Enqueued) }

// NewLinkState returns an idle link.
func NewLinkState(l Link) *LinkState { return &LinkState{link: l} }

// Link returns the link's parameters.
func (s *LinkState) Link() Link { return s.link }

// InFlight is the number of transfers on the link or waiting for it.
func (s *LinkState) InFlight() int { return len(s.active) + len(s.queue) }

// Peak is the largest number of transfers that held a slot at once.
func (s *LinkState) Peak() int { return s.peak }

// Start begins moving bytes at now (after the link's latency, and after a
// free slot when MaxConcurrent is reached). Re-starting a known id restarts
// it from zero (a retry).
func (s *LinkState) Start(id string, bytes int64, now time.Time) {
	s.advance(now)
	s.remove(id)
	s.queue = append(s.queue, &linkTransfer{id: id, bytes: bytes, left: float64(max(bytes, 0)), enqueued: s.now})
	s.promote()
}

// Cancel drops transfer id (failed, or finished by a signal the model did
// not predict); false when it is unknown.
func (s *LinkState) Cancel(id string, now time.Time) bool {
	s.advance(now)
	ok := s.remove(id)
	s.promote()
	return ok
}

func (s *LinkState) remove(id string) bool {
	for i, t := range s.active {
		if t.id == id {
			s.active = slices.Delete(s.active, i, i+1)
			return true
		}
	}
	for i, t := range s.queue {
		if t.id == id {
			s.queue = slices.Delete(s.queue, i, i+1)
			return true
		}
	}
	return false
}

// Advance moves the model to now and returns the transfers completed since
// the last call, in completion order.
func (s *LinkState) Advance(now time.Time) []TransferDone {
	s.advance(now)
	out := s.done
	s.done = nil
	return out
}

// Remaining returns the bytes still to move of each transfer on the link
// or waiting for it.
func (s *LinkState) Remaining() []float64 {
	out := make([]float64, 0, s.InFlight())
	for _, t := range s.active {
		out = append(out, t.left)
	}
	for _, t := range s.queue {
		out = append(out, t.left)
	}
	return out
}

// NextEvent is when the model next changes (a transfer completes or starts
// moving bytes) if nothing is started or cancelled; false when idle.
func (s *LinkState) NextEvent() (time.Time, bool) {
	next, ok := s.nextEvent()
	return next, ok
}

func (s *LinkState) promote() {
	for len(s.queue) > 0 && (s.link.MaxConcurrent <= 0 || len(s.active) < s.link.MaxConcurrent) {
		t := s.queue[0]
		s.queue = s.queue[1:]
		t.began, t.ready, t.hasSlotTime = s.now, s.now.Add(s.link.Latency), true
		s.active = append(s.active, t)
	}
	s.peak = max(s.peak, len(s.active))
}

// moving counts the active transfers past their latency at s.now.
func (s *LinkState) moving() int {
	n := 0
	for _, t := range s.active {
		if !t.ready.After(s.now) {
			n++
		}
	}
	return n
}

func (s *LinkState) nextEvent() (time.Time, bool) {
	if len(s.active) == 0 {
		return time.Time{}, false
	}
	rate := s.link.rate(s.moving())
	var next time.Time
	found := false
	for _, t := range s.active {
		var at time.Time
		if t.ready.After(s.now) {
			at = t.ready
		} else {
			at = s.now.Add(secondsToDuration(t.left / rate))
		}
		if !found || at.Before(next) {
			next, found = at, true
		}
	}
	return next, found
}

// advance runs the fluid model to now.
func (s *LinkState) advance(now time.Time) {
	if s.now.IsZero() {
		s.now = now
	}
	for guard := 0; ; guard++ {
		next, ok := s.nextEvent()
		if !ok || next.After(now) {
			s.flow(now)
			break
		}
		s.flow(next)
		// Complete every moving transfer with (numerically) nothing left.
		eps := max(1e-6, s.link.rate(1)*2e-9)
		kept := s.active[:0]
		for _, t := range s.active {
			if !t.ready.After(s.now) && t.left <= eps {
				s.done = append(s.done, TransferDone{ID: t.id, Bytes: t.bytes, Enqueued: t.enqueued, Began: t.began, At: s.now})
				continue
			}
			kept = append(kept, t)
		}
		clear(s.active[len(kept):])
		s.active = kept
		s.promote()
		if guard > 1<<20 {
			panic("router: link model does not converge")
		}
	}
}

// flow moves bytes from s.now to t (no event in between) and sets s.now.
func (s *LinkState) flow(t time.Time) {
	if !t.After(s.now) {
		return
	}
	dt := t.Sub(s.now).Seconds()
	rate := s.link.rate(s.moving())
	for _, x := range s.active {
		if !x.ready.After(s.now) {
			x.left = max(0, x.left-rate*dt)
		}
	}
	s.now = t
}

// clone deep-copies the model.
func (s *LinkState) clone() *LinkState {
	c := &LinkState{link: s.link, now: s.now, peak: s.peak}
	for _, t := range s.active {
		x := *t
		c.active = append(c.active, &x)
	}
	for _, t := range s.queue {
		x := *t
		c.queue = append(c.queue, &x)
	}
	return c
}

// Estimate is how long a transfer of bytes would take, counted from its
// start, if it started startAfter from now, behind the transfers in flight
// and behind ahead (transfers already committed that will start before it;
// they are assumed to start now, which errs on the slow side). It runs the
// fluid model on a copy; the link itself does not change.
func (s *LinkState) Estimate(now time.Time, bytes int64, startAfter time.Duration, ahead []int64) time.Duration {
	c := s.clone()
	c.done = nil
	c.advance(now)
	for i, b := range ahead {
		c.Start(fmt.Sprintf("\x00ahead-%d", i), b, now)
	}
	start := now.Add(max(startAfter, 0))
	const me = "\x00estimate"
	c.Start(me, bytes, start)
	for {
		for _, d := range c.Advance(c.now) {
			if d.ID == me {
				return d.At.Sub(start)
			}
		}
		next, ok := c.nextEvent()
		if !ok {
			return s.link.Alone(bytes) // unreachable: me is in flight
		}
		c.advance(next)
	}
}

// StepTiming is a worker's step-time model, handed in by the caller (the
// engine package's Profile has these three methods; the router does not
// import it). Times are milliseconds.
type StepTiming struct {
	PrefillMs func(tokens int) float64   // a prefill-only step of tokens new tokens
	DecodeMs  func(fill float64) float64 // a decode-only step at KV fill fraction fill
	// StepMs is a step of prefillTokens prompt tokens and decodeSeqs decode
	// tokens; nil = max(PrefillMs(prefill+decodes), DecodeMs(fill)) when
	// mixed (vLLM runs the batch as one forward pass).
	StepMs func(prefillTokens, decodeSeqs int, fill float64) float64
	// MaxBatchedTokens is the per-step token budget that chunks a long
	// prefill (0 = vLLM's 8,192).
	MaxBatchedTokens int
}

// Validate requires the two basic functions.
func (t StepTiming) Validate() error {
	if t.PrefillMs == nil || t.DecodeMs == nil {
		return fmt.Errorf("step timing needs PrefillMs and DecodeMs: %w", ErrInvalidConfig)
	}
	if t.MaxBatchedTokens < 0 {
		return fmt.Errorf("step timing: max batched tokens %d: %w", t.MaxBatchedTokens, ErrInvalidConfig)
	}
	return nil
}

func (t StepTiming) step(prefill, decodes int, fill float64) float64 {
	if t.StepMs != nil {
		return t.StepMs(prefill, decodes, fill)
	}
	switch {
	case prefill == 0 && decodes == 0:
		return 0
	case prefill == 0:
		return t.DecodeMs(fill)
	case decodes == 0:
		return t.PrefillMs(prefill)
	}
	return math.Max(t.PrefillMs(prefill+decodes), t.DecodeMs(fill))
}

// PrefillRun estimates a worker that has ahead prompt tokens queued (FCFS)
// and decodes sequences decoding: wait is the time until this request's own
// tokens start, own the time of the steps that compute its own tokens, and
// stall what each decoding sequence loses to those steps compared with
// decode-only steps (the interference of an aggregated prefill). Chunks are
// the step budget less one token per decoding sequence.
func (t StepTiming) PrefillRun(ahead, own, decodes int, fill float64) (wait, mine, stall time.Duration) {
	chunk := t.chunk(decodes)
	ahead, own = max(ahead, 0), max(own, 0)
	dec := 0.0
	if decodes > 0 {
		dec = t.DecodeMs(fill)
	}
	var waitMs, ownMs, stallMs float64
	own1 := func(n, times int) {
		ms := t.step(n, decodes, fill)
		ownMs += float64(times) * ms
		if decodes > 0 {
			stallMs += float64(times) * max(ms-dec, 0)
		}
	}
	// Whole chunks of queued work first; the step where the queue ends and
	// this request begins counts as this request's.
	if full := ahead / chunk; full > 0 {
		waitMs = float64(full) * t.step(chunk, decodes, fill)
	}
	left := ahead % chunk
	if own == 0 {
		if left > 0 {
			waitMs += t.step(left, decodes, fill)
		}
		return msDur(waitMs), 0, 0
	}
	first := min(chunk, left+own)
	own1(first, 1)
	todo := own - (first - left)
	if k := todo / chunk; k > 0 {
		own1(chunk, k)
	}
	if r := todo % chunk; r > 0 {
		own1(r, 1)
	}
	return msDur(waitMs), msDur(ownMs), msDur(stallMs)
}

func msDur(ms float64) time.Duration { return time.Duration(math.Round(ms * 1e6)) }

// DisaggMode is the --disagg switch.
type DisaggMode string

// Disaggregation modes.
const (
	DisaggOff    DisaggMode = "off"    // every request aggregated on a decode-capable worker
	DisaggAlways DisaggMode = "always" // every request disaggregated while a prefill worker is healthy
	DisaggAuto   DisaggMode = "auto"   // per request, the lower estimated TTFT
)

// DisaggModes lists the modes.
var DisaggModes = []DisaggMode{DisaggOff, DisaggAlways, DisaggAuto}

// ParseDisaggMode parses off, always or auto.
func ParseDisaggMode(s string) (DisaggMode, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "off", "", "false", "no", "aggregated":
		return DisaggOff, nil
	case "always", "on", "true", "yes":
		return DisaggAlways, nil
	case "auto":
		return DisaggAuto, nil
	}
	return "", fmt.Errorf("unknown disaggregation mode %q (want off, always or auto): %w", s, ErrInvalidConfig)
}

// PlanWorker is what the planner needs of one candidate worker.
type PlanWorker struct {
	Worker       WorkerID
	CachedTokens int // prompt tokens already in its KV cache (overlap × block size)
	// QueuedPrefillTokens are other requests' prompt tokens still to
	// prefill there, ahead of this one.
	QueuedPrefillTokens int
	DecodeSeqs          int     // sequences decoding there
	Fill                float64 // KV fill fraction (decode step time)
	// IncomingKV are the estimated times from now at which the KV of
	// disaggregated requests already routed to this (decode) worker
	// arrives. A prefill run there makes them wait: a running prefill
	// chunk takes the step budget before waiting requests are admitted.
	IncomingKV []time.Duration
}

// PlanInput is one request's candidates.
type PlanInput struct {
	Tokens int // prompt tokens
	// Prefill is the prefill worker the prefill router chose (full cost
	// function with overlap); nil when none is available, with the reason
	// in PrefillUnavailable.
	Prefill            *PlanWorker
	PrefillUnavailable string
	// Decode is the worker the decode router chose (load only) for the
	// disaggregated plan.
	Decode *PlanWorker
	// Aggregated is the decode-capable worker the aggregated plan uses
	// (chosen by the full cost function with overlap, as --disagg off
	// routes); nil = Decode.
	Aggregated *PlanWorker
	// Link is the transfer path from Prefill to Decode; nil = no path.
	Link *PlanLink
}

// PlanLink is a transfer path as the planner sees it.
type PlanLink struct {
	Name string
	Link Link
	// Estimate returns the transfer time of bytes if it starts startAfter
	// from now, queueing included; nil = Link.TransferTime with InFlight.
	Estimate func(bytes int64, startAfter time.Duration) time.Duration
	InFlight int
}

// TTFTEstimate breaks one plan's time to first token down.
type TTFTEstimate struct {
	Worker WorkerID // aggregated: the worker; disaggregated: the prefill worker
	Decode WorkerID // disaggregated: the decode worker
	// PrefillTokens are the uncached prompt tokens computed.
	PrefillTokens int
	QueueWait     time.Duration // prefill queued ahead on the (prefill) worker
	Prefill       time.Duration // the steps computing this prompt
	// Disaggregated only: the KV moved, over which link, and how long.
	TransferTokens int
	TransferBytes  int64
	Link           string
	Transfer       time.Duration // queueing on the link included
	TransferAlone  time.Duration // on an idle link
	FirstDecode    time.Duration // from the KV's arrival to the first token on the decode worker
	Total          time.Duration
	// Aggregated only: what each of DecodeSeqs decoding sequences loses to
	// this prefill's steps.
	StallPerSeq time.Duration
	DecodeSeqs  int
	// Aggregated only: the first-token delay this prefill imposes on the
	// disaggregated requests whose KV arrives on the worker while it runs
	// (sum over Blocked requests).
	BlockedDelay time.Duration
	Blocked      int
}

// TransferQueue is the link queueing part of Transfer.
func (e TTFTEstimate) TransferQueue() time.Duration { return max(e.Transfer-e.TransferAlone, 0) }

// DisaggPlan is the planner's decision for one request.
type DisaggPlan struct {
	Mode          DisaggMode
	Disaggregated bool
	// Fallback: the mode asked for disaggregation but the request is served
	// aggregated (no healthy prefill worker, no link, a failed transfer).
	Fallback bool
	Reason   string
	// PrefillWorker is set when disaggregated; DecodeWorker is the worker
	// that decodes (the aggregated worker when aggregated).
	PrefillWorker, DecodeWorker WorkerID
	Agg                         TTFTEstimate
	Disagg                      TTFTEstimate
	DisaggOK                    bool // Disagg was estimated (a prefill worker and a path exist)
	// Estimate is the chosen plan's estimated TTFT.
	Estimate time.Duration
}

// Explain renders both estimates and the choice, one line each.
func (p DisaggPlan) Explain() string {
	var b strings.Builder
	a := p.Agg
	fmt.Fprintf(&b, "aggregated on worker_id=%s: TTFT %s = queue %s + prefill %d tokens %s", a.Worker, secs(a.Total), secs(a.QueueWait), a.PrefillTokens, secs(a.Prefill))
	if a.DecodeSeqs > 0 {
		fmt.Fprintf(&b, " (mixed with %d decoding sequences; each loses %s)", a.DecodeSeqs, secs(a.StallPerSeq))
	}
	if a.Blocked > 0 {
		fmt.Fprintf(&b, "; delays %d disaggregated first tokens by %s in all", a.Blocked, secs(a.BlockedDelay))
	}
	b.WriteByte('\n')
	if p.DisaggOK {
		d := p.Disagg
		fmt.Fprintf(&b, "disaggregated prefill worker_id=%s → decode worker_id=%s: TTFT %s = queue %s + prefill %d tokens %s + transfer %d tokens %d bytes over %q %s (idle link %s, queueing %s) + first decode step %s\n",
			d.Worker, d.Decode, secs(d.Total), secs(d.QueueWait), d.PrefillTokens, secs(d.Prefill), d.TransferTokens, d.TransferBytes, d.Link,
			secs(d.Transfer), secs(d.TransferAlone), secs(d.TransferQueue()), secs(d.FirstDecode))
	}
	how := "aggregated"
	if p.Disaggregated {
		how = "disaggregated"
	}
	fmt.Fprintf(&b, "disagg=%s: %s (%s)", p.Mode, how, p.Reason)
	if p.Fallback {
		b.WriteString(" [fallback]")
	}
	b.WriteByte('\n')
	return b.String()
}

func secs(d time.Duration) string { return fmt.Sprintf("%.3fs", d.Seconds()) }

// DisaggPlanner compares aggregated and disaggregated TTFT for one request.
type DisaggPlanner struct {
	Mode   DisaggMode
	KV     ModelKV
	Timing StepTiming
	// InterferenceWeight adds, in auto mode, this multiple of the decode
	// time an aggregated prefill takes from the sequences decoding on its
	// worker (stall per sequence × sequences) to the aggregated side:
	// 0 compares TTFT alone; 1 counts a second of others' decode as a
	// second of this request's TTFT.
	InterferenceWeight float64
}

// Validate checks the planner's configuration.
func (pl *DisaggPlanner) Validate() error {
	if _, err := ParseDisaggMode(string(pl.Mode)); err != nil {
		return err
	}
	if err := pl.KV.Validate(); err != nil {
		return err
	}
	if err := pl.Timing.Validate(); err != nil {
		return err
	}
	if !finite(pl.InterferenceWeight) || pl.InterferenceWeight < 0 {
		return fmt.Errorf("interference weight %v must be finite and non-negative: %w", pl.InterferenceWeight, ErrInvalidConfig)
	}
	return nil
}

// uncached: vLLM computes at least one token even on a full hit.
func uncached(tokens, cached int) int { return max(tokens-max(cached, 0), min(tokens, 1)) }

// EstimateAggregated is the TTFT of prefilling on w, a decode-capable worker.
func (pl *DisaggPlanner) EstimateAggregated(tokens int, w PlanWorker) TTFTEstimate {
	own := uncached(tokens, w.CachedTokens)
	wait, mine, stall := pl.Timing.PrefillRun(w.QueuedPrefillTokens, own, w.DecodeSeqs, w.Fill)
	e := TTFTEstimate{
		Worker: w.Worker, PrefillTokens: own, QueueWait: wait, Prefill: mine,
		Total: wait + mine, StallPerSeq: stall, DecodeSeqs: w.DecodeSeqs,
	}
	for _, at := range w.IncomingKV {
		// A KV arriving before this prefill starts waits out the queue
		// anyway and then this prefill too; one arriving during it waits
		// for its end.
		if d := wait + mine - max(at, wait); d > 0 {
			e.BlockedDelay += min(d, mine)
			e.Blocked++
		}
	}
	return e
}

// EstimateDisaggregated is the TTFT of prefilling on p, moving the KV the
// decode worker d does not hold over link, and decoding the first token on d.
func (pl *DisaggPlanner) EstimateDisaggregated(tokens int, p, d PlanWorker, link PlanLink) TTFTEstimate {
	own := uncached(tokens, p.CachedTokens)
	wait, mine, _ := pl.Timing.PrefillRun(p.QueuedPrefillTokens, own, p.DecodeSeqs, p.Fill)
	moved := max(tokens-max(d.CachedTokens, 0), 0)
	bytes := pl.KV.Bytes(moved)
	e := TTFTEstimate{
		Worker: p.Worker, Decode: d.Worker, PrefillTokens: own, QueueWait: wait, Prefill: mine,
		TransferTokens: moved, TransferBytes: bytes, Link: link.Name, TransferAlone: link.Link.Alone(bytes),
	}
	if link.Estimate != nil {
		e.Transfer = link.Estimate(bytes, wait+mine)
	} else {
		e.Transfer = link.Link.TransferTime(bytes, link.InFlight)
	}
	e.FirstDecode = pl.firstDecode(d, e.QueueWait+e.Prefill+e.Transfer)
	e.Total = e.QueueWait + e.Prefill + e.Transfer + e.FirstDecode
	return e
}

// firstDecode is the time from the KV's arrival on d, arrive from now, to
// its first token: one decode step, unless d is still busy with prefill
// work queued there (aggregated requests) when the KV arrives; then the
// request waits out the running step (half a step on average) and decodes
// in a mixed step with the next chunk.
func (pl *DisaggPlanner) firstDecode(d PlanWorker, arrive time.Duration) time.Duration {
	seqs := d.DecodeSeqs + 1
	if d.QueuedPrefillTokens > 0 {
		busy, _, _ := pl.Timing.PrefillRun(d.QueuedPrefillTokens, 0, d.DecodeSeqs, d.Fill)
		if arrive < busy {
			chunk := min(d.QueuedPrefillTokens, pl.Timing.chunk(seqs))
			return msDur(1.5 * pl.Timing.step(chunk, seqs, d.Fill))
		}
	}
	return msDur(pl.Timing.step(0, seqs, d.Fill))
}

// chunk is the prefill tokens one step takes beside decodes decode tokens.
func (t StepTiming) chunk(decodes int) int {
	budget := t.MaxBatchedTokens
	if budget <= 0 {
		budget = 8192
	}
	return max(budget-decodes, 1)
}

// Plan estimates both ways of serving the request and picks one by mode.
// It fails only when there is no decode-capable worker.
func (pl *DisaggPlanner) Plan(in PlanInput) (DisaggPlan, error) {
	p := DisaggPlan{Mode: pl.Mode}
	if in.Decode == nil {
		return p, fmt.Errorf("disaggregation: no decode-capable worker: %w", ErrNoWorkers)
	}
	agg := in.Aggregated
	if agg == nil {
		agg = in.Decode
	}
	p.Agg = pl.EstimateAggregated(in.Tokens, *agg)
	why := ""
	switch {
	case in.Prefill == nil:
		why = "no prefill worker available"
		if in.PrefillUnavailable != "" {
			why += ": " + in.PrefillUnavailable
		}
	case in.Link == nil:
		why = fmt.Sprintf("no transfer link from prefill worker %s to decode worker %s", in.Prefill.Worker, in.Decode.Worker)
	default:
		p.Disagg = pl.EstimateDisaggregated(in.Tokens, *in.Prefill, *in.Decode, *in.Link)
		p.DisaggOK = true
	}
	useDisagg := false
	switch pl.Mode {
	case DisaggOff:
		p.Reason = "disaggregation off"
	case DisaggAlways:
		if p.DisaggOK {
			useDisagg, p.Reason = true, "disaggregation always"
		} else {
			p.Fallback, p.Reason = true, why
		}
	case DisaggAuto:
		// This request's TTFT, plus optionally the decode stall it causes.
		// (BlockedDelay, the first-token delay it causes disaggregated
		// requests already headed there, is reported but not counted:
		// counting it minimises the sum of TTFTs and lost up to ×2 in
		// p50 TTFT in kvbench disagg's 3-prefill + 1-decode runs.)
		aggScore := p.Agg.Total + time.Duration(pl.InterferenceWeight*float64(p.Agg.StallPerSeq)*float64(p.Agg.DecodeSeqs))
		switch {
		case !p.DisaggOK:
			p.Reason = why
		case p.Disagg.Total < aggScore:
			useDisagg = true
			p.Reason = fmt.Sprintf("auto: disaggregated %s < aggregated %s", secs(p.Disagg.Total), secs(aggScore))
		default:
			p.Reason = fmt.Sprintf("auto: aggregated %s <= disaggregated %s", secs(aggScore), secs(p.Disagg.Total))
		}
		if pl.InterferenceWeight > 0 && p.Agg.DecodeSeqs > 0 {
			p.Reason += fmt.Sprintf(" (aggregated includes %.2f × %d sequences × %s of decode stall)", pl.InterferenceWeight, p.Agg.DecodeSeqs, secs(p.Agg.StallPerSeq))
		}
	default:
		return p, fmt.Errorf("disaggregation mode %q: %w", pl.Mode, ErrInvalidConfig)
	}
	p.Disaggregated = useDisagg
	if useDisagg {
		p.PrefillWorker, p.DecodeWorker, p.Estimate = in.Prefill.Worker, in.Decode.Worker, p.Disagg.Total
	} else {
		p.DecodeWorker, p.Estimate = agg.Worker, p.Agg.Total
	}
	return p, nil
}

// DebugFields renders the plan for a JSON debug endpoint (/debug/route):
// times in seconds, one object per estimate.
func (p DisaggPlan) DebugFields() map[string]any {
	est := func(e TTFTEstimate) map[string]any {
		m := map[string]any{
			"worker": e.Worker, "prefill_tokens": e.PrefillTokens, "queue_s": e.QueueWait.Seconds(),
			"prefill_s": e.Prefill.Seconds(), "ttft_s": e.Total.Seconds(),
		}
		if e.Decode != "" {
			m["decode_worker"] = e.Decode
			m["transfer_tokens"], m["transfer_bytes"], m["link"] = e.TransferTokens, e.TransferBytes, e.Link
			m["transfer_s"], m["transfer_idle_link_s"], m["transfer_queue_s"] = e.Transfer.Seconds(), e.TransferAlone.Seconds(), e.TransferQueue().Seconds()
			m["first_decode_s"] = e.FirstDecode.Seconds()
		} else {
			m["decoding_sequences"], m["stall_per_sequence_s"] = e.DecodeSeqs, e.StallPerSeq.Seconds()
			m["blocked_disaggregated"], m["blocked_delay_s"] = e.Blocked, e.BlockedDelay.Seconds()
		}
		return m
	}
	out := map[string]any{
		"mode": p.Mode, "disaggregated": p.Disaggregated, "fallback": p.Fallback, "reason": p.Reason,
		"decode_worker": p.DecodeWorker, "estimate_ttft_s": p.Estimate.Seconds(), "aggregated": est(p.Agg),
	}
	if p.Disaggregated {
		out["prefill_worker"] = p.PrefillWorker
	}
	if p.DisaggOK {
		out["disaggregated_estimate"] = est(p.Disagg)
	}
	return out
}
