package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
)

// pinBody is a chat request whose one user message is prefix + suffix,
// with the nvext object given ("" = none).
func pinBody(prefix, suffix, nvext string) string {
	b := fmt.Sprintf(`{"model":"kvmock","max_tokens":1,"messages":[{"role":"user","content":%q}]`, prefix+suffix)
	if nvext != "" {
		b += `,"nvext":` + nvext
	}
	return b + "}"
}

// postChat sends a chat body and returns the status, the answering worker
// and the body.
func postChat(base, body string) (int, string, string) {
	resp, err := http.Post(base+"/v1/chat/completions", "application/json", bytes.NewBufferString(body))
	if err != nil {
		return 0, "", err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("X-Worker-Id"), string(b)
}

// pinList is GET /pins.
type pinList struct {
	Count int `json:"count"`
	Pins  []struct {
		Worker string `json:"worker"`
		Blocks int    `json:"blocks"`
	} `json:"pins"`
}

func pinsOf(base string) (pinList, error) {
	var p pinList
	resp, err := http.Get(base + "/pins")
	if err != nil {
		return p, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return p, fmt.Errorf("GET /pins: %d", resp.StatusCode)
	}
	return p, json.NewDecoder(resp.Body).Decode(&p)
}

// TestServePrefixPins: three in-process replicas with
// --enable-agentic-cache-control and four workers. A request with
// nvext.cache_control through one replica pins its prefix on the worker
// that served it; every replica then lists the pin (GET /pins,
// /cluster/status) and sends concurrent requests starting with that
// prefix, through the other replicas, to that worker, while requests of
// another prefix spread over several workers (so the pin is what kept
// them together). The worker gets cache_control in the body untouched.
// Malformed cache_control and latency_sensitivity are 400s that pin
// nothing. When the holder leaves, the next request goes elsewhere and the
// pin moves there, on every replica.
func TestServePrefixPins(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas")
	}
	t.Parallel()
	reps := newTestCluster(t, func(c *serveConfig) { c.Pins = true })
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(reps); return err })
	var sawCacheControl atomic.Int64
	workers := sessionWorkersWith(t, reps[0].url(), 4, func(body []byte) {
		if bytes.Contains(body, []byte(`"cache_control":{"type":"ephemeral","ttl":"5m"}`)) {
			sawCacheControl.Add(1)
		}
	})
	waitRoutable(t, reps, workers)

	// The pin is made through a follower: its write is forwarded to the
	// control group's leader.
	leader, err := leaderOf(reps)
	if err != nil {
		t.Fatal(err)
	}
	via := reps[0]
	if via == leader {
		via = reps[1]
	}
	prefix := strings.Repeat("the agent's system prompt and the conversation so far. ", 20)
	code, holder, body := postChat(via.url(), pinBody(prefix, "turn 1", `{"cache_control":{"type":"ephemeral","ttl":"5m"}}`))
	if code != 200 || holder == "" {
		t.Fatalf("pinning request: %d %s", code, body)
	}
	if sawCacheControl.Load() != 1 {
		t.Fatal("the worker did not get nvext.cache_control in the body")
	}
	for _, r := range reps {
		poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
			p, err := pinsOf(r.url())
			if err != nil {
				return err
			}
			if p.Count != 1 || p.Pins[0].Worker != holder || p.Pins[0].Blocks < 5 {
				return fmt.Errorf("%s lists %+v, want one pin of ≥ 5 blocks on %s", r.cfg.NodeID, p, holder)
			}
			return nil
		})
	}

	// Concurrent requests: those starting with the pinned prefix, through
	// two replicas (the other one included), all on the holder; those of
	// another prefix spread by load.
	send := func(prefix string, n int) map[string]int {
		var mu sync.Mutex
		used := map[string]int{}
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				code, w, body := postChat(reps[1+i%2].url(), pinBody(prefix, fmt.Sprintf("turn %d", i+2), ""))
				if code != 200 {
					t.Errorf("request %d: %d %s", i, code, body)
					return
				}
				mu.Lock()
				used[w]++
				mu.Unlock()
			}()
		}
		wg.Wait()
		return used
	}
	if used := send(prefix, 24); len(used) != 1 || used[holder] != 24 {
		t.Errorf("requests of the pinned prefix went to %v, want all on %s", used, holder)
	}
	if used := send(strings.Repeat("an unpinned conversation. ", 40), 24); len(used) < 2 {
		t.Errorf("requests of an unpinned prefix all went to %v: the pin is not what kept the others together", used)
	}

	// Bad input: 400 with a JSON error, nothing pinned.
	for _, nv := range []string{
		`{"cache_control":{"type":"ephemeral","ttl":"5x"}}`,
		`{"cache_control":{"type":"ephemeral","ttl":"2h"}}`,
		`{"cache_control":{"type":"ephemeral","ttl":300}}`,
		`{"cache_control":{"type":"persistent"}}`,
		`{"cache_control":"yes"}`,
		`{"agent_hints":{"latency_sensitivity":-1}}`,
		`{"agent_hints":{"latency_sensitivity":"high"}}`,
	} {
		code, _, body := postChat(reps[2].url(), pinBody("a different prompt entirely, long enough to hash a few blocks. ", nv, nv))
		var e struct {
			Error struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if code != 400 || json.Unmarshal([]byte(body), &e) != nil || e.Error.Message == "" {
			t.Errorf("%s: %d %s, want a 400 with a JSON error", nv, code, body)
		}
	}
	for _, r := range reps {
		var s struct {
			Pins struct {
				Enabled   bool           `json:"enabled"`
				Pins      int            `json:"pins"`
				PerWorker map[string]int `json:"per_worker"`
			} `json:"pins"`
		}
		resp, err := http.Get(r.url() + "/cluster/status")
		if err != nil {
			t.Fatal(err)
		}
		err = json.NewDecoder(resp.Body).Decode(&s)
		resp.Body.Close()
		if err != nil || !s.Pins.Enabled || s.Pins.Pins != 1 || s.Pins.PerWorker[holder] != 1 {
			t.Fatalf("%s status pins %+v (%v)", r.cfg.NodeID, s.Pins, err)
		}
	}

	// The holder leaves: the pin moves with the next request's worker.
	resp, err := http.Post(reps[1].url()+"/workers/deregister", "application/json", strings.NewReader(fmt.Sprintf(`{"id":%q}`, holder)))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("deregister %s: %v %v", holder, err, resp)
	}
	resp.Body.Close()
	for _, r := range reps {
		poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
			if activeRequests(t, r.url(), holder) >= 0 {
				return fmt.Errorf("%s still routes to %s", r.cfg.NodeID, holder)
			}
			return nil
		})
	}
	code, moved, body := postChat(reps[1].url(), pinBody(prefix, "after the holder left", ""))
	if code != 200 || moved == holder || moved == "" {
		t.Fatalf("after %s left: %d %q %s", holder, code, moved, body)
	}
	for _, r := range reps {
		poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
			p, err := pinsOf(r.url())
			if err != nil {
				return err
			}
			if p.Count != 1 || p.Pins[0].Worker != moved {
				return fmt.Errorf("%s lists %+v, want the pin moved to %s", r.cfg.NodeID, p, moved)
			}
			return nil
		})
	}
	if used := send(prefix, 12); len(used) != 1 || used[moved] != 12 {
		t.Errorf("after the move the pinned prefix went to %v, want all on %s", used, moved)
	}

	// An operator ends the worker's pins through a follower: gone everywhere.
	req, _ := http.NewRequest(http.MethodDelete, via.url()+"/pins", strings.NewReader(fmt.Sprintf(`{"worker":%q}`, moved)))
	req.Header.Set("Content-Type", "application/json")
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(b), `"unpinned":1`) {
		t.Fatalf("DELETE /pins: %d %s", resp.StatusCode, b)
	}
	for _, r := range reps {
		poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
			if p, err := pinsOf(r.url()); err != nil || p.Count != 0 {
				return fmt.Errorf("%s lists %+v (%v) after the unpin", r.cfg.NodeID, p, err)
			}
			return nil
		})
	}
}
