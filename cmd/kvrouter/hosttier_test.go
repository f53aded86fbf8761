package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
)

// TestServeHostTierRouting: a replica routes a prompt that no worker holds
// on its GPU to the worker holding it in its host (CPU offload) tier,
// with Dynamo's default tier weights, although that worker carries one
// more running request; with both tier weights 0 the same state goes to
// the idler worker. End to end: two kvmock processes (one with
// --host-tier-blocks), their KV events over the replica's JetStream, the
// replicated index's host tier, /debug/route's cost rows, the routed
// request and the cached tokens the worker reports (its host blocks loaded
// back).
func TestServeHostTierRouting(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica and two worker processes")
	}
	t.Parallel() // its own replicas, ports and workers; it mostly waits (elections, workers)
	bin := buildKvmock(t, t.TempDir())
	for _, c := range []struct {
		name string
		args []string
		want string
	}{
		{"default weights", nil, "ht-a"},
		{"tier weights 0", []string{"--router-host-cache-hit-weight", "0", "--router-disk-cache-hit-weight", "0"}, "ht-b"},
	} {
		t.Run(c.name, func(t *testing.T) { hostTierRoute(t, bin, c.args, c.want) })
	}
}

type hostTierRow struct {
	Worker         string  `json:"worker"`
	CachedBlocks   int     `json:"cached_blocks"`
	HostBlocks     int     `json:"host_blocks"`
	TierCredit     float64 `json:"tier_credit"`
	ActiveRequests int     `json:"active_requests"`
	Formula        string  `json:"formula"`
	Cost           float64 `json:"cost"`
}

type tierRouteDoc struct {
	PromptBlocks int           `json:"prompt_blocks"`
	Chosen       string        `json:"chosen"`
	Workers      []hostTierRow `json:"workers"`
}

func (d tierRouteDoc) row(w string) (hostTierRow, bool) {
	for _, r := range d.Workers {
		if r.Worker == w {
			return r, true
		}
	}
	return hostTierRow{}, false
}

func hostTierRoute(t *testing.T, bin string, extra []string, want string) {
	tmp := t.TempDir()
	ports := freePorts(t, 6)
	args := append([]string{"--single-node", "--node-id", "r1", "--router-mode", "kv",
		"--http-addr", fmt.Sprintf("127.0.0.1:%d", ports[0]), "--raft-addr", fmt.Sprintf("127.0.0.1:%d", ports[1]),
		"--nats-addr", fmt.Sprintf("127.0.0.1:%d", ports[2]), "--nats-cluster-addr", fmt.Sprintf("127.0.0.1:%d", ports[3]),
		"--data-dir", filepath.Join(tmp, "r1")}, extra...)
	cfg, err := parseServe(args, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		log := slog.New(slog.NewTextHandler(testWriter{t, "r1"}, &slog.HandlerOptions{Level: slog.LevelWarn}))
		if err := serve(ctx, cfg, log); err != nil {
			t.Errorf("serve: %v", err)
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	base := "http://" + cfg.HTTPAddr
	var st statusDoc
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error {
		if st, err = status(base); err != nil || st.State != "leader" || st.NATS == "" {
			return fmt.Errorf("replica not leading yet (%v)", err)
		}
		return nil
	})
	worker := func(id string, port int, more ...string) {
		startKvmock(t, bin, append([]string{"--id", id, "--addr", fmt.Sprintf("127.0.0.1:%d", port), "--model", "kvmock",
			"--kv-blocks", "256", "--nats", st.NATS, "--register", base, "--log-level", "warn"}, more...)...)
		poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
			if activeRequests(t, base, id) < 0 {
				return fmt.Errorf("the replica does not route to %s yet", id)
			}
			return nil
		})
	}
	complete := func(url, prompt string, maxTokens int) (string, int) {
		t.Helper()
		body, _ := json.Marshal(map[string]any{"model": "kvmock", "prompt": prompt, "max_tokens": maxTokens})
		resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(string(body)))
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
			t.Fatalf("%s: HTTP %d", url, resp.StatusCode)
		}
		return resp.Header.Get("X-Worker-Id"), doc.Usage.PromptTokensDetails.CachedTokens
	}

	// ht-a, alone: a slow host-tier worker; a long request through the
	// replica keeps one request booked on it for the rest of the test.
	wports := freePorts(t, 2)
	worker("ht-a", wports[0], "--host-tier-blocks", "512", "--speedup", "0.25")
	aURL := fmt.Sprintf("http://127.0.0.1:%d", wports[0])
	holdCtx, stopHold := context.WithCancel(context.Background())
	t.Cleanup(stopHold)
	held := make(chan struct{})
	go func() {
		defer close(held)
		// 64 prompt tokens: 4 blocks of load on ht-a while it runs.
		body, _ := json.Marshal(map[string]any{"model": "kvmock", "prompt": words("hold", 64), "max_tokens": 1500, "stream": true})
		req, _ := http.NewRequestWithContext(holdCtx, http.MethodPost, base+"/v1/completions", strings.NewReader(string(body)))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return
		}
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
		}
	}()
	poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error {
		if n := activeRequests(t, base, "ht-a"); n != 1 {
			return fmt.Errorf("ht-a has %d requests booked, want the holder", n)
		}
		return nil
	})

	// The prompt, straight to ht-a, then other prompts until its GPU has
	// evicted it into the host tier (as the replica's index sees it).
	prompt := words("shared", 480)
	routeBody, _ := json.Marshal(map[string]any{"model": "kvmock", "prompt": prompt, "max_tokens": 1})
	debugRoute := func() (tierRouteDoc, error) {
		var d tierRouteDoc
		resp, err := http.Post(base+"/debug/route", "application/json", strings.NewReader(string(routeBody)))
		if err != nil {
			return d, err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return d, fmt.Errorf("/debug/route: HTTP %d", resp.StatusCode)
		}
		return d, json.NewDecoder(resp.Body).Decode(&d)
	}
	complete(aURL, prompt, 1)
	// With both tier weights 0 the router reads no tier (host_blocks 0):
	// there ht-a's own count says the prompt is in its host tier (every
	// block its GPU evicts goes there, and its LRU has dropped none).
	tiered := want == "ht-a"
	offloaded := func() error {
		d, err := debugRoute()
		if err != nil {
			return err
		}
		a, _ := d.row("ht-a")
		if a.CachedBlocks != 0 || (tiered && a.HostBlocks != d.PromptBlocks) || d.PromptBlocks == 0 {
			return fmt.Errorf("ht-a: %d of %d prompt blocks on the GPU, %d in the host tier", a.CachedBlocks, d.PromptBlocks, a.HostBlocks)
		}
		var ks struct {
			HostTier struct {
				Blocks  int `json:"blocks"`
				Evicted int `json:"evicted_blocks"`
			} `json:"host_tier"`
		}
		resp, err := http.Get(aURL + "/stats")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if err := json.NewDecoder(resp.Body).Decode(&ks); err != nil {
			return err
		}
		if ks.HostTier.Evicted != 0 || ks.HostTier.Blocks < d.PromptBlocks {
			t.Fatalf("ht-a's host tier: %+v (its LRU must drop nothing here)", ks.HostTier)
		}
		return nil
	}
	for i := 0; offloaded() != nil; i++ {
		if i == 30 {
			t.Fatalf("the prompt never moved to ht-a's host tier: %v", offloaded())
		}
		// (The index trails the worker by the event pipeline: a filler
		// more than needed only evicts more into the host tier.)
		complete(aURL, words(fmt.Sprintf("fill%c", 'a'+i), 480), 1)
	}

	// ht-b: idle, nothing cached.
	worker("ht-b", wports[1])
	var d tierRouteDoc
	poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
		if d, err = debugRoute(); err != nil {
			return err
		}
		a, okA := d.row("ht-a")
		b, okB := d.row("ht-b")
		if !okA || !okB || a.ActiveRequests != 1 || b.ActiveRequests != 0 || (tiered && a.HostBlocks != d.PromptBlocks) || a.CachedBlocks != 0 || b.CachedBlocks != 0 || b.HostBlocks != 0 {
			return fmt.Errorf("rows %+v", d.Workers)
		}
		return nil
	})
	a, _ := d.row("ht-a")
	b, _ := d.row("ht-b")
	t.Logf("prompt %d blocks; ht-a: %s; ht-b: %s; chosen %s", d.PromptBlocks, a.Formula, b.Formula, d.Chosen)
	// Decisive: no tie for the choice to fall either way.
	if a.Cost == b.Cost {
		t.Fatalf("ht-a and ht-b cost the same (%v)", a.Cost)
	}
	if tiered != (a.TierCredit > 0) {
		t.Errorf("ht-a tier credit %v with the host tier weighted %v", a.TierCredit, tiered)
	}
	if d.Chosen != want {
		t.Fatalf("/debug/route chose %s, want %s: %+v", d.Chosen, want, d.Workers)
	}
	got, cached := complete(base, prompt, 1)
	select {
	case <-held:
		t.Fatal("the holder request ended before the decision: ht-a's extra load was gone (slow machine?)")
	default:
	}
	if got != want {
		t.Fatalf("routed to %s, want %s", got, want)
	}
	loadedBack := func(cached int) {
		t.Helper()
		if full := d.PromptBlocks * 16; cached < full-16 || cached > full {
			t.Fatalf("ht-a reported %d cached tokens, want its %d host blocks loaded back", cached, d.PromptBlocks)
		}
	}
	if tiered {
		loadedBack(cached)
		return
	}
	if cached != 0 {
		t.Fatalf("%s reported %d cached tokens, want 0", got, cached)
	}
	// The control's state was the same: ht-a did hold the prompt in its
	// host tier (sent there directly, it is loaded back).
	_, cached = complete(aURL, prompt, 1)
	loadedBack(cached)
}

// words is n distinct one-token words.
func words(prefix string, n int) string {
	ws := make([]string, n)
	for i := range ws {
		ws[i] = fmt.Sprintf("%s%d", prefix, i)
	}
	return strings.Join(ws, " ")
}
