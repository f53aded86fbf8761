package replica

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/router"
)

// predictionBatcher carries kv-approx predictions into the Raft log so every
// replica predicts the same blocks. Routing never waits for it: predictions
// are queued and proposed in batches every few milliseconds, one command per
// worker, stamped with this replica's clock plus the TTL (the FSM expires
// them on the leader's ticks, never by reading a clock in Apply).
type predictionBatcher struct {
	r       *replica
	log     *slog.Logger
	mu      sync.Mutex                   // guards pending and until
	pending map[router.WorkerID][]uint64 // predictions not yet proposed, per worker rank
	until   time.Time                    // their expiry: the latest record's time plus the TTL
	kick    chan struct{}                // one pending wake-up for run
}

func newPredictionBatcher(r *replica, log *slog.Logger) *predictionBatcher {
	return &predictionBatcher{r: r, log: log, pending: map[router.WorkerID][]uint64{}, kick: make(chan struct{}, 1)}
}

// record is the router's hook; it must not block.
func (p *predictionBatcher) record(w router.WorkerID, hashes []uint64, now time.Time) {
	if len(hashes) == 0 {
		return
	}
	p.mu.Lock()
	p.pending[w] = append(p.pending[w], hashes...)
	p.until = now.Add(p.r.cfg.Router.ApproxTTL)
	p.mu.Unlock()
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

func (p *predictionBatcher) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.kick:
		}
		time.Sleep(predictionGather) // let a burst gather
		p.mu.Lock()
		batch, until := p.pending, p.until
		p.pending = map[router.WorkerID][]uint64{}
		p.mu.Unlock()
		for w, hashes := range batch {
			cmd, err := fsm.EncodePredictions(fsm.Predictions{Worker: w, Hashes: hashes, Until: until.UnixNano()})
			if err == nil {
				err = p.r.proposeToOwner(ctx, w, cmd)
			}
			if err != nil && ctx.Err() == nil {
				p.log.Warn("kv-approx prediction not replicated", "worker", w, "blocks", len(hashes), "err", err)
			}
		}
	}
}
