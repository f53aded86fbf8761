package cluster

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/internal/pki"
)

// Limits of the TLS accept path. A handshake runs on its own goroutine so
// a peer that stalls mid-handshake cannot hold up raft's accept loop; the
// bound keeps a flood of half-open handshakes from costing unbounded
// goroutines and memory.
const (
	maxPendingHandshakes = 64
	// handshakeTimeout bounds one TLS handshake (both directions) when the
	// transport timeout is longer: a member completes one in milliseconds.
	handshakeTimeout = 10 * time.Second
)

// peerGate decides which node identities may speak Raft to this node and
// call its /cluster/ endpoints. It reads raft's latest configuration (the
// one raft itself acts on, committed or not) on every decision, so a
// removed node is refused from the moment its removal is appended.
//
// Before the first configuration exists (a fresh data dir) it falls back to
// the bootstrap set (Config.Peers) and the join allowance: the join target
// this node reached over mutual TLS, then the members the leader named in
// its join answer. Once a configuration exists, only it counts.
type peerGate struct {
	self string
	rf   atomic.Pointer[raft.Raft] // nil until raft is built: refuse everyone

	bootstrap map[string]string // bootstrap id → Raft address (immutable)

	mu    sync.Mutex      // guards joins
	joins map[string]bool // ids allowed during a join, before a configuration
}

func newPeerGate(cfg *Config) *peerGate {
	g := &peerGate{self: cfg.NodeID, bootstrap: map[string]string{}, joins: map[string]bool{}}
	for _, p := range cfg.Peers {
		g.bootstrap[p.ID] = p.RaftAddr
	}
	return g
}

// servers is raft's latest configuration (nil when raft is not built yet).
// GetConfiguration does not go through raft's main loop: it copies the
// latest configuration, so calling it on every handshake is cheap and
// cannot block behind a snapshot install.
func (g *peerGate) servers() ([]raft.Server, bool) {
	r := g.rf.Load()
	if r == nil {
		return nil, false
	}
	return r.GetConfiguration().Configuration().Servers, true
}

// isMember reports whether node id may speak Raft here.
func (g *peerGate) isMember(id string) bool {
	servers, up := g.servers()
	if !up {
		return false // starting: peers retry, strangers learn nothing
	}
	if len(servers) > 0 {
		return slices.ContainsFunc(servers, func(s raft.Server) bool { return string(s.ID) == id })
	}
	if _, ok := g.bootstrap[id]; ok {
		return true
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.joins[id]
}

// expectedAt is the node id the configuration (or, before one exists, the
// bootstrap set) places at Raft address addr: a dial to addr must reach
// that node and no other member.
func (g *peerGate) expectedAt(addr string) (string, bool) {
	servers, _ := g.servers()
	for _, s := range servers {
		if string(s.Address) == addr {
			return string(s.ID), true
		}
	}
	if len(servers) == 0 {
		for id, a := range g.bootstrap {
			if a == addr {
				return id, true
			}
		}
	}
	return "", false
}

// allowJoin adds ids to the join allowance (ignored once a configuration
// exists).
func (g *peerGate) allowJoin(ids ...string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, id := range ids {
		g.joins[id] = true
	}
}

// members is a pki.Allow accepting member nodes only.
func (g *peerGate) members() pki.Allow { return pki.AllowNodes(g.isMember) }

// memberAt is the dial side's pki.Allow: the peer must be a member, and
// the one the configuration places at addr when it names one.
func (g *peerGate) memberAt(addr string) pki.Allow {
	return func(id pki.Identity) error {
		if err := pki.AllowNodes(g.isMember)(id); err != nil {
			return err
		}
		if want, ok := g.expectedAt(addr); ok && want != id.ID {
			return fmt.Errorf("%s answers at %s where the configuration has node %q: %w", id, addr, want, pki.ErrNotAllowed)
		}
		return nil
	}
}

// tlsStreamLayer is raft.StreamLayer over mutual TLS. Raft's
// NetworkTransport (pool, timeouts, pipelining) runs on top unchanged: it
// sees net.Conns that are already authenticated.
type tlsStreamLayer struct {
	ln        net.Listener
	advertise net.Addr
	dial      func(ctx context.Context, network, addr string) (net.Conn, error)
	server    *tls.Config // client certificate required, member identity
	gate      *peerGate
	bundle    *pki.Bundle
	timeout   time.Duration
	log       *slog.Logger
	refused   func() // counts a refused inbound handshake (metrics)

	accepted chan net.Conn
	closed   chan struct{}
	once     sync.Once
	pending  chan struct{} // semaphore of in-flight handshakes
	wg       sync.WaitGroup
}

func newTLSStreamLayer(ln net.Listener, adv net.Addr, cfg *Config, gate *peerGate, refused func()) *tlsStreamLayer {
	dial := cfg.Dial
	if dial == nil {
		dial = (&net.Dialer{KeepAlive: 30 * time.Second}).DialContext
	}
	s := &tlsStreamLayer{
		ln: ln, advertise: adv, dial: dial, gate: gate, bundle: cfg.TLS,
		server:   cfg.TLS.ServerTLS(gate.members()),
		timeout:  min(cfg.TransportTimeout, handshakeTimeout),
		log:      cfg.nodeLogger().With("component", "raft-tls"),
		refused:  refused,
		accepted: make(chan net.Conn),
		closed:   make(chan struct{}),
		pending:  make(chan struct{}, maxPendingHandshakes),
	}
	s.wg.Add(1)
	go s.acceptLoop()
	return s
}

// acceptLoop accepts TCP connections and hands each to a handshake
// goroutine. Only connections whose handshake succeeded — the peer proved
// it holds a certificate of our CA naming a member node — reach Accept,
// so raft never reads a byte a stranger sent.
func (s *tlsStreamLayer) acceptLoop() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			select {
			case <-s.closed:
				return
			default:
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			s.log.Error("raft listener failed", "err", err)
			s.Close()
			return
		}
		select {
		case s.pending <- struct{}{}:
		default:
			// Too many handshakes in flight: shed the newcomer rather than
			// queue without bound. Members retry.
			c.Close()
			s.refused()
			continue
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer func() { <-s.pending }()
			s.handshake(c)
		}()
	}
}

func (s *tlsStreamLayer) handshake(c net.Conn) {
	tc := tls.Server(c, s.server)
	_ = tc.SetDeadline(time.Now().Add(s.timeout))
	if err := tc.Handshake(); err != nil {
		c.Close()
		s.refused()
		if servers, _ := s.gate.servers(); len(servers) == 0 && errors.Is(err, pki.ErrNotAllowed) {
			// A node joining through a follower is checked by the leader,
			// which this node cannot know yet: expected, the leader's check
			// needs only this node's certificate.
			s.log.Info("refused raft connection from a node not known before joining", "remote", c.RemoteAddr().String(), "err", err)
			return
		}
		s.log.Warn("refused raft connection", "remote", c.RemoteAddr().String(), "err", err)
		return
	}
	// Raft's server side sets no read deadline of its own (the heartbeat
	// connection idles between RPCs): lift the handshake's.
	_ = tc.SetDeadline(time.Time{})
	select {
	case s.accepted <- tc:
	case <-s.closed:
		tc.Close()
	}
}

// Accept returns the next authenticated connection. It fails only once the
// layer is closed: raft's accept loop backs off on errors, and a stranger's
// failed handshake must not slow down members.
func (s *tlsStreamLayer) Accept() (net.Conn, error) {
	select {
	case c := <-s.accepted:
		return c, nil
	case <-s.closed:
		return nil, net.ErrClosed
	}
}

func (s *tlsStreamLayer) Close() error {
	var err error
	s.once.Do(func() {
		close(s.closed)
		err = s.ln.Close()
	})
	return err
}

func (s *tlsStreamLayer) Addr() net.Addr { return s.advertise }

// Dial connects to a member over mutual TLS: the server must present a
// certificate of our CA naming the member the configuration places at
// address (and its host in a SAN: the advertised Raft host must be in the
// node's certificate).
func (s *tlsStreamLayer) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return dialTLS(ctx, s.dial, s.bundle, string(address), s.gate.memberAt(string(address)))
}

// dialTLS dials addr and completes a TLS handshake presenting b's
// certificate and accepting only a server allow accepts.
func dialTLS(ctx context.Context, dial func(context.Context, string, string) (net.Conn, error), b *pki.Bundle, addr string, allow pki.Allow) (net.Conn, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("raft address %q: %w", addr, err)
	}
	c, err := dial(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	cfg := b.ClientTLS(allow)
	cfg.ServerName = host
	tc := tls.Client(c, cfg)
	if err := tc.HandshakeContext(ctx); err != nil {
		c.Close()
		return nil, fmt.Errorf("tls handshake with %s: %w", addr, err)
	}
	return tc, nil
}

// verifyRaftPeer checks that addr answers as node id: a TLS handshake
// whose server certificate (of our CA, for addr's host) names exactly
// pki.Node(id). It is how a join proves the address it names is the
// joining node's, so a bogus voter cannot enter the configuration.
func (n *Node) verifyRaftPeer(ctx context.Context, id, addr string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	want := pki.Node(id)
	c, err := dialTLS(ctx, n.dial, n.cfg.TLS, addr, func(got pki.Identity) error {
		if got != want {
			return fmt.Errorf("certificate names %s, not %s: %w", got, want, pki.ErrNotAllowed)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("raft_addr %s does not answer as node %q: %w", addr, id, err)
	}
	return c.Close()
}

// HTTPServerTLS is the tls.Config for a replica's HTTP port when the
// cluster runs with TLS: it presents the node certificate and asks for a
// client certificate without requiring one, so OpenAI clients without
// certificates still reach /v1 while the /cluster/ endpoints (Handler)
// refuse callers whose verified certificate does not name a member node.
// A client certificate from another CA fails the handshake.
//
// Use it as http.Server.TLSConfig with ServeTLS(ln, "", "") (net/http then
// offers HTTP/2 itself, when the server allows it) or wrap the listener
// with tls.NewListener (HTTP/1.1). NextProtos is left empty on purpose: a
// config that advertised h2 to a server unable to speak it would break
// every HTTP/2 client.
func HTTPServerTLS(b *pki.Bundle) *tls.Config {
	return b.ServerTLSOptionalClient(nil)
}

// httpTransport is the node's HTTP client transport: through the dial
// hook, and with TLS presenting the node certificate to servers allow
// accepts.
func (n *Node) httpTransport(allow pki.Allow) *http.Transport {
	t := &http.Transport{
		DialContext:         n.dial,
		MaxIdleConnsPerHost: 16,
		IdleConnTimeout:     90 * time.Second,
		TLSHandshakeTimeout: handshakeTimeout,
	}
	if n.cfg.TLS != nil {
		t.TLSClientConfig = n.cfg.TLS.ClientTLS(allow)
	}
	return t
}
