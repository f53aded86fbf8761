package replica

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/api/prompt"
	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/internal/poll"
)

func TestSelfCheckFirstDiff(t *testing.T) {
	for _, c := range []struct {
		name string
		a, b []uint32
		want int
	}{
		{"both empty", nil, []uint32{}, -1},
		{"equal", []uint32{1, 2, 3}, []uint32{1, 2, 3}, -1},
		{"differ at 0", []uint32{9, 2, 3}, []uint32{1, 2, 3}, 0},
		{"differ later", []uint32{1, 2, 3, 4, 5}, []uint32{1, 2, 3, 7, 5}, 3},
		{"differ at the last", []uint32{1, 2, 3}, []uint32{1, 2, 4}, 2},
		{"b longer", []uint32{1, 2}, []uint32{1, 2, 3}, 2},
		{"a longer", []uint32{1, 2, 3, 4}, []uint32{1, 2}, 2},
		{"one empty", nil, []uint32{5}, 0},
		{"shifted by a BOS", []uint32{128000, 1, 2}, []uint32{1, 2}, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := firstDiff(c.a, c.b); got != c.want {
				t.Fatalf("firstDiff(%v, %v) = %d, want %d", c.a, c.b, got, c.want)
			}
			if got := firstDiff(c.b, c.a); got != c.want {
				t.Fatalf("not symmetric: firstDiff(%v, %v) = %d, want %d", c.b, c.a, got, c.want)
			}
		})
	}
}

func TestSelfCheckAround(t *testing.T) {
	ids := []uint32{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}
	for _, c := range []struct {
		at, n int
		want  []uint32
	}{
		{0, 3, []uint32{0, 1, 2}},
		{5, 2, []uint32{3, 4, 5, 6}},
		{9, 3, []uint32{6, 7, 8, 9}},
		{10, 2, []uint32{8, 9}}, // at the end: a prefix of the other slice
		{12, 2, []uint32{}},
	} {
		if got := around(ids, c.at, c.n); !slices.Equal(got, c.want) {
			t.Errorf("around(at %d, n %d) = %v, want %v", c.at, c.n, got, c.want)
		}
	}
}

func mismatchGauge(t *testing.T, c *tokenizerCheck, worker string) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.mismatch.WithLabelValues("m", worker).Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetGauge().GetValue()
}

func seriesCount(g *prometheus.GaugeVec) int {
	ch := make(chan prometheus.Metric, 100)
	g.Collect(ch)
	close(ch)
	return len(ch)
}

// fakeTokenizeWorker answers /tokenize with m's ids, passed through edit.
func fakeTokenizeWorker(t *testing.T, m *prompt.Model, edit func([]uint32) []uint32) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/tokenize" {
			http.NotFound(w, r)
			return
		}
		body, _ := io.ReadAll(r.Body)
		ids, err := m.Tokenize(body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"count": len(ids), "tokens": edit(ids)})
	}))
	t.Cleanup(srv.Close)
	return srv
}

// logSink is a log sink the test reads while the code writes, echoed to t.Log.
type logSink struct {
	mu sync.Mutex
	b  bytes.Buffer
	t  *testing.T
}

func (s *logSink) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.t.Log(strings.TrimSpace(string(p)))
	return s.b.Write(p)
}

func (s *logSink) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// The check against fake workers: one agreeing, one whose ids differ
// (a BOS too many), one without /tokenize, one down, one of a model this
// replica has no files for; then the drifting worker is fixed.
func TestSelfCheckFakeWorkers(t *testing.T) {
	m := prompt.Legacy("m", tokenize.Builtin(), tokenize.Plain, "builtin")
	var drift sync.Mutex
	drifting := true
	good := fakeTokenizeWorker(t, m, func(ids []uint32) []uint32 { return ids })
	bad := fakeTokenizeWorker(t, m, func(ids []uint32) []uint32 {
		drift.Lock()
		defer drift.Unlock()
		if !drifting {
			return ids
		}
		return append([]uint32{1}, ids...)
	})
	none := httptest.NewServer(http.NotFoundHandler())
	defer none.Close()
	down := httptest.NewServer(http.NotFoundHandler())
	down.Close()
	workers := []fsm.WorkerRecord{
		{ID: "good", Model: "m", Address: good.URL}, {ID: "bad", Model: "m", Address: bad.URL},
		{ID: "none", Model: "m", Address: none.URL}, {ID: "down", Model: "m", Address: down.URL},
		{ID: "other", Model: "unknown", Address: good.URL},
	}
	lookup := func(model string) (*prompt.Model, bool) { return m, model == "m" }
	logs := &logSink{t: t}
	c := newTokenizerCheck(time.Hour, lookup, func() []fsm.WorkerRecord { return workers }, prometheus.NewRegistry(),
		slog.New(slog.NewTextHandler(logs, nil)))
	c.minGap = 0
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	want := map[string]string{"good": "ok", "bad": "mismatch at 0", "none": "unavailable: short-chat: /tokenize answered HTTP 404",
		"down": "unavailable: POST /tokenize", "other": "skipped: no tokenizer"}
	settled := func() error {
		for id, w := range want {
			if got, _, _ := c.status(id); !strings.HasPrefix(got, w) {
				return fmt.Errorf("%s: %q, want %q…", id, got, w)
			}
		}
		return nil
	}
	c.schedule(ctx, time.Now())
	poll.Until(t, 10*time.Second, 50*time.Millisecond, settled)
	if v := mismatchGauge(t, c, "bad"); v != 1 {
		t.Fatalf("mismatch gauge of bad: %v", v)
	}
	if v := mismatchGauge(t, c, "good"); v != 0 {
		t.Fatalf("mismatch gauge of good: %v", v)
	}
	if n := seriesCount(c.mismatch); n != 2 {
		t.Fatalf("%d mismatch series, want 2 (unchecked workers have none)", n)
	}
	_, detail, _ := c.status("bad")
	if detail["canary"] != "short-chat" || detail["position"] != 0 {
		t.Fatalf("mismatch detail %v", detail)
	}
	out := logs.String()
	if !regexp.MustCompile(`level=WARN msg="tokenizer mismatch[^"]*" model=m worker=bad url=\S+ canary=short-chat first_differing_position=0 replica_ids="?\[`).MatchString(out) {
		t.Fatalf("no mismatch warning naming model, worker and position in:\n%s", out)
	}
	if strings.Count(out, "not possible for this worker") != 3 || strings.Contains(out, "level=WARN msg=\"tokenizer mismatch\" model=m worker=none") {
		t.Fatalf("unavailable and skipped workers: want one info line each:\n%s", out)
	}

	// Not due again for an hour; a re-registration checks at once and the
	// unavailable ones stay quiet.
	c.schedule(ctx, time.Now())
	drift.Lock()
	drifting = false
	drift.Unlock()
	c.note(fsm.Change{Kind: fsm.ChangeWorkers, Worker: "bad"})
	c.note(fsm.Change{Kind: fsm.ChangeWorkers, Worker: "none"})
	c.schedule(ctx, time.Now())
	want["bad"] = "ok"
	poll.Until(t, 10*time.Second, 50*time.Millisecond, settled)
	if v := mismatchGauge(t, c, "bad"); v != 0 {
		t.Fatalf("mismatch gauge of the fixed worker: %v", v)
	}
	poll.Until(t, 5*time.Second, 50*time.Millisecond, func() error {
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.state["none"].running {
			return fmt.Errorf("still checking")
		}
		return nil
	})
	if out := logs.String(); !strings.Contains(out, "agree again") || strings.Count(out, "not possible for this worker") != 3 {
		t.Fatalf("after the fix:\n%s", out)
	}

	// A deregistered worker leaves the status and the gauge.
	workers = workers[:1]
	c.schedule(ctx, time.Now())
	if got, _, _ := c.status("bad"); got != "pending" || seriesCount(c.mismatch) != 1 {
		t.Fatalf("after deregistration: %q, %d series", got, seriesCount(c.mismatch))
	}
}

// TestSelfCheckWorkerKey: a worker started with an API key (its /tokenize
// answers 401 without it) reads "unavailable" to a check without the
// proxy's access and "ok" once useWorkerAccess gives it the transport and
// each worker's key; a worker with its own key gets that one.
func TestSelfCheckWorkerKey(t *testing.T) {
	m := prompt.Legacy("m", tokenize.Builtin(), tokenize.Plain, "builtin")
	keyed := func(key string) *httptest.Server {
		inner := fakeTokenizeWorker(t, m, func(ids []uint32) []uint32 { return ids })
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("Authorization") != "Bearer "+key {
				http.Error(w, `{"error":"Unauthorized"}`, http.StatusUnauthorized)
				return
			}
			r.URL.Host, r.URL.Scheme, r.RequestURI = strings.TrimPrefix(inner.URL, "http://"), "http", ""
			resp, err := http.DefaultTransport.RoundTrip(r)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			defer resp.Body.Close()
			w.WriteHeader(resp.StatusCode)
			_, _ = io.Copy(w, resp.Body)
		}))
		t.Cleanup(srv.Close)
		return srv
	}
	shared, own := keyed("shared-key"), keyed("own-key")
	workers := []fsm.WorkerRecord{{ID: "shared", Model: "m", Address: shared.URL}, {ID: "own", Model: "m", Address: own.URL}}
	lookup := func(model string) (*prompt.Model, bool) { return m, model == "m" }
	newCheck := func() *tokenizerCheck {
		c := newTokenizerCheck(time.Hour, lookup, func() []fsm.WorkerRecord { return workers }, prometheus.NewRegistry(),
			slog.New(slog.NewTextHandler(&logSink{t: t}, nil)))
		c.minGap = 0
		return c
	}
	settle := func(c *tokenizerCheck, want map[string]string) {
		t.Helper()
		c.schedule(context.Background(), time.Now())
		poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
			for id, w := range want {
				if got, _, _ := c.status(id); !strings.HasPrefix(got, w) {
					return fmt.Errorf("%s: %q, want %q…", id, got, w)
				}
			}
			return nil
		})
	}
	settle(newCheck(), map[string]string{"shared": "unavailable: short-chat: /tokenize answered HTTP 401", "own": "unavailable: short-chat: /tokenize answered HTTP 401"})

	c := newCheck()
	var asked sync.Map
	c.useWorkerAccess(http.DefaultTransport.(*http.Transport).Clone(), func(id string) string {
		asked.Store(id, true)
		if id == "own" {
			return "own-key"
		}
		return "shared-key"
	})
	settle(c, map[string]string{"shared": "ok", "own": "ok"})
	for _, id := range []string{"shared", "own"} {
		if _, ok := asked.Load(id); !ok {
			t.Errorf("the key of %s was not asked for by its id", id)
		}
	}
}
