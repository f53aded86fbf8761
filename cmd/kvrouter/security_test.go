package main

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
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
		{"client certificates need TLS", []string{"--single-node", "--api-client-certs"}, nil, "--api-client-certs checks TLS client certificates", nil},
		{"client certificates not with --insecure", append([]string{"--single-node", "--api-client-certs", "--insecure"}, tlsArgs...), nil, "not --insecure", nil},
		{"client certificates", append([]string{"--single-node", "--api-client-certs"}, tlsArgs...), nil, "", func(c serveConfig) bool { return c.APIClientCerts }},
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
	args := []string{"--dir", dir, "--nodes", "r1=127.0.0.1,localhost,r2=127.0.0.1", "--workers", "mock-1,mock-2", "--clients", "app"}
	if code := dispatch(t.Context(), append([]string{"certs"}, args...), &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	if !strings.Contains(out.String(), "5 issued") {
		t.Errorf("output %q", out.String())
	}
	l := pki.Layout{Dir: dir}
	for _, id := range []pki.Identity{pki.Node("r1"), pki.Node("r2"), pki.Worker("mock-1"), pki.Worker("mock-2"), pki.Client("app")} {
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
		{"--dir", dir, "--nodes", "r1=a,r1=b"}, {"--dir", dir, "--workers", "bad/id"}, {"--dir", dir, "--clients", "a,a"}} {
		if code := dispatch(t.Context(), append([]string{"certs"}, bad...), io.Discard, io.Discard); code == 0 {
			t.Errorf("%q accepted", bad)
		}
	}
}

func fmtAny(v any) string { return fmt.Sprintf("%v %+v %#v", v, v, v) }

// TestCertsTokenFiles: --token-files creates each token once (0600, 32
// random bytes as hex, different per file), keeps it on later runs, and
// refuses names that are not plain file names or that would overwrite a
// certificate.
func TestCertsTokenFiles(t *testing.T) {
	dir := t.TempDir()
	args := []string{"certs", "--dir", dir, "--token-files", "admin-token,replica-token"}
	var out, errb bytes.Buffer
	if code := dispatch(t.Context(), args, &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	read := func(name string) string {
		t.Helper()
		p := filepath.Join(dir, name)
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v, want 0600", name, fi.Mode().Perm())
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	hexToken := regexp.MustCompile(`^[0-9a-f]{64}$`)
	admin, replica := read("admin-token"), read("replica-token")
	for name, tok := range map[string]string{"admin-token": admin, "replica-token": replica} {
		if !hexToken.MatchString(tok) {
			t.Errorf("%s: %d bytes, want 64 hex digits", name, len(tok))
		}
		if strings.Contains(out.String(), tok) {
			t.Errorf("the output shows the %s", name)
		}
	}
	if admin == replica {
		t.Error("both tokens are equal")
	}
	if s, err := pki.ReadSecretFile(filepath.Join(dir, "admin-token")); err != nil || s.Reveal() != admin {
		t.Errorf("ReadSecretFile: %v", err)
	}

	// A rerun keeps both, also a token the operator wrote by hand.
	if err := os.WriteFile(filepath.Join(dir, "replica-token"), []byte("chosen\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	if code := dispatch(t.Context(), args, &out, &errb); code != 0 {
		t.Fatalf("second run: exit %d: %s", code, errb.String())
	}
	if read("admin-token") != admin || read("replica-token") != "chosen\n" {
		t.Error("a rerun changed an existing token")
	}
	if !strings.Contains(out.String(), "kept") {
		t.Errorf("second run output %q: want the tokens reported kept", out.String())
	}
	leftovers, _ := filepath.Glob(filepath.Join(dir, ".*tmp*"))
	if len(leftovers) > 0 {
		t.Errorf("temporary files left: %v", leftovers)
	}

	// An empty token file is an error that names the file, not a silent keep.
	if err := os.WriteFile(filepath.Join(dir, "empty"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	errb.Reset()
	if code := dispatch(t.Context(), []string{"certs", "--dir", dir, "--token-files", "empty"}, io.Discard, &errb); code == 0 ||
		!strings.Contains(errb.String(), filepath.Join(dir, "empty")) {
		t.Errorf("empty token file: exit %d, %q", code, errb.String())
	}

	for _, bad := range []string{"../escape", "sub/token", ".hidden", "ca.pem", "node-r1-key.pem", "a,a"} {
		if code := dispatch(t.Context(), []string{"certs", "--dir", dir, "--token-files", bad}, io.Discard, io.Discard); code != 2 {
			t.Errorf("--token-files %q: exit %d, want 2", bad, code)
		}
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(dir), "escape")); err == nil {
		t.Error("a token was written outside --dir")
	}
}

// TestCertsExport: --export copies the CA certificate, the holders'
// certificates and keys and the tokens, with their modes, but never the CA
// key; a rerun rewrites nothing, and a reissued certificate is copied again.
func TestCertsExport(t *testing.T) {
	base := t.TempDir()
	dir, export := filepath.Join(base, "ca"), filepath.Join(base, "mounted")
	args := []string{"certs", "--dir", dir, "--export", export, "--nodes", "r1=r1,127.0.0.1",
		"--workers", "mock-1", "--token-files", "admin-token"}
	var out, errb bytes.Buffer
	if code := dispatch(t.Context(), args, &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	want := map[string]os.FileMode{"ca.pem": 0o644, "node-r1.pem": 0o644, "node-r1-key.pem": 0o600,
		"worker-mock-1.pem": 0o644, "worker-mock-1-key.pem": 0o600, "admin-token": 0o600}
	entries, err := os.ReadDir(export)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range entries {
		got = append(got, e.Name())
	}
	if len(got) != len(want) {
		t.Errorf("exported %v, want exactly %d files (no ca-key.pem)", got, len(want))
	}
	for name, mode := range want {
		p := filepath.Join(export, name)
		fi, err := os.Stat(p)
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		if fi.Mode().Perm() != mode {
			t.Errorf("%s: mode %v, want %v", name, fi.Mode().Perm(), mode)
		}
		a, _ := os.ReadFile(p)
		b, _ := os.ReadFile(filepath.Join(dir, name))
		if !bytes.Equal(a, b) {
			t.Errorf("%s: the copy differs from the original", name)
		}
	}
	// The exported directory is usable without the CA key.
	l := pki.Layout{Dir: export}
	if b, err := pki.LoadBundle(l.Material(pki.Node("r1"))); err != nil || b.Identity() != pki.Node("r1") {
		t.Errorf("exported node bundle: %v", err)
	}

	out.Reset()
	if code := dispatch(t.Context(), args, &out, &errb); code != 0 || !strings.Contains(out.String(), "(0 changed") {
		t.Errorf("rerun: exit %d, %q: want nothing rewritten", code, out.String())
	}

	// A new host for r1 reissues its certificate; the export follows.
	old, _ := os.ReadFile(filepath.Join(export, "node-r1.pem"))
	args[6] = "r1=r1,127.0.0.1,localhost"
	out.Reset()
	if code := dispatch(t.Context(), args, &out, &errb); code != 0 || !strings.Contains(out.String(), "(2 changed") {
		t.Errorf("reissue: exit %d, %q: want the node certificate and key rewritten", code, out.String())
	}
	if now, _ := os.ReadFile(filepath.Join(export, "node-r1.pem")); bytes.Equal(now, old) {
		t.Error("the exported certificate was not replaced")
	}

	if code := dispatch(t.Context(), []string{"certs", "--dir", dir, "--export", dir + "/", "--workers", "w"}, io.Discard, io.Discard); code != 2 {
		t.Errorf("--export equal to --dir: exit %d, want 2", code)
	}
}
