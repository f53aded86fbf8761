package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/internal/reftest"
)

// The status page in a real browser (headless Chromium) against a live
// replica with a kvmock worker and a few routed requests: after the page's
// first refresh its cluster, worker, hit-rate and decision tables hold the live
// values, the browser logged nothing to the console (no script error, no
// refused fetch, no CSP violation), and the page's error line is empty.
// The DOM and a screenshot go to tmp/ui/ (a CI artifact) for a human look.
func TestStatusPageInChromium(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica, a worker process and a browser")
	}
	browser, err := exec.LookPath("chromium")
	if err != nil {
		reftest.Missing(t, "chromium (apt-get install chromium) for the status page test")
	}
	out, err := filepath.Abs(filepath.Join("..", "..", "tmp", "ui"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		t.Fatal(err)
	}
	bin := buildKvmock(t, t.TempDir())
	ports := freePorts(t, 5)
	base := startUIReplica(t, ports, "")
	startKvmock(t, bin, "--id", "ui-mock", "--addr", fmt.Sprintf("127.0.0.1:%d", ports[4]), "--model", "kvmock",
		"--nats", fmt.Sprintf("nats://127.0.0.1:%d", ports[2]), "--register", base, "--log-level", "warn")
	body := `{"model":"kvmock","max_tokens":3,"messages":[{"role":"user","content":"` + strings.Repeat("the status page prompt ", 20) + `"}]}`
	poll.Until(t, 30*time.Second, 100*time.Millisecond, func() error {
		resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Worker-Id") != "ui-mock" {
			return fmt.Errorf("HTTP %d from %q", resp.StatusCode, resp.Header.Get("X-Worker-Id"))
		}
		return nil
	})
	for range 2 { // the same prompt again: a hit in the audit and the log
		resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	var st struct {
		Term uint64 `json:"term"`
	}
	if err := getJSON(base+"/cluster/status?digest=0", "", &st); err != nil || st.Term == 0 {
		t.Fatalf("status: term %d, %v", st.Term, err)
	}

	dom, console := runChromium(t, browser, "--dump-dom", base+"/ui")
	if err := os.WriteFile(filepath.Join(out, "status.html"), []byte(dom), 0o644); err != nil {
		t.Fatal(err)
	}
	if console != "" {
		t.Errorf("the browser's console:\n%s", console)
	}
	for name, re := range map[string]string{
		"node id":        `<span id="node-id">ui-r1</span>`,
		"state":          `<dd id="state">leader</dd>`,
		"leader":         `<dd id="leader">ui-r1</dd>`,
		"term":           fmt.Sprintf(`<dd id="term">%d</dd>`, st.Term),
		"digest":         `<dd id="digest" class="mono">[0-9a-f]{64}</dd>`,
		"worker row":     `<table id="workers">.*<td>ui-mock</td><td>kvmock</td>`,
		"audit row":      `<table id="hits">.*<td>ui-mock</td><td class="num">3</td>`,
		"fleet plan row": `<table id="fleet-plan">.*<td class="num">1</td><td>ui-mock</td><td>kvmock</td><td class="num">\d+</td>`,
		"hit rates":      `<tr class="hit-rate"><td>kvmock</td><td class="chosen">fleet \(\d+ KV blocks\)</td><td>1m</td><td class="num">3</td>(<td class="num">[0-9.]+ %</td>){4}`,
		"worker's hits":  `<tr class="hit-rate"><td>kvmock</td><td>ui-mock</td><td>1m</td><td class="num">3</td><td class="num">fleet-wide</td><td class="num">fleet-wide</td>(<td class="num">[0-9.]+ %</td>){2}`,
		"hit history":    `<svg [^>]*class="hit-chart" data-model="kvmock"[^>]*>.*<polyline [^>]*class="series-available"></polyline>.*<polyline [^>]*class="series-delivered"></polyline>`,
		"decision row":   `<tr class="decision">.*<td class="chosen">ui-mock</td>`,
		"decision cost":  `<div class="chosen">▶ ui-mock: \d+ · \d+r/\d+b · [0-9.]+</div>`,
		"outcome":        `HTTP 200 · TTFT \d+ ms · \d+/\d+ cached`,
		"no fetch error": `<span id="error" class="bad"></span>`,
		"refreshed":      `<span id="refreshed" class="muted">updated `,
	} {
		if !regexp.MustCompile(re).MatchString(dom) {
			t.Errorf("%s: the page has no match for %s (DOM in %s)", name, re, filepath.Join(out, "status.html"))
		}
	}

	png := filepath.Join(out, "status.png")
	os.Remove(png)
	runChromium(t, browser, "--screenshot="+png, "--window-size=1400,1000", base+"/ui")
	if b, err := os.ReadFile(png); err != nil || !bytes.HasPrefix(b, []byte("\x89PNG")) {
		t.Fatalf("no screenshot at %s: %v", png, err)
	}
	t.Logf("screenshot: %s", png)
}

// startUIReplica runs kvrouter serve --single-node on ports[0:4] with the
// extra flags (and the admin token when not ""), and returns its base URL
// once it leads.
func startUIReplica(t *testing.T, ports []int, token string, extra ...string) string {
	t.Helper()
	if token != "" {
		extra = append(extra, "--admin-token", token)
	}
	tmp := t.TempDir()
	cfg, err := parseServe(append([]string{"--single-node", "--node-id", "ui-r1", "--model", "kvmock",
		"--http-addr", fmt.Sprintf("127.0.0.1:%d", ports[0]), "--raft-addr", fmt.Sprintf("127.0.0.1:%d", ports[1]),
		"--nats-addr", fmt.Sprintf("127.0.0.1:%d", ports[2]), "--nats-cluster-addr", fmt.Sprintf("127.0.0.1:%d", ports[3]),
		"--data-dir", filepath.Join(tmp, "r1")}, extra...),
		func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := serve(ctx, cfg, slog.New(slog.NewTextHandler(&logSink{t: t}, &slog.HandlerOptions{Level: slog.LevelWarn}))); err != nil {
			t.Errorf("serve: %v", err)
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	base := "http://" + cfg.HTTPAddr
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { // not /ready: that waits for a worker
		var st struct {
			State string `json:"state"`
		}
		if err := getJSON(base+"/cluster/status?digest=0", token, &st); err != nil || st.State != "leader" {
			return fmt.Errorf("state %q, %v", st.State, err)
		}
		return nil
	})
	return base
}

// With an admin token and --protect-status, the page is still served, and
// instead of failing it asks for the token (its reads answered 401), with
// no script error.
func TestStatusPageInChromiumAsksForToken(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica and a browser")
	}
	browser, err := exec.LookPath("chromium")
	if err != nil {
		reftest.Missing(t, "chromium (apt-get install chromium) for the status page test")
	}
	base := startUIReplica(t, freePorts(t, 4), "ui-secret", "--protect-status")
	dom, console := runChromium(t, browser, "--dump-dom", base+"/ui")
	if !strings.Contains(dom, `<form id="token-form">`) || strings.Contains(dom, `<form id="token-form" hidden`) {
		t.Errorf("the token form is not shown:\n%s", dom)
	}
	if !strings.Contains(dom, `<span id="error" class="bad"></span>`) || !strings.Contains(dom, `<span id="node-id">…</span>`) {
		t.Errorf("without the token the page shows an error or data:\n%s", dom)
	}
	for l := range strings.Lines(console) { // the two 401s are logged as failed loads; nothing else may be
		if !strings.Contains(l, "401") {
			t.Errorf("the browser's console: %s", l)
		}
	}
}

// runChromium runs one headless Chromium command after the page's first
// refresh (virtual time runs the page's timers without waiting for them)
// and returns its stdout and its console lines.
func runChromium(t *testing.T, browser string, args ...string) (stdout, console string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	full := []string{"--headless", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
		"--user-data-dir=" + t.TempDir(), // a profile of its own: tests may run side by side
		"--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000"}
	if os.Geteuid() == 0 {
		full = append(full, "--no-sandbox") // Chromium refuses to run as root with its sandbox
	}
	cmd := exec.CommandContext(ctx, browser, append(full, args...)...)
	var so, se bytes.Buffer
	cmd.Stdout, cmd.Stderr = &so, &se
	if err := cmd.Run(); err != nil {
		t.Fatalf("chromium %v: %v\n%s", args, err, se.String())
	}
	var lines []string
	for l := range strings.Lines(se.String()) {
		// Every console message (console.error, uncaught exceptions,
		// failed loads, CSP violations) is logged as ":CONSOLE"; the page
		// writes none on purpose.
		if strings.Contains(l, ":CONSOLE") || strings.Contains(l, "Uncaught") {
			lines = append(lines, l)
		}
	}
	return so.String(), strings.Join(lines, "")
}

// getJSON decodes the JSON answer of GET url (with the bearer token when
// not "") into v.
func getJSON(url, token string, v any) error {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: HTTP %d", url, resp.StatusCode)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}
