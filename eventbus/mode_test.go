package eventbus

import (
	"log/slog"
	"os"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/internal/pki"
)

// testPKI is a deployment's CA for one test.
type testPKI struct{ ca *pki.CA }

func newTestPKI(t testing.TB) *testPKI {
	t.Helper()
	ca, err := pki.NewCA(pki.CAOptions{Name: t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	return &testPKI{ca: ca}
}

// bundle issues id a certificate valid on loopback.
func (p *testPKI) bundle(t testing.TB, id pki.Identity) *pki.Bundle {
	t.Helper()
	kp, err := p.ca.Issue(pki.Request{Identity: id, Hosts: []string{"127.0.0.1", "localhost"}})
	if err != nil {
		t.Fatal(err)
	}
	b, err := pki.NewBundle(p.ca.CertPEM(), kp)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// busMode runs a test against an insecure bus (pki nil) or a secure one.
type busMode struct {
	name string
	pki  *testPKI
}

var insecureMode = busMode{name: "insecure"}

// bothModes is for the tests that must pass either way.
func bothModes(t testing.TB) []busMode {
	return []busMode{insecureMode, {name: "secure", pki: newTestPKI(t)}}
}

func (m busMode) security(t testing.TB, node string) Security {
	if m.pki == nil {
		return Security{Insecure: true}
	}
	return Security{Bundle: m.pki.bundle(t, pki.Node(node))}
}

// replica connects as a replica: the node certificate of node in the
// secure mode.
func (m busMode) replica(t testing.TB, url, node string, log *slog.Logger) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	if m.pki == nil {
		return connectWith(t, url, node, log)
	}
	return connectWith(t, url, node, log, WithBundle(m.pki.bundle(t, pki.Node(node))))
}

// worker connects as worker: its worker certificate in the secure mode.
func (m busMode) worker(t testing.TB, url, worker string, log *slog.Logger) *nats.Conn {
	t.Helper()
	if m.pki == nil {
		nc, _ := connectWith(t, url, worker, log)
		return nc
	}
	nc, _ := connectWith(t, url, worker, log, WithBundle(m.pki.bundle(t, pki.Worker(worker))))
	return nc
}

func writeFileForTest(path string, data []byte) error { return os.WriteFile(path, data, 0o644) }
