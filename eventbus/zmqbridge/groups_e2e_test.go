package zmqbridge

import (
	"context"
	"fmt"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// TestBridgeHybridGroupsEndToEnd: a fake vLLM serving a hybrid model
// publishes array-shaped events (the layout before vllm#42892) for two KV
// cache groups, full attention in group 0 and a sliding window in group 1,
// over real ZMQ. Group 1's blocks never reach the index, its removals do
// not take group 0's blocks out, and both are counted under other_group in
// /status and /metrics. A second fake engine, SGLang ≥ 0.5.18 configured
// as such, sends a salted store with the metadata map at position 7: read
// as metadata, skipped as namespaced, never taken for a LoRA name nor
// dropped as malformed.
func TestBridgeHybridGroupsEndToEnd(t *testing.T) {
	vllm := startFakeEngine(t, engineOpts{model: "gemma", blocks: 100})
	sgl := startFakeEngine(t, engineOpts{model: "qwen", blocks: 100})
	cluster := newFakeCluster()
	b, err := New(Config{BlockSize: 16, Publishers: cluster.factory, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(b.Collector())
	srv := httptest.NewServer(b.Handler(reg, ""))
	defer srv.Close()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = b.Run(ctx, []WorkerSpec{
			{ID: "hybrid", URL: vllm.url(), Events: vllm.pubAddr, Engine: "vllm"},
			{ID: "sgl", URL: sgl.url(), Events: sgl.pubAddr, Engine: "sglang", EngineVersion: "0.5.18"},
		})
	}()
	defer func() { cancel(); wg.Wait() }()
	poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error {
		for _, w := range b.Status() {
			if w.State != "running" {
				return fmt.Errorf("%s: %s", w.Spec.ID, w.State)
			}
		}
		return nil
	})
	vllm.waitSubscribed(t)
	sgl.waitSubscribed(t)

	// vLLM array layout: ..., lora_id, medium, lora_name, extra_keys,
	// group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window.
	stored := func(hs []uint64, parent any, toks []uint32, group int, kind string, window any) []any {
		return []any{"BlockStored", u64s(hs...), parent, toks, 16, nil, "GPU", nil, nil, group, kind, window}
	}
	prefix, other := tokens(0, 3), tokens(9000, 2)
	vllm.publish(mp(t, batchArr(1, []any{
		stored([]uint64{1, 2, 3}, nil, prefix, 0, "full_attention", nil),
		stored([]uint64{1, 2, 3}, nil, prefix, 1, "sliding_window", 32),
		// A block only the sliding-window group holds.
		stored([]uint64{7, 8}, nil, other, 1, "sliding_window", 32),
	}, 0)), false)
	vllm.publish(mp(t, batchArr(2, []any{
		// The window moved on: group 1 frees the prefix's first blocks.
		[]any{"BlockRemoved", u64s(1, 2), "GPU", 1},
		// Group 0 evicts the last one.
		[]any{"BlockRemoved", u64s(3), "GPU", 0},
	}, 0)), false)
	want := map[uint64]bool{}
	for _, h := range seqHashes(prefix, "")[:2] {
		want[h] = true
	}
	hybrid := router.WorkerKey("hybrid", 0)
	poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error {
		if err := sameSet(cluster.contents(hybrid), want); err != nil {
			return err
		}
		st := statusOf(t, srv.URL)
		if len(st[0].Ranks) == 0 {
			return fmt.Errorf("no ranks")
		}
		c := st[0].Ranks[0].Converter
		if c.Skipped[SkipOtherGroup] != 3 || c.GroupRule != GroupFullAttention || c.Group != 0 {
			return fmt.Errorf("converter %+v", c)
		}
		return nil
	})
	if n := metricOf(t, reg, "kvrouter_bridge_events_skipped_total", "hybrid", "other_group"); n != 3 {
		t.Fatalf("other_group metric %v", n)
	}

	// SGLang ≥ 0.5.18: unsalted store (7 fields), salted store (metadata
	// map at 7) and its salted child.
	sgl.publish(mp(t, batchArr(1, []any{
		sglangStoredArr(int64(exampleHash)),
		[]any{"BlockStored", []any{int64Code(-9)}, nil, tokens(100, 1), 16, nil, "GPU", omap{{"cache_salt", "tenant-a"}}},
		[]any{"BlockStored", []any{int64Code(-10)}, int64Code(-9), tokens(116, 1), 16, nil, "GPU", omap{{"cache_salt", "tenant-a"}}},
	}, 0)), false)
	poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error {
		got := cluster.contents(router.WorkerKey("sgl", 0))
		if len(got) != 1 || !got[seqHashes(tokens(0, 1), "")[0]] {
			return fmt.Errorf("sglang index %v", got)
		}
		st := statusOf(t, srv.URL)
		if len(st) < 2 || len(st[1].Ranks) == 0 {
			return fmt.Errorf("status %+v", st)
		}
		r := st[1].Ranks[0]
		if r.Converter.Skipped[SkipNamespaced] != 2 || r.MalformedEvents != 0 || r.Converter.Skipped[SkipUnknownLayout] != 0 {
			return fmt.Errorf("sglang rank %+v", r)
		}
		return nil
	})
}

// metricOf is the value of the counter name{worker, reason}.
func metricOf(t *testing.T, g prometheus.Gatherer, name, worker, reason string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			var w, r string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "worker":
					w = l.GetValue()
				case "reason":
					r = l.GetValue()
				}
			}
			if w == worker && r == reason {
				return m.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("no %s{worker=%q,reason=%q}", name, worker, reason)
	return 0
}
