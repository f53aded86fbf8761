package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/internal/syncbuf"
)

func TestBridgeCLIParse(t *testing.T) {
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "bridge.json")
	if err := os.WriteFile(cfgPath, []byte(`{"nats":"nats://file:4222","block_size":16,"register":["http://r1:8001"],
		"workers":[{"id":"gpu1","url":"http://gpu1:8000","events":"tcp://gpu1:5557","replay":"tcp://gpu1:5558","dp_ranks":2}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"KVROUTER_BRIDGE_ADMIN_TOKEN": "tok"}
	getenv := func(k string) string { return env[k] }
	var errb bytes.Buffer
	c, err := parseBridge([]string{"--config", cfgPath, "--nats", "nats://flag:4222", "--id", "gpu0", "--url", "http://gpu0:8000/",
		"--events", "tcp://gpu0:5557", "--replay", "tcp://gpu0:5558"}, getenv, &errb)
	if err != nil {
		t.Fatal(err)
	}
	if c.NATS != "nats://flag:4222" || c.AdminToken != "tok" || c.BlockSize != 16 || len(c.Register) != 1 ||
		len(c.workers) != 2 || c.workers[0].ID != "gpu0" || c.workers[0].URL != "http://gpu0:8000" || c.workers[1].DPRanks != 2 {
		t.Fatalf("config %+v", c)
	}
	if c.CompactHashes {
		t.Fatal("compact hashes on by default: older replicas refuse them")
	}
	if c, err := parseBridge([]string{"--nats", "nats://x", "--compact-hashes", "--id", "w", "--url", "http://h:1", "--events", "tcp://h:5557"}, getenv, &errb); err != nil || !c.CompactHashes {
		t.Fatalf("--compact-hashes: %+v, %v", c, err)
	}
	bad := map[string][]string{
		"no nats":            {"--id", "w", "--url", "http://h:1", "--events", "tcp://h:5557"},
		"wildcard endpoint":  {"--nats", "nats://x", "--id", "w", "--url", "http://h:1", "--events", "tcp://*:5557"},
		"no url":             {"--nats", "nats://x", "--id", "w", "--events", "tcp://h:5557"},
		"hash in id":         {"--nats", "nats://x", "--id", "w#1", "--url", "http://h:1", "--events", "tcp://h:5557"},
		"bad block size":     {"--nats", "nats://x", "--block-size", "-1", "--http-addr", "127.0.0.1:0"},
		"nothing to do":      {"--nats", "nats://x", "--http-addr", ""},
		"bad register":       {"--nats", "nats://x", "--register", "r1:8001", "--http-addr", "127.0.0.1:0"},
		"duplicate worker":   {"--nats", "nats://x", "--config", cfgPath, "--id", "gpu1", "--url", "http://h:1", "--events", "tcp://h:5557"},
		"missing config":     {"--nats", "nats://x", "--config", filepath.Join(dir, "nope.json")},
		"stray argument":     {"--nats", "nats://x", "extra"},
		"bad dp ranks":       {"--nats", "nats://x", "--id", "w", "--url", "http://h:1", "--events", "tcp://h:5557", "--dp-ranks", "-1"},
		"bad log level":      {"--nats", "nats://x", "--log-level", "loud", "--http-addr", "127.0.0.1:0"},
		"replay not tcp url": {"--nats", "nats://x", "--id", "w", "--url", "http://h:1", "--events", "tcp://h:5557", "--replay", "ipc:///tmp/x"},
	}
	for name, args := range bad {
		if _, err := parseBridge(args, func(string) string { return "" }, &errb); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if err := os.WriteFile(cfgPath, []byte(`{"workers":[{"id":"a","url":"http://a:1","events":"tcp://a:5557","typo":1}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := parseBridge([]string{"--nats", "nats://x", "--config", cfgPath}, func(string) string { return "" }, &errb); err == nil ||
		!strings.Contains(err.Error(), "typo") {
		t.Errorf("unknown config key: %v", err)
	}
	var out, stderr bytes.Buffer
	if code := dispatch(context.Background(), []string{"bridge", "-h"}, &out, &stderr); code != 0 || !strings.Contains(stderr.String(), "--events") {
		t.Errorf("bridge -h: %d %s", code, stderr.String())
	}
	if code := dispatch(context.Background(), []string{"bridge"}, &out, &stderr); code != 2 {
		t.Errorf("bridge without --nats: %d", code)
	}
}

// TestBridgeCLIRun starts `kvrouter bridge` against an embedded event bus
// with one worker by flags (its engine not up yet) and one added through
// the register API, reads /status and /metrics, and stops it.
func TestBridgeCLIRun(t *testing.T) {
	srv := busWithStream(t, "cli-bridge")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errb syncbuf.Buffer
	done := make(chan int, 1)
	go func() {
		done <- dispatch(ctx, []string{"bridge", "--nats", srv.ClientURL(), "--http-addr", "127.0.0.1:0", "--api-token", "t",
			"--id", "gpu0", "--url", "http://127.0.0.1:1", "--model", "m", "--total-kv-blocks", "100",
			"--events", "tcp://127.0.0.1:1", "--replay", "tcp://127.0.0.1:2", "--log-level", "debug"}, &out, &errb)
	}()
	var base string
	deadline := time.Now().Add(10 * time.Second)
	for base == "" {
		if time.Now().After(deadline) {
			t.Fatalf("no serving line; stderr:\n%s", errb.String())
		}
		if s := out.String(); strings.Contains(s, "serving on ") {
			base = strings.TrimSpace(strings.SplitN(s, "serving on ", 2)[1])
		}
		time.Sleep(10 * time.Millisecond)
	}
	body, _ := json.Marshal(map[string]any{"id": "gpu1", "url": "http://127.0.0.1:1", "model": "m", "events": "tcp://127.0.0.1:3", "total_kv_blocks": 5})
	req, _ := http.NewRequest(http.MethodPost, base+"/workers/register", bytes.NewReader(body))
	req.Header.Set("Authorization", "Bearer t")
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("register: %v %v", resp, err)
	}
	resp.Body.Close()
	var st struct {
		BlockSize int `json:"block_size"`
		Workers   []struct {
			State string `json:"state"`
			Spec  struct {
				ID string `json:"id"`
			} `json:"spec"`
		} `json:"workers"`
	}
	deadline = time.Now().Add(10 * time.Second)
	for {
		resp, err := http.Get(base + "/status")
		if err != nil {
			t.Fatal(err)
		}
		_ = json.NewDecoder(resp.Body).Decode(&st)
		resp.Body.Close()
		if len(st.Workers) == 2 && st.Workers[0].State == "running" && st.Workers[1].State == "running" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("status %+v", st)
		}
		time.Sleep(20 * time.Millisecond)
	}
	resp, err = http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	var m bytes.Buffer
	_, _ = m.ReadFrom(resp.Body)
	resp.Body.Close()
	if !strings.Contains(m.String(), `kvrouter_bridge_worker_running{state="running",worker="gpu0"} 1`) {
		t.Fatalf("metrics:\n%s", m.String())
	}
	cancel()
	select {
	case code := <-done:
		if code != 0 {
			t.Fatalf("exit %d: %s", code, errb.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatal("bridge did not stop")
	}
}

// busWithStream starts an embedded event bus with the KV_EVENTS stream.
func busWithStream(t *testing.T, name string) *eventbus.Server {
	t.Helper()
	srv, err := eventbus.StartServer(eventbus.ServerConfig{Name: name, StoreDir: t.TempDir(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Security: eventbus.Security{Insecure: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	nc, err := eventbus.Connect(srv.ClientURL(), name+"-setup", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := eventbus.EnsureStream(t.Context(), js, eventbus.StreamOptions{}); err != nil {
		t.Fatal(err)
	}
	return srv
}
