package replica

import (
	"context"
	"time"

	"github.com/kvrouter/kvrouter/fsm"
)

// registerSelf records this node's addresses in the replicated node
// registry (followers forward writes to the leader's HTTP address found
// there), retrying until it holds.
func (r *replica) registerSelf(ctx context.Context) {
	want := fsm.RegisterNode{NodeID: r.cfg.NodeID, RaftAddr: r.node.RaftAddr(), HTTPAddr: r.cfg.AdvertiseHTTP}
	cmd, err := fsm.EncodeRegisterNode(want)
	if err != nil {
		r.log.Error("node registration", "err", err)
		return
	}
	for ctx.Err() == nil {
		if rec, ok := r.fsm.Node(want.NodeID); ok && rec.HTTPAddr == want.HTTPAddr && rec.RaftAddr == want.RaftAddr {
			return
		}
		if err := r.propose(ctx, cmd); err != nil {
			r.log.Debug("node registration pending", "err", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(registerSelfRetry):
		}
	}
}

// registerStatic registers the --workers list (no lease: they stay until
// deregistered) once the cluster takes writes. A worker already registered
// is registered again only when its entry now gives a capacity the record
// lacks (capacity added to --workers after the first start).
func (r *replica) registerStatic(ctx context.Context) {
	for _, w := range r.cfg.StaticWorkers {
		cmd, err := fsm.EncodeRegisterWorker(fsm.RegisterWorker{ID: w.ID, DPRanks: 1, Address: w.URL, Model: r.cfg.Models[0],
			BlockSize: r.cfg.Router.BlockSize, TotalBlocks: w.TotalBlocks, MaxBatchedTokens: w.MaxBatchedTokens})
		if err != nil {
			r.log.Error("static worker", "worker", w.ID, "err", err)
			continue
		}
		for ctx.Err() == nil {
			if rec, ok := r.worker(w.ID); ok && staticCapacityHeld(w, rec) {
				break
			}
			if err := r.proposeWorker(ctx, w.ID, cmd); err == nil {
				break
			}
			select {
			case <-ctx.Done():
			case <-time.After(registerStaticRetry):
			}
		}
	}
}

// staticCapacityHeld: rec already holds every capacity the --workers entry
// gives (an entry without capacity leaves the record as it is).
func staticCapacityHeld(w StaticWorker, rec fsm.WorkerRecord) bool {
	return (w.TotalBlocks == 0 || rec.TotalBlocks == w.TotalBlocks) &&
		(w.MaxBatchedTokens == 0 || rec.MaxBatchedTokens == w.MaxBatchedTokens)
}
