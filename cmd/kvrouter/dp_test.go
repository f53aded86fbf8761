package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// Data-parallel ranks end to end: a kvmock process serving two ranks behind
// one URL (each its own cache and event stream) registers with the
// cluster; the rank a replica books is the rank that serves (kvmock refuses
// a request without one); that rank's events reach the replicated index
// through the bus and Raft, and the same prompt then goes to the same rank
// and hits its cache, through another replica too.
func TestServeDPRanksWithKvmock(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas and a worker process")
	}
	bin := buildKvmock(t, t.TempDir())
	reps := newTestCluster(t, func(c *serveConfig) { c.Models = []string{"kvmock"} })
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(reps); return err })
	st, err := status(reps[0].url())
	if err != nil {
		t.Fatal(err)
	}
	port := freePorts(t, 1)[0]
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	startKvmock(t, bin, "--id", "dp-1", "--addr", fmt.Sprintf("127.0.0.1:%d", port), "--model", "kvmock", "--speedup", "4",
		"--dp-ranks", "2", "--nats", st.NATS, "--register", reps[0].url()+","+reps[1].url(), "--log-level", "warn")
	for _, r := range reps[:2] {
		poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
			if a, b := activeRequests(t, r.url(), "dp-1"), activeRequests(t, r.url(), "dp-1#1"); a < 0 || b < 0 {
				return fmt.Errorf("%s does not route to both ranks yet", r.cfg.NodeID)
			}
			return nil
		})
	}
	// Straight to the worker without a rank: refused, loudly.
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"kvmock","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(b), "missing_dp_rank") {
		t.Fatalf("no rank: HTTP %d %s", resp.StatusCode, b)
	}

	body := `{"model":"kvmock","max_tokens":3,"messages":[{"role":"user","content":"` + strings.Repeat("a long shared prompt ", 40) + `"}]}`
	send := func(base string) (booked router.WorkerID, rank string, cached int) {
		t.Helper()
		resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
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
}
