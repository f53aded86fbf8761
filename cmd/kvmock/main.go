// Command kvmock is a simulated inference worker for running kvrouter
// without GPUs: the deterministic engine simulator (package engine) served
// in real time behind an OpenAI-compatible HTTP API, publishing its KV cache
// events into the cluster's NATS JetStream and registering itself with the
// kvrouter replicas.
//
// Prompts are tokenized with the builtin tokenizer and the chat template
// the router uses for it (plain), so the block hashes kvmock publishes are
// the ones the router computes for the same request.
//
// With --role prefill or decode it takes one side of disaggregated
// serving, in the shape of vLLM's NIXL connector: a prefill worker answers
// kv_transfer_params and serves the KV on GET /kv/pull over one shared,
// simulated link (--link-mbps); a decode worker pulls it before it
// generates. See DESIGN.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	cfg, err := parseConfig(args, os.Getenv, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvmock:", err)
		return 2
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: cfg.LogLevel})).With("worker", cfg.ID)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	busOpts, err := cfg.busOptions()
	if err != nil {
		log.Error("cannot start", "err", err)
		return 1
	}
	var connect connectFunc
	if cfg.NATS != "" {
		connect = natsConnect(cfg.NATS, log, busOpts...)
	}
	m, err := newMock(cfg, log, connect)
	if err != nil {
		log.Error("cannot start", "err", err)
		return 1
	}
	if err := m.Run(ctx); err != nil {
		log.Error("kvmock failed", "err", err)
		return 1
	}
	return 0
}
