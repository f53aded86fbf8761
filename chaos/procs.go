//go:build chaos

package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// proc is one child process with its log file.
type proc struct {
	name    string
	logPath string
	env     []string // added to the harness's environment (secrets: never in argv, which the log shows)

	mu      sync.Mutex
	cmd     *exec.Cmd
	done    chan struct{}
	exit    error
	stopped bool // SIGSTOPped
	starts  int
}

func (p *proc) start(argv []string, registry *pidRegistry) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil && !p.exited() {
		return fmt.Errorf("%s already running (pid %d)", p.name, p.cmd.Process.Pid)
	}
	f, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	p.starts++
	fmt.Fprintf(f, "\n===== chaos: start #%d of %s at %s: %s\n", p.starts, p.name, time.Now().Format(time.RFC3339Nano), strings.Join(argv, " "))
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = f, f
	if len(p.env) > 0 {
		cmd.Env = append(os.Environ(), p.env...)
	}
	// Pdeathsig: the child dies with the harness even if the harness is
	// SIGKILLed; its own process group keeps terminal signals away.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	done := make(chan struct{})
	p.cmd, p.done, p.exit, p.stopped = cmd, done, nil, false
	registry.add(cmd.Process.Pid)
	go func() {
		err := cmd.Wait()
		f.Close()
		registry.remove(cmd.Process.Pid)
		p.mu.Lock()
		p.exit = err
		p.mu.Unlock()
		close(done)
	}()
	return nil
}

// exited: mu must be held.
func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *proc) running() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd != nil && !p.exited()
}

func (p *proc) pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || p.exited() {
		return 0
	}
	return p.cmd.Process.Pid
}

func (p *proc) signal(sig syscall.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || p.exited() {
		return fmt.Errorf("%s is not running", p.name)
	}
	if err := p.cmd.Process.Signal(sig); err != nil {
		return err
	}
	switch sig {
	case syscall.SIGSTOP:
		p.stopped = true
	case syscall.SIGCONT:
		p.stopped = false
	}
	return nil
}

// wait waits for the process to exit, up to d.
func (p *proc) wait(d time.Duration) bool {
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	if done == nil {
		return true
	}
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
}

// kill SIGKILLs the process (continuing it first if stopped) and waits.
func (p *proc) kill() {
	if !p.running() {
		return
	}
	_ = p.signal(syscall.SIGKILL)
	p.wait(10 * time.Second)
}

// term sends SIGTERM and waits up to grace, then SIGKILLs.
func (p *proc) term(grace time.Duration) (graceful bool) {
	if !p.running() {
		return true
	}
	p.mu.Lock()
	stopped := p.stopped
	p.mu.Unlock()
	if stopped {
		_ = p.signal(syscall.SIGCONT)
	}
	_ = p.signal(syscall.SIGTERM)
	if p.wait(grace) {
		return true
	}
	p.kill()
	return false
}

// pidRegistry mirrors the live children into a file, so chaos/run.sh can
// kill them if the harness itself dies.
type pidRegistry struct {
	mu   sync.Mutex
	path string
	pids map[int]bool
}

func newPidRegistry(path string) *pidRegistry {
	return &pidRegistry{path: path, pids: map[int]bool{}}
}

func (r *pidRegistry) add(pid int)    { r.update(pid, true) }
func (r *pidRegistry) remove(pid int) { r.update(pid, false) }

func (r *pidRegistry) update(pid int, on bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if on {
		r.pids[pid] = true
	} else {
		delete(r.pids, pid)
	}
	var b strings.Builder
	for p := range r.pids {
		fmt.Fprintln(&b, p)
	}
	if r.path != "" {
		_ = os.WriteFile(r.path, []byte(b.String()), 0o644)
	}
}

// replica is one kvrouter serve process in namespace idx.
type replica struct {
	proc
	idx     int
	id      string
	dataDir string
	join    bool     // start with --join (a replica added to a formed cluster)
	bin     string   // kvrouter binary to start; "" = this build's (U1 starts one on the previous release's)
	groups  int      // --raft-groups (scenario.raftGroups); 0 or 1: the flag is left out, one Raft group
	extra   []string // more serve flags (scenario.serveArgs)
}

// argv is the replica's command line, always the same (formation resumes
// from the data dir; a wiped or new replica joins or bootstraps). With
// credentials it runs as a deployment should: off loopback, so the secure
// default applies, with its node certificate, the replica token (bus
// clients without a certificate: the probes' operator connection) and the
// admin token, all from files. Without (a scenario insecure on purpose,
// see scenario.insecure) it opts out through the environment, which a
// previous release that predates the flag ignores, so its command line is
// the same.
func (r *replica) argv(bin string, members []int, cred *credentials) []string {
	scheme := "http"
	if cred != nil {
		scheme = "https"
	}
	var peers, routes, join []string
	for _, m := range members {
		peers = append(peers, fmt.Sprintf("r%d=%s:%d", m, nodeIP(m), raftPort))
		if m != r.idx {
			routes = append(routes, fmt.Sprintf("nats://%s:%d", nodeIP(m), routePort))
			join = append(join, replicaURL(scheme, m))
		}
	}
	args := []string{"ip", "netns", "exec", nsName(r.idx)}
	if cred == nil {
		args = append(args, "env", "KVROUTER_INSECURE=true")
	}
	args = append(args, bin, "serve",
		"--node-id", r.id,
		"--data-dir", r.dataDir,
		"--http-addr", fmt.Sprintf("%s:%d", nodeIP(r.idx), httpPort),
		"--raft-addr", fmt.Sprintf("%s:%d", nodeIP(r.idx), raftPort),
		"--nats-addr", fmt.Sprintf("%s:%d", nodeIP(r.idx), natsPort),
		"--nats-cluster-addr", fmt.Sprintf("%s:%d", nodeIP(r.idx), routePort),
		"--nats-routes", strings.Join(routes, ","),
		"--model", routeModel+","+ledgerModel,
		"--block-size", fmt.Sprint(blockSize),
	)
	if cred != nil {
		m := cred.node(r.idx)
		args = append(args, "--tls-ca", m.CAFile, "--tls-cert", m.CertFile, "--tls-key", m.KeyFile,
			"--replica-token-file", cred.replicaFile, "--admin-token-file", cred.adminFile)
	}
	if r.groups > 1 {
		args = append(args, "--raft-groups", fmt.Sprint(r.groups), "--raft-group-port-step", fmt.Sprint(raftGroupPortStep))
	}
	args = append(args, r.extra...)
	if r.join {
		args = append(args, "--join", strings.Join(join, ","))
	} else {
		args = append(args, "--peers", strings.Join(peers, ","))
	}
	return args
}

// status is the part of /cluster/status the harness reads.
type status struct {
	NodeID            string  `json:"node_id"`
	State             string  `json:"state"`
	LeaderID          string  `json:"leader_id"`
	Term              uint64  `json:"term"`
	AppliedIndex      uint64  `json:"applied_index"`
	CommitIndex       uint64  `json:"commit_index"`
	LastSnapshotIndex uint64  `json:"last_snapshot_index"`
	SnapshotsRestored uint64  `json:"snapshots_restored"`
	Ready             bool    `json:"ready"`
	ReadyReason       string  `json:"ready_reason"`
	Digest            string  `json:"digest"`
	PID               int     `json:"pid"`
	IndexBlocks       int     `json:"index_blocks"`
	Peers             []peerS `json:"peers"`
	// RaftGroups: the data groups of a sharded replica (--raft-groups > 1);
	// the fields above are then the control group's.
	RaftGroups []groupS       `json:"raft_groups"`
	Workers    []statusWorker `json:"workers"`
	FSM        struct {
		Events     uint64            `json:"Events"`
		Applied    uint64            `json:"Applied"`
		Duplicates uint64            `json:"Duplicates"`
		Gaps       uint64            `json:"Gaps"`
		Rejected   map[string]uint64 `json:"Rejected"`
		Commands   uint64            `json:"Commands"`
	} `json:"fsm"`
	raw json.RawMessage
}

// statusWorker is one worker in /cluster/status.
type statusWorker struct {
	ID               string `json:"id"`
	Model            string `json:"model"`
	URL              string `json:"url"`
	BlockSize        int    `json:"block_size"`
	TotalBlocks      int    `json:"total_kv_blocks"`
	MaxBatchedTokens int    `json:"max_num_batched_tokens"`
	Drained          bool   `json:"drained"`
	RaftGroup        int    `json:"raft_group"` // sharded: the data group that registers it
	Ranks            []struct {
		Rank        uint32 `json:"rank"`
		Blocks      int    `json:"blocks"`
		LastEventID uint64 `json:"last_event_id"`
		Stale       string `json:"stale"`
	} `json:"ranks"`
}

// groupS is one data group in /cluster/status's raft_groups.
type groupS struct {
	Group        int    `json:"group"`
	State        string `json:"state"`
	LeaderID     string `json:"leader_id"`
	Term         uint64 `json:"term"`
	AppliedIndex uint64 `json:"applied_index"`
	CommitIndex  uint64 `json:"commit_index"`
	Ready        bool   `json:"ready"`
	IndexBlocks  int    `json:"index_blocks"`
	Workers      int    `json:"workers"`
	Stream       string `json:"stream"`
	Digest       string `json:"digest"` // "" when the status was asked without digests
	Halted       string `json:"halted"`
}

type peerS struct {
	ID       string `json:"id"`
	RaftAddr string `json:"raft_addr"`
	Suffrage string `json:"suffrage"`
}

func (a *access) getStatus(ctx context.Context, base string) (*status, error) {
	return a.getStatusOpt(ctx, base, true)
}

// getStatusOpt asks without the digests when digest is false: a replica
// computes one per group on request, which a poller every 50 ms on the
// two shared cores would pay for nothing.
func (a *access) getStatusOpt(ctx context.Context, base string, digest bool) (*status, error) {
	path := "/cluster/status"
	if !digest {
		path += "?digest=0"
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+path, nil)
	if err != nil {
		return nil, err
	}
	resp, err := a.status.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 32<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("HTTP %d", resp.StatusCode)
	}
	var st status
	if err := json.Unmarshal(data, &st); err != nil {
		return nil, err
	}
	st.raw = data
	return &st, nil
}

// getReady returns /ready's status code (0: no answer).
func (a *access) getReady(ctx context.Context, base string) int {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/ready", nil)
	if err != nil {
		return 0
	}
	resp, err := a.status.Do(req)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// mock is one kvmock worker in the root namespace.
type mock struct {
	proc
	id            string
	port          int
	registerEvery time.Duration // lease renewal (the lease is 120 s)
}

// argv: with credentials the worker publishes with its own certificate
// (it may publish only its own events) and registers over HTTPS with the
// admin token, as `make run`'s kvmocks do.
func (m *mock) argv(bin string, members []int, cred *credentials) []string {
	scheme := "http"
	if cred != nil {
		scheme = "https"
	}
	var nats, reg []string
	for _, i := range members {
		nats = append(nats, fmt.Sprintf("nats://%s:%d", nodeIP(i), natsPort))
		reg = append(reg, replicaURL(scheme, i))
	}
	args := []string{bin,
		"--id", m.id,
		"--addr", fmt.Sprintf("%s:%d", hostIP, m.port),
		"--model", routeModel,
		"--block-size", fmt.Sprint(blockSize),
		"--kv-blocks", "1024",
		"--speedup", "25",
		"--nats", strings.Join(nats, ","),
		"--register", strings.Join(reg, ","),
		"--register-interval", m.registerEvery.String(),
	}
	if cred != nil {
		w := cred.worker(m.id)
		args = append(args, "--nats-tls-ca", w.CAFile, "--nats-tls-cert", w.CertFile, "--nats-tls-key", w.KeyFile,
			"--register-ca", w.CAFile, "--admin-token-file", cred.adminFile)
	}
	return args
}

// statsClient reads HAProxy's stats page: plain HTTP on the harness's own
// bridge address, not a replica port.
var statsClient = &http.Client{Timeout: 800 * time.Millisecond}

// haproxyStatus reads the backend servers' states from the stats page CSV:
// server name → status (UP, DOWN, "UP 1/2", MAINT, …).
func haproxyStatus(ctx context.Context) (map[string]string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://%s:%d/stats;csv", hostIP, statsPort), nil)
	if err != nil {
		return nil, err
	}
	resp, err := statsClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	lines := strings.Split(string(data), "\n")
	if len(lines) == 0 {
		return nil, fmt.Errorf("empty stats")
	}
	header := strings.Split(strings.TrimPrefix(lines[0], "# "), ",")
	col := map[string]int{}
	for i, h := range header {
		col[h] = i
	}
	px, sv, st := col["pxname"], col["svname"], col["status"]
	out := map[string]string{}
	for _, l := range lines[1:] {
		f := strings.Split(l, ",")
		if len(f) <= st || f[px] != "replicas" || f[sv] == "BACKEND" || f[sv] == "FRONTEND" {
			continue
		}
		out[f[sv]] = f[st]
	}
	return out, nil
}

func mustAbs(p string) string {
	a, err := filepath.Abs(p)
	if err != nil {
		return p
	}
	return a
}
