package main

import (
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/sim"
)

// TestSimTenantFlagValidation: --tenants and the queue's flags, good and bad.
func TestSimTenantFlagValidation(t *testing.T) {
	good := [][]string{
		{"--queue-threshold", "0.5"},
		{"--queue-threshold", "0", "--queue-policy", "wspt"},
		{"--queue-threshold", "0.5", "--tenants", "flood:10,steady:1"},
		{"--queue-threshold", "0.5", "--routers", "3", "--tenants", "flood:10,steady:1@2", "--tenant-counters", "local"},
		{"--queue-threshold", "0.5", "--tenants", "a:0.5", "--tenant-sync-interval", "20ms", "--tenant-fair-burst", "1", "--tenant-fair-slack", "0"},
		{"--queue-threshold", "0.5", "--tenants", "a:1,b:1", "--tenant-engine-priority"},
		{"--queue-threshold", "0.5", "--tenants", "a:1,b:1", "--tenant-engine-priority", "--engine-scheduling", "priority-preempt"},
		{"--engine-scheduling", "priority"},
		{"--queue-threshold", "0.5", "--tenants", "a:1,b:1", "--tenant-latency-guard", "1.5"},
		{"--queue-threshold", "0.5", "--tenants", "a:1,b:1", "--tenant-latency-guard", "0"},
		{"--queue-threshold", "0.5", "--tenants", "a:1,b:1", "--tenant-isolation", "1.5"},
		{"--queue-threshold", "0.5", "--tenants", "a:1,b:1", "--tenant-isolation", "1", "--tenant-latency-guard", "1"},
		{"--queue-threshold", "0.5", "--tenants", "a:1,b:1", "--arrival-rate", "10", "--tenant-prefixes", "own"},
		{"--queue-threshold", "0.5", "--tenants", "a:1,b:1", "--tenant-prefixes", "shared"},
	}
	for _, args := range good {
		if _, err := parseSimFlags(args, io.Discard); err != nil {
			t.Errorf("%q: %v", args, err)
		}
	}
	// --tenant-engine-priority makes the engines schedule by priority.
	if o, err := parseSimFlags([]string{"--queue-threshold", "0.5", "--tenants", "a:1", "--tenant-engine-priority"}, io.Discard); err != nil {
		t.Errorf("engine priority: %v", err)
	} else if got := o.engineConfig().Scheduling; got != "priority" {
		t.Errorf("engine priority: scheduling %q, want priority", got)
	}
	// --tenant-prefixes own shows in the report's config; shared (the
	// default) does not.
	for prefixes, want := range map[string]string{"own": "own", "shared": ""} {
		o, err := parseSimFlags([]string{"--queue-threshold", "0.5", "--tenants", "a:1,b:1", "--arrival-rate", "10", "--tenant-prefixes", prefixes}, io.Discard)
		if err != nil {
			t.Fatalf("--tenant-prefixes %s: %v", prefixes, err)
		}
		if got := o.Tenants.reportConfig().Prefixes; got != want {
			t.Errorf("--tenant-prefixes %s: config tenant_prefixes %q, want %q", prefixes, got, want)
		}
	}
	bad := map[string][]string{
		"tenants without a queue":   {"--tenants", "a:1"},
		"negative threshold":        {"--queue-threshold", "-1"},
		"policy without a queue":    {"--queue-policy", "wspt"},
		"unknown policy":            {"--queue-threshold", "1", "--queue-policy", "edf"},
		"no weight":                 {"--queue-threshold", "1", "--tenants", "a"},
		"zero weight":               {"--queue-threshold", "1", "--tenants", "a:0"},
		"bad weight":                {"--queue-threshold", "1", "--tenants", "a:x"},
		"empty name":                {"--queue-threshold", "1", "--tenants", ":1"},
		"twice":                     {"--queue-threshold", "1", "--tenants", "a:1,a:2"},
		"router out of range":       {"--queue-threshold", "1", "--routers", "2", "--tenants", "a:1@2"},
		"router not a number":       {"--queue-threshold", "1", "--tenants", "a:1@x"},
		"unknown counters":          {"--queue-threshold", "1", "--tenants", "a:1", "--tenant-counters", "gossip"},
		"counters without tenants":  {"--queue-threshold", "1", "--tenant-counters", "local"},
		"zero sync interval":        {"--queue-threshold", "1", "--tenants", "a:1", "--tenant-sync-interval", "0s"},
		"burst below one":           {"--queue-threshold", "1", "--tenants", "a:1", "--tenant-fair-burst", "0.5"},
		"negative slack":            {"--queue-threshold", "1", "--tenants", "a:1", "--tenant-fair-slack", "-1"},
		"tenants with a peer":       {"--queue-threshold", "1", "--tenants", "a:1", "--policies", "kv,gaie"},
		"burst without tenants":     {"--queue-threshold", "1", "--tenant-fair-burst", "10"},
		"interval without tenants":  {"--tenant-sync-interval", "1s"},
		"engine priority alone":     {"--queue-threshold", "1", "--tenant-engine-priority"},
		"engine priority on fcfs":   {"--queue-threshold", "1", "--tenants", "a:1", "--tenant-engine-priority", "--engine-scheduling", "fcfs"},
		"unknown engine policy":     {"--engine-scheduling", "sjf"},
		"guard without tenants":     {"--queue-threshold", "1", "--tenant-latency-guard", "2"},
		"guard below one":           {"--queue-threshold", "1", "--tenants", "a:1", "--tenant-latency-guard", "0.9"},
		"negative guard":            {"--queue-threshold", "1", "--tenants", "a:1", "--tenant-latency-guard", "-1"},
		"guard not a number":        {"--queue-threshold", "1", "--tenants", "a:1", "--tenant-latency-guard", "NaN"},
		"infinite guard":            {"--queue-threshold", "1", "--tenants", "a:1", "--tenant-latency-guard", "+Inf"},
		"isolation without tenants": {"--queue-threshold", "1", "--tenant-isolation", "2"},
		"isolation below one":       {"--queue-threshold", "1", "--tenants", "a:1", "--tenant-isolation", "0.9"},
		"isolation not a number":    {"--queue-threshold", "1", "--tenants", "a:1", "--tenant-isolation", "NaN"},
		"infinite isolation":        {"--queue-threshold", "1", "--tenants", "a:1", "--tenant-isolation", "+Inf"},
		"prefixes without tenants":  {"--queue-threshold", "1", "--arrival-rate", "10", "--tenant-prefixes", "own"},
		"unknown tenant prefixes":   {"--queue-threshold", "1", "--tenants", "a:1", "--arrival-rate", "10", "--tenant-prefixes", "salted"},
		"own prefixes closed loop":  {"--queue-threshold", "1", "--tenants", "a:1", "--tenant-prefixes", "own"},
		"own prefixes sessions":     {"--queue-threshold", "1", "--tenants", "a:1", "--arrival-rate", "10", "--session-turns", "2", "--tenant-prefixes", "own"},
	}
	for name, args := range bad {
		_, err := parseSimFlags(args, io.Discard)
		if code, failed := cli.ParseFailed("sim", err, io.Discard); !failed || code != cli.ExitUsage {
			t.Errorf("%s (%q): accepted or not a usage error: %v", name, args, err)
		}
	}
}

// TestSimTenantsEndToEnd: kvbench sim with tenants writes each tenant's
// figures to the table and the JSON, the tenants' requests add up, and
// the config names the queue and the tenants.
func TestSimTenantsEndToEnd(t *testing.T) {
	js := filepath.Join(t.TempDir(), "r.json")
	var stdout, stderr strings.Builder
	code := run([]string{"sim", "--workers", "2", "--kv-blocks", "2048", "--prefixes", "4", "--prefix-tokens", "256",
		"--tail-tokens", "512", "--output-tokens", "8", "--requests", "300", "--arrival-rate", "200", "--routers", "3",
		"--sync-delay", "5ms", "--queue-threshold", "0.5", "--tenants", "flood:3,steady:1@0", "--policies", "kv",
		"--slo-ttft-ms", "500", "--json", js}, &stdout, &stderr)
	if code != cli.ExitOK {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	var rep struct {
		Config struct {
			Admission struct {
				QueueThreshold float64          `json:"queue_threshold"`
				Tenants        []sim.TenantSpec `json:"tenants"`
				Counters       string           `json:"counters"`
			} `json:"admission"`
		} `json:"config"`
		Results []struct {
			Tenants []sim.TenantFigures `json:"tenants"`
		} `json:"results"`
	}
	b, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	a := rep.Config.Admission
	if a.QueueThreshold != 0.5 || len(a.Tenants) != 2 || a.Tenants[1].Router != 0 || a.Tenants[0].Router != -1 || a.Counters != "shared" {
		t.Fatalf("config: %s", b)
	}
	ts := rep.Results[0].Tenants
	if len(ts) != 2 || ts[0].Tenant != "flood" || ts[1].Tenant != "steady" || ts[0].Requests+ts[1].Requests != 300 ||
		ts[0].Requests <= ts[1].Requests || ts[1].Tokens <= 0 || !ts[1].SLOAttainment.Valid || !ts[1].TTFT.P90.Valid {
		t.Fatalf("tenants: %+v", ts)
	}
	if !strings.Contains(stdout.String(), "kv: tenant steady:") {
		t.Fatalf("table:\n%s", stdout.String())
	}
}

// TestSimTenantStreamsSameWithFlood: a tenant's requests — arrival times,
// prompts (their block hashes), output lengths — are the same whether or not
// another tenant floods beside it (same seed, the tenant's share of the
// requests and of the rate alike), so "the steady tenant with and without
// the flood" compares the same requests. With one arrival process split by
// weight (before per-tenant streams) they were two different random streams.
func TestSimTenantStreamsSameWithFlood(t *testing.T) {
	common := []string{"--workers", "2", "--kv-blocks", "2048", "--prefixes", "4", "--prefix-tokens", "256",
		"--tail-tokens", "256", "--output-tokens", "8", "--routers", "2", "--sync-delay", "5ms",
		"--queue-threshold", "0.5", "--policies", "kv", "--seed", "3"}
	type sent struct {
		id     string
		at     time.Duration
		hashes []uint64
		out    int
	}
	// runTenants runs the sim and returns each tenant's requests as sent.
	runTenants := func(extra ...string) map[string][]sent {
		t.Helper()
		o, err := parseSimFlags(append(slices.Clone(common), extra...), io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		ws, err := o.workloads(io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		res, err := o.runPolicy(ws[0], "kv", o.Seed, nil)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string][]sent{}
		for i, rr := range res.Requests {
			name := res.Tenants[res.TenantOf[i]].Name
			r := ws[0].Requests[i]
			out[name] = append(out[name], sent{r.ID, rr.Sent, r.Hashes, r.OutputTokens})
		}
		return out
	}
	// With --tenant-prefixes own, or shared (the default), alike.
	for _, prefixes := range [][]string{nil, {"--tenant-prefixes", "own"}} {
		alone := runTenants(append([]string{"--tenants", "steady:1@0", "--arrival-rate", "20", "--requests", "40"}, prefixes...)...)["steady"]
		both := runTenants(append([]string{"--tenants", "flood:10,steady:1@0", "--arrival-rate", "220", "--requests", "440"}, prefixes...)...)
		flooded := both["steady"]
		if len(alone) != 40 || len(flooded) != len(alone) {
			t.Fatalf("%q: steady requests: %d alone, %d beside the flood; want 40 both", prefixes, len(alone), len(flooded))
		}
		for i := range alone {
			a, f := alone[i], flooded[i]
			if a.id != f.id || a.at != f.at || a.out != f.out || !slices.Equal(a.hashes, f.hashes) {
				t.Fatalf("%q: steady request %d: alone %s at %v (%d blocks), beside the flood %s at %v (%d blocks)",
					prefixes, i, a.id, a.at, len(a.hashes), f.id, f.at, len(f.hashes))
			}
		}
		// Shared: the tenants' prompts share prefix blocks; own: none.
		steadyBlocks := map[uint64]bool{}
		for _, r := range flooded {
			for _, h := range r.hashes {
				steadyBlocks[h] = true
			}
		}
		common := 0
		for _, r := range both["flood"] {
			for _, h := range r.hashes {
				if steadyBlocks[h] {
					common++
				}
			}
		}
		if own := prefixes != nil; own != (common == 0) {
			t.Fatalf("%q: %d of the flood's blocks are the steady tenant's", prefixes, common)
		}
	}
}
