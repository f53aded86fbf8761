package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/internal/reftest"
)

// logSink is a log sink the test reads while the code writes, echoed to t.Log.
type logSink struct {
	mu sync.Mutex
	b  bytes.Buffer
	t  *testing.T
}

func (s *logSink) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.t.Log(strings.TrimSpace(string(p)))
	return s.b.Write(p)
}

func (s *logSink) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// refModelDir is a real Hugging Face model directory from the pinned npm
// reference packages (internal/reftest: skipped without them, failed in CI).
func refModelDir(t *testing.T, family string) string {
	t.Helper()
	return reftest.ModelDir(t, family)
}

// TestSelfCheckEndToEnd: one replica with Qwen3's files in front of two
// real kvmock processes with the same files, one of them with a
// deliberately different chat template (ChatML without the newline after
// <|im_end|>), and a worker without /tokenize. The replica checks each as
// it registers: ok, mismatch (gauge 1, status flag, warning naming model,
// worker and position), unavailable (no alarm).
func TestSelfCheckEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica and two worker processes")
	}
	dir := refModelDir(t, "qwen3")
	tmp := t.TempDir()
	bin := buildKvmock(t, tmp)
	drift := filepath.Join(tmp, "drift.jinja")
	src := "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
	if err := os.WriteFile(drift, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}

	ports := freePorts(t, 6)
	cfg, err := parseServe([]string{"--single-node", "--node-id", "r1", "--model", "qwen3", "--model-dir", "qwen3=" + dir,
		"--http-addr", fmt.Sprintf("127.0.0.1:%d", ports[0]), "--raft-addr", fmt.Sprintf("127.0.0.1:%d", ports[1]),
		"--nats-addr", fmt.Sprintf("127.0.0.1:%d", ports[2]), "--nats-cluster-addr", fmt.Sprintf("127.0.0.1:%d", ports[3]),
		"--data-dir", filepath.Join(tmp, "r1")}, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	logs := &logSink{t: t}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := serve(ctx, cfg, slog.New(slog.NewTextHandler(logs, nil))); err != nil {
			t.Errorf("serve: %v", err)
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	base := "http://" + cfg.HTTPAddr
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error {
		s, err := status(base)
		if err == nil && s.State != "leader" {
			err = fmt.Errorf("state %q", s.State)
		}
		return err
	})

	common := []string{"--model", "qwen3", "--model-dir", dir, "--register", base, "--log-level", "warn"}
	startKvmock(t, bin, append([]string{"--id", "tc-same", "--addr", fmt.Sprintf("127.0.0.1:%d", ports[4])}, common...)...)
	startKvmock(t, bin, append([]string{"--id", "tc-drift", "--addr", fmt.Sprintf("127.0.0.1:%d", ports[5]), "--chat-template-file", drift}, common...)...)
	// A worker without /tokenize (an engine that does not serve it).
	noTok := httptest.NewServer(http.NotFoundHandler())
	defer noTok.Close()
	reg := fmt.Sprintf(`{"id":"tc-none","url":%q,"model":"qwen3","block_size":16,"total_kv_blocks":1000}`, noTok.URL)
	poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
		resp, err := http.Post(base+"/workers/register", "application/json", strings.NewReader(reg))
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode != 200 {
			b, _ := io.ReadAll(resp.Body)
			return fmt.Errorf("register: %d %s", resp.StatusCode, b)
		}
		return nil
	})

	var checks map[string]string
	poll.Until(t, 90*time.Second, 50*time.Millisecond, func() error {
		var err error
		if checks, err = tokenizerChecks(base); err != nil {
			return err
		}
		if checks["tc-same"] != "ok" || !strings.HasPrefix(checks["tc-drift"], "mismatch at ") ||
			!strings.HasPrefix(checks["tc-none"], "unavailable: ") {
			return fmt.Errorf("tokenizer checks %v", checks)
		}
		return nil
	})
	pos := strings.TrimPrefix(checks["tc-drift"], "mismatch at ")
	if pos == "0" {
		t.Fatalf("the template differs after the first turn, not at 0: %v", checks)
	}
	if v := metricValue(t, base, "kvrouter_tokenizer_mismatch", `model="qwen3"`, `worker="tc-drift"`); v != 1 {
		t.Fatalf("kvrouter_tokenizer_mismatch of tc-drift: %v", v)
	}
	if v := metricValue(t, base, "kvrouter_tokenizer_mismatch", `worker="tc-same"`); v != 0 {
		t.Fatalf("kvrouter_tokenizer_mismatch of tc-same: %v", v)
	}
	out := logs.String()
	line := regexp.MustCompile(`level=WARN msg="tokenizer mismatch[^\n]*`).FindString(out)
	if !strings.Contains(line, "model=qwen3") || !strings.Contains(line, "worker=tc-drift") ||
		!strings.Contains(line, "first_differing_position="+pos+" ") {
		t.Fatalf("mismatch warning %q (want model, worker, position %s)", line, pos)
	}
	if regexp.MustCompile(`level=WARN msg="tokenizer mismatch[^\n]*worker=tc-(none|same)`).MatchString(out) {
		t.Fatal("a worker without /tokenize, or one that agrees, raised the alarm")
	}
	if !regexp.MustCompile(`level=INFO msg="tokenizer self-check not possible[^\n]*worker=tc-none`).MatchString(out) {
		t.Fatalf("no info line for the worker without /tokenize:\n%s", out)
	}
}

// tokenizerChecks reads every worker's tokenizer self-check result from a
// replica's /cluster/status, by worker id.
func tokenizerChecks(base string) (map[string]string, error) {
	resp, err := http.Get(base + "/cluster/status?digest=0")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var doc struct {
		Workers []struct {
			ID    string `json:"id"`
			Check string `json:"tokenizer_check"`
		} `json:"workers"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
		return nil, err
	}
	checks := map[string]string{}
	for _, w := range doc.Workers {
		checks[w.ID] = w.Check
	}
	return checks, nil
}
