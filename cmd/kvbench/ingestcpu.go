package main

import (
	"context"
	"fmt"
	"math"
	"strings"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/live"
)

// cpuMetric is the Prometheus process collector's CPU time (user + system
// seconds of the whole process), which every replica registers on its
// /metrics (replica/run.go). The replica process embeds its NATS server,
// so the figure covers the JetStream stream, our Raft group, the consumer,
// the index and the HTTP server (kvbench's own status polls included).
const cpuMetric = "process_cpu_seconds_total"

// replicaCPUSeconds reads every replica's process CPU seconds; NaN for a
// replica whose /metrics did not answer or lacks the counter.
func replicaCPUSeconds(ctx context.Context, cl *live.Client, replicas []string) []float64 {
	out := make([]float64, len(replicas))
	for i, u := range replicas {
		out[i] = math.NaN()
		m, err := cl.Metrics(ctx, u, cpuMetric)
		if err != nil {
			continue
		}
		if v, ok := m[cpuMetric]; ok {
			out[i] = v
		}
	}
	return out
}

// replicaCPU is one replica's CPU over the run.
type replicaCPU struct {
	Replica string  `json:"replica"`
	CPUS    float64 `json:"cpu_s"`
	// UsPerBlockEvent is CPU µs per committed block event (the
	// denominator of events_per_s): cpu_s × 1e6 ÷ committed_blocks.
	UsPerBlockEvent float64 `json:"us_per_block_event"`
}

// cpuPerBlockEvent divides each replica's CPU time between before and
// after by the committed block events. Replicas with an unknown reading
// (NaN), a counter that went backwards (the process restarted) or no
// committed events are left out.
// Never nil: the report's replica_cpu is a list, empty when unknown.
func cpuPerBlockEvent(names []string, before, after []float64, committed int) []replicaCPU {
	out := []replicaCPU{}
	if committed <= 0 {
		return out
	}
	for i, name := range names {
		if i >= len(before) || i >= len(after) {
			break
		}
		d := after[i] - before[i]
		if math.IsNaN(d) || d < 0 {
			continue
		}
		out = append(out, replicaCPU{Replica: name, CPUS: d, UsPerBlockEvent: d * 1e6 / float64(committed)})
	}
	return out
}

// cpuSummary is the per-replica figure for the one-line summary.
func cpuSummary(cs []replicaCPU) string {
	if len(cs) == 0 {
		return ""
	}
	parts := make([]string, len(cs))
	for i, c := range cs {
		parts[i] = fmt.Sprintf("%s %.2f", c.Replica, c.UsPerBlockEvent)
	}
	return "CPU µs per committed block event: " + strings.Join(parts, ", ")
}
