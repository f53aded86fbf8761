// Package chaos is kvrouter's fault-injection suite: real `kvrouter serve`
// processes in network namespaces, HAProxy in front, simulated workers with
// a ledger of acknowledged events, route and admin clients, and a nemesis
// on a schedule (see RELIABILITY.md at the repository root).
//
// The harness itself needs root and is built only with the `chaos` build
// tag (`make chaos`, chaos/run.sh). This file and the catalog are untagged:
// the report format (docs/CONTRACTS.md: chaos/out/report.json) and the scenario
// list are plain data that ordinary `go test ./...` checks.
package chaos

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Report is chaos/out/report.json. The contract (docs/CONTRACTS.md) fixes
// scenarios[].{id, passed, lost, duplicates, failover_p99_s, availability};
// everything else is extra and may grow.
type Report struct {
	RunID       string    `json:"run_id"`
	Started     time.Time `json:"started"`
	Finished    time.Time `json:"finished"`
	Duration    string    `json:"duration"` // DURATION: the fault phase of each scenario
	ArtifactDir string    `json:"artifact_dir"`
	Passed      bool      `json:"passed"` // every scenario passed
	Scenarios   []Result  `json:"scenarios"`
}

// Result is one scenario's outcome.
type Result struct {
	ID    string `json:"id"`
	Title string `json:"title"`
	// Passed: every check below holds and the scenario ran to the end.
	Passed bool `json:"passed"`
	// Lost: acknowledged ledger events whose effect is missing on some
	// replica after heal and drain (worst replica, summed over workers).
	Lost int `json:"lost"`
	// Duplicates: ledger events applied more than once (blocks a replica
	// holds beyond what the acknowledged events produce).
	Duplicates int `json:"duplicates"`
	// FailoverP99 is the 99th percentile (with few faults: the maximum) of
	// the time from a fault on the leader to a new ready leader, seconds; 0
	// when the scenario removes no leader.
	FailoverP99 float64 `json:"failover_p99_s"`
	// Availability is the share of route requests through HAProxy that
	// succeeded with at most one client retry; AvailabilityNoRetry without.
	Availability        float64 `json:"availability"`
	AvailabilityNoRetry float64 `json:"availability_no_retry"`
	// Unexpected: replica states the ledger cannot explain (a cursor beyond
	// the last published event, a worker still marked stale, a count that
	// differs between replicas).
	Unexpected   int            `json:"unexpected"`
	DigestsEqual bool           `json:"digests_equal"`
	Linearizable string         `json:"admin_linearizable"` // Ok, Illegal, Unknown (porcupine), or "" when not checked
	ElapsedS     float64        `json:"elapsed_s"`
	Checks       []Check        `json:"checks"`
	Failures     []string       `json:"failures,omitempty"` // the checks that did not hold, in words
	Error        string         `json:"error,omitempty"`    // the scenario could not run to the end
	Metrics      map[string]any `json:"metrics,omitempty"`
	ArtifactDir  string         `json:"artifact_dir,omitempty"`
}

// Check is one pass criterion: Value Op Limit.
type Check struct {
	Name  string  `json:"name"`
	Value float64 `json:"value"`
	Op    string  `json:"op"` // "<=", ">=", "=="
	Limit float64 `json:"limit"`
	OK    bool    `json:"ok"`
	Note  string  `json:"note,omitempty"`
}

// Require records a criterion and whether it holds. NaN never holds (a
// figure that could not be measured is a failure, not a pass).
func (r *Result) Require(name string, value float64, op string, limit float64, note string) bool {
	ok := false
	if !math.IsNaN(value) {
		switch op {
		case "<=":
			ok = value <= limit
		case ">=":
			ok = value >= limit
		case "==":
			ok = value == limit
		}
	}
	r.Checks = append(r.Checks, Check{Name: name, Value: jsonSafe(value), Op: op, Limit: limit, OK: ok, Note: note})
	if !ok {
		v := "not measured"
		if !math.IsNaN(value) {
			v = trimFloat(value)
		}
		msg := fmt.Sprintf("%s: %s, want %s %s", name, v, op, trimFloat(limit))
		if note != "" {
			msg += " (" + note + ")"
		}
		r.Failures = append(r.Failures, msg)
	}
	return ok
}

// RequireTrue records a yes/no criterion.
func (r *Result) RequireTrue(name string, ok bool, note string) bool {
	v := 0.0
	if ok {
		v = 1
	}
	return r.Require(name, v, "==", 1, note)
}

// Finish sets Passed from the checks and the error.
func (r *Result) Finish() {
	r.Passed = r.Error == "" && len(r.Checks) > 0
	for _, c := range r.Checks {
		if !c.OK {
			r.Passed = false
		}
	}
}

func trimFloat(v float64) string {
	if v == math.Trunc(v) && math.Abs(v) < 1e15 {
		return fmt.Sprintf("%d", int64(v))
	}
	return fmt.Sprintf("%.4g", v)
}

// jsonSafe maps NaN and ±Inf (which encoding/json refuses) to -1.
func jsonSafe(v float64) float64 {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return -1
	}
	return v
}

// Sanitize makes every float in the result encodable.
func (r *Result) Sanitize() {
	r.FailoverP99 = jsonSafe(r.FailoverP99)
	r.Availability = jsonSafe(r.Availability)
	r.AvailabilityNoRetry = jsonSafe(r.AvailabilityNoRetry)
	for k, v := range r.Metrics {
		if f, ok := v.(float64); ok {
			r.Metrics[k] = jsonSafe(f)
		}
	}
}

// Write writes the report as indented JSON, atomically (temp file + rename)
// so a reader never sees half a report.
func (rep *Report) Write(path string) error {
	rep.Passed = len(rep.Scenarios) > 0
	for i := range rep.Scenarios {
		rep.Scenarios[i].Sanitize()
		if !rep.Scenarios[i].Passed {
			rep.Passed = false
		}
	}
	data, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return fmt.Errorf("encode report: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append(data, '\n'), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// ReadReport parses a report file.
func ReadReport(path string) (*Report, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var rep Report
	if err := json.Unmarshal(data, &rep); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &rep, nil
}

// Scenario describes one entry of the catalog.
type Scenario struct {
	ID    string
	Title string
	// Short: part of the CI tier (`make chaos-short`).
	Short bool
	// SelfTest: runs only when named.
	SelfTest bool
}

// Catalog lists every scenario the harness knows, in run order.
var Catalog = []Scenario{
	{ID: "T1", Title: "leader SIGKILL every 20 s, restarted 5 s later", Short: true},
	{ID: "T2", Title: "random replica SIGKILL, down 3-8 s", Short: true},
	{ID: "T3", Title: "leader SIGSTOP 5 s every 30 s", Short: true},
	{ID: "T4", Title: "leader isolated by iptables for 10 s", Short: true},
	{ID: "T5", Title: "two of three replicas killed for 20 s", Short: true},
	{ID: "T6", Title: "all three replicas SIGKILLed mid-load, restarted", Short: true},
	{ID: "T7", Title: "wiped follower and a new fourth replica catch up by snapshot", Short: true},
	{ID: "T8", Title: "rolling SIGTERM restart, leader last", Short: true},
	{ID: "T11", Title: "replica-sync (NATS route) traffic of one replica cut for 30 s", Short: true},
	// G1 runs the replicas with --raft-groups 3 (issue 19). Named G1
	// because S1 was already the checker's self-test.
	{ID: "G1", Title: "sharded index (--raft-groups 3): the replica leading the most Raft groups SIGKILLed every 10 s, restarted 5 s later", Short: true},
	// D1 drains a worker while the leader of its group is killed (issue
	// 29): the drain completes once, exactly.
	{ID: "D1", Title: "worker drain racing a leader failover: deregistered once, nothing routed to it after the drain", Short: true},
	// D2 is D1 with --raft-groups 3 (the drain in the worker's data group);
	// not in the short tier, which D1 already grows by ~40 s.
	{ID: "D2", Title: "D1 on a sharded index (--raft-groups 3): the worker's data group leader killed while its drain is pending or completing"},
	// A1 replays issue 16's attacks against the secure defaults (probes.go,
	// SECURITY.md): every probe refused, nothing changed.
	{ID: "A1", Title: "security probes: every attack of issue 16 refused, state unchanged", Short: true},
	// AF1: session affinity (issue 28) across leader failovers. Named AF1
	// (affinity) because S1 is the checker's self-test.
	{ID: "AF1", Title: "agent sessions via HAProxy with affinity while the leader holding their bindings is SIGKILLed every 10 s: each session's turns on its one worker, no binding lost", Short: true},
	// U1 needs the previous release's binary (chaos/run.sh builds it).
	{ID: "U1", Title: "rolling upgrade under load: one replica on the previous release, upgraded by SIGTERM + restart"},
	// S1 checks the checker: it injects a loss and a duplicate, and passes
	// when both are reported. Never part of "all" or "short".
	{ID: "S1", Title: "checker self-test: an injected loss and a replayed event must be detected", SelfTest: true},
}

// Lookup returns the catalog entry of id (case-insensitive).
func Lookup(id string) (Scenario, bool) {
	for _, s := range Catalog {
		if strings.EqualFold(s.ID, id) {
			return s, true
		}
	}
	return Scenario{}, false
}

// DefaultScenarios is what `make chaos` runs without SCENARIOS: the
// acceptance tier.
const DefaultScenarios = "T1,T4,T6"

// ParseScenarios turns SCENARIOS into catalog ids, in the order given,
// without repeats. "" means DefaultScenarios; "all" every scenario;
// "short" the CI tier.
func ParseScenarios(s string) ([]string, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		s = DefaultScenarios
	}
	var out []string
	seen := map[string]bool{}
	add := func(id string) {
		if !seen[id] {
			seen[id] = true
			out = append(out, id)
		}
	}
	for _, f := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' }) {
		switch strings.ToLower(f) {
		case "all":
			for _, sc := range Catalog {
				if !sc.SelfTest {
					add(sc.ID)
				}
			}
			continue
		case "short":
			for _, sc := range Catalog {
				if sc.Short {
					add(sc.ID)
				}
			}
			continue
		}
		sc, ok := Lookup(f)
		if !ok {
			return nil, fmt.Errorf("unknown scenario %q (known: %s, all, short)", f, knownIDs())
		}
		add(sc.ID)
	}
	if len(out) == 0 {
		return nil, errors.New("no scenario given")
	}
	return out, nil
}

func knownIDs() string {
	ids := make([]string, len(Catalog))
	for i, s := range Catalog {
		ids[i] = s.ID
	}
	return strings.Join(ids, ", ")
}

// DefaultDuration is the fault phase without DURATION.
const DefaultDuration = 60 * time.Second

// ParseDuration reads DURATION: a Go duration ("90s", "2m") or plain
// seconds ("60"); "" means DefaultDuration. At least 20 s: shorter runs do
// not fit one fault and its recovery.
func ParseDuration(s string) (time.Duration, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return DefaultDuration, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		secs, serr := strconv.ParseFloat(s, 64)
		if serr != nil || math.IsNaN(secs) || math.IsInf(secs, 0) {
			return 0, fmt.Errorf("DURATION %q: want a duration like 60s or 2m", s)
		}
		d = time.Duration(secs * float64(time.Second))
	}
	if d < 20*time.Second {
		return 0, fmt.Errorf("DURATION %s: at least 20s", d)
	}
	return d, nil
}

// Percentile is the nearest-rank p-th percentile (0 < p <= 100) of xs; NaN
// for no samples. With fewer than 100 samples p99 is the maximum.
func Percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	rank := int(math.Ceil(p / 100 * float64(len(s))))
	rank = min(max(rank, 1), len(s))
	return s[rank-1]
}

// Ratio is num/den, NaN when den is 0.
func Ratio(num, den int) float64 {
	if den == 0 {
		return math.NaN()
	}
	return float64(num) / float64(den)
}
