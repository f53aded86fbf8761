// Package bustest holds the test helpers the eventbus packages share. It
// imports the standard library only, so any package under eventbus (the
// bus itself included) can use it from its tests.
package bustest

import (
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
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

// CheckFor polls fn every `every` until it returns nil, and fails the test
// with fn's last error if total elapses first.
func CheckFor(t testing.TB, total, every time.Duration, fn func() error) {
	t.Helper()
	deadline := time.Now().Add(total)
	for {
		err := fn()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("condition not met after %v: %v", total, err)
		}
		time.Sleep(every)
	}
}
