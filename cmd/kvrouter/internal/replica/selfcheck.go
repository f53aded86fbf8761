package replica

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api/prompt"
	"github.com/kvrouter/kvrouter/fsm"
)

// tokenizerCheck is the self-check against the engines: prefix routing is
// only as good as the token ids the replica hashes, and a template or
// tokenizer that differs from the engine's by one id turns every later
// block into a miss while everything looks healthy. So when a worker
// registers (or restarts), and every interval after, the replica sends a
// few fixed canary requests to the worker's own vLLM-compatible /tokenize
// and compares the ids with its own for the same bodies. A mismatch is
// loud: a warning naming the model, the worker and the first differing
// position, kvrouter_tokenizer_mismatch{model,worker} = 1, and the
// worker's tokenizer_check in /cluster/status.
//
// Every replica checks on its own: each hashes with its own files. Checks
// run beside routing, never in its way: one at a time per worker, a few at
// once in all, each bounded by a timeout.
type tokenizerCheck struct {
	log      *slog.Logger
	interval time.Duration // between checks of one worker, jittered ±25 %
	timeout  time.Duration // one whole check
	minGap   time.Duration // between two checks of one worker, however triggered
	lookup   func(model string) (*prompt.Model, bool)
	workers  func() []fsm.WorkerRecord
	client   *http.Client
	// workerKey is the bearer token the proxy sends to a worker (by id);
	// nil or "": none. useWorkerAccess sets it with client's transport.
	workerKey func(id string) string
	mismatch  *prometheus.GaugeVec
	results   *prometheus.CounterVec
	kick      chan struct{} // wakes the loop after a registration
	sem       chan struct{} // bounds the checks running at once

	mu    sync.Mutex
	state map[string]*workerCheck // by worker id; mu guards it and its values
}

// workerCheck is one worker's check state. tokenizerCheck.mu guards it.
type workerCheck struct {
	model, url  string
	due         time.Time // next check
	lastStarted time.Time
	running     bool
	result      string // /cluster/status text; "pending" before the first check
	checkedAt   time.Time
	detail      map[string]any // the mismatch, for /cluster/status
	gauge       bool           // the mismatch gauge has a series for it
	quiet       bool           // "unavailable" or "skipped" already logged
}

// Checks running at once, across workers: a fleet registering at once is
// checked a few at a time.
const selfCheckParallel = 4

func newTokenizerCheck(interval time.Duration, lookup func(string) (*prompt.Model, bool), workers func() []fsm.WorkerRecord,
	reg prometheus.Registerer, log *slog.Logger) *tokenizerCheck {
	c := &tokenizerCheck{
		log: log, interval: interval, timeout: 30 * time.Second, minGap: 10 * time.Second,
		lookup: lookup, workers: workers,
		// Until useWorkerAccess gives it the proxy's transport: its own
		// (no process-global state). A short timeout per request so a hung
		// worker holds a check slot briefly.
		client: &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone(), Timeout: selfCheckRequestTimeout},
		mismatch: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrouter_tokenizer_mismatch",
			Help: "1 when the worker's /tokenize gives other ids than this replica for the canary requests (its prefix hits are lost), 0 when they agree; no series while unchecked."},
			[]string{"model", "worker"}),
		results: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_tokenizer_checks_total",
			Help: "Tokenizer self-checks against the workers' /tokenize, by result (ok, mismatch, unavailable, skipped)."}, []string{"result"}),
		kick:  make(chan struct{}, 1),
		sem:   make(chan struct{}, selfCheckParallel),
		state: map[string]*workerCheck{},
	}
	reg.MustRegister(c.mismatch, c.results)
	return c
}

// selfCheckRequestTimeout bounds one /tokenize request.
const selfCheckRequestTimeout = 10 * time.Second

// useWorkerAccess makes the check reach workers as the proxy does: over
// the proxy's transport (its dial guard, TLS settings and pool) with the
// bearer token the proxy sends each worker (api.Server.WorkerTransport,
// WorkerKey). Without it a worker started with --api-key (a secured
// deployment, make run's kvmocks) answered 401 and read "unavailable".
// Call it before run.
func (c *tokenizerCheck) useWorkerAccess(rt http.RoundTripper, key func(id string) string) {
	if c == nil {
		return
	}
	c.client = &http.Client{Transport: rt, Timeout: selfCheckRequestTimeout}
	c.workerKey = key
}

// note follows the worker registry: a registration, a changed worker or a
// resync (usually a restarted worker, perhaps with other files) is checked
// at once. It is an FSM observer, so it only marks and wakes the loop.
func (c *tokenizerCheck) note(ch fsm.Change) {
	if c == nil || (ch.Kind != fsm.ChangeWorkers && ch.Kind != fsm.ChangeResync && ch.Kind != fsm.ChangeRestored) {
		return
	}
	if ch.Kind != fsm.ChangeRestored {
		c.mu.Lock()
		if st, ok := c.state[ch.Worker]; ok {
			st.due = time.Time{} // now, within minGap of the last check
		}
		c.mu.Unlock()
	}
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

// run schedules checks until ctx ends.
func (c *tokenizerCheck) run(ctx context.Context) {
	if c == nil || c.interval <= 0 {
		return
	}
	t := time.NewTicker(min(c.interval/4, 5*time.Second))
	defer t.Stop()
	for {
		c.schedule(ctx, time.Now())
		select {
		case <-ctx.Done():
			return
		case <-c.kick:
		case <-t.C:
		}
	}
}

// schedule reconciles the state with the registry and starts the checks
// that are due.
func (c *tokenizerCheck) schedule(ctx context.Context, now time.Time) {
	workers := c.workers()
	c.mu.Lock()
	defer c.mu.Unlock()
	seen := make(map[string]bool, len(workers))
	for _, w := range workers {
		seen[w.ID] = true
		st, ok := c.state[w.ID]
		if !ok || st.model != w.Model || st.url != w.Address {
			if ok && st.gauge {
				c.mismatch.DeleteLabelValues(st.model, w.ID)
			}
			st = &workerCheck{model: w.Model, url: w.Address, result: "pending"}
			c.state[w.ID] = st
		}
		if st.running || now.Before(st.due) || now.Before(st.lastStarted.Add(c.minGap)) {
			continue
		}
		st.running, st.lastStarted = true, now
		go c.check(ctx, w.ID, st)
	}
	for id, st := range c.state {
		if !seen[id] {
			if st.gauge {
				c.mismatch.DeleteLabelValues(st.model, id)
			}
			delete(c.state, id)
		}
	}
}

// checkOutcome is one check's conclusion.
type checkOutcome struct {
	kind     string // ok, mismatch, unavailable, skipped
	text     string // /cluster/status text
	compared int    // canaries compared
	canary   string // the first mismatching one
	pos      int
	ours     []uint32
	theirs   []uint32
}

// check runs one check of st, the worker's state when it was scheduled
// (model and url are fixed for a state's life).
func (c *tokenizerCheck) check(ctx context.Context, worker string, st *workerCheck) {
	c.mu.Lock()
	model, url := st.model, st.url
	c.mu.Unlock()
	select {
	case c.sem <- struct{}{}:
		defer func() { <-c.sem }()
	case <-ctx.Done():
		c.mu.Lock()
		st.running = false
		c.mu.Unlock()
		return
	}
	cctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	out := c.compare(cctx, worker, model, url)
	if ctx.Err() != nil { // shutting down: no conclusion
		c.mu.Lock()
		st.running = false
		c.mu.Unlock()
		return
	}
	c.record(worker, st, out)
}

// compare sends each canary to the worker's /tokenize and compares the ids
// with this replica's for the same body. A canary this replica cannot
// tokenize (a model without a chat template) is left out; one the worker
// does not answer with 200 is not compared either (an engine whose
// /tokenize takes prompts only, as SGLang's may, is not a mismatch).
func (c *tokenizerCheck) compare(ctx context.Context, worker, model, url string) checkOutcome {
	m, ok := c.lookup(model)
	if !ok {
		return checkOutcome{kind: "skipped", text: "skipped: no tokenizer"}
	}
	if url == "" {
		return checkOutcome{kind: "skipped", text: "skipped: no worker URL"}
	}
	var unanswered []string
	compared := 0
	for _, cn := range canaries {
		body := cn.body(model)
		ours, err := m.Tokenize(body)
		if err != nil {
			continue
		}
		theirs, err := c.fetch(ctx, worker, url, body)
		if err != nil {
			var st *statusError
			if errors.As(err, &st) {
				// One worker answered; its other canaries may still compare.
				unanswered = append(unanswered, cn.name+": "+err.Error())
				if st.code == http.StatusNotFound {
					break // no /tokenize at all (or not this model): no use asking again
				}
				continue
			}
			return checkOutcome{kind: "unavailable", text: "unavailable: " + err.Error()}
		}
		compared++
		if pos := firstDiff(ours, theirs); pos >= 0 {
			return checkOutcome{kind: "mismatch", text: fmt.Sprintf("mismatch at %d", pos), compared: compared,
				canary: cn.name, pos: pos, ours: ours, theirs: theirs}
		}
	}
	switch {
	case compared > 0:
		return checkOutcome{kind: "ok", text: "ok", compared: compared}
	case len(unanswered) > 0:
		return checkOutcome{kind: "unavailable", text: "unavailable: " + unanswered[0]}
	}
	return checkOutcome{kind: "skipped", text: "skipped: no canary this replica can tokenize for the model"}
}

// statusError is a /tokenize answer other than 200.
type statusError struct {
	code int
	msg  string
}

func (e *statusError) Error() string {
	return fmt.Sprintf("/tokenize answered HTTP %d: %s", e.code, e.msg)
}

// fetch posts body to the worker's /tokenize, with the worker's API key
// when it has one, and returns its "tokens".
func (c *tokenizerCheck) fetch(ctx context.Context, worker, base string, body []byte) ([]uint32, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(base, "/")+"/tokenize", bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("tokenize request: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	if c.workerKey != nil {
		if key := c.workerKey(worker); key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("POST /tokenize: %w", err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return nil, fmt.Errorf("reading /tokenize answer: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		msg := strings.TrimSpace(string(data))
		if len(msg) > 200 {
			msg = msg[:200] + "…"
		}
		return nil, &statusError{code: resp.StatusCode, msg: msg}
	}
	var doc struct {
		Tokens *[]uint32 `json:"tokens"`
	}
	if err := json.Unmarshal(data, &doc); err != nil || doc.Tokens == nil {
		return nil, fmt.Errorf("/tokenize answer without a \"tokens\" list of ids: %.200s", data)
	}
	return *doc.Tokens, nil
}

// record stores a check's outcome, sets the gauge and logs transitions.
func (c *tokenizerCheck) record(worker string, st *workerCheck, out checkOutcome) {
	c.results.WithLabelValues(out.kind).Inc()
	c.mu.Lock()
	defer c.mu.Unlock()
	st.running = false
	if c.state[worker] != st {
		return // deregistered or changed while we checked: a check of the new state says
	}
	model, url := st.model, st.url
	now := time.Now()
	prev := st.result
	st.result, st.checkedAt, st.detail = out.text, now, nil
	st.due = now.Add(c.interval*3/4 + rand.N(c.interval/2+1))
	log := c.log.With("model", model, "worker", worker, "url", url)
	switch out.kind {
	case "mismatch":
		const ctxIDs = 4
		st.detail = map[string]any{"canary": out.canary, "position": out.pos,
			"replica_ids": around(out.ours, out.pos, ctxIDs), "worker_ids": around(out.theirs, out.pos, ctxIDs),
			"replica_len": len(out.ours), "worker_len": len(out.theirs)}
		c.mismatch.WithLabelValues(model, worker).Set(1)
		st.gauge, st.quiet = true, false
		fp := ""
		if m, ok := c.lookup(model); ok {
			fp = m.Fingerprint()
		}
		log.Warn("tokenizer mismatch: the worker's prompt ids differ from this replica's, so its KV blocks never match and routing to it is blind",
			"canary", out.canary, "first_differing_position", out.pos,
			"replica_ids", around(out.ours, out.pos, ctxIDs), "worker_ids", around(out.theirs, out.pos, ctxIDs),
			"replica_len", len(out.ours), "worker_len", len(out.theirs), "replica_fingerprint", fp,
			"fix", "give the replicas (--model-dir) and the engine the same tokenizer files and chat template")
	case "ok":
		c.mismatch.WithLabelValues(model, worker).Set(0)
		st.gauge, st.quiet = true, false
		if prev != "ok" {
			msg := "tokenizer self-check: the worker's prompt ids equal this replica's"
			if strings.HasPrefix(prev, "mismatch") {
				msg = "tokenizer self-check: the worker's prompt ids agree again"
			}
			log.Info(msg, "canaries", out.compared)
		}
	default: // unavailable, skipped: no conclusion; the gauge keeps the last one
		if !st.quiet {
			st.quiet = true
			log.Info("tokenizer self-check not possible for this worker (not an alarm)", "result", out.text)
		}
	}
}

// status is the worker's tokenizer_check for /cluster/status.
func (c *tokenizerCheck) status(worker string) (string, map[string]any, time.Time) {
	if c == nil || c.interval <= 0 {
		return "off", nil, time.Time{}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	st, ok := c.state[worker]
	if !ok {
		return "pending", nil, time.Time{}
	}
	return st.result, st.detail, st.checkedAt
}

// statusFields adds the worker's check to its /cluster/status entry.
func (c *tokenizerCheck) statusFields(worker string, entry map[string]any) {
	res, detail, at := c.status(worker)
	entry["tokenizer_check"] = res
	if !at.IsZero() {
		entry["tokenizer_checked_at"] = at.UTC().Format(time.RFC3339)
	}
	if detail != nil {
		entry["tokenizer_mismatch"] = detail
	}
}

// firstDiff is the first position at which a and b differ, or -1 when they
// are equal; when one is a prefix of the other, it is the shorter length.
func firstDiff(a, b []uint32) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	if len(a) != len(b) {
		return n
	}
	return -1
}

// around is ids[at-n : at+n], clipped to the slice: the context of a
// difference for the log.
func around(ids []uint32, at, n int) []uint32 {
	lo, hi := max(0, at-n), min(len(ids), at+n)
	if lo >= hi {
		return []uint32{}
	}
	return ids[lo:hi]
}

// canary is one fixed request body sent to the workers' /tokenize.
type canary struct {
	name string
	req  map[string]any // without "model"
}

func (c canary) body(model string) []byte {
	req := make(map[string]any, len(c.req)+1)
	for k, v := range c.req {
		req[k] = v
	}
	req["model"] = model
	b, _ := json.Marshal(req) // maps of strings and slices always marshal
	return b
}

func msg(role, content string) map[string]any {
	return map[string]any{"role": role, "content": content}
}

// canaries are the bodies compared: chat templates (one turn; several with
// a system prompt), special-token handling of completions (BOS added, the
// special tokens of several families spelled in the text) and the
// pre-tokenizer's unicode and whitespace rules. Fixed, so every replica
// and every run asks the same.
var canaries = []canary{
	{"short-chat", map[string]any{"messages": []any{msg("user", "Hello! What is the capital of France?")}}},
	{"multi-turn-system", map[string]any{"messages": []any{
		msg("system", "You are a concise assistant. Answer in one sentence."),
		msg("user", "Name a prime number greater than 10."),
		msg("assistant", "11 is a prime number greater than 10."),
		msg("user", "And one greater than 100?"),
	}}},
	{"completion-special-tokens", map[string]any{"prompt": "<|begin_of_text|><|im_start|>user\nSpecial tokens as text: <s>[INST] <bos><start_of_turn>user " +
		"<|endoftext|> <|eot_id|></s><end_of_turn><|im_end|>\n"}},
	{"unicode-code", map[string]any{"messages": []any{msg("user",
		"Fix this:\n```go\nfunc main() {\n\tfmt.Println(\"héllo, 世界 🙂\")  // naïve café\n}\n```\n\n   Ελληνικά, مرحبا, こんにちは, 👩‍💻 1234567 3.14159\t\tend  ")}}},
}
