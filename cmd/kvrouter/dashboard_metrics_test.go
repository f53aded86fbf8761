package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/internal/reftest"
)

// dashboardConditional are metrics the Grafana dashboard queries that a
// healthy single replica with one worker has no series of (a vector shows
// no series, not even its HELP line, until something sets one), each with
// what makes it appear. The test still requires the code to export them
// (deploy's TestDeployGrafanaDashboard); anything queried that is neither
// live nor listed here fails: the dashboard drifted.
var dashboardConditional = map[string]string{
	"kvrouter_tokenizer_fingerprint_mismatch":   "a peer replica (this one is alone)",
	"kvrouter_replica_state_mismatch":           "a peer replica (this one is alone)",
	"kvrouter_requests_without_tokenizer_total": "a model without tokenizer files (kvmock's is built in)",
	"kvrouter_index_blocks_refused_total":       "a worker's KV events past twice its capacity",
	"kvrouter_eventbus_pending_messages":        "proposed, not exported yet (deploy's proposedMetrics)",
	"kvrouter_eventbus_lag_seconds_bucket":      "proposed, not exported yet (deploy's proposedMetrics)",
	"kvrouter_worker_events_missing":            "a routed worker silent for --events-missing-after",
	"kvrouter_queue_depth":                      "a request waiting in the admission queue (every worker over --router-queue-threshold)",
	"kvrouter_worker_failures_total":            "a failed attempt on a worker",
	"kvrouter_worker_retries_total":             "an attempt retried after a worker failed",
}

// TestDashboardMetricsLive: a live replica's /metrics (kvrouter serve
// --single-node, a kvmock worker, a static worker without capacity, a
// few requests, one refused) passes `promtool check metrics`, and every
// metric the Grafana dashboard queries is in it, unless listed in
// dashboardConditional with what brings it. promtool comes with Debian's
// prometheus package (.ci/run installs it).
func TestDashboardMetricsLive(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica and a worker process")
	}
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		reftest.Missing(t, "promtool (apt-get install prometheus) for the dashboard's metrics test")
	}
	queried := dashboardQueries(t, filepath.Join("..", "..", "deploy", "grafana", "dashboards", "kvrouter.json"))

	bin := buildKvmock(t, t.TempDir())
	ports := freePorts(t, 6)
	// A static worker without capacity (nothing listens there) and a queue
	// threshold relative to the capacity it lacks: the capacity gap gets
	// its series.
	base := startUIReplica(t, ports, "", "--workers", fmt.Sprintf("dead=http://127.0.0.1:%d", ports[5]),
		"--router-queue-threshold", "1")
	startKvmock(t, bin, "--id", "metrics-mock", "--addr", fmt.Sprintf("127.0.0.1:%d", ports[4]), "--model", "kvmock",
		"--nats", fmt.Sprintf("nats://127.0.0.1:%d", ports[2]), "--register", base, "--log-level", "warn")
	post := func(body string) (int, error) {
		resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			return 0, err
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode, nil
	}
	body := `{"model":"kvmock","max_tokens":3,"stream":true,"messages":[{"role":"user","content":"` + strings.Repeat("the dashboard prompt ", 20) + `"}]}`
	poll.Until(t, 30*time.Second, 100*time.Millisecond, func() error {
		if code, err := post(body); err != nil || code != http.StatusOK {
			return fmt.Errorf("HTTP %d, %v", code, err)
		}
		return nil
	})
	for range 4 {
		if _, err := post(body); err != nil {
			t.Fatal(err)
		}
	}
	if code, _ := post(`{"model":`); code != http.StatusBadRequest {
		t.Errorf("a broken body: HTTP %d, want 400", code)
	}

	var exposition []byte
	present := map[string]bool{}
	// The load sync, events and retries arrive asynchronously: poll until
	// every unconditional query has its series (or time runs out and the
	// report below names the missing ones).
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		exposition, present = scrape(t, base)
		if len(missingQueries(queried, present)) == 0 || time.Now().After(deadline) {
			break
		}
	}
	if err := os.MkdirAll(filepath.Join("..", "..", "tmp"), 0o755); err == nil {
		_ = os.WriteFile(filepath.Join("..", "..", "tmp", "metrics-live.txt"), exposition, 0o644)
	}

	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = bytes.NewReader(exposition)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("promtool check metrics: %v\n%s", err, out)
	}
	for _, m := range missingQueries(queried, present) {
		t.Errorf("the dashboard queries %s, which a live replica does not export (renamed or dropped? if it needs a condition this test does not create, list it in dashboardConditional)", m)
	}
	for _, m := range queried {
		if why, ok := dashboardConditional[m]; ok && seriesFor(m, present) {
			t.Logf("%s is live here although listed as conditional (%s): drop it from dashboardConditional", m, why)
		}
	}
	for m := range dashboardConditional {
		if !slices.Contains(queried, m) {
			t.Errorf("dashboardConditional lists %s, which the dashboard no longer queries", m)
		}
	}
	for _, m := range []string{"kvrouter_hit_rate_available", "kvrouter_hit_rate_reachable", "kvrouter_hit_rate_captured",
		"kvrouter_hit_rate_delivered", "kvrouter_worker_capacity_missing"} {
		if !slices.Contains(queried, m) {
			t.Errorf("the dashboard does not show %s", m)
		}
	}
}

// dashboardQueries returns the kvrouter_* names the dashboard's panel
// queries use (a name ending in "_" is a prefix matched by a regex).
func dashboardQueries(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	type panel struct {
		Targets []struct {
			Expr string `json:"expr"`
		} `json:"targets"`
		Panels []json.RawMessage `json:"panels"`
	}
	var dash struct {
		Panels []json.RawMessage `json:"panels"`
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	re := regexp.MustCompile(`\bkvrouter_[a-z0-9_]+`)
	seen := map[string]bool{}
	var walk func([]json.RawMessage)
	walk = func(ps []json.RawMessage) {
		for _, raw := range ps {
			var p panel
			if err := json.Unmarshal(raw, &p); err != nil {
				t.Fatalf("%s: %v", path, err)
			}
			for _, tg := range p.Targets {
				for _, m := range re.FindAllString(tg.Expr, -1) {
					seen[m] = true
				}
			}
			walk(p.Panels)
		}
	}
	walk(dash.Panels)
	out := make([]string, 0, len(seen))
	for m := range seen {
		out = append(out, m)
	}
	slices.Sort(out)
	if len(out) < 20 {
		t.Fatalf("only %d metrics queried by %s", len(out), path)
	}
	return out
}

// scrape reads base's /metrics: the exposition and the sample names in it.
func scrape(t *testing.T, base string) ([]byte, map[string]bool) {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics: HTTP %d, %v", resp.StatusCode, err)
	}
	present := map[string]bool{}
	for line := range strings.SplitSeq(string(b), "\n") {
		if line == "" || line[0] == '#' {
			continue
		}
		if i := strings.IndexAny(line, "{ "); i > 0 {
			present[line[:i]] = true
		}
	}
	return b, present
}

// seriesFor says whether the queried name (or prefix) has a sample.
func seriesFor(m string, present map[string]bool) bool {
	if present[m] {
		return true
	}
	if strings.HasSuffix(m, "_") {
		for p := range present {
			if strings.HasPrefix(p, m) {
				return true
			}
		}
	}
	return false
}

// missingQueries lists the queried names with no sample and no condition.
func missingQueries(queried []string, present map[string]bool) []string {
	var out []string
	for _, m := range queried {
		if _, cond := dashboardConditional[m]; !cond && !seriesFor(m, present) {
			out = append(out, m)
		}
	}
	return out
}
