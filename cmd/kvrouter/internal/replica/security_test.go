package replica

import (
	"errors"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/cluster/clustertest"
	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/internal/pki"
)

// TestReplicaCheckForwarded: /cluster/apply takes the command types
// replicas forward and refuses the leader's own (ingest batch, Tick), the
// unproposed RemoveNode, unknown types and undecodable bytes.
func TestReplicaCheckForwarded(t *testing.T) {
	must := func(b []byte, err error) []byte {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	reg := fsm.RegisterWorker{ID: "w1", DPRanks: 1, Address: "http://127.0.0.1:9001", Model: "m", BlockSize: 16, TotalBlocks: 64}
	withRole := reg
	withRole.Role = "prefill"
	ownSize := reg
	ownSize.BlockSize, ownSize.OwnBlockSize = 32, true
	ok := map[string][]byte{
		"register size": must(fsm.EncodeRegisterWorker(ownSize)),
		"register":      must(fsm.EncodeRegisterWorker(reg)),
		"register role": must(fsm.EncodeRegisterWorker(withRole)),
		"deregister":    must(fsm.EncodeDeregisterWorker(fsm.DeregisterWorker{ID: "w1"})),
		"model config":  must(fsm.EncodeSetModelConfig(fsm.SetModelConfig{Model: "m"})),
		"predictions":   must(fsm.EncodePredictions(fsm.Predictions{Worker: "w1", Hashes: []uint64{1}, Until: 1})),
		"register node": must(fsm.EncodeRegisterNode(fsm.RegisterNode{NodeID: "r1", RaftAddr: "127.0.0.1:7001", HTTPAddr: "https://127.0.0.1:8001"})),
		"resync":        must(fsm.EncodeResyncWorker(fsm.ResyncWorker{Worker: "w1"})),
		"drain":         must(fsm.EncodeSetWorkerDrain(fsm.SetWorkerDrain{Worker: "w1", Drained: true, Deadline: 1})),
		"undrain":       must(fsm.EncodeSetWorkerDrain(fsm.SetWorkerDrain{Worker: "w1"})),
		"drain done":    must(fsm.EncodeSetWorkerDrain(fsm.SetWorkerDrain{Worker: "w1", Drained: true, Deregister: true})),
		"bind session":  must(fsm.EncodeBindSession(fsm.BindSession{Session: "s", Worker: "w1", Until: 1})),
		"end session":   must(fsm.EncodeUnbindSessions(fsm.UnbindSessions{Session: "s"})),
		"pin prefix":    must(fsm.EncodePinPrefix(fsm.PinPrefix{Model: "m", Worker: "w1", Key: 1, Blocks: []uint64{1}, TTL: 1e9, Until: 1})),
		"refresh pin":   must(fsm.EncodePinPrefix(fsm.PinPrefix{Model: "m", Worker: "w1", Key: 1, TTL: 1e9, Until: 1})),
		"unpin":         must(fsm.EncodeUnpinPrefix(fsm.UnpinPrefix{Worker: "w1"})),
	}
	for name, cmd := range ok {
		if err := checkForwarded(cmd); err != nil {
			t.Errorf("%s: refused: %v", name, err)
		}
	}
	if withRole := ok["register role"]; fsm.CommandType(withRole[0]&^fsm.IgnoreIfUnknown) != fsm.CmdRegisterWorkerRole {
		t.Fatalf("a registration with a role encodes as type %d, the test expects %d", withRole[0], fsm.CmdRegisterWorkerRole)
	}
	if b := ok["register size"]; fsm.CommandType(b[0]&^fsm.IgnoreIfUnknown) != fsm.CmdRegisterWorkerBlockSize {
		t.Fatalf("a registration with its own block size encodes as type %d, the test expects %d", b[0], fsm.CmdRegisterWorkerBlockSize)
	}
	refused := map[string][]byte{
		"kv batch":    must(fsm.EncodeKVBatch(nil)),
		"tick":        must(fsm.EncodeTick(fsm.Tick{Now: 1 << 62})),
		"remove node": must(fsm.EncodeRemoveNode(fsm.RemoveNode{NodeID: "r2"})),
		"unknown":     {42, fsm.EnvelopeVersion, 0},
		"unknown ign": {42 | fsm.IgnoreIfUnknown, fsm.EnvelopeVersion, 0},
		"empty":       nil,
	}
	for name, cmd := range refused {
		if err := checkForwarded(cmd); !errors.Is(err, errForbiddenCommand) {
			t.Errorf("%s: err = %v, want errForbiddenCommand", name, err)
		}
	}
	garbage := append([]byte{byte(fsm.CmdRegisterWorker), fsm.EnvelopeVersion}, 0xff, 0xff, 0xff)
	if err := checkForwarded(garbage); err == nil {
		t.Error("undecodable RegisterWorker accepted")
	}
}

// testBundles issues a CA with node r1 (127.0.0.1) and worker w1.
func testBundles(t *testing.T) (node, worker *pki.Bundle) {
	t.Helper()
	l := pki.Layout{Dir: t.TempDir()}
	if _, err := l.Ensure([]pki.Holder{{Identity: pki.Node("r1"), Hosts: []string{"127.0.0.1"}}, {Identity: pki.Worker("w1")}}); err != nil {
		t.Fatal(err)
	}
	var err error
	if node, err = pki.LoadBundle(l.Material(pki.Node("r1"))); err != nil {
		t.Fatal(err)
	}
	if worker, err = pki.LoadBundle(l.Material(pki.Worker("w1"))); err != nil {
		t.Fatal(err)
	}
	return node, worker
}

// TestReplicaHTTPPortTLSAndPlain: with TLS material the HTTP port speaks
// HTTPS (the handler sees the verified client certificate) and, when
// allowed, plaintext on the same port; when not allowed a plaintext
// request gets a 400 naming HTTPS.
func TestReplicaHTTPPortTLSAndPlain(t *testing.T) {
	node, worker := testBundles(t)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		who := "plain"
		if r.TLS != nil {
			who = "tls"
			if id, err := pki.PeerIdentity(*r.TLS); err == nil {
				who = id.String()
			}
		}
		io.WriteString(w, who)
	})
	for _, plain := range []bool{true, false} {
		ln, err := listenHTTP(Config{HTTPAddr: "127.0.0.1:0", AllowPlainHTTP: plain}, node)
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
		go srv.Serve(ln)
		base := ln.Addr().String()
		get := func(c *http.Client, url string) (int, string) {
			t.Helper()
			resp, err := c.Get(url)
			if err != nil {
				t.Fatalf("plain=%v GET %s: %v", plain, url, err)
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			return resp.StatusCode, string(b)
		}
		trustOnly := &http.Client{Transport: &http.Transport{TLSClientConfig: pki.TrustOnlyTLS(node.Roots(), nil)}}
		if code, body := get(trustOnly, "https://"+base+"/"); code != 200 || body != "tls" {
			t.Errorf("plain=%v https without certificate: %d %q", plain, code, body)
		}
		if code, body := get(peerClient(node, 5*time.Second), "https://"+base+"/"); code != 200 || body != pki.Node("r1").String() {
			t.Errorf("plain=%v https with the node certificate: %d %q", plain, code, body)
		}
		wc := &http.Client{Transport: &http.Transport{TLSClientConfig: worker.ClientTLS(pki.AllowRoles(pki.RoleNode))}}
		if code, body := get(wc, "https://"+base+"/"); code != 200 || body != pki.Worker("w1").String() {
			t.Errorf("plain=%v https with a worker certificate: %d %q", plain, code, body)
		}
		code, body := get(http.DefaultClient, "http://"+base+"/")
		if plain && (code != 200 || body != "plain") {
			t.Errorf("plain allowed: http: %d %q", code, body)
		}
		if !plain && (code != 400 || !strings.Contains(body, "HTTPS only")) {
			t.Errorf("plain refused: http: %d %q", code, body)
		}
		// A client that connects and says nothing does not block others.
		idle, err := net.Dial("tcp", base)
		if err != nil {
			t.Fatal(err)
		}
		if code, _ := get(trustOnly, "https://"+base+"/"); code != 200 {
			t.Errorf("plain=%v: a silent connection blocked the next one", plain)
		}
		idle.Close()
		srv.Close()
	}
}

// TestReplicaClusterEndpointsTakeCertificates: with TLS the cluster
// endpoints bypass the API (and its admin token) and everything else
// reaches it.
func TestReplicaClusterEndpointsTakeCertificates(t *testing.T) {
	api := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "api") })
	cl := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "cluster") })
	h := withClusterEndpoints(api, cl, 0)
	for path, want := range map[string]string{"/cluster/apply": "cluster", "/cluster/join": "cluster", "/cluster/remove": "cluster",
		"/cluster/commit": "cluster", "/cluster/status": "api", "/v1/models": "api", "/busy_threshold": "api"} {
		rec := &recorder{header: http.Header{}}
		r, _ := http.NewRequest(http.MethodGet, path, nil)
		h.ServeHTTP(rec, r)
		if rec.body.String() != want {
			t.Errorf("%s went to %q, want %q", path, rec.body.String(), want)
		}
	}
}

type recorder struct {
	header http.Header
	body   strings.Builder
}

func (r *recorder) Header() http.Header         { return r.header }
func (r *recorder) Write(b []byte) (int, error) { return r.body.Write(b) }
func (r *recorder) WriteHeader(int)             {}

// TestReplicaLoadBundleChecksIdentity: another node's files are refused at
// start, naming the mismatch.
func TestReplicaLoadBundleChecksIdentity(t *testing.T) {
	dir := t.TempDir()
	l := pki.Layout{Dir: dir}
	if _, err := l.Ensure([]pki.Holder{{Identity: pki.Node("r1"), Hosts: []string{"127.0.0.1"}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := loadBundle(Config{NodeID: "r1", TLS: l.Material(pki.Node("r1"))}); err != nil {
		t.Fatal(err)
	}
	_, err := loadBundle(Config{NodeID: "r2", TLS: l.Material(pki.Node("r1"))})
	if err == nil || !strings.Contains(err.Error(), "node/r1") {
		t.Errorf("r2 with r1's certificate: %v", err)
	}
	if b, err := loadBundle(Config{NodeID: "r2", Insecure: true}); b != nil || err != nil {
		t.Errorf("insecure: %v %v", b, err)
	}
	if _, err := loadBundle(Config{NodeID: "r1", TLS: pki.Material{CAFile: filepath.Join(dir, "none.pem")}}); err == nil {
		t.Error("incomplete material accepted")
	}
}

// TestReplicaMembership: the bus admits this node and the bootstrap set
// until the Raft node is there.
func TestReplicaMembership(t *testing.T) {
	m := newMembership(Config{NodeID: "r1", Peers: []cluster.Peer{{ID: "r1"}, {ID: "r2"}}})
	for id, want := range map[string]bool{"r1": true, "r2": true, "r3": false} {
		if got := m.isMember(id); got != want {
			t.Errorf("isMember(%s) = %v before the node exists", id, got)
		}
	}
}

// TestReplicaOpenBusSecure: with a bundle the replica's bus takes its own
// node certificate, a worker's certificate and the replica token (over
// TLS), and refuses anonymous clients and a wrong token.
func TestReplicaOpenBusSecure(t *testing.T) {
	node, worker := testBundles(t)
	log := clustertest.NewTestLogger(t)
	cfg := Config{NodeID: "r1", NATSAddr: "127.0.0.1:0", DataDir: t.TempDir(), ReplicaToken: "tool-token"}
	bus, err := openBus(cfg, node, newMembership(cfg).isMember, log)
	if err != nil {
		t.Fatal(err)
	}
	defer bus.Close()
	url := bus.Server().ClientURL()
	trust := eventbus.WithTLSConfig(pki.TrustOnlyTLS(node.Roots(), pki.AllowRoles(pki.RoleNode)))
	for name, opts := range map[string][]eventbus.ConnectOption{
		"worker certificate": {eventbus.WithBundle(worker)},
		"replica token":      {trust, eventbus.WithToken("tool-token")},
	} {
		nc, err := eventbus.Connect(url, name, log, opts...)
		if err != nil {
			t.Errorf("%s refused: %v", name, err)
			continue
		}
		nc.Close()
	}
	for name, opts := range map[string][]eventbus.ConnectOption{
		"anonymous":   nil,
		"TLS only":    {trust},
		"wrong token": {trust, eventbus.WithToken("guess")},
	} {
		if nc, err := eventbus.Connect(url, name, log, opts...); err == nil {
			nc.Close()
			t.Errorf("%s accepted", name)
		}
	}
}

// TestReplicaAPIClientCerts: with --api-client-certs the inference
// endpoints take only a verified certificate naming an API client — not
// none, not plaintext, not a node's or a worker's (each credential is good
// for its role only) — while /health and the rest stay as they were.
func TestReplicaAPIClientCerts(t *testing.T) {
	dir := t.TempDir()
	l := pki.Layout{Dir: dir}
	ids := []pki.Identity{pki.Node("r1"), pki.Worker("w1"), pki.Client("app")}
	var holders []pki.Holder
	for _, id := range ids {
		holders = append(holders, pki.Holder{Identity: id, Hosts: []string{"127.0.0.1"}})
	}
	if _, err := l.Ensure(holders); err != nil {
		t.Fatal(err)
	}
	bundles := map[pki.Role]*pki.Bundle{}
	for _, id := range ids {
		b, err := pki.LoadBundle(l.Material(id))
		if err != nil {
			t.Fatal(err)
		}
		bundles[id.Role] = b
	}
	node := bundles[pki.RoleNode]
	check := apiClientCheck(Config{APIClientCerts: true})
	if apiClientCheck(Config{}) != nil {
		t.Fatal("a check without --api-client-certs")
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := check(r); err != nil {
			http.Error(w, err.Error(), http.StatusUnauthorized)
			return
		}
		io.WriteString(w, "ok")
	})
	ln, err := listenHTTP(Config{HTTPAddr: "127.0.0.1:0", AllowPlainHTTP: true}, node)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln)
	defer srv.Close()
	base := ln.Addr().String()
	client := func(b *pki.Bundle) *http.Client {
		if b == nil {
			return &http.Client{Transport: &http.Transport{TLSClientConfig: pki.TrustOnlyTLS(node.Roots(), nil)}}
		}
		return &http.Client{Transport: &http.Transport{TLSClientConfig: b.ClientTLS(pki.AllowRoles(pki.RoleNode))}}
	}
	for _, tc := range []struct {
		name string
		c    *http.Client
		url  string
		want int
	}{
		{"client certificate", client(bundles[pki.RoleClient]), "https://" + base + "/v1/models", 200},
		{"no certificate", client(nil), "https://" + base + "/v1/models", 401},
		{"node certificate", client(node), "https://" + base + "/v1/models", 401},
		{"worker certificate", client(bundles[pki.RoleWorker]), "https://" + base + "/v1/models", 401},
		{"plaintext", http.DefaultClient, "http://" + base + "/v1/models", 401},
	} {
		resp, err := tc.c.Get(tc.url)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Errorf("%s: %d %q, want %d", tc.name, resp.StatusCode, b, tc.want)
		}
	}
}
