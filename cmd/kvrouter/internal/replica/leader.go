package replica

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/router"
)

// The leader's duties. cluster.Node runs lead while this replica leads
// (WhileLeader) and cancels its context when leadership ends; resync runs
// on the leader when the FSM reports a stale rank (onChange). Followers do
// none of this: they apply what the leader commits.

// lead runs on the leader only: the KV event consumer and the clock tick.
func (r *replica) lead(ctx context.Context) {
	r.log.Info("leading: starting event ingest and ticks")
	go r.tick(ctx)
	replicas := streamReplicas(r.cfg)
	for ctx.Err() == nil {
		if err := r.consume(ctx, replicas); err != nil && ctx.Err() == nil {
			r.log.Warn("event ingest stopped; restarting", "err", err)
			select {
			case <-ctx.Done():
			case <-time.After(ingestRestartDelay):
			}
		}
	}
	r.log.Info("no longer leading: event ingest stopped")
}

// consume ensures the KV_EVENTS stream (replicas copies) and runs the
// durable consumer until ctx ends or it fails; each batch is acked only
// after applyEvents committed it.
func (r *replica) consume(ctx context.Context, replicas int) error {
	if _, err := eventbus.EnsureStream(ctx, r.bus.JetStream(), eventbus.StreamOptions{Replicas: replicas}); err != nil {
		return fmt.Errorf("kv event stream: %w", err)
	}
	cons, err := eventbus.NewConsumer(ctx, r.bus.JetStream(), eventbus.ConsumerConfig{
		Validator: r, Logger: r.log.With("component", "ingest"), Registerer: r.reg,
		// One Raft entry per run of events within --max-entry-bytes.
		EntryBytes: wireEntryBytes, MaxEntryBytes: r.cfg.maxEntryBytes() - fsm.KVBatchOverhead,
	})
	if err != nil {
		return fmt.Errorf("kv event consumer: %w", err)
	}
	return cons.Run(ctx, eventbus.ApplierFunc(r.applyEvents))
}

// CheckWorker validates an event's worker before anything reaches the log.
// worker is the rank-folded id (router.WorkerKey).
func (r *replica) CheckWorker(worker string, blockSize int) error {
	base, _, _ := strings.Cut(worker, "#")
	w, ok := r.fsm.Worker(base)
	if !ok {
		return fmt.Errorf("worker %q: %w", worker, router.ErrUnknownWorker)
	}
	if blockSize != 0 && blockSize != w.BlockSize && !(w.BlockSize == 0 && blockSize == r.fsm.BlockSize()) {
		return fmt.Errorf("worker %q: event block size %d, registered %d: %w", worker, blockSize, w.BlockSize, router.ErrBlockSizeMismatch)
	}
	return nil
}

// applyEvents commits a batch of KV events through Raft, as one entry; the
// consumer acks the stream only when this returns nil, and sized the batch
// to fit --max-entry-bytes (wireEntryBytes bounds each event's share).
func (r *replica) applyEvents(_ context.Context, events []eventbus.WireEvent) error {
	batch := make([]fsm.KVBatchEvent, len(events))
	for i := range events {
		ev := &events[i]
		batch[i] = fsm.KVBatchEvent{Worker: ev.Worker, DPRank: ev.DPRank, EventID: ev.EventID, Event: ev.KVEvent()}
	}
	cmd, err := fsm.EncodeKVBatch(batch)
	if err != nil {
		return fmt.Errorf("encode kv batch: %w", err)
	}
	if limit := r.cfg.maxEntryBytes(); len(cmd) > limit {
		// wireEntryBytes is an upper bound (fsm tests it): this is a bug,
		// and the entry must not reach the log anyway.
		return fmt.Errorf("kv batch of %d events encodes to %d bytes, over --max-entry-bytes %d", len(events), len(cmd), limit)
	}
	f := r.node.ApplyLocal(cmd, commitTimeout)
	if err := f.Error(); err != nil {
		return fmt.Errorf("commit kv batch: %w", err)
	}
	if res, ok := f.Response().(*fsm.ApplyResult); ok && res.Err != nil {
		return fmt.Errorf("apply kv batch: %w", res.Err)
	}
	return nil
}

// tick stamps the leader's clock into the log when something is due to
// expire (checked every tickEvery): predictions and worker leases expire
// deterministically on every replica, and an idle cluster's state stays
// still so digests compare equal.
func (r *replica) tick(ctx context.Context) {
	t := time.NewTicker(tickEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			if next := r.fsm.NextExpiry(); next == 0 || next > now.UnixNano() {
				continue
			}
			cmd, err := fsm.EncodeTick(fsm.Tick{Now: now.UnixNano()})
			if err == nil {
				err = r.propose(ctx, cmd)
			}
			if err != nil && ctx.Err() == nil {
				r.log.Debug("tick", "err", err)
			}
		}
	}
}

// onChange follows replicated changes: routers re-read workers and knobs;
// stale workers are resynced by the leader.
func (r *replica) onChange(ch fsm.Change) {
	r.tokcheck.note(ch)
	switch ch.Kind {
	case fsm.ChangeWorkers, fsm.ChangeModelConfig, fsm.ChangeRestored:
		r.refresh()
		r.gaps.check(r.fsm.Workers(), r.modelConfig)
	case fsm.ChangeOverCapacity:
		r.capacity.note(ch)
	case fsm.ChangeStale:
		r.log.Warn("worker index out of step with the worker: resync", "worker", ch.Worker, "dp_rank", ch.DPRank, "reason", ch.Reason)
		if r.node.IsLeader() {
			go r.resync(ch.Worker, ch.DPRank, ch.Reason)
		}
	}
}

// resync drops the stale rank's blocks through Raft, then asks the worker
// to republish its full state. A worker that cannot (a real engine without
// our resync subject) rebuilds the index from its next events.
func (r *replica) resync(worker string, rank uint32, reason string) {
	// A stale mark replayed from the log at start-up, or one a Cleared event
	// in the same batch already ended, needs nothing.
	if _, still := r.fsm.Stale()[fsm.RankKey{Worker: worker, DPRank: rank}]; !still {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), resyncTimeout)
	defer cancel()
	cmd, err := fsm.EncodeResyncWorker(fsm.ResyncWorker{Worker: worker, DPRank: rank})
	if err == nil {
		err = r.propose(ctx, cmd)
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
