package figures

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// ErrDrift is returned by Run in check mode when a figure in the file is
// not what its command produces now.
var ErrDrift = errors.New("figures differ from what their commands produce")

// Output is what a figure's command left: its scratch directory (the JSON
// files it wrote) and its stdout.
type Output struct {
	Dir    string
	Stdout string
}

// Runner runs a figure's command block.
type Runner struct {
	// Kvbench is the binary that `kvbench` in a command means.
	Kvbench string
	// Stderr receives the commands' stderr (progress lines); nil keeps it
	// and prints its tail only when a command fails.
	Stderr io.Writer
	// Keep leaves the scratch directories in place (their paths are logged).
	Keep bool
	Log  *slog.Logger
}

// run executes b's command in a fresh scratch directory. The returned
// cleanup removes the directory unless Keep is set.
func (r Runner) run(ctx context.Context, b Block) (Output, func(), error) {
	dir, err := os.MkdirTemp("", "kvbench-figure-"+b.Name+"-")
	if err != nil {
		return Output{}, nil, fmt.Errorf("figure %s: scratch directory: %w", b.Name, err)
	}
	cleanup := func() {
		if r.Keep {
			r.Log.Info("scratch directory kept", "figure", b.Name, "dir", dir)
			return
		}
		os.RemoveAll(dir)
	}
	fail := func(err error) (Output, func(), error) {
		cleanup()
		return Output{}, nil, fmt.Errorf("figure %s: %w", b.Name, err)
	}
	bin := filepath.Join(dir, ".bin")
	if err := os.Mkdir(bin, 0o755); err != nil {
		return fail(err)
	}
	if err := os.Symlink(r.Kvbench, filepath.Join(bin, "kvbench")); err != nil {
		return fail(err)
	}
	// Commands that plot write under docs/ as they do in the repository;
	// here the PNGs land in the scratch directory and are discarded.
	for _, d := range []string{"docs/plots"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return fail(err)
		}
	}
	for _, p := range slices.Sorted(maps.Keys(b.Files)) {
		if err := os.WriteFile(filepath.Join(dir, p), []byte(b.Files[p]), 0o644); err != nil {
			return fail(err)
		}
	}
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "bash", "-c", "set -eo pipefail\n"+b.Command)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "PATH="+bin+string(os.PathListSeparator)+os.Getenv("PATH"))
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if r.Stderr != nil {
		cmd.Stderr = io.MultiWriter(&stderr, r.Stderr)
	}
	t0 := time.Now()
	r.Log.Info("running", "figure", b.Name)
	if err := cmd.Run(); err != nil {
		return fail(fmt.Errorf("command failed: %w\n%s", err, tail(stderr.String(), 20)))
	}
	r.Log.Info("ran", "figure", b.Name, "seconds", fmt.Sprintf("%.1f", time.Since(t0).Seconds()))
	return Output{Dir: dir, Stdout: stdout.String()}, cleanup, nil
}

func tail(s string, n int) string {
	ls := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(ls) > n {
		ls = ls[len(ls)-n:]
	}
	return strings.Join(ls, "\n")
}

// Options are one kvbench figures run.
type Options struct {
	File   string   // the Markdown file
	Only   []string // figure names; empty = every figure in the file
	Write  bool     // rewrite the file; otherwise check it
	Runner Runner
	// Report receives the diffs (check) or the names rewritten (write).
	Report io.Writer
}

// Run regenerates the figures of o.File. In check mode it returns ErrDrift
// (after printing every difference) when a figure differs; in write mode
// it rewrites only the figures' bodies, reading the file again just before
// writing so that edits made meanwhile to the rest of it are kept.
func Run(ctx context.Context, o Options) error {
	doc, err := os.ReadFile(o.File)
	if err != nil {
		return err
	}
	blocks, err := Parse(doc)
	if err != nil {
		return fmt.Errorf("%s: %w", o.File, err)
	}
	reg := map[string]Figure{}
	for _, f := range Registry() {
		reg[f.Name] = f
	}
	for _, b := range blocks {
		if _, ok := reg[b.Name]; !ok {
			return fmt.Errorf("%s:%d: figure %s has no formatter (Registry)", o.File, b.Line, b.Name)
		}
	}
	selected := blocks
	if len(o.Only) > 0 {
		selected = nil
		for _, n := range o.Only {
			i := slices.IndexFunc(blocks, func(b Block) bool { return b.Name == n })
			if i < 0 {
				return fmt.Errorf("%s: no figure %q (kvbench figures --list)", o.File, n)
			}
			selected = append(selected, blocks[i])
		}
	}
	drift := 0
	// A command that makes several figures runs once.
	outputs := map[string]Output{}
	for _, b := range selected {
		key := runKey(b)
		out, ok := outputs[key]
		if !ok {
			var cleanup func()
			var err error
			out, cleanup, err = o.Runner.run(ctx, b)
			if err != nil {
				return err
			}
			defer cleanup()
			outputs[key] = out
		}
		body, err := reg[b.Name].Format(out)
		if err != nil {
			return fmt.Errorf("figure %s: format: %w", b.Name, err)
		}
		if !strings.HasSuffix(body, "\n") {
			body += "\n"
		}
		if body == b.Body {
			fmt.Fprintf(o.Report, "figure %s: unchanged\n", b.Name)
			continue
		}
		if !o.Write {
			drift++
			fmt.Fprintf(o.Report, "figure %s (%s:%d) differs from what its command produces now:\n%s",
				b.Name, o.File, b.Line, Diff(b.Body, body))
			continue
		}
		if err := rewrite(o.File, b.Name, body); err != nil {
			return err
		}
		fmt.Fprintf(o.Report, "figure %s: rewritten\n", b.Name)
	}
	if drift > 0 {
		return fmt.Errorf("%w: %d of %d (run `kvbench figures --write` and say in the section what changed and why)",
			ErrDrift, drift, len(selected))
	}
	return nil
}

// runKey identifies a command and the files it is given.
func runKey(b Block) string {
	var k strings.Builder
	k.WriteString(b.Command)
	for _, p := range slices.Sorted(maps.Keys(b.Files)) {
		k.WriteString("\x00" + p + "\x00" + b.Files[p])
	}
	return k.String()
}

// rewrite replaces one figure's body in the file as it is on disk now.
func rewrite(path, name, body string) error {
	doc, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	out, err := Replace(doc, name, body)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	tmp := path + ".figures.tmp"
	if err := os.WriteFile(tmp, out, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
