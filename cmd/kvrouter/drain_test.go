package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
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

// copyWorkers are fake OpenAI workers that record what they receive.
type copyWorkers struct {
	mu   sync.Mutex
	seen map[string][]copySeen // worker id → requests, in arrival order
}

type copySeen struct {
	at        time.Time
	maxTokens float64
	stream    bool
	messages  int // the conversation's length: which turn's prompt
	session   string
}

// isCopy: a drain copy of a session's second turn (the client's turns
// carry its session header; a copy carries none of its headers).
func (r copySeen) isCopy() bool {
	return r.isShadow() && r.messages == 2
}

// isShadow: a drain copy of any turn.
func (r copySeen) isShadow() bool {
	return r.maxTokens == 1 && !r.stream && r.session == ""
}

// start starts n workers dc-0..dc-n-1 and registers them through base.
func (cw *copyWorkers) start(t *testing.T, base string, n int) []string {
	t.Helper()
	cw.seen = map[string][]copySeen{}
	var ids []string
	for i := range n {
		id := fmt.Sprintf("dc-%d", i)
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			var body struct {
				MaxTokens float64           `json:"max_tokens"`
				Stream    bool              `json:"stream"`
				Messages  []json.RawMessage `json:"messages"`
			}
			_ = json.NewDecoder(r.Body).Decode(&body)
			cw.mu.Lock()
			cw.seen[id] = append(cw.seen[id], copySeen{at: time.Now(), maxTokens: body.MaxTokens, stream: body.Stream,
				messages: len(body.Messages), session: r.Header.Get("X-Dynamo-Session-ID")})
			cw.mu.Unlock()
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprint(w, `{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":20,"completion_tokens":1}}`)
		}))
		t.Cleanup(srv.Close)
		body := fmt.Sprintf(`{"id":%q,"url":%q,"model":"kvmock","block_size":16,"total_kv_blocks":100000}`, id, srv.URL)
		poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
			resp, err := http.Post(base+"/workers/register", "application/json", strings.NewReader(body))
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			if resp.StatusCode != 200 {
				b, _ := io.ReadAll(resp.Body)
				return fmt.Errorf("register %s: %d %s", id, resp.StatusCode, b)
			}
			return nil
		})
		ids = append(ids, id)
	}
	return ids
}

func (cw *copyWorkers) requests(id string) []copySeen {
	cw.mu.Lock()
	defer cw.mu.Unlock()
	return slices.Clone(cw.seen[id])
}

// drainWorker drains worker through base (POST /workers/drain), retried
// until it is accepted (202).
func drainWorker(t *testing.T, base, worker string) {
	t.Helper()
	poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
		resp, err := http.Post(base+"/workers/drain", "application/json", strings.NewReader(fmt.Sprintf(`{"id":%q}`, worker)))
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusAccepted {
			b, _ := io.ReadAll(resp.Body)
			return fmt.Errorf("drain %s: %d %s", worker, resp.StatusCode, b)
		}
		return nil
	})
}

// boundWorker is a session's worker on base (GET /sessions/{id}).
func boundWorker(base, id string) (string, error) {
	resp, err := http.Get(base + "/sessions/" + id)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var b struct {
		Worker string `json:"worker"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&b); err != nil || resp.StatusCode != 200 {
		return "", fmt.Errorf("GET /sessions/%s: %d %v", id, resp.StatusCode, err)
	}
	return b.Worker, nil
}

// TestServeDrainShadowMovesSessions is --router-drain-shadow live in
// process: three replicas with session affinity, three workers; sessions
// play two turns through r1; the worker W of the first session is drained
// through r2. Before any further turn, each session bound to W is rebound
// on every replica to another worker, which received a copy of the
// session's last turn (max_tokens 1, not streamed, the two-turn
// conversation) — the copy that moved it; W receives nothing after the
// drain. Each such session's next turn, through r3, is answered by its new
// worker, after the copy arrived there. The other sessions stay put and
// get no copy.
// The same with the index sharded over two data groups (the drain commits
// to the worker's data group, the bindings live in the control group).
func TestServeDrainShadowMovesSessions(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas")
	}
	for _, groups := range []int{1, 2} {
		t.Run(fmt.Sprintf("raft-groups=%d", groups), func(t *testing.T) { drainShadowMovesSessions(t, groups) })
	}
}

func drainShadowMovesSessions(t *testing.T, groups int) {
	reps := newTestCluster(t, func(c *serveConfig) {
		c.Sessions.TTL = 300 * time.Second
		c.DrainShadow = true
		c.RaftGroups = groups
	})
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(reps); return err })
	var cw copyWorkers
	workers := cw.start(t, reps[0].url(), 3)
	waitRoutable(t, reps, workers)

	const sessions = 9
	first := map[string]string{}
	for s := range sessions {
		id := fmt.Sprintf("dr-%d", s)
		for k := range 2 {
			w, err := sendTurn(turnSpec{base: reps[0].url(), session: id, turn: k})
			if err != nil {
				t.Fatal(err)
			}
			if k == 0 {
				first[id] = w
			} else if w != first[id] {
				t.Fatalf("session %s moved from %s to %s before any drain", id, first[id], w)
			}
		}
	}
	gone := first["dr-0"]
	var onGone []string
	for id, w := range first {
		if w == gone {
			onGone = append(onGone, id)
		}
	}
	t.Logf("%d of %d sessions bound to %s, drained", len(onGone), sessions, gone)
	// Nothing runs from here on but the drain and its copies (the copies
	// may start before the drain's answer reaches the test).
	drainedAt := time.Now()
	drainWorker(t, reps[1].url(), gone)

	// Moved by their copies alone: no turn is sent meanwhile.
	moved := map[string]string{}
	for _, r := range reps {
		poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
			for id, was := range first {
				w, err := boundWorker(r.url(), id)
				switch {
				case err != nil:
					return err
				case was != gone && w != was:
					t.Fatalf("%s: session %s moved from %s to %s, its worker was not drained", r.cfg.NodeID, id, was, w)
				case was == gone && w == gone:
					return fmt.Errorf("%s: session %s still bound to the drained %s", r.cfg.NodeID, id, gone)
				case was == gone && moved[id] != "" && moved[id] != w:
					return fmt.Errorf("%s: session %s bound to %s, elsewhere %s", r.cfg.NodeID, id, w, moved[id])
				case was == gone:
					moved[id] = w
				}
			}
			return nil
		})
	}
	for _, r := range cw.requests(gone) {
		if r.at.After(drainedAt) {
			t.Errorf("the drained worker got a request after the drain: %+v", r)
		}
	}
	for id, to := range moved {
		var copied time.Time
		for _, r := range cw.requests(to) {
			if r.isCopy() && r.at.After(drainedAt) {
				copied = r.at
			}
		}
		if copied.IsZero() {
			t.Fatalf("session %s moved to %s without a copy there: %+v", id, to, cw.requests(to))
		}
		// The next turn, through another replica: on the new worker,
		// after its copy.
		w, err := sendTurn(turnSpec{base: reps[2].url(), session: id, turn: 2})
		if err != nil || w != to {
			t.Fatalf("session %s's next turn answered by %q (%v), moved to %s", id, w, err, to)
		}
		reqs := cw.requests(to)
		if last := reqs[len(reqs)-1]; last.messages != 3 || !last.at.After(copied) {
			t.Errorf("session %s: its next turn %+v, its copy at %v", id, last, copied)
		}
	}
	if len(moved) != len(onGone) {
		t.Errorf("moved %v, bound to %s before: %v", moved, gone, onGone)
	}
	var copies int
	for _, w := range workers {
		for _, r := range cw.requests(w) {
			if r.isCopy() && r.at.After(drainedAt) {
				copies++
			}
		}
	}
	if copies != len(onGone) {
		t.Errorf("%d copies for %d sessions on %s", copies, len(onGone), gone)
	}
}

// TestServeDrainShadowSpreadTurns: sessions play three turns, turn k
// through replica k, rounds 300 ms apart, so each replica holds a
// different turn of every session. When the worker of the first session
// is drained, the replica holding the newest turn copies first (the
// others wait longer: copyDelay of their turns' ages), so the first copy
// each moved session's new worker receives is of its newest turn (three
// messages), and once it rebinds the others skip: fewer copies than one
// per replica per session (without the stagger, every replica copied at
// once: three per session).
func TestServeDrainShadowSpreadTurns(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas")
	}
	reps := newTestCluster(t, func(c *serveConfig) {
		c.Sessions.TTL = 300 * time.Second
		c.DrainShadow = true
	})
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(reps); return err })
	var cw copyWorkers
	workers := cw.start(t, reps[0].url(), 3)
	waitRoutable(t, reps, workers)

	const sessions, turns = 9, 3
	home := map[string]string{}
	for k := range turns {
		if k > 0 {
			time.Sleep(300 * time.Millisecond) // the workload's shape: turns apart in time, as a conversation's are
		}
		for s := range sessions {
			id := fmt.Sprintf("sp-%d", s)
			w, err := sendTurn(turnSpec{base: reps[k].url(), session: id, turn: k})
			switch {
			case err != nil:
				t.Fatal(err)
			case k == 0:
				home[id] = w
			case w != home[id]:
				t.Fatalf("session %s moved from %s to %s before any drain", id, home[id], w)
			}
		}
	}
	gone := home["sp-0"]
	var onGone []string
	for id, w := range home {
		if w == gone {
			onGone = append(onGone, id)
		}
	}
	drainedAt := time.Now()
	drainWorker(t, reps[1].url(), gone)
	moved := map[string]string{}
	poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
		for _, r := range reps {
			for _, id := range onGone {
				w, err := boundWorker(r.url(), id)
				switch {
				case err != nil:
					return err
				case w == gone:
					return fmt.Errorf("%s: session %s still bound to the drained %s", r.cfg.NodeID, id, gone)
				}
				moved[id] = w
			}
		}
		return nil
	})
	// Count once every replica finished its drain's copies (a skipped
	// copy sends nothing, so only the end of the round says it was
	// skipped).
	for _, r := range reps {
		poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
			resp, err := http.Get(r.url() + "/metrics")
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			if !strings.Contains(string(b), "\nkvrouter_drain_copy_rounds_total 1\n") {
				return fmt.Errorf("%s: drain copies not finished", r.cfg.NodeID)
			}
			return nil
		})
	}
	var copies int
	for _, id := range onGone {
		var first *copySeen
		for _, r := range cw.requests(moved[id]) {
			if r.isShadow() && r.at.After(drainedAt) {
				if first == nil {
					first = &r
				}
			}
		}
		if first == nil || first.messages != turns {
			t.Errorf("session %s moved to %s: its first copy there %+v, want its newest turn (%d messages)", id, moved[id], first, turns)
		}
	}
	for _, w := range workers {
		for _, r := range cw.requests(w) {
			if r.isShadow() && r.at.After(drainedAt) {
				copies++
			}
		}
	}
	t.Logf("%d sessions moved off %s with %d copies (3 replicas each holding one turn)", len(onGone), gone, copies)
	if copies < len(onGone) || copies >= turns*len(onGone) {
		t.Errorf("%d copies for %d sessions: want at least one each and fewer than one per replica each", copies, len(onGone))
	}
}
