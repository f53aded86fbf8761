package main

import (
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/sim"
)

// TestSimRemoveFlags: --remove-at and --remove-choice, valid and not.
func TestSimRemoveFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want *sim.Removal // nil with ok: no removal
		ok   bool
	}{
		{nil, nil, true},
		{[]string{"--remove-at", "10m"}, &sim.Removal{At: 10 * time.Minute, Choose: sim.ChoosePlan}, true},
		{[]string{"--remove-at", "90s", "--remove-choice", "random"}, &sim.Removal{At: 90 * time.Second, Choose: sim.ChooseRandom}, true},
		{[]string{"--remove-at", "0s", "--remove-choice", "least-loaded"}, &sim.Removal{Choose: sim.ChooseLeastLoaded}, true},
		{[]string{"--remove-at", "1m", "--remove-choice", "worker:w2"}, &sim.Removal{At: time.Minute, Choose: sim.ChooseWorker, Worker: "w2"}, true},
		{[]string{"--remove-choice", "random"}, nil, false},
		{[]string{"--remove-at", "soon"}, nil, false},
		{[]string{"--remove-at", "-1m"}, nil, false},
		{[]string{"--remove-at", "1m", "--remove-choice", "oldest"}, nil, false},
		{[]string{"--remove-at", "1m", "--remove-choice", "worker:w9"}, nil, false},
		{[]string{"--remove-at", "1m", "--workers", "1"}, nil, false},
		{[]string{"--add-at", "1m", "--remove-at", "1m"}, nil, false},
		{[]string{"--add-at", "later"}, nil, false},
		{[]string{"--warmup-share", "0.3"}, nil, false},
		{[]string{"--add-at", "1m", "--warmup-share", "0"}, nil, false},
		{[]string{"--add-at", "1m", "--warmup-share", "1.5"}, nil, false},
	} {
		o, err := parseSimFlags(append([]string{"--workers", "4"}, tc.args...), io.Discard)
		if !tc.ok {
			if !errors.Is(err, cli.ErrUsage) {
				t.Errorf("%v: %v, want a usage error", tc.args, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if (o.Remove == nil) != (tc.want == nil) || (o.Remove != nil && *o.Remove != *tc.want) {
			t.Errorf("%v: removal %+v, want %+v", tc.args, o.Remove, tc.want)
		}
	}
}

// TestSimRemoveReport: kvbench sim --remove-at writes each rep's fleet
// event into the JSON report.
func TestSimRemoveReport(t *testing.T) {
	out := filepath.Join(t.TempDir(), "r.json")
	args := []string{"--workers", "3", "--kv-blocks", "400", "--prefixes", "6", "--prefix-tokens", "512", "--tail-tokens", "32",
		"--output-tokens", "4", "--requests", "600", "--arrival-rate", "2", "--policies", "kv", "--reps", "2",
		"--remove-at", "2m", "--remove-choice", "plan", "--json", out}
	if code := runSim(args, io.Discard, io.Discard); code != cli.ExitOK {
		t.Fatalf("exit %d", code)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var rep struct {
		Results []struct {
			FleetEvents []sim.RemovalResult `json:"fleet_events"`
		} `json:"results"`
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Results) != 1 || len(rep.Results[0].FleetEvents) != 2 {
		t.Fatalf("fleet events %s", b)
	}
	for _, e := range rep.Results[0].FleetEvents {
		if e.Choose != sim.ChoosePlan || e.Worker == "" || e.AtS < 120 || e.PromptTokensAfter == 0 || e.HorizonS != 300 {
			t.Fatalf("fleet event %+v", e)
		}
	}
}

// TestSimAddReport: kvbench sim --add-at writes each rep's addition into
// the JSON report.
func TestSimAddReport(t *testing.T) {
	out := filepath.Join(t.TempDir(), "r.json")
	args := []string{"--workers", "3", "--kv-blocks", "400", "--prefixes", "6", "--prefix-tokens", "512", "--tail-tokens", "32",
		"--output-tokens", "4", "--requests", "600", "--arrival-rate", "2", "--policies", "kv,round-robin",
		"--add-at", "2m", "--warmup-share", "0.5", "--json", out}
	if code := runSim(args, io.Discard, io.Discard); code != cli.ExitOK {
		t.Fatalf("exit %d", code)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var rep struct {
		Results []struct {
			FleetAdditions []sim.AdditionResult `json:"fleet_additions"`
		} `json:"results"`
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Results) != 2 {
		t.Fatalf("results %s", b)
	}
	for _, r := range rep.Results {
		if len(r.FleetAdditions) != 1 || r.FleetAdditions[0].Worker != "w2" || r.FleetAdditions[0].Share <= 0 {
			t.Fatalf("additions %+v", r.FleetAdditions)
		}
	}
}
