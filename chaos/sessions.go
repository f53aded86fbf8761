//go:build chaos

package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"
)

// AF1: session affinity across leader failovers (issue 28). The replicas
// run with --router-session-affinity-ttl-secs 300 (hard mode): a session's
// binding (session → worker) is replicated state of the control group,
// committed through its leader on the session's first turn and read
// locally on every later turn. Session clients run agent-like sessions
// through HAProxy — afSessionTurns turns each, every turn's chat body the
// conversation so far plus a new user message, half of the sessions named
// by X-Dynamo-Session-ID and half by the body's prompt_cache_key, one new
// connection per turn so HAProxy spreads a session's turns over the
// replicas — while the leader (of the control group, which holds the
// bindings) is SIGKILLed every 10 s and restarted 5 s later. The common
// workload (route and admin clients, ledger) runs beside them.
//
// Checked, besides the common checks:
//   - ≥ 99.9 % of the answered turns were answered by their session's
//     worker (X-Worker-Id), the binding every replica reports at the end;
//     a turn whose first try failed and whose retry was answered counts
//     where the retry was served;
//   - no binding lost: GET /sessions/{id} (admin) on every replica, after
//     heal and drain, answers 200 with the same worker for every session
//     that had a turn answered;
//   - session turns available (one retry) as the route clients are in T1.

// afServeArgs turns session affinity on for every AF1 replica, and
// snapshots after 256 entries (instead of 2048, which AF1's log does not
// reach in a minute): raft checks every 30-60 s, so the replicas killed
// after that restart from a snapshot holding bindings, not from the log
// alone.
var afServeArgs = []string{"--router-session-affinity-ttl-secs", "300", "--router-snapshot-threshold", "256"}

// afMinDuration: kills at 10, 20, ... 50 s, the later ones after the
// replicas' first snapshot check (30-60 s).
const afMinDuration = 60 * time.Second

const (
	afSessionClients = 6
	afSessionTurns   = 8
	// afTurnTimeout covers a first turn that waits for a leader to commit
	// its binding (BindSession waits up to 5 s during an election).
	afTurnTimeout = 10 * time.Second
	afThink       = 100 * time.Millisecond // between a session's turns
	afKillEvery   = 10 * time.Second
	afDownFor     = 5 * time.Second
)

// afTurn is one answered or failed turn of a session.
type afTurn struct {
	Session string    `json:"session"`
	Turn    int       `json:"turn"`
	At      time.Time `json:"at"`
	Worker  string    `json:"worker"` // X-Worker-Id of the answer ("" when it failed)
	Retried bool      `json:"retried"`
	Err     string    `json:"err,omitempty"`
}

// afRun is what AF1's nemesis hands to its check.
type afRun struct {
	mu       sync.Mutex
	turns    []afTurn
	sessions []string // in start order
}

func (r *afRun) add(t afTurn) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.turns = append(r.turns, t)
}

func (r *afRun) started(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sessions = append(r.sessions, id)
}

func af1Nemesis(e *env) error {
	run := &afRun{}
	e.af = run
	ctx, stop := context.WithCancel(e.ctx)
	var wg sync.WaitGroup
	for c := 0; c < afSessionClients; c++ {
		wg.Add(1)
		go func() { defer wg.Done(); sessionClient(ctx, c, e.acc, run) }()
	}
	e.event("workload", "%d session clients via HAProxy: %d turns per session, X-Dynamo-Session-ID or prompt_cache_key", afSessionClients, afSessionTurns)
	defer func() {
		e.sleepUntil(e.end)
		stop()
		wg.Wait()
	}()
	for at := e.start.Add(afKillEvery); !at.Add(afDownFor).After(e.end); at = at.Add(afKillEvery) {
		if !e.sleepUntil(at) {
			return e.ctx.Err()
		}
		l, err := e.leader()
		if err != nil {
			e.event("error", "no leader to kill: %v", err)
			continue
		}
		t0 := time.Now()
		e.kill(l)
		join := e.failover(l, t0, "leader r"+fmt.Sprint(l)+" killed")
		e.sleepUntil(t0.Add(afDownFor))
		_ = e.restart(l)
		join()
	}
	e.restartFromSnapshot()
	return nil
}

// restartFromSnapshot kills, 3 s before the end, the follower with the
// newest snapshot and restarts it 1 s later: it restores the snapshot
// (holding bindings) before replaying the log. The leader kills alone
// seldom do that: a replica killed every 10-20 s rarely lives through
// raft's first snapshot check (30-60 s after start).
func (e *env) restartFromSnapshot() {
	if !e.sleepUntil(e.end.Add(-3 * time.Second)) {
		return
	}
	best, idx := 0, uint64(0)
	for i, st := range e.statusesOpt(e.members, false) {
		if st != nil && st.State != "leader" && st.LastSnapshotIndex > idx {
			best, idx = i, st.LastSnapshotIndex
		}
	}
	if best == 0 {
		e.event("snapshot", "no follower has a snapshot yet: no restart from one")
		e.metric("snapshot_restart", "none")
		return
	}
	e.kill(best)
	e.sleep(time.Second)
	if e.restart(best) == nil {
		e.event("snapshot", "r%d restarted from its snapshot at index %d", best, idx)
		e.metric("snapshot_restart", map[string]any{"replica": fmt.Sprintf("r%d", best), "snapshot_index": idx})
	}
}

// sessionClient runs sessions one after another until ctx ends: client n's
// sessions alternate between the header and the body's prompt_cache_key.
func sessionClient(ctx context.Context, n int, acc *access, run *afRun) {
	client := acc.client(afTurnTimeout, serviceName)
	// A new connection per turn: HAProxy balances connections (TCP mode),
	// so a kept-alive one would hold a session to one replica.
	client.Transport.(*http.Transport).DisableKeepAlives = true
	u := acc.lbURL() + "/v1/chat/completions"
	for s := 0; ctx.Err() == nil; s++ {
		byHeader := (n+s)%2 == 0
		kind := "hdr"
		if !byHeader {
			kind = "key"
		}
		id := fmt.Sprintf("af1-%s-c%d-s%d", kind, n, s)
		run.started(id)
		msgs := []map[string]string{{"role": "system", "content": "session " + id + ": " + strings.Repeat("agent context ", 16)}}
		for t := 0; t < afSessionTurns && ctx.Err() == nil; t++ {
			msgs = append(msgs, map[string]string{"role": "user", "content": fmt.Sprintf("turn %d of %s: %s", t, id, strings.Repeat("more work ", 12))})
			body := map[string]any{"model": routeModel, "max_tokens": 4, "messages": msgs}
			hdr := http.Header{}
			if byHeader {
				hdr.Set("X-Dynamo-Session-ID", id)
			} else {
				body["prompt_cache_key"] = id
			}
			data, _ := json.Marshal(body)
			at := time.Now()
			w, answer, err := sessionTurn(ctx, client, u, hdr, data)
			retried := false
			if err != nil && ctx.Err() == nil {
				select {
				case <-ctx.Done():
				case <-time.After(retryDelay):
				}
				retried = true
				var err2 error
				w, answer, err2 = sessionTurn(ctx, client, u, hdr, data)
				if err2 == nil {
					err = nil
				}
			}
			if ctx.Err() != nil {
				return // the run ended mid-turn: not counted
			}
			tr := afTurn{Session: id, Turn: t, At: at, Worker: w, Retried: retried}
			if err != nil {
				tr.Worker, tr.Err = "", err.Error()
				answer = "(no answer)"
			}
			run.add(tr)
			msgs = append(msgs, map[string]string{"role": "assistant", "content": answer})
			select {
			case <-ctx.Done():
				return
			case <-time.After(afThink):
			}
		}
	}
}

// sessionTurn sends one turn and returns the worker that answered and the
// answer's text.
func sessionTurn(ctx context.Context, client *http.Client, u string, hdr http.Header, body []byte) (worker, answer string, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(body))
	if err != nil {
		return "", "", err
	}
	req.Header = hdr.Clone()
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return "", "", err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return "", "", fmt.Errorf("reading body: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return "", "", fmt.Errorf("HTTP %d: %s", resp.StatusCode, firstLine(data))
	}
	var out struct {
		Choices []struct {
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(data, &out); err != nil || len(out.Choices) == 0 {
		return "", "", fmt.Errorf("bad completion body: %s", firstLine(data))
	}
	w := resp.Header.Get("X-Worker-Id")
	if w == "" {
		return "", "", fmt.Errorf("answer without X-Worker-Id")
	}
	return w, out.Choices[0].Message.Content, nil
}

// sessionBinding is one replica's GET /sessions/{id}: the worker, or "" and
// why not.
func (e *env) sessionBinding(i int, id string) (worker, why string) {
	ctx, cancel := context.WithTimeout(e.ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.acc.url(i)+"/sessions/"+url.PathEscape(id), nil)
	if err != nil {
		return "", err.Error()
	}
	resp, err := e.acc.adminDo(req)
	if err != nil {
		return "", shortErr(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Sprintf("HTTP %d", resp.StatusCode)
	}
	var b struct {
		Worker string `json:"worker"`
	}
	if err := json.Unmarshal(data, &b); err != nil || b.Worker == "" {
		return "", "bad body: " + firstLine(data)
	}
	return b.Worker, ""
}

// sessionTurnsOf reads replica i's kvrouter_session_turns_total by outcome
// and kvrouter_session_misses_total by reason ("miss_<reason>"), since that
// process started: which replicas the turns went through, and why a turn
// was served unbound.
func (e *env) sessionTurnsOf(i int) map[string]float64 {
	ctx, cancel := context.WithTimeout(e.ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.acc.url(i)+"/metrics", nil)
	if err != nil {
		return nil
	}
	resp, err := e.acc.adminDo(req)
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	out := map[string]float64{}
	for _, line := range strings.Split(string(data), "\n") {
		pre := ""
		rest, ok := strings.CutPrefix(line, `kvrouter_session_turns_total{outcome="`)
		if !ok {
			if rest, ok = strings.CutPrefix(line, `kvrouter_session_misses_total{reason="`); !ok {
				continue
			}
			pre = "miss_"
		}
		outcome, val, ok := strings.Cut(rest, `"} `)
		outcome = pre + outcome
		var v float64
		if _, err := fmt.Sscan(val, &v); ok && err == nil {
			out[outcome] += v
		}
	}
	return out
}

// afSession is one session's account at the end.
type afSession struct {
	ID        string            `json:"session"`
	Turns     int               `json:"turns"`
	Answered  int               `json:"answered"`
	Workers   map[string]int    `json:"workers"`  // answered turns per worker
	Bindings  map[string]string `json:"bindings"` // replica → worker, or why none
	Bound     string            `json:"bound"`    // the worker every replica names, "" when they do not agree
	Elsewhere int               `json:"elsewhere"`
}

func af1Check(e *env) {
	run := e.af
	if run == nil {
		e.res.RequireTrue("session_clients_ran", false, "no session run recorded")
		return
	}
	fo := e.measured("failover_s")
	e.res.FailoverP99 = Percentile(fo, 99)
	e.publishMeasures()
	e.res.Require("leader_kills", float64(len(fo)), ">=", 1, "")
	e.requireAvailability(0.995, 0)

	run.mu.Lock()
	turns := append([]afTurn(nil), run.turns...)
	run.mu.Unlock()
	by := map[string]*afSession{}
	var order []string
	for _, t := range turns {
		s := by[t.Session]
		if s == nil {
			s = &afSession{ID: t.Session, Workers: map[string]int{}, Bindings: map[string]string{}}
			by[t.Session] = s
			order = append(order, t.Session)
		}
		s.Turns++
		if t.Err == "" {
			s.Answered++
			s.Workers[t.Worker]++
		}
	}
	var answered, failed, retried, elsewhere, lost, oneWorker, withAnswer int
	var lostSamples []*afSession
	for _, id := range order {
		s := by[id]
		if s.Answered == 0 {
			continue // never served: nothing to be bound
		}
		withAnswer++
		answered += s.Answered
		for _, i := range e.members {
			w, why := e.sessionBinding(i, id)
			if w == "" {
				w = "(" + why + ")"
			}
			s.Bindings[fmt.Sprintf("r%d", i)] = w
		}
		agree := true
		var first string
		for _, w := range s.Bindings {
			if first == "" {
				first = w
			}
			agree = agree && w == first && !strings.HasPrefix(w, "(")
		}
		if agree {
			s.Bound = first
		} else {
			lost++
			if len(lostSamples) < 10 {
				lostSamples = append(lostSamples, s)
			}
		}
		// Turns answered elsewhere than the session's binding (when the
		// replicas lost it, elsewhere than its most frequent worker: the
		// loss is counted above).
		ref := s.Bound
		if ref == "" {
			n := -1
			for w, c := range s.Workers {
				if c > n || (c == n && w < ref) {
					ref, n = w, c
				}
			}
		}
		s.Elsewhere = s.Answered - s.Workers[ref]
		elsewhere += s.Elsewhere
		if len(s.Workers) == 1 {
			oneWorker++
		}
	}
	for _, t := range turns {
		if t.Err != "" {
			failed++
		}
		if t.Retried {
			retried++
		}
	}
	var split []*afSession
	for _, id := range order {
		if s := by[id]; s.Elsewhere > 0 && len(split) < 20 {
			split = append(split, s)
		}
	}
	perWorker := map[string]int{}
	for _, id := range order {
		if s := by[id]; s.Bound != "" {
			perWorker[s.Bound]++
		}
	}
	e.writeJSON("sessions.json", map[string]any{"turns": turns, "split_sessions": split, "lost_bindings": lostSamples})
	e.metric("session_count", len(order))
	e.metric("session_turns", len(turns))
	e.metric("session_turns_answered", answered)
	e.metric("session_turns_failed", failed)
	e.metric("session_turns_retried", retried)
	e.metric("session_turns_elsewhere", elsewhere)
	e.metric("sessions_one_worker", oneWorker)
	e.metric("sessions_answered", withAnswer)
	e.metric("session_bindings_lost", lost)
	e.metric("sessions_per_worker", perWorker)
	e.metric("split_sessions", split)
	byReplica := map[string]map[string]float64{}
	for _, i := range e.members {
		byReplica[fmt.Sprintf("r%d", i)] = e.sessionTurnsOf(i)
	}
	e.metric("session_turns_by_replica_since_start", byReplica)
	// Which replicas restarted from a snapshot holding bindings: a binding
	// lost on restore shows in session_bindings_lost.
	restored := map[string]any{}
	for i, st := range e.statuses(e.members) {
		if st != nil {
			restored[fmt.Sprintf("r%d", i)] = map[string]uint64{"last_snapshot_index": st.LastSnapshotIndex, "snapshots_restored": st.SnapshotsRestored}
		}
	}
	e.metric("snapshots_at_end", restored)
	e.event("sessions", "%d sessions, %d turns (%d answered, %d failed, %d retried): %d answered elsewhere than the session's worker, %d of %d sessions on one worker, %d bindings lost; per worker %v",
		len(order), len(turns), answered, failed, retried, elsewhere, oneWorker, withAnswer, lost, perWorker)

	e.res.Require("session_turns_answered", float64(answered), ">=", 100, "enough turns to measure 99.9 %")
	e.res.Require("session_turns_on_their_worker", 1-Ratio(elsewhere, answered), ">=", 0.999,
		fmt.Sprintf("%d of %d answered turns served elsewhere than their session's worker", elsewhere, answered))
	e.res.Require("session_bindings_lost", float64(lost), "==", 0,
		"sessions whose GET /sessions/{id} is missing or differs on some replica after heal and drain")
	e.res.Require("session_turn_availability", Ratio(answered, len(turns)), ">=", 0.995, "session turns via HAProxy, one client retry")
}
