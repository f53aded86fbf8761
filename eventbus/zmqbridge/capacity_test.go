package zmqbridge

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/internal/syncbuf"
)

// The bridge registers what capacity it has — from the spec or the
// engine's metrics — and says what it lacks: in /status
// (capacity_missing) and with one warning per missing capacity naming the
// router settings that lose their meaning. max_num_batched_tokens is never
// discovered (no engine exports it), only given.
func TestBridgeReportsMissingCapacity(t *testing.T) {
	cases := []struct {
		name          string
		engineBlocks  int // num_gpu_blocks the fake vLLM reports (0: none)
		spec          WorkerSpec
		wantTotal     int
		wantBatched   int
		wantMissing   []string
		wantWarnings  []string // substrings of the warnings expected
		wantNoWarning bool
	}{
		{name: "both from spec and metrics", engineBlocks: 2048, spec: WorkerSpec{MaxBatchedTokens: 8192},
			wantTotal: 2048, wantBatched: 8192, wantMissing: []string{}, wantNoWarning: true},
		{name: "blocks from metrics, no batched tokens", engineBlocks: 2048,
			wantTotal: 2048, wantMissing: []string{"max_num_batched_tokens"},
			wantWarnings: []string{"max_num_batched_tokens unknown", "--router-queue-threshold"}},
		{name: "metrics without blocks, spec gives neither", engineBlocks: 0,
			wantMissing:  []string{"total_kv_blocks", "max_num_batched_tokens"},
			wantWarnings: []string{"KV capacity unknown", "--active-decode-blocks-threshold", "max_num_batched_tokens unknown"}},
		{name: "spec gives both, metrics report none", engineBlocks: 0, spec: WorkerSpec{TotalBlocks: 512, MaxBatchedTokens: 4096},
			wantTotal: 512, wantBatched: 4096, wantMissing: []string{}, wantNoWarning: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			eng := startFakeEngine(t, engineOpts{topic: "kv", newReplay: true, model: "qwen3", blocks: c.engineBlocks})
			replica := startFakeReplica(t, "tok")
			logs := &syncbuf.Buffer{}
			b, err := New(Config{BlockSize: 16, Publishers: newFakeCluster().factory, Register: []string{replica.srv.URL},
				AdminToken: "tok", RegisterInterval: 50 * time.Millisecond, ReplayTimeout: 5 * time.Second,
				Logger: slog.New(slog.NewTextHandler(logs, nil))})
			if err != nil {
				t.Fatal(err)
			}
			spec := c.spec
			spec.ID, spec.URL, spec.Events, spec.Replay, spec.Topic = "w0", eng.url(), eng.pubAddr, eng.rtrAddr, "kv"
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { defer close(done); _ = b.Run(ctx, []WorkerSpec{spec}) }()
			t.Cleanup(func() { cancel(); <-done })

			poll.Until(t, 15*time.Second, 10*time.Millisecond, func() error {
				if _, ok := replica.last("w0"); !ok {
					return fmt.Errorf("not registered")
				}
				return nil
			})
			r, _ := replica.last("w0")
			if r.TotalBlocks != c.wantTotal || r.MaxBatchedTokens != c.wantBatched {
				t.Errorf("registered %d blocks, %d batched tokens; want %d, %d", r.TotalBlocks, r.MaxBatchedTokens, c.wantTotal, c.wantBatched)
			}
			st := b.Status()
			if len(st) != 1 || !slices.Equal(st[0].CapacityMissing, c.wantMissing) || st[0].CapacityMissing == nil ||
				st[0].MaxBatchedTokens != c.wantBatched {
				t.Errorf("status %+v: capacity_missing want %v", st, c.wantMissing)
			}
			out := logs.String()
			for _, w := range c.wantWarnings {
				if !strings.Contains(out, w) {
					t.Errorf("no warning naming %q in:\n%s", w, out)
				}
			}
			if n := strings.Count(out, "level=WARN"); c.wantNoWarning && n != 0 {
				t.Errorf("%d warnings for a worker with its capacity:\n%s", n, out)
			}
		})
	}
}
