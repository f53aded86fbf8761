package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path"
	"slices"
	"strings"
	"time"
	"unicode"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/pki"
)

// Peer is one member of the expected initial voter set.
type Peer struct {
	ID       string `json:"id"`
	RaftAddr string `json:"raft_addr"`
}

// Config configures one Node. Zero durations and counts take the defaults
// documented on each field (see DefaultConfig).
type Config struct {
	// NodeID is this node's stable Raft server id. Required.
	NodeID string
	// RaftAddr is the TCP address the Raft transport binds, e.g. ":7000" or
	// "127.0.0.1:7000". Required.
	RaftAddr string
	// AdvertiseAddr is the Raft address other nodes dial. Empty: RaftAddr,
	// which must then name a concrete (not unspecified) IP.
	AdvertiseAddr string
	// DataDir holds raft.db (log + stable store) and snapshots/. Required.
	DataDir string
	// HTTPAddr is this node's advertised HTTP base address (forwarding target),
	// e.g. "http://10.0.0.1:8001" or "10.0.0.1:8001". Sent with join requests.
	HTTPAddr string

	// Peers is the expected initial voter set. Every node started with the
	// same Peers bootstraps the identical configuration, which is safe. A node
	// whose NodeID is not in Peers never bootstraps; it can only join.
	Peers []Peer
	// Join lists HTTP base URLs of existing replicas. On a first start (empty
	// data dir) the node asks them to add it as a voter before considering
	// Peers.
	Join []string
	// JoinAttempts is how many rounds over Join are tried before falling back
	// to bootstrapping from Peers (only when NodeID is in Peers). Without that
	// fallback the node retries until the Form context ends. Default 5 (with
	// backoff 0.1→1.6 s, about 3 s: longer than an election, so a restarted
	// empty member of a live cluster finds its leader rather than
	// bootstrapping — which would be safe, only slower).
	JoinAttempts int

	// LeaderHTTP maps a Raft server id to that node's HTTP base address; the
	// composition layer reads it from the FSM's node registry. Nil or "" for
	// an id: followers cannot forward and return ErrNoLeader.
	LeaderHTTP func(nodeID string) string
	// DecodeResult turns a forwarded FSM response (the JSON the leader
	// encoded) back into the caller's type. Nil: json.RawMessage.
	DecodeResult func(cmd []byte, result []byte) (any, error)
	// ResponseError extracts a domain error carried inside an FSM response
	// (e.g. fsm's *ApplyResult.Err). Nil: only responses that are themselves
	// errors count. A non-nil result turns into a *RejectedError from Apply.
	ResponseError func(resp any) error
	// ForwardErrors are sentinel errors the FSM returns as responses; when a
	// forwarded command is rejected with one of them the follower's error
	// still satisfies errors.Is(err, sentinel). Matching is by Error() text.
	ForwardErrors []error

	// TLS, when set, is this node's certificate, key and CA: the Raft
	// transport runs over mutual TLS and refuses, in the handshake, any peer
	// whose certificate does not name a member node; the /cluster/ endpoints
	// take a member's client certificate as their credential; every cluster
	// HTTP request this node sends goes over HTTPS presenting it. Its
	// identity must be pki.Node(NodeID), and the advertised Raft and HTTP
	// hosts must be in its SANs. Serve the HTTP port with HTTPServerTLS.
	// Nil: plain TCP and HTTP, AuthToken/Authorize only (tests, --insecure).
	// DESIGN.md "Transport security".
	TLS *pki.Bundle
	// AuthToken, when set, is sent on every forwarded or join request (the
	// replica's HTTP layer may still ask for it). Without TLS it is also
	// required as "Authorization: Bearer <token>" by the cluster HTTP
	// handler; with TLS the handler ignores it: a token an operator holds is
	// not a node's credential.
	AuthToken string
	// Authorize, when set, replaces the AuthToken check on incoming requests;
	// with TLS it runs after the peer-certificate check, which it cannot
	// relax.
	Authorize func(r *http.Request) error
	// StatusExtra adds fields to GET /cluster/status (e.g. workers,
	// index_blocks); its keys override the node's own.
	StatusExtra func() map[string]any
	// CheckCommand, when set, vets every command on the leader before it
	// enters the log — proposed here or forwarded through /cluster/apply —
	// with what only a live proposer knows (its clock: fsm.CheckEntryTime).
	// A refusal is a RejectedError; nothing is written.
	CheckCommand func(cmd []byte) error
	// CheckForwarded, when set, vets every command arriving through POST
	// /cluster/apply before anything else (then CheckCommand runs as for any
	// proposal). The composition layer accepts exactly the command types its
	// replicas forward with Apply — not, say, the leader-only ingest batch —
	// so a member's credential cannot smuggle other entries into the log. A
	// refusal answers 400 (code "forbidden_command"); nothing is written.
	CheckForwarded func(cmd []byte) error

	// SnapshotThreshold: take a snapshot when this many entries were
	// appended since the last one. Default 2048.
	SnapshotThreshold uint64
	// SnapshotInterval: how often the threshold is checked (jittered by
	// raft). Default 30s.
	SnapshotInterval time.Duration
	// TrailingLogs: entries kept after a snapshot so a slightly lagging
	// follower catches up from the log rather than a snapshot. Default 2048.
	TrailingLogs uint64
	// SnapshotRetain: snapshot files kept on disk. Default 2.
	SnapshotRetain int

	// HeartbeatTimeout: a follower without contact for this long starts an
	// election. Default 1s.
	HeartbeatTimeout time.Duration
	// ElectionTimeout: a candidate without a win for this long retries.
	// Default 1s.
	ElectionTimeout time.Duration
	// LeaderLeaseTimeout: a leader without contact from a quorum for this long
	// steps down (bounds how long an isolated leader accepts writes that
	// cannot commit). Must be <= HeartbeatTimeout. Default 500ms.
	LeaderLeaseTimeout time.Duration
	// CommitTimeout: an idle leader sends an AppendEntries at least this often
	// so followers learn the commit index quickly. Default 5ms.
	CommitTimeout time.Duration
	// ApplyTimeout bounds how long raft.Apply waits to enqueue an entry on
	// the leader (not the commit). Default 10s.
	ApplyTimeout time.Duration
	// TransportTimeout is the Raft RPC I/O deadline. Default 10s.
	TransportTimeout time.Duration
	// BarrierTimeout bounds the barrier a new leader runs before it reports
	// itself ready and starts WhileLeader functions. Default 30s.
	BarrierTimeout time.Duration
	// MaxAppendEntries caps entries per AppendEntries RPC. Default 64.
	MaxAppendEntries int

	// Dial, when set, is used for every outgoing Raft connection and HTTP
	// request (forwarding, joins). The test harness uses it to cut links.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)

	// Logger is this node's logger; Raft's hclog output is adapted into it.
	// Nil: slog.Default().
	Logger *slog.Logger
	// Registry receives this node's metrics; they are unregistered on
	// Shutdown. Nil: a private registry (metrics are not exported).
	Registry prometheus.Registerer

	// PathPrefix is the path under which Handler serves this node's
	// endpoints (PathPrefix+"/join", "/remove", "/apply", "/status",
	// "/commit") and under which it calls its peers' (forwarding, joins,
	// commit-index reads). Several Raft groups in one process share one
	// HTTP server by giving each its own prefix: group k uses
	// "/cluster/g<k>". Every member of a group must use the same prefix.
	// It starts with "/", has no trailing "/" and no spaces. Default
	// "/cluster".
	PathPrefix string
	// Group names this node's Raft group when a process runs several
	// (DESIGN.md "Several groups in one process"). Set: every metric the
	// node registers carries the constant label group="<Group>", so the
	// groups share one registry, and the logger gets attribute "group".
	// Empty (one group per process): metrics exactly as without groups.
	Group string
}

// DefaultPathPrefix is Config.PathPrefix when unset: the single group's
// endpoints, as they always were.
const DefaultPathPrefix = "/cluster"

// DefaultConfig returns the defaults, suited both to one machine and to a
// real network:
//
//   - HeartbeatTimeout 1s, ElectionTimeout 1s, LeaderLeaseTimeout 500ms are
//     hashicorp/raft's own defaults: measured here (DESIGN.md §7) they give a
//     new leader 1.5–2.7 s after a leader dies, and they leave headroom for
//     fsync stalls and GC pauses on a loaded host or a cross-zone network
//     (shorter values cause needless elections there). The lease is half the
//     heartbeat timeout so an isolated leader stops within about a second,
//     before the majority has elected a successor.
//   - CommitTimeout 5ms (raft's default is 50ms): followers learn the commit
//     index within ~5 ms of an idle leader committing, which is the replica
//     staleness routing sees; on one machine or a LAN it costs little.
//   - SnapshotThreshold / TrailingLogs 2048 and SnapshotInterval 30s instead
//     of raft's 8192/10240/120s: ingest entries are large batches (~60 KiB),
//     so raft's defaults would keep ~600 MiB of log.
func DefaultConfig() Config {
	return Config{
		JoinAttempts:       5,
		SnapshotThreshold:  2048,
		SnapshotInterval:   30 * time.Second,
		TrailingLogs:       2048,
		SnapshotRetain:     2,
		HeartbeatTimeout:   time.Second,
		ElectionTimeout:    time.Second,
		LeaderLeaseTimeout: 500 * time.Millisecond,
		CommitTimeout:      5 * time.Millisecond,
		ApplyTimeout:       10 * time.Second,
		TransportTimeout:   10 * time.Second,
		BarrierTimeout:     30 * time.Second,
		MaxAppendEntries:   64,
	}
}

// withDefaults fills zero fields from DefaultConfig and validates.
func (c Config) withDefaults() (Config, error) {
	d := DefaultConfig()
	setDur := func(v *time.Duration, def time.Duration) {
		if *v <= 0 {
			*v = def
		}
	}
	if c.JoinAttempts <= 0 {
		c.JoinAttempts = d.JoinAttempts
	}
	if c.SnapshotThreshold == 0 {
		c.SnapshotThreshold = d.SnapshotThreshold
	}
	if c.TrailingLogs == 0 {
		c.TrailingLogs = d.TrailingLogs
	}
	if c.SnapshotRetain <= 0 {
		c.SnapshotRetain = d.SnapshotRetain
	}
	if c.MaxAppendEntries <= 0 {
		c.MaxAppendEntries = d.MaxAppendEntries
	}
	setDur(&c.SnapshotInterval, d.SnapshotInterval)
	setDur(&c.HeartbeatTimeout, d.HeartbeatTimeout)
	setDur(&c.ElectionTimeout, d.ElectionTimeout)
	setDur(&c.LeaderLeaseTimeout, d.LeaderLeaseTimeout)
	setDur(&c.CommitTimeout, d.CommitTimeout)
	setDur(&c.ApplyTimeout, d.ApplyTimeout)
	setDur(&c.TransportTimeout, d.TransportTimeout)
	setDur(&c.BarrierTimeout, d.BarrierTimeout)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.AdvertiseAddr == "" {
		c.AdvertiseAddr = c.RaftAddr
	}
	if c.PathPrefix == "" {
		c.PathPrefix = DefaultPathPrefix
	}
	c.Peers = slices.Clone(c.Peers)
	c.Join = slices.Clone(c.Join)

	var errs []error
	if c.NodeID == "" {
		errs = append(errs, errors.New("NodeID is required"))
	}
	if c.RaftAddr == "" {
		errs = append(errs, errors.New("RaftAddr is required"))
	}
	if c.DataDir == "" {
		errs = append(errs, errors.New("DataDir is required"))
	}
	if c.TLS != nil && c.NodeID != "" && c.TLS.Identity() != pki.Node(c.NodeID) {
		errs = append(errs, fmt.Errorf("TLS certificate names %s, but this node is %s", c.TLS.Identity(), pki.Node(c.NodeID)))
	}
	if err := checkPathPrefix(c.PathPrefix); err != nil {
		errs = append(errs, err)
	}
	if c.LeaderLeaseTimeout > c.HeartbeatTimeout {
		errs = append(errs, fmt.Errorf("LeaderLeaseTimeout %v exceeds HeartbeatTimeout %v", c.LeaderLeaseTimeout, c.HeartbeatTimeout))
	}
	seen := map[string]bool{}
	for _, p := range c.Peers {
		if p.ID == "" || p.RaftAddr == "" {
			errs = append(errs, fmt.Errorf("peer %+v: id and raft_addr are required", p))
		}
		if p.ID == c.NodeID && c.AdvertiseAddr != "" && p.RaftAddr != c.AdvertiseAddr {
			errs = append(errs, fmt.Errorf("peer %q has raft_addr %s but this node advertises %s", p.ID, p.RaftAddr, c.AdvertiseAddr))
		}
		if seen[p.ID] {
			errs = append(errs, fmt.Errorf("peer id %q listed twice", p.ID))
		}
		seen[p.ID] = true
	}
	if c.RaftAddr != "" {
		if err := checkAdvertise(c.AdvertiseAddr); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return c, fmt.Errorf("cluster config: %w", err)
	}
	return c, nil
}

// checkAdvertise rejects addresses other nodes could not dial.
func checkAdvertise(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("advertise address %q: %w", addr, err)
	}
	if port == "" || port == "0" {
		return fmt.Errorf("advertise address %q: needs a fixed port", addr)
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		return fmt.Errorf("advertise address %q is not dialable; set AdvertiseAddr", addr)
	}
	return nil
}

// checkPathPrefix accepts a clean absolute path without a trailing slash
// and without the characters http.ServeMux patterns or URLs give a meaning
// ({} wildcards, ? query, # fragment, % escapes) — the prefix is pasted
// into both.
func checkPathPrefix(p string) error {
	switch {
	case !strings.HasPrefix(p, "/"):
		return fmt.Errorf("path prefix %q must start with /", p)
	case strings.HasSuffix(p, "/"):
		return fmt.Errorf("path prefix %q must not end with /", p)
	case strings.ContainsFunc(p, unicode.IsSpace):
		return fmt.Errorf("path prefix %q contains a space", p)
	case strings.ContainsAny(p, "{}?#%"):
		return fmt.Errorf("path prefix %q contains one of {}?#%%", p)
	case path.Clean(p) != p:
		return fmt.Errorf("path prefix %q is not a clean path (want %q)", p, path.Clean(p))
	}
	return nil
}

// nodeLogger is Logger with this node's attributes: its id, and its group
// when set (the nodes of several groups share a process and a NodeID, so
// only the group tells their lines apart).
func (c *Config) nodeLogger() *slog.Logger {
	l := c.Logger.With("node", c.NodeID)
	if c.Group != "" {
		l = l.With("group", c.Group)
	}
	return l
}

// selfInPeers reports whether this node belongs to the expected initial set.
func (c *Config) selfInPeers() bool {
	return slices.ContainsFunc(c.Peers, func(p Peer) bool { return p.ID == c.NodeID })
}
