package cluster

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/internal/pki"
)

// Wire format of the internal endpoints (all under Config.PathPrefix).
const (
	// headerForwardedBy marks a request a follower forwarded; a non-leader
	// receiving one answers 503 instead of forwarding again (no loops).
	headerForwardedBy = "X-Kvrouter-Forwarded-By"
	maxCommandBytes   = 64 << 20
	// defaultForwardTimeout bounds a forwarded request whose ctx has no deadline.
	defaultForwardTimeout = 30 * time.Second
)

// Envelope codes (applyEnvelope.Code, adminResponse.Code).
const (
	codeRejected       = "rejected"        // committed; the FSM returned a domain error
	codeNoLeader       = "no_leader"       // not applied
	codeOutcomeUnknown = "outcome_unknown" // may still commit
	codeShutdown       = "shutdown"        // node shutting down
	codeUnencodable    = "unencodable"     // committed; the response is not JSON-encodable
	codeBadRequest     = "bad_request"
	codeUnauthorized   = "unauthorized"      // no credential (401)
	codeForbidden      = "forbidden"         // a credential that may not do this (403)
	codeForbiddenCmd   = "forbidden_command" // /cluster/apply: not a type replicas forward (400)
	codeUnverified     = "unverified_peer"   // join: raft_addr does not answer as the node claimed (400)
	codeFailed         = "failed"
)

// applyEnvelope is the body of a POST /cluster/apply response.
type applyEnvelope struct {
	Result   json.RawMessage `json:"result,omitempty"`
	Error    string          `json:"error,omitempty"`
	Code     string          `json:"code,omitempty"`
	Sentinel string          `json:"sentinel,omitempty"` // Error() of the matched Config.ForwardErrors entry
}

type joinRequest struct {
	NodeID   string `json:"node_id"`
	RaftAddr string `json:"raft_addr"`
	HTTPAddr string `json:"http_addr,omitempty"`
}

type removeRequest struct {
	NodeID string `json:"node_id"`
}

type adminResponse struct {
	OK    bool   `json:"ok"`
	Error string `json:"error,omitempty"`
	Code  string `json:"code,omitempty"`
	// Members are the node ids of the leader's configuration after a join:
	// the joining node, which has no configuration yet, accepts Raft
	// connections from them until the leader's first entries arrive.
	Members []string `json:"members,omitempty"`
}

// Handler serves the cluster endpoints under Config.PathPrefix (P below,
// default /cluster); mount it so it sees paths starting with P+"/":
//
//	POST P/join    {"node_id","raft_addr"[,"http_addr"]} → add voter (idempotent)
//	POST P/remove  {"node_id"}                           → remove server
//	POST P/apply   raw command bytes → {"result"} | {"error","code"[,"sentinel"]}
//	GET  P/status  Status (+ Config.StatusExtra fields)
//	GET  P/commit  {"commit_index","term"}; leader only (after its barrier), else 503
//
// The POSTs are executed by the leader; a follower forwards them once to the
// leader (at the same P) and a forwarded request reaching a non-leader gets
// 503.
//
// With Config.TLS the credential is the caller's verified client
// certificate (serve the port with HTTPServerTLS): it must name a member
// node, or for P/join the joining node itself (DESIGN.md
// "Transport security"). Without TLS: AuthToken / Authorize.
func (n *Node) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+n.path(epJoin), n.handleJoin)
	mux.HandleFunc("POST "+n.path(epRemove), n.handleRemove)
	mux.HandleFunc("POST "+n.path(epApply), n.handleApply)
	mux.HandleFunc("GET "+n.path(epStatus), n.handleStatus)
	mux.HandleFunc("GET "+n.path(epCommit), n.handleCommit)
	return n.authorize(mux)
}

// The endpoints, relative to Config.PathPrefix.
const (
	epJoin   = "/join"
	epRemove = "/remove"
	epApply  = "/apply"
	epStatus = "/status"
	epCommit = "/commit"
)

// path is endpoint ep of this node's group: the path Handler serves it at
// and the path this node calls on its peers (every member of a group uses
// the same prefix).
func (n *Node) path(ep string) string { return n.cfg.PathPrefix + ep }

// PathPrefix returns Config.PathPrefix (defaulted): mount Handler there.
func (n *Node) PathPrefix() string { return n.cfg.PathPrefix }

func (n *Node) authorize(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if status, code, err := n.checkRequest(r); err != nil {
			writeJSON(w, status, adminResponse{Error: err.Error(), Code: code})
			return
		}
		next.ServeHTTP(w, r)
	})
}

// CheckRequest applies the cluster endpoints' credential check to r, for an
// endpoint under /cluster/ served elsewhere (the API's
// /cluster/raft_groups): with TLS the caller's verified certificate must
// name a member node (and Config.Authorize accept it), without TLS
// Config.Authorize or the bearer AuthToken. It returns the refusal's HTTP
// status and error; a refusal over TLS is logged and counted as one of
// Handler's.
func (n *Node) CheckRequest(r *http.Request) (status int, err error) {
	status, _, err = n.checkRequest(r)
	return status, err
}

func (n *Node) checkRequest(r *http.Request) (status int, code string, err error) {
	if n.cfg.TLS != nil {
		status, code, err := n.checkPeer(r)
		if err == nil && n.cfg.Authorize != nil {
			status, code, err = http.StatusUnauthorized, codeUnauthorized, n.cfg.Authorize(r)
		}
		if err != nil {
			n.refusedHTTP.Add(1)
			n.log.Warn("refused cluster request", "path", r.URL.Path, "remote", r.RemoteAddr, "err", err)
		}
		return status, code, err
	}
	switch {
	case n.cfg.Authorize != nil:
		err = n.cfg.Authorize(r)
	case n.cfg.AuthToken != "":
		want := "Bearer " + n.cfg.AuthToken
		if subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), []byte(want)) != 1 {
			err = errors.New("missing or wrong bearer token")
		}
	}
	if err != nil {
		return http.StatusUnauthorized, codeUnauthorized, err
	}
	return 0, "", nil
}

// checkPeer is the TLS credential check: a verified client certificate
// naming a node, a member for every endpoint but the join (whose caller is
// not a member yet; handleJoin checks it is the joining node).
func (n *Node) checkPeer(r *http.Request) (status int, code string, err error) {
	id, err := requestIdentity(r)
	if err != nil {
		return http.StatusUnauthorized, codeUnauthorized, fmt.Errorf("cluster endpoints need a node's client certificate: %w", err)
	}
	allow := n.gate.members()
	if r.URL.Path == n.path(epJoin) {
		allow = pki.AllowRoles(pki.RoleNode)
	}
	if err := allow(id); err != nil {
		return http.StatusForbidden, codeForbidden, err
	}
	return 0, "", nil
}

// requestIdentity is the identity named by the request's verified client
// certificate.
func requestIdentity(r *http.Request) (pki.Identity, error) {
	if r.TLS == nil {
		return pki.Identity{}, errors.New("not a TLS connection")
	}
	if len(r.TLS.PeerCertificates) == 0 {
		return pki.Identity{}, errors.New("no client certificate")
	}
	return pki.PeerIdentity(*r.TLS)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func (n *Node) handleStatus(w http.ResponseWriter, r *http.Request) {
	st := n.Status()
	if n.cfg.StatusExtra == nil {
		writeJSON(w, http.StatusOK, st)
		return
	}
	raw, _ := json.Marshal(st)
	out := map[string]any{}
	_ = json.Unmarshal(raw, &out)
	for k, v := range n.cfg.StatusExtra() {
		out[k] = v
	}
	writeJSON(w, http.StatusOK, out)
}

type commitResponse struct {
	CommitIndex uint64 `json:"commit_index"`
	Term        uint64 `json:"term"`
}

// handleCommit tells followers the leader's commit index (readiness target).
func (n *Node) handleCommit(w http.ResponseWriter, r *http.Request) {
	if !n.leaderReadyTermIsCurrent() {
		writeJSON(w, http.StatusServiceUnavailable, adminResponse{Error: n.cfg.NodeID + " is not a ready leader", Code: codeNoLeader})
		return
	}
	// A deposed leader that has not noticed yet must not hand out its commit
	// index as current: confirm leadership with a quorum first.
	if err := n.raft.VerifyLeader().Error(); err != nil {
		writeJSON(w, http.StatusServiceUnavailable, adminResponse{Error: n.cfg.NodeID + " could not confirm leadership: " + err.Error(), Code: codeNoLeader})
		return
	}
	writeJSON(w, http.StatusOK, commitResponse{CommitIndex: n.raft.CommitIndex(), Term: n.raft.CurrentTerm()})
}

// leaderCommitIndex fetches the commit index of leader over HTTP.
func (n *Node) leaderCommitIndex(leader string) (uint64, error) {
	base := n.cfg.LeaderHTTP(leader)
	if base == "" {
		return 0, fmt.Errorf("no HTTP address known for %s", leader)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	go func() {
		select {
		case <-n.closing:
			cancel()
		case <-ctx.Done():
		}
	}()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, n.baseURL(base)+n.path(epCommit), nil)
	if err != nil {
		return 0, err
	}
	n.setAuth(req)
	resp, err := n.client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var cr commitResponse
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("HTTP %d", resp.StatusCode)
	}
	if err := json.NewDecoder(resp.Body).Decode(&cr); err != nil {
		return 0, err
	}
	return cr.CommitIndex, nil
}

func (n *Node) handleApply(w http.ResponseWriter, r *http.Request) {
	cmd, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxCommandBytes))
	if err != nil {
		writeJSON(w, http.StatusBadRequest, applyEnvelope{Error: err.Error(), Code: codeBadRequest})
		return
	}
	if n.cfg.CheckForwarded != nil {
		if err := n.cfg.CheckForwarded(cmd); err != nil {
			writeJSON(w, http.StatusBadRequest, applyEnvelope{Error: "command refused: " + err.Error(), Code: codeForbiddenCmd})
			return
		}
	}
	if n.isClosing() {
		n.writeApplyResult(w, nil, ErrShutdown)
		return
	}
	if n.raft.State() == raft.Leader {
		resp, err := n.applyLeader(r.Context(), cmd)
		if !errors.Is(err, raft.ErrNotLeader) {
			n.writeApplyResult(w, resp, err)
			return
		}
	}
	if by := r.Header.Get(headerForwardedBy); by != "" {
		n.writeApplyResult(w, nil, fmt.Errorf("%w: %s is not the leader (forwarded by %s)", ErrNoLeader, n.cfg.NodeID, by))
		return
	}
	status, body, _, err := n.forward(r.Context(), n.path(epApply), "application/octet-stream", cmd)
	if err != nil {
		n.writeApplyResult(w, nil, err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// writeApplyResult encodes an applyLeader outcome (the leader side of
// forwarding).
func (n *Node) writeApplyResult(w http.ResponseWriter, resp any, err error) {
	var rej *RejectedError
	switch {
	case err == nil:
		raw, merr := json.Marshal(resp)
		if merr != nil {
			writeJSON(w, http.StatusOK, applyEnvelope{Error: merr.Error(), Code: codeUnencodable})
			return
		}
		writeJSON(w, http.StatusOK, applyEnvelope{Result: raw})
	case errors.As(err, &rej):
		env := applyEnvelope{Error: rej.Message, Code: codeRejected}
		for _, s := range n.cfg.ForwardErrors {
			if errors.Is(rej.Err, s) {
				env.Sentinel = s.Error()
				break
			}
		}
		writeJSON(w, http.StatusOK, env)
	case errors.Is(err, ErrOutcomeUnknown):
		writeJSON(w, http.StatusInternalServerError, applyEnvelope{Error: err.Error(), Code: codeOutcomeUnknown})
	case errors.Is(err, ErrNoLeader):
		writeJSON(w, http.StatusServiceUnavailable, applyEnvelope{Error: err.Error(), Code: codeNoLeader})
	case errors.Is(err, ErrShutdown):
		writeJSON(w, http.StatusServiceUnavailable, applyEnvelope{Error: err.Error(), Code: codeShutdown})
	default:
		writeJSON(w, http.StatusInternalServerError, applyEnvelope{Error: err.Error(), Code: codeFailed})
	}
}

// forwardApply sends cmd to the leader and decodes its envelope.
func (n *Node) forwardApply(ctx context.Context, cmd []byte) (any, error) {
	status, body, leader, err := n.forward(ctx, n.path(epApply), "application/octet-stream", cmd)
	if err != nil {
		return nil, err
	}
	var env applyEnvelope
	if err := json.Unmarshal(body, &env); err != nil {
		if status == http.StatusServiceUnavailable {
			return nil, fmt.Errorf("%w: leader %s: HTTP %d", ErrNoLeader, leader, status)
		}
		return nil, fmt.Errorf("%w: leader %s: HTTP %d: undecodable response: %v", ErrOutcomeUnknown, leader, status, err)
	}
	switch env.Code {
	case "":
		if status != http.StatusOK {
			return nil, fmt.Errorf("%w: leader %s: HTTP %d", ErrOutcomeUnknown, leader, status)
		}
		if len(env.Result) == 0 || string(env.Result) == "null" {
			return nil, nil
		}
		if n.cfg.DecodeResult != nil {
			return n.cfg.DecodeResult(cmd, env.Result)
		}
		return env.Result, nil
	case codeRejected:
		rej := &RejectedError{Message: env.Error}
		for _, s := range n.cfg.ForwardErrors {
			if env.Sentinel != "" && s.Error() == env.Sentinel {
				rej.Err = s
				break
			}
		}
		return nil, rej
	case codeNoLeader, codeShutdown:
		return nil, fmt.Errorf("%w: via %s: %s", ErrNoLeader, leader, env.Error)
	case codeOutcomeUnknown:
		return nil, fmt.Errorf("%w: via %s: %s", ErrOutcomeUnknown, leader, env.Error)
	case codeUnencodable:
		return nil, fmt.Errorf("cluster: leader %s applied the command but could not encode the response: %s", leader, env.Error)
	default:
		return nil, fmt.Errorf("cluster: leader %s: %s: %s", leader, env.Code, env.Error)
	}
}

// forward POSTs body to path on the current leader. Errors: ErrNoLeader when
// the request was certainly not delivered (no leader, no address, dial
// failure); ErrOutcomeUnknown when it may have been.
func (n *Node) forward(ctx context.Context, path, contentType string, body []byte) (status int, respBody []byte, leader string, err error) {
	_, sid := n.raft.LeaderWithID()
	leader = string(sid)
	if leader == "" {
		return 0, nil, "", fmt.Errorf("%w: none known to %s", ErrNoLeader, n.cfg.NodeID)
	}
	if leader == n.cfg.NodeID {
		return 0, nil, leader, fmt.Errorf("%w: %s lost leadership", ErrNoLeader, n.cfg.NodeID)
	}
	base := ""
	if n.cfg.LeaderHTTP != nil {
		base = n.cfg.LeaderHTTP(leader)
	}
	if base == "" {
		return 0, nil, leader, fmt.Errorf("%w: no HTTP address known for leader %s", ErrNoLeader, leader)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultForwardTimeout)
		defer cancel()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, n.baseURL(base)+path, bytes.NewReader(body))
	if err != nil {
		return 0, nil, leader, fmt.Errorf("%w: leader %s: %v", ErrNoLeader, leader, err)
	}
	req.Header.Set("Content-Type", contentType)
	req.Header.Set(headerForwardedBy, n.cfg.NodeID)
	n.setAuth(req)
	resp, err := n.client.Do(req)
	if err != nil {
		if isDialError(err) {
			return 0, nil, leader, fmt.Errorf("%w: leader %s unreachable: %v", ErrNoLeader, leader, err)
		}
		return 0, nil, leader, fmt.Errorf("%w: forward to leader %s: %v", ErrOutcomeUnknown, leader, err)
	}
	defer resp.Body.Close()
	respBody, err = io.ReadAll(io.LimitReader(resp.Body, maxCommandBytes))
	if err != nil {
		return 0, nil, leader, fmt.Errorf("%w: read leader %s response: %v", ErrOutcomeUnknown, leader, err)
	}
	return resp.StatusCode, respBody, leader, nil
}

func (n *Node) setAuth(req *http.Request) {
	if n.cfg.AuthToken != "" {
		req.Header.Set("Authorization", "Bearer "+n.cfg.AuthToken)
	}
}

// isDialError: the connection was never established, so nothing was sent.
func isDialError(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// baseURL accepts "host:port" as well as "http(s)://host:port[/]".
func baseURL(s string) string {
	s = strings.TrimRight(s, "/")
	if !strings.Contains(s, "://") {
		s = "http://" + s
	}
	return s
}

// baseURL is baseURL with HTTPS whenever the node has TLS, whatever the
// address says: the credential is the node's client certificate, and the
// AuthToken it also sends must never cross the network in clear.
func (n *Node) baseURL(s string) string {
	s = baseURL(s)
	if n.cfg.TLS != nil {
		if rest, ok := strings.CutPrefix(s, "http://"); ok {
			s = "https://" + rest
		}
	}
	return s
}

// checkRaftAddr accepts host:port with a non-empty host and a port in
// 1..65535.
func checkRaftAddr(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err == nil && host == "" {
		err = errors.New("empty host")
	}
	if err == nil {
		if p, perr := strconv.Atoi(port); perr != nil || p < 1 || p > 65535 {
			err = fmt.Errorf("port %q", port)
		}
	}
	if err != nil {
		return fmt.Errorf("raft_addr %q is not host:port: %v", addr, err)
	}
	return nil
}

func (n *Node) handleJoin(w http.ResponseWriter, r *http.Request) {
	var req joinRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&req); err != nil || req.NodeID == "" || req.RaftAddr == "" {
		writeJSON(w, http.StatusBadRequest, adminResponse{Error: "want {\"node_id\",\"raft_addr\"}", Code: codeBadRequest})
		return
	}
	// A voter whose address cannot be dialled would cost the cluster its
	// quorum for good (a single node adding one stops electing itself).
	if err := checkRaftAddr(req.RaftAddr); err != nil {
		writeJSON(w, http.StatusBadRequest, adminResponse{Error: err.Error(), Code: codeBadRequest})
		return
	}
	if n.cfg.TLS != nil {
		if status, code, err := n.checkJoin(r, req); err != nil {
			n.refusedHTTP.Add(1)
			n.log.Warn("refused join", "node_id", req.NodeID, "raft_addr", req.RaftAddr, "remote", r.RemoteAddr, "err", err)
			writeJSON(w, status, adminResponse{Error: err.Error(), Code: code})
			return
		}
	}
	var members []string
	n.serveAdmin(w, r, n.path(epJoin), req, func(ctx context.Context) error {
		if n.cfg.TLS != nil {
			// The leader checks every join it executes, forwarded or not:
			// a member's certificate vouches for the member, not for the
			// address it forwards.
			if err := n.verifyRaftPeer(ctx, req.NodeID, req.RaftAddr); err != nil {
				n.refusedHTTP.Add(1)
				n.log.Warn("refused join", "node_id", req.NodeID, "raft_addr", req.RaftAddr, "remote", r.RemoteAddr, "err", err)
				return fmt.Errorf("%w: %w", errUnverified, err)
			}
		}
		if err := n.addVoter(ctx, raft.ServerID(req.NodeID), raft.ServerAddress(req.RaftAddr)); err != nil {
			return err
		}
		members = n.memberIDs()
		return nil
	}, func() []string { return members })
}

// errUnverified: a join's raft_addr did not answer as the node it names.
var errUnverified = errors.New("join refused")

// checkJoin enforces the caller half of the TLS join rule: the caller is
// the joining node itself (its certificate names req.NodeID), or a member
// forwarding a join (X-Kvrouter-Forwarded-By names the caller). The other
// half — req.RaftAddr answers a TLS dial with a certificate naming
// req.NodeID — is checked by the leader just before it changes the
// configuration (handleJoin), whoever forwarded the request.
func (n *Node) checkJoin(r *http.Request, req joinRequest) (status int, code string, err error) {
	caller, err := requestIdentity(r)
	if err != nil {
		return http.StatusUnauthorized, codeUnauthorized, err
	}
	if by := r.Header.Get(headerForwardedBy); by != "" {
		if by != caller.ID || !n.gate.isMember(caller.ID) {
			return http.StatusForbidden, codeForbidden, fmt.Errorf("forwarded join: caller %s is not member %q", caller, by)
		}
		return 0, "", nil
	}
	if caller != pki.Node(req.NodeID) {
		return http.StatusForbidden, codeForbidden, fmt.Errorf("a node joins itself: caller %s may not join node %q", caller, req.NodeID)
	}
	return 0, "", nil
}

// memberIDs are the node ids of the latest configuration.
func (n *Node) memberIDs() []string {
	servers, _ := n.gate.servers()
	ids := make([]string, 0, len(servers))
	for _, s := range servers {
		ids = append(ids, string(s.ID))
	}
	return ids
}

func (n *Node) handleRemove(w http.ResponseWriter, r *http.Request) {
	var req removeRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&req); err != nil || req.NodeID == "" {
		writeJSON(w, http.StatusBadRequest, adminResponse{Error: "want {\"node_id\"}", Code: codeBadRequest})
		return
	}
	n.serveAdmin(w, r, n.path(epRemove), req, func(ctx context.Context) error {
		return waitFuture(ctx, n.raft.RemoveServer(raft.ServerID(req.NodeID), 0, n.cfg.ApplyTimeout))
	}, nil)
}

// serveAdmin runs op on the leader, or forwards the request once; members,
// when set, fills the success answer's Members.
func (n *Node) serveAdmin(w http.ResponseWriter, r *http.Request, path string, req any, op func(context.Context) error, members func() []string) {
	if n.raft.State() == raft.Leader {
		if err := mapRaftError(op(r.Context())); err != nil {
			n.writeAdminError(w, err)
			return
		}
		ok := adminResponse{OK: true}
		if members != nil {
			ok.Members = members()
		}
		writeJSON(w, http.StatusOK, ok)
		return
	}
	if by := r.Header.Get(headerForwardedBy); by != "" {
		n.writeAdminError(w, fmt.Errorf("%w: %s is not the leader (forwarded by %s)", ErrNoLeader, n.cfg.NodeID, by))
		return
	}
	body, _ := json.Marshal(req)
	status, resp, _, err := n.forward(r.Context(), path, "application/json", body)
	if err != nil {
		n.writeAdminError(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(resp)
}

func (n *Node) writeAdminError(w http.ResponseWriter, err error) {
	switch {
	case errors.Is(err, errUnverified):
		writeJSON(w, http.StatusBadRequest, adminResponse{Error: err.Error(), Code: codeUnverified})
	case errors.Is(err, ErrNoLeader), errors.Is(err, ErrShutdown):
		writeJSON(w, http.StatusServiceUnavailable, adminResponse{Error: err.Error(), Code: codeNoLeader})
	case errors.Is(err, ErrOutcomeUnknown):
		writeJSON(w, http.StatusInternalServerError, adminResponse{Error: err.Error(), Code: codeOutcomeUnknown})
	default:
		writeJSON(w, http.StatusInternalServerError, adminResponse{Error: err.Error(), Code: codeFailed})
	}
}

// forwardAdmin sends a join/remove to the leader and checks the answer.
func (n *Node) forwardAdmin(ctx context.Context, path string, req any) error {
	body, _ := json.Marshal(req)
	status, resp, leader, err := n.forward(ctx, path, "application/json", body)
	if err != nil {
		return err
	}
	return adminResult(leader, status, resp)
}

func adminResult(target string, status int, body []byte) error {
	var ar adminResponse
	_ = json.Unmarshal(body, &ar)
	if status == http.StatusOK && ar.OK {
		return nil
	}
	msg := ar.Error
	if msg == "" {
		msg = strings.TrimSpace(string(body))
	}
	switch ar.Code {
	case codeNoLeader:
		return fmt.Errorf("%w: %s: %s", ErrNoLeader, target, strings.TrimPrefix(msg, ErrNoLeader.Error()+": "))
	case codeOutcomeUnknown:
		return fmt.Errorf("%w: %s: %s", ErrOutcomeUnknown, target, strings.TrimPrefix(msg, ErrOutcomeUnknown.Error()+": "))
	}
	return fmt.Errorf("cluster: %s: HTTP %d: %s", target, status, msg)
}

// joinOnce asks each Join target in turn to add this node; nil on the first
// acceptance.
func (n *Node) joinOnce(ctx context.Context) error {
	body, _ := json.Marshal(joinRequest{NodeID: n.cfg.NodeID, RaftAddr: n.cfg.AdvertiseAddr, HTTPAddr: n.cfg.HTTPAddr})
	client := n.client
	if n.cfg.TLS != nil {
		// This node has no configuration yet, so no member to check the
		// target against: any node of our CA the operator named will do,
		// and from the handshake on this node accepts Raft connections from
		// it (the target dials back to check this node's raft_addr).
		t := n.httpTransport(func(id pki.Identity) error {
			if err := pki.AllowRoles(pki.RoleNode)(id); err != nil {
				return err
			}
			n.gate.allowJoin(id.ID)
			return nil
		})
		defer t.CloseIdleConnections()
		client = &http.Client{Transport: t}
	}
	var errs []error
	for _, target := range n.cfg.Join {
		if n.cfg.HTTPAddr != "" && n.baseURL(target) == n.baseURL(n.cfg.HTTPAddr) {
			continue // the same --join list is given to every node
		}
		err := func() error {
			ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, n.baseURL(target)+n.path(epJoin), bytes.NewReader(body))
			if err != nil {
				return err
			}
			req.Header.Set("Content-Type", "application/json")
			n.setAuth(req)
			resp, err := client.Do(req)
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			rb, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
			if err := adminResult(target, resp.StatusCode, rb); err != nil {
				return err
			}
			var ar adminResponse
			if json.Unmarshal(rb, &ar) == nil {
				// The leader replicates to us from now on: accept it and the
				// other members until its first entries bring the
				// configuration.
				n.gate.allowJoin(ar.Members...)
			}
			return nil
		}()
		if err == nil {
			n.log.Info("joined cluster", "via", target)
			return nil
		}
		errs = append(errs, err) // adminResult and url.Error name the target
	}
	if len(errs) == 0 {
		return errors.New("no join target other than this node")
	}
	return errors.Join(errs...)
}
