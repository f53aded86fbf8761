package main

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/eventbus"
)

// errStopped: the engine loop has ended (shutdown).
var errStopped = errors.New("engine stopped")

// driver runs the deterministic engine in real time. One goroutine (run)
// owns the engine: every access goes through a closure sent on cmds. Virtual
// time is wall time since start; the engine's Speedup only shortens steps.
//
// After every engine call that can produce KV events the loop drains them
// into the event queue at once, so the queue order is the engine's order.
type driver struct {
	eng     *engine.Engine
	start   time.Time
	speedup float64
	log     *slog.Logger
	q       *eventQueue // nil: no bus, events are counted and dropped
	host    *hostTier   // nil: no host tier (--host-tier-blocks 0)

	cmds chan func()
	done chan struct{} // closed when run returns

	// Owned by the loop goroutine.
	last    time.Duration
	waiters map[string]*waiter

	droppedNoBus atomic.Uint64 // engine events with nowhere to go (no --nats)
	engineEvents atomic.Uint64
}

func newDriver(eng *engine.Engine, q *eventQueue, log *slog.Logger) *driver {
	return &driver{
		eng:     eng,
		start:   time.Now(),
		speedup: eng.Config().Speedup,
		log:     log,
		q:       q,
		cmds:    make(chan func(), 1024),
		done:    make(chan struct{}),
		waiters: map[string]*waiter{},
	}
}

// now is the virtual time: wall time since start, never going backwards.
// Loop goroutine only.
func (d *driver) now() time.Duration {
	if t := time.Since(d.start); t > d.last {
		d.last = t
	}
	return d.last
}

// run is the engine loop; it returns when ctx ends. Requests still waiting
// are told the engine stopped.
func (d *driver) run(ctx context.Context) {
	defer close(d.done)
	defer func() {
		for id, w := range d.waiters {
			w.stop()
			delete(d.waiters, id)
		}
	}()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		wait, busy := d.settle()
		if !busy {
			wait = time.Hour
		}
		timer.Reset(wait)
		select {
		case fn := <-d.cmds:
			fn()
			// Take what else is queued, so a burst of arrivals joins one step.
			for more := true; more; {
				select {
				case fn = <-d.cmds:
					fn()
				default:
					more = false
				}
			}
		case <-timer.C:
		case <-ctx.Done():
			return
		}
		// Go ≥ 1.23 timers: Reset discards a pending expiry, no draining needed.
	}
}

// settle runs the engine up to now, hands out its outputs, starts the next
// step if one is due and returns how long until it ends (busy false: idle).
func (d *driver) settle() (time.Duration, bool) {
	for {
		now := d.now()
		d.dispatch(d.eng.Advance(now))
		next, busy := d.eng.NextEventTime() // starts a due step: may emit events and outputs
		d.drain()
		// A step's start can admit a remote-prefill request (AwaitingKV):
		// its handler must learn it now, not at the end of the step, or
		// never if the engine then has nothing to run.
		d.dispatch(d.eng.TakeOutputs())
		if !busy {
			return 0, false
		}
		if wait := next - d.now(); wait > 0 {
			return wait, true
		}
	}
}

// dispatch delivers outputs to the waiting handlers. Loop goroutine only.
func (d *driver) dispatch(outs []engine.Output) {
	if len(outs) == 0 {
		return
	}
	itl := time.Duration(d.eng.Profile().DecodeMs(d.eng.Stats().Fill) / d.speedup * float64(time.Millisecond))
	for _, o := range outs {
		w := d.waiters[o.RequestID]
		if w == nil {
			continue
		}
		w.deliver(update{out: o, itl: itl})
		if o.Kind == engine.Finished {
			delete(d.waiters, o.RequestID)
		}
	}
}

// drain moves the engine's KV events into the event queue, in order. If the
// queue is full (NATS down for long), its unpublished events are replaced by
// a full-state resync: nothing is reordered, and what the index ends up
// with is the engine's state. Loop goroutine only.
func (d *driver) drain() {
	evs := d.eng.DrainEvents()
	if len(evs) == 0 {
		return
	}
	d.engineEvents.Add(uint64(len(evs)))
	var wires []eventbus.WireEvent
	if d.host != nil {
		wires = d.host.observe(evs) // the host tier follows the engine, bus or not
	}
	if d.q == nil {
		d.droppedNoBus.Add(uint64(len(evs)))
		return
	}
	if wires == nil {
		wires = toWire(evs)
	}
	if !d.q.push(wires) {
		d.q.overflows.Add(1)
		d.log.Error("KV event queue full: replacing the unpublished events with a full-state resync (is NATS reachable?)",
			"queued", d.q.len(), "new", len(wires), "limit", d.q.max)
		d.snapshot("event queue overflow")
	}
}

// snapshot replaces the unpublished events with the engine's full state: a
// cleared event, then every cached block (parents before children). Ids are
// assigned at publish time, so they stay contiguous. Loop goroutine only.
func (d *driver) snapshot(reason string) {
	if d.q == nil {
		return
	}
	pending := d.eng.DrainEvents() // superseded by the snapshot
	d.engineEvents.Add(uint64(len(pending)))
	evs := snapshotEvents(d.eng.CachedBlocks(), d.eng.Config().BlockSize)
	if d.host != nil {
		d.host.observe(pending) // its evictions still move blocks to the host
		evs = append(evs, d.host.snapshotEvents()...)
	}
	superseded := d.q.reset(evs) + len(pending)
	d.log.Info("publishing full KV state", "reason", reason, "blocks", d.eng.Stats().CachedBlocks, "events", len(evs), "superseded", superseded)
}

// call runs fn on the loop goroutine and waits for it. errStopped: the
// loop has ended (fn did not run).
func (d *driver) call(ctx context.Context, fn func()) error {
	ran := make(chan struct{})
	select {
	case d.cmds <- func() { fn(); close(ran) }:
	case <-d.done:
		return errStopped
	case <-ctx.Done():
		return ctx.Err()
	}
	// Once queued, fn runs promptly unless the loop ends first.
	select {
	case <-ran:
		return nil
	case <-d.done:
		select {
		case <-ran:
			return nil
		default:
			return errStopped
		}
	}
}

// send queues fn for the loop without waiting for it to run.
func (d *driver) send(fn func()) {
	select {
	case d.cmds <- fn:
	case <-d.done:
	}
}

// submit queues a request; its outputs arrive on the returned waiter.
func (d *driver) submit(ctx context.Context, req engine.Request) (*waiter, error) {
	w := newWaiter()
	var err error
	if cerr := d.call(ctx, func() {
		err = d.eng.Submit(d.now(), req)
		d.drain()
		if err == nil {
			d.waiters[req.ID] = w
		}
	}); cerr != nil {
		return nil, cerr
	}
	if err != nil {
		return nil, err
	}
	return w, nil
}

// cancel aborts a request (the client went away), without waiting.
func (d *driver) cancel(id string) {
	d.send(func() {
		delete(d.waiters, id)
		if d.eng.Cancel(d.now(), id) {
			d.log.Debug("request cancelled", "request", id)
		}
		d.drain()
	})
}

// kvReceived tells the engine that a remote-prefill request's KV arrived.
// False: the request is not awaiting its KV.
func (d *driver) kvReceived(ctx context.Context, id string) (bool, error) {
	var ok bool
	err := d.call(ctx, func() {
		ok = d.eng.KVReceived(d.now(), id)
		d.drain()
	})
	return ok, err
}

// stats returns the engine's statistics.
func (d *driver) stats(ctx context.Context) (engine.Stats, error) {
	var st engine.Stats
	err := d.call(ctx, func() { st = d.eng.Stats() })
	return st, err
}

// update is one engine output for a request, with the loop's estimate of
// the time between tokens at that moment (for pacing a stream).
type update struct {
	out engine.Output
	itl time.Duration
}

// waiter collects one request's outputs. The loop never blocks on it.
type waiter struct {
	mu      sync.Mutex
	pending []update
	stopped bool
	notify  chan struct{} // cap 1
}

func newWaiter() *waiter { return &waiter{notify: make(chan struct{}, 1)} }

func (w *waiter) deliver(u update) {
	w.mu.Lock()
	w.pending = append(w.pending, u)
	w.mu.Unlock()
	w.wake()
}

func (w *waiter) stop() {
	w.mu.Lock()
	w.stopped = true
	w.mu.Unlock()
	w.wake()
}

func (w *waiter) wake() {
	select {
	case w.notify <- struct{}{}:
	default:
	}
}

// take returns the outputs delivered since the last call and whether the
// engine stopped.
func (w *waiter) take() ([]update, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := w.pending
	w.pending = nil
	return out, w.stopped
}
