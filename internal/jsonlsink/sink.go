// Package jsonlsink writes values as JSON lines to a file rotated by size,
// off the caller's goroutine: the decision log's file and the traffic
// capture share it.
package jsonlsink

import (
	"bufio"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
)

// Sink writes values of T as JSON lines to a file, rotated by size: when the next line would take the file past MaxBytes, path is
// renamed path.1 (path.1 to path.2, …, the oldest of Keep dropped) and a
// new file begins. Writing happens on its own goroutine behind a bounded
// queue, so a slow disk never holds up a request: when the queue is full
// the value is dropped and counted (Dropped), never waited for.
type Sink[T any] struct {
	what     string // names the sink in errors and logs ("decision log")
	path     string
	maxBytes int64
	keep     int
	log      *slog.Logger

	queue   chan *T
	done    chan struct{}
	dropped atomic.Uint64
	written atomic.Uint64

	mu   sync.Mutex // guards f, w, size (the writer goroutine and Close)
	f    *os.File
	w    *bufio.Writer
	size int64
}

// Queue is how many values may wait for the writer.
const Queue = 4096

// Open opens (appends to) path; what names the sink in errors and logs.
// maxBytes ≤ 0 means 64 MiB; keep < 1 means 3 rotated files.
func Open[T any](path, what string, maxBytes int64, keep int, log *slog.Logger) (*Sink[T], error) {
	if maxBytes <= 0 {
		maxBytes = 64 << 20
	}
	if keep < 1 {
		keep = 3
	}
	if log == nil {
		log = slog.Default()
	}
	s := &Sink[T]{what: what, path: path, maxBytes: maxBytes, keep: keep, log: log, queue: make(chan *T, Queue), done: make(chan struct{})}
	if err := s.open(); err != nil {
		return nil, err
	}
	go s.run()
	return s, nil
}

func (s *Sink[T]) open() error {
	f, err := os.OpenFile(s.path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o640)
	if err != nil {
		return fmt.Errorf("%s: %w", s.what, err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return fmt.Errorf("%s: %w", s.what, err)
	}
	s.f, s.w, s.size = f, bufio.NewWriterSize(f, 64<<10), st.Size()
	return nil
}

// Write queues d (a value the caller no longer touches).
func (s *Sink[T]) Write(d *T) {
	select {
	case s.queue <- d:
	default:
		s.dropped.Add(1)
	}
}

func (s *Sink[T]) run() {
	defer close(s.done)
	for d := range s.queue {
		line, err := json.Marshal(d)
		if err != nil {
			s.log.Error(s.what+": encode", "err", err)
			continue
		}
		line = append(line, '\n')
		s.mu.Lock()
		if err := s.writeLine(line); err != nil {
			s.log.Error(s.what+": write", "path", s.path, "err", err)
		}
		if len(s.queue) == 0 { // idle: what is buffered reaches the file
			_ = s.w.Flush()
		}
		s.mu.Unlock()
	}
}

// writeLine: s.mu must be held.
func (s *Sink[T]) writeLine(line []byte) error {
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
func (s *Sink[T]) rotate() error {
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
func (s *Sink[T]) Close() error {
	close(s.queue)
	<-s.done
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.w.Flush(); err != nil {
		return err
	}
	return s.f.Close()
}

// Dropped is how many values the full queue turned away.
func (s *Sink[T]) Dropped() uint64 { return s.dropped.Load() }

// Written is how many values reached the file.
func (s *Sink[T]) Written() uint64 { return s.written.Load() }
