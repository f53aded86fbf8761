// Package cli is what kvbench's subcommands share about the command line:
// exit codes, usage errors, flag parsing, JSON output and the synthetic
// workload's flags (one set of defaults for sim and load).
package cli

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
)

// Exit codes (kvbench's contract: README).
const (
	ExitOK    = 0 // success, or -h
	ExitFail  = 1 // a run failed
	ExitUsage = 2 // bad flags or bad input
)

// ErrUsage marks a problem with the command line or the user's input: the
// command prints it and exits ExitUsage.
var ErrUsage = errors.New("usage")

// Usagef is a usage error; the message names the flag at fault.
func Usagef(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrUsage}, args...)...)
}

// Parse parses args into fs. Every error is a usage error, except
// flag.ErrHelp for -h; arguments left after the flags are refused, as no
// subcommand takes any.
func Parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", ErrUsage, err)
	}
	if fs.NArg() > 0 {
		return Usagef("unexpected argument %q", fs.Arg(0))
	}
	return nil
}

// Given is the set of flags the command line set (flag defaults left
// alone are not in it).
func Given(fs *flag.FlagSet) map[string]bool {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	return set
}

// ParseFailed turns a flag-parsing outcome into the exit code: help is
// success, anything else a usage error printed without its "usage: "
// prefix. failed is false when the command should go on.
func ParseFailed(cmd string, err error, stderr io.Writer) (code int, failed bool) {
	switch {
	case err == nil:
		return ExitOK, false
	case errors.Is(err, flag.ErrHelp):
		return ExitOK, true
	}
	fmt.Fprintf(stderr, "kvbench %s: %s\n", cmd, strings.TrimPrefix(err.Error(), ErrUsage.Error()+": "))
	return ExitUsage, true
}

// Fail prints err as kvbench cmd's failure and returns code, so a command
// ends with `return cli.Fail(…)`.
func Fail(stderr io.Writer, cmd string, err error, code int) int {
	fmt.Fprintf(stderr, "kvbench %s: %v\n", cmd, err)
	return code
}

// WriteJSON writes v as indented JSON and a newline. HTML characters are
// left as they are: the reports hold rules such as ">= one block".
func WriteJSON(w io.Writer, v any) error {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return fmt.Errorf("encode JSON: %w", err)
	}
	_, err := w.Write(b.Bytes())
	return err
}

// WriteJSONFile writes v as WriteJSON does to the file at path. It
// encodes before creating the file, so a value that cannot be encoded
// leaves no truncated file behind.
func WriteJSONFile(path string, v any) error {
	var b bytes.Buffer
	if err := WriteJSON(&b, v); err != nil {
		return err
	}
	if err := os.WriteFile(path, b.Bytes(), 0o644); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}
