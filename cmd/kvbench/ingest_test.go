package main

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
)

func TestIngestFlagValidation(t *testing.T) {
	good := [][]string{
		{"--target", "http://127.0.0.1:8001"},
		{"--target", "http://localhost:8001/", "--duration", "20s", "--json", "x.json", "--workers", "2", "--blocks-per-event", "32",
			"--window", "64", "--max-unapplied", "0", "--poll", "50ms", "--worker-blocks", "0"},
		{"--target", "http://127.0.0.1:8001", "--replicas", "http://127.0.0.1:8002,http://127.0.0.1:8003", "--nats", "nats://127.0.0.1:4222,nats://localhost:4223"},
	}
	for _, args := range good {
		if _, err := parseIngestFlags(args, io.Discard); err != nil {
			t.Errorf("%q: %v", args, err)
		}
	}
	o, _ := parseIngestFlags([]string{"--target", "http://127.0.0.1:8001/", "--replicas", "http://127.0.0.1:8002,http://127.0.0.1:8001"}, io.Discard)
	if strings.Join(o.Replicas, " ") != "http://127.0.0.1:8001 http://127.0.0.1:8002" {
		t.Errorf("replicas %q: want the target first, once", o.Replicas)
	}
	if o.Workers != 8 || o.BlocksPerEvent != 32 || o.BlockSize != 16 || o.Duration != 10*time.Second {
		t.Errorf("defaults %+v", o)
	}
	t1 := "--target"
	u := "http://127.0.0.1:8001"
	bad := map[string][]string{
		"no target":          {},
		"remote target":      {t1, "http://10.1.2.3:8001"},
		"target with path":   {t1, u + "/cluster"},
		"not a URL":          {t1, "127.0.0.1:8001"},
		"remote replica":     {t1, u, "--replicas", "http://example.com:8002"},
		"remote nats":        {t1, u, "--nats", "nats://10.0.0.1:4222"},
		"nats scheme":        {t1, u, "--nats", "tcp://127.0.0.1:4222"},
		"zero duration":      {t1, u, "--duration", "0s"},
		"duration unit":      {t1, u, "--duration", "20"},
		"zero workers":       {t1, u, "--workers", "0"},
		"zero blocks":        {t1, u, "--blocks-per-event", "0"},
		"too many blocks":    {t1, u, "--blocks-per-event", "5000"},
		"block size":         {t1, u, "--block-size", "0"},
		"window":             {t1, u, "--window", "0"},
		"negative unapplied": {t1, u, "--max-unapplied", "-1"},
		"poll too fast":      {t1, u, "--poll", "100us"},
		"sample":             {t1, u, "--sample-every", "0"},
		"drain":              {t1, u, "--drain-timeout", "0s"},
		"tiny worker cache":  {t1, u, "--blocks-per-event", "8", "--worker-blocks", "10"},
		"stray argument":     {t1, u, "extra"},
		"unknown flag":       {t1, u, "--nope"},
	}
	for name, args := range bad {
		if _, err := parseIngestFlags(args, io.Discard); !errors.Is(err, cli.ErrUsage) {
			t.Errorf("%s %q: err %v, want a usage error", name, args, err)
		}
		var stdout, stderr strings.Builder
		if code := run(append([]string{"ingest"}, args...), &stdout, &stderr); code != cli.ExitUsage {
			t.Errorf("%s: exit %d, want 2 (%s)", name, code, stderr.String())
		}
	}
	var stdout, stderr strings.Builder
	if code := run([]string{"ingest", "-h"}, &stdout, &stderr); code != cli.ExitOK || !strings.Contains(stderr.String(), "-blocks-per-event") {
		t.Errorf("ingest -h: exit %d, %q", code, stderr.String())
	}
}

func TestIngestUnreachableTarget(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	u := srv.URL
	srv.Close() // nothing listens there any more
	var stdout, stderr strings.Builder
	if code := run([]string{"ingest", "--target", u, "--duration", "1s"}, &stdout, &stderr); code != cli.ExitFail {
		t.Fatalf("exit %d, want 1: %s", code, stderr.String())
	}
}

// A replica that refuses the synthetic workers' block size: a usage error
// (exit 2), and nothing is left registered.
func TestIngestRejectedRegistration(t *testing.T) {
	var deregistered, registered int
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/cluster/status":
			_ = json.NewEncoder(w).Encode(map[string]any{"node_id": "r1", "leader_id": "r1", "nats_url": "nats://127.0.0.1:4222",
				"models": []string{"m"}, "peers": []map[string]any{{"id": "r1", "raft_addr": "127.0.0.1:1"}}})
		case "/workers/register":
			registered++
			http.Error(w, `{"error":"block size 8 differs from the router's 16"}`, http.StatusBadRequest)
		case "/workers/deregister":
			deregistered++
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	var stdout, stderr strings.Builder
	code := run([]string{"ingest", "--target", srv.URL, "--block-size", "8", "--duration", "1s"}, &stdout, &stderr)
	if code != cli.ExitUsage || !strings.Contains(stderr.String(), "block size") {
		t.Fatalf("exit %d, want 2: %s", code, stderr.String())
	}
	if registered != 1 || deregistered != 0 {
		t.Fatalf("registered %d, deregistered %d", registered, deregistered)
	}
}

func TestIngestReportShape(t *testing.T) {
	rep := &ingestReport{EventsPerS: 123456.5, Published: 10, Acked: 9, Lost: 1,
		ReplicaCPU: []replicaCPU{{Replica: "r1", CPUS: 4.5, UsPerBlockEvent: 4.5}}}
	rep.VisibleMs.P50, rep.VisibleMs.P99 = 12.5, 99
	p := filepath.Join(t.TempDir(), "r.json")
	if err := cli.WriteJSONFile(p, rep); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(p)
	var j map[string]any
	if err := json.Unmarshal(b, &j); err != nil {
		t.Fatal(err)
	}
	vis, _ := j["visible_ms"].(map[string]any)
	if j["events_per_s"] != 123456.5 || vis["p50"] != 12.5 || vis["p99"] != 99.0 || j["published"] != 10.0 || j["acked"] != 9.0 || j["lost"] != 1.0 {
		t.Fatalf("contract fields: %s", b)
	}
	cpu, _ := j["replica_cpu"].([]any)
	if len(cpu) != 1 || cpu[0].(map[string]any)["us_per_block_event"] != 4.5 || cpu[0].(map[string]any)["replica"] != "r1" {
		t.Fatalf("replica_cpu: %s", b)
	}
	if s := ingestSummary(rep); !strings.Contains(s, "123456 block events/s") || !strings.Contains(s, "lost 1") {
		t.Fatalf("summary %q", s)
	}
}

func TestIngestEventChainBookkeeping(t *testing.T) {
	w := &ingestWorker{removals: []removal{{id: 5, blocks: 8}, {id: 10, blocks: 8}}}
	// Events 1-4 stored (16 blocks), 5 removes 8, 6-9 stored, 10 removes 8, 11 stored.
	for _, c := range []struct {
		id             uint64
		stored, remove int
	}{{0, 0, 0}, {4, 16, 0}, {5, 16, 8}, {9, 32, 8}, {11, 36, 16}} {
		if s, r := w.storedUpTo(c.id, 4), w.removedUpTo(c.id); s != c.stored || r != c.remove {
			t.Errorf("up to %d: stored %d removed %d, want %d %d", c.id, s, r, c.stored, c.remove)
		}
	}
	// Block hashes are distinct across workers and blocks.
	seen := map[uint64]bool{}
	for wk := range 4 {
		for k := range uint64(1000) {
			h := blockHash(42, wk, k)
			if seen[h] {
				t.Fatalf("hash collision at worker %d block %d", wk, k)
			}
			seen[h] = true
		}
	}
}
