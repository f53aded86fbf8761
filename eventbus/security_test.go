package eventbus

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/internal/pki"
	"github.com/kvrouter/kvrouter/internal/poll"
)

// secureSingle starts a secure single server (optionally admitting the
// replica token) with a stream and the ingest consumer, and returns a
// replica's connection to it.
func secureSingle(t *testing.T, p *testPKI, token pki.Secret) (*Server, *nats.Conn, jetstream.JetStream) {
	t.Helper()
	log := testLogger(t)
	s, err := StartServer(ServerConfig{Name: "r1", StoreDir: t.TempDir(), Logger: log,
		Security: Security{Bundle: p.bundle(t, pki.Node("r1")), ReplicaToken: token}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Shutdown)
	nc, js := connectWith(t, s.ClientURL(), "r1", log, WithBundle(p.bundle(t, pki.Node("r1"))))
	ensureStream(t, js, 1)
	if _, err := NewConsumer(context.Background(), js, ConsumerConfig{Logger: log}); err != nil {
		t.Fatal(err)
	}
	return s, nc, js
}

func TestBusSecureNeedsMaterial(t *testing.T) {
	_, err := StartServer(ServerConfig{Name: "x", StoreDir: t.TempDir(), Logger: testLogger(t)})
	if err == nil || !strings.Contains(err.Error(), "TLS material (CA file, certificate file, key file)") || !strings.Contains(err.Error(), "Insecure") {
		t.Fatalf("zero Security: got %v, want a refusal naming the missing files and the opt-out", err)
	}
	p := newTestPKI(t)
	_, err = StartServer(ServerConfig{Name: "x", StoreDir: t.TempDir(), Logger: testLogger(t),
		Security: Security{Bundle: p.bundle(t, pki.Worker("x"))}})
	if err == nil || !strings.Contains(err.Error(), "not a node") {
		t.Fatalf("server with a worker certificate: %v", err)
	}
	if _, err := (ClientSecurity{}).Options(); err == nil {
		t.Fatal("zero ClientSecurity accepted")
	}
	if _, err := (ClientSecurity{Token: "t"}).Options(); err == nil {
		t.Fatal("token without a CA to check the server accepted")
	}
}

// Nothing gets in without a certificate of the deployment's CA or the
// replica token.
func TestBusSecureRefusesStrangers(t *testing.T) {
	p, other := newTestPKI(t), newTestPKI(t)
	log := testLogger(t)
	for _, token := range []pki.Secret{"", "s3cret-replica-token"} {
		t.Run(fmt.Sprintf("token=%v", token != ""), func(t *testing.T) {
			s, _, _ := secureSingle(t, p, token)
			url := s.ClientURL()
			foreign := other.bundle(t, pki.Node("r1")) // right name, wrong CA
			forced := foreign.ClientTLS(nil)
			forced.RootCAs = p.ca.Pool()  // it trusts our server...
			cert := foreign.Certificate() // ...and sends its certificate whatever the server asks for
			forced.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return cert, nil }
			refused := map[string][]ConnectOption{
				"anonymous plaintext":       nil,
				"anonymous TLS":             {WithTLSConfig(pki.TrustOnlyTLS(p.ca.Pool(), nil))},
				"certificate of another CA": {WithTLSConfig(forced)},
				"wrong token":               {WithTLSConfig(pki.TrustOnlyTLS(p.ca.Pool(), nil)), WithToken("guess")},
				"token over plaintext":      {WithToken(token)},
				"our cert, server not ours": {WithBundle(foreign)},
			}
			for name, opts := range refused {
				nc, err := Connect(url, "stranger", log, opts...)
				if err == nil {
					nc.Close()
					t.Errorf("%s: connected", name)
					continue
				}
				if token != "" && strings.Contains(err.Error(), token.Reveal()) {
					t.Errorf("%s: the error quotes the token: %v", name, err)
				}
			}
			if token == "" {
				return
			}
			opts, err := ClientSecurity{TLS: pki.Material{CAFile: writeCA(t, p)}, Token: token}.Options()
			if err != nil {
				t.Fatal(err)
			}
			nc, js := connectWith(t, url, "tool", log, opts...)
			if _, err := js.Stream(context.Background(), StreamName); err != nil {
				t.Fatalf("replica token: %v", err)
			}
			_ = nc
		})
	}
}

func writeCA(t *testing.T, p *testPKI) string {
	t.Helper()
	path := t.TempDir() + "/ca.pem"
	if err := writeFileForTest(path, p.ca.CertPEM()); err != nil {
		t.Fatal(err)
	}
	return path
}

// A worker may publish its own events and serve its own resyncs, and
// nothing else: not another worker's subject, not replica sync, not the
// JetStream API.
func TestBusSecureWorkerPermissions(t *testing.T) {
	p := newTestPKI(t)
	s, replica, js := secureSingle(t, p, "")
	log := testLogger(t)
	ctx := context.Background()

	// The replica watches every subject a forged message could reach.
	var seen atomic.Int64
	var forged atomic.Value
	for _, subj := range []string{"kv.events.w2", "kv.sync.>", "$JS.API.CONSUMER.DELETE.>", "$JS.API.STREAM.>"} {
		if _, err := replica.Subscribe(subj, func(m *nats.Msg) { seen.Add(1); forged.Store(m.Subject) }); err != nil {
			t.Fatal(err)
		}
	}
	if err := replica.Flush(); err != nil {
		t.Fatal(err)
	}

	w1 := p.bundle(t, pki.Worker("w1"))
	violations := make(chan error, 16)
	nc, err := Connect(s.ClientURL(), "w1", log, WithBundle(w1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	nc.SetErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { violations <- err })

	// Allowed: its own events, through the stream, acked to its inbox.
	pub, err := NewPublisher(nc, "w1", 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pub.Close)
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := pub.Publish(pctx, storedEvent(0, 1, 2)); err != nil {
		t.Fatalf("worker publishing its own events: %v", err)
	}
	// Allowed: serving its own resync (the reply goes to the requester).
	sub, err := ServeResync(nc, "w1", log, func(ResyncRequest) ResyncReply { return ResyncReply{Accepted: true} })
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
	defer rcancel()
	if rep, err := RequestResync(rctx, replica, ResyncRequest{Worker: "w1"}); err != nil || !rep.Accepted {
		t.Fatalf("resync through a worker: %+v, %v", rep, err)
	}

	// Refused: every forged write of issue 16, and wider subscriptions.
	forgedSync := mustEncode(t, storedEvent(1, 7))
	for _, subj := range []string{
		EventSubject("w2"),
		SyncSubject("m"), SyncSubject(""),
		"$JS.API.CONSUMER.DELETE." + StreamName + "." + DefaultDurable,
		"$JS.API.STREAM.PURGE." + StreamName,
	} {
		if err := nc.Publish(subj, forgedSync); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := nc.Request("$JS.API.CONSUMER.DELETE."+StreamName+"."+DefaultDurable, nil, time.Second); err == nil {
		t.Fatal("worker request to the JetStream API answered")
	}
	for _, subj := range []string{"kv.events.>", "_INBOX.>", ResyncSubject("w2"), "$JS.API.>"} {
		if _, err := nc.SubscribeSync(subj); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	// 6 publishes + 4 subscriptions, each answered with a violation.
	want := 10
	poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error {
		if len(violations) < want {
			return fmt.Errorf("%d permission violations reported, want %d", len(violations), want)
		}
		return nil
	})
	for range want {
		if err := <-violations; !errors.Is(err, nats.ErrPermissionViolation) && !strings.Contains(err.Error(), "Permissions Violation") {
			t.Fatalf("unexpected error: %v", err)
		}
	}
	// Messages of one connection arrive in order: a marker the worker may
	// send, received after everything it sent before, proves nothing
	// forged got through to the replica's subscriptions.
	marker, err := replica.SubscribeSync(EventSubject("w1"))
	if err != nil {
		t.Fatal(err)
	}
	if err := replica.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := nc.Publish(EventSubject("w1"), []byte("marker")); err != nil {
		t.Fatal(err)
	}
	if _, err := marker.NextMsg(5 * time.Second); err != nil {
		t.Fatalf("marker: %v", err)
	}
	if n := seen.Load(); n != 0 {
		t.Fatalf("%d forged messages reached the replica (last on %v)", n, forged.Load())
	}
	// The ingest consumer and the stream are intact.
	if _, err := js.Consumer(ctx, StreamName, DefaultDurable); err != nil {
		t.Fatalf("consumer after a worker's delete: %v", err)
	}
	st, err := js.Stream(ctx, StreamName)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// The event and the marker: nothing purged, nothing forged.
	if info.State.Msgs != 2 {
		t.Fatalf("stream holds %d messages, want 2", info.State.Msgs)
	}
}

// Routes run over mutual TLS between members only: a route connection with
// a certificate of another CA, of a worker, or of a node that is not a
// member fails in the TLS handshake, before NATS sends or reads a byte of
// its protocol.
func TestBusSecureRoutesRefuseStrangers(t *testing.T) {
	p, other := newTestPKI(t), newTestPKI(t)
	log := testLogger(t)
	members := map[string]bool{"n1": true, "n2": true}
	cport := freePort(t)
	s, err := StartServer(ServerConfig{Name: "n1", Port: freePort(t), StoreDir: t.TempDir(), Logger: log,
		ClusterName: "kvtest", ClusterPort: cport, Routes: []string{fmt.Sprintf("127.0.0.1:%d", cport)},
		Security: Security{Bundle: p.bundle(t, pki.Node("n1")), IsMember: func(id string) bool { return members[id] }}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Shutdown)
	addr := fmt.Sprintf("127.0.0.1:%d", cport)
	dial := func(b *pki.Bundle, force bool) error {
		c := b.ClientTLS(nil)
		c.RootCAs = p.ca.Pool()
		if force {
			cert := b.Certificate()
			c.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return cert, nil }
		}
		// A TLS route starts with the handshake: NATS sends its INFO only
		// to a peer that passed it.
		tc, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, c)
		if err != nil {
			return err
		}
		defer tc.Close()
		_ = tc.SetDeadline(time.Now().Add(5 * time.Second))
		// TLS 1.3: a refused client certificate shows at the first read.
		line, err := readLine(tc)
		if err == nil && !strings.HasPrefix(line, "INFO ") {
			return fmt.Errorf("route greeted with %q", line)
		}
		return err
	}
	if err := dial(p.bundle(t, pki.Node("n2")), false); err != nil {
		t.Fatalf("member n2 refused: %v", err)
	}
	for name, b := range map[string]*pki.Bundle{
		"another CA": other.bundle(t, pki.Node("n2")),
		"a worker":   p.bundle(t, pki.Worker("n2")),
		"non-member": p.bundle(t, pki.Node("n9")),
	} {
		if err := dial(b, true); err == nil {
			t.Errorf("route from %s admitted", name)
		}
	}
}

func readLine(c net.Conn) (string, error) {
	var b strings.Builder
	buf := make([]byte, 1)
	for {
		if _, err := c.Read(buf); err != nil {
			return b.String(), err
		}
		if buf[0] == '\n' {
			return b.String(), nil
		}
		b.WriteByte(buf[0])
	}
}

func TestBusRedactURL(t *testing.T) {
	tests := map[string]string{
		"nats://127.0.0.1:4222":        "nats://127.0.0.1:4222",
		"nats://user:pw@h:4222":        "nats://REDACTED@h:4222",
		"tls://tok@h:1,nats://a:b@g:2": "tls://REDACTED@h:1,nats://REDACTED@g:2",
		"tok@h:4222":                   "REDACTED@h:4222",
		"nats://u:p@ss@h:1/x?y@z":      "nats://REDACTED@h:1/x?y@z",
		"nats://h:1, nats://u:p@h:2":   "nats://h:1,nats://REDACTED@h:2",
	}
	for in, want := range tests {
		if got := RedactURL(in); got != want {
			t.Errorf("RedactURL(%q) = %q, want %q", in, got, want)
		}
	}
	_, err := Connect("nats://hunter2@127.0.0.1:1", "t", testLogger(t))
	if err == nil || strings.Contains(err.Error(), "hunter2") {
		t.Fatalf("connect error %v quotes the credential", err)
	}
}

// TestBusWildcardListenSecure: a replica whose bus listens on 0.0.0.0
// connects its own client (no certificate names a wildcard address): it
// dials loopback and checks the server against its own certificate's name,
// here a DNS name that does not resolve to loopback at all.
func TestBusWildcardListenSecure(t *testing.T) {
	p := newTestPKI(t)
	kp, err := p.ca.Issue(pki.Request{Identity: pki.Node("r1"), Hosts: []string{"r1.example"}})
	if err != nil {
		t.Fatal(err)
	}
	b, err := pki.NewBundle(p.ca.CertPEM(), kp)
	if err != nil {
		t.Fatal(err)
	}
	bus, err := OpenBus(BusConfig{ClientName: "r1", Logger: testLogger(t), Server: ServerConfig{Name: "r1", Host: "0.0.0.0",
		StoreDir: t.TempDir(), Security: Security{Bundle: b}}})
	if err != nil {
		t.Fatalf("open a secure bus listening on 0.0.0.0: %v", err)
	}
	t.Cleanup(bus.Close)
	if !bus.Conn().IsConnected() {
		t.Fatal("own client not connected")
	}
	if got := bus.Server().ClientSecurity().ServerName; got != "r1.example" {
		t.Errorf("own client checks the server as %q, want the certificate's r1.example", got)
	}
	// The URL it dials is loopback, not the wildcard.
	if u, wildcard := bus.Server().localURL(); !wildcard || !strings.Contains(u, "127.0.0.1") {
		t.Errorf("local URL %q (wildcard %v), want loopback", u, wildcard)
	}
}
