package api

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api/decisionlog"
	"github.com/kvrouter/kvrouter/router"
)

// epochReplica is a fake replica with an index view.
type epochReplica struct {
	*fakeReplica
}

func (epochReplica) IndexEpoch() uint64 { return 4242 }
func (epochReplica) SyncAge(time.Time) (time.Duration, bool) {
	return 250 * time.Millisecond, true
}

// TestAPIDecisionLog: every routed request leaves a decision with its cost
// table, the index epoch and sync age it was made against, and the
// engine's account of it (status, TTFT, cached tokens); GET
// /debug/decisions finds it by request id and worker, refuses bad filters,
// and says so when the log is off.
func TestAPIDecisionLog(t *testing.T) {
	rep := newFakeReplica("m", router.DefaultConfig())
	var hits atomic.Int64
	rep.addWorker("m", "w1", fakeWorker(t, &hits).URL)
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, Decisions: decisionlog.New(16, nil)},
		epochReplica{rep})
	for i, body := range []string{fmt.Sprintf(chatBody, ""), fmt.Sprintf(chatBody, `,"stream":true`)} {
		req := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Request-Id", fmt.Sprintf("client-req-%d", i))
		rec := httptest.NewRecorder()
		s.Handler().ServeHTTP(rec, req)
		if rec.Code != 200 {
			t.Fatalf("request %d: %d %s", i, rec.Code, rec.Body)
		}
	}
	get := func(q string) (int, []decisionlog.Decision, string) {
		rec := httptest.NewRecorder()
		s.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/debug/decisions"+q, nil))
		var out struct {
			Decisions []decisionlog.Decision `json:"decisions"`
		}
		_ = json.Unmarshal(rec.Body.Bytes(), &out)
		return rec.Code, out.Decisions, rec.Body.String()
	}
	code, ds, body := get("?request_id=client-req-1")
	if code != 200 || len(ds) != 1 {
		t.Fatalf("by request id: %d %s", code, body)
	}
	d := ds[0]
	if d.Worker != "w1" || d.Model != "m" || d.Attempt != 1 || d.IndexEpoch != 4242 || d.SyncAgeMs != 250 ||
		len(d.Candidates) != 1 || d.Candidates[0].Worker != "w1" || d.PromptTokens == 0 {
		t.Fatalf("decision %+v", d)
	}
	if o := d.Outcome; o == nil || o.Status != 200 || o.CachedTokens != 16 || o.PromptTokens != 40 || o.TTFTMs <= 0 {
		t.Fatalf("outcome %+v (the streamed answer reports 16 cached of 40)", d.Outcome)
	}
	if _, ds, _ := get("?worker=w1"); len(ds) != 2 || ds[0].RequestID != "client-req-1" {
		t.Fatalf("by worker: %+v, want both, newest first", ds)
	}
	if _, ds, _ := get("?worker=w9"); len(ds) != 0 {
		t.Fatalf("other worker: %+v", ds)
	}
	for _, q := range []string{"?limit=0", "?limit=x", "?since=yesterday"} {
		if code, _, body := get(q); code != http.StatusBadRequest {
			t.Errorf("%s: %d %s, want 400", q, code, body)
		}
	}
	off := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true}, rep)
	rec := httptest.NewRecorder()
	off.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/debug/decisions", nil))
	if rec.Code != http.StatusNotFound {
		t.Errorf("log off: %d, want 404", rec.Code)
	}
}
