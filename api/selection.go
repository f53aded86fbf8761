package api

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/router"
)

// Dynamo's standalone selection API (its docs/components/router/
// standalone-selection.md): for callers with their own proxy, who ask which
// worker should serve a prompt they hashed themselves and report the
// request's lifecycle. Every replica serves it over the shared index;
// reservations are bookings like a proxied request's, announced to the
// other replicas (replica sync), and expire after Config.ReservationTTL
// when nobody releases them.
//
//	POST   /select                                  choose, book nothing
//	POST   /select_and_reserve                      choose and book at once
//	POST   /reservations                            book a worker chosen by /select
//	POST   /reservations/{selection_id}/prefill_complete
//	POST   /reservations/{selection_id}/output_block   one more block of output
//	DELETE /reservations/{selection_id}             release

// selectRequest is the body of /select and /select_and_reserve (and, with
// the worker named, of /reservations).
type selectRequest struct {
	SelectionID  string `json:"selection_id"`
	ModelName    string `json:"model_name"`
	RoutingGroup string `json:"routing_group"`
	// BlockHashes are the prompt's local block hashes, SequenceHashes the
	// chained ones the index is keyed by (derived from BlockHashes when
	// absent, as the engines chain them).
	BlockHashes    []uint64 `json:"block_hashes"`
	SequenceHashes []uint64 `json:"sequence_hashes"`
	IslTokens      int      `json:"isl_tokens"`
	// /reservations only.
	WorkerID               json.RawMessage `json:"worker_id"`
	DPRank                 *int            `json:"dp_rank"`
	EffectivePrefillTokens *int            `json:"effective_prefill_tokens"`
}

// selectResponse is Dynamo's selection shape.
type selectResponse struct {
	SelectionID            string          `json:"selection_id,omitempty"`
	ModelName              string          `json:"model_name"`
	RoutingGroup           string          `json:"routing_group"`
	WorkerID               json.RawMessage `json:"worker_id"`
	DPRank                 int             `json:"dp_rank"`
	Endpoint               string          `json:"endpoint"`
	BlockSize              int             `json:"block_size"`
	Overlap                selectOverlap   `json:"overlap"`
	EffectivePrefillTokens int             `json:"effective_prefill_tokens"`
}

// selectOverlap is matched tokens, cumulative by tier as Dynamo's (and
// Mooncake's) tier breakdown: gpu ⊆ cpu ⊆ disk; longest_matched the
// deepest; dp the gpu match of each rank of the chosen engine.
type selectOverlap struct {
	LongestMatched int            `json:"longest_matched"`
	GPU            int            `json:"gpu"`
	DP             map[string]int `json:"dp"`
	CPU            int            `json:"cpu"`
	Disk           int            `json:"disk"`
}

// defaultGroup is Dynamo's name for the one routing group a model has here.
const defaultGroup = "default"

// maxSelectionHashes bounds a prompt's blocks (a million tokens at 16 per block).
const maxSelectionHashes = 1 << 16

// maxSelectionID bounds a selection id (it names a booking on every replica).
const maxSelectionID = 256

// reservations are the bookings made through the selection API, by
// selection id, each with its expiry timer.
type reservations struct {
	mu      sync.Mutex
	byID    map[string]*reservation
	expired prometheus.Counter
}

type reservation struct {
	p     *prepared
	timer *time.Timer
}

func newReservations(reg prometheus.Registerer) *reservations {
	r := &reservations{byID: make(map[string]*reservation),
		expired: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_reservations_expired_total",
			Help: "Selection API reservations freed by their TTL, never released by the caller."})}
	reg.MustRegister(r.expired)
	return r
}

// selectionError answers a selection API error as the other JSON
// endpoints do.
func selectionError(c *gin.Context, status int, msg string) {
	c.AbortWithStatusJSON(status, gin.H{"error": msg})
}

// readSelection parses and checks a selection body; on error it answered.
func (s *Server) readSelection(c *gin.Context) (selectRequest, *router.Router, bool) {
	var in selectRequest
	body, err := io.ReadAll(c.Request.Body)
	if err == nil {
		err = json.Unmarshal(body, &in)
	}
	if err != nil {
		selectionError(c, http.StatusBadRequest, "invalid JSON body: "+err.Error())
		return in, nil, false
	}
	if in.ModelName == "" {
		in.ModelName = defaultGroup // Dynamo's default model name
	}
	if in.RoutingGroup == "" {
		in.RoutingGroup = defaultGroup
	}
	rt, ok := s.rep.Router(in.ModelName)
	switch {
	case !ok:
		selectionError(c, http.StatusNotFound, fmt.Sprintf("model %q is not served here", in.ModelName))
	case in.RoutingGroup != defaultGroup:
		selectionError(c, http.StatusNotFound, fmt.Sprintf("routing group %q: each model has the one group %q here", in.RoutingGroup, defaultGroup))
		ok = false
	case len(in.SelectionID) > maxSelectionID:
		selectionError(c, http.StatusBadRequest, fmt.Sprintf("selection_id longer than %d bytes", maxSelectionID))
		ok = false
	case strings.Contains(in.SelectionID, "/"):
		// It is released as /reservations/{selection_id}: one path segment.
		selectionError(c, http.StatusBadRequest, "selection_id must not contain '/'")
		ok = false
	case len(in.SequenceHashes) > maxSelectionHashes || len(in.BlockHashes) > maxSelectionHashes:
		selectionError(c, http.StatusBadRequest, fmt.Sprintf("more than %d block hashes", maxSelectionHashes))
		ok = false
	case len(in.SequenceHashes) > 0 && len(in.BlockHashes) > 0 && len(in.SequenceHashes) != len(in.BlockHashes):
		selectionError(c, http.StatusBadRequest, "block_hashes and sequence_hashes must describe the same blocks")
		ok = false
	case in.IslTokens < 0 || in.IslTokens > maxSelectionHashes*1024:
		selectionError(c, http.StatusBadRequest, "isl_tokens out of range")
		ok = false
	}
	if !ok {
		return in, nil, false
	}
	if len(in.SequenceHashes) == 0 && len(in.BlockHashes) > 0 {
		in.SequenceHashes = chainHashes(in.BlockHashes)
	}
	if bs := rt.Config().BlockSize; in.IslTokens == 0 {
		in.IslTokens = len(in.SequenceHashes) * bs
	} else if in.IslTokens < len(in.SequenceHashes)*bs {
		selectionError(c, http.StatusBadRequest, fmt.Sprintf("isl_tokens %d is shorter than %d blocks of %d tokens", in.IslTokens, len(in.SequenceHashes), bs))
		return in, nil, false
	}
	return in, rt, true
}

// chainHashes derives sequence hashes from local block hashes, as the
// engines chain them (router.SeededBlockHashes).
func chainHashes(local []uint64) []uint64 {
	seq := make([]uint64, len(local))
	for i, h := range local {
		if i == 0 {
			seq[i] = h
		} else {
			seq[i] = router.ChainHash(seq[i-1], h)
		}
	}
	return seq
}

// selectionPrepared is a selection request as the proxy's prepared
// request: the same routing and bookkeeping apply to it.
func (s *Server) selectionPrepared(in selectRequest, rt *router.Router, c *gin.Context) *prepared {
	start := time.Now()
	id := in.SelectionID
	if id == "" {
		id = fmt.Sprintf("%s-%d-%d", s.rep.NodeID(), start.UnixNano(), s.reqSeq.Add(1))
	}
	return &prepared{path: c.Request.URL.Path, model: in.ModelName, rt: rt, start: start, requestID: c.GetString(requestIDKey),
		req: router.Request{ID: bookingID(id), Hashes: in.SequenceHashes, Tokens: in.IslTokens, Sequences: 1}}
}

// bookingID is a selection's id in the load view: prefixed, so a caller's
// id never collides with a proxied request's.
func bookingID(selection string) string { return "sel:" + selection }

// selectWorker answers POST /select: the routing decision, nothing booked.
func (s *Server) selectWorker(c *gin.Context) {
	in, rt, ok := s.readSelection(c)
	if !ok {
		return
	}
	p := s.selectionPrepared(in, rt, c)
	d, err := s.decideSelection(p, time.Now())
	if err != nil {
		s.selectionRefused(c, err)
		return
	}
	s.answerSelection(c, in, p, d, d.Worker)
}

// decideSelection is /select's decision: among a pinned prefix's live
// holders when the prompt's sequence hashes start with one (pins.go: the
// same lookup a proxied request makes; hard, so busy holders answer busy),
// else the router's. Read-only: nothing is booked, so no pin is written
// (a pin whose holders are all gone moves when a request or a
// /select_and_reserve is placed, not on a question). Dynamo's selection
// body carries no session and no cache_control, so neither binds nor pins.
func (s *Server) decideSelection(p *prepared, now time.Time) (router.Decision, error) {
	if pr, on := s.pinReplica(); on && pr.PinCount() > 0 && len(p.req.Hashes) > 0 {
		if match, hit := pr.PinLookup(p.model, p.req.Hashes); hit {
			var live []router.WorkerID
			for _, h := range match.Holders {
				if s.canServe(p, h.Worker) {
					live = append(live, h.Worker)
				}
			}
			if len(live) > 0 {
				return p.rt.Decide(restrictTo(p.req, p.rt, live), now)
			}
		}
	}
	return p.rt.Decide(p.req, now)
}

// selectAndReserve answers POST /select_and_reserve: chosen and booked in
// one step (the proxy's routeAndBook), through the model's admission queue.
func (s *Server) selectAndReserve(c *gin.Context) {
	in, rt, ok := s.readSelection(c)
	if !ok {
		return
	}
	p := s.selectionPrepared(in, rt, c)
	// Claimed first: two bookings under one id would share one entry of
	// the load view, and freeing one would free the other.
	if !s.resv.claim(p.req.ID) {
		selectionError(c, http.StatusConflict, "selection_id "+strings.TrimPrefix(p.req.ID, "sel:")+" is reserved already")
		return
	}
	if !s.admit(c, p) {
		s.resv.unclaim(p.req.ID)
		return
	}
	defer p.settled()
	d, booked, err := s.routeAndBook(c.Request.Context(), p)
	if err != nil {
		s.resv.unclaim(p.req.ID)
		s.selectionRefused(c, err)
		return
	}
	<-booked // the other replicas hear of the booking before anything later about it (release, Freed)
	s.resv.add(p, s.cfg.ReservationTTL, s.expireReservation)
	s.answerSelection(c, in, p, d, d.Worker)
}

func (s *Server) selectionRefused(c *gin.Context, err error) {
	switch {
	case errors.Is(err, router.ErrAllBusy):
		selectionError(c, s.cfg.BusyStatus, err.Error())
	default:
		selectionError(c, http.StatusServiceUnavailable, err.Error())
	}
}

// answerSelection writes Dynamo's selection shape for worker w of d.
func (s *Server) answerSelection(c *gin.Context, in selectRequest, p *prepared, d router.Decision, w router.WorkerID) {
	bs := p.rt.Config().BlockSize
	base, _, _ := strings.Cut(string(w), "#")
	rank, _ := s.rep.DPRank(w)
	url, _ := s.rep.WorkerURL(w)
	out := selectResponse{SelectionID: in.SelectionID, ModelName: in.ModelName, RoutingGroup: in.RoutingGroup,
		WorkerID: workerIDJSON(base), DPRank: rank, Endpoint: url, BlockSize: bs, Overlap: selectOverlap{DP: map[string]int{}}}
	if c.Request.URL.Path == "/select_and_reserve" && in.SelectionID == "" {
		out.SelectionID = strings.TrimPrefix(p.req.ID, "sel:") // the generated id the caller releases with
	}
	for _, r := range d.Rows {
		rb, _, _ := strings.Cut(string(r.Worker), "#")
		if rb != base {
			continue
		}
		if rr, ok := s.rep.DPRank(r.Worker); ok {
			out.Overlap.DP[strconv.Itoa(rr)] = r.Overlap * bs
		}
		if r.Worker == w {
			out.Overlap.GPU = r.Overlap * bs
			out.Overlap.CPU = (r.Overlap + r.HostOverlap) * bs
			out.Overlap.Disk = (r.Overlap + r.HostOverlap + r.DiskOverlap) * bs
			out.Overlap.LongestMatched = out.Overlap.Disk
			out.EffectivePrefillTokens = max(p.req.Tokens-r.Overlap*bs, 0) // what routeAndBook books
		}
	}
	if len(out.Overlap.DP) == 0 {
		out.Overlap.DP[strconv.Itoa(rank)] = out.Overlap.GPU
	}
	c.JSON(http.StatusOK, out)
}

// workerIDJSON is a worker id in Dynamo's shape: a number when the id is
// one (Dynamo's worker ids are integers), else a string.
func workerIDJSON(id string) json.RawMessage {
	if _, err := strconv.ParseUint(id, 10, 64); err == nil {
		return json.RawMessage(id)
	}
	b, _ := json.Marshal(id)
	return b
}

// workerOf resolves a /reservations body's worker_id and dp_rank to one of
// rt's workers.
func (s *Server) workerOf(rt *router.Router, raw json.RawMessage, rank *int) (router.WorkerID, bool) {
	var id string
	if err := json.Unmarshal(raw, &id); err != nil {
		var n json.Number
		if err := json.Unmarshal(raw, &n); err != nil {
			return "", false
		}
		id = n.String()
	}
	for _, w := range rt.Workers() {
		base, _, _ := strings.Cut(string(w.ID), "#")
		if base != id {
			continue
		}
		r, ranked := s.rep.DPRank(w.ID)
		if !ranked || rank == nil || *rank == r {
			return w.ID, true
		}
	}
	return "", false
}

// reserve answers POST /reservations: books a worker the caller chose with
// /select, as routeAndBook would have (with the caller's
// effective_prefill_tokens when given), here and on the other replicas.
func (s *Server) reserve(c *gin.Context) {
	in, rt, ok := s.readSelection(c)
	if !ok {
		return
	}
	if in.SelectionID == "" {
		selectionError(c, http.StatusBadRequest, "selection_id is required")
		return
	}
	w, ok := s.workerOf(rt, in.WorkerID, in.DPRank)
	if !ok {
		selectionError(c, http.StatusNotFound, fmt.Sprintf("no worker %s (dp_rank %v) serves model %q", in.WorkerID, in.DPRank, in.ModelName))
		return
	}
	p := s.selectionPrepared(in, rt, c)
	prefill := p.req.Tokens
	if in.EffectivePrefillTokens != nil {
		if *in.EffectivePrefillTokens < 0 || *in.EffectivePrefillTokens > p.req.Tokens {
			selectionError(c, http.StatusBadRequest, "effective_prefill_tokens must be within [0, isl_tokens]")
			return
		}
		prefill = *in.EffectivePrefillTokens
	} else if d, err := rt.Decide(router.Request{ID: p.req.ID, Hashes: p.req.Hashes, Tokens: p.req.Tokens}, time.Now()); err == nil {
		for _, r := range d.Rows {
			if r.Worker == w {
				prefill = max(p.req.Tokens-r.Overlap*rt.Config().BlockSize, 0)
			}
		}
	}
	if !s.resv.claim(p.req.ID) {
		selectionError(c, http.StatusConflict, "selection_id "+in.SelectionID+" is reserved already")
		return
	}
	b := router.Booking{ID: p.req.ID, Worker: w, Hashes: rt.Config().ActiveHashes(p.req), PrefillTokens: prefill,
		Sequences: 1, Added: p.start, PromptTokens: p.req.Tokens}
	rt.Load().Add(b)
	s.rep.Booked(p.model, router.Booking{ID: b.ID, Worker: w, Hashes: b.Hashes, PrefillTokens: prefill, Sequences: 1, Added: p.start})
	s.resv.add(p, s.cfg.ReservationTTL, s.expireReservation)
	c.JSON(http.StatusCreated, gin.H{"selection_id": in.SelectionID, "model_name": in.ModelName, "routing_group": in.RoutingGroup,
		"worker_id": workerIDJSON(strings.SplitN(string(w), "#", 2)[0]), "dp_rank": in.DPRank, "effective_prefill_tokens": prefill})
}

// prefillComplete answers POST /reservations/{id}/prefill_complete.
func (s *Server) prefillComplete(c *gin.Context) {
	p, ok := s.resv.get(bookingID(c.Param("id")))
	if !ok {
		selectionError(c, http.StatusNotFound, "no reservation "+c.Param("id"))
		return
	}
	p.rt.PrefillDoneAt(p.req.ID, time.Now())
	s.rep.PrefillDone(p.model, p.req.ID)
	c.JSON(http.StatusOK, gin.H{"selection_id": c.Param("id"), "prefill_complete": true})
}

// outputBlock answers POST /reservations/{id}/output_block: the request
// generated one more block of output (Dynamo's output-block tracking,
// --router-track-output-blocks: a no-op without it). Dynamo's optional
// decay_fraction must lie in [0, 1]; the decay itself follows the router's
// rule (the expected output the request was booked with), as for a proxied
// request. Announced to the other replicas once per block, as the proxy's
// output progress is (Dynamo keeps it local).
func (s *Server) outputBlock(c *gin.Context) {
	var in struct {
		DecayFraction *float64 `json:"decay_fraction"`
	}
	if body, err := io.ReadAll(c.Request.Body); err != nil || (len(body) > 0 && json.Unmarshal(body, &in) != nil) {
		selectionError(c, http.StatusBadRequest, "invalid JSON body")
		return
	}
	if f := in.DecayFraction; f != nil && !(*f >= 0 && *f <= 1) {
		selectionError(c, http.StatusBadRequest, "decay_fraction must be within [0, 1]")
		return
	}
	p, ok := s.resv.get(bookingID(c.Param("id")))
	if !ok {
		selectionError(c, http.StatusNotFound, "no reservation "+c.Param("id"))
		return
	}
	s.resv.mu.Lock() // p.generated: one reservation's blocks may be reported concurrently
	s.generated(p, p.rt.Config().BlockSize)
	tokens := p.generated
	s.resv.mu.Unlock()
	c.JSON(http.StatusOK, gin.H{"selection_id": c.Param("id"), "output_tokens": tokens})
}

// release answers DELETE /reservations/{id}: the booking freed here and on
// the other replicas.
func (s *Server) release(c *gin.Context) {
	p, ok := s.resv.take(bookingID(c.Param("id")))
	if !ok {
		selectionError(c, http.StatusNotFound, "no reservation "+c.Param("id"))
		return
	}
	s.free(p)
	s.tenantEnd(p) // counted in flight since its admission (wait)
	c.JSON(http.StatusOK, gin.H{"selection_id": c.Param("id"), "released": true})
}

// expireReservation frees a reservation its TTL ran out on.
func (s *Server) expireReservation(id string) {
	p, ok := s.resv.take(id)
	if !ok {
		return // released meanwhile
	}
	s.resv.expired.Inc()
	s.log.Warn("selection reservation expired unreleased: freed", "selection_id", strings.TrimPrefix(id, "sel:"),
		"model", p.model, "ttl", s.cfg.ReservationTTL)
	s.free(p)
	s.tenantEnd(p)
}

// unclaim gives up a claim that did not become a reservation.
func (r *reservations) unclaim(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if v, ok := r.byID[id]; ok && v.p == nil {
		delete(r.byID, id)
	}
}

// claim holds id for a reservation being made (false: taken).
func (r *reservations) claim(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.byID[id]; ok {
		return false
	}
	r.byID[id] = &reservation{}
	return true
}

// add turns p's claim into its reservation, expiring after ttl.
func (r *reservations) add(p *prepared, ttl time.Duration, expire func(id string)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	id := p.req.ID
	r.byID[id] = &reservation{p: p, timer: time.AfterFunc(ttl, func() { expire(id) })}
}

func (r *reservations) get(id string) (*prepared, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	v, ok := r.byID[id]
	if !ok || v.p == nil {
		return nil, false
	}
	return v.p, true
}

// take removes a reservation and stops its timer.
func (r *reservations) take(id string) (*prepared, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	v, ok := r.byID[id]
	if !ok || v.p == nil {
		return nil, false
	}
	delete(r.byID, id)
	v.timer.Stop()
	return v.p, true
}
