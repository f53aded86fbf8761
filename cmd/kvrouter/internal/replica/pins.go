package replica

import (
	"context"
	"strconv"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/router"
)

// Prefix pins (issue 28 item 2; api.PinReplica). Pins are replicated state
// of the control group's FSM (fsm/pins.go), beside session bindings: every
// replica reads them locally, so a pin one replica made steers the
// requests of every replica, and kv-pooled on every replica prices the
// pinned blocks alike. Writes go to the control group in the background:
// a pin is an optimisation, and the request it came with is not delayed by
// a Raft round trip (Dynamo's router pins fire-and-forget too).

// pinWriteKey is a pin's key among the background writes (bgWrites): one
// write per (model, key, worker) at a time.
type pinWriteKey struct {
	model  string
	key    uint64
	worker router.WorkerID
}

var _ api.PinReplica = (*replica)(nil)

func (r *replica) PinsEnabled() bool { return r.cfg.Pins }
func (r *replica) PinCount() int     { return r.fsm.PinCount() }

// PinLookup reads the control group's FSM: no consensus round trip.
func (r *replica) PinLookup(model string, hashes []uint64) (api.PinMatch, bool) {
	depth, holders := r.fsm.PinLookup(model, hashes)
	if depth == 0 {
		return api.PinMatch{}, false
	}
	m := api.PinMatch{Depth: depth, Key: hashes[depth-1], Holders: make([]api.PinHolder, len(holders))}
	for i, p := range holders {
		m.Holders[i] = api.PinHolder{Worker: p.Worker, Until: time.Unix(0, p.Until), TTL: time.Duration(p.TTL)}
	}
	return m, true
}

// Pins lists the pins for GET /pins.
func (r *replica) Pins() []api.PinInfo {
	pins := r.fsm.Pins()
	out := make([]api.PinInfo, len(pins))
	for i, p := range pins {
		out[i] = api.PinInfo{Model: p.Model, Worker: p.Worker, Key: strconv.FormatUint(p.Key(), 16), Blocks: len(p.Blocks),
			TTL: time.Duration(p.TTL).Seconds(), Expires: time.Unix(0, p.Until).UTC()}
	}
	return out
}

// Pin commits a pin, refresh or move in the background, unless a write of
// the same pin is in flight. The proposer stamps Until with its clock.
func (r *replica) Pin(w api.PinWrite) {
	r.pinWrites.start(pinWriteKey{w.Model, w.Key, w.Worker}, r.log, "pin write", func() error {
		c := fsm.PinPrefix{Model: w.Model, Worker: w.Worker, Key: w.Key, Blocks: w.Blocks, TTL: int64(w.TTL),
			Until: time.Now().Add(w.TTL).UnixNano(), Replace: w.Replace}
		_, err := r.proposePin(context.Background(), c)
		return err
	}, "model", w.Model, "worker", w.Worker, "blocks", len(w.Blocks))
}

// proposePin checks, encodes and commits a pin command to the control
// group. A refused pin (the limit, a rule) is never proposed.
func (r *replica) proposePin(ctx context.Context, c fsm.Command) (*fsm.ApplyResult, error) {
	if pc, ok := c.(fsm.PinPrefix); ok {
		if err := r.fsm.CheckPinPrefix(pc); err != nil {
			return nil, err
		}
	}
	if err := fsm.CheckTime(c, time.Now().UnixNano()); err != nil {
		return nil, err
	}
	res, err := r.commitControl(ctx, c)
	if err != nil {
		return nil, err
	}
	return res, res.Err
}

// Unpin commits UnpinPrefix (DELETE /pins) and returns the pins it ended.
func (r *replica) Unpin(ctx context.Context, u api.PinUnpin) (int, error) {
	res, err := r.proposePin(ctx, fsm.UnpinPrefix{Model: u.Model, Key: u.Key, Worker: u.Worker})
	if err != nil {
		return 0, err
	}
	return res.Applied, nil
}

// pinnedBlocksOf is what a model's router gives kv-pooled: the blocks of
// the model pinned on a worker (rank), from the replicated pins.
func (r *replica) pinnedBlocksOf(model string) func(router.WorkerID) int {
	return func(w router.WorkerID) int { return r.fsm.PinnedBlocks(model, w) }
}

// pinStatus is the "pins" part of /cluster/status: on or off, the count
// and the pins per worker id.
func (r *replica) pinStatus() map[string]any {
	return map[string]any{"enabled": r.cfg.Pins, "pins": r.fsm.PinCount(), "per_worker": r.fsm.PinsPerWorker(),
		"max_pins": fsm.MaxPins, "max_blocks_per_pin": fsm.MaxPinBlocks}
}
