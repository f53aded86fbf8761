package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/pki"
	"github.com/kvrouter/kvrouter/internal/poll"
)

// sessionWorkers starts n fake OpenAI workers that take a few
// milliseconds per answer (so concurrent sessions load them unevenly and
// an unbound router would move a session between them) and registers
// them through base.
func sessionWorkers(t *testing.T, base string, n int) []string {
	t.Helper()
	return sessionWorkersWith(t, base, n, nil)
}

// sessionWorkersWith is sessionWorkers whose workers hand every request
// body to observe (nil: none) before answering.
func sessionWorkersWith(t *testing.T, base string, n int, observe func(body []byte)) []string {
	t.Helper()
	var ids []string
	for i := range n {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			if observe != nil {
				observe(body)
			}
			time.Sleep(5 * time.Millisecond) // the worker's own work, not a synchronisation
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprint(w, `{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":20,"completion_tokens":1}}`)
		}))
		t.Cleanup(srv.Close)
		id := fmt.Sprintf("sw-%d", i)
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

// sessionStatus is the sessions part of /cluster/status.
type sessionStatus struct {
	Sessions struct {
		Bindings  int            `json:"bindings"`
		PerWorker map[string]int `json:"per_worker"`
		Mode      string         `json:"mode"`
	} `json:"sessions"`
	Workers []struct {
		ID       string `json:"id"`
		Bindings int    `json:"session_bindings"`
	} `json:"workers"`
}

func sessionsOf(base string) (sessionStatus, error) {
	var s sessionStatus
	resp, err := http.Get(base + "/cluster/status")
	if err != nil {
		return s, err
	}
	defer resp.Body.Close()
	return s, json.NewDecoder(resp.Body).Decode(&s)
}

// waitRoutable waits until every replica routes to all the workers.
func waitRoutable(t *testing.T, reps []*testReplica, workers []string) {
	t.Helper()
	for _, r := range reps {
		poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
			for _, w := range workers {
				if activeRequests(t, r.url(), w) < 0 {
					return fmt.Errorf("%s does not route to %s yet", r.cfg.NodeID, w)
				}
			}
			return nil
		})
	}
}

// sessionTurn sends one turn of a session and returns the answering worker.
type turnSpec struct {
	base    string
	session string
	turn    int
	inBody  bool // prompt_cache_key instead of X-Dynamo-Session-ID
}

func sendTurn(ts turnSpec) (string, error) {
	msgs := []string{}
	for i := 0; i <= ts.turn; i++ { // the conversation so far, growing each turn
		msgs = append(msgs, fmt.Sprintf(`{"role":"user","content":"session %s turn %d: tell me more"}`, ts.session, i))
	}
	body := `{"model":"kvmock","max_tokens":1,"messages":[` + strings.Join(msgs, ",") + `]`
	if ts.inBody {
		body += fmt.Sprintf(`,"prompt_cache_key":%q`, ts.session)
	}
	body += "}"
	req, err := http.NewRequest(http.MethodPost, ts.base+"/v1/chat/completions", bytes.NewBufferString(body))
	if err != nil {
		return "", err
	}
	req.Header.Set("Content-Type", "application/json")
	if !ts.inBody {
		req.Header.Set("X-Dynamo-Session-ID", ts.session)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		return "", fmt.Errorf("%s turn %d via %s: %d %s", ts.session, ts.turn, ts.base, resp.StatusCode, b)
	}
	return resp.Header.Get("X-Worker-Id"), nil
}

// runSessions plays sessions × turns concurrently (each session's turns in
// order), turn k of session s through replica (s+k) mod len(reps): every
// turn reaches another replica than the one before. It returns the workers
// that answered each session, in turn order.
func runSessions(t *testing.T, reps []*testReplica, prefix string, sessions, turns, from int, inBody bool) map[string][]string {
	t.Helper()
	var mu sync.Mutex
	got := map[string][]string{}
	var wg sync.WaitGroup
	errs := make(chan error, sessions)
	for s := range sessions {
		id := fmt.Sprintf("%s-%02d", prefix, s)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := from; k < from+turns; k++ {
				w, err := sendTurn(turnSpec{base: reps[(s+k)%len(reps)].url(), session: id, turn: k, inBody: inBody})
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				got[id] = append(got[id], w)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	return got
}

// oneWorkerEach checks that each session's turns were answered by one
// worker, and returns how many workers the sessions used in all.
func oneWorkerEach(t *testing.T, got map[string][]string, bound map[string]string) int {
	t.Helper()
	used := map[string]bool{}
	for id, ws := range got {
		for _, w := range ws {
			if w == "" || w != ws[0] || (bound != nil && bound[id] != "" && w != bound[id]) {
				t.Errorf("session %s answered by %v (bound before: %q)", id, ws, bound[id])
				break
			}
		}
		used[ws[0]] = true
	}
	return len(used)
}

// TestServeSessionAffinity: three in-process replicas with
// --router-session-affinity-ttl-secs 300, four workers; 20 sessions × 8
// turns, each turn through a different replica than the last, all
// concurrent (the workers' load differs from turn to turn): every
// session's turns are answered by one worker (X-Worker-Id). The same with
// prompt_cache_key in the body. Every replica then shows the same binding
// (GET /sessions/{id}) and the same per-worker counts (/cluster/status).
func TestServeSessionAffinity(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas")
	}
	t.Parallel()
	reps := newTestCluster(t, func(c *serveConfig) { c.Sessions.TTL = 300 * time.Second })
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(reps); return err })
	workers := sessionWorkers(t, reps[0].url(), 4)
	waitRoutable(t, reps, workers)

	used := oneWorkerEach(t, runSessions(t, reps, "hdr", 20, 8, 0, false), nil)
	used += oneWorkerEach(t, runSessions(t, reps, "pck", 20, 8, 0, true), nil)
	if used < 3 {
		t.Errorf("the sessions used %d workers in all: affinity is not what kept them apart", used)
	}
	poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
		for _, r := range reps {
			s, err := sessionsOf(r.url())
			if err != nil {
				return err
			}
			sum, listed := 0, 0
			for _, n := range s.Sessions.PerWorker {
				sum += n
			}
			for _, w := range s.Workers {
				listed += w.Bindings
			}
			if s.Sessions.Bindings != 40 || sum != 40 || listed != 40 || s.Sessions.Mode != "hard" {
				return fmt.Errorf("%s: %+v", r.cfg.NodeID, s)
			}
		}
		return nil
	})
	// A bound worker leaves: its sessions' next turns, each through
	// another replica, rebind once and agree on the new worker; the other
	// sessions stay where they were.
	hdr := runSessions(t, reps, "hdr", 20, 1, 8, false)
	gone := hdr["hdr-00"][0]
	resp, err := http.Post(reps[1].url()+"/workers/deregister", "application/json", strings.NewReader(fmt.Sprintf(`{"id":%q}`, gone)))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("deregister %s: %v %v", gone, err, resp)
	}
	resp.Body.Close()
	for _, r := range reps {
		poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
			if activeRequests(t, r.url(), gone) >= 0 {
				return fmt.Errorf("%s still routes to %s", r.cfg.NodeID, gone)
			}
			return nil
		})
	}
	after := runSessions(t, reps, "hdr", 20, 3, 9, false)
	oneWorkerEach(t, after, nil)
	for id, ws := range after {
		if was := hdr[id][0]; (was == gone) == (ws[0] == was) {
			t.Errorf("session %s on %s before %s left, on %s after", id, was, gone, ws[0])
		}
	}
	for _, id := range []string{"hdr-07", "pck-13"} {
		var first string
		for _, r := range reps {
			resp, err := http.Get(r.url() + "/sessions/" + id)
			if err != nil {
				t.Fatal(err)
			}
			var b struct {
				Worker string `json:"worker"`
			}
			err = json.NewDecoder(resp.Body).Decode(&b)
			resp.Body.Close()
			if err != nil || resp.StatusCode != 200 || b.Worker == "" || (first != "" && b.Worker != first) {
				t.Fatalf("GET /sessions/%s via %s: %d %+v (%v), first %q", id, r.cfg.NodeID, resp.StatusCode, b, err, first)
			}
			first = b.Worker
		}
	}
}

// TestServeSessionAffinityLeaderFailover: sessions bound before the
// leader is stopped keep their workers through the election and after
// (the bindings are replicated state, not the leader's), new sessions bind
// while it is down, and the restarted replica routes every session to the
// same worker.
func TestServeSessionAffinityLeaderFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas")
	}
	t.Parallel()
	reps := newTestCluster(t, func(c *serveConfig) { c.Sessions.TTL = 300 * time.Second })
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(reps); return err })
	workers := sessionWorkers(t, reps[0].url(), 4)
	waitRoutable(t, reps, workers)

	before := runSessions(t, reps, "fo", 12, 3, 0, false)
	oneWorkerEach(t, before, nil)
	bound := map[string]string{}
	for id, ws := range before {
		bound[id] = ws[0]
	}
	old, err := leaderOf(reps)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("stopping leader %s", old.cfg.NodeID)
	old.stop()
	var alive []*testReplica
	for _, r := range reps {
		if r != old {
			alive = append(alive, r)
		}
	}
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(alive); return err })
	oneWorkerEach(t, runSessions(t, alive, "fo", 12, 3, 3, false), bound)
	fresh := runSessions(t, alive, "new", 6, 3, 0, false) // bound under the new leader
	oneWorkerEach(t, fresh, nil)
	for id, ws := range fresh {
		bound[id] = ws[0]
	}
	old.start()
	waitRoutable(t, []*testReplica{old}, workers)
	for id, w := range bound {
		poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error { // the restarted replica catches up
			got, err := sendTurn(turnSpec{base: old.url(), session: id, turn: 9})
			if err != nil {
				return err
			}
			if got != w {
				return fmt.Errorf("session %s answered by %s via the restarted %s, bound to %s", id, got, old.cfg.NodeID, w)
			}
			return nil
		})
	}
}

// TestServeSessionAffinityTLS: the same over mutual TLS between the
// replicas (the production default), where a follower's binding reaches
// the leader through /cluster/apply under its member certificate: every
// session's turns, each through another replica, answered by one worker.
func TestServeSessionAffinityTLS(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas")
	}
	t.Parallel()
	l := pki.Layout{Dir: filepath.Join(t.TempDir(), "certs")}
	var holders []pki.Holder
	for i := 1; i <= 3; i++ {
		holders = append(holders, pki.Holder{Identity: pki.Node(fmt.Sprintf("r%d", i)), Hosts: []string{"127.0.0.1"}})
	}
	if _, err := l.Ensure(holders); err != nil {
		t.Fatal(err)
	}
	reps := newTestCluster(t, func(c *serveConfig) {
		c.Sessions.TTL = 300 * time.Second
		c.TLS, c.Insecure = l.Material(pki.Node(c.NodeID)), false
		c.AdvertiseHTTP = "https://" + c.HTTPAddr
	})
	workers := sessionWorkers(t, reps[0].url(), 3) // retries until the cluster has formed
	waitRoutable(t, reps, workers)
	used := oneWorkerEach(t, runSessions(t, reps, "tls", 8, 6, 0, false), nil)
	// On failure, each replica's session series say why (misses, follows).
	for _, r := range reps {
		if !t.Failed() {
			break
		}
		resp, _ := http.Get(r.url() + "/metrics")
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "kvrouter_session") && !strings.Contains(l, "bucket") {
				t.Log(r.cfg.NodeID, l)
			}
		}
	}
	if used < 2 {
		t.Errorf("the sessions used %d workers in all", used)
	}
}

// TestServeSessionAffinitySharded: with the index sharded (--raft-groups
// 2) the bindings live in the control group, whatever data group their
// workers are placed in: sessions through rotating replicas keep one
// worker each, and every replica counts the same bindings.
func TestServeSessionAffinitySharded(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas, three Raft groups each")
	}
	t.Parallel()
	reps := newTestCluster(t, func(c *serveConfig) {
		c.Sessions.TTL = 300 * time.Second
		c.RaftGroups = 2
	})
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(reps); return err })
	workers := sessionWorkers(t, reps[0].url(), 4)
	waitRoutable(t, reps, workers)
	if used := oneWorkerEach(t, runSessions(t, reps, "shard", 12, 6, 0, false), nil); used < 2 {
		t.Errorf("the sessions used %d workers in all", used)
	}
	poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
		for _, r := range reps {
			if s, err := sessionsOf(r.url()); err != nil || s.Sessions.Bindings != 12 {
				return fmt.Errorf("%s: %+v (%v)", r.cfg.NodeID, s.Sessions, err)
			}
		}
		return nil
	})
}
