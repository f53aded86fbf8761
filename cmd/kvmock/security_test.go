package main

import (
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/internal/pki"
)

// TestMockSecureBus: with its worker certificate kvmock connects to a
// secure bus and its events reach the stream; another worker's certificate
// is refused at start; flags come in threes.
func TestMockSecureBus(t *testing.T) {
	if testing.Short() {
		t.Skip("embedded NATS")
	}
	log := testLog(t)
	l := pki.Layout{Dir: t.TempDir()}
	if _, err := l.Ensure([]pki.Holder{{Identity: pki.Node("n1"), Hosts: []string{"127.0.0.1"}},
		{Identity: pki.Worker("mock-1")}, {Identity: pki.Worker("mock-2")}}); err != nil {
		t.Fatal(err)
	}
	srv, err := eventbus.StartServer(eventbus.ServerConfig{Name: "n1", Host: "127.0.0.1", Port: freePort(t), StoreDir: t.TempDir(), Logger: log,
		Security: eventbus.Security{TLS: l.Material(pki.Node("n1"))}})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	url := srv.ClientURL()
	node, err := pki.LoadBundle(l.Material(pki.Node("n1")))
	if err != nil {
		t.Fatal(err)
	}
	admin, err := eventbus.Connect(url, "admin", log, eventbus.WithBundle(node))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	js, err := jetstream.New(admin)
	if err != nil {
		t.Fatal(err)
	}
	stream, err := eventbus.EnsureStream(t.Context(), js, eventbus.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}

	args := func(id string) []string {
		m := l.Material(pki.Worker(id))
		return []string{"--id", "mock-1", "--nats", url, "--nats-tls-ca", m.CAFile, "--nats-tls-cert", m.CertFile, "--nats-tls-key", m.KeyFile}
	}
	cfg, err := parseConfig(args("mock-1"), func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	opts, err := cfg.busOptions()
	if err != nil {
		t.Fatal(err)
	}
	var acked atomic.Int64
	pub, closeFn, err := natsConnect(url, log, opts...)(t.Context(), cfg.ID, 0, busHooks{firstEventID: 1,
		onAck: func(eventbus.PublishAck) { acked.Add(1) }, onError: func(id uint64, err error) { t.Errorf("event %d: %v", id, err) }})
	if err != nil {
		t.Fatal(err)
	}
	defer closeFn()
	if _, err := pub.PublishAsync(t.Context(), eventbus.WireEvent{Worker: "mock-1", Kind: eventbus.KindCleared}); err != nil {
		t.Fatal(err)
	}
	if err := pub.Flush(t.Context()); err != nil {
		t.Fatal(err)
	}
	pub.Close()
	info, err := stream.Info(t.Context())
	if err != nil || info.State.Msgs != 1 || acked.Load() != 1 {
		t.Fatalf("stream holds %v messages (err %v), %d acked; want 1", info.State.Msgs, err, acked.Load())
	}

	// mock-2's certificate for worker mock-1: refused before connecting.
	cfg2, err := parseConfig(args("mock-2"), func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cfg2.busOptions(); err == nil || !strings.Contains(err.Error(), "worker/mock-2") {
		t.Errorf("another worker's certificate: %v", err)
	}
	// Without credentials the secure bus refuses the connection.
	if _, _, err := natsConnect(url, log)(t.Context(), "mock-1", 0, busHooks{}); err == nil {
		t.Error("anonymous connection accepted by a secure bus")
	}
	for _, bad := range [][]string{{"--nats", url, "--nats-tls-ca", "ca.pem"}, {"--nats-tls-ca", "a", "--nats-tls-cert", "b", "--nats-tls-key", "c"}} {
		if _, err := parseConfig(bad, func(string) string { return "" }, io.Discard); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// TestMockRegisterOverHTTPS: --register-ca (or --nats-tls-ca) makes the
// registration client trust the cluster's CA and only a replica's
// certificate; --admin-token-file is read.
func TestMockRegisterOverHTTPS(t *testing.T) {
	l := pki.Layout{Dir: t.TempDir()}
	if _, err := l.Ensure([]pki.Holder{{Identity: pki.Node("r1"), Hosts: []string{"127.0.0.1"}}, {Identity: pki.Worker("mock-1"), Hosts: []string{"127.0.0.1"}}}); err != nil {
		t.Fatal(err)
	}
	serve := func(id pki.Identity) *httptest.Server {
		b, err := pki.LoadBundle(l.Material(id))
		if err != nil {
			t.Fatal(err)
		}
		s := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprint(w, r.Header.Get("Authorization"))
		}))
		s.TLS = b.ServerTLSOptionalClient(nil)
		// StartTLS installs its own certificate when Certificates is
		// empty (a bundle's configurations pick theirs per handshake).
		s.TLS.Certificates = []tls.Certificate{*b.Certificate()}
		s.StartTLS()
		t.Cleanup(s.Close)
		return s
	}
	replica, notReplica := serve(pki.Node("r1")), serve(pki.Worker("mock-1"))
	tokFile := t.TempDir() + "/tok"
	if err := writeFile(tokFile, "s3cret\n"); err != nil {
		t.Fatal(err)
	}
	cfg, err := parseConfig([]string{"--register", replica.URL, "--register-ca", l.CACertFile(), "--admin-token-file", tokFile},
		func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.AdminToken != "s3cret" {
		t.Errorf("admin token %q", cfg.AdminToken)
	}
	c, err := cfg.registerClient()
	if err != nil || c == nil {
		t.Fatalf("client %v, err %v", c, err)
	}
	c.Timeout = 5 * time.Second
	resp, err := c.Get(replica.URL)
	if err != nil {
		t.Fatalf("replica over HTTPS: %v", err)
	}
	resp.Body.Close()
	if _, err := c.Get(notReplica.URL); err == nil {
		t.Error("a server with a worker certificate was accepted as a replica")
	}
	if c, err := testConfig(t).registerClient(); c != nil || err != nil {
		t.Errorf("no CA: client %v err %v, want registrar's default", c, err)
	}
}

func writeFile(path, content string) error { return os.WriteFile(path, []byte(content), 0o600) }
