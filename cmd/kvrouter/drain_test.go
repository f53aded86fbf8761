package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
)

// workerStates is, per worker id in base's /cluster/status, whether it is
// drained.
func workerStates(base string) (map[string]bool, error) {
	resp, err := http.Get(base + "/cluster/status?digest=0")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var doc struct {
		Workers []struct {
			ID      string `json:"id"`
			Drained bool   `json:"drained"`
		} `json:"workers"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
		return nil, err
	}
	out := map[string]bool{}
	for _, w := range doc.Workers {
		out[w.ID] = w.Drained
	}
	return out, nil
}

// TestServeShardedWorkerDrain is issue 29's live drain in process, with
// the index sharded over two data groups: a request runs on worker d-a;
// d-a is drained through another replica; every replica then says d-a is
// drained (status, metric, fleet plan) and routes new requests to d-b
// only; the running request finishes with 200; then d-a's group's leader
// deregisters it, and every replica agrees.
func TestServeShardedWorkerDrain(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas")
	}
	reps := newTestCluster(t, func(c *serveConfig) { c.RaftGroups = 2 })
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(reps); return err })

	// d-a answers once released; d-b at once. Both speak just enough
	// OpenAI for the proxy.
	release := make(chan struct{})
	answer := func(hold bool, who string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if !strings.HasSuffix(r.URL.Path, "/chat/completions") {
				http.NotFound(w, r)
				return
			}
			if hold {
				select {
				case <-release:
				case <-r.Context().Done():
					return
				}
			}
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"choices":[{"message":{"content":%q}}],"usage":{"prompt_tokens":8,"completion_tokens":1}}`, who)
		}
	}
	slow := httptest.NewServer(answer(true, "d-a"))
	defer slow.Close()
	fast := httptest.NewServer(answer(false, "d-b"))
	defer fast.Close()
	register := func(id, url string) {
		body := fmt.Sprintf(`{"id":%q,"url":%q,"model":"kvmock","block_size":16,"total_kv_blocks":1000}`, id, url)
		poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
			resp, err := http.Post(reps[0].url()+"/workers/register", "application/json", bytes.NewBufferString(body))
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				b, _ := io.ReadAll(resp.Body)
				return fmt.Errorf("register %s: %d %s", id, resp.StatusCode, b)
			}
			return nil
		})
	}
	chat := func(base string) (int, string, error) {
		resp, err := http.Post(base+"/v1/chat/completions", "application/json",
			bytes.NewBufferString(`{"model":"kvmock","messages":[{"role":"user","content":"hello"}]}`))
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		io.Copy(io.Discard, resp.Body)
		return resp.StatusCode, resp.Header.Get("X-Worker-Id"), nil
	}

	// The only worker: the request lands on d-a and stays there.
	register("d-a", slow.URL)
	poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
		for _, r := range reps {
			if ws, err := workerStates(r.url()); err != nil || len(ws) != 1 {
				return fmt.Errorf("%s: workers %v %v", r.cfg.NodeID, ws, err)
			}
		}
		return nil
	})
	type result struct {
		code   int
		worker string
		err    error
	}
	running := make(chan result, 1)
	go func() {
		code, w, err := chat(reps[0].url())
		running <- result{code, w, err}
	}()
	register("d-b", fast.URL)

	// Drain d-a through another replica, once the request is booked
	// (replica sync tells the leaders).
	var drained map[string]any
	poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
		resp, err := http.Post(reps[1].url()+"/workers/drain", "application/json", bytes.NewBufferString(`{"id":"d-a"}`))
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusAccepted {
			return fmt.Errorf("drain: %d %s", resp.StatusCode, b)
		}
		return json.Unmarshal(b, &drained)
	})
	if drained["drained"] != true {
		t.Fatalf("drain answer %v", drained)
	}
	for _, r := range reps {
		poll.Until(t, 10*time.Second, 50*time.Millisecond, func() error {
			ws, err := workerStates(r.url())
			if err != nil {
				return err
			}
			if !ws["d-a"] || ws["d-b"] {
				return fmt.Errorf("%s: drained %v", r.cfg.NodeID, ws)
			}
			resp, err := http.Get(r.url() + "/metrics")
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			if !strings.Contains(string(b), `kvrouter_worker_drained{worker="d-a"} 1`) {
				return fmt.Errorf("%s: no drained metric for d-a", r.cfg.NodeID)
			}
			return nil
		})
		// New requests go to d-b only, on every replica.
		for range 5 {
			code, w, err := chat(r.url())
			if err != nil || code != http.StatusOK || w != "d-b" {
				t.Fatalf("%s: a new request after the drain: %d on %q, %v", r.cfg.NodeID, code, w, err)
			}
		}
	}
	select {
	case res := <-running:
		t.Fatalf("the running request ended before its worker answered: %+v", res)
	default:
	}
	ws, err := workerStates(reps[2].url())
	if err != nil || !ws["d-a"] {
		t.Fatalf("d-a left while its request ran: %v %v", ws, err)
	}

	close(release)
	if res := <-running; res.err != nil || res.code != http.StatusOK || res.worker != "d-a" {
		t.Fatalf("the request running during the drain: %+v", res)
	}
	poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
		for _, r := range reps {
			ws, err := workerStates(r.url())
			if err != nil {
				return err
			}
			if _, ok := ws["d-a"]; ok || len(ws) != 1 {
				return fmt.Errorf("%s: workers %v", r.cfg.NodeID, ws)
			}
		}
		return nil
	})
}
