package api

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
)

// workerTransport is the proxy's HTTP/1.1 client to the workers: a pool of
// kept-alive connections on which the goroutine that sends a request also
// writes it and reads its answer (issue 31 item 4). net/http's Transport
// hands each request to a writer goroutine of the connection and each
// answer's headers back from a reader goroutine: two goroutine wake-ups on
// the way to the first token (≈ 28 µs measured for the headers' hand-over
// alone on this project's 2-core machine), and no point between "written"
// and "answered" where the caller could do its bookkeeping while the worker
// computes. Here Send writes and returns; Answer reads the headers.
//
// What it keeps of net/http: the request is written by http.Request.Write
// and the answer read by http.ReadResponse (chunked and length-delimited
// bodies, trailers, "Connection: close", HTTP/1.0), so framing is the
// standard library's. What it does itself, as http.Transport does it: idle
// connections closed after idle (below the engines' keep-alive timeout,
// transport.go), a connection the worker closed while idle found before
// it is used (isAlive), a request whose write failed on a reused
// connection sent once more on a new one (nothing reached a worker able to
// read it: net/http's nothingWrittenError rule), the answer's headers
// awaited for at most headerTimeout, the request's context cutting the
// connection. Only HTTP/1.1 (http.Transport with a custom dialer and TLS
// configuration never negotiated HTTP/2 either), no proxies from the
// environment (none before), no compression (none before).
type workerTransport struct {
	dial          func(ctx context.Context, network, addr string) (net.Conn, error)
	tls           *tls.Config // for https:// workers; ServerName set per host
	headerTimeout time.Duration
	idle          time.Duration // idle connections are closed after this
	maxIdle       int           // per host
	writeBuf      int

	mu    sync.Mutex
	pools map[string][]*workerConn // by scheme://host:port; the most recently used last
}

// workerConn is one kept-alive connection to a worker.
type workerConn struct {
	t     *workerTransport
	key   string
	conn  net.Conn // TLS over raw for https://
	raw   net.Conn // the TCP connection (isAlive reads it)
	br    *bufio.Reader
	bw    *bufio.Writer
	timer *time.Timer // closes the connection after idle; stopped while in use
	used  bool        // it carried a request before
}

func newWorkerTransport(dial func(ctx context.Context, network, addr string) (net.Conn, error), tlsConf *tls.Config,
	headerTimeout, idle time.Duration, maxIdle, writeBuf int) *workerTransport {
	var conf *tls.Config
	if tlsConf != nil {
		conf = tlsConf.Clone()
	} else {
		conf = &tls.Config{}
	}
	if conf.ClientSessionCache == nil {
		// a reconnect (a worker that closed an idle connection) resumes
		// its TLS session instead of a full handshake
		conf.ClientSessionCache = tls.NewLRUClientSessionCache(256)
	}
	return &workerTransport{dial: dial, tls: conf, headerTimeout: max(headerTimeout, 0), idle: idle,
		maxIdle: maxIdle, writeBuf: writeBuf, pools: make(map[string][]*workerConn)}
}

// connKey is the pool a request's connection comes from.
func connKey(req *http.Request) (key, addr string, err error) {
	u := req.URL
	if u == nil || u.Host == "" {
		return "", "", errors.New("request without a host")
	}
	port := u.Port()
	switch u.Scheme {
	case "http":
		if port == "" {
			port = "80"
		}
	case "https":
		if port == "" {
			port = "443"
		}
	default:
		return "", "", fmt.Errorf("unsupported scheme %q", u.Scheme)
	}
	addr = net.JoinHostPort(u.Hostname(), port)
	return u.Scheme + "://" + addr, addr, nil
}

// errWrite marks a failure to write the request: the worker cannot have
// read it whole, so it started no work (sendFailure's "not written").
type errWrite struct{ err error }

func (e *errWrite) Error() string { return "writing the request: " + e.err.Error() }
func (e *errWrite) Unwrap() error { return e.err }

// sentRequest is a request written to a worker whose answer is not read
// yet: Answer reads it, or Abandon drops the connection.
type sentRequest struct {
	wc   *workerConn
	req  *http.Request
	stop func() bool // ends the context's hold on the connection
}

// RoundTrip is http.RoundTripper's: Send, then Answer.
func (t *workerTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	sr, err := t.Send(req)
	if err != nil {
		return nil, err
	}
	return sr.Answer()
}

// Send writes req on a kept-alive connection to its host, or a new one. It
// closes req.Body. An error wrapping *errWrite means the request did not
// go out whole (a dial, handshake or write failure).
func (t *workerTransport) Send(req *http.Request) (*sentRequest, error) {
	if req.Body != nil {
		defer req.Body.Close()
	}
	key, addr, err := connKey(req)
	if err != nil {
		return nil, &errWrite{err: err}
	}
	ctx := req.Context()
	for try := 0; ; try++ {
		wc := t.take(key)
		if wc == nil {
			if wc, err = t.connect(ctx, key, addr, req.URL.Hostname()); err != nil {
				return nil, &errWrite{err: ctxErr(ctx, err)}
			}
		}
		// The request's context cuts the connection: a blocked write or
		// read returns, and the connection is not reused.
		stop := context.AfterFunc(ctx, func() { wc.conn.Close() })
		if err = t.write(wc, req); err == nil {
			return &sentRequest{wc: wc, req: req, stop: stop}, nil
		}
		stop()
		wc.close()
		// A reused connection may have been closed by the worker as it
		// was taken: the request did not reach anyone, so it goes once
		// more on a new connection (as http.Transport retries a request
		// on a reused connection when nothing was written).
		if !wc.used || try > 0 || ctx.Err() != nil || req.GetBody == nil && req.Body != nil && req.Body != http.NoBody {
			return nil, &errWrite{err: ctxErr(ctx, err)}
		}
		if req.GetBody != nil {
			body, gerr := req.GetBody()
			if gerr != nil {
				return nil, &errWrite{err: err}
			}
			req.Body = body
		}
	}
}

// ctxErr prefers the context's error, as http.Transport reports a
// cancelled request.
func ctxErr(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("%w (%w)", cerr, err)
	}
	return err
}

// write sends req whole: one write when it fits the buffer.
func (t *workerTransport) write(wc *workerConn, req *http.Request) error {
	if err := req.Write(wc.bw); err != nil {
		return err
	}
	return wc.bw.Flush()
}

// Answer reads the answer's status and headers (at most headerTimeout);
// its body reads from the connection, which goes back to the pool once
// the body was read to its end and closed, or is closed when the body is
// closed earlier.
func (sr *sentRequest) Answer() (*http.Response, error) {
	wc, t := sr.wc, sr.wc.t
	fail := func(err error) (*http.Response, error) {
		sr.stop()
		wc.close()
		return nil, ctxErr(sr.req.Context(), err)
	}
	if t.headerTimeout > 0 {
		wc.conn.SetReadDeadline(time.Now().Add(t.headerTimeout))
	}
	var resp *http.Response
	for {
		var err error
		resp, err = http.ReadResponse(wc.br, sr.req)
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				err = fmt.Errorf("timeout awaiting response headers: %w", err)
			}
			return fail(err)
		}
		// 1xx answers before the real one (100 Continue, 103 Early
		// Hints) are skipped, as http.Transport skips them.
		if resp.StatusCode < 100 || resp.StatusCode >= 200 || resp.StatusCode == http.StatusSwitchingProtocols {
			break
		}
	}
	if resp.StatusCode == http.StatusSwitchingProtocols {
		return fail(errors.New("worker switched protocols"))
	}
	if t.headerTimeout > 0 {
		wc.conn.SetReadDeadline(time.Time{})
	}
	resp.Body = &workerBody{body: resp.Body, sr: sr, reuse: !resp.Close && !sr.req.Close}
	return resp, nil
}

// Abandon drops a sent request without reading its answer.
func (sr *sentRequest) Abandon() {
	sr.stop()
	sr.wc.close()
}

// workerBody is an answer's body: at its end, the connection returns to
// the pool; closed before it, the connection is closed (reading the rest
// of a stream the client left would take as long as the generation).
type workerBody struct {
	body  io.ReadCloser
	sr    *sentRequest
	reuse bool
	eof   bool
	done  bool
}

func (b *workerBody) Read(p []byte) (int, error) {
	if b.done {
		return 0, errors.New("read on a closed body")
	}
	n, err := b.body.Read(p)
	if err == io.EOF {
		b.eof = true
	} else if err != nil {
		err = ctxErr(b.sr.req.Context(), err)
	}
	return n, err
}

func (b *workerBody) Close() error {
	if b.done {
		return nil
	}
	b.done = true
	wc := b.sr.wc
	// stop is false when the context already closed the connection.
	if b.sr.stop() && b.eof && b.reuse && wc.br.Buffered() == 0 {
		wc.t.put(wc)
		return nil
	}
	wc.close()
	return nil
}

// connect dials addr (TLS for https://, checking host's certificate).
func (t *workerTransport) connect(ctx context.Context, key, addr, host string) (*workerConn, error) {
	raw, err := t.dial(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	conn := raw
	if strings.HasPrefix(key, "https://") {
		conf := t.tls.Clone()
		if conf.ServerName == "" {
			conf.ServerName = host
		}
		tc := tls.Client(raw, conf)
		if err := tc.HandshakeContext(ctx); err != nil {
			raw.Close()
			return nil, fmt.Errorf("TLS handshake: %w", err)
		}
		conn = tc
	}
	wc := &workerConn{t: t, key: key, conn: conn, raw: raw, br: bufio.NewReader(conn), bw: bufio.NewWriterSize(conn, t.writeBuf)}
	wc.timer = time.AfterFunc(t.idle, wc.expire)
	wc.timer.Stop()
	return wc, nil
}

// take returns an idle connection to key that is still open, or nil.
func (t *workerTransport) take(key string) *workerConn {
	for {
		t.mu.Lock()
		pool := t.pools[key]
		if len(pool) == 0 {
			t.mu.Unlock()
			return nil
		}
		wc := pool[len(pool)-1]
		pool[len(pool)-1] = nil
		t.pools[key] = pool[:len(pool)-1]
		t.mu.Unlock()
		wc.timer.Stop()
		if isAlive(wc.raw) {
			wc.used = true
			return wc
		}
		wc.conn.Close()
	}
}

// put keeps wc for the next request to its host, or closes it when the
// pool is full.
func (t *workerTransport) put(wc *workerConn) {
	t.mu.Lock()
	pool := t.pools[wc.key]
	if len(pool) >= t.maxIdle {
		t.mu.Unlock()
		wc.conn.Close()
		return
	}
	t.pools[wc.key] = append(pool, wc)
	wc.timer.Reset(t.idle)
	t.mu.Unlock()
}

// expire closes wc if it is still idle (the idle timer).
func (wc *workerConn) expire() {
	t := wc.t
	t.mu.Lock()
	pool := t.pools[wc.key]
	for i, c := range pool {
		if c == wc {
			t.pools[wc.key] = append(pool[:i], pool[i+1:]...)
			t.mu.Unlock()
			wc.conn.Close()
			return
		}
	}
	t.mu.Unlock() // taken meanwhile: in use, not idle
}

func (wc *workerConn) close() {
	wc.timer.Stop()
	wc.conn.Close()
}

// CloseIdleConnections closes every idle connection (http.Client calls it
// through its own CloseIdleConnections).
func (t *workerTransport) CloseIdleConnections() {
	t.mu.Lock()
	pools := t.pools
	t.pools = make(map[string][]*workerConn)
	t.mu.Unlock()
	for _, pool := range pools {
		for _, wc := range pool {
			wc.close()
		}
	}
}
