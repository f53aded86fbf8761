package main

import (
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
)

// A long run on a non-terminal stderr (a CI log, a pipe) prints plain
// progress lines there and nothing of them on stdout, which other tools
// parse. --progress-every 1ms makes a short test run long enough to print.
func TestProgressOnlyOnStderr(t *testing.T) {
	fake := &fakeWorker{id: "a", blockSize: 16, seen: map[string]bool{}}
	srv := httptest.NewServer(fake)
	defer srv.Close()
	for _, tc := range []struct {
		name   string
		args   []string
		line   string // every stderr line matches
		stdout string // stdout holds this
	}{
		{"sim", []string{"sim", "--workers", "2", "--kv-blocks", "926", "--prefixes", "12", "--prefix-tokens", "1500",
			"--tail-tokens", "32", "--output-tokens", "16", "--requests", "600", "--concurrency", "4", "--policies", "round-robin,kv"},
			`^kvbench sim: \d+/1200 requests \(\d+%\), \d+s elapsed(, about \d+s left)?$`, "round-robin"},
		{"disagg", []string{"disagg", "--link-mbps", "100,50000", "--prompt-tokens", "500,3000", "--requests", "12"},
			`^kvbench disagg: \d+/20 runs \(\d+%\), \d+s elapsed(, about \d+s left)?$`, "seed 001"},
		{"load", []string{"load", "--target", srv.URL, "--prefixes", "3", "--prefix-tokens", "64", "--tail-tokens", "20",
			"--output-tokens", "4", "--requests", "60", "--concurrency", "1", "--salt", "1"},
			`^kvbench load: \d+/60 requests \(\d+%\), \d+s elapsed(, about \d+s left)?$`, "kvbench load live"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr strings.Builder
			if code := run(append(tc.args, "--progress-every", "1ms"), &stdout, &stderr); code != cli.ExitOK {
				t.Fatalf("exit %d: %s", code, stderr.String())
			}
			if !strings.Contains(stdout.String(), tc.stdout) || strings.Contains(stdout.String(), "elapsed") || strings.ContainsAny(stdout.String(), "\r\x1b") {
				t.Errorf("stdout:\n%s", stdout.String())
			}
			lines := strings.Split(strings.TrimSuffix(stderr.String(), "\n"), "\n")
			re := regexp.MustCompile(tc.line)
			for _, l := range lines {
				if !re.MatchString(l) {
					t.Errorf("stderr line %q does not match %s", l, tc.line)
				}
			}
			if stderr.Len() == 0 {
				t.Error("no progress line on stderr")
			}
		})
	}
	var stderr strings.Builder
	if code := run([]string{"sim", "--progress-every", "0s"}, &strings.Builder{}, &stderr); code != cli.ExitUsage {
		t.Errorf("--progress-every 0s: exit %d (%s), want 2", code, stderr.String())
	}
}
