package api

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/router"
)

// Prefix pinning (issue 28 item 2; DESIGN.md "Prefix pins"): Dynamo's
// agentic cache control. A request carrying
//
//	"nvext": {"cache_control": {"type": "ephemeral", "ttl": "5m"}}
//
// pins its prompt's prefix blocks (the block hashes the router computed) on
// the worker it was sent to, for the TTL. While the pin lasts, requests
// whose prompt starts with the pinned prefix go to the pin's holders, a hit
// refreshes the pin, and kv-pooled prices the pinned blocks as held and not
// evictable. Pins are replicated state (the control group's FSM), read
// locally; writes go through Raft in the background, coalesced (at most one
// entry per pin per half TTL, or when the prompt has doubled the pinned
// prefix), never one per request. The body, cache_control included, is
// forwarded to the worker untouched: SGLang's HiCache pins the blocks in
// the engine too; vLLM ignores the field.

// Pin limits. MaxPinBlocks and MaxPinTTL are the FSM's (fsm.MaxPinBlocks,
// fsm.MaxPinTTL; the replica checks they agree).
const (
	// DefaultPinTTL is Dynamo's default TTL ("5m") when ttl is absent.
	DefaultPinTTL = 5 * time.Minute
	// MaxPinTTL is the longest TTL a request may ask: Dynamo's longest
	// documented format ("1h"), and Anthropic's longest cache TTL.
	MaxPinTTL = time.Hour
	// MaxPinBlocks bounds the blocks one pin holds: a longer prompt pins
	// its first MaxPinBlocks blocks (still a prefix).
	MaxPinBlocks = 4096
)

// PinReplica is the optional part of a Replica that keeps prefix pins
// (found by type assertion, like SessionReplica). Without it, or while
// PinsEnabled is false, cache_control is not read (it still reaches the
// worker in the body) and requests are routed as before.
type PinReplica interface {
	// PinsEnabled is --enable-agentic-cache-control.
	PinsEnabled() bool
	// PinLookup finds the longest pinned prefix of hashes for model, from
	// the local replicated state (no consensus round trip).
	PinLookup(model string, hashes []uint64) (PinMatch, bool)
	// Pin commits a pin, a refresh or a move in the background; a write of
	// the same pin already in flight absorbs it. Never blocks.
	Pin(w PinWrite)
	// PinCount is the number of pins held; Pins lists them (GET /pins).
	PinCount() int
	Pins() []PinInfo
	// Unpin commits the end of pins (DELETE /pins) and returns how many
	// ended. A malformed request wraps ErrInvalid.
	Unpin(ctx context.Context, u PinUnpin) (int, error)
}

// PinUnpin names the pins DELETE /pins ends: with Model, those of the
// prefix Key (on Worker's ranks, or every holder when Worker is ""); without,
// every pin on Worker's ranks.
type PinUnpin struct {
	Model  string
	Key    uint64
	Worker string
}

// PinMatch is the longest pinned prefix of a request: Depth blocks, whose
// last block hash is Key, pinned on Holders.
type PinMatch struct {
	Depth   int
	Key     uint64
	Holders []PinHolder
}

// PinHolder is one worker holding a pin, with its expiry and TTL.
type PinHolder struct {
	Worker router.WorkerID
	Until  time.Time
	TTL    time.Duration
}

// PinWrite asks for a pin of Blocks (Key = its last hash) on Worker for
// TTL, or, with Blocks nil, a refresh of the pin (Model, Key, Worker).
// Replace is a holder found gone: its pin of this prefix ends (the pin
// moves).
type PinWrite struct {
	Model   string
	Worker  router.WorkerID
	Blocks  []uint64
	Key     uint64
	TTL     time.Duration
	Replace router.WorkerID
}

// PinInfo is one pin as GET /pins shows it.
type PinInfo struct {
	Model   string          `json:"model"`
	Worker  router.WorkerID `json:"worker"`
	Key     string          `json:"key"` // the last block hash, hex
	Blocks  int             `json:"blocks"`
	TTL     float64         `json:"ttl_seconds"`
	Expires time.Time       `json:"expires"`
}

// pinRequest is a request's nvext.cache_control, parsed.
type pinRequest struct {
	ttl time.Duration
}

// pinMetrics count what pins did (kvrouter_pin*).
type pinMetrics struct {
	routed *prometheus.CounterVec
	writes *prometheus.CounterVec
}

func newPinMetrics(reg prometheus.Registerer, pr PinReplica) *pinMetrics {
	m := &pinMetrics{
		routed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_pin_routed_total",
			Help: "Requests whose prompt starts with a pinned prefix, by outcome: holder (sent to a pin's holder), moved (every holder gone: normal decision, the pin moves)."}, []string{"outcome"}),
		writes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_pin_writes_total",
			Help: "Pin writes this replica handed to Raft, by kind: pin (a new or longer prefix), refresh (a hit with less than half the TTL left), move (the holder was gone)."}, []string{"kind"}),
	}
	pins := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvrouter_pins",
		Help: "Prefix pins in the replicated state (every replica reports the same count)."},
		func() float64 { return float64(pr.PinCount()) })
	reg.MustRegister(m.routed, m.writes, pins)
	return m
}

// pinReplica returns the replica's pin support when pinning is on.
func (s *Server) pinReplica() (PinReplica, bool) {
	pr, ok := s.rep.(PinReplica)
	if !ok || !pr.PinsEnabled() {
		return nil, false
	}
	return pr, true
}

// readCacheControl parses nvext.cache_control when pinning is on (off: the
// field is not read, as Dynamo without --enable-agentic-cache-control):
// null or absent is none; otherwise an object whose type is "ephemeral"
// and whose ttl, when present, is a string such as "30s", "5m" or "1h"
// (parsePinTTL). Anything else is a 400 naming the field; nothing is
// pinned and nothing proposed.
func (s *Server) readCacheControl(raw json.RawMessage) (*pinRequest, error) {
	if _, on := s.pinReplica(); !on {
		return nil, nil
	}
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var cc struct {
		Type *string         `json:"type"`
		TTL  json.RawMessage `json:"ttl"`
	}
	if raw[0] != '{' || json.Unmarshal(raw, &cc) != nil {
		return nil, fmt.Errorf("nvext.cache_control must be an object such as {\"type\": \"ephemeral\", \"ttl\": \"5m\"}, got %s", clip(string(raw)))
	}
	if cc.Type == nil || *cc.Type != "ephemeral" {
		got := "none"
		if cc.Type != nil {
			got = strconv.Quote(clip(*cc.Type))
		}
		return nil, fmt.Errorf("nvext.cache_control.type must be \"ephemeral\", got %s", got)
	}
	ttl := DefaultPinTTL
	if t := bytes.TrimSpace(cc.TTL); len(t) > 0 && string(t) != "null" {
		var str string
		if json.Unmarshal(t, &str) != nil {
			return nil, fmt.Errorf("nvext.cache_control.ttl must be a string such as \"30s\", \"5m\" or \"1h\", got %s", clip(string(t)))
		}
		d, err := parsePinTTL(str)
		if err != nil {
			return nil, err
		}
		ttl = d
	}
	return &pinRequest{ttl: ttl}, nil
}

// parsePinTTL reads Dynamo's TTL formats: a positive whole number of
// seconds, minutes or hours ("30s", "5m", "30m", "1h"), at most MaxPinTTL.
// No fractions, no compound durations, no bare numbers: Dynamo documents
// none, and a client that sends one means something we would guess.
func parsePinTTL(s string) (time.Duration, error) {
	bad := func() (time.Duration, error) {
		return 0, fmt.Errorf("nvext.cache_control.ttl must be a whole number of seconds, minutes or hours from 1s to %s (\"30s\", \"5m\", \"1h\"), got %q",
			"1h", clip(s))
	}
	if len(s) < 2 || len(s) > 8 {
		return bad()
	}
	var unit time.Duration
	switch s[len(s)-1] {
	case 's':
		unit = time.Second
	case 'm':
		unit = time.Minute
	case 'h':
		unit = time.Hour
	default:
		return bad()
	}
	digits := s[:len(s)-1]
	for _, c := range digits {
		if c < '0' || c > '9' {
			return bad()
		}
	}
	n, err := strconv.Atoi(digits)
	if err != nil || n <= 0 || time.Duration(n) > MaxPinTTL/unit {
		return bad()
	}
	return time.Duration(n) * unit, nil
}

// pinBlocks is the prefix a request pins: its first MaxPinBlocks hashes.
func pinBlocks(hashes []uint64) []uint64 {
	return hashes[:min(len(hashes), MaxPinBlocks)]
}

// routePinned routes a request when pinning is on: to the holders of the
// longest pinned prefix of its prompt while one can take it, else as the
// router decides; then writes what the request asks or earned (pinWrites).
// A pin is hard, like a hard session binding: busy holders answer busy,
// the request is not sent elsewhere (the pin exists to keep the prefix
// on its holders); a holder that is gone (deregistered, drained, dead,
// excluded after a failed attempt) no longer counts, and when none is
// left the normal decision places the request and the pin moves there.
func (s *Server) routePinned(pr PinReplica, p *prepared, now time.Time) (router.Decision, error) {
	match, hit := PinMatch{}, false
	if pr.PinCount() > 0 && len(p.req.Hashes) > 0 {
		match, hit = pr.PinLookup(p.model, p.req.Hashes)
	}
	p.pinned = hit || p.pin != nil
	if !hit {
		d, err := p.rt.Route(p.req, now)
		if err == nil && p.pin != nil {
			s.writePin(pr, p, d.Worker, "pin", "")
		}
		return d, err
	}
	var live []router.WorkerID
	for _, h := range match.Holders {
		if s.canServe(p, h.Worker) {
			live = append(live, h.Worker)
		}
	}
	if len(live) == 0 {
		d, err := p.rt.Route(p.req, now)
		if err == nil {
			s.movePin(pr, p, match, d.Worker)
		}
		return d, err
	}
	d, err := p.rt.Route(restrictTo(p.req, p.rt, live), now)
	if err != nil {
		return d, err
	}
	s.pinHit(pr, p, match, d.Worker)
	return d, nil
}

// movePin moves a pinned prefix whose holders are all gone to w (or pins
// the request's longer prompt there when it asks, replacing the first
// holder's pin).
func (s *Server) movePin(pr PinReplica, p *prepared, match PinMatch, w router.WorkerID) {
	s.pinMetrics.routed.WithLabelValues("moved").Inc()
	if p.pin != nil {
		s.writePin(pr, p, w, "move", match.Holders[0].Worker)
		return
	}
	h := match.Holders[0]
	s.writePinOf(pr, PinWrite{Model: p.model, Worker: w, Blocks: p.req.Hashes[:match.Depth],
		Key: match.Key, TTL: h.TTL, Replace: h.Worker}, "move")
}

// pinHit is the bookkeeping of a request routed to its prefix's holders:
// w computed the prompt; when w is a holder its pin is refreshed (or
// superseded by the request's longer prompt) as routePinned does.
func (s *Server) pinHit(pr PinReplica, p *prepared, match PinMatch, w router.WorkerID) {
	i := slices.IndexFunc(match.Holders, func(h PinHolder) bool { return h.Worker == w })
	if i < 0 {
		return // the limited stage was busy: the plan served it elsewhere
	}
	s.pinMetrics.routed.WithLabelValues("holder").Inc()
	h := match.Holders[i]
	due := time.Until(h.Until) < h.TTL/2
	switch {
	case p.pin != nil && (due || len(pinBlocks(p.req.Hashes)) >= 2*match.Depth):
		s.writePin(pr, p, w, "pin", "")
	case due:
		s.writePinOf(pr, PinWrite{Model: p.model, Worker: w, Key: match.Key, TTL: h.TTL}, "refresh")
	}
}

// writePin pins the request's prefix on w.
func (s *Server) writePin(pr PinReplica, p *prepared, w router.WorkerID, kind string, replace router.WorkerID) {
	blocks := pinBlocks(p.req.Hashes)
	if len(blocks) == 0 {
		return // nothing hashable (no tokenizer, a prompt shorter than a block)
	}
	s.writePinOf(pr, PinWrite{Model: p.model, Worker: w, Blocks: blocks, Key: blocks[len(blocks)-1], TTL: p.pin.ttl, Replace: replace}, kind)
}

func (s *Server) writePinOf(pr PinReplica, w PinWrite, kind string) {
	s.pinMetrics.writes.WithLabelValues(kind).Inc()
	pr.Pin(w)
}

// restrictTo is req restricted to the workers of only.
func restrictTo(req router.Request, rt *router.Router, only []router.WorkerID) router.Request {
	ws := rt.Workers()
	ex := slices.Clone(req.Exclude)
	for _, i := range ws {
		if !slices.Contains(only, i.ID) && !slices.Contains(ex, i.ID) {
			ex = append(ex, i.ID)
		}
	}
	req.Exclude = ex
	return req
}

// getPins is GET /pins (admin): every pin, from this replica's replicated
// state after a read barrier.
func (s *Server) getPins(c *gin.Context) {
	pr, ok := s.rep.(PinReplica)
	if !ok {
		openAIError(c, http.StatusNotFound, "not_found_error", "prefix pinning is not supported by this replica")
		return
	}
	if err := s.rep.ReadBarrier(c.Request.Context()); err != nil {
		openAIError(c, statusOf(err), "server_error", err.Error())
		return
	}
	pins := pr.Pins()
	if pins == nil {
		pins = []PinInfo{}
	}
	c.JSON(http.StatusOK, gin.H{"enabled": pr.PinsEnabled(), "count": len(pins), "pins": pins})
}

// deletePins is DELETE /pins (admin): {"model", "key"} ends a prefix's pins
// (with "worker", only on that worker's ranks), {"worker"} every pin of a
// worker. 200 {"unpinned": n} once applied; a malformed body is a 400 and
// writes nothing.
func (s *Server) deletePins(c *gin.Context) {
	pr, ok := s.rep.(PinReplica)
	if !ok {
		c.JSON(http.StatusNotFound, gin.H{"error": "prefix pinning is not supported by this replica"})
		return
	}
	var body struct {
		Model  string `json:"model"`
		Key    string `json:"key"` // hex, as GET /pins shows it
		Worker string `json:"worker"`
	}
	const want = `body must be {"model", "key" (hex, as GET /pins shows it), optional "worker"} or {"worker"}; worker ids have no '#'`
	err := c.ShouldBindJSON(&body)
	key, kerr := strconv.ParseUint(body.Key, 16, 64)
	switch {
	case err != nil, len(body.Model) > 4096, len(body.Worker) > 4096, strings.ContainsRune(body.Worker, '#'),
		body.Model == "" && (body.Worker == "" || body.Key != ""),
		body.Model != "" && (body.Key == "" || kerr != nil):
		c.JSON(http.StatusBadRequest, gin.H{"error": want})
		return
	}
	n, err := pr.Unpin(c.Request.Context(), PinUnpin{Model: body.Model, Key: key, Worker: body.Worker})
	if err != nil {
		c.JSON(statusOf(err), gin.H{"error": s.redact(err.Error())})
		return
	}
	c.JSON(http.StatusOK, gin.H{"unpinned": n})
}
