package replica

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/internal/pki"
)

// loadBundle loads this replica's TLS material once, for Raft, the bus and
// HTTPS alike, and checks that the certificate is this node's: a replica
// started with another node's files would otherwise be refused by every
// peer with a message naming the peer, not the mistake. Nil when insecure.
func loadBundle(cfg Config) (*pki.Bundle, error) {
	if cfg.Insecure {
		return nil, nil
	}
	b, err := pki.LoadBundle(cfg.TLS)
	if err != nil {
		return nil, fmt.Errorf("TLS material: %w", err)
	}
	if want := pki.Node(cfg.NodeID); b.Identity() != want {
		return nil, fmt.Errorf("TLS material: %s names %s, but this replica is %s (kvrouter certs issues one per node)",
			cfg.TLS.CertFile, b.Identity(), want)
	}
	return b, nil
}

// forwardedTypes are the command types a replica forwards to the leader
// through /cluster/apply (replica.propose → cluster.Node.Apply on a
// follower). Who proposes each:
//   - RegisterWorker (1; 10 when it carries a role; 11 when its block size
//     is not the cluster default), DeregisterWorker (2),
//     SetModelConfig (4): the admin API, on whichever replica took the
//     request; RegisterWorker also registerStatic (--workers).
//   - Predictions (5): the kv-approx batcher, on every replica.
//   - RegisterNode (7): registerSelf, on every replica at start.
//   - ResyncWorker (8): the leader's resync, through propose; it arrives
//     forwarded when leadership moved between its decision and its write.
//   - PlaceWorker (13): a worker's first registration with --raft-groups
//     > 1, on whichever replica took it, to the control group's leader;
//     also POST /workers/move and /workers/rebalance.
//   - SetGroups (14; 15 with the replicas it checked, what this build
//     proposes): POST /cluster/raft_groups, on any replica.
//   - SetWorkerDrain (16): POST /workers/drain and /workers/undrain, on
//     whichever replica took the request, to the worker's owner group's
//     leader; its completion (Deregister) from that leader's watchDrains,
//     forwarded when leadership moved between its decision and its write.
//   - BindSession (17), UnbindSessions (18), BindSessionStages (21):
//     session affinity (21: a two-stage model's binding), on the
//     replica that took a session's turn (sessions.go), to the control
//     group's leader.
//   - PinPrefix (19): prefix pins, pins, refreshes and moves, on the
//     replica that routed the request (pins.go), to the control group's
//     leader; UnpinPrefix (20): DELETE /pins on any replica, likewise.
//
// Not forwarded, so refused: KVEventBatch (3) — the leader's ingest writes
// it locally (ApplyLocal), never through /cluster/apply; Tick (6) — only a
// leader stamps its clock into the log (a forwarded Tick is a leader that
// lost leadership mid-proposal, and the next leader ticks anyway);
// RemoveNode (9) — no replica code proposes it today (membership changes go
// through /cluster/remove, which the cluster package handles); and every
// type this build does not know.
var forwardedTypes = []fsm.CommandType{
	fsm.CmdRegisterWorker, fsm.CmdRegisterWorkerRole, fsm.CmdRegisterWorkerBlockSize, fsm.CmdDeregisterWorker, fsm.CmdSetModelConfig,
	fsm.CmdPredictions, fsm.CmdRegisterNode, fsm.CmdResyncWorker, fsm.CmdPlaceWorker, fsm.CmdSetGroups,
	fsm.CmdSetGroupsChecked, fsm.CmdSetWorkerDrain, fsm.CmdBindSession, fsm.CmdUnbindSessions, fsm.CmdPinPrefix,
	fsm.CmdUnpinPrefix, fsm.CmdBindSessionStages,
}

// errForbiddenCommand is wrapped by every refusal of checkForwarded.
var errForbiddenCommand = errors.New("command type not forwarded by replicas")

// checkForwarded is cluster.Config.CheckForwarded: a member's certificate
// lets it forward the writes replicas forward, nothing else — not the
// ingest batch, not a Tick, not bytes that do not decode (which the FSM
// would treat as a programming error). The leader's CheckCommand (clock
// bounds) still runs after.
func checkForwarded(cmd []byte) error {
	if len(cmd) == 0 {
		return fmt.Errorf("empty command: %w", errForbiddenCommand)
	}
	t := fsm.CommandType(cmd[0] &^ fsm.IgnoreIfUnknown)
	if !slices.Contains(forwardedTypes, t) {
		return fmt.Errorf("type %d (%s): %w", uint8(t), t, errForbiddenCommand)
	}
	if _, err := fsm.Decode(cmd); err != nil {
		return fmt.Errorf("type %s: %w", t, err)
	}
	return nil
}

// membership answers the bus's IsMember from the Raft configuration. The
// bus opens before the Raft node exists (the node's FSM needs nothing from
// it, but the replica does), so until the node is set the bootstrap set
// (--peers) and this node count, as the Raft port's own gate does
// (cluster/DESIGN.md, "The identity rule"); a joining node's peers are
// refused until its join lands, and their routes retry.
type membership struct {
	self      string
	bootstrap []string
	node      atomic.Pointer[cluster.Node]
}

func newMembership(cfg Config) *membership {
	m := &membership{self: cfg.NodeID}
	for _, p := range cfg.Peers {
		m.bootstrap = append(m.bootstrap, p.ID)
	}
	return m
}

// isMember is eventbus.Security.IsMember. cluster exports no membership
// query, so it reads Status().Peers — raft's latest configuration, the
// source the Raft port's gate reads — once per node connection to the bus
// (routes and replicas' own clients: a handful per replica, not per
// message).
func (m *membership) isMember(id string) bool {
	if id == m.self {
		return true
	}
	n := m.node.Load()
	if n == nil {
		return slices.Contains(m.bootstrap, id)
	}
	peers := n.StatusWithoutDigest().Peers
	if len(peers) == 0 { // no configuration yet (joining): the bootstrap set
		return slices.Contains(m.bootstrap, id)
	}
	return slices.ContainsFunc(peers, func(p cluster.PeerStatus) bool { return p.ID == id })
}

// peerClient is the HTTP client a replica uses for its peers' HTTPS
// ports (tokenizer agreement, the in-replica bridge registering with this
// replica): it presents the node certificate and accepts only a node of
// the cluster's CA at the host dialled. Without TLS, a plain client.
func peerClient(b *pki.Bundle, timeout time.Duration) *http.Client {
	c := &http.Client{Timeout: timeout}
	if b != nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.TLSClientConfig = b.ClientTLS(pki.AllowRoles(pki.RoleNode))
		c.Transport = t
	}
	return c
}

// apiClientCheck is api.Config.ClientCert: nil (no check) unless
// --api-client-certs.
func apiClientCheck(cfg Config) func(*http.Request) error {
	if !cfg.APIClientCerts {
		return nil
	}
	return requireAPIClient
}

// requireAPIClient accepts a request whose connection presented a verified
// certificate of the cluster's CA naming an API client. A node's or a
// worker's certificate is refused: each credential is good for its role
// only. Plaintext (loopback) connections carry none and are refused.
func requireAPIClient(r *http.Request) error {
	if r.TLS == nil {
		return errors.New("not a TLS connection")
	}
	id, err := pki.PeerIdentity(*r.TLS)
	if err != nil {
		return err
	}
	if id.Role != pki.RoleClient {
		return fmt.Errorf("%s is not an API client certificate", id)
	}
	return nil
}

// clusterPaths are the cluster package's endpoints a replica serves. With
// TLS they bypass the API's admin-token group: the credential is the
// caller's member certificate (cluster.Handler checks it), not a token an
// operator holds. /cluster/status stays the API's (the contract's document,
// open unless --protect-status).
var clusterPaths = []string{"/cluster/join", "/cluster/remove", "/cluster/apply", "/cluster/commit"}

// withClusterEndpoints routes clusterPaths to cluster and everything else
// to api.
func withClusterEndpoints(api, cluster http.Handler, groups int) http.Handler {
	mux := http.NewServeMux()
	for _, p := range clusterPaths {
		mux.Handle(p, cluster)
		for g := 1; g <= groups; g++ {
			// data group g's: /cluster/g<g>/join, …
			mux.Handle(groupPathPrefix(g)+strings.TrimPrefix(p, "/cluster"), cluster)
		}
	}
	mux.Handle("/", api)
	return mux
}

// listenHTTP opens the replica's HTTP port: plaintext without TLS
// material; with it HTTPS (client certificates requested, not required:
// OpenAI clients have none, /cluster/* demands a member's), plus plaintext
// on the same port when cfg.AllowPlainHTTP (loopback by default; see
// sniffListener).
func listenHTTP(cfg Config, bundle *pki.Bundle) (net.Listener, error) {
	ln, err := net.Listen("tcp", cfg.HTTPAddr)
	if err != nil {
		return nil, fmt.Errorf("http listen: %w", err)
	}
	if bundle == nil {
		return ln, nil
	}
	return newSniffListener(ln, cluster.HTTPServerTLS(bundle), cfg.AllowPlainHTTP, firstByteTimeout), nil
}

// workerTLS is the proxy's TLS configuration for https:// workers: the CAs
// of --worker-tls-ca instead of the system roots (nil without the flag:
// Go's default, the system roots). The tokenizer self-check and LoRA
// discovery reach workers through the same transport.
func workerTLS(cfg Config) (*tls.Config, error) {
	if cfg.WorkerTLSCA == "" {
		return nil, nil
	}
	pool, err := pki.LoadPool(cfg.WorkerTLSCA)
	if err != nil {
		return nil, fmt.Errorf("--worker-tls-ca: %w", err)
	}
	return &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}, nil
}
