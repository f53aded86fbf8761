package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/router"
)

// dynamoRow is one line of testdata/dynamo-names.tsv (its header says what
// each column means).
type dynamoRow struct {
	line                     int
	kind, name, sample, with string
	expect, detail           string
}

func readDynamoNames(t *testing.T) []dynamoRow {
	t.Helper()
	f, err := os.Open("testdata/dynamo-names.tsv")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var rows []dynamoRow
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		c := strings.Split(line, "\t")
		if len(c) != 7 {
			t.Fatalf("line %d: %d columns, want 7: %q", n, len(c), line)
		}
		r := dynamoRow{line: n, kind: c[0], name: c[1], sample: c[2], with: c[3], expect: c[5], detail: c[6]}
		switch {
		case r.kind != "flag" && r.kind != "env":
			t.Fatalf("line %d: kind %q", n, r.kind)
		case r.expect == "same" && r.detail != "":
			t.Fatalf("line %d: a same row has no detail", n)
		case r.expect == "changes" || r.expect == "warns":
			if r.detail == "" {
				t.Fatalf("line %d: a %s row names what changes or what the warning says", n, r.expect)
			}
		case r.expect != "same":
			t.Fatalf("line %d: expect %q: want exactly one of same, changes, warns", n, r.expect)
		}
		rows = append(rows, r)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return rows
}

// TestDynamoNames: every Dynamo flag and environment name in
// testdata/dynamo-names.tsv is accepted by `kvrouter serve` and does
// exactly what its row says, against the same command line without it:
// nothing (same), exactly the named fields of the running configuration
// (changes), or nothing but one startup warning with the row's text
// (warns). And every Dynamo name dynamo.go accepts has a row.
func TestDynamoNames(t *testing.T) {
	rows := readDynamoNames(t)
	if len(rows) < 200 {
		t.Fatalf("only %d names read", len(rows))
	}
	listed := map[string]bool{}
	for _, r := range rows {
		listed[r.name] = true
		t.Run(fmt.Sprintf("%d_%s", r.line, r.name), func(t *testing.T) {
			base := strings.Fields(r.with)
			args := slices.Clone(base)
			env := map[string]string{}
			switch {
			case r.kind == "env":
				env[r.name] = r.sample
			case r.sample == "":
				args = append(args, "--"+r.name)
			default:
				args = append(args, "--"+r.name, r.sample)
			}
			want, wantWarn := runningConfig(t, base, nil)
			got, gotWarn := runningConfig(t, args, env)
			changed := diffFields(want, got)
			warned := newWarnings(wantWarn, gotWarn)
			what := fmt.Sprintf("line %d: %s %s=%q (with %q)", r.line, r.kind, r.name, r.sample, r.with)
			switch r.expect {
			case "same":
				if len(changed) > 0 || len(warned) > 0 {
					t.Errorf("%s is marked same, but changed %v and warned %q", what, changed, warned)
				}
			case "changes":
				if wantChanged := strings.Split(r.detail, ","); !slices.Equal(changed, sorted(wantChanged)) || len(warned) > 0 {
					t.Errorf("%s should change exactly %v without a warning; changed %v, warned %q", what, wantChanged, changed, warned)
				}
			case "warns":
				if len(changed) > 0 || len(warned) != 1 || !strings.Contains(warned[0], r.detail) {
					t.Errorf("%s should change nothing and log one warning containing %q; changed %v, warned %q", what, r.detail, changed, warned)
				}
			}
		})
	}
	// The other direction: a Dynamo name dynamo.go accepts without a row
	// here would be untested.
	var d dynamoState
	for _, sp := range dynamoSpecs(&serveConfig{}, &d, func(string) {}) {
		for _, n := range append(slices.Clone(sp.names), sp.env...) {
			if !listed[n] {
				t.Errorf("%s is accepted (dynamo.go) but has no row in testdata/dynamo-names.tsv", n)
			}
		}
	}
}

// runningConfig parses a serve command line as runServe does and returns
// what the replica would run with, flattened to field paths, and the
// startup warnings runServe would log. Router.* is the configuration of a
// model's router as internal/replica builds it (replica.modelConfig: the
// state machine's configuration of the model, over which the replica's
// mode is set; then router.New), not the parsed flags: a knob that the
// router does not end up with has not changed anything.
func runningConfig(t *testing.T, args []string, env map[string]string) (map[string]string, []string) {
	t.Helper()
	c, err := parseServe(append([]string{"--single-node"}, args...), func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatalf("%q %v refused: %v", args, env, err)
	}
	out := map[string]string{}
	rest := c.Config
	rest.Router = router.Config{}
	flatten("", reflect.ValueOf(rest), out)
	delete(out, "Router")
	state, err := fsm.NewFSM(c.Router)
	if err != nil {
		t.Fatal(err)
	}
	mc := state.ModelConfig(c.Models[0])
	mc.Mode = c.Router.Mode
	rt, err := router.New(mc, nil, 1)
	if err != nil {
		t.Fatalf("%q %v: the router refuses the configuration: %v", args, env, err)
	}
	flatten("Router.", reflect.ValueOf(rt.Config()), out)
	if c.Disagg.Mode != "" && c.Disagg.Mode != router.DisaggOff {
		dc, err := c.Disagg.RouterConfig()
		if err != nil {
			t.Fatal(err)
		}
		flatten("DisaggRouter.", reflect.ValueOf(dc), out)
	}
	var logged warningLog
	logStartupWarnings(slog.New(&logged), c.Warnings)
	return out, logged.details()
}

// flatten writes v's leaves into out under their field paths.
func flatten(path string, v reflect.Value, out map[string]string) {
	switch v.Kind() {
	case reflect.Pointer, reflect.Interface:
		if v.IsNil() {
			out[strings.TrimSuffix(path, ".")] = "nil"
			return
		}
		flatten(path, v.Elem(), out)
	case reflect.Struct:
		for i := range v.NumField() {
			if f := v.Type().Field(i); f.IsExported() {
				flatten(path+f.Name+".", v.Field(i), out)
			}
		}
	default:
		out[strings.TrimSuffix(path, ".")] = fmt.Sprintf("%#v", v.Interface())
	}
}

// diffFields lists the paths whose values differ, sorted.
func diffFields(a, b map[string]string) []string {
	var out []string
	for k, v := range b {
		if w, ok := a[k]; !ok || w != v {
			out = append(out, k)
		}
	}
	for k := range a {
		if _, ok := b[k]; !ok {
			out = append(out, k)
		}
	}
	sort.Strings(out)
	return out
}

func sorted(s []string) []string { s = slices.Clone(s); sort.Strings(s); return s }

// newWarnings is got less one of each warning in base.
func newWarnings(base, got []string) []string {
	left := map[string]int{}
	for _, w := range base {
		left[w]++
	}
	var out []string
	for _, w := range got {
		if left[w] > 0 {
			left[w]--
			continue
		}
		out = append(out, w)
	}
	return out
}

// warningLog is a slog.Handler keeping the detail of each warning logged.
type warningLog struct {
	mu      sync.Mutex
	warning []string
}

func (h *warningLog) Enabled(context.Context, slog.Level) bool { return true }
func (h *warningLog) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *warningLog) WithGroup(string) slog.Handler            { return h }
func (h *warningLog) Handle(_ context.Context, r slog.Record) error {
	if r.Level < slog.LevelWarn {
		return nil
	}
	msg := r.Message
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "detail" {
			msg = a.Value.String()
		}
		return true
	})
	h.mu.Lock()
	h.warning = append(h.warning, msg)
	h.mu.Unlock()
	return nil
}

func (h *warningLog) details() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.warning)
}

// Dynamo's 'None' clears a threshold; --admission-control, removed from
// Dynamo, fills nothing in: the thresholds are only those given.
func TestDynamoThresholdLiterals(t *testing.T) {
	none := func(string) string { return "" }
	c, err := parseServe([]string{"--single-node", "--active-decode-blocks-threshold", "0.5", "--active-decode-blocks-threshold", "None"}, none, io.Discard)
	if err != nil || c.Router.Thresholds.ActiveDecodeBlocks != nil {
		t.Fatalf("None: %v %v", err, c.Router.Thresholds.ActiveDecodeBlocks)
	}
	c, err = parseServe([]string{"--single-node", "--admission-control", "token-capacity", "--active-prefill-tokens-threshold", "7"}, none, io.Discard)
	th := c.Router.Thresholds
	if err != nil || th.ActiveDecodeBlocks != nil || *th.ActivePrefillTokens != 7 || th.ActivePrefillTokensFrac != nil {
		t.Fatalf("token-capacity: %v %+v", err, th)
	}
	if _, err := parseServe([]string{"--single-node", "--admission-control", "maybe"}, none, io.Discard); err == nil {
		t.Fatal("bad admission control accepted")
	}
	if _, err := parseServe([]string{"--single-node", "--router-tracking-hash", "md5"}, none, io.Discard); err == nil {
		t.Fatal("unknown tracking hash accepted")
	}
}

// Our own mode-scoped flag warns like Dynamo's when the mode does not read
// it.
func TestDynamoModeScopedPooledWaitWeight(t *testing.T) {
	tests := []struct {
		name       string
		base, args []string          // the line without it, and what is added
		env        map[string]string // added too
		warn       string            // "" = no warning
	}{
		{"kv-pooled reads it", []string{"--router-mode", "kv-pooled"}, []string{"--pooled-wait-weight", "0.1"}, nil, ""},
		{"kv does not", nil, []string{"--pooled-wait-weight", "0.1"}, nil, "--pooled-wait-weight=0.1 has no effect with --router-mode kv"},
		{"from the environment", []string{"--router-mode", "round-robin"}, nil, map[string]string{"KVROUTER_POOLED_WAIT_WEIGHT": "0.2"},
			"KVROUTER_POOLED_WAIT_WEIGHT=0.2 has no effect with --router-mode round-robin"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, base := runningConfig(t, tt.base, nil)
			_, got := runningConfig(t, append(slices.Clone(tt.base), tt.args...), tt.env)
			warned := newWarnings(base, got)
			switch {
			case tt.warn == "" && len(warned) > 0:
				t.Errorf("warned %q", warned)
			case tt.warn != "" && (len(warned) != 1 || !strings.Contains(warned[0], tt.warn)):
				t.Errorf("want one warning containing %q, got %q", tt.warn, warned)
			}
		})
	}
}

// TestDynamoSessionAffinityFlags: the TTL Dynamo accepts (1 to 31536000
// whole seconds) turns affinity on, by flag or environment; anything else
// (negative, zero, fractional, past a year, not a number) is refused at
// startup, as is a mode other than hard or soft.
func TestDynamoSessionAffinityFlags(t *testing.T) {
	none := func(string) string { return "" }
	for _, tc := range []struct {
		args []string
		env  map[string]string
		ttl  time.Duration
		soft bool
		ok   bool
	}{
		{nil, nil, 0, false, true},
		{[]string{"--router-session-affinity-ttl-secs", "300"}, nil, 300 * time.Second, false, true},
		{[]string{"--router-session-affinity-ttl-secs", "31536000", "--router-session-affinity-mode", "soft"}, nil, 31536000 * time.Second, true, true},
		{nil, map[string]string{"DYN_ROUTER_SESSION_AFFINITY_TTL_SECS": "60", "DYN_ROUTER_SESSION_AFFINITY_MODE": "soft"}, time.Minute, true, true},
		{[]string{"--router-session-affinity-ttl-secs", "-5"}, nil, 0, false, false},
		{[]string{"--router-session-affinity-ttl-secs", "0"}, nil, 0, false, false},
		{[]string{"--router-session-affinity-ttl-secs", "1.5"}, nil, 0, false, false},
		{[]string{"--router-session-affinity-ttl-secs", "31536001"}, nil, 0, false, false},
		{nil, map[string]string{"DYN_ROUTER_SESSION_AFFINITY_TTL_SECS": "forever"}, 0, false, false},
		{[]string{"--router-session-affinity-mode", "sticky"}, nil, 0, false, false},
	} {
		getenv := none
		if tc.env != nil {
			getenv = func(k string) string { return tc.env[k] }
		}
		c, err := parseServe(append([]string{"--single-node"}, tc.args...), getenv, io.Discard)
		if (err == nil) != tc.ok {
			t.Errorf("%q %v: err %v, want ok %v", tc.args, tc.env, err, tc.ok)
			continue
		}
		if err == nil && (c.Sessions.TTL != tc.ttl || c.Sessions.Soft != tc.soft) {
			t.Errorf("%q %v: sessions %+v", tc.args, tc.env, c.Sessions)
		}
	}
}
