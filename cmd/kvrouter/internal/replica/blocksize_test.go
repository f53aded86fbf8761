package replica

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/internal/poll"
)

// Each model hashes with its own block size: a model whose workers run
// 32-token blocks gets a 32-token router on every replica, next to the
// default model's 16; a worker of that model at another size is refused.
func TestReplicaPerModelBlockSize(t *testing.T) {
	tc := newTestCluster(t, 3)
	leader := tc.WaitLeader()
	r := tc.follower(leader)
	register := func(id, model string, bs int) error {
		var err error
		poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error {
			err = r.RegisterWorker(t.Context(), api.WorkerSpec{ID: id, URL: "http://127.0.0.1:1", Model: model, BlockSize: bs, TotalBlocks: 1000})
			if errors.Is(err, api.ErrInvalid) {
				return nil // a refusal is an answer
			}
			return err
		})
		return err
	}
	if err := register("a1", model, 16); err != nil {
		t.Fatal(err)
	}
	if err := register("b1", "big-blocks", 32); err != nil {
		t.Fatal(err)
	}
	if err := register("b2", "big-blocks", 16); !errors.Is(err, api.ErrInvalid) {
		t.Fatalf("a 16-token worker of a 32-token model: %v", err)
	}
	poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
		return tc.eachReplica(func(r *replica) error {
			for m, want := range map[string]int{model: 16, "big-blocks": 32} {
				rt, ok := r.Router(m)
				if !ok {
					return fmt.Errorf("no router for %s", m)
				}
				if got := rt.Config().BlockSize; got != want {
					return fmt.Errorf("%s: router block size %d, want %d", m, got, want)
				}
			}
			return nil
		})
	})
	tc.WaitConverged()
}
