//go:build chaos

package chaos

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/eventbus"
)

// A ledger worker is a synthetic engine worker that publishes KV events
// through the project's own eventbus.Publisher and records every event the
// stream acknowledged. Its events are designed so that the final block
// count of the worker on a replica is a function of the events applied:
//
//	event 2k-1: Stored  [A_k, T_k]   (A_k permanent, T_k temporary)
//	event 2k  : Removed [T_k]
//
// After acknowledged events 1..n the worker holds ceil(n/2) A blocks, plus
// T if n is odd. A lost odd event shows as a missing A block, a lost even
// event or an odd event applied again after its removal as an extra T
// block; the replica's cursor must reach the last acknowledged id.
//
// Like kvmock, it serves resync requests (the leader asks after a gap):
// Cleared, then Stored with every block it holds.
type ledgerWorker struct {
	id    string
	idx   int
	log   *slog.Logger
	nc    *nats.Conn
	pub   *eventbus.Publisher
	rate  time.Duration // between events
	iso   *isolationWatch
	regTo []string
	acc   *access       // HTTPS and the admin token for registration
	renew time.Duration // registration lease renewal

	mu          sync.Mutex
	nextID      uint64            // next event id to assign
	k           int               // pairs started
	oddPending  bool              // last logical op was a store (T_k held)
	heldAfter   map[uint64]int    // event id → blocks held once it is applied
	lastAcked   uint64            // acks come in order
	acked       int               //
	failed      map[uint64]string // given up (unknown outcome)
	resyncs     []string          // reasons of resync requests served
	ackViaIso   int               // acks received through an isolated server
	ackViaIsoEx []string

	gapSkipped int  // acknowledged events inside gaps the FSM reported (skipped, repaired by resync)
	noResync   bool // refuse resync requests (self-test: a loss must stay visible)

	resyncReq atomic.Pointer[eventbus.ResyncRequest]
}

func newLedgerWorker(idx int, log *slog.Logger, rate time.Duration, iso *isolationWatch, registerTo []string, acc *access, renew time.Duration) *ledgerWorker {
	id := fmt.Sprintf("ledger-%d", idx)
	return &ledgerWorker{id: id, idx: idx, log: log.With("ledger", id), rate: rate, iso: iso, regTo: registerTo, acc: acc, renew: renew,
		nextID: 1, heldAfter: map[uint64]int{0: 0}, failed: map[uint64]string{}}
}

func blockHash(worker string, k int, temp bool) uint64 {
	h := fnv.New64a()
	fmt.Fprintf(h, "%s/%d/%v", worker, k, temp)
	return h.Sum64() | 1 // never 0
}

// heldLocked is the count after the events published so far: mu held.
func (w *ledgerWorker) heldLocked() int {
	n := w.k
	if w.oddPending {
		n++
	}
	return n
}

// connect opens the NATS connection and the publisher. The URL list is
// tried in order (not shuffled), so the caller decides which replica's NATS
// server each worker starts on: every server gets workers, and an isolated
// replica always has publishers attached.
//
// tlsConf (nil: a plaintext, anonymous bus) is the worker's own
// certificate: the bus then lets it publish kv.events.<its id> and nothing
// else, subscribe only to its resync subject and its inbox, and reply once
// to each resync request. That is all a ledger worker does: the publisher's
// acks come to the inbox (WorkerInboxPrefix, which the permissions
// require), ServeResync answers on the resync subject.
func (w *ledgerWorker) connect(urls []string, tlsConf *tls.Config) error {
	log := w.log.With("component", "nats-client")
	var secure []nats.Option
	if tlsConf != nil {
		secure = append(secure, nats.Secure(tlsConf), nats.CustomInboxPrefix(eventbus.WorkerInboxPrefix(w.id)))
	}
	nc, err := nats.Connect(strings.Join(urls, ","), append(secure,
		nats.Name("chaos-"+w.id),
		nats.DontRandomize(),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250*time.Millisecond),
		nats.Timeout(5*time.Second),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("nats disconnected", "err", err)
			}
		}),
		nats.ReconnectHandler(func(c *nats.Conn) { log.Info("nats reconnected", "url", c.ConnectedUrlRedacted()) }),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { log.Warn("nats async error", "err", err) }))...)
	if err != nil {
		return err
	}
	pub, err := eventbus.NewPublisher(nc, w.id, 0,
		eventbus.WithWindow(64),
		eventbus.WithAckTimeout(2*time.Second),
		eventbus.WithOnAck(w.onAck),
		eventbus.WithOnError(w.onError),
		eventbus.WithPublisherLogger(w.log))
	if err != nil {
		nc.Close()
		return err
	}
	if _, err := eventbus.ServeResync(nc, w.id, w.log, func(req eventbus.ResyncRequest) eventbus.ResyncReply {
		if w.noResync {
			w.mu.Lock()
			w.resyncs = append(w.resyncs, "refused: "+req.Reason)
			w.mu.Unlock()
			return eventbus.ResyncReply{Error: "this ledger worker does not republish (self-test)"}
		}
		r := req
		w.resyncReq.Store(&r)
		w.mu.Lock()
		next := w.nextID
		w.mu.Unlock()
		return eventbus.ResyncReply{Accepted: true, NextEventID: next}
	}); err != nil {
		pub.Close()
		nc.Close()
		return err
	}
	w.nc, w.pub = nc, pub
	return nil
}

func (w *ledgerWorker) onAck(a eventbus.PublishAck) {
	server := w.nc.ConnectedServerName()
	w.mu.Lock()
	defer w.mu.Unlock()
	if a.EventID > w.lastAcked {
		w.lastAcked = a.EventID
	}
	w.acked++
	if w.iso != nil && w.iso.violates(server, time.Now()) {
		w.ackViaIso++
		if len(w.ackViaIsoEx) < 5 {
			w.ackViaIsoEx = append(w.ackViaIsoEx, fmt.Sprintf("event %d acked via %s at %s", a.EventID, server, time.Now().Format("15:04:05.000")))
		}
	}
}

func (w *ledgerWorker) onError(id uint64, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.failed[id] = err.Error()
}

// register keeps the worker registered (lease renewal) until ctx ends.
func (w *ledgerWorker) register(ctx context.Context, first chan<- error) {
	spec := map[string]any{"id": w.id, "url": fmt.Sprintf("http://%s:1", hostIP), "model": ledgerModel,
		"block_size": blockSize, "total_kv_blocks": 1 << 20, "max_num_batched_tokens": 8192}
	body, _ := json.Marshal(spec)
	reported := false
	for i := 0; ctx.Err() == nil; i++ {
		var err error
		for j := range w.regTo {
			u := w.regTo[(i+j)%len(w.regTo)] + "/workers/register"
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			resp, e := w.acc.adminDo(req)
			if e == nil {
				msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					err = nil
					break
				}
				e = fmt.Errorf("%s: HTTP %d %s", u, resp.StatusCode, bytes.TrimSpace(msg))
			}
			err = e
		}
		wait := w.renew
		if err != nil {
			wait = 500 * time.Millisecond
		}
		if !reported && (err == nil || i >= 60) {
			reported = true
			first <- err
		}
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
}

// run publishes until ctx ends.
func (w *ledgerWorker) run(ctx context.Context) {
	t := time.NewTicker(w.rate)
	defer t.Stop()
	for ctx.Err() == nil {
		if req := w.resyncReq.Swap(nil); req != nil {
			w.republish(ctx, *req)
			continue
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		w.mu.Lock()
		id := w.nextID
		var ev eventbus.WireEvent
		if !w.oddPending {
			w.k++
			ev = eventbus.WireEvent{EventID: id, Kind: eventbus.KindStored, BlockSize: blockSize, Blocks: []eventbus.WireBlock{
				{Engine: blockHash(w.id, w.k, false), Content: blockHash(w.id, w.k, false)},
				{Engine: blockHash(w.id, w.k, true), Content: blockHash(w.id, w.k, true)},
			}}
			w.oddPending = true
		} else {
			ev = eventbus.WireEvent{EventID: id, Kind: eventbus.KindRemoved, BlockSize: blockSize, Removed: []uint64{blockHash(w.id, w.k, true)}}
			w.oddPending = false
		}
		w.heldAfter[id] = w.heldLocked()
		w.nextID++
		w.mu.Unlock()
		if _, err := w.pub.PublishAsync(ctx, ev); err != nil {
			if ctx.Err() == nil {
				w.log.Warn("publish refused", "event_id", id, "err", err)
			}
			// Not sent: roll back so ids stay dense.
			w.mu.Lock()
			if w.nextID == id+1 {
				w.nextID = id
				delete(w.heldAfter, id)
				if ev.Kind == eventbus.KindStored {
					w.k--
					w.oddPending = false
				} else {
					w.oddPending = true
				}
			}
			w.mu.Unlock()
			return
		}
	}
}

// republish answers a resync: Cleared, then every held block in chains of
// at most 1024.
func (w *ledgerWorker) republish(ctx context.Context, req eventbus.ResyncRequest) {
	w.mu.Lock()
	w.resyncs = append(w.resyncs, fmt.Sprintf("%s: last_event_id %d: %s", time.Now().Format("15:04:05.000"), req.LastEventID, req.Reason))
	// "gap from X to Y": events X+1..Y-1 reached the FSM after Y (or
	// never) and were skipped; those the stream had acknowledged count
	// (the ones the publisher gave up on were never acknowledged).
	var gx, gy uint64
	if _, err := fmt.Sscanf(req.Reason, "gap from %d to %d", &gx, &gy); err == nil && gy > gx+1 {
		for id := gx + 1; id < gy && id <= w.lastAcked; id++ {
			if _, gaveUp := w.failed[id]; !gaveUp {
				w.gapSkipped++
			}
		}
	}
	var blocks []eventbus.WireBlock
	for k := 1; k <= w.k; k++ {
		h := blockHash(w.id, k, false)
		blocks = append(blocks, eventbus.WireBlock{Engine: h, Content: h})
		if k == w.k && w.oddPending {
			t := blockHash(w.id, k, true)
			blocks = append(blocks, eventbus.WireBlock{Engine: t, Content: t})
		}
	}
	held := w.heldLocked()
	evs := []eventbus.WireEvent{{Kind: eventbus.KindCleared, BlockSize: blockSize}}
	var parent uint64
	for len(blocks) > 0 {
		n := min(len(blocks), 1024)
		ev := eventbus.WireEvent{Kind: eventbus.KindStored, BlockSize: blockSize, Blocks: blocks[:n]}
		if parent != 0 {
			ev.HasParent, ev.Parent = true, parent
		}
		parent = blocks[n-1].Engine
		blocks = blocks[n:]
		evs = append(evs, ev)
	}
	for i := range evs {
		evs[i].EventID = w.nextID
		w.nextID++
		w.heldAfter[evs[i].EventID] = held
	}
	w.mu.Unlock()
	w.log.Info("resync: republishing", "events", len(evs), "held", held, "reason", req.Reason)
	for _, ev := range evs {
		if _, err := w.pub.PublishAsync(ctx, ev); err != nil {
			w.log.Warn("resync publish refused", "event_id", ev.EventID, "err", err)
			return
		}
	}
}

// injectReplay publishes, outside the ledger's accounting, a Stored event
// that re-stores the worker's first temporary block under a fresh event id:
// to the checker it looks exactly like an old event applied a second time
// (self-test only).
func (w *ledgerWorker) injectReplay(ctx context.Context) error {
	w.mu.Lock()
	id := w.nextID
	w.nextID++
	w.heldAfter[id] = w.heldLocked() // the ledger does not know
	w.mu.Unlock()
	t := blockHash(w.id, 1, true)
	_, err := w.pub.PublishAsync(ctx, eventbus.WireEvent{EventID: id, Kind: eventbus.KindStored, BlockSize: blockSize,
		Blocks: []eventbus.WireBlock{{Engine: t, Content: t}}})
	return err
}

// ledgerSummary is what the checks need of one worker after Flush.
type ledgerSummary struct {
	Worker        string            `json:"worker"`
	Published     uint64            `json:"last_published"`
	LastAcked     uint64            `json:"last_acked"`
	Acked         int               `json:"acked"`
	ExpectedHeld  int               `json:"expected_blocks"` // after the last acknowledged event
	HeldRange     [2]int            `json:"held_range"`      // over unacknowledged tails
	Failed        map[uint64]string `json:"failed,omitempty"`
	Resyncs       []string          `json:"resyncs,omitempty"`
	AckViaIso     int               `json:"acks_via_isolated_server"`
	AckViaIsoEx   []string          `json:"acks_via_isolated_examples,omitempty"`
	GapSkipped    int               `json:"acked_events_skipped_in_gaps"`
	PublisherStat eventbus.PublisherStats
}

func (w *ledgerWorker) summary() ledgerSummary {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := ledgerSummary{Worker: w.id, Published: w.nextID - 1, LastAcked: w.lastAcked, Acked: w.acked,
		ExpectedHeld: w.heldAfter[w.lastAcked], Resyncs: append([]string(nil), w.resyncs...),
		AckViaIso: w.ackViaIso, AckViaIsoEx: append([]string(nil), w.ackViaIsoEx...), GapSkipped: w.gapSkipped}
	s.HeldRange = [2]int{s.ExpectedHeld, s.ExpectedHeld}
	for id := w.lastAcked; id <= s.Published; id++ {
		h := w.heldAfter[id]
		s.HeldRange[0], s.HeldRange[1] = min(s.HeldRange[0], h), max(s.HeldRange[1], h)
	}
	if len(w.failed) > 0 {
		s.Failed = map[uint64]string{}
		for k, v := range w.failed {
			s.Failed[k] = v
		}
	}
	if w.pub != nil {
		s.PublisherStat = w.pub.Stats()
	}
	return s
}

// isolationWatch knows which NATS servers are cut off, and since when: an
// ack received through such a server (after a grace for acks already on
// the wire) breaks "an isolated replica acknowledges no stream message".
type isolationWatch struct {
	mu    sync.Mutex
	since map[string]time.Time // server name (node id) → isolated since
	grace time.Duration
}

func newIsolationWatch() *isolationWatch {
	return &isolationWatch{since: map[string]time.Time{}, grace: 300 * time.Millisecond}
}

func (w *isolationWatch) set(server string, on bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if on {
		w.since[server] = time.Now()
	} else {
		delete(w.since, server)
	}
}

func (w *isolationWatch) violates(server string, at time.Time) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	t, ok := w.since[server]
	return ok && at.Sub(t) > w.grace
}
