package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/pki"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// Data-parallel ranks end to end: a kvmock process serving two ranks behind
// one URL (each its own cache and event stream) registers with the
// cluster; the rank a replica books is the rank that serves (kvmock refuses
// a request without one); that rank's events reach the replicated index
// through the bus and Raft, and the same prompt then goes to the same rank
// and hits its cache, through another replica too. The worker runs with
// --api-key and the replicas hold its key per worker
// (--worker-api-keys-file's map): every request carries it, and the
// client's X-Request-Id and traceparent reach the worker.
func TestServeDPRanksWithKvmock(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas and a worker process")
	}
	t.Parallel() // its own replicas, ports and workers; it mostly waits (elections, workers)
	bin := buildKvmock(t, t.TempDir())
	dir := t.TempDir()
	keyFile := filepath.Join(dir, "dp-1.key")
	if err := os.WriteFile(keyFile, []byte("dp-1-secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	reps := newTestCluster(t, func(c *serveConfig) {
		c.Models = []string{"kvmock"}
		c.WorkerAPIKey = "not-dp-1s" // the default, for workers not in the map
		c.WorkerAPIKeys = map[string]pki.Secret{"dp-1": "dp-1-secret"}
	})
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(reps); return err })
	st, err := status(reps[0].url())
	if err != nil {
		t.Fatal(err)
	}
	port := freePorts(t, 1)[0]
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	startKvmock(t, bin, "--id", "dp-1", "--addr", fmt.Sprintf("127.0.0.1:%d", port), "--model", "kvmock", "--speedup", "4",
		"--dp-ranks", "2", "--api-key-file", keyFile, "--nats", st.NATS, "--register", reps[0].url()+","+reps[1].url(), "--log-level", "warn")
	for _, r := range reps[:2] {
		poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
			if a, b := activeRequests(t, r.url(), "dp-1"), activeRequests(t, r.url(), "dp-1#1"); a < 0 || b < 0 {
				return fmt.Errorf("%s does not route to both ranks yet", r.cfg.NodeID)
			}
			return nil
		})
	}
	// Straight to the worker without a rank: refused, loudly.
	req, _ := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", strings.NewReader(`{"model":"kvmock","messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("Authorization", "Bearer dp-1-secret")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(b), "missing_dp_rank") {
		t.Fatalf("no rank: HTTP %d %s", resp.StatusCode, b)
	}

	const traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	body := `{"model":"kvmock","max_tokens":3,"messages":[{"role":"user","content":"` + strings.Repeat("a long shared prompt ", 40) + `"}]}`
	send := func(base string) (booked router.WorkerID, rank string, cached int) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer client-key") // not the worker's: never forwarded
		req.Header.Set("X-Request-Id", "dp-req-"+base[len(base)-5:])
		req.Header.Set("Traceparent", traceparent)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var doc struct {
			Usage struct {
				PromptTokensDetails struct {
					CachedTokens int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if resp.StatusCode != http.StatusOK || json.NewDecoder(resp.Body).Decode(&doc) != nil {
			t.Fatalf("HTTP %d", resp.StatusCode)
		}
		return router.WorkerID(resp.Header.Get("X-Worker-Id")), resp.Header.Get("X-Kvmock-Dp-Rank"), doc.Usage.PromptTokensDetails.CachedTokens
	}
	first, rank, cached := send(reps[0].url())
	if want := map[string]router.WorkerID{"0": "dp-1", "1": "dp-1#1"}[rank]; want == "" || first != want || cached != 0 {
		t.Fatalf("booked %s, served by rank %q with %d cached tokens", first, rank, cached)
	}
	// The serving rank's blocks reach the index of every replica.
	for _, r := range reps {
		poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
			resp, err := http.Post(r.url()+"/debug/route", "application/json", strings.NewReader(body))
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			var doc struct {
				Workers []struct {
					Worker string `json:"worker"`
					Cached int    `json:"cached_blocks"`
				} `json:"workers"`
			}
			if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
				return err
			}
			for _, w := range doc.Workers {
				if (router.WorkerID(w.Worker) == first) != (w.Cached > 0) {
					return fmt.Errorf("%s: %s has %d cached blocks (served on %s)", r.cfg.NodeID, w.Worker, w.Cached, first)
				}
			}
			return nil
		})
	}
	for _, r := range reps[:2] {
		again, againRank, cached := send(r.url())
		if again != first || againRank != rank || cached == 0 {
			t.Fatalf("through %s: booked %s, rank %q, %d cached tokens; want %s, rank %s, a hit", r.cfg.NodeID, again, againRank, cached, first, rank)
		}
	}
	// The worker saw the key (nothing refused), the last request's id and
	// the trace context.
	resp, err = http.Get(url + "/stats")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var stats struct {
		Requests struct {
			Unauthorized int `json:"unauthorized"`
		} `json:"requests"`
		Forwarded struct {
			LastRequestID   string `json:"last_request_id"`
			LastTraceparent string `json:"last_traceparent"`
		} `json:"forwarded"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&stats); err != nil {
		t.Fatal(err)
	}
	last := reps[1].url()
	if stats.Requests.Unauthorized != 0 || stats.Forwarded.LastRequestID != "dp-req-"+last[len(last)-5:] || stats.Forwarded.LastTraceparent != traceparent {
		t.Fatalf("worker stats %+v", stats)
	}
}
