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
	"net/textproto"
	"net/url"
	"strconv"
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

	mu      sync.Mutex
	pools   map[string][]*workerConn // by scheme://host:port; the most recently used last
	targets map[string]*workerTarget // parsed base URLs (Post)
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
		maxIdle: maxIdle, writeBuf: writeBuf, pools: make(map[string][]*workerConn), targets: make(map[string]*workerTarget)}
}

// workerTarget is a worker's base URL, parsed once (targets).
type workerTarget struct {
	key      string // the pool: scheme://host:port
	addr     string // host:port to dial
	host     string // for the Host header
	hostname string // without the port: the TLS server name
	path     string // the base URL's path, before each request's
}

// maxTargets bounds the parsed base URLs kept (workers come and go; the
// registry's cap is far below).
const maxTargets = 4096

// target parses base (a registered worker URL) or returns it parsed.
func (t *workerTransport) target(base string) (*workerTarget, error) {
	t.mu.Lock()
	wt := t.targets[base]
	t.mu.Unlock()
	if wt != nil {
		return wt, nil
	}
	u, err := url.Parse(base)
	if err != nil {
		return nil, err
	}
	if wt, err = urlTarget(u); err != nil {
		return nil, err
	}
	t.mu.Lock()
	if len(t.targets) >= maxTargets {
		clear(t.targets)
	}
	t.targets[base] = wt
	t.mu.Unlock()
	return wt, nil
}

func urlTarget(u *url.URL) (*workerTarget, error) {
	if u == nil || u.Host == "" {
		return nil, errors.New("request without a host")
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
		return nil, fmt.Errorf("unsupported scheme %q", u.Scheme)
	}
	addr := net.JoinHostPort(u.Hostname(), port)
	return &workerTarget{key: u.Scheme + "://" + addr, addr: addr, host: u.Host, hostname: u.Hostname(), path: strings.TrimSuffix(u.EscapedPath(), "/")}, nil
}

// errWrite marks a failure to write the request: the worker cannot have
// read it whole, so it started no work (sendFailure's "not written").
type errWrite struct{ err error }

func (e *errWrite) Error() string { return "writing the request: " + e.err.Error() }
func (e *errWrite) Unwrap() error { return e.err }

// sentRequest is a request written to a worker whose answer is not read
// yet: Answer reads it.
type sentRequest struct {
	wc   *workerConn
	ctx  context.Context
	req  *http.Request
	stop func() bool  // ends the context's hold on the connection
	post http.Request // req when the request was written by hand (Post)
}

// RoundTrip is http.RoundTripper's: the request written by
// http.Request.Write, then Answer.
func (t *workerTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Body != nil {
		defer req.Body.Close()
	}
	wt, err := urlTarget(req.URL)
	if err != nil {
		return nil, &errWrite{err: err}
	}
	replay := req.Body == nil || req.Body == http.NoBody || req.GetBody != nil
	first := true
	sr, err := t.send(req.Context(), wt, replay, func(bw *bufio.Writer) error {
		if !first {
			body, err := req.GetBody()
			if err != nil {
				return err
			}
			req.Body = body
		}
		first = false
		return req.Write(bw)
	})
	if err != nil {
		return nil, err
	}
	sr.req = req
	return sr.Answer()
}

// Post writes a POST of body to base+path with header h (and Host,
// Content-Length, a User-Agent when h has none), by hand: the proxy's
// request, without an http.Request or its allocations. Header names and
// values are checked as http.Transport checks them (a value with a line
// break would split the request). An error wrapping *errWrite means the
// request did not go out whole.
func (t *workerTransport) Post(ctx context.Context, base, path string, h http.Header, body []byte) (*sentRequest, error) {
	wt, err := t.target(base)
	if err != nil {
		return nil, &errWrite{err: err}
	}
	for name, vs := range h {
		if !validHeaderName(name) {
			return nil, &errWrite{err: fmt.Errorf("invalid header field name %q", name)}
		}
		for _, v := range vs {
			if !validHeaderValue(v) {
				return nil, &errWrite{err: fmt.Errorf("invalid header field value for %q", name)}
			}
		}
	}
	sr, err := t.send(ctx, wt, true, func(bw *bufio.Writer) error {
		bw.WriteString("POST ")
		if wt.path == "" && path == "" {
			bw.WriteByte('/')
		}
		bw.WriteString(wt.path)
		bw.WriteString(path)
		bw.WriteString(" HTTP/1.1\r\nHost: ")
		bw.WriteString(wt.host)
		bw.WriteString("\r\n")
		if _, ok := h["User-Agent"]; !ok {
			bw.WriteString("User-Agent: Go-http-client/1.1\r\n")
		}
		bw.WriteString("Content-Length: ")
		var n [20]byte
		bw.Write(strconv.AppendInt(n[:0], int64(len(body)), 10))
		bw.WriteString("\r\n")
		for name, vs := range h {
			for _, v := range vs {
				bw.WriteString(name)
				bw.WriteString(": ")
				bw.WriteString(textproto.TrimString(v))
				bw.WriteString("\r\n")
			}
		}
		bw.WriteString("\r\n")
		_, err := bw.Write(body)
		return err
	})
	if err != nil {
		return nil, err
	}
	sr.post.Method = http.MethodPost
	sr.req = &sr.post
	return sr, nil
}

// validHeaderName: a token (RFC 9110 §5.1), not one the request writes
// itself.
func validHeaderName(name string) bool {
	if name == "" || name == "Host" || name == "Content-Length" || name == "Transfer-Encoding" {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if c <= ' ' || c >= 0x7f || strings.IndexByte(`"(),/:;<=>?@[\]{}`, c) >= 0 {
			return false
		}
	}
	return true
}

// validHeaderValue: no control characters but tab (RFC 9110 §5.5).
func validHeaderValue(v string) bool {
	for i := 0; i < len(v); i++ {
		if c := v[i]; c < ' ' && c != '\t' || c == 0x7f {
			return false
		}
	}
	return true
}

// send writes a request with write on a kept-alive connection to wt, or a
// new one. replay says the request may be written again: a write that
// failed on a reused connection is then tried once more on a new one.
func (t *workerTransport) send(ctx context.Context, wt *workerTarget, replay bool, write func(*bufio.Writer) error) (*sentRequest, error) {
	for try := 0; ; try++ {
		wc := t.take(wt.key)
		if wc == nil {
			var err error
			if wc, err = t.connect(ctx, wt); err != nil {
				return nil, &errWrite{err: ctxErr(ctx, err)}
			}
		}
		// The request's context cuts the connection: a blocked write or
		// read returns, and the connection is not reused.
		stop := context.AfterFunc(ctx, func() { wc.conn.Close() })
		err := write(wc.bw)
		if err == nil {
			err = wc.bw.Flush()
		}
		if err == nil {
			return &sentRequest{wc: wc, ctx: ctx, stop: stop}, nil
		}
		stop()
		wc.close()
		// A reused connection may have been closed by the worker as it
		// was taken: the request reached no one, so it goes once more on
		// a new connection (as http.Transport retries a request on a
		// reused connection when nothing was written).
		if !wc.used || try > 0 || !replay || ctx.Err() != nil {
			return nil, &errWrite{err: ctxErr(ctx, err)}
		}
		wc.bw.Reset(io.Discard)
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

// Answer reads the answer's status and headers (at most headerTimeout);
// its body reads from the connection, which goes back to the pool once
// the body was read to its end and closed, or is closed when the body is
// closed earlier.
func (sr *sentRequest) Answer() (*http.Response, error) {
	wc, t := sr.wc, sr.wc.t
	fail := func(err error) (*http.Response, error) {
		sr.stop()
		wc.close()
		return nil, ctxErr(sr.ctx, err)
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
	// No body (204, 304, HEAD): the connection is free once closed.
	resp.Body = &workerBody{body: resp.Body, sr: sr, reuse: !resp.Close && !sr.req.Close, eof: resp.Body == http.NoBody}
	return resp, nil
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
		err = ctxErr(b.sr.ctx, err)
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
func (t *workerTransport) connect(ctx context.Context, wt *workerTarget) (*workerConn, error) {
	raw, err := t.dial(ctx, "tcp", wt.addr)
	if err != nil {
		return nil, err
	}
	conn := raw
	if strings.HasPrefix(wt.key, "https://") {
		conf := t.tls.Clone()
		if conf.ServerName == "" {
			conf.ServerName = wt.hostname
		}
		tc := tls.Client(raw, conf)
		if err := tc.HandshakeContext(ctx); err != nil {
			raw.Close()
			return nil, fmt.Errorf("TLS handshake: %w", err)
		}
		conn = tc
	}
	wc := &workerConn{t: t, key: wt.key, conn: conn, raw: raw, br: bufio.NewReader(conn), bw: bufio.NewWriterSize(conn, t.writeBuf)}
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
