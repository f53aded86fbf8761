package main

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
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
		"kv bytes":           {"--kv-bytes-per-token", "0"},
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
