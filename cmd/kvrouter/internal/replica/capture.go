package replica

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/kvrouter/kvrouter/api/capture"
)

// openCapture is the traffic capture cfg asks for (nil: off) and what
// closes it.
func openCapture(cfg Config, log *slog.Logger) (*capture.Recorder, func(), error) {
	if cfg.CaptureFile == "" {
		return nil, func() {}, nil
	}
	sample := cfg.CaptureSample
	if sample == 0 {
		sample = 1
	}
	rec, err := capture.Open(capture.Config{Path: cfg.CaptureFile, Sample: sample, MaxBytes: cfg.CaptureMaxBytes, Replica: cfg.NodeID}, time.Now(), log)
	if err != nil {
		return nil, nil, fmt.Errorf("--capture-file: %w", err)
	}
	log.Info("capturing answered requests as a trace (block hashes and lengths, no text)", "path", cfg.CaptureFile, "sample", sample)
	return rec, func() {
		if err := rec.Close(); err != nil {
			log.Warn("capture file not closed cleanly", "err", err)
		}
		if n := rec.Dropped(); n > 0 {
			log.Warn("requests dropped from the capture (its queue was full)", "dropped", n)
		}
	}, nil
}
