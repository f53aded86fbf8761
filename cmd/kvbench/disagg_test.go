package main

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
)

func TestDisaggFlagValidation(t *testing.T) {
	good := [][]string{
		{},
		{"--link-mbps", "104", "--prompt-tokens", "1500,3000", "--concurrency", "1", "--modes", "off,always"},
		{"--kv-shape", "28,8,128,2", "--profile", "dynamo-mocker", "--link-latency", "2ms", "--link-per-transfer-mbps", "608"},
		{"--prefix-groups", "4", "--prefix-tokens", "400", "--prompt-tokens", "500", "--fail-every", "5", "--think-time", "250ms"},
	}
	for _, args := range good {
		if _, err := parseDisaggFlags(args, io.Discard); err != nil {
			t.Errorf("%q: %v", args, err)
		}
	}
	bad := map[string][]string{
		"link zero":          {"--link-mbps", "0"},
		"link word":          {"--link-mbps", "fast"},
		"prompt zero":        {"--prompt-tokens", "0"},
		"mode":               {"--modes", "off,sometimes"},
		"mode twice":         {"--modes", "auto,auto"},
		"empty mode":         {"--modes", "off,"},
		"kv shape":           {"--kv-shape", "28,8,128"},
		"kv bytes":           {"--kv-bytes-per-token", "-1"},
		"kv bytes, serve's":  {"--disagg-kv-bytes-per-token", "x"},
		"shape, serve's":     {"--disagg-model-shape", "28,8"},
		"profile":            {"--profile", "h100"},
		"latency":            {"--link-latency", "-1ms"},
		"bound":              {"--bound", "0.9"},
		"prefix alone":       {"--prefix-groups", "3"},
		"prompt over cache":  {"--prompt-tokens", "300000"},
		"no decode workers":  {"--decode-workers", "0"},
		"think time":         {"--think-time", "soon"},
		"per-transfer cap":   {"--link-per-transfer-mbps", "-1"},
		"stray argument":     {"extra"},
		"unknown flag":       {"--nope"},
		"negative parallel":  {"--parallel", "-1"},
		"negative fail rate": {"--fail-every", "-1"},
	}
	for name, args := range bad {
		if _, err := parseDisaggFlags(args, io.Discard); !errors.Is(err, cli.ErrUsage) {
			t.Errorf("%s %q: err %v, want a usage error", name, args, err)
		}
	}
}

// kvrouter serve's spellings of the shared settings mean the same in
// kvbench disagg (one parser, cmd/internal/disaggflag).
func TestDisaggServeSpellings(t *testing.T) {
	cases := []struct {
		name         string
		bench, serve []string
	}{
		{"defaults", nil, nil},
		{"shape", []string{"--kv-shape", "32,8,128,2"}, []string{"--disagg-model-shape", "32,8,128,2"}},
		{"bytes", []string{"--kv-bytes-per-token", "70000"}, []string{"--disagg-kv-bytes-per-token", "70000"}},
		{"link", []string{"--link-mbps", "104", "--link-latency", "2ms", "--link-max-concurrent", "2"},
			[]string{"--disagg-link-mbps", "104", "--disagg-link-latency", "2ms", "--disagg-link-max-transfers", "2"}},
		{"profile and retries", []string{"--profile", "dynamo-mocker", "--transfer-retries", "3"},
			[]string{"--disagg-profile", "dynamo-mocker", "--disagg-transfer-retries", "3"}},
		{"modes", []string{"--modes", "auto"}, []string{"--disagg", "auto"}},
	}
	for _, c := range cases {
		a, err := parseDisaggFlags(c.bench, io.Discard)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		b, err := parseDisaggFlags(c.serve, io.Discard)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if a.Grid.Base.KV != b.Grid.Base.KV || a.Grid.Base.Link != b.Grid.Base.Link || a.Grid.Base.Profile.Name != b.Grid.Base.Profile.Name ||
			a.Grid.Base.TransferRetries != b.Grid.Base.TransferRetries || !slices.Equal(a.Grid.LinkMBps, b.Grid.LinkMBps) || !slices.Equal(a.Grid.Modes, b.Grid.Modes) {
			t.Errorf("%s: kvbench spelling %+v, serve spelling %+v", c.name, a.Grid, b.Grid)
		}
	}
	o, err := parseDisaggFlags(nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if got := o.Grid.Base.KV.BytesPerToken(); got != 114_688 || o.Grid.Base.Profile.Name != "seed001-small" {
		t.Fatalf("defaults: %d B/token, profile %s", got, o.Grid.Base.Profile.Name)
	}
	// A measured size wins over the shape, in either order, as in serve.
	for _, args := range [][]string{
		{"--kv-shape", "32,8,128,2", "--kv-bytes-per-token", "70000"},
		{"--kv-bytes-per-token", "70000", "--kv-shape", "32,8,128,2"},
	} {
		o, err := parseDisaggFlags(args, io.Discard)
		if err != nil || o.Grid.Base.KV.BytesPerToken() != 70000 {
			t.Errorf("%q: %v, %+v", args, err, o)
		}
	}
}

func TestDisaggCommand(t *testing.T) {
	dir := t.TempDir()
	jp, pp := filepath.Join(dir, "d.json"), filepath.Join(dir, "d.png")
	var out, errb bytes.Buffer
	code := run([]string{"disagg", "--link-mbps", "100,50000", "--prompt-tokens", "500,3000", "--requests", "12",
		"--json", jp, "--plot", pp, "--strict"}, &out, &errb)
	if code != cli.ExitOK {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	for _, want := range []string{"kvbench disagg: profile seed001-small", "auto ≤ 1.05", "seed 001 §4.5", "| 1500 | 1 | 172032000 | 1.654 |"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	for _, p := range []string{jp, pp} {
		if st, err := os.Stat(p); err != nil || st.Size() == 0 {
			t.Errorf("%s: %v", p, err)
		}
	}
	if code := run([]string{"disagg", "--modes", "never"}, io.Discard, io.Discard); code != cli.ExitUsage {
		t.Errorf("bad mode: exit %d", code)
	}
	if code := run([]string{"disagg", "-h"}, io.Discard, io.Discard); code != cli.ExitOK {
		t.Errorf("-h: exit %d", code)
	}
	var help bytes.Buffer
	run([]string{"help"}, &help, io.Discard)
	if !strings.Contains(help.String(), "disagg") {
		t.Errorf("usage does not list disagg:\n%s", help.String())
	}
}
