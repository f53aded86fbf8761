package eventbus

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/internal/pki"
)

// ServerConfig configures the embedded NATS server of one replica.
type ServerConfig struct {
	// Name is the server name; unique within the cluster (JetStream
	// clustering requires it). Use the replica's node id.
	Name string
	// Host and Port are the client listener (default 127.0.0.1; Port 0
	// picks a free port, see Server.ClientURL).
	Host string
	Port int
	// ClusterName, ClusterHost and ClusterPort enable clustering: routes
	// to the peers listed in Routes (nats-route://host:port or
	// nats://host:port; the server's own address may be listed and is
	// ignored). ClusterPort 0 and no Routes = single node.
	ClusterName string
	ClusterHost string
	ClusterPort int
	Routes      []string
	// StoreDir holds JetStream's files (required). Every write is fsynced.
	StoreDir string
	// MaxStore bounds JetStream file storage (0 = the server's default,
	// derived from the free disk space).
	MaxStore int64
	// ReadyTimeout bounds the wait for the listeners (default 10s).
	ReadyTimeout time.Duration
	// Logger receives NATS's log lines (default slog.Default()).
	Logger *slog.Logger
	// Debug and Trace turn on NATS's verbose levels (logged at slog
	// Debug).
	Debug, Trace bool
	// Security is TLS and authentication for clients and routes. Its zero
	// value is the secure mode and needs TLS material; see Security.
	Security Security
}

// Clustered reports whether the configuration forms a cluster.
func (c ServerConfig) Clustered() bool { return c.ClusterPort != 0 || len(c.Routes) > 0 }

// Server is a replica's embedded NATS server with JetStream.
type Server struct {
	ns     *server.Server
	log    *natsLogger
	cfg    ServerConfig
	bundle *pki.Bundle // nil in the insecure mode
}

// StartServer starts an embedded NATS server with JetStream on file storage
// (SyncAlways: every write fsynced), clustered when cfg says so, and waits
// until it accepts connections. NATS's logger is replaced by one that writes
// to slog and never exits the process; NATS installs no signal handlers.
func StartServer(cfg ServerConfig) (*Server, error) {
	logger := cfg.Logger
	if logger == nil {
		logger = slog.Default()
	}
	opts, err := serverOptions(cfg)
	if err != nil {
		return nil, err
	}
	bundle, err := applySecurity(opts, cfg.Security, cfg.Clustered(), logger.With("component", "nats-auth", "server", cfg.Name))
	if err != nil {
		return nil, fmt.Errorf("nats server %s: %w", cfg.Name, err)
	}
	nl := &natsLogger{log: logger.With("component", "nats", "server", cfg.Name)}
	ns, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("nats server %s: %w", cfg.Name, err)
	}
	// Before Start: NATS must never reach its default logger, whose Fatalf
	// calls os.Exit.
	ns.SetLoggerV2(nl, cfg.Debug, cfg.Trace, false)
	ns.Start()
	timeout := cfg.ReadyTimeout
	if timeout <= 0 {
		timeout = 10 * time.Second
	}
	if !ns.ReadyForConnections(timeout) {
		ns.Shutdown()
		ns.WaitForShutdown()
		if ferr := nl.fatal(); ferr != nil {
			return nil, fmt.Errorf("nats server %s: %w", cfg.Name, ferr)
		}
		return nil, fmt.Errorf("nats server %s: not ready after %v", cfg.Name, timeout)
	}
	if ferr := nl.fatal(); ferr != nil || !ns.JetStreamEnabled() {
		ns.Shutdown()
		ns.WaitForShutdown()
		if ferr == nil {
			ferr = errors.New("JetStream not enabled")
		}
		return nil, fmt.Errorf("nats server %s: %w", cfg.Name, ferr)
	}
	return &Server{ns: ns, log: nl, cfg: cfg, bundle: bundle}, nil
}

func serverOptions(cfg ServerConfig) (*server.Options, error) {
	if cfg.StoreDir == "" {
		return nil, errors.New("nats server: StoreDir is required")
	}
	host := cfg.Host
	if host == "" {
		host = "127.0.0.1"
	}
	opts := &server.Options{
		ServerName: cfg.Name,
		Host:       host,
		Port:       cfg.Port,
		JetStream:  true,
		StoreDir:   cfg.StoreDir,
		SyncAlways: true,
		NoSigs:     true,
		// Our logger is installed with SetLoggerV2; NoLog keeps NATS from
		// ever configuring its own (ConfigureLogger returns early).
		NoLog:             true,
		JetStreamMaxStore: cfg.MaxStore,
	}
	if opts.Port == 0 {
		opts.Port = server.RANDOM_PORT
	}
	if cfg.Clustered() {
		if cfg.Name == "" || cfg.ClusterName == "" {
			return nil, errors.New("nats server: clustering needs Name and ClusterName")
		}
		if cfg.ClusterPort == 0 {
			return nil, errors.New("nats server: clustering needs ClusterPort")
		}
		chost := cfg.ClusterHost
		if chost == "" {
			chost = host
		}
		opts.Cluster = server.ClusterOpts{Name: cfg.ClusterName, Host: chost, Port: cfg.ClusterPort}
		if opts.Cluster.Port < 0 {
			opts.Cluster.Port = server.RANDOM_PORT
		}
		for _, r := range cfg.Routes {
			u, err := routeURL(r)
			if err != nil {
				return nil, err
			}
			opts.Routes = append(opts.Routes, u)
		}
	}
	return opts, nil
}

func routeURL(s string) (*url.URL, error) {
	if !strings.Contains(s, "://") {
		s = "nats-route://" + s
	}
	u, err := url.Parse(s)
	if err != nil || u.Host == "" {
		return nil, fmt.Errorf("nats server: bad route %q", s)
	}
	if _, _, err := net.SplitHostPort(u.Host); err != nil {
		return nil, fmt.Errorf("nats server: route %q needs host:port", s)
	}
	return u, nil
}

// ClientURL is the URL clients of this server connect to.
func (s *Server) ClientURL() string { return s.ns.ClientURL() }

// localURL is how this process's own client reaches the server: ClientURL,
// except that a wildcard listen address (0.0.0.0, ::), which no client can
// dial and no certificate names, becomes loopback. wildcard says so.
func (s *Server) localURL() (u string, wildcard bool) {
	u = s.ClientURL()
	parsed, err := url.Parse(u)
	if err != nil {
		return u, false
	}
	if ip := net.ParseIP(parsed.Hostname()); ip == nil || !ip.IsUnspecified() {
		return u, false
	}
	parsed.Host = net.JoinHostPort("127.0.0.1", parsed.Port())
	return parsed.String(), true
}

// Secure reports whether the server requires TLS and authentication.
func (s *Server) Secure() bool { return s.bundle != nil }

// ClientSecurity is what a replica's own client needs to connect to this
// server: its node certificate, or nothing in the insecure mode.
// On a wildcard listen address the client dials loopback (localURL) and
// checks the server against the first name of the node's own certificate
// instead: the server is this process, presenting that very certificate,
// and the identity check (a member node) still applies.
func (s *Server) ClientSecurity() ClientSecurity {
	if s.bundle == nil {
		return ClientSecurity{Insecure: true}
	}
	cs := ClientSecurity{Bundle: s.bundle}
	if _, wildcard := s.localURL(); wildcard {
		cs.ServerName = certName(s.bundle.Certificate().Leaf)
	}
	return cs
}

// certName is a name leaf is valid for: its first DNS name, else its first
// IP address ("" if it names neither).
func certName(leaf *x509.Certificate) string {
	switch {
	case leaf == nil:
		return ""
	case len(leaf.DNSNames) > 0:
		return leaf.DNSNames[0]
	case len(leaf.IPAddresses) > 0:
		return leaf.IPAddresses[0].String()
	}
	return ""
}

// Name is the server name.
func (s *Server) Name() string { return s.ns.Name() }

// NATS exposes the underlying server (for status pages and tests).
func (s *Server) NATS() *server.Server { return s.ns }

// JetStreamConfig is the running JetStream configuration (nil if JetStream
// is off); tests assert SyncAlways through it.
func (s *Server) JetStreamConfig() *server.JetStreamConfig { return s.ns.JetStreamConfig() }

// Shutdown stops the server and waits until it has stopped. Safe to call
// more than once.
func (s *Server) Shutdown() {
	s.ns.Shutdown()
	s.ns.WaitForShutdown()
}

// natsLogger adapts NATS's Logger to slog. Fatalf logs at Error and records
// the error instead of exiting: the embedding process decides what is fatal.
type natsLogger struct {
	log *slog.Logger

	mu       sync.Mutex // guards fatalErr: NATS logs from its own goroutines
	fatalErr error
}

func (l *natsLogger) Noticef(format string, v ...any) { l.log.Info(fmt.Sprintf(format, v...)) }
func (l *natsLogger) Warnf(format string, v ...any)   { l.log.Warn(fmt.Sprintf(format, v...)) }
func (l *natsLogger) Errorf(format string, v ...any)  { l.log.Error(fmt.Sprintf(format, v...)) }
func (l *natsLogger) Debugf(format string, v ...any)  { l.log.Debug(fmt.Sprintf(format, v...)) }
func (l *natsLogger) Tracef(format string, v ...any) {
	l.log.Log(context.Background(), slog.LevelDebug-4, fmt.Sprintf(format, v...))
}

func (l *natsLogger) Fatalf(format string, v ...any) {
	msg := fmt.Sprintf(format, v...)
	l.log.Error(msg, "fatal", true)
	l.mu.Lock()
	if l.fatalErr == nil {
		l.fatalErr = errors.New(msg)
	}
	l.mu.Unlock()
}

func (l *natsLogger) fatal() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.fatalErr
}

// FatalError is the first error NATS reported as fatal, if any. NATS keeps
// running after it (it would have exited), so a replica should treat it as
// a reason to fail readiness.
func (s *Server) FatalError() error { return s.log.fatal() }

// BusConfig chooses between the embedded server and an external NATS.
type BusConfig struct {
	// ExternalURL, when set, is an existing NATS cluster (with JetStream)
	// to use; no server is started. Comma-separated URLs are fine.
	ExternalURL string
	// Server configures the embedded server (ignored with ExternalURL).
	Server ServerConfig
	// Client is how the bus's client authenticates to ExternalURL (marked
	// External automatically). With the embedded server it is ignored: the
	// client uses the server's own Security (its node certificate).
	Client ClientSecurity
	// ClientName names this process's connection (default Server.Name).
	ClientName string
	Logger     *slog.Logger
}

// Bus is one replica's handle on the bus: the embedded server (if any), a
// client connection and a JetStream context on it.
type Bus struct {
	srv *Server
	nc  *nats.Conn
	js  jetstream.JetStream

	// What Dial needs to open more connections like nc.
	url, name string
	copts     []ConnectOption
	logger    *slog.Logger
	mu        sync.Mutex
	extra     []*nats.Conn // opened by Dial, closed by Close
}

// OpenBus starts the embedded server (unless cfg.ExternalURL is set) and
// connects to it.
func OpenBus(cfg BusConfig) (*Bus, error) {
	logger := cfg.Logger
	if logger == nil {
		logger = slog.Default()
	}
	if cfg.Server.Logger == nil {
		cfg.Server.Logger = logger
	}
	name := cfg.ClientName
	if name == "" {
		name = cfg.Server.Name
	}
	b := &Bus{}
	url := cfg.ExternalURL
	sec := cfg.Client
	sec.External = true
	if url == "" {
		srv, err := StartServer(cfg.Server)
		if err != nil {
			return nil, err
		}
		b.srv = srv
		url, _ = srv.localURL()
		sec = srv.ClientSecurity()
	}
	copts, err := sec.Options()
	if err != nil {
		b.Close()
		return nil, err
	}
	nc, err := Connect(url, name, logger, copts...)
	if err != nil {
		b.Close()
		return nil, err
	}
	b.nc = nc
	b.url, b.name, b.copts, b.logger = url, name, copts, logger
	js, err := jetstream.New(nc)
	if err != nil {
		b.Close()
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	b.js = js
	return b, nil
}

// Conn is the bus's client connection.
func (b *Bus) Conn() *nats.Conn { return b.nc }

// JetStream is a JetStream context on Conn.
func (b *Bus) JetStream() jetstream.JetStream { return b.js }

// Server is the embedded server, nil with an external NATS.
func (b *Bus) Server() *Server { return b.srv }

// ClientURL is the URL this bus's clients connect to (the embedded server's
// or the external one).
func (b *Bus) ClientURL() string {
	if b.srv != nil {
		return b.srv.ClientURL()
	}
	if b.nc != nil {
		return b.nc.ConnectedUrlRedacted()
	}
	return ""
}

// Dial opens another connection to the bus's server with the same
// credentials as Conn, named Conn's name + "-" + suffix, plus opts (say
// WithNoEcho): for traffic that wants options of its own. Close closes it.
func (b *Bus) Dial(suffix string, opts ...ConnectOption) (*nats.Conn, error) {
	nc, err := Connect(b.url, b.name+"-"+suffix, b.logger, append(slices.Clone(b.copts), opts...)...)
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	b.extra = append(b.extra, nc)
	b.mu.Unlock()
	return nc, nil
}

// Close drains nothing: it closes the connections, then stops the embedded
// server. Callers stop their consumers and publishers first.
func (b *Bus) Close() {
	b.mu.Lock()
	for _, nc := range b.extra {
		nc.Close()
	}
	b.extra = nil
	b.mu.Unlock()
	if b.nc != nil {
		b.nc.Close()
	}
	if b.srv != nil {
		b.srv.Shutdown()
	}
}
