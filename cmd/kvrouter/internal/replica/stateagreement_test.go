package replica

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/router"
)

func TestStateAgreementCompareCheckpoints(t *testing.T) {
	cp := func(pairs ...any) []fsm.Checkpoint {
		var out []fsm.Checkpoint
		for i := 0; i < len(pairs); i += 2 {
			out = append(out, fsm.Checkpoint{Index: uint64(pairs[i].(int)), Digest: pairs[i+1].(string)})
		}
		return out
	}
	cases := []struct {
		name        string
		here, there []fsm.Checkpoint
		verdict     string
		index       uint64
	}{
		{"newest common agrees", cp(8, "a", 16, "b", 24, "c"), cp(16, "b", 24, "c", 32, "d"), "agree", 24},
		{"newest common differs", cp(8, "a", 16, "b"), cp(8, "a", 16, "X"), "differ", 16},
		{"an older difference is not looked at", cp(8, "a", 16, "b"), cp(8, "X", 16, "b"), "agree", 16},
		{"nothing in common", cp(8, "a"), cp(16, "b"), "not compared", 0},
		{"none yet", nil, cp(16, "b"), "not compared", 0},
	}
	for _, c := range cases {
		v := compareCheckpoints(c.here, c.there)
		if v.Verdict != c.verdict || v.Index != c.index {
			t.Errorf("%s: %+v, want %s at %d", c.name, v, c.verdict, c.index)
		}
	}
}

// TestStateAgreementCheck: against a peer's /cluster/status, the newest
// common checkpoint decides; a divergence sets the gauge and is reported;
// an idle cluster (no common checkpoint, one applied index) compares the
// current digests.
func TestStateAgreementCheck(t *testing.T) {
	f, err := fsm.NewFSM(router.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	f.SetDigestCheckpoints(64)
	data, err := fsm.Encode(fsm.RegisterWorker{ID: "w1", DPRanks: 1, Model: "m", TotalBlocks: 100})
	if err != nil {
		t.Fatal(err)
	}
	f.Apply(&raft.Log{Index: 1, Term: 1, Type: raft.LogCommand, Data: data})

	var status map[string]any
	peer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		st := status
		if r.URL.Query().Get("digest") == "0" {
			st = map[string]any{}
			for k, v := range status {
				if k != "digest" {
					st[k] = v
				}
			}
		}
		_ = json.NewEncoder(w).Encode(st)
	}))
	defer peer.Close()
	reg := prometheus.NewRegistry()
	a := newStateAgreement("r1", f, reg, slog.New(slog.DiscardHandler))
	ctx := context.Background()

	cases := []struct {
		name    string
		status  map[string]any
		verdict string
		gauge   float64
	}{
		{"idle, same state", map[string]any{"applied_index": 1, "digest": f.Digest()}, "agree", 0},
		{"idle, another state", map[string]any{"applied_index": 1, "digest": "feed"}, "differ", 1},
		{"peer further on, no checkpoint in common", map[string]any{"applied_index": 9, "digest": "feed"}, "not compared", 1},
	}
	for _, c := range cases {
		status = c.status
		a.check(ctx, "r2", peer.URL)
		v := a.snapshot()["r2"]
		if v.Verdict != c.verdict {
			t.Fatalf("%s: %+v, want %s", c.name, v, c.verdict)
		}
		var m dto.Metric
		if err := a.gauge.WithLabelValues("r2", "").Write(&m); err != nil {
			t.Fatal(err)
		}
		if g := m.GetGauge().GetValue(); g != c.gauge {
			t.Fatalf("%s: gauge %v, want %v", c.name, g, c.gauge)
		}
	}
	if !strings.Contains(a.snapshot()["r2"].Detail, "checkpoint") {
		t.Fatalf("detail %q", a.snapshot()["r2"].Detail)
	}
}

// TestStateAgreementGroups: with a sharded index every data group is
// compared on its own, from the peer's raft_groups, reported under
// "<peer> group <g>" with the gauge labelled by group; a group the peer
// does not run is "not compared", never "agree".
func TestStateAgreementGroups(t *testing.T) {
	control, err := fsm.NewFSM(router.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	data, err := fsm.NewFSM(router.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	cmd, err := fsm.Encode(fsm.RegisterWorker{ID: "w1", DPRanks: 1, Model: "m", TotalBlocks: 100})
	if err != nil {
		t.Fatal(err)
	}
	data.Apply(&raft.Log{Index: 1, Term: 1, Type: raft.LogCommand, Data: cmd})

	var status map[string]any
	peer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = json.NewEncoder(w).Encode(status)
	}))
	defer peer.Close()
	a := newStateAgreement("r1", control, prometheus.NewRegistry(), slog.New(slog.DiscardHandler))
	a.groups = []stateGroup{{1, data}}
	top := map[string]any{"applied_index": 0, "digest": control.Digest()}
	cases := []struct {
		name    string
		groups  []map[string]any
		verdict string
		gauge   float64
	}{
		{"group agrees", []map[string]any{{"group": 1, "applied_index": 1, "digest": data.Digest()}}, "agree", 0},
		{"group differs", []map[string]any{{"group": 1, "applied_index": 1, "digest": "feed"}}, "differ", 1},
		{"peer runs no group 1", nil, "not compared", 1},
	}
	for _, c := range cases {
		status = map[string]any{"raft_groups": c.groups}
		for k, v := range top {
			status[k] = v
		}
		a.check(context.Background(), "r2", peer.URL)
		rep := a.snapshot()
		if rep["r2"].Verdict != "agree" {
			t.Fatalf("%s: control group %+v, want agree", c.name, rep["r2"])
		}
		if v := rep["r2 group 1"]; v.Verdict != c.verdict {
			t.Fatalf("%s: group 1 %+v, want %s", c.name, v, c.verdict)
		}
		var m dto.Metric
		if err := a.gauge.WithLabelValues("r2", "1").Write(&m); err != nil {
			t.Fatal(err)
		}
		if g := m.GetGauge().GetValue(); g != c.gauge {
			t.Fatalf("%s: gauge %v, want %v", c.name, g, c.gauge)
		}
	}
}
