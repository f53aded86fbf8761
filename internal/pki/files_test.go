package pki

import (
	"crypto/tls"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestPKIFilesRoundTrip(t *testing.T) {
	dir := t.TempDir()
	ca, err := NewCA(CAOptions{})
	if err != nil {
		t.Fatal(err)
	}
	caCert, caKey := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem")
	if err := ca.Save(caCert, caKey); err != nil {
		t.Fatal(err)
	}
	// A reloaded CA issues certificates the saved one's pool trusts.
	ca2, err := LoadCA(caCert, caKey)
	if err != nil {
		t.Fatal(err)
	}
	kp, err := ca2.Issue(Request{Identity: Node("n1"), Hosts: []string{"127.0.0.1", "n1.example"}})
	if err != nil {
		t.Fatal(err)
	}
	m := Material{CAFile: caCert, CertFile: filepath.Join(dir, "n1.pem"), KeyFile: filepath.Join(dir, "sub", "n1-key.pem")}
	if err := kp.Save(m.CertFile, m.KeyFile); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{caKey, m.KeyFile} {
		st, err := os.Stat(key)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != 0o600 {
			t.Errorf("%s has mode %v, want 0600", key, st.Mode().Perm())
		}
	}
	b, err := LoadBundle(m)
	if err != nil {
		t.Fatal(err)
	}
	if b.Identity() != Node("n1") {
		t.Fatalf("identity %v", b.Identity())
	}
	leaf := b.cert.Load().Leaf
	if len(leaf.IPAddresses) != 1 || len(leaf.DNSNames) != 1 || leaf.DNSNames[0] != "n1.example" {
		t.Fatalf("hosts not in SAN: %v %v", leaf.IPAddresses, leaf.DNSNames)
	}
}

func TestPKILoadBundleRefuses(t *testing.T) {
	dir := t.TempDir()
	ca, _ := NewCA(CAOptions{})
	other, _ := NewCA(CAOptions{})
	caFile := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(caFile, ca.CertPEM(), 0o644); err != nil {
		t.Fatal(err)
	}
	save := func(name string, issuer *CA, req Request) Material {
		kp, err := issuer.Issue(req)
		if err != nil {
			t.Fatal(err)
		}
		m := Material{CAFile: caFile, CertFile: filepath.Join(dir, name+".pem"), KeyFile: filepath.Join(dir, name+"-key.pem")}
		if err := kp.Save(m.CertFile, m.KeyFile); err != nil {
			t.Fatal(err)
		}
		return m
	}
	expired := save("expired", ca, Request{Identity: Node("n1"), Now: time.Now().Add(-48 * time.Hour), Validity: time.Hour})
	foreign := save("foreign", other, Request{Identity: Node("n1")})
	good := save("good", ca, Request{Identity: Node("n1")})
	mismatched := Material{CAFile: caFile, CertFile: good.CertFile, KeyFile: foreign.KeyFile}

	tests := []struct {
		name string
		m    Material
		want string
	}{
		{"nothing", Material{}, "missing [CA file certificate file key file]"},
		{"no key", Material{CAFile: caFile, CertFile: good.CertFile}, "missing [key file]"},
		{"expired", expired, "expired"},
		{"another CA", foreign, "unknown authority"},
		{"key of another certificate", mismatched, "does not match"},
		{"no such file", Material{CAFile: caFile, CertFile: good.CertFile, KeyFile: filepath.Join(dir, "nope")}, "no such file"},
	}
	for _, tt := range tests {
		_, err := LoadBundle(tt.m)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: got %v, want an error containing %q", tt.name, err, tt.want)
		}
	}
}

func TestPKIIssueCapsAtCAExpiry(t *testing.T) {
	ca, _ := NewCA(CAOptions{Validity: time.Hour})
	kp, err := ca.Issue(Request{Identity: Worker("w1"), Validity: 100 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	c, _ := kp.TLSCertificate()
	if c.Leaf.NotAfter.After(ca.Certificate().NotAfter) {
		t.Fatalf("leaf expires %v after its CA %v", c.Leaf.NotAfter, ca.Certificate().NotAfter)
	}
}

// TestPKIBundleReload: a bundle loaded from files presents a rotated
// certificate from the next handshake on, and keeps its current one when
// the new files are unchanged, unreadable, of another identity or from
// another CA.
func TestPKIBundleReload(t *testing.T) {
	f := newFixture(t)
	dir := t.TempDir()
	m := Material{CAFile: filepath.Join(dir, "ca.pem"), CertFile: filepath.Join(dir, "n1.pem"), KeyFile: filepath.Join(dir, "n1-key.pem")}
	if err := f.ca.Save(m.CAFile, filepath.Join(dir, "ca-key.pem")); err != nil {
		t.Fatal(err)
	}
	issue := func(ca *CA, id Identity) *KeyPair {
		kp, err := ca.Issue(Request{Identity: id, Hosts: []string{"127.0.0.1"}})
		if err != nil {
			t.Fatal(err)
		}
		return kp
	}
	if err := issue(f.ca, Node("n1")).Save(m.CertFile, m.KeyFile); err != nil {
		t.Fatal(err)
	}
	b, err := LoadBundle(m)
	if err != nil {
		t.Fatal(err)
	}
	server := b.ServerTLS(nil)
	client := newBundleOrFail(t, f.ca, Node("n2")).ClientTLS(nil)
	serial := func() string {
		t.Helper()
		_, cerr, _ := handshake(t, server, client)
		if cerr != nil {
			t.Fatalf("handshake: %v", cerr)
		}
		return b.cert.Load().Leaf.SerialNumber.String()
	}
	first := serial()
	if changed, err := b.Reload(); changed || err != nil {
		t.Fatalf("reload of unchanged files: changed %v, %v", changed, err)
	}

	// Rotation: a new certificate and key for the same node.
	rotated := issue(f.ca, Node("n1"))
	if err := rotated.Save(m.CertFile, m.KeyFile); err != nil {
		t.Fatal(err)
	}
	if changed, err := b.Reload(); !changed || err != nil {
		t.Fatalf("reload after rotation: changed %v, %v", changed, err)
	}
	if got := serial(); got == first {
		t.Fatal("the rotated certificate is not the one presented")
	}
	presented := peerSerial(t, server, client)
	if presented != b.cert.Load().Leaf.SerialNumber.String() {
		t.Fatalf("handshake presented serial %s, bundle holds %s", presented, b.cert.Load().Leaf.SerialNumber)
	}

	// Each bad state is refused and the rotated certificate stays.
	kept := b.cert.Load().Leaf.SerialNumber.String()
	for name, write := range map[string]func(){
		"half-written": func() { _ = os.WriteFile(m.CertFile, []byte("-----BEGIN CERT"), 0o644) },
		"another node": func() { _ = issue(f.ca, Node("n9")).Save(m.CertFile, m.KeyFile) },
		"another CA":   func() { _ = issue(f.other, Node("n1")).Save(m.CertFile, m.KeyFile) },
	} {
		write()
		if changed, err := b.Reload(); changed || err == nil {
			t.Errorf("%s: reload changed %v, err %v; want refused", name, changed, err)
		}
		if got := b.cert.Load().Leaf.SerialNumber.String(); got != kept {
			t.Errorf("%s: serial %s after a refused reload, want %s kept", name, got, kept)
		}
	}
	if _, err := newBundleFromMemory(t, f.ca).Reload(); err == nil {
		t.Error("an in-memory bundle reloaded")
	}
}

func newBundleOrFail(t *testing.T, ca *CA, id Identity) *Bundle {
	t.Helper()
	kp, err := ca.Issue(Request{Identity: id, Hosts: []string{"127.0.0.1"}})
	if err != nil {
		t.Fatal(err)
	}
	b, err := NewBundle(ca.CertPEM(), kp)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func newBundleFromMemory(t *testing.T, ca *CA) *Bundle { return newBundleOrFail(t, ca, Node("mem")) }

// peerSerial is the serial of the certificate the server presented in one
// handshake.
func peerSerial(t *testing.T, server, client *tls.Config) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		tc := tls.Server(c, server)
		_ = tc.Handshake()
		_, _ = tc.Write([]byte{1})
		tc.Close()
	}()
	cc := client.Clone()
	cc.ServerName = "127.0.0.1"
	c, err := tls.Dial("tcp", ln.Addr().String(), cc)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	return c.ConnectionState().PeerCertificates[0].SerialNumber.String()
}
