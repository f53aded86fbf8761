package cluster

import (
	"context"
	"io"
	"log"
	"log/slog"
	"sync/atomic"

	"github.com/hashicorp/go-hclog"
)

// hclogAdapter implements hclog.Logger over a *slog.Logger so hashicorp/raft
// logs through the node's own slog logger (no process-global logger).
type hclogAdapter struct {
	base    *slog.Logger  // without name and implied args
	out     *slog.Logger  // base + name + implied args
	name    string        // dotted, hclog style
	implied []any         // With() args, in order
	level   *atomic.Int32 // minimum hclog level, shared by derived loggers
}

// NewHCLogger returns an hclog.Logger that writes into l. name becomes the
// "logger" attribute. Levels map Trace→Debug-4, Debug, Info, Warn, Error.
func NewHCLogger(l *slog.Logger, name string) hclog.Logger {
	if l == nil {
		l = slog.Default()
	}
	lvl := new(atomic.Int32)
	lvl.Store(int32(hclog.Trace)) // let the slog handler decide
	return newHCLog(l, name, nil, lvl)
}

func newHCLog(base *slog.Logger, name string, implied []any, lvl *atomic.Int32) *hclogAdapter {
	out := base
	if name != "" {
		out = out.With("logger", name)
	}
	if len(implied) > 0 {
		out = out.With(implied...)
	}
	return &hclogAdapter{base: base, out: out, name: name, implied: implied, level: lvl}
}

func slogLevel(l hclog.Level) slog.Level {
	switch l {
	case hclog.Trace:
		return slog.LevelDebug - 4
	case hclog.Debug:
		return slog.LevelDebug
	case hclog.Warn:
		return slog.LevelWarn
	case hclog.Error:
		return slog.LevelError
	default: // Info, NoLevel, DefaultLevel
		return slog.LevelInfo
	}
}

func (h *hclogAdapter) enabled(l hclog.Level) bool {
	if l == hclog.Off {
		return false
	}
	floor := hclog.Level(h.level.Load())
	if l != hclog.NoLevel && floor != hclog.NoLevel && l < floor {
		return false
	}
	return h.out.Enabled(context.Background(), slogLevel(l))
}

func (h *hclogAdapter) Log(level hclog.Level, msg string, args ...any) {
	if !h.enabled(level) {
		return
	}
	h.out.Log(context.Background(), slogLevel(level), msg, args...)
}

func (h *hclogAdapter) Trace(msg string, args ...any) { h.Log(hclog.Trace, msg, args...) }
func (h *hclogAdapter) Debug(msg string, args ...any) { h.Log(hclog.Debug, msg, args...) }
func (h *hclogAdapter) Info(msg string, args ...any)  { h.Log(hclog.Info, msg, args...) }
func (h *hclogAdapter) Warn(msg string, args ...any)  { h.Log(hclog.Warn, msg, args...) }
func (h *hclogAdapter) Error(msg string, args ...any) { h.Log(hclog.Error, msg, args...) }

func (h *hclogAdapter) IsTrace() bool { return h.enabled(hclog.Trace) }
func (h *hclogAdapter) IsDebug() bool { return h.enabled(hclog.Debug) }
func (h *hclogAdapter) IsInfo() bool  { return h.enabled(hclog.Info) }
func (h *hclogAdapter) IsWarn() bool  { return h.enabled(hclog.Warn) }
func (h *hclogAdapter) IsError() bool { return h.enabled(hclog.Error) }

func (h *hclogAdapter) ImpliedArgs() []any { return append([]any(nil), h.implied...) }

func (h *hclogAdapter) With(args ...any) hclog.Logger {
	implied := append(append([]any(nil), h.implied...), args...)
	return newHCLog(h.base, h.name, implied, h.level)
}

func (h *hclogAdapter) Name() string { return h.name }

func (h *hclogAdapter) Named(name string) hclog.Logger {
	if h.name != "" {
		name = h.name + "." + name
	}
	return newHCLog(h.base, name, h.implied, h.level)
}

func (h *hclogAdapter) ResetNamed(name string) hclog.Logger {
	return newHCLog(h.base, name, h.implied, h.level)
}

func (h *hclogAdapter) SetLevel(level hclog.Level) { h.level.Store(int32(level)) }

func (h *hclogAdapter) GetLevel() hclog.Level { return hclog.Level(h.level.Load()) }

func (h *hclogAdapter) StandardLogger(opts *hclog.StandardLoggerOptions) *log.Logger {
	lvl := slog.LevelInfo
	if opts != nil && opts.ForceLevel != hclog.NoLevel {
		lvl = slogLevel(opts.ForceLevel)
	}
	return slog.NewLogLogger(h.out.Handler(), lvl)
}

func (h *hclogAdapter) StandardWriter(opts *hclog.StandardLoggerOptions) io.Writer {
	return h.StandardLogger(opts).Writer()
}

var _ hclog.Logger = (*hclogAdapter)(nil)
