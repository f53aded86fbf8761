package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
)

// A static worker registered without capacity, with two capacity-relative
// settings on: /cluster/status lists what it lacks and which settings do
// not apply to it, the metric is set for each, and the replica warns once
// per setting. A static worker given its capacity in --workers has none of
// that. End to end through kvrouter serve: flag parsing, Raft registration,
// the status handler.
func TestServeStaticWorkerWithoutCapacityIsLoud(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica")
	}
	t.Parallel() // its own replicas, ports and workers; it mostly waits (elections, workers)
	tmp := t.TempDir()
	ports := freePorts(t, 4)
	cfg, err := parseServe([]string{"--single-node", "--node-id", "r1",
		"--http-addr", fmt.Sprintf("127.0.0.1:%d", ports[0]), "--raft-addr", fmt.Sprintf("127.0.0.1:%d", ports[1]),
		"--nats-addr", fmt.Sprintf("127.0.0.1:%d", ports[2]), "--nats-cluster-addr", fmt.Sprintf("127.0.0.1:%d", ports[3]),
		"--data-dir", filepath.Join(tmp, "r1"),
		"--workers", "bare=http://127.0.0.1:1,sized=http://127.0.0.1:2;total_kv_blocks=2048;max_num_batched_tokens=8192",
		"--router-queue-threshold", "0.5", "--active-decode-blocks-threshold", "0.85"},
		func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	logs := &logSink{t: t}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := serve(ctx, cfg, slog.New(slog.NewTextHandler(logs, nil))); err != nil {
			t.Errorf("serve: %v", err)
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	base := "http://" + cfg.HTTPAddr

	type gap struct{ Setting, Missing, Fallback string }
	type worker struct {
		ID          string   `json:"id"`
		TotalBlocks int      `json:"total_kv_blocks"`
		MaxBatched  int      `json:"max_num_batched_tokens"`
		Missing     []string `json:"capacity_missing"`
		Gaps        []gap    `json:"capacity_gaps"`
	}
	var ws map[string]worker
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error {
		resp, err := http.Get(base + "/cluster/status?digest=0")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		var doc struct {
			Workers []worker `json:"workers"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
			return err
		}
		ws = map[string]worker{}
		for _, w := range doc.Workers {
			ws[w.ID] = w
		}
		if len(ws) != 2 {
			return fmt.Errorf("workers %v", ws)
		}
		return nil
	})

	bare, sized := ws["bare"], ws["sized"]
	if !slices.Equal(bare.Missing, []string{"total_kv_blocks", "max_num_batched_tokens"}) {
		t.Errorf("bare: capacity_missing %v", bare.Missing)
	}
	var settings []string
	for _, g := range bare.Gaps {
		settings = append(settings, g.Setting+"/"+g.Missing)
		if g.Fallback == "" {
			t.Errorf("bare: gap %+v names no fallback", g)
		}
	}
	if want := []string{"router-queue-threshold/max_num_batched_tokens", "active-decode-blocks-threshold/total_kv_blocks"}; !slices.Equal(settings, want) {
		t.Errorf("bare: capacity_gaps %v, want %v", settings, want)
	}
	if sized.TotalBlocks != 2048 || sized.MaxBatched != 8192 || sized.Missing == nil || len(sized.Missing) != 0 || sized.Gaps == nil || len(sized.Gaps) != 0 {
		t.Errorf("sized: %+v, want its capacity registered and empty (not absent) lists", sized)
	}

	for _, s := range []string{"router-queue-threshold", "active-decode-blocks-threshold"} {
		if v := metricValue(t, base, "kvrouter_worker_capacity_missing", `worker="bare"`, `setting="`+s+`"`); v != 1 {
			t.Errorf("kvrouter_worker_capacity_missing{bare,%s} = %v, want 1", s, v)
		}
	}
	if v := metricValue(t, base, "kvrouter_worker_capacity_missing", `worker="sized"`); v != 0 {
		t.Errorf("kvrouter_worker_capacity_missing for sized = %v, want no series", v)
	}
	// The warning is logged when the registration applies, before the
	// status shows it; once per setting however often workers change.
	out := logs.String()
	for _, s := range []string{"--router-queue-threshold needs", "--active-decode-blocks-threshold needs"} {
		if n := strings.Count(out, s); n != 1 {
			t.Errorf("%q logged %d times, want once", s, n)
		}
	}
}
