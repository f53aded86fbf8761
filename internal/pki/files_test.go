package pki

import (
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
	leaf := b.cert.Leaf
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
