package progress

import (
	"bytes"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/syncbuf"
)

func TestLine(t *testing.T) {
	count := func(n int64) func() int64 { return func() int64 { return n } }
	for _, tc := range []struct {
		name string
		m    Meter
		want string
	}{
		{"known total", Meter{Name: "kvbench sim", Unit: "requests", Total: 400, Count: count(100)},
			"kvbench sim: 100/400 requests (25%), 10s elapsed, about 30s left"},
		{"nothing done yet", Meter{Name: "kvbench sim", Unit: "requests", Total: 400, Count: count(0)},
			"kvbench sim: 0/400 requests (0%), 10s elapsed"},
		{"done", Meter{Name: "kvbench disagg", Unit: "runs", Total: 8, Count: count(8)},
			"kvbench disagg: 8/8 runs (100%), 10s elapsed"},
		{"unknown total, detail", Meter{Name: "kvbench ingest", Unit: "events", Count: count(7), Detail: func() string { return "acked 5" }},
			"kvbench ingest: 7 events, 10s elapsed, acked 5"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Line(tc.m, 10*time.Second); got != tc.want {
				t.Errorf("got  %q\nwant %q", got, tc.want)
			}
		})
	}
}

// captureStdout runs f with os.Stdout redirected and returns what was
// written to it.
func captureStdout(t *testing.T, f func()) string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	old := os.Stdout
	os.Stdout = w
	defer func() { os.Stdout = old }()
	var out bytes.Buffer
	copied := make(chan struct{})
	go func() { io.Copy(&out, r); close(copied) }()
	f()
	w.Close()
	<-copied
	return out.String()
}

// Progress goes to the writer it is given, never to stdout: a plain
// line per tick on a non-terminal, a bar that is cleared at the end on a
// terminal. The test drives the ticks itself (an unbuffered channel: each
// send returns once the meter has taken the tick), so the line count is
// exact and nothing depends on the machine's speed.
func TestStartWritesOnlyToItsWriter(t *testing.T) {
	const ticks = 3
	for _, tc := range []struct {
		name  string
		opt   Options
		check func(t *testing.T, out string)
	}{
		{"lines", Options{Every: time.Hour}, func(t *testing.T, out string) {
			lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
			if len(lines) != ticks {
				t.Fatalf("%d lines after %d ticks:\n%s", len(lines), ticks, out)
			}
			for _, l := range lines {
				if !strings.HasPrefix(l, "kvbench test: ") || !strings.Contains(l, "/1000 requests (") || strings.ContainsAny(l, "\r\x1b") {
					t.Errorf("line %q", l)
				}
			}
			if last := lines[ticks-1]; !strings.Contains(last, " 30/1000 requests (3%)") {
				t.Errorf("last line %q, want the count at the last tick (30/1000)", last)
			}
		}},
		{"bar", Options{Bar: true}, func(t *testing.T, out string) {
			if !strings.Contains(out, "kvbench test") || !strings.Contains(out, "/1000") || !strings.Contains(out, "\r") {
				t.Errorf("no bar drawn: %q", out)
			}
			// Cleared at the end: the last thing written is a line of
			// spaces between carriage returns.
			if i := strings.LastIndex(out, "\r"); i < 0 || strings.TrimSpace(out[strings.LastIndex(out[:i], "\r")+1:i]) != "" {
				t.Errorf("bar not cleared at the end: %q", out[max(0, len(out)-120):])
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var n atomic.Int64
			var w syncbuf.Buffer
			tick := make(chan time.Time)
			opt := tc.opt
			opt.tick = tick
			stdout := captureStdout(t, func() {
				stop := Start(&w, Meter{Name: "kvbench test", Unit: "requests", Total: 1000, Count: n.Load}, opt)
				for range ticks {
					n.Add(10)
					tick <- time.Now()
				}
				stop()
				stop() // idempotent
			})
			if stdout != "" {
				t.Errorf("stdout: %q", stdout)
			}
			out := w.String()
			tc.check(t, out)
			// Stopped: nobody takes a tick any more, nothing more is written.
			select {
			case tick <- time.Now():
				t.Error("a tick was taken after stop")
			default:
			}
			if after := w.String(); after != out {
				t.Errorf("written after stop: %q", after[len(out):])
			}
		})
	}
}

func TestIsTerminal(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "log"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	for name, w := range map[string]io.Writer{"file": f, "/dev/null": null, "buffer": &bytes.Buffer{}} {
		if IsTerminal(w) {
			t.Errorf("%s is a terminal", name)
		}
	}
	for _, tc := range []struct {
		args []string
		want Options
		err  bool
	}{
		{nil, Options{Every: DefaultEvery}, false},
		{[]string{"--progress"}, Options{Every: time.Second}, false},
		{[]string{"--progress-every", "1m"}, Options{Every: time.Minute}, false},
		{[]string{"--progress-every", "0s"}, Options{}, true},
	} {
		var f Flags
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		f.Register(fs)
		if err := fs.Parse(tc.args); err != nil {
			t.Fatal(err)
		}
		if err := f.Check(); (err != nil) != tc.err {
			t.Errorf("%q: check %v", tc.args, err)
			continue
		}
		if o := f.Options(null); !tc.err && o != tc.want {
			t.Errorf("%q on /dev/null: %+v, want %+v", tc.args, o, tc.want)
		}
	}
}
