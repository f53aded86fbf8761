package decisionlog

import (
	"bufio"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
)

// Sink writes completed decisions as JSON lines to a file, rotated by
// size: when the next line would take the file past MaxBytes, path is
// renamed path.1 (path.1 to path.2, …, the oldest of Keep dropped) and a
// new file begins. Writing happens on its own goroutine behind a bounded
// queue, so a slow disk never holds up a request: when the queue is full
// the decision is dropped and counted (Dropped), never waited for.
type Sink struct {
	path     string
	maxBytes int64
	keep     int
	log      *slog.Logger

	queue   chan *Decision
	done    chan struct{}
	dropped atomic.Uint64
	written atomic.Uint64

	mu   sync.Mutex // guards f, w, size (the writer goroutine and Close)
	f    *os.File
	w    *bufio.Writer
	size int64
}

// SinkQueue is how many decisions may wait for the writer.
const SinkQueue = 4096

// OpenSink opens (appends to) path. maxBytes ≤ 0 means 64 MiB; keep < 1
// means 3 rotated files.
func OpenSink(path string, maxBytes int64, keep int, log *slog.Logger) (*Sink, error) {
	if maxBytes <= 0 {
		maxBytes = 64 << 20
	}
	if keep < 1 {
		keep = 3
	}
	if log == nil {
		log = slog.Default()
	}
	s := &Sink{path: path, maxBytes: maxBytes, keep: keep, log: log, queue: make(chan *Decision, SinkQueue), done: make(chan struct{})}
	if err := s.open(); err != nil {
		return nil, err
	}
	go s.run()
	return s, nil
}

func (s *Sink) open() error {
	f, err := os.OpenFile(s.path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o640)
	if err != nil {
		return fmt.Errorf("decision log: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return fmt.Errorf("decision log: %w", err)
	}
	s.f, s.w, s.size = f, bufio.NewWriterSize(f, 64<<10), st.Size()
	return nil
}

// write queues d (a copy the caller no longer touches).
func (s *Sink) write(d *Decision) {
	select {
	case s.queue <- d:
	default:
		s.dropped.Add(1)
	}
}

func (s *Sink) run() {
	defer close(s.done)
	for d := range s.queue {
		line, err := json.Marshal(d)
		if err != nil {
			s.log.Error("decision log: encode", "err", err)
			continue
		}
		line = append(line, '\n')
		s.mu.Lock()
		if err := s.writeLine(line); err != nil {
			s.log.Error("decision log: write", "path", s.path, "err", err)
		}
		if len(s.queue) == 0 { // idle: what is buffered reaches the file
			_ = s.w.Flush()
		}
		s.mu.Unlock()
	}
}

// writeLine: s.mu must be held.
func (s *Sink) writeLine(line []byte) error {
	if s.size > 0 && s.size+int64(len(line)) > s.maxBytes {
		if err := s.rotate(); err != nil {
			return err
		}
	}
	n, err := s.w.Write(line)
	s.size += int64(n)
	if err == nil {
		s.written.Add(1)
	}
	return err
}

// rotate: s.mu must be held.
func (s *Sink) rotate() error {
	if err := s.w.Flush(); err != nil {
		return err
	}
	if err := s.f.Close(); err != nil {
		return err
	}
	_ = os.Remove(fmt.Sprintf("%s.%d", s.path, s.keep))
	for i := s.keep - 1; i >= 1; i-- {
		_ = os.Rename(fmt.Sprintf("%s.%d", s.path, i), fmt.Sprintf("%s.%d", s.path, i+1))
	}
	if err := os.Rename(s.path, s.path+".1"); err != nil {
		return fmt.Errorf("rotate: %w", err)
	}
	return s.open()
}

// Close writes what is queued and closes the file.
func (s *Sink) Close() error {
	close(s.queue)
	<-s.done
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.w.Flush(); err != nil {
		return err
	}
	return s.f.Close()
}

// Dropped is how many decisions the full queue turned away.
func (s *Sink) Dropped() uint64 { return s.dropped.Load() }

// Written is how many decisions reached the file.
func (s *Sink) Written() uint64 { return s.written.Load() }
