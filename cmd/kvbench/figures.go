package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/figures"
)

// figuresOptions are kvbench figures' validated flags.
type figuresOptions struct {
	File    string
	Write   bool
	Check   bool
	List    bool
	Only    []string
	Keep    bool
	Verbose bool
}

func parseFiguresFlags(args []string, output io.Writer) (*figuresOptions, error) {
	o := &figuresOptions{}
	fs := flag.NewFlagSet("kvbench figures", flag.ContinueOnError)
	fs.SetOutput(output)
	var only string
	fs.StringVar(&o.File, "file", "BENCHMARKS.md", "the Markdown file whose marked figures are checked or rewritten")
	fs.BoolVar(&o.Write, "write", false, "rerun each figure's printed command and rewrite the figure in place")
	fs.BoolVar(&o.Check, "check", false, "rerun each figure's printed command; exit 1 with a diff when the file differs")
	fs.BoolVar(&o.List, "list", false, "list the figures the file marks and what each costs")
	fs.StringVar(&only, "only", "", "comma list of figure names (default: every marked figure)")
	fs.BoolVar(&o.Keep, "keep", false, "keep each command's scratch directory (its JSON files)")
	fs.BoolVar(&o.Verbose, "v", false, "pass the commands' stderr (progress) through")
	if err := cli.Parse(fs, args); err != nil {
		return nil, err
	}
	if n := btoi(o.Write) + btoi(o.Check) + btoi(o.List); n != 1 {
		return nil, cli.Usagef("give one of --write, --check, --list")
	}
	if only != "" {
		for _, n := range strings.Split(only, ",") {
			if n = strings.TrimSpace(n); n == "" {
				return nil, cli.Usagef("--only: empty name in %q", only)
			}
			o.Only = append(o.Only, strings.TrimSpace(n))
		}
	}
	return o, nil
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// runFigures is the `kvbench figures` subcommand.
func runFigures(args []string, stdout, stderr io.Writer) int {
	o, err := parseFiguresFlags(args, stderr)
	if code, failed := cli.ParseFailed("figures", err, stderr); failed {
		return code
	}
	if o.List {
		return listFigures(o, stdout, stderr)
	}
	self, err := os.Executable()
	if err != nil {
		return cli.Fail(stderr, "figures", fmt.Errorf("find the kvbench binary: %w", err), cli.ExitFail)
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	r := figures.Runner{Kvbench: self, Keep: o.Keep, Log: log}
	if o.Verbose {
		r.Stderr = stderr
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	err = figures.Run(ctx, figures.Options{File: o.File, Only: o.Only, Write: o.Write, Runner: r, Report: stdout})
	switch {
	case errors.Is(err, figures.ErrDrift):
		return cli.Fail(stderr, "figures", err, cli.ExitFail)
	case errors.Is(err, os.ErrNotExist):
		return cli.Fail(stderr, "figures", err, cli.ExitUsage)
	case err != nil:
		return cli.Fail(stderr, "figures", err, cli.ExitFail)
	}
	return cli.ExitOK
}

func listFigures(o *figuresOptions, stdout, stderr io.Writer) int {
	doc, err := os.ReadFile(o.File)
	if err != nil {
		return cli.Fail(stderr, "figures", err, cli.ExitUsage)
	}
	blocks, err := figures.Parse(doc)
	if err != nil {
		return cli.Fail(stderr, "figures", fmt.Errorf("%s: %w", o.File, err), cli.ExitFail)
	}
	about := map[string]string{}
	for _, f := range figures.Registry() {
		about[f.Name] = f.About
	}
	for _, b := range blocks {
		fmt.Fprintf(stdout, "%-22s %s:%d  %s\n", b.Name, o.File, b.Line, about[b.Name])
	}
	return cli.ExitOK
}
