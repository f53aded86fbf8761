package pki

import (
	"crypto/tls"
	"errors"
	"net"
	"strings"
	"testing"
	"time"
)

// fixture is one deployment's CA plus an unrelated CA (an attacker's, or
// another cluster's).
type fixture struct {
	ca, other *CA
}

func newFixture(t testing.TB) fixture {
	t.Helper()
	ca, err := NewCA(CAOptions{})
	if err != nil {
		t.Fatal(err)
	}
	other, err := NewCA(CAOptions{Name: "someone else"})
	if err != nil {
		t.Fatal(err)
	}
	return fixture{ca: ca, other: other}
}

// bundle issues a certificate for id from ca, trusting trust (normally the
// same CA). Bundles are built without newBundle's own checks so a test can
// hold expired or foreign material, as an attacker would.
func bundle(t testing.TB, ca, trust *CA, req Request) *Bundle {
	t.Helper()
	if len(req.Hosts) == 0 {
		req.Hosts = []string{"127.0.0.1", "localhost"}
	}
	kp, err := ca.Issue(req)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := kp.TLSCertificate()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := IdentityOf(cert.Leaf)
	b := &Bundle{roots: trust.Pool(), identity: id}
	b.cert.Store(&cert)
	return b
}

// handshake runs a TLS handshake over loopback TCP. The server writes one
// byte after a successful handshake and the client reads it, so a refusal
// the server decides after the client's handshake returned (TLS 1.3 checks
// client certificates last) still reaches the client. serverGot is the
// client identity the server verified.
func handshake(t *testing.T, server, client *tls.Config) (serverErr, clientErr error, serverGot Identity) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	type result struct {
		err error
		id  Identity
	}
	done := make(chan result, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			done <- result{err: err}
			return
		}
		defer c.Close()
		tc := tls.Server(c, server)
		_ = tc.SetDeadline(time.Now().Add(5 * time.Second))
		if err := tc.Handshake(); err != nil {
			done <- result{err: err}
			return
		}
		var r result
		if len(tc.ConnectionState().PeerCertificates) > 0 {
			r.id, r.err = PeerIdentity(tc.ConnectionState())
		}
		_, _ = tc.Write([]byte{1})
		done <- r
	}()
	client = client.Clone()
	client.ServerName = "127.0.0.1"
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", ln.Addr().String(), client)
	if err == nil {
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		_, err = c.Read(make([]byte, 1))
		c.Close()
	}
	r := <-done
	return r.err, err, r.id
}

func TestPKIHandshake(t *testing.T) {
	f := newFixture(t)
	members := map[string]bool{"n1": true, "n2": true}
	isMember := func(id string) bool { return members[id] }
	n1 := bundle(t, f.ca, f.ca, Request{Identity: Node("n1")})
	past := time.Now().Add(-48 * time.Hour)

	tests := []struct {
		name      string
		server    *tls.Config
		client    *tls.Config
		wantOK    bool
		wantPeer  Identity
		serverErr string // substring of the server's handshake error
		clientErr bool   // the client must see the failure (its own check, or the server's alert)
	}{
		{name: "valid node chain", server: n1.ServerTLS(AllowNodes(isMember)),
			client: bundle(t, f.ca, f.ca, Request{Identity: Node("n2")}).ClientTLS(AllowNodes(isMember)),
			wantOK: true, wantPeer: Node("n2")},
		{name: "client from another CA", server: n1.ServerTLS(AllowNodes(isMember)),
			client:    bundle(t, f.other, f.ca, Request{Identity: Node("n2")}).ClientTLS(nil),
			serverErr: "certificate", clientErr: true},
		{name: "client from another CA, forced", server: n1.ServerTLS(AllowNodes(isMember)),
			client:    forceCert(bundle(t, f.other, f.ca, Request{Identity: Node("n2")}).ClientTLS(nil)),
			serverErr: "unknown authority", clientErr: true},
		{name: "expired client", server: n1.ServerTLS(AllowNodes(isMember)),
			client:    bundle(t, f.ca, f.ca, Request{Identity: Node("n2"), Now: past, Validity: time.Hour}).ClientTLS(nil),
			serverErr: "expired", clientErr: true},
		{name: "not yet valid client", server: n1.ServerTLS(AllowNodes(isMember)),
			client:    bundle(t, f.ca, f.ca, Request{Identity: Node("n2"), Now: time.Now().Add(time.Hour)}).ClientTLS(nil),
			serverErr: "certificate", clientErr: true},
		{name: "node not a member", server: n1.ServerTLS(AllowNodes(isMember)),
			client:    bundle(t, f.ca, f.ca, Request{Identity: Node("n9")}).ClientTLS(nil),
			serverErr: "not a cluster member", clientErr: true},
		{name: "worker on a node port", server: n1.ServerTLS(AllowNodes(isMember)),
			client:    bundle(t, f.ca, f.ca, Request{Identity: Worker("n2")}).ClientTLS(nil),
			serverErr: "not a node", clientErr: true},
		{name: "client certificate missing", server: n1.ServerTLS(AllowNodes(isMember)),
			client:    &tls.Config{RootCAs: f.ca.Pool(), MinVersion: tls.VersionTLS13},
			serverErr: "certificate", clientErr: true},
		{name: "optional client cert: none sent", server: n1.ServerTLSOptionalClient(AllowRoles(RoleNode, RoleWorker)),
			client: &tls.Config{RootCAs: f.ca.Pool(), MinVersion: tls.VersionTLS13}, wantOK: true},
		{name: "optional client cert: worker", server: n1.ServerTLSOptionalClient(AllowRoles(RoleNode, RoleWorker)),
			client: bundle(t, f.ca, f.ca, Request{Identity: Worker("w1")}).ClientTLS(AllowRoles(RoleNode)),
			wantOK: true, wantPeer: Worker("w1")},
		// crypto/tls withholds a certificate the server's CA list does not
		// name, so a polite client from another CA arrives anonymous (and
		// the application refuses it); an attacker who sends it anyway
		// fails the handshake.
		{name: "optional client cert: another CA arrives anonymous", server: n1.ServerTLSOptionalClient(nil),
			client: bundle(t, f.other, f.ca, Request{Identity: Worker("w1")}).ClientTLS(nil),
			wantOK: true},
		{name: "optional client cert: another CA forced is refused", server: n1.ServerTLSOptionalClient(nil),
			client:    forceCert(bundle(t, f.other, f.ca, Request{Identity: Worker("w1")}).ClientTLS(nil)),
			serverErr: "certificate", clientErr: true},
		{name: "server from another CA", server: bundle(t, f.other, f.ca, Request{Identity: Node("n1")}).ServerTLS(nil),
			client:    bundle(t, f.ca, f.ca, Request{Identity: Node("n2")}).ClientTLS(nil),
			clientErr: true},
		{name: "expired server", server: bundle(t, f.ca, f.ca, Request{Identity: Node("n1"), Now: past, Validity: time.Hour}).ServerTLS(nil),
			client:    bundle(t, f.ca, f.ca, Request{Identity: Node("n2")}).ClientTLS(nil),
			clientErr: true},
		{name: "server is a worker", server: bundle(t, f.ca, f.ca, Request{Identity: Worker("n1")}).ServerTLS(nil),
			client:    bundle(t, f.ca, f.ca, Request{Identity: Worker("w1")}).ClientTLS(AllowRoles(RoleNode)),
			clientErr: true},
		{name: "server host name not in certificate", server: bundle(t, f.ca, f.ca, Request{Identity: Node("n1"), Hosts: []string{"elsewhere.example"}}).ServerTLS(nil),
			client:    bundle(t, f.ca, f.ca, Request{Identity: Node("n2")}).ClientTLS(nil),
			clientErr: true},
		{name: "TLS 1.2 client refused", server: n1.ServerTLS(nil),
			client: func() *tls.Config {
				c := bundle(t, f.ca, f.ca, Request{Identity: Node("n2")}).ClientTLS(nil)
				c.MinVersion, c.MaxVersion = tls.VersionTLS12, tls.VersionTLS12
				return c
			}(),
			serverErr: "version", clientErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			serr, cerr, got := handshake(t, tt.server, tt.client)
			if tt.wantOK {
				if serr != nil || cerr != nil {
					t.Fatalf("handshake failed: server %v, client %v", serr, cerr)
				}
				if got != tt.wantPeer {
					t.Fatalf("server saw %v, want %v", got, tt.wantPeer)
				}
				return
			}
			if tt.serverErr != "" && (serr == nil || !strings.Contains(serr.Error(), tt.serverErr)) {
				t.Errorf("server error %v, want one containing %q", serr, tt.serverErr)
			}
			if tt.clientErr && cerr == nil {
				t.Errorf("client saw no error")
			}
			if serr == nil && cerr == nil {
				t.Errorf("handshake succeeded")
			}
		})
	}
}

// forceCert makes c present its certificate even when the server's list of
// acceptable CAs does not name its issuer, as an attacker's client would.
func forceCert(c *tls.Config) *tls.Config {
	polite := c.GetClientCertificate
	c.GetClientCertificate = func(cri *tls.CertificateRequestInfo) (*tls.Certificate, error) {
		cri.AcceptableCAs = nil // "any CA": the polite check then passes
		return polite(cri)
	}
	return c
}

func TestPKIAllowNodesWrapsErrNotAllowed(t *testing.T) {
	allow := AllowNodes(func(id string) bool { return id == "n1" })
	if err := allow(Node("n1")); err != nil {
		t.Fatal(err)
	}
	for _, id := range []Identity{Node("n2"), Worker("n1")} {
		if err := allow(id); !errors.Is(err, ErrNotAllowed) {
			t.Errorf("%v: got %v, want ErrNotAllowed", id, err)
		}
	}
	if err := AllowRoles(RoleWorker)(Node("n1")); !errors.Is(err, ErrNotAllowed) {
		t.Errorf("AllowRoles: got %v", err)
	}
}
