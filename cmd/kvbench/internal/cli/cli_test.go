package cli

import (
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestCLIParse(t *testing.T) {
	cases := []struct {
		name  string
		args  []string
		usage bool
		help  bool
	}{
		{"fine", []string{"--n", "3"}, false, false},
		{"help", []string{"-h"}, false, true},
		{"unknown flag", []string{"--nope"}, true, false},
		{"bad value", []string{"--n", "many"}, true, false},
		{"stray argument", []string{"--n", "3", "extra"}, true, false},
	}
	for _, c := range cases {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		fs.Int("n", 1, "")
		err := Parse(fs, c.args)
		if errors.Is(err, ErrUsage) != c.usage || errors.Is(err, flag.ErrHelp) != c.help {
			t.Errorf("%s: err %v", c.name, err)
		}
	}
}

func TestCLIParseFailed(t *testing.T) {
	var b strings.Builder
	if code, failed := ParseFailed("sim", Usagef("--workers %d: need one", 0), &b); !failed || code != ExitUsage {
		t.Fatalf("usage error: code %d failed %v", code, failed)
	}
	if got := b.String(); got != "kvbench sim: --workers 0: need one\n" {
		t.Fatalf("message %q", got)
	}
	if code, failed := ParseFailed("sim", flag.ErrHelp, io.Discard); !failed || code != ExitOK {
		t.Fatalf("help: code %d failed %v", code, failed)
	}
	if _, failed := ParseFailed("sim", nil, io.Discard); failed {
		t.Fatal("nil error failed")
	}
}

func TestCLIWriteJSONFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "r.json")
	if err := WriteJSONFile(p, map[string]string{"hit_rule": "cached >= one block"}); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if want := "{\n  \"hit_rule\": \"cached >= one block\"\n}\n"; string(b) != want {
		t.Fatalf("got %q, want %q", b, want)
	}
	if err := WriteJSONFile(filepath.Join(t.TempDir(), "x.json"), func() {}); err == nil {
		t.Fatal("a function encoded")
	}
}

func TestCLIWorkloadCheck(t *testing.T) {
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	var w Workload
	w.Register(fs)
	if err := w.Check(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	for _, bad := range [][]string{
		{"--prefixes", "0"}, {"--prefix-tokens", "-1"}, {"--prefix-tokens", "0", "--tail-tokens", "0"},
		{"--output-tokens", "0"}, {"--requests", "0"}, {"--concurrency", "0"}, {"--prefix-order", "sorted"},
	} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		var w Workload
		w.Register(fs)
		if err := Parse(fs, bad); err != nil {
			t.Fatal(err)
		}
		if err := w.Check(); !errors.Is(err, ErrUsage) {
			t.Errorf("%q: err %v, want a usage error", bad, err)
		}
	}
}
