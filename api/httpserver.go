package api

import (
	"errors"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"time"
)

// ServerOptions are the connection bounds of a replica's HTTP server (the
// listener side; Config holds the request side). Zero values take the
// defaults named; see DESIGN.md, "Bounds".
type ServerOptions struct {
	// ReadHeaderTimeout bounds reading a request's headers (default 10 s).
	ReadHeaderTimeout time.Duration
	// BodyReadTimeout bounds reading a request's whole body, from the end
	// of its headers (default 30 s: 8 MiB, the body cap, at 2.2 Mbit/s).
	// A client trickling its body (slowloris) is cut when it passes. The
	// deadline is lifted once the body is read, so streamed answers, which
	// last minutes, are not cut.
	BodyReadTimeout time.Duration
	// IdleTimeout closes keep-alive connections idle this long (default
	// 120 s, above HAProxy's and the engines' keep-alive timeouts).
	IdleTimeout time.Duration
	// MaxHeaderBytes caps request headers (default 64 KiB; Go's default is
	// 1 MiB per request).
	MaxHeaderBytes int
	// Logger receives the server's own errors (TLS handshakes, bad
	// requests), at warn level; nil = slog.Default().
	Logger *slog.Logger
}

func (o ServerOptions) withDefaults() ServerOptions {
	if o.ReadHeaderTimeout <= 0 {
		o.ReadHeaderTimeout = 10 * time.Second
	}
	if o.BodyReadTimeout <= 0 {
		o.BodyReadTimeout = 30 * time.Second
	}
	if o.IdleTimeout <= 0 {
		o.IdleTimeout = 120 * time.Second
	}
	if o.MaxHeaderBytes <= 0 {
		o.MaxHeaderBytes = 64 << 10
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return o
}

// NewHTTPServer returns the *http.Server a replica serves h with: header,
// body and idle timeouts and a header size cap. No WriteTimeout: answers
// stream for minutes, and the proxy's own timeouts bound a hung worker.
func NewHTTPServer(h http.Handler, o ServerOptions) *http.Server {
	o = o.withDefaults()
	return &http.Server{
		Handler:           BodyDeadline(h, o.BodyReadTimeout),
		ReadHeaderTimeout: o.ReadHeaderTimeout,
		IdleTimeout:       o.IdleTimeout,
		MaxHeaderBytes:    o.MaxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(o.Logger.Handler(), slog.LevelWarn),
	}
}

// BodyDeadline wraps h so a request body must arrive within d: it sets
// the connection's read deadline when the request has a body and lifts it
// once the body is read to its end. (Go's ReadTimeout would do the first,
// but covers headers and body together and cannot be lifted for one
// request.) A trickling client's read fails with a timeout, the handler
// answers it as a bad body, and the connection closes. A handler that
// returns before the body's end leaves the deadline in place: the server
// then discards the rest of the body, and that must be bounded too (the
// next request on the connection gets fresh deadlines from the server).
func BodyDeadline(h http.Handler, d time.Duration) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body == nil || r.Body == http.NoBody || d <= 0 {
			h.ServeHTTP(w, r)
			return
		}
		rc := http.NewResponseController(w)
		if err := rc.SetReadDeadline(time.Now().Add(d)); err != nil {
			// Not a real connection (a test recorder): nothing to bound.
			h.ServeHTTP(w, r)
			return
		}
		b := &deadlineBody{body: r.Body, lift: func() { _ = rc.SetReadDeadline(time.Time{}) }}
		r.Body = b
		h.ServeHTTP(w, r)
	})
}

// deadlineBody lifts the connection's read deadline when the body ends:
// from then on the server reads the connection only to notice the client
// leaving, and a deadline there would cancel a streamed answer midway.
type deadlineBody struct {
	body io.ReadCloser
	lift func()
	once sync.Once
}

func (b *deadlineBody) liftOnce() { b.once.Do(b.lift) }

func (b *deadlineBody) Read(p []byte) (int, error) {
	n, err := b.body.Read(p)
	if errors.Is(err, io.EOF) {
		b.liftOnce()
	}
	return n, err
}

func (b *deadlineBody) Close() error { return b.body.Close() }
