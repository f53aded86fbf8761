// Package progress shows how far a long kvbench run has got, on stderr
// only (stdout and the JSON reports are parsed by other tools): a progress
// bar (github.com/schollz/progressbar) when stderr is a terminal, else a
// plain line now and then, for CI logs and pipes.
//
// The run counts its work itself (an atomic counter, say) and the meter
// polls it, so the hot loops pay for no lock and no call.
package progress

import (
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

// DefaultEvery is how often the plain line is printed when stderr is not
// a terminal: rare enough to keep a CI log short, often enough to show a
// long run is alive.
const DefaultEvery = 10 * time.Second

// Meter describes a run's progress.
type Meter struct {
	Name  string       // who is talking, e.g. "kvbench sim"
	Unit  string       // what Count counts, e.g. "requests"
	Total int64        // Count when done; ≤ 0 if unknown
	Count func() int64 // work done so far; called from another goroutine
	// Detail, when set, is appended to the line (the bar's description);
	// called from another goroutine.
	Detail func() string
}

// Options say how progress is shown.
type Options struct {
	// Bar draws a progress bar (stderr is a terminal) when the total is
	// known; otherwise a line every Every.
	Bar   bool
	Every time.Duration // 0: DefaultEvery

	tick <-chan time.Time // a test's ticks in place of the ticker
}

// Flags are the --progress flags every long kvbench command takes.
type Flags struct {
	Often bool          // --progress: a line every second
	Every time.Duration // --progress-every
}

// Register defines --progress and --progress-every on fs.
func (f *Flags) Register(fs *flag.FlagSet) {
	fs.BoolVar(&f.Often, "progress", false, "when stderr is not a terminal, print the progress line every second (as --progress-every 1s)")
	fs.DurationVar(&f.Every, "progress-every", DefaultEvery, "when stderr is not a terminal, print a progress line this often (a terminal gets a progress bar)")
}

// Check refuses a non-positive --progress-every.
func (f *Flags) Check() error {
	if f.Every <= 0 {
		return fmt.Errorf("--progress-every %v: must be positive", f.Every)
	}
	return nil
}

// Options are the options for w: a bar if w is a terminal, else a line
// every --progress-every, or every second with --progress.
func (f *Flags) Options(w io.Writer) Options {
	o := Options{Bar: IsTerminal(w), Every: f.Every}
	if f.Often {
		o.Every = time.Second
	}
	return o
}

// IsTerminal reports whether w is a terminal (not a file, pipe or
// /dev/null, which is a character device too).
func IsTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// Start shows m's progress on w until the returned stop is called; stop
// clears the bar (the plain line prints nothing more) and may be called
// more than once.
func Start(w io.Writer, m Meter, o Options) (stop func()) {
	quit := make(chan struct{})
	done := make(chan struct{})
	if o.Bar && m.Total > 0 {
		go runBar(w, m, o.tick, quit, done)
	} else {
		go runLines(w, m, o.Every, o.tick, quit, done)
	}
	return sync.OnceFunc(func() {
		close(quit)
		<-done
	})
}

// barRefresh is how often the bar polls the count and redraws.
const barRefresh = 200 * time.Millisecond

// ticks is tick, or a ticker's channel every period when tick is nil; stop
// stops that ticker.
func ticks(tick <-chan time.Time, period time.Duration) (c <-chan time.Time, stop func()) {
	if tick != nil {
		return tick, func() {}
	}
	t := time.NewTicker(period)
	return t.C, t.Stop
}

func runBar(w io.Writer, m Meter, tick <-chan time.Time, quit <-chan struct{}, done chan<- struct{}) {
	defer close(done)
	opts := []progressbar.Option{
		progressbar.OptionSetWriter(w),
		progressbar.OptionSetDescription(m.Name),
		progressbar.OptionSetItsString(m.Unit),
		progressbar.OptionShowCount(),
		progressbar.OptionSetElapsedTime(true),
		progressbar.OptionSetPredictTime(true),
		progressbar.OptionSetWidth(25),
		progressbar.OptionThrottle(barRefresh / 2),
		progressbar.OptionClearOnFinish(),
		progressbar.OptionSetRenderBlankState(true), // the rate counts from now, not from the first poll
	}
	if m.Detail == nil {
		// The rate, unless a detail takes the room (a bar line must not
		// wrap, or redrawing it leaves a trail).
		opts = append(opts, progressbar.OptionShowIts())
	}
	bar := progressbar.NewOptions64(m.Total, opts...)
	tick, stop := ticks(tick, barRefresh)
	defer stop()
	update := func() {
		if m.Detail != nil {
			bar.Describe(m.Name + ": " + m.Detail())
		}
		_ = bar.Set64(m.Count()) // the bar's write errors are not the run's
	}
	for {
		select {
		case <-quit:
			update()
			_ = bar.Finish() // clears the line (OptionClearOnFinish)
			return
		case <-tick:
			update()
		}
	}
}

func runLines(w io.Writer, m Meter, every time.Duration, tick <-chan time.Time, quit <-chan struct{}, done chan<- struct{}) {
	defer close(done)
	if every <= 0 {
		every = DefaultEvery
	}
	start := time.Now()
	tick, stop := ticks(tick, every)
	defer stop()
	for {
		select {
		case <-quit:
			return
		case <-tick:
			fmt.Fprintln(w, Line(m, time.Since(start)))
		}
	}
}

// Line is the plain progress line after elapsed: count, share of the
// total and an estimate of the time left when the total is known, then
// the detail.
func Line(m Meter, elapsed time.Duration) string {
	n := m.Count()
	var b strings.Builder
	fmt.Fprintf(&b, "%s: ", m.Name)
	if m.Total > 0 {
		fmt.Fprintf(&b, "%d/%d %s (%.0f%%)", n, m.Total, m.Unit, 100*float64(n)/float64(m.Total))
	} else {
		fmt.Fprintf(&b, "%d %s", n, m.Unit)
	}
	fmt.Fprintf(&b, ", %s elapsed", elapsed.Round(time.Second))
	if m.Total > 0 && n > 0 && n < m.Total {
		left := time.Duration(float64(elapsed) * float64(m.Total-n) / float64(n))
		fmt.Fprintf(&b, ", about %s left", left.Round(time.Second))
	}
	if m.Detail != nil {
		if d := m.Detail(); d != "" {
			b.WriteString(", ")
			b.WriteString(d)
		}
	}
	return b.String()
}
