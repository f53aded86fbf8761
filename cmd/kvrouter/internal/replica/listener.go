package replica

import (
	"bufio"
	"crypto/tls"
	"errors"
	"net"
	"sync"
	"time"
)

// tlsRecordHandshake is the first byte of every TLS connection (a
// handshake record carrying the ClientHello); an HTTP/1 request starts
// with a method's letter and HTTP/2 prior knowledge with 'P', so one byte
// tells them apart.
const tlsRecordHandshake = 0x16

// plainRefusal answers a plaintext request on a port that takes TLS only,
// as net/http's own TLS server does, so a curl with http:// learns why.
const plainRefusal = "HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\nthis port takes HTTPS only (the replica has TLS material; plaintext is accepted on loopback or with --allow-plain-http)\n"

// sniffListener serves HTTPS and, when plain is set, plaintext HTTP on one
// port: it peeks at each connection's first byte and hands the server a
// *tls.Conn for a TLS client (net/http then runs the handshake and fills
// Request.TLS, which the cluster endpoints read the peer's certificate
// from) or the connection itself for a plaintext one.
//
// Why one port: the contract is one HTTP port per replica, and the local
// cluster's clients (HAProxy's checks, the acceptance scripts, curl) speak
// http:// to it on loopback, while replicas must reach each other's
// /cluster/ endpoints with their certificates. A plaintext request never
// carries a certificate, so /cluster/* refuses it whatever the port
// (cluster.Handler: "not a TLS connection"); SECURITY.md has the rest.
//
// Peeking runs on a goroutine per connection, bounded by timeout, so a
// silent client holds its own goroutine only (as net/http's
// ReadHeaderTimeout bounds it), never the accept loop.
type sniffListener struct {
	net.Listener
	tls     *tls.Config
	plain   bool
	timeout time.Duration

	conns chan net.Conn
	errc  chan error
	done  chan struct{}
	once  sync.Once
}

func newSniffListener(ln net.Listener, conf *tls.Config, plain bool, timeout time.Duration) *sniffListener {
	l := &sniffListener{Listener: ln, tls: conf, plain: plain, timeout: timeout,
		conns: make(chan net.Conn), errc: make(chan error, 1), done: make(chan struct{})}
	go l.acceptLoop()
	return l
}

func (l *sniffListener) acceptLoop() {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue // transient (EMFILE surfaces as a temporary error); http.Server backs off itself
			}
			l.errc <- err
			return
		}
		go l.classify(c)
	}
}

func (l *sniffListener) classify(c net.Conn) {
	_ = c.SetReadDeadline(time.Now().Add(l.timeout))
	br := bufio.NewReader(c)
	first, err := br.Peek(1)
	_ = c.SetReadDeadline(time.Time{})
	if err != nil {
		c.Close() // connected and said nothing in time, or hung up
		return
	}
	pc := &peekedConn{Conn: c, r: br}
	var out net.Conn
	switch {
	case first[0] == tlsRecordHandshake:
		out = tls.Server(pc, l.tls)
	case l.plain:
		out = pc
	default:
		_ = c.SetWriteDeadline(time.Now().Add(l.timeout))
		_, _ = c.Write([]byte(plainRefusal))
		c.Close()
		return
	}
	select {
	case l.conns <- out:
	case <-l.done:
		c.Close()
	}
}

// Accept returns the next classified connection.
func (l *sniffListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case err := <-l.errc:
		l.errc <- err // every later Accept fails the same way
		return nil, err
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// Close stops accepting; connections still being classified are closed.
func (l *sniffListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return l.Listener.Close()
}

// peekedConn is a connection whose first bytes sit in a bufio.Reader.
type peekedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *peekedConn) Read(p []byte) (int, error) { return c.r.Read(p) }
