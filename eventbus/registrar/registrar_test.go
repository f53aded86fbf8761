package registrar

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
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/eventbus/internal/bustest"
	"github.com/kvrouter/kvrouter/internal/poll"
)

// replica is a kvrouter replica's /workers endpoints. It answers each
// registration with the next of statuses (the last one repeats; none: 200)
// and each deregistration with deregStatus (0: 200).
type replica struct {
	srv   *httptest.Server
	token string // required bearer token; "" = none

	mu          sync.Mutex
	statuses    []int
	deregStatus int
	registers   int               // POST /workers/register received
	bodies      []json.RawMessage // the accepted registrations
	deregs      []string          // ids of every deregistration received
	auth        []string          // Authorization headers, in order
}

func newReplica(t *testing.T, token string, statuses ...int) *replica {
	t.Helper()
	r := &replica{token: token, statuses: statuses}
	r.srv = httptest.NewServer(r)
	t.Cleanup(r.srv.Close)
	return r
}

// downURL is the URL of a replica that is not running: connection refused.
func downURL(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(http.NotFoundHandler())
	srv.Close()
	return srv.URL
}

func (r *replica) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.auth = append(r.auth, req.Header.Get("Authorization"))
	if req.Method != http.MethodPost || req.Header.Get("Content-Type") != "application/json" {
		http.Error(w, "want a JSON POST", http.StatusMethodNotAllowed)
		return
	}
	if r.token != "" && req.Header.Get("Authorization") != "Bearer "+r.token {
		http.Error(w, `{"error":"admin endpoints need the bearer token"}`, http.StatusUnauthorized)
		return
	}
	body, _ := io.ReadAll(req.Body)
	switch req.URL.Path {
	case "/workers/register":
		r.registers++
		status := http.StatusOK
		if len(r.statuses) > 0 {
			status = r.statuses[0]
			if len(r.statuses) > 1 {
				r.statuses = r.statuses[1:]
			}
		}
		if status != http.StatusOK {
			http.Error(w, `{"error":"no leader"}`, status)
			return
		}
		r.bodies = append(r.bodies, body)
		fmt.Fprint(w, `{"registered":"w"}`)
	case "/workers/deregister":
		var b struct {
			ID string `json:"id"`
		}
		_ = json.Unmarshal(body, &b)
		r.deregs = append(r.deregs, b.ID)
		if r.deregStatus != 0 && r.deregStatus != http.StatusOK {
			http.Error(w, fmt.Sprintf(`{"error":"invalid request: worker %q is not registered"}`, b.ID), r.deregStatus)
			return
		}
		fmt.Fprintf(w, `{"deregistered":%q}`, b.ID)
	default:
		http.NotFound(w, req)
	}
}

type replicaState struct {
	registers int
	specs     []Spec
	deregs    []string
	auth      []string
}

func (r *replica) state(t *testing.T) replicaState {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	st := replicaState{registers: r.registers, deregs: append([]string(nil), r.deregs...), auth: append([]string(nil), r.auth...)}
	for _, b := range r.bodies {
		var s Spec
		if err := json.Unmarshal(b, &s); err != nil {
			t.Fatalf("registration %s: %v", b, err)
		}
		st.specs = append(st.specs, s)
	}
	return st
}

// fast is a Config with short intervals for tests.
func fast(t *testing.T, urls ...string) Config {
	return Config{URLs: urls, Spec: Spec{ID: "w", URL: "http://w:8000", Model: "m", BlockSize: 16, TotalBlocks: 512},
		Interval: 10 * time.Millisecond, BackoffMin: time.Millisecond, BackoffMax: 5 * time.Millisecond,
		Logger: bustest.Logger(t)}
}

// start runs r until the test ends; stop cancels it and waits.
func start(t *testing.T, r *Registrar, before func()) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); r.Run(ctx, before) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Errorf("Run did not return after its ctx ended")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

func isRegistered(r *Registrar) bool {
	select {
	case <-r.Registered():
		return true
	default:
		return false
	}
}

// The body is api.WorkerSpec's JSON: role and dp_ranks only when set.
func TestRegistrarSpecJSON(t *testing.T) {
	base := Spec{ID: "w", URL: "http://w:8000", Model: "m", BlockSize: 16, TotalBlocks: 512, MaxBatchedTokens: 8192}
	const common = `"id":"w","url":"http://w:8000","model":"m","block_size":16,"total_kv_blocks":512,"max_num_batched_tokens":8192`
	for name, tc := range map[string]struct {
		role    string
		dpRanks int
		want    string
	}{
		"plain":      {want: `{` + common + `}`},
		"role":       {role: "prefill", want: `{` + common + `,"role":"prefill"}`},
		"dp_ranks":   {dpRanks: 2, want: `{` + common + `,"dp_ranks":2}`},
		"both extra": {role: "decode", dpRanks: 4, want: `{` + common + `,"role":"decode","dp_ranks":4}`},
	} {
		t.Run(name, func(t *testing.T) {
			s := base
			s.Role, s.DPRanks = tc.role, tc.dpRanks
			got, err := json.Marshal(s)
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != tc.want {
				t.Fatalf("got  %s\nwant %s", got, tc.want)
			}
			// And what a replica receives decodes back to it.
			rep := newReplica(t, "")
			cfg := fast(t, rep.srv.URL)
			cfg.Spec = s
			r := New(cfg)
			start(t, r, nil)
			poll.Until(t, 10*time.Second, time.Millisecond, func() error {
				if !isRegistered(r) {
					return fmt.Errorf("not registered: %+v", r.Stats())
				}
				return nil
			})
			if st := rep.state(t); st.specs[0] != s {
				t.Fatalf("replica got %+v, want %+v", st.specs[0], s)
			}
		})
	}
}

// setup is a TestRegistrarRun case's replicas.
type setup struct {
	token    string // the registrar's
	replicas []*replica
	urls     []string // the registrar's: the replicas' and down ones
}

// Run registers, retrying until a replica accepts, then renews; the first
// success closes Registered.
func TestRegistrarRun(t *testing.T) {
	for name, tc := range map[string]struct {
		setup func(t *testing.T) setup
		// done is polled until it returns nil; check gets the stats of
		// that moment (a later attempt may be cut short by the stop).
		done  func(r *Registrar, s setup) error
		check func(t *testing.T, st Stats, r *Registrar, s setup)
	}{
		"one down, one up": {
			setup: func(t *testing.T) setup {
				up := newReplica(t, "")
				return setup{replicas: []*replica{up}, urls: []string{downURL(t), up.srv.URL}}
			},
			done: renewed(3),
			check: func(t *testing.T, st Stats, r *Registrar, s setup) {
				if st.Failures != 0 || !st.Registered || st.LastError != "" {
					t.Fatalf("stats %+v: a down replica is skipped, not a failure", st)
				}
			},
		},
		"bearer token": {
			setup: func(t *testing.T) setup {
				rep := newReplica(t, "s3cret")
				return setup{token: "s3cret", replicas: []*replica{rep}, urls: []string{rep.srv.URL}}
			},
			done: renewed(2),
			check: func(t *testing.T, st Stats, r *Registrar, s setup) {
				for _, a := range s.replicas[0].state(t).auth {
					if a != "Bearer s3cret" {
						t.Fatalf("Authorization %q", a)
					}
				}
			},
		},
		"no token": {
			setup: func(t *testing.T) setup {
				rep := newReplica(t, "")
				return setup{replicas: []*replica{rep}, urls: []string{rep.srv.URL}}
			},
			done: renewed(1),
			check: func(t *testing.T, st Stats, r *Registrar, s setup) {
				if a := s.replicas[0].state(t).auth[0]; a != "" {
					t.Fatalf("Authorization %q sent without a token", a)
				}
			},
		},
		"wrong token keeps retrying": {
			setup: func(t *testing.T) setup {
				rep := newReplica(t, "s3cret")
				return setup{token: "guess", replicas: []*replica{rep}, urls: []string{rep.srv.URL}}
			},
			done: func(r *Registrar, _ setup) error {
				if st := r.Stats(); st.Failures < 6 {
					return fmt.Errorf("%d failures", st.Failures)
				}
				return nil
			},
			check: func(t *testing.T, st Stats, r *Registrar, s setup) {
				if st.Registered || st.Renewals != 0 || !strings.Contains(st.LastError, "HTTP 401") {
					t.Fatalf("stats %+v", st)
				}
				if isRegistered(r) {
					t.Fatal("Registered closed without a registration")
				}
			},
		},
		"retry with backoff until accepted": {
			setup: func(t *testing.T) setup {
				rep := newReplica(t, "", 503, 503, 503, 200)
				return setup{replicas: []*replica{rep}, urls: []string{rep.srv.URL}}
			},
			done: renewed(3),
			check: func(t *testing.T, st Stats, r *Registrar, s setup) {
				if st.Failures != 3 || !st.Registered || st.LastError != "" {
					t.Fatalf("stats %+v: want 3 failures, then registered", st)
				}
				if got := s.replicas[0].state(t).registers; got < int(st.Failures+st.Renewals) {
					t.Fatalf("%d attempts, stats %+v", got, st)
				}
			},
		},
		"preferred replica": {
			setup: func(t *testing.T) setup {
				a, b := newReplica(t, "", 503), newReplica(t, "")
				return setup{replicas: []*replica{a, b}, urls: []string{a.srv.URL, b.srv.URL}}
			},
			done: renewed(3),
			check: func(t *testing.T, st Stats, r *Registrar, s setup) {
				if n := s.replicas[0].state(t).registers; n != 1 {
					t.Fatalf("the refusing replica was asked %d times: want once, then the one that answered", n)
				}
				if st.Failures != 0 {
					t.Fatalf("stats %+v", st)
				}
			},
		},
		"renewal after a lost leader": {
			setup: func(t *testing.T) setup {
				rep := newReplica(t, "", 200, 200, 503, 200)
				return setup{replicas: []*replica{rep}, urls: []string{rep.srv.URL}}
			},
			done: renewed(5),
			check: func(t *testing.T, st Stats, r *Registrar, s setup) {
				if st.Failures != 1 || !st.Registered || st.LastError != "" {
					t.Fatalf("stats %+v", st)
				}
				for _, spec := range s.replicas[0].state(t).specs {
					if spec != r.Spec() {
						t.Fatalf("renewal %+v, want %+v", spec, r.Spec())
					}
				}
			},
		},
	} {
		t.Run(name, func(t *testing.T) {
			s := tc.setup(t)
			cfg := fast(t, s.urls...)
			cfg.Token = s.token
			r := New(cfg)
			if isRegistered(r) {
				t.Fatal("Registered closed before Run")
			}
			stop := start(t, r, nil)
			poll.Until(t, 10*time.Second, time.Millisecond, func() error { return tc.done(r, s) })
			st := r.Stats()
			stop()
			tc.check(t, st, r, s)
		})
	}
}

func renewed(n uint64) func(*Registrar, setup) error {
	return func(r *Registrar, _ setup) error {
		if !isRegistered(r) {
			return fmt.Errorf("not registered: %+v", r.Stats())
		}
		if st := r.Stats(); st.Renewals < n {
			return fmt.Errorf("%d renewals, want %d", st.Renewals, n)
		}
		return nil
	}
}

// before runs ahead of every attempt; SetTotalBlocks changes what the next
// one registers.
func TestRegistrarBeforeSetTotalBlocks(t *testing.T) {
	rep := newReplica(t, "")
	r := New(fast(t, rep.srv.URL))
	var mu sync.Mutex
	calls := 0
	start(t, r, func() {
		mu.Lock()
		defer mu.Unlock()
		calls++
		if calls == 3 {
			r.SetTotalBlocks(4096) // learnt from the engine's metrics
		}
	})
	poll.Until(t, 10*time.Second, time.Millisecond, func() error {
		if st := rep.state(t); len(st.specs) < 4 {
			return fmt.Errorf("%d registrations", len(st.specs))
		}
		return nil
	})
	specs := rep.state(t).specs
	for i, s := range specs[:4] {
		want := 512
		if i >= 2 {
			want = 4096
		}
		if s.TotalBlocks != want {
			t.Fatalf("registration %d: total_kv_blocks %d, want %d", i, s.TotalBlocks, want)
		}
	}
	if got := r.Spec().TotalBlocks; got != 4096 {
		t.Fatalf("Spec().TotalBlocks %d", got)
	}
}

// Deregister posts the worker's id to the first replica that answers; with
// LenientDeregister a definite refusal ("not registered") is done too.
func TestRegistrarDeregister(t *testing.T) {
	const down = -1
	for name, tc := range map[string]struct {
		statuses []int // per replica: its answer, or down
		lenient  bool
		wantErr  string // "" = nil
		wantHits []int  // deregistrations each replica received
	}{
		"first answers":              {statuses: []int{200, 200}, wantHits: []int{1, 0}},
		"one down, one up":           {statuses: []int{down, 200}, wantHits: []int{0, 1}},
		"refused, strict":            {statuses: []int{400, 404}, wantErr: "HTTP 404", wantHits: []int{1, 1}},
		"refused, then accepted":     {statuses: []int{400, 200}, wantHits: []int{1, 1}},
		"refused, lenient":           {statuses: []int{400, 200}, lenient: true, wantHits: []int{1, 0}},
		"not found, lenient":         {statuses: []int{404}, lenient: true, wantHits: []int{1}},
		"unauthorized, lenient":      {statuses: []int{401, 200}, lenient: true, wantHits: []int{1, 1}},
		"rate limited, lenient":      {statuses: []int{429, 429}, lenient: true, wantErr: "HTTP 429", wantHits: []int{1, 1}},
		"server error, lenient":      {statuses: []int{503}, lenient: true, wantErr: "HTTP 503", wantHits: []int{1}},
		"all down":                   {statuses: []int{down, down}, wantErr: "POST /workers/deregister", wantHits: []int{0, 0}},
		"no replica answers, strict": {statuses: []int{down, 503}, wantErr: "HTTP 503", wantHits: []int{0, 1}},
	} {
		t.Run(name, func(t *testing.T) {
			var urls []string
			reps := make([]*replica, len(tc.statuses))
			for i, st := range tc.statuses {
				if st == down {
					urls = append(urls, downURL(t))
					continue
				}
				reps[i] = newReplica(t, "tok")
				reps[i].deregStatus = st
				urls = append(urls, reps[i].srv.URL)
			}
			cfg := fast(t, urls...)
			cfg.Token, cfg.LenientDeregister = "tok", tc.lenient
			err := New(cfg).Deregister(t.Context())
			switch {
			case tc.wantErr == "" && err != nil:
				t.Fatalf("err %v", err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Fatalf("err %v, want one with %q", err, tc.wantErr)
			}
			for i, rep := range reps {
				if rep == nil {
					continue
				}
				st := rep.state(t)
				if len(st.deregs) != tc.wantHits[i] {
					t.Fatalf("replica %d: %d deregistrations, want %d", i, len(st.deregs), tc.wantHits[i])
				}
				for _, id := range st.deregs {
					if id != "w" {
						t.Fatalf("deregistered %q", id)
					}
				}
				if st.registers != 0 {
					t.Fatalf("replica %d: %d registrations", i, st.registers)
				}
			}
		})
	}
}

// The retry delay doubles from BackoffMin to BackoffMax; each wait is
// jittered down to half of it.
func TestRegistrarBackoff(t *testing.T) {
	ms := time.Millisecond
	for name, tc := range map[string]struct {
		lo, hi time.Duration
		want   []time.Duration // after failures 1, 2, …
	}{
		"defaults": {DefaultBackoffMin, DefaultBackoffMax,
			[]time.Duration{200 * ms, 400 * ms, 800 * ms, 1600 * ms, 3200 * ms, 5 * time.Second, 5 * time.Second}},
		"short": {5 * ms, 20 * ms, []time.Duration{5 * ms, 10 * ms, 20 * ms, 20 * ms}},
		"flat":  {ms, ms, []time.Duration{ms, ms, ms}},
	} {
		t.Run(name, func(t *testing.T) {
			for i, want := range tc.want {
				if got := retryDelay(i+1, tc.lo, tc.hi); got != want {
					t.Fatalf("after %d failures: %v, want %v", i+1, got, want)
				}
			}
			if got := retryDelay(1000, tc.lo, tc.hi); got != tc.hi {
				t.Fatalf("after 1000 failures: %v, want %v", got, tc.hi)
			}
			for _, d := range tc.want {
				for range 200 {
					if j := jitter(d); j < d/2 || j > d {
						t.Fatalf("jitter(%v) = %v, outside [%v, %v]", d, j, d/2, d)
					}
				}
			}
		})
	}
}

// New fills in the defaults (a 5 s client: kvmock's); a given client is
// the one used (the bridge's, shared with its engine probes).
func TestRegistrarConfig(t *testing.T) {
	r := New(Config{})
	if r.cfg.BackoffMin != DefaultBackoffMin || r.cfg.BackoffMax != DefaultBackoffMax ||
		r.cfg.Interval != DefaultInterval || r.cfg.Client.Timeout != DefaultTimeout {
		t.Fatalf("defaults %+v", r.cfg)
	}
	rep := newReplica(t, "")
	var used countingTransport
	cfg := fast(t, rep.srv.URL)
	cfg.Client = &http.Client{Transport: &used}
	if err := New(cfg).Deregister(t.Context()); err != nil {
		t.Fatal(err)
	}
	if used.n.Load() != 1 {
		t.Fatalf("the given client sent %d requests, want 1", used.n.Load())
	}
}

type countingTransport struct{ n atomic.Int64 }

func (c *countingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	c.n.Add(1)
	return http.DefaultTransport.RoundTrip(req)
}

// Run ends with its ctx, also in the middle of a backoff.
func TestRegistrarRunStopsWithContext(t *testing.T) {
	cfg := fast(t, downURL(t))
	cfg.BackoffMin, cfg.BackoffMax = time.Hour, time.Hour
	r := New(cfg)
	stop := start(t, r, nil)
	poll.Until(t, 10*time.Second, time.Millisecond, func() error {
		if st := r.Stats(); st.Failures == 0 {
			return fmt.Errorf("no attempt yet")
		}
		return nil
	})
	began := time.Now()
	stop() // fails the test if Run does not return
	if d := time.Since(began); d > 5*time.Second {
		t.Fatalf("Run took %v to stop", d)
	}
}

// Five failures in a row are not a blip: the log says so at error level.
func TestRegistrarLogEscalates(t *testing.T) {
	seen := &levelLog{}
	cfg := fast(t, newReplica(t, "", 503).srv.URL)
	cfg.Logger = slog.New(levels{next: bustest.Logger(t).Handler(), log: seen})
	r := New(cfg)
	stop := start(t, r, nil)
	poll.Until(t, 10*time.Second, time.Millisecond, func() error {
		if st := r.Stats(); st.Failures < 6 {
			return fmt.Errorf("%d failures", st.Failures)
		}
		return nil
	})
	stop()
	seen.mu.Lock()
	defer seen.mu.Unlock()
	if len(seen.levels) < 6 {
		t.Fatalf("log levels %v", seen.levels)
	}
	for i, l := range seen.levels[:6] {
		want := slog.LevelWarn
		if i >= 4 {
			want = slog.LevelError
		}
		if l != want {
			t.Fatalf("failure %d logged at %v, want %v (all: %v)", i+1, l, want, seen.levels)
		}
	}
}

// levels is a slog.Handler that records the level of each "registration
// failed" record into log (shared by its With copies).
type levels struct {
	next slog.Handler
	log  *levelLog
}

type levelLog struct {
	mu     sync.Mutex
	levels []slog.Level
}

func (h levels) Enabled(ctx context.Context, l slog.Level) bool { return h.next.Enabled(ctx, l) }

func (h levels) Handle(ctx context.Context, rec slog.Record) error {
	if strings.HasPrefix(rec.Message, "registration failed") {
		h.log.mu.Lock()
		h.log.levels = append(h.log.levels, rec.Level)
		h.log.mu.Unlock()
	}
	return h.next.Handle(ctx, rec)
}

func (h levels) WithAttrs(a []slog.Attr) slog.Handler { return levels{h.next.WithAttrs(a), h.log} }
func (h levels) WithGroup(g string) slog.Handler      { return levels{h.next.WithGroup(g), h.log} }
