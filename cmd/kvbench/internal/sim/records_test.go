package sim

import (
	"bytes"
	"encoding/json"
	"math"
	"reflect"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/stats"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/router"
)

// TestRecordsAgreeWithSummary: the request records of a tenant run
// through three routers are the requests the summary is computed from —
// one per request in workload order, each tenant's TTFT quantiles and
// charged tokens equal to its summary figures, the steady tenant's
// requests all through its router 0 and the flood's through all three —
// and they survive the JSON Lines round trip unchanged.
func TestRecordsAgreeWithSummary(t *testing.T) {
	w, cfg := tenantScenario(t, 400, 3, CountersShared)
	res, err := Run(w, cfg)
	if err != nil {
		t.Fatal(err)
	}
	s := SummarizeSLO(w, res, time.Minute, SLO{})
	recs := Records(w, res, 2, 9)
	if len(recs) != len(w.Requests) {
		t.Fatalf("%d records for %d requests", len(recs), len(w.Requests))
	}
	ttft := map[string][]float64{}
	charged := map[string]int64{}
	routers := map[string]map[int]bool{"flood": {}, "steady": {}}
	queued := 0
	for i, r := range recs {
		if r.ID != w.Requests[i].ID || r.Policy != "kv" || r.Rep != 2 || r.Seed != 9 {
			t.Fatalf("record %d: %+v, want request %s of policy kv, rep 2, seed 9", i, r, w.Requests[i].ID)
		}
		if !r.Done || r.TTFTMs == nil || r.QueueMs == nil || r.Worker == "" {
			t.Fatalf("record %d: %+v: every request of this run completes", i, r)
		}
		if r.RoutedMs < r.SentMs || r.FirstTokenMs < r.RoutedMs || r.FinishedMs < r.FirstTokenMs || math.Abs(*r.QueueMs-(r.RoutedMs-r.SentMs)) > 1e-6 {
			t.Fatalf("record %d: times out of order: %+v", i, r)
		}
		if *r.QueueMs > 0 {
			queued++
		}
		ttft[r.Tenant] = append(ttft[r.Tenant], *r.TTFTMs)
		charged[r.Tenant] += int64(r.Charged)
		routers[r.Tenant][r.Router] = true
	}
	if queued == 0 {
		t.Fatalf("no request waited in a router's queue: the run does not exercise queue_ms")
	}
	for k, tf := range s.Tenants {
		if got := stats.Of(ttft[tf.Tenant]); got.P50 != tf.TTFT.P50 || got.P99 != tf.TTFT.P99 {
			t.Errorf("tenant %s: records' TTFT p50/p99 %.3f/%.3f, summary's %.3f/%.3f", tf.Tenant, got.P50, got.P99, tf.TTFT.P50, tf.TTFT.P99)
		}
		if charged[tf.Tenant] != res.Tenants[k].Tokens || charged[tf.Tenant] == 0 {
			t.Errorf("tenant %s: records charged %d tokens, the ledger totals %d", tf.Tenant, charged[tf.Tenant], res.Tenants[k].Tokens)
		}
	}
	if len(routers["steady"]) != 1 || !routers["steady"][0] || len(routers["flood"]) != 3 {
		t.Errorf("routers used: %v; want steady through router 0 only, flood through all three", routers)
	}

	var buf bytes.Buffer
	if err := WriteRecords(&buf, recs); err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(&buf)
	for i := range recs {
		var got RequestRecord
		if err := dec.Decode(&got); err != nil {
			t.Fatalf("line %d: %v", i+1, err)
		}
		if !reflect.DeepEqual(got, recs[i]) {
			t.Fatalf("line %d: %+v, wrote %+v", i+1, got, recs[i])
		}
	}
	if dec.More() {
		t.Fatalf("more lines than records")
	}
}

// TestRecordsFailedRequest: a request never routed has no worker, routing
// time, TTFT or queue time, and says why it failed; a routed one that did
// not complete keeps its worker and routing time.
func TestRecordsFailedRequest(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{Prefixes: 1, PrefixTokens: 64, OutputTokens: 4, Requests: 2, Concurrency: 1, Seed: 1})
	res := &Result{Policy: "kv", Workers: []router.WorkerID{"w0"}, Requests: []RequestResult{
		{Worker: -1, Sent: time.Second, Err: "route: no worker"},
		{Worker: 0, Sent: 2 * time.Second, Routed: 2*time.Second + 5*time.Millisecond, Err: "did not complete"},
	}}
	recs := Records(w, res, 0, 1)
	for i, want := range []RequestRecord{
		{Policy: "kv", Seed: 1, ID: w.Requests[0].ID, Session: workload.NoSession, PromptTokens: w.Requests[0].PromptTokens,
			OutputTokens: 4, SentMs: 1000, Error: "route: no worker"},
		{Policy: "kv", Seed: 1, ID: w.Requests[1].ID, Session: workload.NoSession, PromptTokens: w.Requests[1].PromptTokens,
			OutputTokens: 4, Worker: "w0", SentMs: 2000, RoutedMs: 2005, Error: "did not complete"},
	} {
		if !reflect.DeepEqual(recs[i], want) {
			t.Errorf("record %d: %+v, want %+v", i, recs[i], want)
		}
	}
}
