package main

import (
	"context"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/live"
)

func TestIngestCPUPerBlockEvent(t *testing.T) {
	nan := math.NaN()
	cases := []struct {
		name          string
		before, after []float64
		committed     int
		want          map[string]float64 // replica → µs per block event
	}{
		{"three replicas", []float64{10, 20, 30}, []float64{14.5, 24, 33}, 1_000_000, map[string]float64{"r1": 4.5, "r2": 4, "r3": 3}},
		{"unknown before", []float64{nan, 20, 30}, []float64{14.5, 24, 33}, 1_000_000, map[string]float64{"r2": 4, "r3": 3}},
		{"unknown after", []float64{10, 20, 30}, []float64{14.5, nan, 33}, 2_000_000, map[string]float64{"r1": 2.25, "r3": 1.5}},
		{"restarted replica", []float64{10, 20, 30}, []float64{1, 24, 33}, 1_000_000, map[string]float64{"r2": 4, "r3": 3}},
		{"nothing committed", []float64{10, 20, 30}, []float64{14.5, 24, 33}, 0, nil},
		{"short readings", []float64{10}, []float64{11, 24, 33}, 1_000_000, map[string]float64{"r1": 1}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := cpuPerBlockEvent([]string{"r1", "r2", "r3"}, c.before, c.after, c.committed)
			if got == nil || len(got) != len(c.want) {
				t.Fatalf("got %+v, want %v", got, c.want)
			}
			for _, g := range got {
				w, ok := c.want[g.Replica]
				if !ok || math.Abs(g.UsPerBlockEvent-w) > 1e-9 {
					t.Errorf("%s: %v µs, want %v (present %v)", g.Replica, g.UsPerBlockEvent, w, ok)
				}
				if math.Abs(g.CPUS-w*float64(c.committed)/1e6) > 1e-9 {
					t.Errorf("%s: cpu_s %v", g.Replica, g.CPUS)
				}
			}
		})
	}
}

// A fake replica /metrics in the Prometheus text format, the counter among
// others (a longer name sharing its prefix, labelled series, comments).
func TestIngestReplicaCPUFromMetrics(t *testing.T) {
	page := func(v string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/metrics" {
				http.NotFound(w, r)
				return
			}
			w.Header().Set("Content-Type", "text/plain; version=0.0.4")
			_, _ = w.Write([]byte(`# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total_extra 99
go_gc_duration_seconds{quantile="0.5"} 1.2e-05
` + v + `
process_max_fds 1024
`))
		}
	}
	a := httptest.NewServer(page("process_cpu_seconds_total 12.34"))
	defer a.Close()
	b := httptest.NewServer(page("process_cpu_seconds_total 1.5e+02"))
	defer b.Close()
	none := httptest.NewServer(page(""))
	defer none.Close()
	down := httptest.NewServer(http.NotFoundHandler())
	down.Close()
	got := replicaCPUSeconds(context.Background(), live.NewClient(""), []string{a.URL, b.URL, none.URL, down.URL})
	if got[0] != 12.34 || got[1] != 150 || !math.IsNaN(got[2]) || !math.IsNaN(got[3]) {
		t.Fatalf("readings %v, want [12.34 150 NaN NaN]", got)
	}
	rep := &ingestReport{ReplicaCPU: cpuPerBlockEvent([]string{"r1", "r2", "r3", "r4"}, []float64{10, 100, 1, 1}, got, 1_000_000)}
	if s := ingestSummary(rep); !strings.Contains(s, "CPU µs per committed block event: r1 2.34, r2 50.00") || strings.Contains(s, "r3") {
		t.Fatalf("summary %q", s)
	}
}
