//go:build chaos

package chaos

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/reftest"
)

// TestChaosShort runs scenarios against real processes (root, bin/ built):
//
//	make build && go test -tags chaos -run TestChaosShort -timeout 30m ./chaos/
//
// CHAOS_SCENARIOS (default T1,T4,T6) and CHAOS_DURATION (default 30s) choose
// what runs; the report goes to chaos/out/report.json like `make chaos`.
func TestChaosShort(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: no chaos")
	}
	opts := Options{Root: "..", Out: testWriter{t}}
	if err := Preflight(opts); err != nil {
		// Skipped where root, the binaries or the tools are missing — but a
		// failure in CI (KVROUTER_REQUIRE_REFERENCE=1), where they are
		// installed: a preflight that fails there must not pass as a skip.
		reftest.Missing(t, "cannot run chaos here: %v", err)
	}
	ids, err := ParseScenarios(os.Getenv("CHAOS_SCENARIOS"))
	if err != nil {
		t.Fatal(err)
	}
	d := 30 * time.Second
	if v := os.Getenv("CHAOS_DURATION"); v != "" {
		if d, err = ParseDuration(v); err != nil {
			t.Fatal(err)
		}
	}
	opts.Scenarios, opts.Duration = ids, d
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if dl, ok := t.Deadline(); ok {
		ctx, cancel = context.WithDeadline(ctx, dl.Add(-30*time.Second))
		defer cancel()
	}
	rep, err := Run(ctx, opts)
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	for _, sc := range rep.Scenarios {
		if !sc.Passed {
			t.Errorf("%s failed: %v %s (artifacts %s)", sc.ID, sc.Failures, sc.Error, sc.ArtifactDir)
		}
	}
	t.Logf("report: %s", filepath.Join(mustAbs(".."), "chaos", "out", "report.json"))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(string(p[:len(p)-min(1, len(p))]))
	return len(p), nil
}
