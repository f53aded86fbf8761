// Package bustest holds the test helpers the eventbus packages share. It
// imports the standard library only, so any package under eventbus (the
// bus itself included) can use it from its tests.
package bustest

import (
	"log/slog"
	"strings"
	"sync"
	"testing"
)

// Logger writes slog lines into t.Log (shown only on failure), at debug
// level. Lines logged after the test ended (late NATS or HTTP goroutines)
// are dropped: t.Log would panic.
func Logger(t testing.TB) *slog.Logger {
	w := &tWriter{t: t}
	t.Cleanup(w.stop) // registered first, so it runs after every later cleanup
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct {
	t    testing.TB
	mu   sync.Mutex
	done bool // mu must be held
}

func (w *tWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.t.Log(strings.TrimRight(string(p), "\n"))
	}
	return len(p), nil
}

func (w *tWriter) stop() {
	w.mu.Lock()
	w.done = true
	w.mu.Unlock()
}
