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
	"github.com/kvrouter/kvrouter/internal/warmup"
)

func TestSimSessionAndFleetFlagValidation(t *testing.T) {
	trace := filepath.Join(t.TempDir(), "t.jsonl")
	os.WriteFile(trace, []byte(`{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], "session_id": 1}`+"\n"), 0o644)
	good := [][]string{
		{"--session-turns", "4", "--think-time-ms", "500", "--subagents", "2"},
		{"--session-turns", "4", "--arrival-rate", "1", "--session-affinity", "hard"},
		{"--session-turns", "4", "--routers", "3", "--sync-delay", "1s", "--session-affinity", "soft",
			"--session-affinity-table", "per-router", "--session-affinity-busy", "0.5"},
		{"--trace", trace, "--session-affinity", "hard"},
		{"--session-turns", "4", "--session-affinity", "hard", "--pin-every", "4", "--pin-ttl", "30s"},
		{"--trace", trace, "--pin-every", "1"},
		{"--remove-worker-at", "30s,1m", "--remove-chooser", "random", "--remove-mode", "drain"},
		{"--add-worker-at", "10s", "--event-window", "5s", "--event-horizon", "1m", "--event-tolerance", "0.05", "--event-ttft-factor", "1.5"},
		{"--remove-worker-at", "", "--add-worker-at", " "},
		{"--remove-worker-at", "1s", "--remove-chooser", "id:w2"},
		{"--remove-worker-at", "1s", "--remove-mode", "drain-sessions"},
		{"--remove-worker-at", "1s", "--remove-mode", "drain-shadow", "--shadow-inflight", "2"},
		{"--add-worker-at", "1m", "--warmup-shadow", "--shadow-min-holders", "2"},
		{"--add-worker-at", "1m", "--warmup-shadow", "--warmup-fresh-share", "0.5"},
		{"--remove-worker-at", "1s", "--remove-mode", "drain-shadow", "--shadow-eager"},
	}
	for _, args := range good {
		if _, err := parseSimFlags(args, io.Discard); err != nil {
			t.Errorf("%q: %v", args, err)
		}
	}
	bad := map[string][]string{
		"negative turns":                {"--session-turns", "-1"},
		"think without turns":           {"--think-time-ms", "100"},
		"subagents without turns":       {"--subagents", "2"},
		"negative think":                {"--session-turns", "2", "--think-time-ms", "-1"},
		"negative subagents":            {"--session-turns", "2", "--subagents", "-1"},
		"turns with repeat":             {"--session-turns", "2", "--repeat", "2"},
		"turns with trace":              {"--trace", trace, "--session-turns", "2"},
		"turns overflow the cache":      {"--session-turns", "200", "--kv-blocks", "2000"},
		"unknown affinity":              {"--session-turns", "2", "--session-affinity", "sticky"},
		"affinity without sessions":     {"--session-affinity", "hard"},
		"affinity with a peer":          {"--session-turns", "2", "--session-affinity", "hard", "--policies", "kv,gaie"},
		"busy without soft":             {"--session-turns", "2", "--session-affinity", "hard", "--session-affinity-busy", "0.5"},
		"busy out of range":             {"--session-turns", "2", "--session-affinity", "soft", "--session-affinity-busy", "0"},
		"table without affinity":        {"--session-turns", "2", "--session-affinity-table", "per-router"},
		"unknown table":                 {"--session-turns", "2", "--session-affinity", "hard", "--session-affinity-table", "gossip"},
		"pins without sessions":         {"--pin-every", "2"},
		"negative pin-every":            {"--session-turns", "2", "--pin-every", "-1"},
		"pin ttl over an hour":          {"--session-turns", "2", "--pin-every", "2", "--pin-ttl", "2h"},
		"pin ttl under a second":        {"--session-turns", "2", "--pin-every", "2", "--pin-ttl", "500ms"},
		"pin ttl without pins":          {"--session-turns", "2", "--pin-ttl", "1m"},
		"event time":                    {"--remove-worker-at", "soon"},
		"negative event time":           {"--add-worker-at", "-1s"},
		"event time without unit":       {"--remove-worker-at", "30"},
		"unknown chooser":               {"--remove-worker-at", "1s", "--remove-chooser", "cheapest"},
		"empty worker id":               {"--remove-worker-at", "1s", "--remove-chooser", "id:"},
		"unknown mode":                  {"--remove-worker-at", "1s", "--remove-mode", "evict"},
		"every worker removed":          {"--workers", "2", "--remove-worker-at", "1s,2s"},
		"events with a peer":            {"--add-worker-at", "1s", "--policies", "kv,gaie"},
		"zero window":                   {"--add-worker-at", "1s", "--event-window", "0s"},
		"zero horizon":                  {"--add-worker-at", "1s", "--event-horizon", "0s"},
		"tolerance out of range":        {"--add-worker-at", "1s", "--event-tolerance", "2"},
		"ttft factor below one":         {"--add-worker-at", "1s", "--event-ttft-factor", "0.5"},
		"warm-up without an add":        {"--warmup-share", "0.3"},
		"negative warm-up share":        {"--add-worker-at", "1m", "--warmup-share", "-0.1"},
		"warm-up share over one":        {"--add-worker-at", "1m", "--warmup-share", "1.5"},
		"shadow warm-up without an add": {"--warmup-shadow"},
		"both warm-ups":                 {"--add-worker-at", "1m", "--warmup-shadow", "--warmup-share", "0.3"},
		"no shadow slot":                {"--remove-worker-at", "1s", "--remove-mode", "drain-shadow", "--shadow-inflight", "0"},
		"min holders 0":                 {"--add-worker-at", "1m", "--warmup-shadow", "--shadow-min-holders", "0"},
		"eager without drain-shadow":    {"--remove-worker-at", "1s", "--remove-mode", "drain", "--shadow-eager"},
		"fresh share without shadows":   {"--add-worker-at", "1m", "--warmup-fresh-share", "0.5"},
		"fresh share over one":          {"--add-worker-at", "1m", "--warmup-shadow", "--warmup-fresh-share", "1.5"},
		"negative fresh share":          {"--add-worker-at", "1m", "--warmup-shadow", "--warmup-fresh-share", "-0.5"},
	}
	for name, args := range bad {
		_, err := parseSimFlags(args, io.Discard)
		if code, failed := cli.ParseFailed("sim", err, io.Discard); !failed || code != cli.ExitUsage {
			t.Errorf("%s (%q): accepted or not a usage error: %v", name, args, err)
		}
	}
}

func TestSimParseEventTimes(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []time.Duration
		ok   bool
	}{
		{"", nil, true},
		{"30s", []time.Duration{30 * time.Second}, true},
		{" 2m, 30s ,1h", []time.Duration{30 * time.Second, 2 * time.Minute, time.Hour}, true},
		{"0s", []time.Duration{0}, true},
		{"30s,", nil, false},
		{"-1s", nil, false},
		{"1001h", nil, false},
		{"1", nil, false},
		{strings.Repeat("1s,", maxFleetEvents) + "1s", nil, false},
	} {
		got, err := parseEventTimes(tc.in)
		if (err == nil) != tc.ok || (tc.ok && !slices.Equal(got, tc.want)) {
			t.Errorf("%q: %v, %v; want %v (ok %v)", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

// FuzzParseEventTimes: never panics; what it accepts is sorted, within
// the limits, and at most maxFleetEvents long.
func FuzzParseEventTimes(f *testing.F) {
	for _, s := range []string{"", "30s", "1m,30s", "-1s", "1h,,2h", "9999999h", "1e3s", "0"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, err := parseEventTimes(s)
		if err != nil {
			return
		}
		if len(got) > maxFleetEvents || !slices.IsSorted(got) {
			t.Fatalf("%q: %v", s, got)
		}
		for _, d := range got {
			if d < 0 || d > maxEventTime {
				t.Fatalf("%q: %v outside the limits", s, d)
			}
		}
	})
}

// The command end to end with sessions, affinity through three routers and
// fleet events: the new JSON fields are there and hold together.
func TestSimSessionsAndEventsEndToEnd(t *testing.T) {
	js := filepath.Join(t.TempDir(), "r.json")
	var stdout, stderr strings.Builder
	code := run([]string{"sim", "--workers", "4", "--kv-blocks", "1024", "--prefixes", "4", "--prefix-tokens", "512",
		"--tail-tokens", "64", "--output-tokens", "16", "--requests", "240", "--session-turns", "4", "--think-time-ms", "200",
		"--subagents", "1", "--arrival-rate", "2", "--routers", "3", "--sync-delay", "500ms", "--session-affinity", "hard",
		"--session-affinity-table", "per-router", "--policies", "round-robin,kv", "--reps", "2",
		"--remove-worker-at", "5s", "--remove-chooser", "random", "--add-worker-at", "10s", "--event-window", "2s",
		"--json", js}, &stdout, &stderr)
	if code != cli.ExitOK {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	var rep struct {
		Config struct {
			Sessions        map[string]any `json:"sessions"`
			SessionAffinity map[string]any `json:"session_affinity"`
			FleetEvents     map[string]any `json:"fleet_events"`
		} `json:"config"`
		Results []struct {
			Policy   string   `json:"policy"`
			Fraction *float64 `json:"session_cached_fraction"`
			Events   []struct {
				Kind    string   `json:"kind"`
				Workers []string `json:"workers"`
				Steady  struct {
					Requests int `json:"requests"`
				} `json:"steady"`
				Lost     *float64 `json:"lost_cached_tokens"`
				Baseline float64  `json:"baseline_cached_tokens"`
				Reps     []any    `json:"reps"`
			} `json:"fleet_events"`
		} `json:"results"`
	}
	b, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	if rep.Config.Sessions == nil || rep.Config.SessionAffinity["table"] != "per-router" || rep.Config.FleetEvents == nil {
		t.Fatalf("config: %s", b)
	}
	for _, r := range rep.Results {
		if r.Fraction == nil || *r.Fraction <= 0 || *r.Fraction > 1 || len(r.Events) != 2 {
			t.Fatalf("%s: fraction %v, %d events", r.Policy, r.Fraction, len(r.Events))
		}
		for k, e := range r.Events {
			want := []string{"remove", "add"}[k]
			if e.Kind != want || len(e.Workers) != 2 || e.Steady.Requests == 0 || e.Lost == nil || e.Baseline <= 0 || len(e.Reps) != 2 {
				t.Fatalf("%s event %d: %+v", r.Policy, k, e)
			}
		}
		if r.Events[1].Workers[0] != "w4" {
			t.Fatalf("the added worker is %q, want w4", r.Events[1].Workers[0])
		}
	}
	if !strings.Contains(stdout.String(), "session cached fraction") || !strings.Contains(stdout.String(), "remove (random) at 5s") {
		t.Fatalf("table:\n%s", stdout.String())
	}
}

// TestSimRemoveFlags: --remove-worker-at, --remove-chooser,
// --remove-mode, --add-worker-at and --warmup-share: the events and the
// warm-up policy they make (the flags refused:
// TestSimSessionAndFleetFlagValidation).
func TestSimRemoveFlags(t *testing.T) {
	for _, tc := range []struct {
		args  []string
		want  []sim.FleetEvent
		share float64 // the warm-up's share (0: none)
	}{
		{nil, nil, 0},
		{[]string{"--remove-worker-at", "10m"}, []sim.FleetEvent{{At: 10 * time.Minute, Kind: sim.EventRemove, Chooser: sim.ChooserPlan}}, 0},
		{[]string{"--remove-worker-at", "90s", "--remove-chooser", "random"}, []sim.FleetEvent{{At: 90 * time.Second, Kind: sim.EventRemove, Chooser: sim.ChooserRandom}}, 0},
		{[]string{"--remove-worker-at", "0s", "--remove-chooser", "least-loaded", "--remove-mode", "drain"}, []sim.FleetEvent{{Kind: sim.EventDrain, Chooser: sim.ChooserLeastLoaded}}, 0},
		{[]string{"--remove-worker-at", "1m", "--remove-chooser", "id:w2"}, []sim.FleetEvent{{At: time.Minute, Kind: sim.EventRemove, Chooser: "id:w2"}}, 0},
		{[]string{"--add-worker-at", "1m", "--remove-worker-at", "1m"}, []sim.FleetEvent{{At: time.Minute, Kind: sim.EventRemove, Chooser: sim.ChooserPlan}, {At: time.Minute, Kind: sim.EventAdd}}, 0},
		{[]string{"--add-worker-at", "1m", "--warmup-share", "0.3"}, []sim.FleetEvent{{At: time.Minute, Kind: sim.EventAdd}}, 0.3},
	} {
		o, err := parseSimFlags(append([]string{"--workers", "4"}, tc.args...), io.Discard)
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

// TestSimShadowReport: kvbench sim --add-worker-at with --warmup-shadow
// reports the copies the warm-up sent and what they computed.
func TestSimShadowReport(t *testing.T) {
	got := simEvents(t, []string{"--workers", "3", "--kv-blocks", "400", "--prefixes", "6", "--prefix-tokens", "512", "--tail-tokens", "32",
		"--output-tokens", "4", "--requests", "600", "--arrival-rate", "2", "--policies", "kv",
		"--add-worker-at", "2m", "--warmup-shadow"})
	evs := got["kv"]
	if len(evs) != 1 || !evs[0].Shadows.Valid || evs[0].Shadows.Value <= 0 || !evs[0].ShadowPrefillTokens.Valid ||
		evs[0].ShadowPrefillTokens.Value <= 0 || !evs[0].ShadowPrefillShare.Valid || evs[0].Steered.Value != 0 {
		t.Fatalf("additions %+v", evs)
	}
	// The like-with-like figures come with every addition.
	if !evs[0].WarmComparableS.Valid || evs[0].WarmUpTTFTP99Ms <= 0 || evs[0].WarmUpBaseTTFTP99Ms <= 0 || evs[0].TTFTP99VsBase <= 0 {
		t.Fatalf("like-with-like figures missing: %+v", evs[0])
	}
}
