package main

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/figures"
)

// asKvbench makes the test binary act as kvbench when kvbench figures runs
// a command that calls it (figures runs os.Executable()).
const asKvbench = "KVBENCH_TEST_AS_KVBENCH"

func TestMain(m *testing.M) {
	if os.Getenv(asKvbench) == "1" {
		os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// tinyCalibration is a seed-002-shaped run small enough for a unit test.
const tinyCalibration = "kvbench sim --workers 2 --kv-blocks 120 --block-size 16 --prefixes $k --prefix-tokens 512 --tail-tokens 64 " +
	"--output-tokens 8 --requests 40 --concurrency 2 --policies round-robin --seed 7 --reps 3 --json s002-$k.json"

// TestFiguresCalibrationFormatter runs a tiny sim in process and checks the
// calibration formatter's row against the report's own figures.
func TestFiguresCalibrationFormatter(t *testing.T) {
	dir := t.TempDir()
	args := strings.Fields(strings.ReplaceAll(tinyCalibration, "$k", "2"))[2:]
	for i, a := range args {
		if a == "--json" {
			args[i+1] = filepath.Join(dir, args[i+1])
		}
	}
	o, err := parseSimFlags(args, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	rep, _, _, err := executeSim(o, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if err := cli.WriteJSONFile(o.JSON, rep); err != nil {
		t.Fatal(err)
	}
	var format func(figures.Output) (string, error)
	for _, f := range figures.Registry() {
		if f.Name == "s002-calibration" {
			format = f.Format
		}
	}
	got, err := format(figures.Output{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	x := rep.Results[0]
	if len(x.Reps) != 3 {
		t.Fatalf("%d reps in the report", len(x.Reps))
	}
	var per []string
	for _, r := range x.Reps {
		per = append(per, fmt.Sprintf("%.1f", 100*r.RequestHitRate))
	}
	want := "| prefixes | simulated hit rate (median) | per rep | Dynamo measured (round-robin) | difference (points) | simulated cached ratio |\n" +
		"|---:|---:|---|---:|---:|---:|\n" +
		fmt.Sprintf("| 2 | %.1f%% | %s | 95.0%% | %+.1f | %.3f |\n", 100*x.RequestHitRate, strings.Join(per, " / "),
			100*x.RequestHitRate-95, x.CachedTokenRatio)
	if got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
	if x.RequestHitRate <= 0 || x.RequestHitRate >= 1 {
		t.Errorf("hit rate %v: the tiny run should hit sometimes and miss sometimes", x.RequestHitRate)
	}
}

// TestFiguresCheckAndWrite: a stale figure fails --check with a diff,
// --write fixes it and keeps the rest of the file, and --check then passes
// (the simulator is deterministic).
func TestFiguresCheckAndWrite(t *testing.T) {
	t.Setenv(asKvbench, "1")
	doc := "# Figures\n\nBefore.\n\n<!-- figure-command: s002-calibration -->\n\n    for k in 2 7; do\n      " +
		tinyCalibration + "\n    done\n\n<!-- figure: s002-calibration -->\n| stale |\n<!-- /figure -->\n\nAfter.\n"
	path := filepath.Join(t.TempDir(), "B.md")
	if err := os.WriteFile(path, []byte(doc), 0o644); err != nil {
		t.Fatal(err)
	}
	figs := func(args ...string) (int, string, string) {
		var stdout, stderr bytes.Buffer
		code := run(append([]string{"figures", "--file", path}, args...), &stdout, &stderr)
		return code, stdout.String(), stderr.String()
	}
	code, out, errs := figs("--check")
	if code != cli.ExitFail || !strings.Contains(out, "- | stale |") || !strings.Contains(out, "+ | 2 | ") {
		t.Fatalf("stale check: exit %d\n%s\n%s", code, out, errs)
	}
	if code, out, errs = figs("--write"); code != cli.ExitOK {
		t.Fatalf("write: exit %d\n%s\n%s", code, out, errs)
	}
	b, _ := os.ReadFile(path)
	if !strings.HasPrefix(string(b), "# Figures\n\nBefore.\n") || !strings.HasSuffix(string(b), "<!-- /figure -->\n\nAfter.\n") ||
		!strings.Contains(string(b), "| 7 | ") || strings.Contains(string(b), "stale") {
		t.Fatalf("written file:\n%s", b)
	}
	if code, out, errs = figs("--check", "--only", "s002-calibration"); code != cli.ExitOK || !strings.Contains(out, "unchanged") {
		t.Fatalf("check after write: exit %d\n%s\n%s", code, out, errs)
	}
	if code, _, errs = figs("--check", "--only", "nope"); code != cli.ExitFail || !strings.Contains(errs, `no figure "nope"`) {
		t.Fatalf("unknown figure: exit %d\n%s", code, errs)
	}
}

func TestFiguresFlagValidation(t *testing.T) {
	for _, args := range [][]string{{}, {"--write", "--check"}, {"--list", "--check"}, {"--check", "--only", "a,,b"}, {"--check", "extra"}} {
		if _, err := parseFiguresFlags(args, io.Discard); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
	o, err := parseFiguresFlags([]string{"--check", "--only", "a, b"}, io.Discard)
	if err != nil || len(o.Only) != 2 || o.Only[1] != "b" || o.File != "BENCHMARKS.md" {
		t.Errorf("%+v, %v", o, err)
	}
}
