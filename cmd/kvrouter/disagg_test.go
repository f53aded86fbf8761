package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// kvmockBuild is the kvmock binary the tests of this package share: built
// once (a link of kvmock costs seconds on a loaded 2-core host, and six
// tests run worker processes), removed by TestMain.
var kvmockBuild struct {
	once sync.Once
	dir  string
	bin  string
	err  error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if kvmockBuild.dir != "" {
		_ = os.RemoveAll(kvmockBuild.dir)
	}
	os.Exit(code)
}

// buildKvmock returns the path of a kvmock binary (the tests run real
// worker processes: the prefill worker's link, the decode worker's pull),
// compiled on the first call. The directory argument is no longer used
// (callers passed their own t.TempDir, one build each).
func buildKvmock(t *testing.T, _ string) string {
	t.Helper()
	b := &kvmockBuild
	b.once.Do(func() {
		if b.dir, b.err = os.MkdirTemp("", "kvrouter-test-kvmock-"); b.err != nil {
			return
		}
		b.bin = filepath.Join(b.dir, "kvmock")
		cmd := exec.Command("go", "build", "-o", b.bin, "github.com/kvrouter/kvrouter/cmd/kvmock")
		if out, err := cmd.CombinedOutput(); err != nil {
			b.err = fmt.Errorf("%v\n%s", err, out)
		}
	})
	if b.err != nil {
		t.Fatalf("building kvmock: %v", b.err)
	}
	return b.bin
}

func startKvmock(t *testing.T, bin string, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = testWriter{t, args[1]}, testWriter{t, args[1]}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return cmd
}

// metricValue sums the samples of name whose labels contain every want.
func metricValue(t *testing.T, base, name string, want ...string) float64 {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	sum := 0.0
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		ok := true
		for _, w := range want {
			ok = ok && strings.Contains(line, w)
		}
		if ok {
			v, _ := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
			sum += v
		}
	}
	return sum
}

// TestServeDisaggWithKvmock: three replicas with --disagg always in front
// of a real prefill-only and a real decode-only kvmock sharing a 104 MB/s
// link (at speedup 4). A request is prefilled on the prefill worker, its KV
// pulled by the decode worker, and answered by the decode worker; its
// decode booking reaches the other replicas through replica sync; with the
// prefill worker killed, requests are served aggregated on the decode
// worker and the recovery is counted.
func TestServeDisaggWithKvmock(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas and two worker processes")
	}
	t.Parallel() // its own replicas, ports and workers; it mostly waits (elections, workers)
	bin := buildKvmock(t, t.TempDir())
	const speedup = "4"
	reps := newTestCluster(t, func(c *serveConfig) {
		c.Disagg.Mode = router.DisaggAlways
		c.Disagg.Speedup = 4
		c.Models = []string{"kvmock"}
	})
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(reps); return err })
	st, err := status(reps[0].url())
	if err != nil {
		t.Fatal(err)
	}
	ports := freePorts(t, 2)
	common := []string{"--model", "kvmock", "--speedup", speedup, "--nats", st.NATS, "--register", reps[0].url() + "," + reps[1].url(), "--log-level", "warn"}
	prefill := startKvmock(t, bin, append([]string{"--id", "dg-p", "--addr", fmt.Sprintf("127.0.0.1:%d", ports[0]), "--role", "prefill", "--link-mbps", "104"}, common...)...)
	startKvmock(t, bin, append([]string{"--id", "dg-d", "--addr", fmt.Sprintf("127.0.0.1:%d", ports[1]), "--role", "decode"}, common...)...)
	for _, r := range reps {
		poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
			resp, err := http.Get(r.url() + "/cluster/status?digest=0")
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			var doc struct {
				Workers []struct{ ID, Role string } `json:"workers"`
			}
			if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
				return err
			}
			roles := map[string]string{}
			for _, w := range doc.Workers {
				roles[w.ID] = w.Role
			}
			if roles["dg-p"] != "prefill" || roles["dg-d"] != "decode" {
				return fmt.Errorf("%s roles %v", r.cfg.NodeID, roles)
			}
			return nil
		})
	}

	send := func(base string, tokens, seed int) (http.Header, error) {
		ids := make([]string, tokens)
		for i := range ids {
			ids[i] = strconv.Itoa(1000 + (seed*7919+i*104729)%30000)
		}
		body := fmt.Sprintf(`{"model":"kvmock","max_tokens":4,"stream":true,"prompt":[%s]}`, strings.Join(ids, ","))
		resp, err := http.Post(base+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			return nil, err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK || !bytes.Contains(b, []byte("[DONE]")) {
			return nil, fmt.Errorf("status %d: %s", resp.StatusCode, b)
		}
		return resp.Header, nil
	}

	// Disaggregated: the decode worker answers with the KV it pulled.
	h, err := send(reps[1].url(), 1500, 1)
	if err != nil {
		t.Fatal(err)
	}
	if h.Get("X-Worker-Id") != "dg-d" || h.Get("X-Kvmock-Kv-Pulled-Tokens") == "" || h.Get("X-Kvmock-Kv-Pulled-Tokens") == "0" {
		t.Fatalf("not disaggregated: worker %q pulled %q", h.Get("X-Worker-Id"), h.Get("X-Kvmock-Kv-Pulled-Tokens"))
	}
	if n := metricValue(t, reps[1].url(), "kvrouter_disagg_decisions_total", `outcome="disaggregated"`); n != 1 {
		t.Fatalf("disaggregated decisions on r2: %v", n)
	}

	// Replica sync: while a long transfer runs (3,000 tokens: 3.3 s of
	// link time, 0.8 s at speedup 4) the other replicas see its bookings.
	done := make(chan error, 1)
	go func() { _, err := send(reps[1].url(), 3000, 2); done <- err }()
	seen := false
	for !seen {
		select {
		case err := <-done:
			t.Fatalf("the request ended (%v) before replica r3 saw its load", err)
		case <-time.After(20 * time.Millisecond):
		}
		seen = metricValue(t, reps[2].url(), "kvrouter_worker_active_decode_blocks", `worker="dg-d"`) > 0
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 10*time.Second, 50*time.Millisecond, func() error {
		for _, r := range reps {
			if v := metricValue(t, r.url(), "kvrouter_worker_inflight_requests", `worker="dg-`); v != 0 {
				return fmt.Errorf("%s still counts %v requests in flight", r.cfg.NodeID, v)
			}
		}
		return nil
	})

	// The prefill worker dies: requests are served aggregated, loudly.
	_ = prefill.Process.Kill()
	_ = prefill.Wait()
	for i := range 3 {
		h, err := send(reps[2].url(), 200, 10+i)
		if err != nil {
			t.Fatalf("with the prefill worker dead: %v", err)
		}
		if h.Get("X-Worker-Id") != "dg-d" {
			t.Fatalf("worker %q", h.Get("X-Worker-Id"))
		}
	}
	if n := metricValue(t, reps[2].url(), "kvrouter_disagg_recoveries_total", `action="aggregate"`); n < 1 {
		t.Fatalf("aggregate recoveries on r3: %v", n)
	}
}
