package main

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/router"
)

// errLinkStopped: the link loop has ended (shutdown).
var errLinkStopped = errors.New("KV link stopped")

// kvLink is the worker's one outgoing KV link, shared by every transfer it
// sends: router.LinkState's fluid model (concurrent transfers share the
// throughput equally; past MaxConcurrent they queue) driven by the real
// clock. One goroutine (run) advances the model and wakes each sender when
// its last byte is through. The throughput is multiplied by --speedup, so
// a transfer takes 1/speedup of its simulated time, as engine steps do.
type kvLink struct {
	infinite bool // --link-mbps 0: every transfer completes at once

	mu      sync.Mutex
	state   *router.LinkState                   // mu must be held
	waiters map[string]chan router.TransferDone // by transfer id; mu must be held

	wake chan struct{} // cap 1: the model changed, recompute the next event
	done chan struct{} // closed when run returns

	sent, bytes, cancelled atomic.Uint64
	inflight               atomic.Int64 // on the link or queued for it
}

func newKVLink(mbps float64, maxTransfers int, speedup float64) *kvLink {
	l := &kvLink{
		infinite: mbps == 0,
		waiters:  map[string]chan router.TransferDone{},
		wake:     make(chan struct{}, 1),
		done:     make(chan struct{}),
	}
	l.state = router.NewLinkState(router.Link{ThroughputBytesPerS: mbps * 1e6 * speedup, MaxConcurrent: maxTransfers})
	return l
}

// run advances the link model in real time until ctx ends.
func (l *kvLink) run(ctx context.Context) {
	defer close(l.done)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		l.mu.Lock()
		// time.Now is read under mu, so the model never sees time go back.
		for _, d := range l.state.Advance(time.Now()) {
			if ch := l.waiters[d.ID]; ch != nil {
				ch <- d // cap 1, one delivery per id
				delete(l.waiters, d.ID)
			}
		}
		next, busy := l.state.NextEvent()
		l.mu.Unlock()
		wait := time.Hour
		if busy {
			wait = max(time.Until(next), 0)
		}
		timer.Reset(wait)
		select {
		case <-timer.C:
		case <-l.wake:
		case <-ctx.Done():
			return
		}
	}
}

func (l *kvLink) poke() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// send moves bytes over the link as transfer id (unique among the
// transfers in flight) and returns how long it took, queueing included.
// If ctx ends first the transfer is taken off the link, so it stops
// slowing the others down.
func (l *kvLink) send(ctx context.Context, id string, bytes int64) (time.Duration, error) {
	l.inflight.Add(1)
	defer l.inflight.Add(-1)
	if l.infinite || bytes <= 0 {
		l.count(bytes)
		return 0, nil
	}
	ch := make(chan router.TransferDone, 1)
	l.mu.Lock()
	select {
	case <-l.done:
		l.mu.Unlock()
		return 0, errLinkStopped
	default:
	}
	l.state.Start(id, bytes, time.Now())
	l.waiters[id] = ch
	l.mu.Unlock()
	l.poke()
	select {
	case d := <-ch:
		l.count(bytes)
		return d.Duration(), nil
	case <-ctx.Done():
		l.mu.Lock()
		delete(l.waiters, id)
		l.state.Cancel(id, time.Now())
		l.mu.Unlock()
		l.poke()
		l.cancelled.Add(1)
		return 0, ctx.Err()
	case <-l.done:
		return 0, errLinkStopped
	}
}

func (l *kvLink) count(bytes int64) {
	l.sent.Add(1)
	l.bytes.Add(uint64(max(bytes, 0)))
}

// peak is the most transfers that have moved bytes at once.
func (l *kvLink) peak() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.state.Peak()
}
