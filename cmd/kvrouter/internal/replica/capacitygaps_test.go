package replica

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/router"
)

// A gap is warned about once however often the worker set changes, its
// gauge series lives exactly as long as the gap, and closing it (the
// worker re-registers with its capacity) is logged and clears the series.
func TestCapacityGapsWarnOnceAndClose(t *testing.T) {
	var logs bytes.Buffer
	reg := prometheus.NewRegistry()
	g := newCapacityGaps(reg, slog.New(slog.NewTextHandler(&logs, nil)))
	cfg := router.DefaultConfig()
	cfg.Thresholds.ActivePrefillTokensFrac = ptrTo(1.0)
	config := func(string) router.Config { return cfg }
	bare := fsm.WorkerRecord{ID: "s0", Model: "m", TotalBlocks: 100}
	sized := fsm.WorkerRecord{ID: "s0", Model: "m", TotalBlocks: 100, MaxBatchedTokens: 8192}

	steps := []struct {
		workers   []fsm.WorkerRecord
		series    int // kvrouter_worker_capacity_missing series after the step
		warnings  int // warnings logged so far
		closedLog int // "capacity gap closed" lines so far
	}{
		{[]fsm.WorkerRecord{bare}, 1, 1, 0},
		{[]fsm.WorkerRecord{bare}, 1, 1, 0}, // the same set again: no second warning
		{[]fsm.WorkerRecord{sized}, 0, 1, 1},
		{[]fsm.WorkerRecord{bare}, 1, 2, 1}, // the gap reopens: warned again
		{nil, 0, 2, 2},                      // the worker left
	}
	for i, s := range steps {
		g.check(s.workers, config)
		if n := seriesCount(g.gauge); n != s.series {
			t.Errorf("step %d: %d series, want %d", i, n, s.series)
		}
		out := logs.String()
		if n := strings.Count(out, "level=WARN"); n != s.warnings {
			t.Errorf("step %d: %d warnings, want %d:\n%s", i, n, s.warnings, out)
		}
		if n := strings.Count(out, "capacity gap closed"); n != s.closedLog {
			t.Errorf("step %d: %d closed lines, want %d", i, n, s.closedLog)
		}
	}
}

func ptrTo[T any](v T) *T { return &v }
