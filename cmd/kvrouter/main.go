// Command kvrouter is one replica of the KV-cache-aware router, and its
// operator tools. main only dispatches: each subcommand parses its flags,
// builds what it needs and runs until its context ends.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

// command is one subcommand: it returns the process exit code.
type command struct {
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) int
}

func commands() map[string]command {
	return map[string]command{
		"hash":     {"print Dynamo-compatible block hashes of token ids", runHash},
		"serve":    {"run one router replica", runServe},
		"tokenize": {"print the prompt token ids a replica would hash, one JSON line per request", runTokenize},

		"bridge": {"follow vLLM / SGLang KV events over ZMQ into the event bus", runBridge},
		"certs":  {"create a private CA and node / worker certificates in a directory", runCerts},
	}
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: kvrouter <command> [flags]\n\ncommands:")
	for _, name := range []string{"serve", "certs", "hash", "tokenize", "bridge"} {
		fmt.Fprintf(w, "  %-8s %s\n", name, commands()[name].summary)
	}
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(dispatch(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

func dispatch(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stderr)
		return 2
	}
	cmd, ok := commands()[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "kvrouter: unknown command %q\n", args[0])
		usage(stderr)
		return 2
	}
	return cmd.run(ctx, args[1:], stdout, stderr)
}
