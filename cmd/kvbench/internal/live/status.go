// Package live holds what kvbench's real-time subcommands (ingest, load)
// share: a small client for a replica's HTTP endpoints (cluster status,
// worker registration), replica discovery, the visibility tracker of
// ingest, and a streaming OpenAI client that times requests.
package live

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// Status is the part of GET /cluster/status kvbench reads.
type Status struct {
	NodeID       string   `json:"node_id"`
	State        string   `json:"state"`
	LeaderID     string   `json:"leader_id"`
	RaftAddr     string   `json:"raft_addr"`
	HTTP         string   `json:"http"`
	NATSURL      string   `json:"nats_url"`
	Models       []string `json:"models"`
	Peers        []Peer   `json:"peers"`
	Workers      []Worker `json:"workers"`
	IndexBlocks  int      `json:"index_blocks"`
	AppliedIndex uint64   `json:"applied_index"`
	CommitIndex  uint64   `json:"commit_index"`
	Digest       string   `json:"digest"`
	FSM          FSMStats `json:"fsm"`
	// Nodes is the replicated node registry, when a replica publishes it
	// (not in every version): the peers' HTTP addresses.
	Nodes []Node `json:"nodes"`
}

// Peer is one Raft voter.
type Peer struct {
	ID       string `json:"id"`
	RaftAddr string `json:"raft_addr"`
	Leader   bool   `json:"leader"`
}

// Node is a replica of the node registry.
type Node struct {
	ID       string `json:"id"`
	RaftAddr string `json:"raft_addr"`
	HTTP     string `json:"http"`
	HTTPAddr string `json:"http_addr"`
}

// Worker is a registered worker with its ranks' cursors.
type Worker struct {
	ID        string `json:"id"`
	URL       string `json:"url"`
	Model     string `json:"model"`
	BlockSize int    `json:"block_size"`
	Ranks     []Rank `json:"ranks"`
}

// Rank is one data-parallel rank of a worker.
type Rank struct {
	Rank        uint32 `json:"rank"`
	Blocks      int    `json:"blocks"`
	LastEventID uint64 `json:"last_event_id"`
	Stale       string `json:"stale"`
}

// FSMStats are the state machine's cumulative counters.
type FSMStats struct {
	Commands   uint64            `json:"Commands"`
	Events     uint64            `json:"Events"`
	Applied    uint64            `json:"Applied"`
	Duplicates uint64            `json:"Duplicates"`
	Gaps       uint64            `json:"Gaps"`
	Rejected   map[string]uint64 `json:"Rejected"`
}

// Rejections sums the rejected events over reasons.
func (s FSMStats) Rejections() uint64 {
	var n uint64
	for _, v := range s.Rejected {
		n += v
	}
	return n
}

// Worker returns the worker with id, if registered.
func (s *Status) Worker(id string) (Worker, bool) {
	for _, w := range s.Workers {
		if w.ID == id {
			return w, true
		}
	}
	return Worker{}, false
}

// Client talks to replicas.
type Client struct {
	HTTP       *http.Client
	AdminToken string // bearer token of the admin endpoints, if any
}

// NewClient returns a client with a connection pool sized for polling a few
// replicas.
func NewClient(adminToken string) *Client {
	tr := &http.Transport{
		Proxy:               nil, // localhost benchmarks: never through a proxy
		DialContext:         (&net.Dialer{Timeout: 2 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        64,
		MaxIdleConnsPerHost: 16,
		IdleConnTimeout:     90 * time.Second,
	}
	return &Client{HTTP: &http.Client{Transport: tr}, AdminToken: adminToken}
}

// HTTPError is a non-2xx answer.
type HTTPError struct {
	URL    string
	Status int
	Body   string
}

func (e *HTTPError) Error() string {
	return fmt.Sprintf("%s: HTTP %d: %s", e.URL, e.Status, strings.TrimSpace(e.Body))
}

func (c *Client) do(ctx context.Context, method, u string, body any, out any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.AdminToken != "" {
		req.Header.Set("Authorization", "Bearer "+c.AdminToken)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return &HTTPError{URL: u, Status: resp.StatusCode, Body: string(b)}
	}
	if out == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		return nil
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

// Status fetches base's /cluster/status without the digest (cheap to poll);
// StatusWithDigest includes it.
func (c *Client) Status(ctx context.Context, base string) (*Status, error) {
	return c.status(ctx, base, "?digest=0")
}

// Cursors fetches base's /cluster/status?view=cursors: node id, Raft state,
// leader and every worker rank's cursor and blocks, without the rest of the
// document, which costs the replica about a millisecond of CPU per call
// (kvbench ingest polls every replica every few milliseconds, and measures
// the replicas' CPU). A replica that does not know the view answers the
// whole document (without the digest), which holds the same fields.
func (c *Client) Cursors(ctx context.Context, base string) (*Status, error) {
	return c.status(ctx, base, "?digest=0&view=cursors")
}

// StatusWithDigest fetches base's /cluster/status with the state digest.
func (c *Client) StatusWithDigest(ctx context.Context, base string) (*Status, error) {
	return c.status(ctx, base, "")
}

func (c *Client) status(ctx context.Context, base, query string) (*Status, error) {
	var st Status
	if err := c.do(ctx, http.MethodGet, BaseURL(base)+"/cluster/status"+query, nil, &st); err != nil {
		return nil, err
	}
	return &st, nil
}

// WorkerSpec is the body of POST /workers/register.
type WorkerSpec struct {
	ID               string `json:"id"`
	URL              string `json:"url"`
	Model            string `json:"model"`
	BlockSize        int    `json:"block_size"`
	TotalBlocks      int    `json:"total_kv_blocks"`
	MaxBatchedTokens int    `json:"max_num_batched_tokens"`
}

// Register registers a worker through base (the replica forwards to the
// leader).
func (c *Client) Register(ctx context.Context, base string, w WorkerSpec) error {
	return c.do(ctx, http.MethodPost, BaseURL(base)+"/workers/register", w, nil)
}

// Deregister removes a worker through base.
func (c *Client) Deregister(ctx context.Context, base, id string) error {
	return c.do(ctx, http.MethodPost, BaseURL(base)+"/workers/deregister", map[string]string{"id": id}, nil)
}

// BaseURL trims trailing slashes.
func BaseURL(u string) string { return strings.TrimRight(u, "/") }

// ParseLocalURL checks that u is an http(s) URL of this machine (kvbench
// only drives local clusters) and returns it without a trailing slash.
func ParseLocalURL(u string) (string, error) {
	p, err := url.Parse(u)
	if err != nil || (p.Scheme != "http" && p.Scheme != "https") || p.Host == "" {
		return "", fmt.Errorf("%q is not an http URL", u)
	}
	if !IsLocalHost(p.Hostname()) {
		return "", fmt.Errorf("%q is not a localhost URL (kvbench drives local clusters only)", u)
	}
	if p.Path != "" && p.Path != "/" {
		return "", fmt.Errorf("%q: give the base URL, without a path", u)
	}
	return BaseURL(p.Scheme + "://" + p.Host), nil
}

// IsLocalHost reports whether host names this machine.
func IsLocalHost(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// Discovery is what kvbench learned about the cluster behind a target.
type Discovery struct {
	Target   *Status
	Replicas []string // HTTP base URLs, the target first
	// Unresolved are peers whose HTTP address could not be found.
	Unresolved []string
	How        string // how the replicas were found
}

// Discover finds every replica's HTTP address from the target's status:
// the node registry when the status has one; otherwise it assumes the
// peers use the target's offset between Raft and HTTP ports (as the local
// cluster does: Raft :7001-7003, HTTP :8001-8003) and keeps each guess only
// if that address answers /cluster/status with the peer's node id.
func (c *Client) Discover(ctx context.Context, target string) (*Discovery, error) {
	st, err := c.Status(ctx, target)
	if err != nil {
		return nil, err
	}
	d := &Discovery{Target: st, Replicas: []string{BaseURL(target)}}
	found := map[string]bool{st.NodeID: true}
	if len(st.Nodes) > 0 {
		d.How = "node registry in /cluster/status"
		for _, n := range st.Nodes {
			h := n.HTTP
			if h == "" {
				h = n.HTTPAddr
			}
			if found[n.ID] || h == "" {
				continue
			}
			if !strings.Contains(h, "://") {
				h = "http://" + h
			}
			// The registry names https:// addresses when the replicas
			// serve TLS, but `make run`'s loopback ports answer plain
			// http:// too, and kvbench may not trust the cluster's CA:
			// a target reached over http:// says the peers are, first.
			tries := []string{h}
			if rest, ok := strings.CutPrefix(h, "https://"); ok && strings.HasPrefix(target, "http://") {
				tries = []string{"http://" + rest, h}
			}
			for _, h := range tries {
				if ps, err := c.Status(ctx, h); err == nil && ps.NodeID == n.ID {
					d.Replicas = append(d.Replicas, BaseURL(h))
					found[n.ID] = true
					break
				}
			}
		}
	} else {
		d.How = "peers' Raft ports shifted by the target's HTTP−Raft port offset, each confirmed by its node id"
		off, ok := portOffset(st.HTTP, st.RaftAddr)
		if !ok {
			off, ok = portOffset(target, st.RaftAddr)
		}
		for _, p := range st.Peers {
			if found[p.ID] || !ok {
				continue
			}
			host, port, err := net.SplitHostPort(p.RaftAddr)
			if err != nil {
				continue
			}
			n, err := strconv.Atoi(port)
			if err != nil || n+off <= 0 || n+off > 65535 {
				continue
			}
			guess := "http://" + net.JoinHostPort(host, strconv.Itoa(n+off))
			if ps, err := c.Status(ctx, guess); err == nil && ps.NodeID == p.ID {
				d.Replicas = append(d.Replicas, guess)
				found[p.ID] = true
			}
		}
	}
	for _, p := range st.Peers {
		if !found[p.ID] {
			d.Unresolved = append(d.Unresolved, p.ID)
		}
	}
	return d, nil
}

// portOffset is httpPort − raftPort.
func portOffset(httpURL, raftAddr string) (int, bool) {
	hu := httpURL
	if !strings.Contains(hu, "://") {
		hu = "http://" + hu
	}
	p, err := url.Parse(hu)
	if err != nil || p.Port() == "" {
		return 0, false
	}
	hp, err := strconv.Atoi(p.Port())
	if err != nil {
		return 0, false
	}
	_, rps, err := net.SplitHostPort(raftAddr)
	if err != nil {
		return 0, false
	}
	rp, err := strconv.Atoi(rps)
	if err != nil {
		return 0, false
	}
	return hp - rp, true
}

// ErrNotVisible: the events did not become visible in time.
var ErrNotVisible = errors.New("not visible on every replica")
