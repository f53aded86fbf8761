package main

import (
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/sim"
	"github.com/kvrouter/kvrouter/internal/warmup"
)

// TestSimRemoveFlags: --remove-worker-at, --remove-chooser,
// --add-worker-at and --warmup-share, valid and not: the events and the
// warm-up policy they make.
func TestSimRemoveFlags(t *testing.T) {
	for _, tc := range []struct {
		args  []string
		want  []sim.FleetEvent
		share float64 // the warm-up's share (0: none)
		ok    bool
	}{
		{nil, nil, 0, true},
		{[]string{"--remove-worker-at", "10m"}, []sim.FleetEvent{{At: 10 * time.Minute, Kind: sim.EventRemove, Chooser: sim.ChooserPlan}}, 0, true},
		{[]string{"--remove-worker-at", "90s", "--remove-chooser", "random"}, []sim.FleetEvent{{At: 90 * time.Second, Kind: sim.EventRemove, Chooser: sim.ChooserRandom}}, 0, true},
		{[]string{"--remove-worker-at", "0s", "--remove-chooser", "least-loaded", "--remove-mode", "drain"}, []sim.FleetEvent{{Kind: sim.EventDrain, Chooser: sim.ChooserLeastLoaded}}, 0, true},
		{[]string{"--remove-worker-at", "1m", "--remove-chooser", "id:w2"}, []sim.FleetEvent{{At: time.Minute, Kind: sim.EventRemove, Chooser: "id:w2"}}, 0, true},
		{[]string{"--add-worker-at", "1m", "--remove-worker-at", "1m"}, []sim.FleetEvent{{At: time.Minute, Kind: sim.EventRemove, Chooser: sim.ChooserPlan}, {At: time.Minute, Kind: sim.EventAdd}}, 0, true},
		{[]string{"--add-worker-at", "1m", "--warmup-share", "0.3"}, []sim.FleetEvent{{At: time.Minute, Kind: sim.EventAdd}}, 0.3, true},
		{[]string{"--remove-worker-at", "soon"}, nil, 0, false},
		{[]string{"--remove-worker-at", "-1m"}, nil, 0, false},
		{[]string{"--remove-worker-at", "1m", "--remove-chooser", "oldest"}, nil, 0, false},
		{[]string{"--remove-worker-at", "1m", "--workers", "1"}, nil, 0, false},
		{[]string{"--add-worker-at", "later"}, nil, 0, false},
		{[]string{"--warmup-share", "0.3"}, nil, 0, false},
		{[]string{"--add-worker-at", "1m", "--warmup-share", "-0.1"}, nil, 0, false},
		{[]string{"--add-worker-at", "1m", "--warmup-share", "1.5"}, nil, 0, false},
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
		if got := o.Fleet.events(); !slices.Equal(got, tc.want) {
			t.Errorf("%v: events %+v, want %+v", tc.args, got, tc.want)
		}
		w := o.Fleet.warmUp()
		if (w == nil) != (tc.share == 0) || (w != nil && *w != (warmup.Policy{Share: tc.share, Headroom: warmup.DefaultHeadroom})) {
			t.Errorf("%v: warm-up %+v, want share %v", tc.args, w, tc.share)
		}
	}
}

// simEvents runs kvbench sim with args and returns its fleet events by
// policy from the JSON report.
func simEvents(t *testing.T, args []string) map[string][]sim.EventFigures {
	t.Helper()
	out := filepath.Join(t.TempDir(), "r.json")
	if code := runSim(append(args, "--json", out), io.Discard, io.Discard); code != cli.ExitOK {
		t.Fatalf("exit %d", code)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var rep struct {
		Results []struct {
			Policy      string `json:"policy"`
			FleetEvents []struct {
				sim.EventFigures
				Workers []string           `json:"workers"`
				Reps    []sim.EventFigures `json:"reps"`
			} `json:"fleet_events"`
		} `json:"results"`
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	got := map[string][]sim.EventFigures{}
	for _, r := range rep.Results {
		for _, e := range r.FleetEvents {
			reps := e.Reps
			if len(reps) == 0 { // one rep: its worker under workers
				e.Worker = e.Workers[0]
				reps = []sim.EventFigures{e.EventFigures}
			}
			got[r.Policy] = append(got[r.Policy], reps...)
		}
	}
	return got
}

// TestSimRemoveReport: kvbench sim --remove-worker-at writes each rep's
// fleet event into the JSON report.
func TestSimRemoveReport(t *testing.T) {
	got := simEvents(t, []string{"--workers", "3", "--kv-blocks", "400", "--prefixes", "6", "--prefix-tokens", "512", "--tail-tokens", "32",
		"--output-tokens", "4", "--requests", "600", "--arrival-rate", "2", "--policies", "kv", "--reps", "2",
		"--remove-worker-at", "2m", "--remove-chooser", "plan"})
	if len(got) != 1 || len(got["kv"]) != 2 {
		t.Fatalf("fleet events %+v", got)
	}
	for _, e := range got["kv"] {
		if e.Kind != "remove" || e.Chooser != "plan" || e.Worker == "" || e.AtS != 120 || e.After.Requests == 0 || e.BaselineCachedTokens <= 0 {
			t.Fatalf("fleet event %+v", e)
		}
	}
}

// TestSimAddReport: kvbench sim --add-worker-at with --warmup-share
// writes each policy's addition into the JSON report, the warm-up's
// steered requests with it.
func TestSimAddReport(t *testing.T) {
	got := simEvents(t, []string{"--workers", "3", "--kv-blocks", "400", "--prefixes", "6", "--prefix-tokens", "512", "--tail-tokens", "32",
		"--output-tokens", "4", "--requests", "600", "--arrival-rate", "2", "--policies", "kv,round-robin",
		"--add-worker-at", "2m", "--warmup-share", "0.5"})
	if len(got) != 2 {
		t.Fatalf("results %+v", got)
	}
	for p, evs := range got {
		if len(evs) != 1 || evs[0].Kind != "add" || evs[0].Worker != "w3" || !evs[0].NewWorkerShare.Valid || evs[0].NewWorkerShare.Value <= 0 || !evs[0].Steered.Valid {
			t.Fatalf("%s: additions %+v", p, evs)
		}
	}
}
