//go:build chaos

package chaos

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/internal/pki"
)

// The suite runs the cluster as a deployment should (SECURITY.md, issue
// 16): every replica listens off loopback, on its namespace's address, so
// the secure default applies and it refuses to start without TLS material
// and an admin token. The harness is the operator: it makes a private CA
// and the certificates with the real `kvrouter certs`, writes the tokens,
// and hands each process only what its role gets in `make run`
// (deploy/local/run.sh): replicas their node certificate, the replica
// token and the admin token; workers their worker certificate, the CA
// and the admin token (to register). The harness's own clients trust the
// CA and send the admin token where the API asks for it.

// serviceName is the DNS name every node certificate carries besides its
// own address: the name clients use for the cluster behind the load
// balancer (a route client reaches whichever replica HAProxy picks, so it
// cannot check for one node's address).
const serviceName = "kvrouter.kvc"

// nodeName is node i's own DNS name in its certificate, for HAProxy's
// health checks (verifyhost: the check on server rN accepts only rN).
func nodeName(i int) string { return fmt.Sprintf("r%d.kvc", i) }

// credentials are one run's cluster credentials, made once per run and
// shared by its scenarios (each scenario still starts a fresh cluster).
type credentials struct {
	layout      pki.Layout
	adminFile   string // 0600, the replicas' --admin-token-file and the workers'
	replicaFile string // 0600, the replicas' --replica-token-file
	adminToken  string
	replicaTok  string
}

// workerIDs are the worker certificates a run needs: the kvmocks and the
// ledger workers (the probes' rogue worker is ledger-1 itself).
func workerIDs(o Options) []string {
	ids := []string{"mock-1", "mock-2"}
	for j := 1; j <= o.LedgerWorkers; j++ {
		ids = append(ids, fmt.Sprintf("ledger-%d", j))
	}
	return ids
}

// issueCredentials runs `kvrouter certs` into dir/certs for every node the
// suite may start (r1..r4: T7 adds a fourth) and every worker, and writes
// the two tokens into dir/secrets.
func issueCredentials(ctx context.Context, kvrouter, dir string, workers []string) (*credentials, error) {
	var nodes []string
	for i := 1; i <= maxNodes; i++ {
		nodes = append(nodes, fmt.Sprintf("r%d=%s,%s,%s", i, nodeIP(i), nodeName(i), serviceName))
	}
	c := &credentials{layout: pki.Layout{Dir: filepath.Join(dir, "certs")}}
	if _, err := run(ctx, kvrouter, "certs", "--dir", c.layout.Dir, "--nodes", strings.Join(nodes, ","), "--workers", strings.Join(workers, ",")); err != nil {
		return nil, fmt.Errorf("kvrouter certs: %w", err)
	}
	secrets := filepath.Join(dir, "secrets")
	if err := os.MkdirAll(secrets, 0o700); err != nil {
		return nil, err
	}
	var err error
	c.adminFile = filepath.Join(secrets, "admin-token")
	if c.adminToken, err = writeToken(c.adminFile); err != nil {
		return nil, err
	}
	c.replicaFile = filepath.Join(secrets, "replica-token")
	if c.replicaTok, err = writeToken(c.replicaFile); err != nil {
		return nil, err
	}
	return c, nil
}

// writeToken writes 32 random bytes, hex, to a new 0600 file.
func writeToken(path string) (string, error) {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	tok := hex.EncodeToString(b)
	if err := os.WriteFile(path, []byte(tok+"\n"), 0o600); err != nil {
		return "", fmt.Errorf("write %s: %w", path, err)
	}
	return tok, nil
}

func (c *credentials) caFile() string { return c.layout.CACertFile() }

func (c *credentials) node(i int) pki.Material {
	return c.layout.Material(pki.Node(fmt.Sprintf("r%d", i)))
}

func (c *credentials) worker(id string) pki.Material { return c.layout.Material(pki.Worker(id)) }

// workerTLS is worker id's client configuration for the bus: its
// certificate, and only a kvrouter node accepted as the server.
func (c *credentials) workerTLS(id string) (*tls.Config, error) {
	b, err := pki.LoadBundle(c.worker(id))
	if err != nil {
		return nil, err
	}
	return b.ClientTLS(pki.AllowRoles(pki.RoleNode)), nil
}

// access is how the harness's clients reach the replicas' HTTP ports:
// HTTPS trusting the run's CA and the admin token on admin requests, or,
// for a scenario that runs insecure on purpose (U1), plain HTTP.
type access struct {
	scheme string
	token  string      // admin token ("" when insecure)
	tls    *tls.Config // nil when insecure
	status *http.Client
	admin  *http.Client
}

func newAccess(c *credentials) (*access, error) {
	a := &access{scheme: "http"}
	if c != nil {
		roots, err := pki.LoadPool(c.caFile())
		if err != nil {
			return nil, err
		}
		a.scheme, a.token = "https", c.adminToken
		a.tls = &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: roots}
	}
	a.status = a.client(800*time.Millisecond, "")
	a.admin = a.client(3*time.Second, "")
	return a, nil
}

// client is an HTTP client for this access; serverName, when set, is the
// name the server's certificate must carry (else the address dialled).
func (a *access) client(timeout time.Duration, serverName string) *http.Client {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConnsPerHost = 4
	if a.tls != nil {
		c := a.tls.Clone()
		c.ServerName = serverName
		t.TLSClientConfig = c
	}
	return &http.Client{Timeout: timeout, Transport: t}
}

func (a *access) url(i int) string { return replicaURL(a.scheme, i) }

// lbURL is HAProxy's frontend; TLS passes through it to a replica, whose
// certificate names serviceName.
func (a *access) lbURL() string { return fmt.Sprintf("%s://%s:%d", a.scheme, hostIP, lbPort) }

// authorize adds the admin token to req (nothing when insecure).
func (a *access) authorize(req *http.Request) {
	if a.token != "" {
		req.Header.Set("Authorization", "Bearer "+a.token)
	}
}

// adminDo sends an admin request (token added) with the admin client.
func (a *access) adminDo(req *http.Request) (*http.Response, error) {
	a.authorize(req)
	return a.admin.Do(req)
}

// post sends body as JSON to base+path with the admin token and returns
// the status and the first line of the answer.
func (a *access) post(ctx context.Context, base, path, body string) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path, strings.NewReader(body))
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := a.adminDo(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	return resp.StatusCode, firstLine(data), nil
}
