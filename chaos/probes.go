//go:build chaos

package chaos

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/internal/pki"
	"github.com/kvrouter/kvrouter/router"
)

// A1 replays issue 16's attacks against a three-replica cluster running
// with the secure defaults (every replica off loopback, TLS material, the
// admin token), from the harness's process in the root namespace: an
// address that is no member, holding no cluster credential unless a probe
// says otherwise (the admin token, a worker's certificate, a non-member
// node's certificate: each says why). Each probe must be refused, and
// nothing may change: the probes run in a quiet window (no clients, the
// ledger paused, lease renewals 100 s apart), so every replica's applied
// index and FSM digest after the probes must equal those before, and so
// must the workers, their blocks and cursors, the membership and the term.
//
// Every probe below says what the attack did before issue 16 (SECURITY.md,
// the issue's "Why") and what stops it now.

// probeTimeout bounds one network attempt of a probe.
const probeTimeout = 5 * time.Second

// a1Rogue is the worker whose certificate the probes misuse: a real,
// registered worker turned hostile (its key stolen, or its engine host
// compromised). a1Victim is the worker it attacks.
const (
	a1Rogue  = "ledger-1"
	a1Victim = "ledger-2"
)

// a1Bogus is a Raft address nothing listens on (the harness's own bridge
// address, a closed port): a voter there could never answer.
var a1Bogus = fmt.Sprintf("%s:%d", hostIP, 7999)

// attacker is what the probes hold and how they reach the cluster.
type attacker struct {
	e       *env
	roots   *x509.CertPool  // the cluster's CA, public: only to reach HTTPS without skipping checks
	foreign tls.Certificate // node certificate naming r1, from a CA the attacker made
	rogue   tls.Certificate // a1Rogue's worker certificate (valid CA, wrong role)
	r4      tls.Certificate // node r4's certificate: valid CA, a node, not a member
	leader  int
}

func a1Nemesis(e *env) error {
	if e.cred == nil {
		return errors.New("A1 needs the secure defaults (credentials)")
	}
	if len(e.ledger) < 2 {
		return errors.New("A1 needs two ledger workers (rogue and victim)")
	}
	a, err := newAttacker(e)
	if err != nil {
		return err
	}
	// Ledger events flow for a while (the state has blocks to protect),
	// then the ledger pauses and the cluster settles.
	if !e.sleep(5 * time.Second) {
		return e.ctx.Err()
	}
	e.pauseLedger()
	before, err := e.quiesce("quiet before the probes")
	if err != nil {
		return err
	}
	e.event("probe", "before: applied %d, digest %s on every replica", before[e.members[0]].AppliedIndex, before[e.members[0]].Digest)
	natsBefore, err := a.streamState()
	if err != nil {
		return fmt.Errorf("operator view of the stream: %w", err)
	}
	if a.leader, err = e.leader(); err != nil {
		return err
	}

	// The slow-client probes take the server's deadlines (10 s, 30 s,
	// 120 s): they run beside the others. None writes anything.
	var slowWG sync.WaitGroup
	slow := map[string]float64{}
	var slowMu sync.Mutex
	for name, fn := range map[string]func() (float64, error){
		"slow_header": a.slowHeader, "slow_body": a.slowBody, "idle_keepalive": a.idleKeepAlive,
	} {
		slowWG.Add(1)
		go func() {
			defer slowWG.Done()
			s, err := fn()
			if err != nil {
				e.event("probe", "8 %s: %v", name, err)
				s = math.NaN()
			}
			slowMu.Lock()
			slow[name] = s
			slowMu.Unlock()
		}()
	}

	a.raftProbes(before)
	a.joinProbes()
	a.applyProbes()
	a.natsProbes()
	a.ssrfProbes()
	a.tokenProbes()

	// Wait for the body deadline (the longest that bounds a write-capable
	// request) before the state is compared: the slow body is a chat
	// completion, which books load if it ever got through.
	_, _ = e.waitFor("slow body probe", 60*time.Second, 250*time.Millisecond, func() bool {
		slowMu.Lock()
		defer slowMu.Unlock()
		_, ok := slow["slow_body"]
		return ok
	})
	after, err := e.quiesce("quiet after the probes")
	if err != nil {
		return err
	}
	natsAfter, err := a.streamState()
	if err != nil {
		return fmt.Errorf("operator view of the stream: %w", err)
	}
	a.compare(before, after, natsBefore, natsAfter)

	// The bridge is not a replica: its probe runs after the cluster's state
	// is settled (its own bus connection must not blur the comparison).
	a.zmqProbe()
	slowWG.Wait()
	a.slowChecks(slow)
	a.processesAlive(before)

	// Ingest still flows: the ledger resumes, and every replica applies
	// new events of every ledger worker.
	e.resumeLedger()
	a.ingestFlows(after)
	return nil
}

func a1Check(e *env) {
	e.publishMeasures()
}

func newAttacker(e *env) (*attacker, error) {
	roots, err := pki.LoadPool(e.cred.caFile())
	if err != nil {
		return nil, err
	}
	a := &attacker{e: e, roots: roots}
	// A CA of the attacker's own, and a certificate from it that claims
	// to be member r1: the name is right, the signature is not ours.
	ca, err := pki.NewCA(pki.CAOptions{Name: "attacker CA"})
	if err != nil {
		return nil, err
	}
	kp, err := ca.Issue(pki.Request{Identity: pki.Node("r1"), Hosts: []string{hostIP, nodeIP(1)}})
	if err != nil {
		return nil, err
	}
	if a.foreign, err = kp.TLSCertificate(); err != nil {
		return nil, err
	}
	w := e.cred.worker(a1Rogue)
	if a.rogue, err = tls.LoadX509KeyPair(w.CertFile, w.KeyFile); err != nil {
		return nil, err
	}
	n := e.cred.node(4)
	if a.r4, err = tls.LoadX509KeyPair(n.CertFile, n.KeyFile); err != nil {
		return nil, err
	}
	return a, nil
}

// check records one probe's verdict (a probe: refused; a state check:
// unchanged) as one check of the result.
func (a *attacker) check(name string, ok bool, detail string) {
	a.e.res.RequireTrue(name, ok, detail)
	verdict := "ok"
	if !ok {
		verdict = "FAILED"
	}
	a.e.event("probe", "%s: %s — %s", name, verdict, detail)
}

// --- 1, 2: the Raft port ---------------------------------------------------------

// raftProbes: before issue 16 the Raft transport was plain TCP and
// hashicorp/raft trusts whoever speaks it: one AppendEntries with term
// 1000 from an outside process made a replica follow the sender and
// commit its entry (a worker deregistered). Now the port is mutual TLS
// (cluster/tls.go): the handshake must present a certificate of the
// cluster's CA naming a current member, and raft reads no byte before
// that. The forged request below is the real thing, built with raft's own
// transport: term 1000, the target's last index as the previous entry,
// one entry deregistering mock-1, committed at once.
func (a *attacker) raftProbes(before map[int]*status) {
	cases := []struct {
		name, how string
		conf      *tls.Config // nil: plain TCP
	}{
		{"p1_raft_forged_append_plain_tcp", "plain TCP", nil},
		{"p1_raft_forged_append_foreign_ca", "TLS, a certificate naming member r1 from the attacker's own CA", presenting(a.foreign)},
		{"p1_raft_forged_append_nonmember_node", "TLS, node r4's genuine certificate (r4 is no member)", presenting(a.r4)},
		// 2: the CA is right, the role is not: a worker may publish its
		// events, never speak Raft.
		{"p2_raft_forged_append_worker_cert", "TLS, worker " + a1Rogue + "'s genuine certificate", presenting(a.rogue)},
	}
	for _, c := range cases {
		var accepted []string
		var errs []string
		for _, i := range a.e.members {
			err := forgedAppendEntries(fmt.Sprintf("%s:%d", nodeIP(i), raftPort), c.conf, before[i])
			if err == nil {
				accepted = append(accepted, fmt.Sprintf("r%d", i))
			} else {
				errs = append(errs, fmt.Sprintf("r%d: %s", i, shortDetail(err)))
			}
		}
		a.check(c.name, len(accepted) == 0, fmt.Sprintf("AppendEntries term 1000 over %s: %s", c.how, strings.Join(append(errs, accepted...), "; ")))
	}
}

// forgedAppendEntries sends one AppendEntries RPC to addr through raft's
// NetworkTransport; nil means the target answered it (the attack got
// through the transport, whatever raft then decided).
func forgedAppendEntries(addr string, conf *tls.Config, st *status) error {
	ln, err := net.Listen("tcp", hostIP+":0")
	if err != nil {
		return fmt.Errorf("attacker listener: %w", err)
	}
	stream := &attackStream{Listener: ln, conf: conf}
	trans := raft.NewNetworkTransport(stream, 1, probeTimeout, io.Discard)
	defer trans.Close()
	cmd, err := fsm.EncodeDeregisterWorker(fsm.DeregisterWorker{ID: "mock-1"})
	if err != nil {
		return err
	}
	var last, term uint64
	if st != nil {
		last, term = st.CommitIndex, st.Term
	}
	req := &raft.AppendEntriesRequest{
		RPCHeader:         raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte("attacker"), Addr: []byte(ln.Addr().String())},
		Term:              1000,
		PrevLogEntry:      last,
		PrevLogTerm:       term,
		Entries:           []*raft.Log{{Index: last + 1, Term: 1000, Type: raft.LogCommand, Data: cmd}},
		LeaderCommitIndex: last + 1,
	}
	var resp raft.AppendEntriesResponse
	if err := trans.AppendEntries("r", raft.ServerAddress(addr), req, &resp); err != nil {
		return err
	}
	return nil
}

// presenting is an attacker's TLS client configuration: it skips checking
// the server (the attacker does not care whom it talks to) and sends cert
// whatever CAs the server says it accepts (crypto/tls would otherwise
// send nothing when the issuer is not among them, and the probe would
// test an anonymous client instead of the forged certificate).
func presenting(cert tls.Certificate) *tls.Config {
	return &tls.Config{InsecureSkipVerify: true, GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
		return &cert, nil
	}}
}

// attackStream is raft.StreamLayer dialling plain TCP or TLS with the
// attacker's configuration.
type attackStream struct {
	net.Listener
	conf *tls.Config
}

func (s *attackStream) Dial(addr raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	d := &net.Dialer{Timeout: timeout}
	if s.conf == nil {
		return d.Dial("tcp", string(addr))
	}
	return tls.DialWithDialer(d, "tcp", string(addr), s.conf)
}

// --- 3, 4, 5: the cluster endpoints ---------------------------------------------------

// client is an HTTPS client that trusts the cluster's CA and presents cert
// (none when nil).
func (a *attacker) client(cert *tls.Certificate) *http.Client {
	conf := &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: a.roots}
	if cert != nil {
		conf.Certificates = []tls.Certificate{*cert}
	}
	// One connection per request: a probe leaves nothing idle behind.
	return &http.Client{Timeout: probeTimeout, Transport: &http.Transport{TLSClientConfig: conf, DisableKeepAlives: true}}
}

// call sends body to the path on replica i; token "" sends none. It
// returns the status (0 when the request failed) and the answer's first
// line or the error.
func (a *attacker) call(c *http.Client, i int, method, path, contentType string, body []byte, token string) (int, string) {
	ctx, cancel := context.WithTimeout(a.e.ctx, probeTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, a.e.acc.url(i)+path, strings.NewReader(string(body)))
	if err != nil {
		return 0, err.Error()
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, shortDetail(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	return resp.StatusCode, firstLine(data)
}

// joinProbes: before issue 16 POST /cluster/join took at most the
// operator's token, and a bogus voter (an address that never answers)
// cost a single-node cluster its quorum for good. Now /cluster/* takes a
// member's client certificate, not a token (cluster/http.go checkPeer);
// a join must come from the joining node itself, and the leader dials
// the address it names and wants that node's certificate there before
// it changes the configuration (verifyRaftPeer).
func (a *attacker) joinProbes() {
	body, _ := json.Marshal(map[string]string{"node_id": "evil", "raft_addr": a1Bogus})
	var got []string
	refused := true
	for _, i := range a.e.members {
		code, msg := a.call(a.client(nil), i, http.MethodPost, "/cluster/join", "application/json", body, a.e.cred.adminToken)
		got = append(got, fmt.Sprintf("r%d: HTTP %d %s", i, code, msg))
		refused = refused && code == http.StatusUnauthorized
	}
	a.check("p3_join_admin_token_no_cert", refused, "bogus voter evil at "+a1Bogus+" with the admin token, no client certificate (want 401 from every replica): "+strings.Join(got, "; "))

	// With the genuine certificate of node r4 (a node, so it may ask to
	// join as itself) naming an address where r4 does not answer: the
	// leader's dial finds nobody and refuses.
	r4 := a.rogueNode()
	body, _ = json.Marshal(map[string]string{"node_id": "r4", "raft_addr": a1Bogus})
	code, msg := a.call(r4, a.leader, http.MethodPost, "/cluster/join", "application/json", body, a.e.cred.adminToken)
	a.check("p3_join_nonmember_node_bogus_addr", code != 0 && (code < 200 || code > 299),
		fmt.Sprintf("node r4's own certificate asks the leader r%d to add r4 at %s, where nothing answers: HTTP %d %s", a.leader, a1Bogus, code, msg))
}

func (a *attacker) rogueNode() *http.Client { return a.client(&a.r4) }

// applyProbes: before issue 16 POST /cluster/apply committed whatever
// bytes it was given (garbage included, which the FSM treated as a
// programming error) with at most the operator's token. Now it needs a
// member's certificate (401 without a certificate, 403 for a worker's),
// and even a member may forward only the command types replicas forward
// (replica.checkForwarded): never an ingest batch nor a Tick.
func (a *attacker) applyProbes() {
	garbage := make([]byte, 64)
	_, _ = rand.Read(garbage)
	batch, _ := fsm.EncodeKVBatch([]fsm.KVBatchEvent{{Worker: a1Victim, EventID: 1 << 50, Event: router.KVEvent{Kind: router.EventCleared}}})
	dereg, _ := fsm.EncodeDeregisterWorker(fsm.DeregisterWorker{ID: "mock-1"})
	tick, _ := fsm.EncodeTick(fsm.Tick{Now: math.MaxInt64})
	for _, c := range []struct {
		name, what string
		cmd        []byte
	}{
		{"p4_apply_garbage", "64 random bytes", garbage},
		{"p4_apply_ingest_batch", "an ingest batch clearing " + a1Victim + "'s blocks", batch},
		{"p4_apply_deregister", "DeregisterWorker mock-1 (the issue's forged entry)", dereg},
		// 5: the time-travel Tick. Proposing it from outside is refused
		// like any other command; were it ever applied, the FSM clamps the
		// step to MaxClockStep (fsm/clock.go; fsm/clock_test.go
		// TestFSMClockTimeTravelTick replays it: live workers survive).
		{"p5_apply_tick_maxint64", "Tick{Now: MaxInt64}", tick},
	} {
		code, msg := a.call(a.client(nil), a.leader, http.MethodPost, "/cluster/apply", "application/octet-stream", c.cmd, a.e.cred.adminToken)
		a.check(c.name+"_no_cert", code == http.StatusUnauthorized,
			fmt.Sprintf("%s to leader r%d with the admin token, no client certificate (want 401): HTTP %d %s", c.what, a.leader, code, msg))
		code, msg = a.call(a.client(&a.rogue), a.leader, http.MethodPost, "/cluster/apply", "application/octet-stream", c.cmd, a.e.cred.adminToken)
		a.check(c.name+"_worker_cert", code == http.StatusForbidden,
			fmt.Sprintf("%s to leader r%d with %s's certificate and the admin token (want 403): HTTP %d %s", c.what, a.leader, a1Rogue, code, msg))
	}
}

// --- 9, 10: the admin API --------------------------------------------------------------

// ssrfProbes: before issue 16 /workers/register accepted any URL, and the
// proxy then sent clients' requests there (gopher://, loopback ports,
// the cloud metadata address). Now a worker URL must be http(s) with a
// host, and loopback, link-local and unspecified hosts are refused unless
// the replica itself listens on loopback (api bounds, --allow-loopback-workers).
// The probes hold the admin token: the URL check must stand on its own.
func (a *attacker) ssrfProbes() {
	for _, c := range []struct{ name, url string }{
		{"p9_ssrf_gopher", "gopher://" + hostIP + ":70/_evil"},
		{"p9_ssrf_file", "file:///etc/passwd"},
		{"p9_ssrf_loopback", "http://127.0.0.1:8080"},
		{"p9_ssrf_metadata", "http://169.254.169.254/latest/meta-data/"},
	} {
		body, _ := json.Marshal(map[string]any{"id": "ssrf-" + strings.TrimPrefix(c.name, "p9_ssrf_"), "url": c.url, "model": ledgerModel,
			"block_size": blockSize, "total_kv_blocks": 1024})
		code, msg := a.call(a.client(nil), a.e.members[0], http.MethodPost, "/workers/register", "application/json", body, a.e.cred.adminToken)
		a.check(c.name, code == http.StatusBadRequest, fmt.Sprintf("register a worker at %s with the admin token (want 400): HTTP %d %s", c.url, code, msg))
	}
}

// tokenProbes: before issue 16 the admin endpoints were open when no
// token was configured, and nothing made one necessary. Now a replica off
// loopback refuses to start without one (cmd/kvrouter checkSecurity), and
// the admin group answers 401 without it or with a wrong one.
func (a *attacker) tokenProbes() {
	threshold := []byte(fmt.Sprintf(`{"model":%q,"active_decode_blocks_threshold":0.01}`, ledgerModel))
	register, _ := json.Marshal(map[string]any{"id": "intruder", "url": fmt.Sprintf("http://%s:9", hostIP), "model": ledgerModel,
		"block_size": blockSize, "total_kv_blocks": 1024})
	for _, c := range []struct {
		name, path, token string
		body              []byte
	}{
		{"p10_busy_threshold_no_token", "/busy_threshold", "", threshold},
		{"p10_busy_threshold_wrong_token", "/busy_threshold", "not-the-admin-token", threshold},
		{"p10_register_no_token", "/workers/register", "", register},
		{"p10_register_wrong_token", "/workers/register", "not-the-admin-token", register},
	} {
		code, msg := a.call(a.client(nil), a.e.members[0], http.MethodPost, c.path, "application/json", c.body, c.token)
		a.check(c.name, code == http.StatusUnauthorized || code == http.StatusForbidden,
			fmt.Sprintf("POST %s (want 401 or 403): HTTP %d %s", c.path, code, msg))
	}
}

// --- 6: the bus ------------------------------------------------------------------------

// natsURLs are the replicas' NATS client ports.
func (a *attacker) natsURLs() string {
	var urls []string
	for _, i := range a.e.members {
		urls = append(urls, fmt.Sprintf("nats://%s:%d", nodeIP(i), natsPort))
	}
	return strings.Join(urls, ",")
}

// natsProbes: before issue 16 the embedded NATS had no TLS and no
// authentication: forged KV events put 8,191 blocks on a worker, a forged
// replica-sync message booked 50 M prefill tokens, and
// $JS.API.CONSUMER.DELETE removed the ingest consumer. Now the client
// port is TLS only and admits a node or worker certificate or the replica
// token, nothing anonymous (eventbus/auth.go clientAuth); a worker may
// publish only kv.events.<itself> and subscribe only to its resync
// subject and its own inbox (workerPermissions).
func (a *attacker) natsProbes() {
	// Plain TCP, the NATS protocol by hand: the server wants TLS first.
	err := natsPlainConnect(fmt.Sprintf("%s:%d", nodeIP(a.e.members[0]), natsPort))
	a.check("p6_nats_plain_no_credentials", err != nil, "CONNECT without TLS or credentials: "+shortDetail(err))

	for _, c := range []struct {
		name, what string
		opts       []nats.Option
	}{
		{"p6_nats_tls_anonymous", "TLS, no certificate, no token", nil},
		{"p6_nats_tls_wrong_token", "TLS, a wrong token", []nats.Option{nats.Token("not-the-replica-token")}},
		{"p6_nats_tls_foreign_ca", "TLS, node r1's name from the attacker's CA", []nats.Option{nats.Secure(presenting(a.foreign))}},
	} {
		opts := append([]nats.Option{nats.Secure(&tls.Config{InsecureSkipVerify: true}), nats.Timeout(probeTimeout), nats.NoReconnect()}, c.opts...)
		nc, err := nats.Connect(a.natsURLs(), opts...)
		if nc != nil {
			nc.Close()
		}
		a.check(c.name, err != nil, c.what+": "+shortDetail(err))
	}

	// The rogue worker: a genuine worker certificate, used for what only
	// replicas may do.
	violations := make(chan string, 64)
	nc, err := nats.Connect(a.natsURLs(), nats.Name("chaos-a1-rogue"), nats.Timeout(probeTimeout), nats.NoReconnect(),
		nats.Secure(&tls.Config{RootCAs: a.roots, Certificates: []tls.Certificate{a.rogue}}),
		nats.CustomInboxPrefix(eventbus.WorkerInboxPrefix(a1Rogue)),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			select {
			case violations <- err.Error():
			default:
			}
		}))
	if err != nil {
		a.check("p6_rogue_worker_connects", false, "the rogue worker's own certificate must connect (else the next probes prove nothing): "+err.Error())
		return
	}
	defer nc.Close()
	forged, _ := json.Marshal([]eventbus.WireEvent{{EventID: 1 << 50, Kind: eventbus.KindCleared, BlockSize: blockSize}})
	for _, c := range []struct {
		name, subject, what string
	}{
		{"p6_publish_other_workers_events", eventbus.EventSubject(a1Victim), "a Cleared event as " + a1Victim},
		{"p6_publish_replica_sync", eventbus.SyncSubject(""), "a replica-sync message"},
		{"p6_publish_replica_sync_model", eventbus.SyncSubject(ledgerModel), "a replica-sync message for " + ledgerModel},
		{"p6_js_consumer_delete", "$JS.API.CONSUMER.DELETE." + eventbus.StreamName + "." + eventbus.DefaultDurable, "a JetStream consumer delete"},
		{"p6_js_stream_purge", "$JS.API.STREAM.PURGE." + eventbus.StreamName, "a JetStream stream purge"},
	} {
		drain(violations)
		err := nc.Publish(c.subject, forged)
		if err == nil {
			err = nc.FlushTimeout(probeTimeout)
		}
		v := awaitViolation(violations, c.subject, 3*time.Second)
		a.check(c.name, v != "", fmt.Sprintf("%s with %s's certificate on %s: %s", c.what, a1Rogue, c.subject, firstNonEmpty(v, "no permissions violation (publish: "+shortDetail(err)+")")))
	}
	// Reading every worker's events (or other clients' replies) is no
	// worker's business either.
	for _, c := range []struct{ name, subject string }{
		{"p6_subscribe_all_events", eventbus.EventSubjects},
		{"p6_subscribe_all_inboxes", "_INBOX.>"},
	} {
		drain(violations)
		sub, err := nc.SubscribeSync(c.subject)
		if err == nil {
			err = nc.FlushTimeout(probeTimeout)
		}
		v := awaitViolation(violations, c.subject, 3*time.Second)
		if sub != nil {
			_ = sub.Unsubscribe()
		}
		a.check(c.name, v != "", fmt.Sprintf("subscribe %s with %s's certificate: %s", c.subject, a1Rogue, firstNonEmpty(v, "no permissions violation (subscribe: "+shortDetail(err)+")")))
	}
}

// natsPlainConnect speaks the NATS client protocol over plain TCP without
// credentials; nil means the server answered PONG (accepted).
func natsPlainConnect(addr string) error {
	c, err := net.DialTimeout("tcp", addr, probeTimeout)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(probeTimeout))
	r := bufio.NewReader(c)
	info, err := r.ReadString('\n')
	if err != nil {
		return fmt.Errorf("no INFO: %w", err)
	}
	if _, err := io.WriteString(c, "CONNECT {\"verbose\":false,\"pedantic\":false,\"tls_required\":false,\"name\":\"chaos-a1\"}\r\nPING\r\n"); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	for {
		line, err := r.ReadString('\n')
		line = strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(line, "PONG"):
			return nil
		case strings.HasPrefix(line, "-ERR"):
			return fmt.Errorf("server: %s (INFO said tls_required: %v)", line, strings.Contains(info, `"tls_required":true`))
		case err != nil:
			return fmt.Errorf("connection closed: %w (INFO said tls_required: %v)", err, strings.Contains(info, `"tls_required":true`))
		}
	}
}

func drain(ch chan string) {
	for {
		select {
		case <-ch:
		default:
			return
		}
	}
}

// awaitViolation waits for the server's permissions violation naming
// subject and returns its text ("" if none came).
func awaitViolation(ch chan string, subject string, d time.Duration) string {
	t := time.After(d)
	for {
		select {
		case v := <-ch:
			if strings.Contains(strings.ToLower(v), "permissions violation") && strings.Contains(v, subject) {
				return v
			}
		case <-t:
			return ""
		}
	}
}

// streamInfo is the operator's view of the ingest stream: its consumers,
// each with its creation time (a consumer deleted and made again by the
// leader has the same name, not the same creation time), and its last
// sequence (a forged event that got in would move it).
type streamInfo struct {
	Consumers []string // name@created
	Last      uint64
}

// streamState reads the stream as the operator, with the replica token
// (the harness made it; no attacker holds it).
func (a *attacker) streamState() (streamInfo, error) {
	var si streamInfo
	nc, err := nats.Connect(a.natsURLs(), nats.Name("chaos-a1-operator"), nats.Timeout(probeTimeout), nats.NoReconnect(),
		nats.Secure(&tls.Config{MinVersion: tls.VersionTLS13, RootCAs: a.roots}), nats.Token(a.e.cred.replicaTok))
	if err != nil {
		return si, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return si, err
	}
	ctx, cancel := context.WithTimeout(a.e.ctx, probeTimeout)
	defer cancel()
	st, err := js.Stream(ctx, eventbus.StreamName)
	if err != nil {
		return si, err
	}
	info, err := st.Info(ctx)
	if err != nil {
		return si, err
	}
	si.Last = info.State.LastSeq
	infos := st.ListConsumers(ctx)
	for ci := range infos.Info() {
		si.Consumers = append(si.Consumers, ci.Name+"@"+ci.Created.Format(time.RFC3339Nano))
	}
	if err := infos.Err(); err != nil {
		return si, err
	}
	sort.Strings(si.Consumers)
	return si, nil
}

// --- 7: the ZMQ bridge ------------------------------------------------------------------

// zmqProbe: before issue 16 zmq4 allocated whatever frame size the peer
// declared, so one 10-byte header declaring 2^50 bytes crashed `kvrouter
// bridge` (makeslice panic, or a fatal out-of-memory). Now the bridge
// dials engines through a transport that follows the ZMTP framing and
// drops a connection whose header is over the cap before zmq4 sees it
// (eventbus/zmqbridge/framecap.go). The probe plays the engine: the
// bridge connects to it, and it answers the handshake and then the huge
// header, on every connection.
//
// The bridge has no bus certificate flags (it connects with
// eventbus.Connect and no credentials of its own), so on the secure bus it
// authenticates with the replica token in its NATS URL, passed in its
// environment, and trusts the CA through SSL_CERT_FILE: a finding, not a
// choice (a worker-scoped certificate would be the right credential).
func (a *attacker) zmqProbe() {
	e := a.e
	engine, err := startHostileEngine()
	if err != nil {
		a.check("p7_zmq_oversized_frame", false, "hostile engine: "+err.Error())
		return
	}
	defer engine.close()
	httpAddr, err := freeLoopbackAddr()
	if err != nil {
		a.check("p7_zmq_oversized_frame", false, err.Error())
		return
	}
	var urls []string
	for _, i := range e.members {
		urls = append(urls, fmt.Sprintf("tls://%s@%s:%d", e.cred.replicaTok, nodeIP(i), natsPort))
	}
	br := &proc{name: "bridge", logPath: filepath.Join(e.dir, "bridge.log"),
		env: []string{"KVROUTER_BRIDGE_NATS=" + strings.Join(urls, ","), "SSL_CERT_FILE=" + e.cred.caFile()}}
	argv := []string{e.bin("kvrouter"), "bridge", "--id", "zmq-probe", "--url", fmt.Sprintf("http://%s:9", hostIP),
		"--model", ledgerModel, "--events", "tcp://" + engine.addr(), "--total-kv-blocks", "1024", "--max-batched-tokens", "8192",
		"--block-size", fmt.Sprint(blockSize), "--http-addr", httpAddr}
	if err := br.start(argv, e.pids); err != nil {
		a.check("p7_zmq_oversized_frame", false, "start the bridge: "+err.Error())
		return
	}
	defer br.term(5 * time.Second)
	// The bridge must connect, be dropped by its guard, and dial again.
	_, werr := e.waitFor("bridge redials the hostile engine", 30*time.Second, 100*time.Millisecond, func() bool {
		return !br.running() || (engine.accepted.Load() >= 2 && engine.hungUp.Load() >= 1)
	})
	e.sleep(time.Second)
	alive := br.running()
	oversized, health := bridgeOversized(e.ctx, "http://"+httpAddr+"/status")
	logged := fileContains(br.logPath, "zmq frame over the size cap")
	detail := fmt.Sprintf("hostile engine declared a %d-byte frame on %d connections (bridge hung up %d); bridge running %v, /status %s, oversized_frames %d, refusal logged %v",
		uint64(1)<<50, engine.accepted.Load(), engine.hungUp.Load(), alive, health, oversized, logged)
	if werr != nil {
		detail += "; " + werr.Error()
	}
	a.check("p7_zmq_oversized_frame", alive && health == "200" && oversized >= 1 && logged, detail)
}

// hostileEngine is a raw TCP server in the place of an engine's ZMQ PUB
// socket: ZMTP 3.0 greeting (NULL mechanism), READY with Socket-Type PUB,
// then a long frame header declaring 2^50 bytes.
type hostileEngine struct {
	ln       net.Listener
	accepted atomic.Int64
	hungUp   atomic.Int64
	wg       sync.WaitGroup
}

func startHostileEngine() (*hostileEngine, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	h := &hostileEngine{ln: ln}
	greeting := make([]byte, 64)
	greeting[0], greeting[9], greeting[10] = 0xFF, 0x7F, 3 // signature, version 3.0
	copy(greeting[12:32], "NULL")
	ready := append([]byte("\x05READY\x0bSocket-Type"), binary.BigEndian.AppendUint32(nil, 3)...)
	ready = append(ready, "PUB"...)
	script := append(append(greeting, 0x04, byte(len(ready))), ready...) // command frame, short size
	script = append(script, 0x02)                                        // long frame, no more
	script = binary.BigEndian.AppendUint64(script, 1<<50)
	h.wg.Add(1)
	go func() {
		defer h.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			h.accepted.Add(1)
			h.wg.Add(1)
			go func() {
				defer h.wg.Done()
				defer c.Close()
				_, _ = c.Write(script)
				_, _ = io.Copy(io.Discard, c) // until the bridge hangs up
				h.hungUp.Add(1)
			}()
		}
	}()
	return h, nil
}

func (h *hostileEngine) addr() string { return h.ln.Addr().String() }

func (h *hostileEngine) close() {
	_ = h.ln.Close()
	h.wg.Wait()
}

func freeLoopbackAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// bridgeOversized sums oversized_frames over the bridge's /status.
func bridgeOversized(ctx context.Context, url string) (uint64, string) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, shortDetail(err)
	}
	defer resp.Body.Close()
	var doc any
	if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
		return 0, fmt.Sprintf("%d (undecodable: %v)", resp.StatusCode, err)
	}
	return sumKey(doc, "oversized_frames"), fmt.Sprint(resp.StatusCode)
}

func sumKey(v any, key string) uint64 {
	var n uint64
	switch x := v.(type) {
	case map[string]any:
		for k, c := range x {
			if f, ok := c.(float64); ok && k == key {
				n += uint64(f)
			} else {
				n += sumKey(c, key)
			}
		}
	case []any:
		for _, c := range x {
			n += sumKey(c, key)
		}
	}
	return n
}

func fileContains(path, s string) bool {
	data, err := os.ReadFile(path)
	return err == nil && strings.Contains(string(data), s)
}

// --- 8: slow clients ---------------------------------------------------------------------

// The replica's HTTP server bounds (api/httpserver.go ServerOptions
// defaults; serve passes none of its own): headers 10 s, a body 30 s
// from the end of the headers, an idle keep-alive 120 s. Before issue 16
// only ReadHeaderTimeout was set: a body at 1 byte/s and an idle
// keep-alive held their connection (and goroutine) for ever.
const (
	serverHeaderTimeout = 10 * time.Second
	serverBodyTimeout   = 30 * time.Second
	serverIdleTimeout   = 120 * time.Second
	// slowMargin covers scheduling and the 1 s pace of the trickle.
	slowMargin = 3 * time.Second
)

// dialReplica opens a TLS connection to replica i's HTTP port as a client
// without credentials.
func (a *attacker) dialReplica(i int) (*tls.Conn, error) {
	d := &net.Dialer{Timeout: probeTimeout}
	return tls.DialWithDialer(d, "tcp", fmt.Sprintf("%s:%d", nodeIP(i), httpPort), &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: a.roots})
}

// trickle writes p one byte a second until the connection fails or stop
// closes; then it returns.
func trickle(c net.Conn, p []byte, stop <-chan struct{}) {
	for _, b := range p {
		select {
		case <-stop:
			return
		case <-time.After(time.Second):
		}
		_ = c.SetWriteDeadline(time.Now().Add(probeTimeout))
		if _, err := c.Write([]byte{b}); err != nil {
			return
		}
	}
}

// untilClosed reads c until the server closes it (or limit passes) and
// returns the seconds since t0.
func untilClosed(c net.Conn, t0 time.Time, limit time.Duration) (float64, error) {
	_ = c.SetReadDeadline(t0.Add(limit))
	_, err := io.Copy(io.Discard, c)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return math.NaN(), fmt.Errorf("still open after %s", limit)
	}
	return time.Since(t0).Seconds(), nil
}

// slowHeader sends a request line, then a header at 1 byte/s.
func (a *attacker) slowHeader() (float64, error) {
	c, err := a.dialReplica(a.e.members[0])
	if err != nil {
		return 0, err
	}
	defer c.Close()
	t0 := time.Now()
	if _, err := io.WriteString(c, "GET /health HTTP/1.1\r\n"); err != nil {
		return 0, err
	}
	stop := make(chan struct{})
	defer close(stop)
	go trickle(c, []byte("Host: "+strings.Repeat("h", 200)+"\r\n\r\n"), stop)
	return untilClosed(c, t0, serverHeaderTimeout+30*time.Second)
}

// slowBody sends a chat completion's headers, then its body at 1 byte/s.
func (a *attacker) slowBody() (float64, error) {
	c, err := a.dialReplica(a.e.members[0])
	if err != nil {
		return 0, err
	}
	defer c.Close()
	body := []byte(fmt.Sprintf(`{"model":%q,"max_tokens":4,"messages":[{"role":"user","content":"%s"}]}`, routeModel, strings.Repeat("slow ", 40)))
	head := fmt.Sprintf("POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", nodeIP(a.e.members[0]), len(body))
	if _, err := io.WriteString(c, head); err != nil {
		return 0, err
	}
	t0 := time.Now()
	stop := make(chan struct{})
	defer close(stop)
	go trickle(c, body, stop)
	return untilClosed(c, t0, serverBodyTimeout+30*time.Second)
}

// idleKeepAlive sends one request, reads the answer and then says
// nothing on the kept-alive connection.
func (a *attacker) idleKeepAlive() (float64, error) {
	c, err := a.dialReplica(a.e.members[0])
	if err != nil {
		return 0, err
	}
	defer c.Close()
	if _, err := io.WriteString(c, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		return 0, err
	}
	_ = c.SetReadDeadline(time.Now().Add(probeTimeout))
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return 0, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.Close {
		return 0, errors.New("the server closed after the first answer: no keep-alive to hold")
	}
	t0 := time.Now()
	_ = c.SetReadDeadline(t0.Add(serverIdleTimeout + 30*time.Second))
	_, err = io.Copy(io.Discard, br)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return math.NaN(), fmt.Errorf("still open after %s", serverIdleTimeout+30*time.Second)
	}
	return time.Since(t0).Seconds(), nil
}

func (a *attacker) slowChecks(slow map[string]float64) {
	for _, c := range []struct {
		name  string
		limit time.Duration
		what  string
	}{
		{"slow_header", serverHeaderTimeout, "headers at 1 byte/s, closed after (s), ReadHeaderTimeout"},
		{"slow_body", serverBodyTimeout, "a chat completion's body at 1 byte/s, closed after (s) from the end of its headers, BodyReadTimeout"},
		{"idle_keepalive", serverIdleTimeout, "an idle keep-alive after one answer, closed after (s), IdleTimeout"},
	} {
		v, ok := slow[c.name]
		if !ok {
			v = math.NaN()
		}
		a.e.metric("p8_"+c.name+"_s", jsonSafe(v))
		a.e.res.Require("p8_"+c.name+"_s", v, "<=", (c.limit + slowMargin).Seconds(), fmt.Sprintf("%s %s + %s", c.what, c.limit, slowMargin))
		a.e.event("probe", "p8_%s: closed after %.1fs (bound %s)", c.name, v, c.limit)
	}
}

// --- nothing changed ------------------------------------------------------------------------

// compare checks that the probes changed nothing: every replica's applied
// index, digest and FSM command count as before (nothing was committed),
// the same workers with the same blocks and cursors, the same members,
// the same term (a forged term 1000 never reached raft), the ingest
// consumer and the stream as they were.
func (a *attacker) compare(before, after map[int]*status, nb, na streamInfo) {
	var applied, workers, members, terms []string
	okApplied, okWorkers, okMembers, okTerms := true, true, true, true
	for _, i := range a.e.members {
		b, f := before[i], after[i]
		if b == nil || f == nil {
			okApplied, okWorkers, okMembers, okTerms = false, false, false, false
			continue
		}
		applied = append(applied, fmt.Sprintf("r%d applied %d→%d commands %d→%d digest %s→%s", i, b.AppliedIndex, f.AppliedIndex, b.FSM.Commands, f.FSM.Commands, b.Digest, f.Digest))
		okApplied = okApplied && b.AppliedIndex == f.AppliedIndex && b.Digest == f.Digest && b.FSM.Commands == f.FSM.Commands
		wb, wf := workerView(b), workerView(f)
		if wb != wf {
			okWorkers = false
			workers = append(workers, fmt.Sprintf("r%d before [%s] after [%s]", i, wb, wf))
		}
		mb, mf := memberView(b), memberView(f)
		if mb != mf {
			okMembers = false
			members = append(members, fmt.Sprintf("r%d before [%s] after [%s]", i, mb, mf))
		}
		terms = append(terms, fmt.Sprintf("r%d %d→%d", i, b.Term, f.Term))
		okTerms = okTerms && b.Term == f.Term && f.Term < 1000
	}
	first := before[a.e.members[0]]
	a.check("unchanged_applied_index_and_digest", okApplied, strings.Join(applied, "; "))
	a.check("unchanged_workers_blocks_cursors", okWorkers, firstNonEmpty(strings.Join(workers, "; "), "every replica: "+workerView(first)))
	a.check("unchanged_membership", okMembers, firstNonEmpty(strings.Join(members, "; "), "every replica: "+memberView(first)))
	a.check("unchanged_term", okTerms, strings.Join(terms, "; "))
	// 5, process level: the workers are all still registered (a Tick
	// from the future used to expire every leased worker).
	ids := func(st *status) []string {
		var out []string
		for _, w := range st.Workers {
			out = append(out, w.ID)
		}
		sort.Strings(out)
		return out
	}
	survived := true
	for _, i := range a.e.members {
		if after[i] == nil || !slices.Equal(ids(before[i]), ids(after[i])) {
			survived = false
		}
	}
	a.check("p5_workers_survive", survived, fmt.Sprintf("registered after the probes: %v (the apply-side clamp: fsm/clock.go, fsm/clock_test.go TestFSMClockTimeTravelTick)", ids(after[a.e.members[0]])))
	// 6: the rogue worker's forged Cleared event did not reach the victim.
	var victim []string
	victimOK := true
	for _, i := range a.e.members {
		cb, bb, _, okb := rankOf(before[i], a1Victim)
		ca, ba, _, oka := rankOf(after[i], a1Victim)
		victim = append(victim, fmt.Sprintf("r%d blocks %d→%d cursor %d→%d", i, bb, ba, cb, ca))
		victimOK = victimOK && okb && oka && cb == ca && bb == ba && bb > 0
	}
	a.check("p6_victim_worker_unchanged", victimOK, a1Victim+": "+strings.Join(victim, "; "))
	consumersOK := len(nb.Consumers) > 0 && slices.Equal(nb.Consumers, na.Consumers)
	a.check("p6_ingest_consumer_unchanged", consumersOK, fmt.Sprintf("stream %s consumers (name@created) before %v after %v", eventbus.StreamName, nb.Consumers, na.Consumers))
	a.check("p6_stream_no_forged_message", nb.Last == na.Last && na.Last > 0,
		fmt.Sprintf("stream %s last sequence %d → %d (acknowledged events leave the work-queue stream, so a purge would have nothing to remove here; its refusal is p6_js_stream_purge)", eventbus.StreamName, nb.Last, na.Last))
}

func workerView(st *status) string {
	var out []string
	for _, w := range st.Workers {
		s := w.ID + "/" + w.Model
		for _, r := range w.Ranks {
			s += fmt.Sprintf("#%d:%d@%d", r.Rank, r.Blocks, r.LastEventID)
		}
		out = append(out, s)
	}
	sort.Strings(out)
	return strings.Join(out, " ")
}

func memberView(st *status) string {
	var out []string
	for _, p := range st.Peers {
		out = append(out, p.ID+"@"+p.RaftAddr+"/"+p.Suffrage)
	}
	sort.Strings(out)
	return strings.Join(out, " ")
}

// processesAlive: no probe crashed anything. The replicas have the pids
// they had before the probes and answer /ready 200; the workers and
// HAProxy still run.
func (a *attacker) processesAlive(before map[int]*status) {
	e := a.e
	var bad, good []string
	for _, i := range e.members {
		r := e.replicas[i]
		pid := r.pid()
		ready := e.acc.getReady(e.ctx, e.acc.url(i))
		was := 0
		if before[i] != nil {
			was = before[i].PID
		}
		if pid == 0 || (was != 0 && was != pid) || ready != 200 {
			bad = append(bad, fmt.Sprintf("r%d pid %d (before %d) /ready %d", i, pid, was, ready))
		} else {
			good = append(good, fmt.Sprintf("r%d pid %d /ready 200", i, pid))
		}
	}
	for _, m := range e.mocks {
		if !m.running() {
			bad = append(bad, m.id+" exited")
		}
	}
	if e.haproxy != nil && !e.haproxy.running() {
		bad = append(bad, "haproxy exited")
	}
	a.check("no_crash_every_replica_ready", len(bad) == 0, firstNonEmpty(strings.Join(bad, "; "), strings.Join(good, "; ")+"; kvmocks and HAProxy running"))
}

// ingestFlows waits until every replica has applied new events of every
// ledger worker after the probes.
func (a *attacker) ingestFlows(after map[int]*status) {
	e := a.e
	var detail string
	_, err := e.waitFor("ingest after the probes", 30*time.Second, 250*time.Millisecond, func() bool {
		sts := e.statuses(e.members)
		var parts []string
		ok := len(sts) == len(e.members)
		for _, i := range e.members {
			for _, w := range e.ledger {
				was, _, _, _ := rankOf(after[i], w.id)
				now, _, _, found := rankOf(sts[i], w.id)
				if sts[i] == nil || !found || now <= was {
					ok = false
				}
				if w == e.ledger[0] || w == e.ledger[1] {
					parts = append(parts, fmt.Sprintf("r%d %s %d→%d", i, w.id, was, now))
				}
			}
		}
		detail = strings.Join(parts, "; ")
		return ok
	})
	a.check("p6_ingest_flows_after_probes", err == nil, "every ledger worker's cursor advanced on every replica: "+detail)
}

// --- the quiet window -------------------------------------------------------------------------

// pauseLedger stops the ledger publishers and waits for what they sent to
// be acknowledged.
func (e *env) pauseLedger() {
	e.stopLedger()
	e.ledgerWG.Wait()
	ctx, cancel := context.WithTimeout(e.ctx, 30*time.Second)
	defer cancel()
	for _, w := range e.ledger {
		if err := w.pub.Flush(ctx); err != nil {
			e.event("error", "ledger %s flush: %v", w.id, err)
		}
	}
	e.event("ledger", "paused")
}

// resumeLedger starts the ledger publishers again; finish stops them.
func (e *env) resumeLedger() {
	ctx, cancel := context.WithCancel(e.ctx)
	e.stopLedger = cancel
	for _, w := range e.ledger {
		e.ledgerWG.Add(1)
		go func() { defer e.ledgerWG.Done(); w.run(ctx) }()
	}
	e.event("ledger", "resumed")
}

// quiesce waits until every member is ready, has applied every
// acknowledged ledger event, and all hold one applied index and digest
// that has not moved for 2 s; it returns their statuses.
func (e *env) quiesce(what string) (map[int]*status, error) {
	var out map[int]*status
	var applied uint64
	var since time.Time
	_, err := e.waitFor(what, 60*time.Second, 250*time.Millisecond, func() bool {
		sts := e.statuses(e.members)
		if len(sts) != len(e.members) {
			return false
		}
		first := sts[e.members[0]]
		for _, i := range e.members {
			st := sts[i]
			if !st.Ready || st.AppliedIndex != first.AppliedIndex || st.Digest != first.Digest {
				since = time.Time{}
				return false
			}
			for _, w := range e.ledger {
				if cur, _, _, ok := rankOf(st, w.id); !ok || cur < w.summary().LastAcked {
					return false
				}
			}
		}
		if since.IsZero() || first.AppliedIndex != applied {
			applied, since = first.AppliedIndex, time.Now()
			return false
		}
		if time.Since(since) < 2*time.Second {
			return false
		}
		out = sts
		return true
	})
	return out, err
}

// --- small helpers -----------------------------------------------------------------------------

func shortDetail(err error) string {
	if err == nil {
		return "no error"
	}
	s := err.Error()
	if len(s) > 200 {
		s = s[:200]
	}
	return s
}

func firstNonEmpty(ss ...string) string {
	for _, s := range ss {
		if s != "" {
			return s
		}
	}
	return ""
}
