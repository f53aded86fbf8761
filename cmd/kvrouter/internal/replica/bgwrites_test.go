package replica

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
)

// TestReplicaBackgroundWrites: a write the log did not take is tried again
// until it commits; a refusal is not; a second write of a key under way is
// dropped (a burst writes once), another key's is not.
func TestReplicaBackgroundWrites(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	refused := errors.New("refused by the FSM")
	for _, tc := range []struct {
		name      string
		failures  []error // what the first calls return, then nil
		wantCalls int32
	}{
		{"commits at once", nil, 1},
		{"no leader twice, then commits", []error{fmt.Errorf("%w: no leader", errNotCommitted), fmt.Errorf("%w: timeout", errNotCommitted)}, 3},
		{"refused: no retry", []error{refused}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var b bgWrites[string]
			var calls atomic.Int32
			done := make(chan struct{})
			b.start("s", log, "test write", func() error {
				n := calls.Add(1)
				if int(n) <= len(tc.failures) {
					if !errors.Is(tc.failures[n-1], errNotCommitted) {
						close(done)
					}
					return tc.failures[n-1]
				}
				close(done)
				return nil
			})
			<-done
			poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
				b.mu.Lock()
				defer b.mu.Unlock()
				if b.inFlight["s"] {
					return errors.New("still in flight")
				}
				return nil
			})
			if got := calls.Load(); got != tc.wantCalls {
				t.Fatalf("%d calls, want %d", got, tc.wantCalls)
			}
		})
	}
	t.Run("one write per key", func(t *testing.T) {
		var b bgWrites[string]
		release := make(chan struct{})
		var wg sync.WaitGroup
		var calls atomic.Int32
		write := func() error { defer wg.Done(); calls.Add(1); <-release; return nil }
		wg.Add(2)
		b.start("a", log, "test write", write)
		b.start("a", log, "test write", func() error { t.Error("second write of a key under way ran"); return nil })
		b.start("b", log, "test write", write)
		close(release)
		wg.Wait()
		if got := calls.Load(); got != 2 {
			t.Fatalf("%d writes, want 2 (a once, b once)", got)
		}
	})
}
