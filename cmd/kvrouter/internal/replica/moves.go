package replica

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/router"
)

// Moving a worker between data groups, online (issue 19 item 2).
//
// MoveWorker (POST /workers/move, any replica) only commits the new
// placement to the control group. The rest follows from it:
//  1. the old group's leader drops the worker's subject from its stream
//     (streamWorkers: no longer placed there). The worker's publisher now
//     gets "no responders" and re-sends the same event until a stream
//     takes it: backpressure, no loss;
//  2. the new group's leader (adoptMoved, from its stream keeper) waits
//     until the old stream neither captures the subject nor holds any of
//     its events — work-queue retention: every event it acknowledged was
//     acked by its consumer, so committed in the old group — and until
//     its own copy of the old group's state has applied everything
//     committed (LinearizableRead);
//  3. it registers the worker in its group (the old record), resyncs each
//     rank there (clears, and makes the next sequenced event the new
//     baseline, so the worker's next id is no gap), copies every block
//     each rank holds in the old group as unsequenced stored events, waits
//     until every replica that answers has applied the whole copy
//     (waitPeersApplied), and deregisters the worker from the old group;
//  4. only then does its stream take the worker's subject (streamWorkers:
//     registered here and nowhere else), and the worker's re-sent events
//     flow again, into the new group.
//
// Reads, routing among them, take a moving worker from the old group until
// it let go of the worker (groupOf; router.MergedOverlaps drops the new
// group's entries for it meanwhile): the old group's copy is whole and
// takes no more events once step 2 began, the new group's is partial until
// the copy ends. The deregistration — the switch — comes after every
// replica applied the copy, so no replica switches to a partial copy and
// routing sees the worker's blocks throughout. (A replica that did not
// answer within moveCatchUpTimeout, a down one, may: it reads the new
// group as far as it has applied it.) Each step is idempotent: a new
// leader of the target group redoes whatever its predecessor left undone
// (the old registration still exists until the last step). Not carried
// over: the worker's kv-approx predictions, which are transient.

// moveCatchUpTimeout bounds step 3's wait for the other replicas to apply
// the copy: a replica down or partitioned cannot hold a move up longer.
const moveCatchUpTimeout = 10 * time.Second

// adoptBlocksPerEntry: blocks copied per Raft entry in a hand-over. The
// eventbus's largest valid event, which --max-entry-bytes' smallest
// setting (MinMaxEntryBytes) always holds, aliased hashes and all.
const adoptBlocksPerEntry = eventbus.DefaultMaxBlocks

// ErrNotSharded: moving needs --raft-groups > 1.
var ErrNotSharded = errors.New("the index is not sharded (--raft-groups 1): there is no other group")

// MoveWorker places worker in data group to and returns the group it was
// in; the hand-over itself runs on the target group's leader. It waits,
// bounded by ctx, until this replica sees the worker registered in the
// target group only.
func (r *replica) MoveWorker(ctx context.Context, worker string, to int) (from int, err error) {
	if !r.sharded() {
		return 0, fmt.Errorf("%w: %v", api.ErrInvalid, ErrNotSharded)
	}
	r.waitApplied(ctx) // the placement and group count as committed, not as last applied here
	if n := len(r.activeGroups()); to < 1 || to > n {
		return 0, fmt.Errorf("%w: group %d: the data groups are 1 to %d", api.ErrInvalid, to, n)
	}
	p, placed := r.fsm.Placement(worker)
	if _, ok := r.worker(worker); !ok || !placed {
		return 0, fmt.Errorf("%w: worker %q is not registered", api.ErrInvalid, worker)
	}
	from = int(p)
	if g, ok := r.groupOf(worker); ok {
		if _, drained := g.fsm.Drain(worker); drained {
			// The drain lives in the registration the move hands over.
			return from, fmt.Errorf("%w: worker %q is drained: undrain it before moving it", api.ErrInvalid, worker)
		}
	}
	if from != to {
		cmd, err := fsm.EncodePlaceWorker(fsm.PlaceWorker{Worker: worker, Group: uint32(to), Groups: uint32(r.clusterGroups())})
		if err != nil {
			return from, fmt.Errorf("%w: %v", api.ErrInvalid, err)
		}
		if err := r.propose(ctx, cmd); err != nil {
			return from, apiError(err)
		}
		r.log.Info("worker placed in another group: its events move there once the group adopted it", "worker", worker, "from", from, "to", to)
	}
	target := r.groups[to-1]
	for {
		if _, ok := target.fsm.Worker(worker); ok && r.registeredElsewhere(worker, target) == nil {
			return from, nil
		}
		select {
		case <-ctx.Done():
			return from, fmt.Errorf("worker %q placed in group %d; the hand-over is still running: %w", worker, to, ctx.Err())
		case <-time.After(streamKeeperEvery):
		}
	}
}

// adoptMoved runs on g's leader: every worker placed in g but still
// registered in another group is taken over (steps 2–3 above). A worker
// whose old stream has not drained yet is left for the next call.
func (r *replica) adoptMoved(ctx context.Context, g *dataGroup) {
	for _, w := range r.placedWorkers(g.id) {
		from := r.registeredElsewhere(w, g)
		if from == nil {
			continue
		}
		done, err := r.adopt(ctx, g, from, w)
		switch {
		case err != nil && ctx.Err() == nil:
			r.log.Warn("moving a worker between groups: retrying", "worker", w, "from", from.id, "to", g.id, "err", err)
		case done:
			r.log.Info("worker moved between groups: its blocks and registration are in the new group", "worker", w, "from", from.id, "to", g.id)
		}
	}
}

// adopt moves worker from group from into g, once from's stream is drained
// of it; done reports the move completed.
func (r *replica) adopt(ctx context.Context, g, from *dataGroup, worker string) (done bool, err error) {
	captured, waiting, err := eventbus.SubjectBacklog(ctx, r.bus.JetStream(), eventbus.GroupStreamName(from.id), eventbus.EventSubject(worker))
	if err != nil {
		return false, fmt.Errorf("old stream: %w", err)
	}
	if captured || waiting > 0 {
		return false, nil // the old group's leader has not dropped the subject, or its backlog not committed yet
	}
	rctx, cancel := context.WithTimeout(ctx, proposeTimeout)
	err = from.node.LinearizableRead(rctx)
	cancel()
	if err != nil {
		return false, fmt.Errorf("old group's state not caught up here: %w", err)
	}
	rec, ok := from.fsm.Worker(worker)
	if !ok {
		return false, nil // its lease ran out meanwhile: nothing to carry over
	}
	reg := fsm.RegisterWorker{ID: rec.ID, DPRanks: rec.DPRanks, Address: rec.Address, Model: rec.Model, BlockSize: rec.BlockSize,
		TotalBlocks: rec.TotalBlocks, MaxBatchedTokens: rec.MaxBatchedTokens, LeaseUntil: rec.LeaseUntil, Role: rec.Role}
	if reg, err = g.fsm.CheckRegisterWorker(reg); err != nil {
		return false, fmt.Errorf("registration in the new group: %w", err)
	}
	if err := r.proposeCmd(ctx, g, func() ([]byte, error) { return fsm.EncodeRegisterWorker(reg) }); err != nil {
		return false, fmt.Errorf("registration in the new group: %w", err)
	}
	for rank, key := range rec.Keys() {
		if err := r.proposeCmd(ctx, g, func() ([]byte, error) {
			return fsm.EncodeResyncWorker(fsm.ResyncWorker{Worker: worker, DPRank: uint32(rank)})
		}); err != nil {
			return false, fmt.Errorf("rank %d baseline in the new group: %w", rank, err)
		}
		for t := router.TierDevice; t < router.NumTiers; t++ {
			ix := from.fsm.Index()
			if t != router.TierDevice {
				if ix = ix.LowerTier(t); ix == nil {
					continue
				}
			}
			blocks := ix.WorkerBlocks(key)
			for len(blocks) > 0 {
				part := blocks[:min(len(blocks), adoptBlocksPerEntry)]
				blocks = blocks[len(part):]
				// EventID 0: unsequenced, so the cursor stays at the
				// baseline the resync set; no parent: a copy of a set.
				ev := fsm.KVBatchEvent{Worker: worker, DPRank: uint32(rank),
					Event: router.KVEvent{Kind: router.EventStored, Blocks: part, Tier: t}}
				if err := r.proposeCmd(ctx, g, func() ([]byte, error) { return fsm.EncodeKVBatch([]fsm.KVBatchEvent{ev}) }); err != nil {
					return false, fmt.Errorf("rank %d %v blocks into the new group: %w", rank, t, err)
				}
			}
		}
	}
	r.waitPeersApplied(ctx, g, g.fsm.AppliedIndex())
	if err := r.proposeCmd(ctx, from, func() ([]byte, error) { return fsm.EncodeDeregisterWorker(fsm.DeregisterWorker{ID: worker}) }); err != nil {
		return false, fmt.Errorf("deregistration from the old group: %w", err)
	}
	return true, nil
}

// waitPeersApplied waits until every other replica in the node registry
// reports group g applied through index, or does not answer, bounded by
// moveCatchUpTimeout (and ctx).
func (r *replica) waitPeersApplied(ctx context.Context, g *dataGroup, index uint64) {
	ctx, cancel := context.WithTimeout(ctx, moveCatchUpTimeout)
	defer cancel()
	for _, node := range r.fsm.Nodes() {
		if node.ID == r.cfg.NodeID || node.HTTPAddr == "" {
			continue
		}
		for {
			var st struct {
				Groups []struct {
					Group   int    `json:"group"`
					Applied uint64 `json:"applied_index"`
				} `json:"raft_groups"`
			}
			err := peerStatus(ctx, r.state.client, node.HTTPAddr, false, &st)
			if err != nil && ctx.Err() != nil {
				r.log.Warn("moving a worker: a replica has not applied the copy in time; switching anyway", "replica", node.ID, "group", g.id, "index", index)
				return
			}
			if err != nil {
				r.log.Warn("moving a worker: a replica did not say whether it applied the copy; switching anyway", "replica", node.ID, "group", g.id, "err", err)
				break
			}
			caught := false
			for _, e := range st.Groups {
				caught = caught || (e.Group == g.id && e.Applied >= index)
			}
			if caught {
				break
			}
			select {
			case <-ctx.Done():
				r.log.Warn("moving a worker: a replica has not applied the copy in time; switching anyway", "replica", node.ID, "group", g.id, "index", index)
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
}

// proposeCmd encodes and proposes one command in g.
func (r *replica) proposeCmd(ctx context.Context, g *dataGroup, encode func() ([]byte, error)) error {
	cmd, err := encode()
	if err != nil {
		return err
	}
	return r.proposeOn(ctx, g, cmd)
}
