package api

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/router"
)

// cursorReplica is a fakeReplica that also answers the cursors view.
type cursorReplica struct {
	*fakeReplica
	st CursorStatus
}

func (c cursorReplica) CursorStatus() CursorStatus { return c.st }

func TestAPIClusterStatusCursorsView(t *testing.T) {
	base := newFakeReplica("m", router.DefaultConfig())
	withView := cursorReplica{fakeReplica: base, st: CursorStatus{NodeID: "r1", State: "leader", LeaderID: "r1", AppliedIndex: 42,
		Workers: []CursorWorker{{ID: "w-admin-token-xyz", Ranks: []CursorRank{{Rank: 0, Blocks: 7, LastEventID: 9, Stale: "gap"}}}}}}
	cases := []struct {
		name     string
		rep      Replica
		path     string
		wantKeys []string // exactly these top-level keys
		wantFull bool     // the full document (the fake's: node_id only)
	}{
		{"view asked and known", withView, "/cluster/status?digest=0&view=cursors", []string{"applied_index", "leader_id", "node_id", "state", "workers"}, false},
		{"no view: the full document", withView, "/cluster/status?digest=0", nil, true},
		{"another view: the full document", withView, "/cluster/status?view=other", nil, true},
		{"replica without the view: the full document", base, "/cluster/status?digest=0&view=cursors", nil, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := New(Config{Registry: prometheus.NewRegistry(), AdminToken: "admin-token-xyz"}, tc.rep)
			rec := do(s, "GET", tc.path, "")
			if rec.Code != http.StatusOK {
				t.Fatalf("%d %s", rec.Code, rec.Body)
			}
			var doc map[string]json.RawMessage
			if err := json.Unmarshal(rec.Body.Bytes(), &doc); err != nil {
				t.Fatal(err)
			}
			if tc.wantFull {
				if _, ok := doc["workers"]; ok {
					t.Fatalf("cursors view answered: %s", rec.Body)
				}
				return
			}
			for _, k := range tc.wantKeys {
				if _, ok := doc[k]; !ok {
					t.Errorf("key %q missing: %s", k, rec.Body)
				}
			}
			if len(doc) != len(tc.wantKeys) {
				t.Errorf("keys %d, want %d: %s", len(doc), len(tc.wantKeys), rec.Body)
			}
			var st CursorStatus
			if err := json.Unmarshal(rec.Body.Bytes(), &st); err != nil {
				t.Fatal(err)
			}
			if st.AppliedIndex != 42 || len(st.Workers) != 1 || len(st.Workers[0].Ranks) != 1 ||
				st.Workers[0].Ranks[0] != (CursorRank{Rank: 0, Blocks: 7, LastEventID: 9, Stale: "gap"}) {
				t.Errorf("decoded %+v", st)
			}
			if strings.Contains(rec.Body.String(), "admin-token-xyz") {
				t.Errorf("a secret in a worker id not redacted: %s", rec.Body)
			}
		})
	}
}

// redactWith answers what redact answers.
func TestAPIRedactWithMatchesRedact(t *testing.T) {
	s := New(Config{Registry: prometheus.NewRegistry(), AdminToken: "admin-token-xyz", WorkerAPIKey: "wkey-123456"}, newFakeReplica("m", router.DefaultConfig()))
	for _, in := range []string{"", "w1", "mock-1#2", "http://u:p@host:1/x", "nats://tok@h:4222", "w-admin-token-xyz-and-wkey-123456",
		"a@b", "@", "x://@", "gap: event 3 after 1"} {
		if got, want := redactWith(in, s.secrets()), s.redact(in); got != want {
			t.Errorf("redactWith(%q) = %q, redact %q", in, got, want)
		}
	}
}
