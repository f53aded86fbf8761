package replica

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/fsm"
)

// bgWrites runs the replica's background writes to the control group (session
// refreshes and ends, prefix pins): at most one write per key at a time, so a
// burst of turns on one session, or of hits on one pinned prefix, commits once.
// The request that caused a write never waits for it.
type bgWrites[K comparable] struct {
	mu       sync.Mutex
	inFlight map[K]bool
}

// errNotCommitted marks a write the Raft log did not take (no leader during an
// election, a forward that timed out), as opposed to one the FSM refused: worth
// trying again.
var errNotCommitted = errors.New("not committed")

// How long a background write is retried, and its first backoff.
const (
	bgRetryFor   = 10 * time.Second
	bgRetryFirst = 100 * time.Millisecond
)

// start runs propose in the background unless a write of k is under way. A
// write the log did not take is tried again for up to bgRetryFor: a dropped
// end (X-Dynamo-Session-Final) would keep its worker bound for the rest of its
// TTL, a dropped pin leave its prefix unpinned. A refusal is final. A write
// that never commits is logged at warn with attrs.
func (b *bgWrites[K]) start(k K, log *slog.Logger, what string, propose func() error, attrs ...any) {
	b.mu.Lock()
	if b.inFlight == nil {
		b.inFlight = make(map[K]bool)
	}
	if b.inFlight[k] {
		b.mu.Unlock()
		return
	}
	b.inFlight[k] = true
	b.mu.Unlock()
	go func() {
		defer func() {
			b.mu.Lock()
			delete(b.inFlight, k)
			b.mu.Unlock()
		}()
		start, wait := time.Now(), bgRetryFirst
		for {
			err := propose()
			if err == nil {
				return
			}
			if !errors.Is(err, errNotCommitted) || time.Since(start)+wait > bgRetryFor {
				log.Warn(what+" not committed", append(attrs, "err", err)...)
				return
			}
			time.Sleep(wait)
			wait = min(2*wait, time.Second)
		}
	}()
}

// commitControl encodes c and commits it to the control group (forwarded to
// the leader from a follower), returning the FSM's result with its domain
// error in res.Err; an error returned is one the log did not take
// (errNotCommitted) or a command that does not encode (api.ErrInvalid).
func (r *replica) commitControl(ctx context.Context, c fsm.Command) (*fsm.ApplyResult, error) {
	b, err := fsm.Encode(c)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", api.ErrInvalid, err)
	}
	ctx, cancel := context.WithTimeout(ctx, proposeTimeout)
	defer cancel()
	resp, err := r.control().node.Apply(ctx, b)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errNotCommitted, err)
	}
	res, ok := resp.(*fsm.ApplyResult)
	if !ok {
		return nil, fmt.Errorf("%s: unexpected apply response %T", c.Type(), resp)
	}
	return res, nil
}
