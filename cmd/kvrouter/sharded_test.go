package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// ledger publishes chained KV events for a few workers through the
// replicas' embedded NATS and knows, per worker, how many blocks it
// published and the last event id acknowledged, so a test can check that
// every replica holds exactly that. Like kvmock it serves resync requests
// by republishing its whole chain after a cleared event.
type ledger struct {
	t    *testing.T
	nc   *nats.Conn
	mu   sync.Mutex
	sent map[string]int    // worker → blocks published (a chain of that length)
	ack  map[string]uint64 // worker → highest acknowledged event id
	pubs map[string]*eventbus.Publisher
}

func newLedger(t *testing.T, reps []*testReplica, workers []string) *ledger {
	t.Helper()
	var urls []string
	for _, r := range reps {
		urls = append(urls, "nats://"+r.cfg.NATSAddr)
	}
	nc, err := eventbus.Connect(strings.Join(urls, ","), "test-ledger", slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	l := &ledger{t: t, nc: nc, sent: map[string]int{}, ack: map[string]uint64{}, pubs: map[string]*eventbus.Publisher{}}
	for _, w := range workers {
		p, err := eventbus.NewPublisher(nc, w, 0, eventbus.WithWindow(64), eventbus.WithOnAck(func(a eventbus.PublishAck) {
			l.mu.Lock()
			l.ack[w] = max(l.ack[w], a.EventID)
			l.mu.Unlock()
		}))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Close() })
		l.pubs[w] = p
		sub, err := eventbus.ServeResync(nc, w, nil, func(eventbus.ResyncRequest) eventbus.ResyncReply {
			l.mu.Lock()
			n := l.sent[w]
			l.mu.Unlock()
			next := p.NextEventID()
			go l.republish(w, n)
			return eventbus.ResyncReply{Accepted: true, NextEventID: next}
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sub.Unsubscribe() })
	}
	return l
}

func ledgerHash(w string, i int) uint64 {
	return uint64(i+1)<<16 | uint64(len(w))<<8 | uint64(w[len(w)-1])
}

func (l *ledger) republish(w string, n int) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p := l.pubs[w]
	_, _ = p.PublishAsync(ctx, eventbus.WireEvent{Kind: uint8(router.EventCleared)})
	var blocks []eventbus.WireBlock
	for i := range n {
		blocks = append(blocks, eventbus.WireBlock{Engine: ledgerHash(w, i), Content: ledgerHash(w, i)})
	}
	for len(blocks) > 0 {
		part := blocks[:min(len(blocks), 512)]
		blocks = blocks[len(part):]
		_, _ = p.PublishAsync(ctx, eventbus.WireEvent{Kind: uint8(router.EventStored), BlockSize: 16, Blocks: part})
	}
}

// publish extends w's chain by n blocks, one event each.
func (l *ledger) publish(ctx context.Context, w string, n int) {
	l.mu.Lock()
	from := l.sent[w]
	l.mu.Unlock()
	for i := from; i < from+n && ctx.Err() == nil; i++ {
		ev := eventbus.WireEvent{Kind: uint8(router.EventStored), BlockSize: 16,
			Blocks: []eventbus.WireBlock{{Engine: ledgerHash(w, i), Content: ledgerHash(w, i)}}}
		if i > 0 {
			ev.HasParent, ev.Parent = true, ledgerHash(w, i-1)
		}
		l.mu.Lock()
		l.sent[w] = i + 1
		l.mu.Unlock()
		if _, err := l.pubs[w].PublishAsync(ctx, ev); err != nil {
			l.t.Logf("publish %s #%d: %v", w, i, err)
			return
		}
	}
}

func (l *ledger) sentOf(w string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.sent[w]
}

func (l *ledger) acked(w string) uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.ack[w]
}

// flush waits until every publisher's events are resolved.
func (l *ledger) flush(ctx context.Context) {
	for _, p := range l.pubs {
		if err := p.Flush(ctx); err != nil {
			l.t.Logf("flush: %v", err)
		}
	}
}

// agree waits until every replica holds every worker's whole chain (not
// stale, the acknowledged events applied) and all replicas' digests, of
// every Raft group, are equal.
func (l *ledger) agree(reps []*testReplica, wait time.Duration) {
	l.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	l.flush(ctx)
	poll.Until(l.t, wait, 50*time.Millisecond, func() error {
		var digests []string
		for _, r := range reps {
			s, err := status(r.url())
			if err != nil {
				return err
			}
			l.mu.Lock()
			held := map[string]bool{}
			for _, w := range s.Workers {
				if _, ours := l.sent[w.ID]; !ours {
					continue
				}
				held[w.ID] = true
				rk := w.Ranks[0]
				if rk.LastEventID < l.ack[w.ID] || rk.Blocks != l.sent[w.ID] || rk.Stale != "" {
					// Formatted before unlocking: the publishers' ack
					// callbacks write l.ack under l.mu.
					err := fmt.Errorf("%s: %s at event %d of %d acked, %d of %d blocks (stale %q)", r.cfg.NodeID, w.ID, rk.LastEventID, l.ack[w.ID], rk.Blocks, l.sent[w.ID], rk.Stale)
					l.mu.Unlock()
					return err
				}
			}
			for w := range l.sent {
				if !held[w] {
					l.mu.Unlock()
					return fmt.Errorf("%s does not list worker %s", r.cfg.NodeID, w)
				}
			}
			l.mu.Unlock()
			d := s.Digest
			for _, g := range s.Groups {
				d += "," + g.Digest
			}
			digests = append(digests, d)
		}
		for _, d := range digests[1:] {
			if d != digests[0] {
				return fmt.Errorf("digests differ: %v", digests)
			}
		}
		return nil
	})
}

// adminJSON posts body to base+path and decodes the 200 answer into out.
func adminJSON(t *testing.T, base, path, body string, out any) {
	t.Helper()
	resp, err := http.Post(base+path, "application/json", bytes.NewBufferString(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST %s %s: %d %s", path, body, resp.StatusCode, b)
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			t.Fatalf("POST %s: %v: %s", path, err, b)
		}
	}
}

// TestServeShardedGrow adds a data group to a running sharded cluster
// (issue 19: "a group added"): four workers in two groups, every replica
// restarted one at a time with a third group, the count raised, the
// workers rebalanced; no block is lost and every group agrees, and a
// replica still running two groups would not be ready.
func TestServeShardedGrow(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas, rolling restarts")
	}
	reps := newTestCluster(t, func(c *serveConfig) {
		c.RaftGroups = 2
	})
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(reps); return err })
	workers := []string{"g-a", "g-b", "g-c", "g-d"}
	registerTestWorkers(t, reps[0].url(), workers)
	l := newLedger(t, reps, workers)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for _, w := range workers {
		l.publish(ctx, w, 50)
	}
	l.agree(reps, 60*time.Second)

	// Growing before every replica runs the third group is refused.
	resp, err := http.Post(reps[0].url()+"/cluster/raft_groups", "application/json", bytes.NewBufferString(`{"groups":3}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("growing to 3 groups while every replica runs 2: %d, want 400", resp.StatusCode)
	}
	for _, r := range reps {
		r.stop()
		r.cfg.RaftGroups = 3
		r.start()
		poll.Until(t, 60*time.Second, 100*time.Millisecond, func() error {
			resp, err := http.Get(r.url() + "/ready")
			if err != nil {
				return err
			}
			resp.Body.Close()
			if resp.StatusCode != 200 {
				return fmt.Errorf("%s not ready: %d", r.cfg.NodeID, resp.StatusCode)
			}
			return nil
		})
		for _, w := range workers {
			l.publish(ctx, w, 10) // events keep coming through the restarts
		}
	}
	var grown struct{ Groups, Running int }
	poll.Until(t, 30*time.Second, 200*time.Millisecond, func() error { // the new groups' leaders
		resp, err := http.Post(reps[1].url()+"/cluster/raft_groups", "application/json", bytes.NewBufferString(`{"groups":3}`))
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 200 {
			return fmt.Errorf("grow: %d %s", resp.StatusCode, b)
		}
		return json.Unmarshal(b, &grown)
	})
	if grown.Groups != 3 {
		t.Fatalf("after growing: %+v", grown)
	}
	var rb struct {
		Moves []struct {
			Worker   string
			From, To int
		}
	}
	adminJSON(t, reps[2].url(), "/workers/rebalance", `{}`, &rb)
	t.Logf("rebalance: %+v", rb.Moves)
	if len(rb.Moves) == 0 {
		t.Fatal("rebalancing 2+2 workers over three groups moved none")
	}
	for _, w := range workers {
		l.publish(ctx, w, 20)
	}
	l.agree(reps, 60*time.Second)
	s, err := status(reps[0].url())
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Groups) != 3 {
		t.Fatalf("status lists %d groups after growing to 3", len(s.Groups))
	}
	for _, g := range s.Groups {
		if g.Workers < 1 || g.Workers > 2 {
			t.Fatalf("after rebalancing, group %d holds %d workers: %+v", g.Group, g.Workers, s.Groups)
		}
	}
}

// TestServeShardedRoutesThroughMove routes continuously on every replica
// while a worker moves between data groups, and never sees the worker's
// overlap with a prompt it holds drop: reads take a moving worker from the
// group it comes from until every replica applied the whole copy in the
// new one (moves.go). The worker holds the prompt's blocks among a few
// thousand others, so the copy takes several Raft entries and the new
// group holds a partial copy for a while; it moves from group 1 to group
// 2, the later of the two in the merged view.
func TestServeShardedRoutesThroughMove(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas, three Raft groups each")
	}
	reps := newTestCluster(t, func(c *serveConfig) {
		c.RaftGroups = 2
	})
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(reps); return err })
	registerTestWorkers(t, reps[0].url(), []string{"mv-a", "mv-b"})
	var mover string
	poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
		s, err := status(reps[0].url())
		if err != nil {
			return err
		}
		for _, w := range s.Workers {
			if w.Group == 1 {
				mover = w.ID
				return nil
			}
		}
		return fmt.Errorf("no worker in group 1: %+v", s.Workers)
	})

	// The prompt's block hashes, as the replicas compute them.
	prompt := strings.Repeat("a prompt the moving worker holds in its cache ", 60)
	body, _ := json.Marshal(map[string]any{"model": "kvmock", "prompt": prompt, "max_tokens": 1})
	var tok struct{ Tokens []uint32 }
	adminJSON(t, reps[0].url(), "/tokenize", string(body), &tok)
	hashes := router.SaltedSequenceHashes(tok.Tokens, 16, "", "")
	if len(hashes) < 24 {
		t.Fatalf("the prompt makes %d blocks", len(hashes))
	}

	// The worker's cache: the prompt's chain, then 8 × 4,000 other blocks
	// of random hashes. The copy goes by content hash, eventbus.
	// DefaultMaxBlocks an entry, so the prompt's blocks are spread over
	// several entries and the new group's partial copy holds some of them.
	nc, err := eventbus.Connect("nats://"+reps[0].cfg.NATSAddr, "test-mover", slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	pub, err := eventbus.NewPublisher(nc, mover, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var chainBlocks []eventbus.WireBlock
	for _, h := range hashes {
		chainBlocks = append(chainBlocks, eventbus.WireBlock{Engine: h, Content: h})
	}
	events := []eventbus.WireEvent{{Kind: uint8(router.EventStored), BlockSize: 16, Blocks: chainBlocks}}
	const fillers, perEvent = 8, 4000
	rng := rand.New(rand.NewPCG(1, 2))
	for range fillers {
		ev := eventbus.WireEvent{Kind: uint8(router.EventStored), BlockSize: 16}
		for range perEvent {
			h := rng.Uint64()
			ev.Blocks = append(ev.Blocks, eventbus.WireBlock{Engine: h, Content: h})
		}
		events = append(events, ev)
	}
	// Like kvmock, the worker answers a resync (an event lost or
	// reordered on its way in) by clearing and republishing its cache.
	sub, err := eventbus.ServeResync(nc, mover, nil, func(eventbus.ResyncRequest) eventbus.ResyncReply {
		next := pub.NextEventID()
		go func() {
			_, _ = pub.PublishAsync(ctx, eventbus.WireEvent{Kind: uint8(router.EventCleared)})
			for _, ev := range events {
				_, _ = pub.PublishAsync(ctx, ev)
			}
		}()
		return eventbus.ResyncReply{Accepted: true, NextEventID: next}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	for _, ev := range events {
		if _, err := pub.PublishAsync(ctx, ev); err != nil {
			t.Fatal(err)
		}
	}
	if err := pub.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	total := len(hashes) + fillers*perEvent

	// cached is the mover's cached blocks in r's routing table for the prompt.
	cached := func(base string) (int, error) {
		resp, err := http.Post(base+"/debug/route", "application/json", bytes.NewReader(body))
		if err != nil {
			return 0, err
		}
		defer resp.Body.Close()
		var doc struct {
			Workers []struct {
				Worker string `json:"worker"`
				Cached int    `json:"cached_blocks"`
			} `json:"workers"`
		}
		if resp.StatusCode != http.StatusOK {
			return 0, fmt.Errorf("/debug/route: HTTP %d", resp.StatusCode)
		}
		if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
			return 0, err
		}
		for _, w := range doc.Workers {
			if w.Worker == mover {
				return w.Cached, nil
			}
		}
		return 0, fmt.Errorf("%s is not in the routing table", mover)
	}
	// in is nil once every replica lists the mover in group g with all its blocks.
	in := func(g int) error {
		for _, r := range reps {
			var s statusDoc
			resp, err := http.Get(r.url() + "/cluster/status?digest=0") // no digests: cheap enough to poll
			if err == nil {
				err = json.NewDecoder(resp.Body).Decode(&s)
				resp.Body.Close()
			}
			if err != nil {
				return err
			}
			found := false
			for _, w := range s.Workers {
				if w.ID == mover {
					found = w.Group == g && w.Ranks[0].Blocks == total
				}
			}
			if !found {
				return fmt.Errorf("%s does not list %s in group %d with %d blocks yet", r.cfg.NodeID, mover, g, total)
			}
		}
		return nil
	}
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { return in(1) })
	for _, r := range reps {
		if n, err := cached(r.url()); err != nil || n != len(hashes) {
			t.Fatalf("%s before the move: %s has %d of the prompt's %d blocks (%v)", r.cfg.NodeID, mover, n, len(hashes), err)
		}
	}

	// Route on every replica, back to back, through the move.
	var (
		wg     sync.WaitGroup
		stop   = make(chan struct{})
		checks [3]atomic.Int64
		mu     sync.Mutex
		drops  []string
	)
	for i, r := range reps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				n, err := cached(r.url())
				if err != nil || n != len(hashes) {
					mu.Lock()
					drops = append(drops, fmt.Sprintf("%s after %d routes: %d of %d blocks (%v)", r.cfg.NodeID, checks[i].Load(), n, len(hashes), err))
					mu.Unlock()
				}
				checks[i].Add(1)
			}
		}()
	}
	var before [3]int64
	for i := range reps {
		before[i] = checks[i].Load()
	}
	moveWorker(t, reps[1].url(), mover, 2)
	poll.Until(t, 60*time.Second, 20*time.Millisecond, func() error { return in(2) })
	var during [3]int64
	for i := range reps {
		during[i] = checks[i].Load()
	}
	poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error { // a few routes after the move too
		for i := range reps {
			if checks[i].Load() < during[i]+5 {
				return fmt.Errorf("%s routed %d times since the move", reps[i].cfg.NodeID, checks[i].Load()-during[i])
			}
		}
		return nil
	})
	close(stop)
	wg.Wait()
	if len(drops) > 0 {
		t.Fatalf("routing lost the moving worker's blocks %d times, first: %s", len(drops), drops[0])
	}
	for i, r := range reps {
		if during[i] == before[i] {
			t.Fatalf("%s did not route during the move", r.cfg.NodeID)
		}
		t.Logf("%s: %d routes during the move, %d in all", r.cfg.NodeID, during[i]-before[i], checks[i].Load())
	}
}
