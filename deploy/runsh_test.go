package deploy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/internal/syncbuf"
)

// The lifecycle of deploy/local/run.sh, tested with stand-ins for kvrouter
// and kvmock: this test binary itself, re-executed with fakeRoleEnv set. The
// stand-ins serve /health, /ready and /cluster/status (with their pid) and
// record their arguments, which is all run.sh relies on.

const (
	fakeRoleEnv = "KVROUTER_DEPLOY_TEST_FAKE"      // kvrouter or kvmock
	fakeDirEnv  = "KVROUTER_DEPLOY_TEST_FAKE_DIR"  // where stand-ins record their arguments
	fakeWaitEnv = "KVROUTER_DEPLOY_TEST_FAKE_WAIT" // kvrouter stand-ins answer /ready 503 this long
)

func TestMain(m *testing.M) {
	if role := os.Getenv(fakeRoleEnv); role != "" {
		os.Exit(runFake(role, os.Args[1:]))
	}
	os.Exit(m.Run())
}

// fakeRecord is what a stand-in writes to <fake dir>/<id>.json.
type fakeRecord struct {
	Role  string            `json:"role"`
	PID   int               `json:"pid"`
	Args  []string          `json:"args"`
	Flags map[string]string `json:"flags"`
}

func runFake(role string, args []string) int {
	f := flagValues(args)
	id, addr := f["node-id"], f["http-addr"]
	if role == "kvmock" {
		id, addr = f["id"], f["addr"]
	}
	if role == "kvrouter" && len(args) > 0 && args[0] == "certs" {
		return fakeCerts(f)
	}
	if role == "kvrouter" && (len(args) == 0 || args[0] != "serve") {
		fmt.Fprintln(os.Stderr, "fake kvrouter: want `serve`")
		return 2
	}
	if id == "" || addr == "" {
		fmt.Fprintf(os.Stderr, "fake %s: no id or address in %q\n", role, args)
		return 2
	}
	rec, _ := json.Marshal(fakeRecord{Role: role, PID: os.Getpid(), Args: args, Flags: f})
	if err := os.WriteFile(filepath.Join(os.Getenv(fakeDirEnv), id+".json"), rec, 0o644); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	wait, _ := time.ParseDuration(os.Getenv(fakeWaitEnv))
	start := time.Now()
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("/ready", func(w http.ResponseWriter, _ *http.Request) {
		if time.Since(start) < wait {
			http.Error(w, `{"reason":"warming up"}`, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	mux.HandleFunc("/cluster/status", func(w http.ResponseWriter, _ *http.Request) {
		json.NewEncoder(w).Encode(map[string]any{"node_id": id, "pid": os.Getpid()})
	})
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Printf("fake %s %s listening on %s\n", role, id, addr)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	<-ctx.Done()
	fmt.Printf("fake %s %s stopping\n", role, id)
	srv.Close()
	return 0
}

// fakeCerts stands in for `kvrouter certs`: the files run.sh then names,
// empty (the fakes never read them).
func fakeCerts(f map[string]string) int {
	dir := f["dir"]
	if dir == "" || f["nodes"] == "" {
		fmt.Fprintln(os.Stderr, "fake kvrouter certs: want --dir and --nodes")
		return 2
	}
	files := []string{"ca.pem", "ca-key.pem"}
	for _, n := range strings.Split(f["nodes"], ",") {
		id, _, _ := strings.Cut(n, "=")
		files = append(files, "node-"+id+".pem", "node-"+id+"-key.pem")
	}
	for _, w := range strings.Split(f["workers"], ",") {
		files = append(files, "worker-"+w+".pem", "worker-"+w+"-key.pem")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	for _, name := range files {
		if err := os.WriteFile(filepath.Join(dir, name), nil, 0o600); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	return 0
}

// --- harness ------------------------------------------------------------------------

type runHarness struct {
	t       *testing.T
	dir     string // bin/, run/, fake/
	offset  int
	haproxy bool
	cmd     *exec.Cmd
	out     *syncbuf.Buffer
	done    chan struct{}
	err     error // the script's exit, once done is closed
}

// basePorts are every port run.sh opens (before the offset).
var basePorts = []int{8000, 8404, 8001, 8002, 8003, 7001, 7002, 7003, 4222, 4223, 4224, 6222, 6223, 6224, 9001, 9002, 9003, 9004}

// busyPorts returns the ports (offset added) that cannot be listened on.
func busyPorts(offset int) []int {
	var busy []int
	for _, p := range basePorts {
		ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p+offset))
		if err != nil {
			busy = append(busy, p+offset)
			continue
		}
		ln.Close()
	}
	return busy
}

// newRunHarness prepares stand-in binaries and a port offset whose ports are
// all free, so the test does not collide with a real `make run`.
func newRunHarness(t *testing.T) *runHarness {
	t.Helper()
	if _, err := exec.LookPath("bash"); err != nil {
		t.Skip("bash not installed")
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	h := &runHarness{t: t, dir: t.TempDir()}
	for _, d := range []string{"bin", "fake"} {
		if err := os.Mkdir(filepath.Join(h.dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, role := range []string{"kvrouter", "kvmock"} {
		script := fmt.Sprintf("#!/bin/sh\n%s=%s exec %q \"$@\"\n", fakeRoleEnv, role, self)
		if err := os.WriteFile(filepath.Join(h.dir, "bin", role), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// Offsets 10000-22999 keep every port below Linux's ephemeral range
	// (32768+), where outgoing connections could take one at any moment.
	for i := 0; ; i++ {
		h.offset = 10000 + rand.IntN(13000)
		if len(busyPorts(h.offset)) == 0 {
			break
		}
		if i == 50 {
			t.Fatal("no free port range found")
		}
	}
	_, err = exec.LookPath("haproxy")
	h.haproxy = err == nil
	return h
}

// start runs run.sh in its own process group (as `setsid make run` does).
func (h *runHarness) start(extraEnv ...string) {
	h.t.Helper()
	h.cmd = exec.Command("bash", "local/run.sh")
	h.cmd.Env = append(os.Environ(),
		"KVROUTER_BIN_DIR="+filepath.Join(h.dir, "bin"),
		"KVROUTER_RUN_DIR="+filepath.Join(h.dir, "run"),
		"KVROUTER_RUN_PORT_OFFSET="+strconv.Itoa(h.offset),
		"KVROUTER_RUN_TAIL=0",
		"KVROUTER_RUN_STOP_TIMEOUT=5",
		fakeDirEnv+"="+filepath.Join(h.dir, "fake"),
	)
	h.cmd.Env = append(h.cmd.Env, extraEnv...)
	h.out = &syncbuf.Buffer{}
	h.cmd.Stdout, h.cmd.Stderr = h.out, h.out
	h.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := h.cmd.Start(); err != nil {
		h.t.Fatal(err)
	}
	done, out, cmd := make(chan struct{}), h.out, h.cmd
	h.done = done
	go func() { h.err = cmd.Wait(); close(done) }()
	h.t.Cleanup(func() {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
		if h.t.Failed() {
			h.t.Logf("run.sh output:\n%s", out.String())
		}
	})
}

// wait polls cond until it holds or the deadline passes.
func (h *runHarness) wait(what string, d time.Duration, cond func() bool) {
	h.t.Helper()
	poll.Until(h.t, d, 50*time.Millisecond, func() error {
		if !cond() {
			return fmt.Errorf("still waiting for %s", what)
		}
		return nil
	})
}

func (h *runHarness) outputHas(s string) func() bool {
	return func() bool { return strings.Contains(h.out.String(), s) }
}

// exit waits for run.sh to end and returns its exit status.
func (h *runHarness) exit(d time.Duration) int {
	h.t.Helper()
	select {
	case <-h.done:
	case <-time.After(d):
		h.t.Fatalf("run.sh still running after %v", d)
	}
	var ee *exec.ExitError
	if errors.As(h.err, &ee) {
		return ee.ExitCode()
	}
	if h.err != nil {
		h.t.Fatal(h.err)
	}
	return 0
}

func (h *runHarness) url(basePort int, path string) string {
	return fmt.Sprintf("http://127.0.0.1:%d%s", basePort+h.offset, path)
}

func (h *runHarness) record(id string) fakeRecord {
	h.t.Helper()
	b, err := os.ReadFile(filepath.Join(h.dir, "fake", id+".json"))
	if err != nil {
		h.t.Fatalf("stand-in %s did not start: %v", id, err)
	}
	var r fakeRecord
	if err := json.Unmarshal(b, &r); err != nil {
		h.t.Fatal(err)
	}
	return r
}

func httpOK(url string) bool { return httpOKWithin(url, time.Second) }

// httpOKWithin: a GET of url answered 200 within timeout.
func httpOKWithin(url string, timeout time.Duration) bool {
	c := http.Client{Timeout: timeout}
	resp, err := c.Get(url)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

func processGone(pid int) bool {
	return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
}

// --- tests ----------------------------------------------------------------------------

// TestDeployRunScriptLifecycle: the cluster comes up and reports ready, the
// replicas get the right flags, a SIGKILLed replica is reported while the rest
// keeps running (HAProxy fails over), and SIGTERM to the process group stops
// everything with exit status 0.
func TestDeployRunScriptLifecycle(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes; skipped with -short")
	}
	h := newRunHarness(t)
	h.start(fakeWaitEnv + "=1s")
	h.wait("the cluster to report ready", 60*time.Second, h.outputHas("cluster ready"))
	out := h.out.String()
	for _, s := range []string{"ready: ", "(3/3)", h.url(8001, ""), "mock-4"} {
		if !strings.Contains(out, s) {
			t.Errorf("output lacks %q", s)
		}
	}

	// Flags as docs/CONTRACTS.md and cmd/kvrouter/config.go name them.
	o := h.offset
	peers := fmt.Sprintf("r1=127.0.0.1:%d,r2=127.0.0.1:%d,r3=127.0.0.1:%d", 7001+o, 7002+o, 7003+o)
	var pids []int
	for i, r := range []string{"r1", "r2", "r3"} {
		rec := h.record(r)
		pids = append(pids, rec.PID)
		var routes []string
		for j := 0; j < 3; j++ {
			if j != i {
				routes = append(routes, fmt.Sprintf("nats://127.0.0.1:%d", 6222+j+o))
			}
		}
		want := map[string]string{
			"node-id":           r,
			"http-addr":         fmt.Sprintf("127.0.0.1:%d", 8001+i+o),
			"raft-addr":         fmt.Sprintf("127.0.0.1:%d", 7001+i+o),
			"nats-addr":         fmt.Sprintf("127.0.0.1:%d", 4222+i+o),
			"nats-cluster-addr": fmt.Sprintf("127.0.0.1:%d", 6222+i+o),
			"nats-routes":       strings.Join(routes, ","),
			"peers":             peers,
			"data-dir":          filepath.Join(h.dir, "run", r),
			"model":             "kvmock",
			// Secure by default (SECURITY.md): the node's own certificate.
			"tls-ca":             filepath.Join(h.dir, "run", "certs", "ca.pem"),
			"tls-cert":           filepath.Join(h.dir, "run", "certs", "node-"+r+".pem"),
			"tls-key":            filepath.Join(h.dir, "run", "certs", "node-"+r+"-key.pem"),
			"replica-token-file": filepath.Join(h.dir, "run", "secrets", "replica-token"),
			// Strangers kept out (issue 26): the admin token on every admin
			// endpoint but /busy_threshold from loopback, and the workers' key.
			"admin-token-file":       filepath.Join(h.dir, "run", "secrets", "admin-token"),
			"admin-open-to-loopback": "/busy_threshold",
			"worker-api-key-file":    filepath.Join(h.dir, "run", "secrets", "worker-api-key"),
		}
		for k, v := range want {
			if rec.Flags[k] != v {
				t.Errorf("%s: --%s %q, want %q", r, k, rec.Flags[k], v)
			}
		}
	}
	// The secrets: fresh, 64 hex digits, readable by their owner only.
	for _, name := range []string{"admin-token", "worker-api-key", "replica-token"} {
		p := filepath.Join(h.dir, "run", "secrets", name)
		st, err := os.Stat(p)
		if err != nil {
			t.Errorf("secret %s: %v", name, err)
			continue
		}
		if st.Mode().Perm() != 0o600 {
			t.Errorf("%s has mode %v, want 0600", p, st.Mode().Perm())
		}
		if b, _ := os.ReadFile(p); len(b) != 64 || strings.Trim(string(b), "0123456789abcdef") != "" {
			t.Errorf("%s holds %d bytes, want 64 hex digits", p, len(b))
		}
	}
	for _, s := range []string{"token required, in " + filepath.Join(h.dir, "run", "secrets", "admin-token"), "except /busy_threshold from this host",
		"API key required on /v1/*, in " + filepath.Join(h.dir, "run", "secrets", "worker-api-key")} {
		if !strings.Contains(out, s) {
			t.Errorf("output lacks %q", s)
		}
	}
	nats := fmt.Sprintf("nats://127.0.0.1:%d,nats://127.0.0.1:%d,nats://127.0.0.1:%d", 4222+o, 4223+o, 4224+o)
	register := fmt.Sprintf("https://127.0.0.1:%d,https://127.0.0.1:%d,https://127.0.0.1:%d", 8001+o, 8002+o, 8003+o)
	for j := 1; j <= 4; j++ {
		id := fmt.Sprintf("mock-%d", j)
		rec := h.record(id)
		pids = append(pids, rec.PID)
		want := map[string]string{
			"addr":          fmt.Sprintf("127.0.0.1:%d", 9000+j+o),
			"advertise-url": fmt.Sprintf("http://127.0.0.1:%d", 9000+j+o),
			"nats":          nats,
			"register":      register,
			"model":         "kvmock",
			"nats-tls-ca":   filepath.Join(h.dir, "run", "certs", "ca.pem"),
			"nats-tls-cert": filepath.Join(h.dir, "run", "certs", "worker-"+id+".pem"),
			"nats-tls-key":  filepath.Join(h.dir, "run", "certs", "worker-"+id+"-key.pem"),
			// It registers with the admin token and requires the worker key.
			"admin-token-file": filepath.Join(h.dir, "run", "secrets", "admin-token"),
			"api-key-file":     filepath.Join(h.dir, "run", "secrets", "worker-api-key"),
		}
		for k, v := range want {
			if rec.Flags[k] != v {
				t.Errorf("%s: --%s %q, want %q", id, k, rec.Flags[k], v)
			}
		}
		for _, k := range []string{"kv-blocks", "speedup", "block-size"} {
			if rec.Flags[k] == "" {
				t.Errorf("%s: no --%s", id, k)
			}
		}
	}

	lb := h.url(8000, "/cluster/status")
	if h.haproxy {
		h.wait("HAProxy to pass requests", 15*time.Second, func() bool { return httpOK(lb) })
	} else {
		t.Log("haproxy not installed: the HAProxy part is not exercised")
	}

	// SIGKILL a replica by the pid it reports, as live-cluster does to the leader.
	var st struct {
		PID int `json:"pid"`
	}
	resp, err := http.Get(h.url(8002, "/cluster/status"))
	if err != nil {
		t.Fatal(err)
	}
	json.NewDecoder(resp.Body).Decode(&st)
	resp.Body.Close()
	if st.PID != pids[1] {
		t.Errorf("r2 reports pid %d, recorded %d", st.PID, pids[1])
	}
	if err := syscall.Kill(st.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	h.wait("run.sh to report r2's death", 10*time.Second, h.outputHas(fmt.Sprintf("r2 (pid %d) was killed by SIGKILL", st.PID)))
	select {
	case <-h.done:
		t.Fatalf("run.sh exited after one replica died")
	default:
	}
	if !httpOK(h.url(8001, "/ready")) || !httpOK(h.url(8003, "/ready")) {
		t.Error("r1 or r3 stopped answering after r2 was killed")
	}
	if h.haproxy {
		// Connections to r2 are refused; HAProxy redispatches them and the
		// checks take r2 out of rotation: every request must succeed. Not
		// within httpOK's second: HAProxy waits min(timeout connect, 1 s)
		// before retrying a refused connection, so a request that met r2
		// before the checks noticed takes just over a second (it failed
		// make test once on a loaded machine).
		for i := 0; i < 30; i++ {
			if !httpOKWithin(lb, 5*time.Second) {
				t.Errorf("request %d through HAProxy failed after r2 was killed", i)
			}
		}
	}

	// Stop it the way the acceptance checks do: SIGTERM to the whole group.
	if err := syscall.Kill(-h.cmd.Process.Pid, syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := h.exit(20 * time.Second); code != 0 {
		t.Errorf("run.sh exited with %d after SIGTERM, want 0", code)
	}
	if !strings.Contains(h.out.String(), "stopped") {
		t.Error("run.sh did not say it stopped")
	}
	for _, pid := range pids {
		if !processGone(pid) {
			t.Errorf("pid %d still exists after run.sh exited", pid)
		}
	}
	// The listeners die with their processes; allow the kernel a moment.
	end := time.Now().Add(5 * time.Second)
	for busy := busyPorts(h.offset); len(busy) > 0; busy = busyPorts(h.offset) {
		if time.Now().After(end) {
			t.Errorf("ports %v still in use after run.sh exited", busy)
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestDeployRunScriptInterrupt: SIGINT to the script alone (at a terminal
// Ctrl-C reaches the whole foreground group, but background jobs of a
// non-interactive shell may ignore SIGINT): it must stop every child itself
// and exit 0.
func TestDeployRunScriptInterrupt(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes; skipped with -short")
	}
	if signal.Ignored(os.Interrupt) {
		t.Skip("SIGINT is ignored in this process (started in the background?); bash cannot trap it then")
	}
	h := newRunHarness(t)
	// Also the terminal mode: every log copied to the output, prefixed;
	// and the opt-outs of the admin token and the worker key.
	h.start("KVROUTER_RUN_HAPROXY=0", "KVROUTER_RUN_WORKERS=1", "KVROUTER_RUN_TAIL=1", "KVROUTER_RUN_ADMIN_TOKEN=0", "KVROUTER_RUN_WORKER_API_KEY=0")
	h.wait("the cluster to report ready", 60*time.Second, h.outputHas("cluster ready"))
	h.wait("the prefixed log copy", 10*time.Second, h.outputHas("[mock-1] fake kvmock mock-1 listening"))
	if strings.Contains(h.out.String(), "haproxy.cfg") {
		t.Error("HAProxy configured although KVROUTER_RUN_HAPROXY=0")
	}
	for _, s := range []string{"WARNING: KVROUTER_RUN_ADMIN_TOKEN=0: no admin token", "NO TOKEN: admin endpoints and worker registration open"} {
		if !strings.Contains(h.out.String(), s) {
			t.Errorf("the open cluster is not announced loudly: output lacks %q", s)
		}
	}
	for _, id := range []string{"r1", "mock-1"} {
		for _, f := range []string{"admin-token-file", "admin-open-to-loopback", "worker-api-key-file", "api-key-file"} {
			if v, ok := h.record(id).Flags[f]; ok {
				t.Errorf("%s got --%s %q with the opt-outs", id, f, v)
			}
		}
	}
	for _, name := range []string{"admin-token", "worker-api-key"} {
		if _, err := os.Stat(filepath.Join(h.dir, "run", "secrets", name)); err == nil {
			t.Errorf("secrets/%s written with its opt-out", name)
		}
	}
	pids := []int{h.record("r1").PID, h.record("r2").PID, h.record("r3").PID, h.record("mock-1").PID}
	if err := h.cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	if code := h.exit(20 * time.Second); code != 0 {
		t.Errorf("exit status %d after SIGINT, want 0", code)
	}
	for _, pid := range pids {
		if !processGone(pid) {
			t.Errorf("pid %d still exists after run.sh exited", pid)
		}
	}
}

// TestDeployRunScriptRefuses: a port in use, a run directory run.sh did not
// make, and missing binaries each stop it early with a clear message.
func TestDeployRunScriptRefuses(t *testing.T) {
	h := newRunHarness(t)

	ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", 8002+h.offset))
	if err != nil {
		t.Fatal(err)
	}
	h.start()
	code := h.exit(20 * time.Second)
	ln.Close()
	if out := h.out.String(); code == 0 || !strings.Contains(out, "already in use") ||
		!strings.Contains(out, fmt.Sprintf("%d (r2 HTTP)", 8002+h.offset)) || !strings.Contains(out, "KVROUTER_RUN_PORT_OFFSET") {
		t.Errorf("port in use: exit %d, output:\n%s", code, out)
	}

	foreign := filepath.Join(h.dir, "foreign")
	os.MkdirAll(foreign, 0o755)
	precious := filepath.Join(foreign, "precious.txt")
	os.WriteFile(precious, []byte("keep me"), 0o644)
	h.start("KVROUTER_RUN_DIR=" + foreign)
	if code := h.exit(20 * time.Second); code == 0 || !strings.Contains(h.out.String(), "refusing to wipe") {
		t.Errorf("foreign run dir: exit %d, output:\n%s", code, h.out.String())
	}
	if _, err := os.Stat(precious); err != nil {
		t.Errorf("run.sh deleted a directory it did not make: %v", err)
	}

	h.start("KVROUTER_BIN_DIR=" + filepath.Join(h.dir, "nothing-here"))
	if code := h.exit(20 * time.Second); code == 0 || !strings.Contains(h.out.String(), "make build") {
		t.Errorf("missing binaries: exit %d, output:\n%s", code, h.out.String())
	}
}

// TestDeployRunScriptStartupFailure: when every replica exits at once (bad
// flags, say), run.sh shows why and exits non-zero instead of waiting forever.
func TestDeployRunScriptStartupFailure(t *testing.T) {
	h := newRunHarness(t)
	// `certs` succeeds (run.sh stops at once when it fails): serve is what breaks.
	bad := "#!/bin/sh\n[ \"$1\" = certs ] && exit 0\necho 'kvrouter serve: not built yet' >&2\nexit 2\n"
	if err := os.WriteFile(filepath.Join(h.dir, "bin", "kvrouter"), []byte(bad), 0o755); err != nil {
		t.Fatal(err)
	}
	h.start("KVROUTER_RUN_HAPROXY=0")
	if code := h.exit(30 * time.Second); code == 0 {
		t.Errorf("exit 0 although no replica started")
	}
	out := h.out.String()
	for _, s := range []string{"exited with status 2", "not built yet", "every replica exited"} {
		if !strings.Contains(out, s) {
			t.Errorf("output lacks %q", s)
		}
	}
}
