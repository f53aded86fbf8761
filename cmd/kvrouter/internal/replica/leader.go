package replica

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/router"
)

// The leader's duties. cluster.Node runs lead while this replica leads
// (WhileLeader) and cancels its context when leadership ends; resync runs
// on the leader when the FSM reports a stale rank (onChange). Followers do
// none of this: they apply what the leader commits.

// lead runs on the control group's leader: the clock tick, the inference
// pool's registrations (pool.go) and, unless the index is sharded, the KV
// event consumer.
func (r *replica) lead(ctx context.Context) {
	if r.pool != nil {
		go r.syncPool(ctx)
	}
	r.leadGroup(ctx, r.control())
}

// leadGroup runs on group g's leader only: its clock tick and, when g owns
// workers, its KV event consumer.
func (r *replica) leadGroup(ctx context.Context, g *dataGroup) {
	log := r.log
	if g.id > 0 {
		log = log.With("group", g.id)
	}
	if r.sharded() && g.id == 0 {
		// The control group owns no workers: nothing to ingest.
		log.Info("leading the control group: ticks only")
		r.tick(ctx, g)
		return
	}
	log.Info("leading: starting event ingest and ticks")
	go r.tick(ctx, g)
	go r.watchDrains(ctx, g) // workerdrain.go: completes drains of g's workers
	replicas := streamReplicas(r.cfg)
	for ctx.Err() == nil {
		if err := r.consume(ctx, g, replicas); err != nil && ctx.Err() == nil {
			log.Warn("event ingest stopped; restarting", "err", err)
			select {
			case <-ctx.Done():
			case <-time.After(ingestRestartDelay):
			}
		}
	}
	log.Info("no longer leading: event ingest stopped")
}

// consume ensures g's stream (replicas copies: KV_EVENTS unsharded, else
// KV_EVENTS_G<g> over the subjects of g's placed workers, kept up to date
// while it runs) and runs the durable consumer until ctx ends or it fails;
// each batch is acked only after applyEvents committed it.
func (r *replica) consume(ctx context.Context, g *dataGroup, replicas int) error {
	opts := r.streamOptions(g, replicas)
	if _, err := eventbus.EnsureStream(ctx, r.bus.JetStream(), opts); err != nil {
		return fmt.Errorf("kv event stream: %w", err)
	}
	cc := eventbus.ConsumerConfig{
		Validator: g, Logger: r.log.With("component", "ingest"), Registerer: r.reg,
		// One Raft entry per run of events within --max-entry-bytes.
		EntryBytes: wireEntryBytes, MaxEntryBytes: r.cfg.maxEntryBytes() - fsm.KVBatchOverhead,
		FileState: r.cfg.BusConsumerFileState,
	}
	if srv := r.bus.Server(); srv != nil && replicas > 1 {
		// The embedded server is this replica's: keep the stream's and the
		// consumer's NATS leadership on the other replicas, so the Raft
		// leader does not carry all three (eventbus/leaders.go).
		cc.SpreadFrom = srv.Name()
	}
	if r.sharded() {
		cc.Stream = opts.Name
		cc.Logger = cc.Logger.With("group", g.id)
		cc.ConstLabels = prometheus.Labels{"group": strconv.Itoa(g.id)}
	}
	cons, err := eventbus.NewConsumer(ctx, r.bus.JetStream(), cc)
	if err != nil {
		return fmt.Errorf("kv event consumer: %w", err)
	}
	if r.sharded() {
		keepCtx, stop := context.WithCancel(ctx)
		defer stop()
		go r.keepStreamSubjects(keepCtx, g, replicas, opts.Subjects)
	}
	return cons.Run(ctx, eventbus.ApplierFunc(func(ctx context.Context, evs []eventbus.WireEvent) error {
		return r.applyEvents(ctx, g, evs)
	}))
}

// streamOptions is g's stream: KV_EVENTS over every worker's subject when
// the index is not sharded, else KV_EVENTS_G<g> over its placed workers'.
func (r *replica) streamOptions(g *dataGroup, replicas int) eventbus.StreamOptions {
	o := eventbus.StreamOptions{Replicas: replicas}
	if r.sharded() {
		o.Name = eventbus.GroupStreamName(g.id)
		o.Subjects = eventbus.GroupStreamSubjects(g.id, r.streamWorkers(g))
	}
	return o
}

// keepStreamSubjects updates g's stream whenever the placement map gives
// it other workers. A newly placed worker's publisher sees "no responders"
// until then and retries the same event (eventbus/DESIGN.md): nothing it
// was acknowledged is lost, nothing is stored in a stream no one drains.
func (r *replica) keepStreamSubjects(ctx context.Context, g *dataGroup, replicas int, have []string) {
	t := time.NewTicker(streamKeeperEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-g.placed:
		case <-t.C: // a move waiting on the old group's backlog, a failed update
		}
		r.adoptMoved(ctx, g)
		opts := r.streamOptions(g, replicas)
		if slices.Equal(opts.Subjects, have) {
			continue
		}
		if _, err := eventbus.EnsureStream(ctx, r.bus.JetStream(), opts); err != nil {
			if ctx.Err() == nil {
				// The ticker tries again after the pause.
				r.log.Error("kv event stream: subjects not updated to the placement map; the new workers' events wait", "group", g.id, "err", err)
				select {
				case <-ctx.Done():
					return
				case <-time.After(ingestRestartDelay):
				}
			}
			continue
		}
		r.log.Info("kv event stream follows the placement map", "group", g.id, "stream", opts.Name, "workers", len(opts.Subjects))
		have = opts.Subjects
	}
}

// CheckWorker validates an event's worker against the registry of the
// group whose stream it came from, before anything reaches the log (the
// group is the consumer's eventbus.Validator). worker is the rank-folded
// id (router.WorkerKey).
func (g *dataGroup) CheckWorker(worker string, blockSize int) error {
	base, _, _ := strings.Cut(worker, "#")
	w, ok := g.fsm.Worker(base)
	if !ok {
		return fmt.Errorf("worker %q: %w", worker, router.ErrUnknownWorker)
	}
	if blockSize != 0 && blockSize != w.BlockSize && !(w.BlockSize == 0 && blockSize == g.fsm.BlockSize()) {
		return fmt.Errorf("worker %q: event block size %d, registered %d: %w", worker, blockSize, w.BlockSize, router.ErrBlockSizeMismatch)
	}
	return nil
}

// applyEvents commits a batch of KV events through Raft, as one entry; the
// consumer acks the stream only when this returns nil, and sized the batch
// to fit --max-entry-bytes (wireEntryBytes bounds each event's share).
func (r *replica) applyEvents(_ context.Context, g *dataGroup, events []eventbus.WireEvent) error {
	cmd, err := fsm.EncodeKVBatch(kvBatchOf(events))
	if err != nil {
		return fmt.Errorf("encode kv batch: %w", err)
	}
	if limit := r.cfg.maxEntryBytes(); len(cmd) > limit {
		// wireEntryBytes is an upper bound (fsm tests it): this is a bug,
		// and the entry must not reach the log anyway.
		return fmt.Errorf("kv batch of %d events encodes to %d bytes, over --max-entry-bytes %d", len(events), len(cmd), limit)
	}
	f := g.node.ApplyLocal(cmd, commitTimeout)
	if err := f.Error(); err != nil {
		return fmt.Errorf("commit kv batch: %w", err)
	}
	if res, ok := f.Response().(*fsm.ApplyResult); ok && res.Err != nil {
		return fmt.Errorf("apply kv batch: %w", res.Err)
	}
	return nil
}

// kvBatchOf is events in the state machine's form, to encode and drop: the
// stored blocks of all events share one allocation, and removed hashes are
// the wire events' own slices, not copies (WireEvent.KVEvent allocates per
// event; this runs for every event on the leader: issue 31).
func kvBatchOf(events []eventbus.WireEvent) []fsm.KVBatchEvent {
	n := 0
	for i := range events {
		n += len(events[i].Blocks)
	}
	blocks := make([]router.StoredBlock, n)
	batch := make([]fsm.KVBatchEvent, len(events))
	for i := range events {
		ev := &events[i]
		kv := router.KVEvent{Kind: router.EventKind(ev.Kind), HasParent: ev.HasParent, Parent: ev.Parent,
			BlockSize: ev.BlockSize, Tier: router.Tier(ev.Tier), Removed: ev.Removed}
		if len(ev.Blocks) > 0 {
			kv.Blocks, blocks = blocks[:len(ev.Blocks):len(ev.Blocks)], blocks[len(ev.Blocks):]
			for j, b := range ev.Blocks {
				kv.Blocks[j] = router.StoredBlock{EngineHash: b.Engine, ContentHash: b.Content}
			}
		}
		batch[i] = fsm.KVBatchEvent{Worker: ev.Worker, DPRank: ev.DPRank, EventID: ev.EventID, Event: kv}
	}
	return batch
}

// tick stamps the leader's clock into the log when something is due to
// expire (checked every tickEvery): predictions and worker leases expire
// deterministically on every replica, and an idle cluster's state stays
// still so digests compare equal.
func (r *replica) tick(ctx context.Context, g *dataGroup) {
	t := time.NewTicker(tickEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			if next := g.fsm.NextExpiry(); next == 0 || next > now.UnixNano() {
				continue
			}
			cmd, err := fsm.EncodeTick(fsm.Tick{Now: now.UnixNano()})
			if err == nil {
				err = r.proposeOn(ctx, g, cmd)
			}
			if err != nil && ctx.Err() == nil {
				r.log.Debug("tick", "err", err)
			}
		}
	}
}

// onChange follows replicated changes of the control group.
func (r *replica) onChange(ch fsm.Change) { r.onGroupChange(r.control(), ch) }

// onGroupChange follows replicated changes of group g: routers re-read
// workers and knobs; stale workers are resynced by g's leader; a placement
// wakes the data groups' stream keepers.
func (r *replica) onGroupChange(g *dataGroup, ch fsm.Change) {
	r.tokcheck.note(ch)
	switch ch.Kind {
	case fsm.ChangeDrain:
		// Routers drop (or take back) the worker from their candidates;
		// then the API hears of a new drain (api.DrainWatcher), so what
		// it routes for the drain never reaches the drained worker.
		r.refresh()
		if !ch.Removed && ch.Reason == "drained" {
			r.drained.notify(ch.Worker)
		}
	case fsm.ChangeWorkers, fsm.ChangeModelConfig, fsm.ChangeRestored:
		r.refresh()
		r.gaps.check(r.workers(), r.modelConfig)
		if r.sharded() && g.id > 0 {
			// A registration can complete a stream's subject list
			// (streamWorkers): every group's, since a worker leaving
			// one group completes a move into another.
			r.notePlacements()
		}
		if ch.Kind == fsm.ChangeRestored && g.id == 0 {
			r.notePlacements()
		}
	case fsm.ChangePlacement:
		r.refresh()
		r.notePlacements()
	case fsm.ChangeOverCapacity:
		r.capacity.note(ch)
	case fsm.ChangeStale:
		r.log.Warn("worker index out of step with the worker: resync", "worker", ch.Worker, "dp_rank", ch.DPRank, "reason", ch.Reason, "group", g.id)
		if g.node.IsLeader() {
			go r.resync(g, ch.Worker, ch.DPRank, ch.Reason)
		}
	}
}

// notePlacements wakes every data group's stream keeper.
func (r *replica) notePlacements() {
	for _, g := range r.groups {
		g.notePlaced()
	}
}

// resync drops the stale rank's blocks through Raft, then asks the worker
// to republish its full state. A worker that cannot (a real engine without
// our resync subject) rebuilds the index from its next events.
func (r *replica) resync(g *dataGroup, worker string, rank uint32, reason string) {
	// A stale mark replayed from the log at start-up, or one a Cleared event
	// in the same batch already ended, needs nothing.
	if _, still := g.fsm.Stale()[fsm.RankKey{Worker: worker, DPRank: rank}]; !still {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), resyncTimeout)
	defer cancel()
	cmd, err := fsm.EncodeResyncWorker(fsm.ResyncWorker{Worker: worker, DPRank: rank})
	if err == nil {
		err = r.proposeOn(ctx, g, cmd)
	}
	if err != nil {
		r.log.Error("resync: clearing the stale worker failed", "worker", worker, "err", err)
		return
	}
	reply, err := eventbus.RequestResync(ctx, r.bus.Conn(), eventbus.ResyncRequest{Worker: worker, DPRank: rank, Reason: reason})
	if err != nil || !reply.Accepted {
		r.log.Warn("resync: worker cannot republish; its blocks rebuild from new events", "worker", worker, "err", err, "reply", reply.Error)
		return
	}
	r.log.Info("resync: worker republishing its cache", "worker", worker, "next_event_id", reply.NextEventID)
}
