package main

import (
	"context"
	"net"
	"net/http"
	"sync"
	"syscall"
	"testing"
)

// memNet is an in-process network of net.Pipe connections, for tests run
// in a testing/synctest bubble: a goroutine blocked on a pipe is durably
// blocked (one on a TCP socket is not, so the clock would never move), and
// the bubble's fake clock advances only when every goroutine in it, kvmock's
// and the test's clients alike, is durably blocked. Timing
// assertions then hold exactly, whatever the host's load (docs/STYLE.md:
// no wall-clock limits in tests). Build it inside the bubble.
type memNet struct {
	mu        sync.Mutex
	listeners map[string]*memListener // by "127.0.0.1:port"; mu must be held
	port      int                     // the last port handed out; mu must be held
}

func newMemNet() *memNet { return &memNet{listeners: map[string]*memListener{}} }

// listen returns a listener on a new address, 127.0.0.1:port (nothing is
// bound on the host: the address only names it within n).
func (n *memNet) listen() *memListener {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.port++
	l := &memListener{
		n:      n,
		addr:   &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: n.port},
		conns:  make(chan net.Conn),
		closed: make(chan struct{}),
	}
	n.listeners[l.addr.String()] = l
	return l
}

// dial connects to the listener at addr; refused if there is none or it
// is closed.
func (n *memNet) dial(ctx context.Context, _, addr string) (net.Conn, error) {
	n.mu.Lock()
	l := n.listeners[addr]
	n.mu.Unlock()
	if l == nil {
		return nil, &net.OpError{Op: "dial", Net: "mem", Err: syscall.ECONNREFUSED}
	}
	client, server := net.Pipe()
	select {
	case l.conns <- server:
		return client, nil
	case <-l.closed:
	case <-ctx.Done():
		client.Close()
		server.Close()
		return nil, ctx.Err()
	}
	client.Close()
	server.Close()
	return nil, &net.OpError{Op: "dial", Net: "mem", Err: syscall.ECONNREFUSED}
}

// transport is an HTTP transport over n.
func (n *memNet) transport() *http.Transport { return &http.Transport{DialContext: n.dial} }

// client is an HTTP client over n whose idle connections are closed when
// the test ends (a bubble must end with no goroutine left).
func (n *memNet) client(t *testing.T) *http.Client {
	c := &http.Client{Transport: n.transport()}
	t.Cleanup(c.CloseIdleConnections)
	return c
}

// serveOn is a startMock option: serve on a listener of n, and pull KV
// (decode side) over n too.
func (n *memNet) serveOn(tm *testMock) {
	tm.ln = n.listen()
	tm.m.pullClient = &http.Client{Transport: n.transport()}
}

type memListener struct {
	n      *memNet
	addr   *net.TCPAddr
	conns  chan net.Conn
	once   sync.Once
	closed chan struct{}
}

func (l *memListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.closed:
		return nil, net.ErrClosed
	}
}

func (l *memListener) Close() error {
	l.once.Do(func() {
		close(l.closed)
		l.n.mu.Lock()
		delete(l.n.listeners, l.addr.String())
		l.n.mu.Unlock()
	})
	return nil
}

func (l *memListener) Addr() net.Addr { return l.addr }
