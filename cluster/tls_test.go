package cluster_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/cluster/clustertest"
	"github.com/kvrouter/kvrouter/internal/pki"
	"github.com/kvrouter/kvrouter/internal/poll"
)

// TestClusterTLSFormPeers: three members bootstrapped from the same peer
// set over mutual TLS elect a leader, replicate (also through a follower,
// whose forwarding presents its node certificate), and survive the
// leader's restart.
func TestClusterTLSFormPeers(t *testing.T) {
	c := clustertest.New(t, 3, clustertest.Options{TLS: true})
	l := c.WaitLeader()
	if !strings.HasPrefix(l.HTTPURL(), "https://") {
		t.Fatalf("TLS member serves %s", l.HTTPURL())
	}
	c.ApplyN("a", 10)
	f := followerOf(c, l)
	if _, err := c.ApplyVia(f.Node, []byte("via-follower")); err != nil {
		t.Fatalf("forwarded apply over TLS: %v", err)
	}
	c.WaitConverged()

	c.Restart(l.Index)
	c.WaitLeader()
	c.ApplyN("b", 10)
	c.WaitConverged()
	for _, m := range c.Running() {
		if ok, why := m.Node().Ready(); !ok {
			poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
				if ok, why = m.Node().Ready(); !ok {
					return fmt.Errorf("%s not ready: %s", m.ID, why)
				}
				return nil
			})
		}
	}
}

// TestClusterTLSFormJoin: members 1 and 2 join member 0 over HTTPS; the
// join is checked (caller certificate, raft_addr answering as the node),
// and the joining node accepts the leader before it has a configuration.
// A wiped member rejoins the same way.
func TestClusterTLSFormJoin(t *testing.T) {
	c := clustertest.New(t, 3, clustertest.Options{TLS: true, Formation: clustertest.FormJoin})
	l := c.WaitLeader()
	if got := voters(t, l.Node()); len(got) != 3 {
		t.Fatalf("configuration %v", got)
	}
	c.ApplyN("a", 5)
	c.WaitConverged()
	c.Wipe(followerOf(c, l).Index)
	c.ApplyN("b", 5)
	c.WaitConverged()

	// Joining through a follower: the follower forwards, the leader checks
	// the new node's raft_addr, and the new node accepts the leader's
	// replication once the join answer names the members.
	l = c.WaitLeader()
	start := time.Now()
	m := c.AddNodeVia(followerOf(c, l).Index)
	c.ApplyN("c", 5)
	c.WaitConverged()
	t.Logf("%s joined through a follower and converged in %v", m.ID, time.Since(start))
	if got := voters(t, c.WaitLeader().Node()); len(got) != 4 {
		t.Fatalf("configuration %v", got)
	}
}

// refusals is kvrouter_cluster_peer_refusals_total{port} of member m.
func refusals(t *testing.T, m *clustertest.Member, port string) float64 {
	t.Helper()
	mf, ok := gather(t, m.Registry())["kvrouter_cluster_peer_refusals_total"]
	if !ok {
		t.Fatal("kvrouter_cluster_peer_refusals_total missing")
	}
	for _, x := range mf.GetMetric() {
		for _, l := range x.GetLabel() {
			if l.GetName() == "port" && l.GetValue() == port {
				return x.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("no refusals counter for port %s", port)
	return 0
}

// attackerTLS is how a stranger holding b dials: it presents b's
// certificate whatever CAs the server asks for (crypto/tls would
// otherwise send nothing when b's CA is not among them) and does not care
// whom it reaches.
func attackerTLS(b *pki.Bundle) *tls.Config {
	c := b.ClientTLS(nil)
	cert := b.Certificate()
	c.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return cert, nil }
	c.InsecureSkipVerify = true
	c.VerifyConnection = nil
	return c
}

// probeRaftTLS completes a client handshake to addr with cfg and reads: a
// member's transport would wait for an RPC (the read times out), a refused
// peer's connection is failed by the server's handshake (TLS 1.3 tells a
// client its certificate was refused at its first read).
func probeRaftTLS(addr string, cfg *tls.Config) error {
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, cfg)
	if err != nil {
		return err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(3 * time.Second))
	_, err = conn.Read(make([]byte, 1))
	return err
}

// state is what a forged RPC must not change.
type memberState struct {
	term, commit, applied uint64
	leader, digest        string
}

func stateOf(m *clustertest.Member) memberState {
	st := m.Node().Status()
	return memberState{term: st.Term, commit: st.CommitIndex, applied: st.AppliedIndex, leader: st.LeaderID, digest: st.Digest}
}

// forgedAppendEntries is the probe of issue 16: a term-1000 AppendEntries
// from a "leader" that is no member, consistent with the target's log (so
// a transport that let it through would make raft accept it), carrying one
// entry and a commit index that covers it.
func forgedAppendEntries(m *clustertest.Member, from string) *raft.AppendEntriesRequest {
	st := m.Node().Status()
	var lastTerm uint64
	fmt.Sscan(m.Node().Stats()["last_log_term"], &lastTerm)
	return &raft.AppendEntriesRequest{
		RPCHeader:         raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte("evil"), Addr: []byte(from)},
		Term:              1000,
		PrevLogEntry:      st.LastLogIndex,
		PrevLogTerm:       lastTerm,
		Entries:           []*raft.Log{{Index: st.LastLogIndex + 1, Term: 1000, Type: raft.LogCommand, Data: []byte("forged")}},
		LeaderCommitIndex: st.LastLogIndex + 1,
	}
}

// attackerStream is a raft.StreamLayer dialing with TLS config cfg (nil:
// plain TCP), so the forged RPC is exactly what raft's own transport sends.
type attackerStream struct {
	net.Listener
	cfg *tls.Config
}

func (s attackerStream) Dial(addr raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	d := &net.Dialer{Timeout: timeout}
	if s.cfg == nil {
		return d.Dial("tcp", string(addr))
	}
	return tls.DialWithDialer(d, "tcp", string(addr), s.cfg)
}

// sendForged sends forgedAppendEntries to m through a raft transport of
// the attacker's and returns raft's verdict.
func sendForged(t *testing.T, m *clustertest.Member, cfg *tls.Config) (*raft.AppendEntriesResponse, error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	trans := raft.NewNetworkTransport(attackerStream{Listener: ln, cfg: cfg}, 1, 5*time.Second, io.Discard)
	defer trans.Close()
	var resp raft.AppendEntriesResponse
	err = trans.AppendEntries("n-target", raft.ServerAddress(m.RaftAddr), forgedAppendEntries(m, ln.Addr().String()), &resp)
	return &resp, err
}

// TestClusterRaftForgedAppendEntriesPlain is the control for the TLS
// probes: without TLS the forged AppendEntries works (the replica adopts
// term 1000 and commits the attacker's entry), so the probe is real and
// its refusal below means something.
func TestClusterRaftForgedAppendEntriesPlain(t *testing.T) {
	c := clustertest.New(t, 1, clustertest.Options{Quiet: true})
	c.WaitLeader()
	c.ApplyN("a", 3)
	m := c.M(0)
	before := stateOf(m)
	resp, err := sendForged(t, m, nil)
	if err != nil || !resp.Success {
		t.Fatalf("forged AppendEntries on plain TCP: success=%v err=%v (the control should succeed)", resp.Success, err)
	}
	poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error {
		if after := stateOf(m); after.term != 1000 || after.applied <= before.applied {
			return fmt.Errorf("term %d applied %d (before %d)", after.term, after.applied, before.applied)
		}
		return nil
	})
}

// TestClusterTLSRaftRefusesStrangers: with TLS, the Raft port refuses in
// the handshake a client without a certificate, with a certificate of
// another CA (even one naming a member), with a worker certificate, and
// with a node certificate of a non-member; the forged term-1000
// AppendEntries over plain TCP and over TLS with a non-member's
// certificate changes nothing: term, leader, commit and applied index and
// digest are as before on every member.
func TestClusterTLSRaftRefusesStrangers(t *testing.T) {
	c := clustertest.New(t, 3, clustertest.Options{TLS: true})
	c.WaitLeader()
	c.ApplyN("a", 5)
	c.WaitConverged()

	otherCA, err := pki.NewCA(pki.CAOptions{Name: "attacker CA"})
	if err != nil {
		t.Fatal(err)
	}
	foreign := clustertest.IssueBundle(t, otherCA, pki.Node("n0"))
	worker := c.Issue(pki.Worker("w1"))
	stranger := c.Issue(pki.Node("n9"))
	noCert := pki.TrustOnlyTLS(c.CA().Pool(), nil)
	noCert.InsecureSkipVerify, noCert.VerifyConnection = true, nil

	before := map[string]memberState{}
	for _, m := range c.Members() {
		before[m.ID] = stateOf(m)
	}
	for _, m := range c.Members() {
		for _, p := range []struct {
			name string
			cfg  *tls.Config
		}{
			{"no certificate", noCert},
			{"another CA's certificate naming a member", attackerTLS(foreign)},
			{"worker certificate", attackerTLS(worker)},
			{"non-member node certificate", attackerTLS(stranger)},
		} {
			was := refusals(t, m, "raft")
			err := probeRaftTLS(m.RaftAddr, p.cfg)
			var ne net.Error
			if err == nil || (errors.As(err, &ne) && ne.Timeout()) {
				t.Errorf("%s: %s: connection kept (err %v)", m.ID, p.name, err)
			}
			poll.Until(t, 5*time.Second, 10*time.Millisecond, func() error {
				if got := refusals(t, m, "raft"); got != was+1 {
					return fmt.Errorf("%s: %s: raft refusals %v, want %v", m.ID, p.name, got, was+1)
				}
				return nil
			})
		}
		for _, p := range []struct {
			name string
			cfg  *tls.Config
		}{
			{"plain TCP", nil},
			{"TLS with a non-member certificate", attackerTLS(stranger)},
			{"TLS with a worker certificate", attackerTLS(worker)},
		} {
			if resp, err := sendForged(t, m, p.cfg); err == nil {
				t.Errorf("%s: forged AppendEntries over %s answered %+v", m.ID, p.name, resp)
			}
		}
	}
	// Give a forged entry that slipped through time to commit and apply.
	c.WaitConverged()
	for _, m := range c.Members() {
		if got := stateOf(m); got != before[m.ID] {
			t.Errorf("%s changed: before %+v, after %+v", m.ID, before[m.ID], got)
		}
	}
	// The cluster still works.
	c.ApplyN("b", 3)
	c.WaitConverged()
}

// postJSON sends body to url with client and returns the status and decoded
// JSON answer (error, code, ok).
func postJSON(t *testing.T, client *http.Client, url string, body []byte, header map[string]string) (int, map[string]any) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, map[string]any{"transport_error": err.Error()}
	}
	defer resp.Body.Close()
	var out map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&out)
	return resp.StatusCode, out
}

// TestClusterTLSEndpointsRefuse: with TLS the /cluster/ endpoints take a
// member's client certificate and nothing else — not the admin token, not
// a worker's or a non-member's certificate; /cluster/apply refuses command
// types replicas do not forward (CheckForwarded); a join must come from
// the joining node itself and name a raft_addr answering as it (a bogus
// voter is refused and the configuration stays as it was); a removed
// member's certificate no longer opens the Raft port.
func TestClusterTLSEndpointsRefuse(t *testing.T) {
	const token = "s3cret"
	c := clustertest.New(t, 3, clustertest.Options{TLS: true, Configure: func(_ int, cfg *cluster.Config, _ cluster.StateMachine) {
		cfg.AuthToken = token
		cfg.CheckForwarded = func(cmd []byte) error {
			if bytes.HasPrefix(cmd, []byte("leader-only")) {
				return errors.New("leader-only commands are not forwarded")
			}
			return nil
		}
	}})
	l := c.WaitLeader()
	c.ApplyN("a", 3)
	c.WaitConverged()
	f := followerOf(c, l)
	// Forwarding (follower → leader over HTTPS with its node certificate)
	// works although the token alone would not.
	if _, err := c.ApplyVia(f.Node, []byte("forwarded")); err != nil {
		t.Fatalf("forwarded apply: %v", err)
	}
	c.WaitConverged()

	otherCA, err := pki.NewCA(pki.CAOptions{Name: "attacker CA"})
	if err != nil {
		t.Fatal(err)
	}
	member := f.Bundle()
	stranger := c.Issue(pki.Node("n9"))
	anon := c.HTTPClient(nil)
	bearer := map[string]string{"Authorization": "Bearer " + token}
	before := map[string]memberState{}
	for _, m := range c.Members() {
		before[m.ID] = stateOf(m)
	}
	configBefore := voters(t, l.Node())

	type probe struct {
		name   string
		client *http.Client
		path   string
		body   string
		header map[string]string
		status int
		code   string
		leader bool // send to the leader only (a forwarded request reaching a follower gets 503)
	}
	freeAddr := func() string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		return ln.Addr().String()
	}
	foreign := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: attackerTLS(clustertest.IssueBundle(t, otherCA, pki.Node("n1")))}}
	probes := []probe{
		{"apply, admin token, no certificate", anon, "/cluster/apply", "x1", bearer, 401, "unauthorized", false},
		{"apply, worker certificate", c.HTTPClient(c.Issue(pki.Worker("w1"))), "/cluster/apply", "x2", nil, 403, "forbidden", false},
		{"apply, non-member certificate", c.HTTPClient(stranger), "/cluster/apply", "x3", nil, 403, "forbidden", false},
		{"apply, another CA's certificate", foreign, "/cluster/apply", "x4", nil, 0, "", false},
		{"apply, member, a type replicas do not forward", c.HTTPClient(member), "/cluster/apply", "leader-only-1", nil, 400, "forbidden_command", false},
		{"remove, non-member certificate", c.HTTPClient(stranger), "/cluster/remove", `{"node_id":"n2"}`, nil, 403, "forbidden", false},
		{"remove, admin token", anon, "/cluster/remove", `{"node_id":"n2"}`, bearer, 401, "unauthorized", false},
		{"join, no certificate", anon, "/cluster/join", `{"node_id":"n9","raft_addr":"` + freeAddr() + `"}`, bearer, 401, "unauthorized", false},
		{"join, raft_addr where nothing answers", c.HTTPClient(stranger), "/cluster/join", `{"node_id":"n9","raft_addr":"` + freeAddr() + `"}`, nil, 400, "unverified_peer", false},
		{"join, raft_addr of another member", c.HTTPClient(stranger), "/cluster/join", `{"node_id":"n9","raft_addr":"` + c.M(2).RaftAddr + `"}`, nil, 400, "unverified_peer", false},
		{"join of another node than the caller", c.HTTPClient(stranger), "/cluster/join", `{"node_id":"n8","raft_addr":"` + freeAddr() + `"}`, nil, 403, "forbidden", false},
		{"join, worker certificate", c.HTTPClient(c.Issue(pki.Worker("n9"))), "/cluster/join", `{"node_id":"n9","raft_addr":"` + freeAddr() + `"}`, nil, 403, "forbidden", false},
		{"join, forwarded-by spoofed by a non-member", c.HTTPClient(stranger), "/cluster/join", `{"node_id":"n7","raft_addr":"` + freeAddr() + `"}`, map[string]string{"X-Kvrouter-Forwarded-By": "n9"}, 403, "forbidden", false},
		{"join, member claiming another forwarder", c.HTTPClient(member), "/cluster/join", `{"node_id":"n7","raft_addr":"` + freeAddr() + `"}`, map[string]string{"X-Kvrouter-Forwarded-By": l.ID}, 403, "forbidden", false},
		// A member's certificate vouches for the member, not for the
		// address it forwards: the leader checks it anyway.
		{"join forwarded by a member, raft_addr where nothing answers", c.HTTPClient(member), "/cluster/join", `{"node_id":"n7","raft_addr":"` + freeAddr() + `"}`, map[string]string{"X-Kvrouter-Forwarded-By": f.ID}, 400, "unverified_peer", true},
		{"join forwarded by a member, raft_addr of another member", c.HTTPClient(member), "/cluster/join", `{"node_id":"n7","raft_addr":"` + c.M(2).RaftAddr + `"}`, map[string]string{"X-Kvrouter-Forwarded-By": f.ID}, 400, "unverified_peer", true},
	}
	for _, m := range []*clustertest.Member{l, f} {
		for _, p := range probes {
			if p.leader && m != l {
				continue
			}
			status, out := postJSON(t, p.client, m.HTTPURL()+p.path, []byte(p.body), p.header)
			if p.status == 0 {
				if status != 0 {
					t.Errorf("%s on %s: HTTP %d %v, want the handshake refused", p.name, m.ID, status, out)
				}
				continue
			}
			if status != p.status || out["code"] != p.code {
				t.Errorf("%s on %s: HTTP %d %v, want %d %s", p.name, m.ID, status, out, p.status, p.code)
			}
		}
		// GET /cluster/commit, readiness's channel, needs a member too.
		resp, err := anon.Get(m.HTTPURL() + "/cluster/commit")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("commit without certificate on %s: HTTP %d", m.ID, resp.StatusCode)
		}
	}
	c.WaitConverged()
	for _, m := range c.Members() {
		if got := stateOf(m); got != before[m.ID] {
			t.Errorf("%s changed: before %+v, after %+v", m.ID, before[m.ID], got)
		}
	}
	if got := voters(t, l.Node()); !slices.Equal(got, configBefore) {
		t.Errorf("configuration %v, was %v", got, configBefore)
	}
	if got := refusals(t, l, "http"); got == 0 {
		t.Error("no HTTP refusals counted")
	}

	// A member's own certificate applies directly.
	status, out := postJSON(t, c.HTTPClient(member), l.HTTPURL()+"/cluster/apply", []byte("direct"), nil)
	if status != http.StatusOK || out["error"] != nil {
		t.Errorf("apply with a member certificate: HTTP %d %v", status, out)
	}

	// Removed, a member is refused on the Raft port although its
	// certificate is still valid.
	gone := c.M(2)
	if gone == l {
		gone = c.M(1)
	}
	if err := retryErr(t, func(ctx context.Context) error { return c.WaitLeader().Node().Remove(ctx, gone.ID) }); err != nil {
		t.Fatalf("remove %s: %v", gone.ID, err)
	}
	l = c.WaitLeader()
	poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
		if len(voters(t, l.Node())) != 2 {
			return fmt.Errorf("configuration %v", voters(t, l.Node()))
		}
		return nil
	})
	err = probeRaftTLS(l.RaftAddr, attackerTLS(gone.Bundle()))
	var ne net.Error
	if err == nil || (errors.As(err, &ne) && ne.Timeout()) {
		t.Errorf("removed member %s kept a Raft connection to %s (err %v)", gone.ID, l.ID, err)
	}
}

// TestClusterTLSConfigIdentity: a node refuses to start with a certificate
// naming another node (or a worker): peers would check the wrong name.
func TestClusterTLSConfigIdentity(t *testing.T) {
	ca, err := pki.NewCA(pki.CAOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []pki.Identity{pki.Node("n1"), pki.Worker("n0")} {
		cfg := cluster.Config{NodeID: "n0", RaftAddr: "127.0.0.1:1", DataDir: t.TempDir(), TLS: clustertest.IssueBundle(t, ca, id)}
		_, err := cluster.New(cfg, clustertest.NewFSM())
		if err == nil || !strings.Contains(err.Error(), "TLS certificate names") {
			t.Errorf("certificate %s for node n0: err %v", id, err)
		}
	}
}
