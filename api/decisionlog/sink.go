package decisionlog

import (
	"log/slog"

	"github.com/kvrouter/kvrouter/internal/jsonlsink"
)

// Sink writes completed decisions as JSON lines to a file rotated by size,
// behind a bounded queue that drops (and counts) rather than waits.
type Sink = jsonlsink.Sink[Decision]

// OpenSink opens (appends to) path. maxBytes ≤ 0 means 64 MiB; keep < 1
// means 3 rotated files.
func OpenSink(path string, maxBytes int64, keep int, log *slog.Logger) (*Sink, error) {
	return jsonlsink.Open[Decision](path, "decision log", maxBytes, keep, log)
}
