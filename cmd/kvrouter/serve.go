package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/kvrouter/kvrouter/cmd/kvrouter/internal/replica"
)

// runServe parses the configuration, builds the replica and serves until
// SIGINT/SIGTERM, then hands leadership over and stops. The replica itself
// (assembly, the leader's duties, api.Replica) is internal/replica.
func runServe(ctx context.Context, args []string, _, stderr io.Writer) int {
	rest, adminOpen, err := takeSecurityFlags(args, os.Getenv) // securityflags.go
	if err != nil {
		fmt.Fprintf(stderr, "kvrouter serve: %v\n", err)
		return 2
	}
	cfg, err := parseServe(rest, os.Getenv, stderr)
	if err == nil {
		err = applySecurityFlags(&cfg, adminOpen)
	}
	if err != nil {
		if errors.Is(err, errHelp) {
			securityFlagsUsage(stderr)
			return 0
		}
		fmt.Fprintf(stderr, "kvrouter serve: %v\n", err)
		return 2
	}
	log := newLogger(cfg.LogLevel, cfg.NodeID, stderr)
	warnAdminAccess(cfg, log)
	logStartupWarnings(log, cfg.Warnings)
	if err := serve(ctx, cfg, log); err != nil {
		log.Error("replica stopped", "err", err)
		return 1
	}
	return 0
}

var errHelp = errors.New("help requested")

func newLogger(level, node string, w io.Writer) *slog.Logger {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		l = slog.LevelInfo
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l})).With("node", node)
}

// serve runs one replica until ctx ends: the parsed configuration, less
// what only the command line needs (log level, warnings), is the replica's.
func serve(ctx context.Context, cfg serveConfig, log *slog.Logger) error {
	return replica.Run(ctx, cfg.Config, log)
}
