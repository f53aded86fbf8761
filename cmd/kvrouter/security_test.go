package main

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/pki"
)

// TestServeSecurityConfig: the secure defaults and their opt-outs.
func TestServeSecurityConfig(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	adminFile, keyFile, replicaFile := write("admin", "adm-secret\n"), write("wkey", "wk-secret\n"), write("replica", "rep-secret")
	tlsArgs := []string{"--tls-ca", "ca.pem", "--tls-cert", "node.pem", "--tls-key", "node-key.pem"}
	off := []string{"--http-addr", "10.0.0.1:8001", "--raft-addr", "10.0.0.1:7001", "--nats-addr", "10.0.0.1:4222", "--nats-cluster-addr", "10.0.0.1:6222"}
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	tests := []struct {
		name    string
		args    []string
		env     map[string]string
		wantErr string // "" = must parse
		check   func(serveConfig) bool
	}{
		{"loopback without material runs insecure", []string{"--single-node"}, nil, "", func(c serveConfig) bool {
			return c.Insecure && c.AdvertiseHTTP == "http://127.0.0.1:8001" && len(c.Warnings) > 0
		}},
		{"material: https advertised, plain allowed on loopback", append([]string{"--single-node"}, tlsArgs...), nil, "", func(c serveConfig) bool {
			return !c.Insecure && c.AdvertiseHTTP == "https://127.0.0.1:8001" && c.AllowPlainHTTP
		}},
		{"plain off on request", append([]string{"--single-node", "--allow-plain-http=false"}, tlsArgs...), nil, "", func(c serveConfig) bool { return !c.AllowPlainHTTP }},
		{"incomplete material", []string{"--single-node", "--tls-ca", "ca.pem"}, nil, "certificate file, key file", nil},
		{"off loopback needs material and token", append([]string{"--single-node"}, off...), nil, "TLS material (--tls-ca", nil},
		{"off loopback needs a token", append(append([]string{"--single-node"}, off...), tlsArgs...), nil, "an admin token", nil},
		{"off loopback secure", append(append([]string{"--single-node", "--admin-token-file", adminFile}, off...), tlsArgs...), nil, "", func(c serveConfig) bool {
			return c.AdminToken == "adm-secret" && !c.AllowPlainHTTP && c.AdvertiseHTTP == "https://10.0.0.1:8001"
		}},
		{"off loopback insecure on purpose", append([]string{"--single-node", "--insecure"}, off...), nil, "", func(c serveConfig) bool { return c.Insecure }},
		{"secret files from the environment", append([]string{"--single-node"}, tlsArgs...),
			map[string]string{"KVROUTER_ADMIN_TOKEN_FILE": adminFile, "KVROUTER_WORKER_API_KEY_FILE": keyFile, "KVROUTER_REPLICA_TOKEN_FILE": replicaFile}, "",
			func(c serveConfig) bool {
				return c.AdminToken == "adm-secret" && c.WorkerAPIKey.Reveal() == "wk-secret" && c.ReplicaToken.Reveal() == "rep-secret"
			}},
		{"worker key inline", []string{"--single-node", "--worker-api-key", "k1"}, nil, "", func(c serveConfig) bool { return c.WorkerAPIKey.Reveal() == "k1" }},
		{"token twice", []string{"--single-node", "--admin-token", "a", "--admin-token-file", adminFile}, nil, "give the admin token once", nil},
		{"missing secret file", []string{"--single-node", "--worker-api-key-file", filepath.Join(dir, "nope")}, nil, "--worker-api-key-file", nil},
		{"replica token needs TLS", []string{"--single-node", "--replica-token-file", replicaFile}, nil, "needs TLS material", nil},
		{"http advertise with TLS", append([]string{"--single-node", "--advertise-http", "http://127.0.0.1:8001"}, tlsArgs...), nil, "https://", nil},
	}
	for _, tc := range tests {
		c, err := parseServe(tc.args, env(tc.env), io.Discard)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%s: err = %v, want %q", tc.name, err, tc.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if tc.check != nil && !tc.check(c) {
			t.Errorf("%s: config %+v", tc.name, c.Config)
		}
		// Secrets never print: the config as a whole may reach a log.
		for _, s := range []string{"wk-secret", "rep-secret"} {
			if strings.Contains(strings.Join([]string{fmtAny(c.Config)}, ""), s) {
				t.Errorf("%s: %s printed", tc.name, s)
			}
		}
	}
}

// TestCerts: kvrouter certs writes a CA and the holders' files, loadable
// as bundles with the identities and hosts asked for, and a second run
// issues nothing.
func TestCerts(t *testing.T) {
	dir := t.TempDir()
	var out, errb bytes.Buffer
	args := []string{"--dir", dir, "--nodes", "r1=127.0.0.1,localhost,r2=127.0.0.1", "--workers", "mock-1,mock-2"}
	if code := dispatch(t.Context(), append([]string{"certs"}, args...), &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	if !strings.Contains(out.String(), "4 issued") {
		t.Errorf("output %q", out.String())
	}
	l := pki.Layout{Dir: dir}
	for _, id := range []pki.Identity{pki.Node("r1"), pki.Node("r2"), pki.Worker("mock-1"), pki.Worker("mock-2")} {
		b, err := pki.LoadBundle(l.Material(id))
		if err != nil || b.Identity() != id {
			t.Errorf("%s: %v", id, err)
		}
	}
	if fi, err := os.Stat(l.Material(pki.Node("r1")).KeyFile); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("key file mode: %v %v", fi.Mode(), err)
	}
	out.Reset()
	if code := dispatch(t.Context(), append([]string{"certs"}, args...), &out, &errb); code != 0 || !strings.Contains(out.String(), "0 issued") {
		t.Errorf("second run: exit %d, %q", code, out.String())
	}
	for _, bad := range [][]string{{"--dir", dir}, {"--dir", dir, "--nodes", "127.0.0.1"}, {"--dir", dir, "--nodes", "r1="},
		{"--dir", dir, "--nodes", "r1=a,r1=b"}, {"--dir", dir, "--workers", "bad/id"}} {
		if code := dispatch(t.Context(), append([]string{"certs"}, bad...), io.Discard, io.Discard); code == 0 {
			t.Errorf("%q accepted", bad)
		}
	}
}

func fmtAny(v any) string { return fmt.Sprintf("%v %+v %#v", v, v, v) }
