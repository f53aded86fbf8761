package deploy

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/pki"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/internal/reftest"
)

// The deployments run with TLS and authentication on (SECURITY.md, issue
// 16): these tests check that the Compose stack, HAProxy, Prometheus and the
// Kubernetes manifests agree on where the credentials are and that nothing
// turns security off.

// composeCAFile is where the compose services that verify the replicas
// (HAProxy, Prometheus) find the CA: the certs volume, mounted at /certs.
const composeCAFile = "/certs/ca.pem"

// writeTestCA writes a fresh CA certificate into a temporary file.
func writeTestCA(t *testing.T) string {
	t.Helper()
	ca, err := pki.NewCA(pki.CAOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(p, ca.CertPEM(), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestDeployNoInsecure: no configuration under deploy/ turns security off.
// The opt-outs are documented (*.md) and belong to the local cluster
// (local/run.sh: KVROUTER_RUN_INSECURE=1 passes --insecure).
func TestDeployNoInsecure(t *testing.T) {
	checked := 0
	err := filepath.WalkDir(".", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		if strings.HasSuffix(p, ".md") || strings.HasSuffix(p, "_test.go") || p == "local/run.sh" ||
			strings.HasPrefix(p, "k8s/secrets/") || strings.HasPrefix(p, "grafana/dashboards/") {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		checked++
		for _, bad := range []string{"KVROUTER_INSECURE", "--insecure", "DYN_INSECURE"} {
			if bytes.Contains(b, []byte(bad)) {
				t.Errorf("%s contains %s: deployments run with TLS and authentication (only make run has a documented opt-out)", p, bad)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if checked < 15 {
		t.Errorf("checked only %d files", checked)
	}
}

// --- Docker Compose ------------------------------------------------------------

// dependsOn returns the services s waits for, with their conditions
// ("service_started" for the short list form).
func dependsOn(s composeService) map[string]string {
	out := map[string]string{}
	switch d := s.DependsOn.(type) {
	case []any:
		for _, n := range d {
			out[fmt.Sprint(n)] = "service_started"
		}
	case map[string]any:
		for n, v := range d {
			cond := "service_started"
			if m, ok := v.(map[string]any); ok && m["condition"] != nil {
				cond = fmt.Sprint(m["condition"])
			}
			out[n] = cond
		}
	}
	return out
}

// effectiveFlags merges a service's flags with its environment variables
// (PREFIX_SOME_FLAG → some-flag), as kvrouter serve and kvmock read them;
// a flag on the command line wins.
func effectiveFlags(s composeService, prefix string) map[string]string {
	out := map[string]string{}
	for k, v := range s.Environment {
		if name, ok := strings.CutPrefix(k, prefix); ok {
			out[strings.ToLower(strings.ReplaceAll(name, "_", "-"))] = v
		}
	}
	for k, v := range flagValues(s.Command) {
		out[k] = v
	}
	return out
}

// mountOf returns where s mounts the named volume and whether read-only.
func mountOf(s composeService, volume string) (path string, readOnly, ok bool) {
	for _, v := range s.Volumes {
		parts := strings.Split(v, ":")
		if parts[0] == volume && len(parts) >= 2 {
			return parts[1], len(parts) == 3 && parts[2] == "ro", true
		}
	}
	return "", false, false
}

// nodeHosts parses kvrouter certs' --nodes: id → hosts.
func nodeHosts(v string) map[string][]string {
	out := map[string][]string{}
	last := ""
	for _, item := range strings.Split(v, ",") {
		if id, host, ok := strings.Cut(item, "="); ok {
			last = id
			out[id] = append(out[id], host)
		} else if last != "" {
			out[last] = append(out[last], item)
		}
	}
	return out
}

func TestDeployComposeSecurity(t *testing.T) {
	docs := decodeAll[composeFile](t, "docker-compose.yml")
	if len(docs) != 1 {
		t.Fatalf("docker-compose.yml: %d documents", len(docs))
	}
	c := docs[0]
	replicas := []string{"r1", "r2", "r3"}
	mocks := []string{"mock-1", "mock-2", "mock-3", "mock-4"}

	// The certs service: the CA in its own volume, everything else exported
	// into the one the others mount.
	cs, ok := c.Services["certs"]
	if !ok {
		t.Fatal("no certs service")
	}
	if len(cs.Command) == 0 || cs.Command[0] != "certs" || cs.Image != "kvrouter:local" || len(cs.Entrypoint) > 0 {
		t.Fatalf("certs: image %q entrypoint %v command %v, want `kvrouter certs …` from kvrouter:local", cs.Image, cs.Entrypoint, cs.Command)
	}
	cf := flagValues(cs.Command)
	caDir, caRO, _ := mountOf(cs, "ca")
	certsDir, certsRO, _ := mountOf(cs, "certs")
	if cf["dir"] != caDir || caDir == "" || caRO {
		t.Errorf("certs: --dir %q, want the writable mount of volume ca (%q)", cf["dir"], caDir)
	}
	if cf["export"] != certsDir || certsDir == "" || certsRO {
		t.Errorf("certs: --export %q, want the writable mount of volume certs (%q)", cf["export"], certsDir)
	}
	hosts := nodeHosts(cf["nodes"])
	tokens := strings.Split(cf["token-files"], ",")
	exported := map[string]bool{"ca.pem": true}
	for id := range hosts {
		exported["node-"+id+".pem"], exported["node-"+id+"-key.pem"] = true, true
	}
	for _, w := range strings.Split(cf["workers"], ",") {
		exported["worker-"+w+".pem"], exported["worker-"+w+"-key.pem"] = true, true
	}
	for _, tok := range tokens {
		exported[tok] = true
	}
	if !slices.Equal(slices.Sorted(strings.SplitSeq(cf["workers"], ",")), mocks) {
		t.Errorf("certs: --workers %q, want %v", cf["workers"], mocks)
	}
	for name, s := range c.Services {
		if _, _, ok := mountOf(s, "ca"); ok && name != "certs" {
			t.Errorf("%s mounts the ca volume: only the certs service may see ca-key.pem", name)
		}
	}

	// exportedFile checks that a path a service reads is in its read-only
	// certs mount and is a file the certs service exports.
	exportedFile := func(svc, flag, path string) {
		t.Helper()
		s := c.Services[svc]
		mnt, ro, ok := mountOf(s, "certs")
		switch {
		case !ok || !ro:
			t.Errorf("%s: mount the certs volume read-only (volumes %v)", svc, s.Volumes)
		case filepath.Dir(path) != mnt:
			t.Errorf("%s: %s %q is not in its certs mount %s", svc, flag, path, mnt)
		case !exported[filepath.Base(path)]:
			t.Errorf("%s: %s %q: the certs service does not export %s", svc, flag, path, filepath.Base(path))
		}
	}
	waitsForCerts := func(svc string) {
		t.Helper()
		if got := dependsOn(c.Services[svc])["certs"]; got != "service_completed_successfully" {
			t.Errorf("%s: depends_on certs %q, want condition service_completed_successfully", svc, got)
		}
	}
	// Keys and tokens are 0600, owned by the user the certs service runs as.
	sameUser := func(svc string) {
		t.Helper()
		if u := c.Services[svc].User; u == "" || u != cs.User {
			t.Errorf("%s: user %q, want the certs service's %q (it owns the 0600 keys and tokens)", svc, u, cs.User)
		}
	}
	noInlineSecrets := func(svc string) {
		t.Helper()
		for k := range c.Services[svc].Environment {
			if (strings.Contains(k, "TOKEN") || strings.Contains(k, "API_KEY")) && !strings.HasSuffix(k, "_FILE") {
				t.Errorf("%s: secret %s inline in the environment; use %s_FILE", svc, k, k)
			}
		}
	}

	for _, r := range replicas {
		s := c.Services[r]
		f := effectiveFlags(s, "KVROUTER_")
		waitsForCerts(r)
		sameUser(r)
		noInlineSecrets(r)
		want := map[string]string{"tls-ca": "ca.pem", "tls-cert": "node-" + r + ".pem", "tls-key": "node-" + r + "-key.pem",
			"admin-token-file": "admin-token", "replica-token-file": "replica-token"}
		for flag, file := range want {
			if filepath.Base(f[flag]) != file {
				t.Errorf("%s: --%s %q, want …/%s", r, flag, f[flag], file)
				continue
			}
			exportedFile(r, "--"+flag, f[flag])
		}
		// The certificate names the advertised Raft and HTTP hosts (the
		// replica refuses to start otherwise), and 127.0.0.1 for the
		// published ports.
		raftHost, _, _ := strings.Cut(f["raft-addr"], ":")
		httpHost := strings.TrimPrefix(f["advertise-http"], "https://")
		httpHost, _, _ = strings.Cut(httpHost, ":")
		for _, h := range []string{raftHost, httpHost, "127.0.0.1"} {
			if !slices.Contains(hosts[r], h) {
				t.Errorf("certs: --nodes gives %s the hosts %v, not %q", r, hosts[r], h)
			}
		}
		if f["allow-plain-http"] != "" {
			t.Errorf("%s: --allow-plain-http: the port must be HTTPS only", r)
		}
	}
	for _, m := range mocks {
		s := c.Services[m]
		f := effectiveFlags(s, "KVMOCK_")
		waitsForCerts(m)
		sameUser(m)
		noInlineSecrets(m)
		want := map[string]string{"nats-tls-ca": "ca.pem", "nats-tls-cert": "worker-" + m + ".pem",
			"nats-tls-key": "worker-" + m + "-key.pem", "admin-token-file": "admin-token"}
		for flag, file := range want {
			if filepath.Base(f[flag]) != file {
				t.Errorf("%s: --%s %q, want …/%s", m, flag, f[flag], file)
				continue
			}
			exportedFile(m, "--"+flag, f[flag])
		}
		for _, u := range strings.Split(f["register"], ",") {
			if !strings.HasPrefix(u, "https://") {
				t.Errorf("%s: registers at %q, want https://", m, u)
			}
		}
	}

	// HAProxy checks every replica over TLS, verifying its certificate
	// against the exported CA and its name against the service name.
	waitsForCerts("haproxy")
	exportedFile("haproxy", "ca-file", composeCAFile)
	servers := 0
	for _, l := range haproxyLines(t, "haproxy/haproxy-compose.cfg") {
		f := strings.Fields(l)
		if len(f) < 3 || f[0] != "server" {
			continue
		}
		servers++
		name, host := f[1], strings.Split(f[2], ":")[0]
		opts := " " + strings.Join(f[3:], " ") + " "
		for _, want := range []string{" check ", " check-ssl ", " verify required ", " ca-file " + composeCAFile + " ", " check-sni " + host + " "} {
			if !strings.Contains(opts, want) {
				t.Errorf("haproxy-compose.cfg: server %s lacks %q: %s", name, strings.TrimSpace(want), l)
			}
		}
		if !slices.Contains(hosts[name], host) {
			t.Errorf("haproxy-compose.cfg: server %s checks SNI %s, which its certificate does not name (%v)", name, host, hosts[name])
		}
	}
	if servers != 6 {
		t.Errorf("haproxy-compose.cfg: %d server lines, want 6", servers)
	}

	// Prometheus scrapes over HTTPS trusting the exported CA.
	waitsForCerts("prometheus")
	type promTLS struct {
		ScrapeConfigs []struct {
			JobName   string `yaml:"job_name"`
			Scheme    string `yaml:"scheme"`
			TLSConfig struct {
				CAFile             string `yaml:"ca_file"`
				InsecureSkipVerify bool   `yaml:"insecure_skip_verify"`
			} `yaml:"tls_config"`
		} `yaml:"scrape_configs"`
	}
	for _, sc := range decodeAll[promTLS](t, "prometheus/prometheus.yml")[0].ScrapeConfigs {
		if sc.Scheme != "https" || sc.TLSConfig.InsecureSkipVerify {
			t.Errorf("prometheus job %s: scheme %q, insecure_skip_verify %v: want https, verified", sc.JobName, sc.Scheme, sc.TLSConfig.InsecureSkipVerify)
		}
		exportedFile("prometheus", "ca_file", sc.TLSConfig.CAFile)
	}
}

// TestDeployHAProxyTLSChecks runs HAProxy with haproxy-compose.cfg (server
// addresses, binds and ca-file pointed at this test) in front of three
// HTTPS servers: r1 has a certificate from the CA naming r1, r2 one from
// another CA, r3 one from the right CA that names another host. Only r1
// may pass the checks, and a client's TLS must pass through to it.
func TestDeployHAProxyTLSChecks(t *testing.T) {
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		reftest.Missing(t, "haproxy is not installed (apt-get install -y haproxy); CI installs it")
	}
	ca, err := pki.NewCA(pki.CAOptions{})
	if err != nil {
		t.Fatal(err)
	}
	other, err := pki.NewCA(pki.CAOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	caFile := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(caFile, ca.CertPEM(), 0o644); err != nil {
		t.Fatal(err)
	}
	serve := func(issuer *pki.CA, id string, hosts ...string) string {
		kp, err := issuer.Issue(pki.Request{Identity: pki.Node(id), Hosts: hosts})
		if err != nil {
			t.Fatal(err)
		}
		cert, err := kp.TLSCertificate()
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprintf(w, "served by %s", id)
		}))
		// As a replica: TLS 1.3, client certificates requested, not required.
		srv.TLS = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13, ClientAuth: tls.RequestClientCert}
		srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the refused checks' handshakes
		srv.StartTLS()
		t.Cleanup(srv.Close)
		return srv.Listener.Addr().String()
	}
	addrs := map[string]string{
		"r1": serve(ca, "r1", "r1"),
		"r2": serve(other, "r2", "r2"),            // a stranger's CA
		"r3": serve(ca, "elsewhere", "elsewhere"), // our CA, another name (and CN)
	}
	front, stats := freePort(t), freePort(t)

	// The compose configuration with only addresses changed.
	var cfg strings.Builder
	inResolvers := false
	src, err := os.ReadFile("haproxy/haproxy-compose.cfg")
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(bytes.NewReader(src))
	for sc.Scan() {
		l := sc.Text()
		if l != "" && l[0] != ' ' && l[0] != '#' {
			inResolvers = strings.HasPrefix(l, "resolvers ")
		}
		if inResolvers {
			continue
		}
		l = strings.ReplaceAll(l, " resolvers docker init-addr last,libc,none", "")
		l = strings.ReplaceAll(l, composeCAFile, caFile)
		l = strings.Replace(l, "bind :8000", "bind "+front, 1)
		l = strings.Replace(l, "bind :8404", "bind "+stats, 1)
		for r, a := range addrs {
			l = strings.Replace(l, "server "+r+" "+r+":8080 ", "server "+r+" "+a+" ", 1)
		}
		cfg.WriteString(l + "\n")
	}
	cfgFile := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(cfgFile, []byte(cfg.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(bin, "-c", "-f", cfgFile).CombinedOutput(); err != nil {
		t.Fatalf("haproxy -c: %v\n%s", err, out)
	}
	ctx, cancel := context.WithCancel(t.Context())
	var logs bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, "-db", "-f", cfgFile)
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("haproxy output:\n%s", logs.String())
		}
	})

	// State and last check of every server in backend replicas.
	status := func() (map[string]string, error) {
		resp, err := http.Get("http://" + stats + "/stats;csv")
		if err != nil {
			return nil, err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			return nil, err
		}
		out := map[string]string{}
		for _, line := range strings.Split(string(body), "\n") {
			f := strings.Split(line, ",")
			if len(f) > 37 && f[0] == "replicas" && addrs[f[1]] != "" {
				out[f[1]] = f[17] + " " + f[36]
			}
		}
		return out, nil
	}
	want := map[string]string{"r1": "UP L7OK", "r2": "DOWN L6RSP", "r3": "DOWN L6RSP"}
	poll.Until(t, 15*time.Second, 100*time.Millisecond, func() error {
		got, err := status()
		if err != nil {
			return err
		}
		for r, w := range want {
			if got[r] != w {
				return fmt.Errorf("server states %v, want %v", got, want)
			}
		}
		return nil
	})

	// L4: the client's TLS reaches the replica, whose certificate it
	// verifies with the deployment's CA (HAProxy holds no key).
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: ca.Pool(), ServerName: "r1", MinVersion: tls.VersionTLS13},
	}}
	resp, err := client.Get("https://" + front + "/v1/models")
	if err != nil {
		t.Fatalf("through HAProxy: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(body) != "served by r1" {
		t.Errorf("through HAProxy: %q, want r1's answer", body)
	}
}

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// --- Kubernetes -----------------------------------------------------------------

// k8sMounts maps a container's mount paths to the generator (Secret) and the
// keys it projects there.
func k8sMounts(t *testing.T, what string, ps podSpec, c container, kust k8sObject) map[string][]string {
	t.Helper()
	gens := map[string]k8sGenerator{}
	for _, g := range kust.SecretGenerator {
		gens[g.Name] = g
	}
	out := map[string][]string{}
	for _, m := range c.VolumeMounts {
		for _, v := range ps.Volumes {
			if v.Name != m.Name || v.Secret == nil {
				continue
			}
			g, ok := gens[v.Secret.SecretName]
			if !ok {
				t.Errorf("%s: volume %s mounts Secret %s, which kustomization.yaml does not generate", what, v.Name, v.Secret.SecretName)
				continue
			}
			if !m.ReadOnly {
				t.Errorf("%s: Secret volume %s is not mounted readOnly", what, v.Name)
			}
			if v.Secret.DefaultMode == nil {
				t.Errorf("%s: Secret volume %s: no defaultMode (Kubernetes' default 0644 lets every user of the pod read the keys)", what, v.Name)
			} else if *v.Secret.DefaultMode&0o007 != 0 {
				t.Errorf("%s: Secret volume %s: defaultMode %#o, want no access for others (e.g. 288 = 0440)", what, v.Name, *v.Secret.DefaultMode)
			} else if *v.Secret.DefaultMode&0o400 == 0 || (*v.Secret.DefaultMode&0o040 != 0) != (ps.SecurityContext.FSGroup != nil) {
				t.Errorf("%s: Secret volume %s: defaultMode %#o and fsGroup %v: the pod's user must read it through the group", what, v.Name, *v.Secret.DefaultMode, ps.SecurityContext.FSGroup)
			}
			keys := g.keys()
			if len(v.Secret.Items) > 0 {
				keys = nil
				for _, it := range v.Secret.Items {
					if !slices.Contains(g.keys(), it.Key) {
						t.Errorf("%s: volume %s projects key %s, not in Secret %s", what, v.Name, it.Key, g.Name)
					}
					keys = append(keys, it.Path)
				}
			}
			out[m.MountPath] = keys
		}
	}
	return out
}

func TestDeployK8sSecurity(t *testing.T) {
	kust, objs := loadK8s(t)
	var all []string
	for _, g := range append(slices.Clone(kust.SecretGenerator), kust.ConfigMapGenerator...) {
		for _, f := range g.Files {
			all = append(all, f)
			if filepath.Base(f) == "ca-key.pem" {
				t.Errorf("generator %s holds ca-key.pem: the CA key never goes into the cluster", g.Name)
			}
			if !strings.HasPrefix(f, "secrets/") {
				t.Errorf("generator %s reads %s: certs.sh writes under secrets/ (git-ignored)", g.Name, f)
			}
		}
	}
	if ign, err := os.ReadFile("k8s/secrets/.gitignore"); err != nil || !strings.Contains(string(ign), "*") {
		t.Errorf("k8s/secrets/.gitignore must ignore the generated keys: %v", err)
	}

	// checkPaths: every file flag points into a Secret mount at a key that
	// Secret has, for each pod name.
	checkPaths := func(what string, pods []string, mounts map[string][]string, f map[string]string, want map[string]string) {
		t.Helper()
		for flag, file := range want {
			v := f[flag]
			// Exact base names: a per-pod file must name $(POD_NAME), or
			// every pod would present one pod's identity.
			if filepath.Base(v) != file {
				t.Errorf("%s: --%s %q, want …/%s", what, flag, v, file)
				continue
			}
			keys, ok := mounts[filepath.Dir(v)]
			if !ok {
				t.Errorf("%s: --%s %q is not in a Secret mount (%v)", what, flag, v, mounts)
				continue
			}
			for _, pod := range pods {
				key := strings.ReplaceAll(filepath.Base(v), "$(POD_NAME)", pod)
				if !slices.Contains(keys, key) {
					t.Errorf("%s: pod %s reads %s, not in its Secret (keys %v)", what, pod, key, keys)
				}
			}
		}
	}

	sts := objs["StatefulSet/kvrouter"]
	ps := sts.Spec.Template.Spec
	c := ps.Containers[0]
	f := flagValues(c.Args)
	var pods []string
	for i := range *sts.Spec.Replicas {
		pods = append(pods, fmt.Sprintf("kvrouter-%d", i))
	}
	checkPaths("StatefulSet/kvrouter", pods, k8sMounts(t, "StatefulSet/kvrouter", ps, c, kust), f, map[string]string{
		"tls-ca": "ca.pem", "tls-cert": "node-$(POD_NAME).pem", "tls-key": "node-$(POD_NAME)-key.pem",
		"admin-token-file": "admin-token", "replica-token-file": "replica-token"})
	if !strings.HasPrefix(f["advertise-http"], "https://$(POD_NAME).") {
		t.Errorf("--advertise-http %q, want https://$(POD_NAME)…", f["advertise-http"])
	}
	if sts.Spec.Template.Metadata.Annotations["prometheus.io/scheme"] != "https" {
		t.Error("StatefulSet/kvrouter: annotation prometheus.io/scheme must be https")
	}

	mock := objs["StatefulSet/kvmock"]
	mps := mock.Spec.Template.Spec
	mc := mps.Containers[0]
	mf := flagValues(mc.Args)
	var mpods []string
	for i := range *mock.Spec.Replicas {
		mpods = append(mpods, fmt.Sprintf("kvmock-%d", i))
	}
	mmounts := k8sMounts(t, "StatefulSet/kvmock", mps, mc, kust)
	checkPaths("StatefulSet/kvmock", mpods, mmounts, mf, map[string]string{
		"nats-tls-ca": "ca.pem", "nats-tls-cert": "worker-$(POD_NAME).pem", "nats-tls-key": "worker-$(POD_NAME)-key.pem",
		"admin-token-file": "admin-token"})
	for _, keys := range mmounts {
		if slices.Contains(keys, "replica-token") || slices.ContainsFunc(keys, func(k string) bool { return strings.HasPrefix(k, "node-") }) {
			t.Errorf("StatefulSet/kvmock mounts %v: workers get their own certificates and the admin token only", keys)
		}
	}
	for _, u := range strings.Split(mf["register"], ",") {
		if !strings.HasPrefix(u, "https://") {
			t.Errorf("kvmock registers at %q, want https://", u)
		}
	}

	// certs.sh and the generators agree on the file names (the script's
	// output is checked for real by TestDeployK8sCertsScript).
	script, err := os.ReadFile("k8s/certs.sh")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"--export \"$secrets/tls\"", "--dir \"$secrets/ca\"", "--token-files admin-token,replica-token"} {
		if !bytes.Contains(script, []byte(want)) {
			t.Errorf("k8s/certs.sh does not run kvrouter certs with %s", want)
		}
	}
	for _, f := range all {
		if filepath.Dir(f) != "secrets/tls" {
			t.Errorf("generator file %s: certs.sh exports into secrets/tls", f)
		}
	}
}

// TestDeployK8sCertsScript runs k8s/certs.sh with a kvrouter built from this
// tree into a scratch copy of k8s/, then checks the certificates name what
// the manifests dial, and (when kubectl is installed) that `kubectl
// kustomize` builds the Secrets the StatefulSets mount.
func TestDeployK8sCertsScript(t *testing.T) {
	if testing.Short() {
		t.Skip("builds kvrouter")
	}
	if out, err := exec.Command("bash", "-n", "k8s/certs.sh").CombinedOutput(); err != nil {
		t.Fatalf("bash -n k8s/certs.sh: %v\n%s", err, out)
	}
	if sc, err := exec.LookPath("shellcheck"); err == nil {
		if out, err := exec.Command(sc, "-S", "warning", "k8s/certs.sh", "compose-smoke.sh").CombinedOutput(); err != nil {
			t.Errorf("shellcheck: %v\n%s", err, out)
		}
	}
	work := t.TempDir()
	bin := filepath.Join(work, "kvrouter")
	if out, err := exec.Command("go", "build", "-o", bin, "../cmd/kvrouter").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	k8s := filepath.Join(work, "k8s")
	if err := os.MkdirAll(k8s, 0o755); err != nil {
		t.Fatal(err)
	}
	files, _ := filepath.Glob("k8s/*.yaml")
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(k8s, filepath.Base(f)), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	secrets := filepath.Join(k8s, "secrets")
	run := func(args ...string) (string, error) {
		cmd := exec.Command("k8s/certs.sh", args...)
		cmd.Env = append(os.Environ(), "KVROUTER_BIN="+bin, "KVROUTER_K8S_SECRETS_DIR="+secrets)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	for _, bad := range [][]string{{}, {"Bad_NS"}, {"ns", "bad domain"}} {
		if out, err := run(bad...); err == nil {
			t.Errorf("certs.sh %q accepted:\n%s", bad, out)
		}
	}
	if out, err := run("team-a", "example.internal"); err != nil {
		t.Fatalf("certs.sh: %v\n%s", err, out)
	}

	kust, _ := loadK8s(t)
	tls := filepath.Join(secrets, "tls")
	for _, g := range append(slices.Clone(kust.SecretGenerator), kust.ConfigMapGenerator...) {
		for _, f := range g.Files {
			if _, err := os.Stat(filepath.Join(k8s, f)); err != nil {
				t.Errorf("generator %s: %v", g.Name, err)
			}
		}
	}
	if _, err := os.Stat(filepath.Join(tls, "ca-key.pem")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("secrets/tls/ca-key.pem: %v, want absent", err)
	}
	if _, err := os.Stat(filepath.Join(secrets, "ca", "ca-key.pem")); err != nil {
		t.Errorf("the CA key is not kept in secrets/ca: %v", err)
	}
	pool, err := pki.LoadPool(filepath.Join(tls, "ca.pem"))
	if err != nil {
		t.Fatal(err)
	}
	leaf := func(name string) *x509.Certificate {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(tls, name))
		if err != nil {
			t.Fatal(err)
		}
		blk, _ := pem.Decode(b)
		if blk == nil {
			t.Fatalf("%s: no PEM", name)
		}
		c, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	for i := range 3 {
		pod := fmt.Sprintf("kvrouter-%d", i)
		m := pki.Material{CAFile: filepath.Join(tls, "ca.pem"), CertFile: filepath.Join(tls, "node-"+pod+".pem"), KeyFile: filepath.Join(tls, "node-"+pod+"-key.pem")}
		if b, err := pki.LoadBundle(m); err != nil || b.Identity() != pki.Node(pod) {
			t.Errorf("%s: %v", pod, err)
		}
		c := leaf("node-" + pod + ".pem")
		for _, host := range []string{pod + ".kvrouter-peers.team-a.svc.example.internal", "kvrouter", "kvrouter.team-a.svc",
			"kvrouter.team-a.svc.example.internal", "localhost", "127.0.0.1"} {
			if _, err := c.Verify(x509.VerifyOptions{Roots: pool, DNSName: host}); err != nil {
				t.Errorf("%s's certificate for %s: %v", pod, host, err)
			}
		}
		if _, err := c.Verify(x509.VerifyOptions{Roots: pool, DNSName: pod + ".kvrouter-peers.default.svc.cluster.local"}); err == nil {
			t.Errorf("%s's certificate names another namespace", pod)
		}
	}
	for i := range 4 {
		w := fmt.Sprintf("kvmock-%d", i)
		m := pki.Material{CAFile: filepath.Join(tls, "ca.pem"), CertFile: filepath.Join(tls, "worker-"+w+".pem"), KeyFile: filepath.Join(tls, "worker-"+w+"-key.pem")}
		if b, err := pki.LoadBundle(m); err != nil || b.Identity() != pki.Worker(w) {
			t.Errorf("%s: %v", w, err)
		}
	}
	for _, tok := range []string{"admin-token", "replica-token"} {
		if fi, err := os.Stat(filepath.Join(tls, tok)); err != nil || fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: %v", tok, err)
		}
	}
	admin, _ := os.ReadFile(filepath.Join(tls, "admin-token"))
	if out, err := run("team-a", "example.internal"); err != nil || !strings.Contains(out, "0 issued") || !strings.Contains(out, "(0 changed") {
		t.Errorf("rerun: %v, want nothing reissued or rewritten:\n%s", err, out)
	}
	if again, _ := os.ReadFile(filepath.Join(tls, "admin-token")); !bytes.Equal(again, admin) {
		t.Error("a rerun changed the admin token")
	}

	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		t.Log("kubectl not installed: kustomize build not checked")
		return
	}
	out, err := exec.Command(kubectl, "kustomize", k8s).Output()
	if err != nil {
		t.Fatalf("kubectl kustomize: %v", err)
	}
	generated := map[string]bool{}
	var mounted []string
	dec := decodeAllBytes[k8sObject](t, out)
	for _, o := range dec {
		if o.Kind == "Secret" {
			generated[o.Metadata.Name] = true
		}
		for _, v := range o.Spec.Template.Spec.Volumes {
			if v.Secret != nil {
				mounted = append(mounted, v.Secret.SecretName)
			}
		}
	}
	if len(mounted) != 4 {
		t.Errorf("kustomize output mounts Secrets %v, want 4 (tls and tokens in each StatefulSet)", mounted)
	}
	for _, s := range mounted {
		if !generated[s] {
			t.Errorf("kustomize output mounts Secret %s, which it does not contain (generated: %v)", s, generated)
		}
	}
}

// decodeAllBytes is decodeAll for bytes in memory.
func decodeAllBytes[T any](t *testing.T, b []byte) []T {
	t.Helper()
	p := filepath.Join(t.TempDir(), "doc.yaml")
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return decodeAll[T](t, p)
}
