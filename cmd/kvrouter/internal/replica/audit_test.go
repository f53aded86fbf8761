package replica

import (
	"io"
	"log/slog"
	"testing"
)

func TestCacheAuditFlagsDrift(t *testing.T) {
	tests := []struct {
		name                string
		predicted, reported int
		n                   int
		drifting            bool
	}{
		{"agreeing", 160, 160, 30, false},
		{"too few requests", 160, 0, 5, false},
		{"engine reports nothing the index predicts", 160, 0, 30, true},
		{"engine reports far more than predicted", 0, 400, 30, true},
		{"close enough", 160, 120, 30, false},
		{"no caching at all", 0, 0, 30, false},
	}
	for _, tc := range tests {
		a := newCacheAudit(slog.New(slog.NewTextHandler(io.Discard, nil)))
		for range tc.n {
			a.observe("w", tc.predicted, tc.reported)
		}
		got := a.report()["w"].(map[string]any)["drifting"].(bool)
		if got != tc.drifting {
			t.Errorf("%s: drifting = %v", tc.name, got)
		}
	}
}
