package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// stageLog records which session each fake two-stage worker served, by
// stage: prefill[session] and decode[session] are the workers, in order.
type stageLog struct {
	mu      sync.Mutex
	prefill map[string][]string
	decode  map[string][]string
}

func (l *stageLog) add(stage map[string][]string, session, worker string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	stage[session] = append(stage[session], worker)
}

func (l *stageLog) of(stage map[string][]string, session string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), stage[session]...)
}

// stageWorkers starts fake vLLM workers speaking the NIXL proxy protocol
// (a prefill answers kv_transfer_params, a decode answers the turn) and
// registers them with their role through base.
func stageWorkers(t *testing.T, base string, log *stageLog, role string, ids ...string) {
	t.Helper()
	for _, id := range ids {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			var body struct {
				Params map[string]any `json:"kv_transfer_params"`
			}
			_ = json.NewDecoder(r.Body).Decode(&body)
			session := r.Header.Get("X-Dynamo-Session-ID")
			w.Header().Set("Content-Type", "application/json")
			if body.Params["do_remote_decode"] == true {
				log.add(log.prefill, session, id)
				fmt.Fprintf(w, `{"choices":[{"text":"x"}],"usage":{"prompt_tokens":40,"completion_tokens":1},"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":%q,"transfer_id":"t","num_tokens":40}}`, id)
				return
			}
			log.add(log.decode, session, id)
			time.Sleep(3 * time.Millisecond) // the worker's own work, not a synchronisation
			fmt.Fprint(w, `{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":40,"completion_tokens":1}}`)
		}))
		t.Cleanup(srv.Close)
		body := fmt.Sprintf(`{"id":%q,"url":%q,"model":"kvmock","block_size":16,"total_kv_blocks":100000,"role":%q}`, id, srv.URL, role)
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
	}
}

// waitRoles waits until every replica has the workers with their roles.
func waitRoles(t *testing.T, reps []*testReplica, want map[string]string) {
	t.Helper()
	for _, r := range reps {
		poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
			var doc struct {
				Workers []struct{ ID, Role string } `json:"workers"`
			}
			resp, err := http.Get(r.url() + "/cluster/status?digest=0")
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
				return err
			}
			got := map[string]string{}
			for _, w := range doc.Workers {
				got[w.ID] = w.Role
			}
			for id, role := range want {
				if got[id] != role {
					return fmt.Errorf("%s: workers %v", r.cfg.NodeID, got)
				}
			}
			if len(got) != len(want) {
				return fmt.Errorf("%s: workers %v", r.cfg.NodeID, got)
			}
			return nil
		})
	}
}

// stagedBinding is GET /sessions/{id} of a two-stage binding.
type stagedBinding struct {
	Worker  string `json:"worker"`
	Prefill string `json:"prefill_worker"`
	Decode  string `json:"decode_worker"`
}

func getStagedBinding(base, id string) (stagedBinding, error) {
	var b stagedBinding
	resp, err := http.Get(base + "/sessions/" + id)
	if err != nil {
		return b, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return b, fmt.Errorf("GET /sessions/%s: %d", id, resp.StatusCode)
	}
	return b, json.NewDecoder(resp.Body).Decode(&b)
}

// sameEach reports the sessions whose workers were not all one.
func sameEach(log *stageLog, stage map[string][]string, ids []string) (map[string]string, error) {
	out := map[string]string{}
	for _, id := range ids {
		ws := log.of(stage, id)
		if len(ws) == 0 {
			return nil, fmt.Errorf("session %s reached no worker", id)
		}
		for _, w := range ws {
			if w != ws[0] {
				return nil, fmt.Errorf("session %s served by %v", id, ws)
			}
		}
		out[id] = ws[0]
	}
	return out, nil
}

// TestServeSessionStages: three in-process replicas with session affinity
// and --disagg always in front of three prefill and two decode workers
// (fakes speaking the NIXL proxy protocol). 12 sessions × 6 turns, each
// turn through another replica than the last, all concurrent: every
// session's prefills reach one prefill worker and its answers one decode
// worker, and every replica shows the same two-stage binding. Then a
// session's prefill worker leaves while another prefill worker holds the
// session's next prompt (its KV events published on the bus): the next
// turns, through every replica, rebind the prefill stage to that worker
// and keep the decode worker. Then a decode worker leaves: its sessions
// rebind that stage and keep their prefill workers.
func TestServeSessionStages(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas")
	}
	t.Parallel()
	reps := newTestCluster(t, func(c *serveConfig) {
		c.Sessions.TTL = 300 * time.Second
		c.Disagg.Mode = router.DisaggAlways
		c.Models = []string{"kvmock"}
	})
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(reps); return err })
	log := &stageLog{prefill: map[string][]string{}, decode: map[string][]string{}}
	stageWorkers(t, reps[0].url(), log, "prefill", "sp-0", "sp-1", "sp-2")
	stageWorkers(t, reps[1].url(), log, "decode", "sd-0", "sd-1")
	waitRoles(t, reps, map[string]string{"sp-0": "prefill", "sp-1": "prefill", "sp-2": "prefill", "sd-0": "decode", "sd-1": "decode"})

	const sessions, turns = 12, 6
	var ids []string
	for s := range sessions {
		ids = append(ids, fmt.Sprintf("st-%02d", s))
	}
	answered := runSessions(t, reps, "st", sessions, turns, 0, false)
	decodeOf := map[string]string{}
	for id, ws := range answered {
		for _, w := range ws {
			if w != ws[0] {
				t.Fatalf("session %s answered by %v", id, ws)
			}
		}
		decodeOf[id] = ws[0]
	}
	prefillOf, err := sameEach(log, log.prefill, ids)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sameEach(log, log.decode, ids); err != nil {
		t.Fatal(err)
	}
	used := map[string]bool{}
	for _, id := range ids {
		used[prefillOf[id]], used[decodeOf[id]] = true, true
		for _, r := range reps {
			b, err := getStagedBinding(r.url(), id)
			if err != nil || b.Prefill != prefillOf[id] || b.Decode != decodeOf[id] || b.Worker != decodeOf[id] {
				t.Fatalf("%s via %s: %+v (%v), served %s → %s", id, r.cfg.NodeID, b, err, prefillOf[id], decodeOf[id])
			}
		}
	}
	if len(used) < 3 {
		t.Errorf("the sessions used %d workers in all: affinity is not what kept them apart", len(used))
	}
	for _, r := range reps {
		if n := metricValue(t, r.url(), "kvrouter_session_turns_total", `outcome="bound"`); n == 0 {
			t.Errorf("%s counted no bound two-stage turn", r.cfg.NodeID)
		}
	}

	// Session st-00's prefill worker leaves; another prefill worker holds
	// its next prompt.
	victim := "st-00"
	gone := prefillOf[victim]
	holder := "sp-0"
	for _, w := range []string{"sp-0", "sp-1", "sp-2"} {
		if w != gone {
			holder = w
		}
	}
	next := turnBody(victim, turns)
	var tok struct{ Tokens []uint32 }
	adminJSON(t, reps[0].url(), "/tokenize", next, &tok)
	hashes := router.SaltedSequenceHashes(tok.Tokens, 16, "", "")
	if len(hashes) < 2 {
		t.Fatalf("the prompt makes %d blocks", len(hashes))
	}
	publishStored(t, reps[0].cfg.NATSAddr, holder, hashes)
	resp, err := http.Post(reps[1].url()+"/workers/deregister", "application/json", strings.NewReader(fmt.Sprintf(`{"id":%q}`, gone)))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("deregister %s: %v %v", gone, err, resp)
	}
	resp.Body.Close()
	delete(used, gone)
	want := map[string]string{"sp-0": "prefill", "sp-1": "prefill", "sp-2": "prefill", "sd-0": "decode", "sd-1": "decode"}
	delete(want, gone)
	waitRoles(t, reps, want)
	// The holder's blocks reached every replica's index.
	for _, r := range reps {
		poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
			if n := cachedBlocksOn(t, r.url(), next, holder); n < len(hashes) {
				return fmt.Errorf("%s sees %d of %d blocks on %s", r.cfg.NodeID, n, len(hashes), holder)
			}
			return nil
		})
	}
	log.mu.Lock()
	clear(log.prefill)
	clear(log.decode)
	log.mu.Unlock()
	after := runSessions(t, reps, "st", sessions, 3, turns, false)
	for id, ws := range after {
		for _, w := range ws {
			if w != decodeOf[id] {
				t.Errorf("session %s answered by %v after %s left, bound to %s", id, ws, gone, decodeOf[id])
			}
		}
	}
	prefillAfter, err := sameEach(log, log.prefill, ids)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		switch {
		case id == victim && prefillAfter[id] != holder:
			t.Errorf("%s rebound its prefill to %s, not to %s holding its prefix", id, prefillAfter[id], holder)
		case prefillOf[id] != gone && prefillAfter[id] != prefillOf[id]:
			t.Errorf("%s moved its prefill from %s to %s though %s is alive", id, prefillOf[id], prefillAfter[id], prefillOf[id])
		}
		for _, r := range reps {
			b, err := getStagedBinding(r.url(), id)
			if err != nil || b.Prefill != prefillAfter[id] || b.Decode != decodeOf[id] {
				t.Fatalf("%s via %s after the rebind: %+v (%v)", id, r.cfg.NodeID, b, err)
			}
		}
	}

	// A decode worker leaves: its sessions' next turns rebind that stage
	// (to the one decode worker left) and keep their prefill workers.
	goneDecode := decodeOf["st-01"]
	resp, err = http.Post(reps[2].url()+"/workers/deregister", "application/json", strings.NewReader(fmt.Sprintf(`{"id":%q}`, goneDecode)))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("deregister %s: %v %v", goneDecode, err, resp)
	}
	resp.Body.Close()
	delete(want, goneDecode)
	waitRoles(t, reps, want)
	log.mu.Lock()
	clear(log.prefill)
	log.mu.Unlock()
	last := runSessions(t, reps, "st", sessions, 2, turns+3, false)
	prefillLast, err := sameEach(log, log.prefill, ids)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		ws := last[id]
		if ws[0] == goneDecode || ws[0] != ws[len(ws)-1] || (decodeOf[id] != goneDecode && ws[0] != decodeOf[id]) {
			t.Errorf("session %s answered by %v after %s left (bound to %s)", id, ws, goneDecode, decodeOf[id])
		}
		if prefillLast[id] != prefillAfter[id] {
			t.Errorf("session %s moved its prefill from %s to %s when a decode worker left", id, prefillAfter[id], prefillLast[id])
		}
		for _, r := range reps {
			b, err := getStagedBinding(r.url(), id)
			if err != nil || b.Prefill != prefillAfter[id] || b.Decode != ws[0] {
				t.Fatalf("%s via %s after the decode rebind: %+v (%v)", id, r.cfg.NodeID, b, err)
			}
		}
	}
	if n := metricValue(t, reps[0].url(), "kvrouter_session_rebinds_total", `reason="worker_gone"`) +
		metricValue(t, reps[1].url(), "kvrouter_session_rebinds_total", `reason="worker_gone"`) +
		metricValue(t, reps[2].url(), "kvrouter_session_rebinds_total", `reason="worker_gone"`); n < 1 {
		t.Errorf("no rebind counted")
	}
}

// turnBody is the chat body sendTurn sends for a session's turn.
func turnBody(session string, turn int) string {
	msgs := []string{}
	for i := 0; i <= turn; i++ {
		msgs = append(msgs, fmt.Sprintf(`{"role":"user","content":"session %s turn %d: tell me more"}`, session, i))
	}
	return `{"model":"kvmock","max_tokens":1,"messages":[` + strings.Join(msgs, ",") + `]}`
}

// publishStored publishes worker's cache of hashes (one chain) on the bus.
func publishStored(t *testing.T, natsAddr, worker string, hashes []uint64) {
	t.Helper()
	nc, err := eventbus.Connect("nats://"+natsAddr, "test-"+worker, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	pub, err := eventbus.NewPublisher(nc, worker, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	var blocks []eventbus.WireBlock
	for _, h := range hashes {
		blocks = append(blocks, eventbus.WireBlock{Engine: h, Content: h})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := pub.PublishAsync(ctx, eventbus.WireEvent{Kind: uint8(router.EventStored), BlockSize: 16, Blocks: blocks}); err != nil {
		t.Fatal(err)
	}
	if err := pub.Flush(ctx); err != nil {
		t.Fatal(err)
	}
}

// cachedBlocksOn is worker's cached blocks for body in base's /debug/route (the
// prefill router's table of a two-stage model); -1 when not listed.
func cachedBlocksOn(t *testing.T, base, body, worker string) int {
	t.Helper()
	resp, err := http.Post(base+"/debug/route", "application/json", strings.NewReader(body))
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	// Any table naming the worker with its cached blocks will do.
	var doc map[string]any
	if json.Unmarshal(b, &doc) != nil {
		return -1
	}
	best := -1
	var walk func(v any)
	walk = func(v any) {
		switch x := v.(type) {
		case map[string]any:
			if x["worker"] == worker {
				if n, ok := x["cached_blocks"].(float64); ok && int(n) > best {
					best = int(n)
				}
			}
			for _, y := range x {
				walk(y)
			}
		case []any:
			for _, y := range x {
				walk(y)
			}
		}
	}
	walk(doc)
	return best
}
