package api

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/router"
)

// TestAPISetPriority: the body's top-level "priority" is set, inserted
// first when absent, replaced in place (every duplicate) when present;
// nested members and every other byte are kept; anything but one JSON
// object is refused.
func TestAPISetPriority(t *testing.T) {
	for _, tc := range []struct {
		name, in, want string
		prio           int64
	}{
		{"absent", `{"model":"m","messages":[]}`, `{"priority":3,"model":"m","messages":[]}`, 3},
		{"empty object", `{}`, `{"priority":3}`, 3},
		{"empty with spaces", " { } ", ` {"priority":3 } `, 3},
		{"client's replaced", `{"priority":7,"model":"m"}`, `{"priority":-2,"model":"m"}`, -2},
		{"null, spaced", `{"priority" : null }`, `{"priority" : 4294967296 }`, 4294967296},
		{"duplicates and a nested one", `{"priority":1,"x":{"priority":9},"priority":"a"}`, `{"priority":0,"x":{"priority":9},"priority":0}`, 0},
		{"escaped key", `{"priorit\u0079":2,"a":[1,2]}`, `{"priorit\u0079":5,"a":[1,2]}`, 5},
		{"a priority string value elsewhere", `{"p":"priority","n":{"priority":1}}`, `{"priority":1,"p":"priority","n":{"priority":1}}`, 1},
	} {
		got, err := setPriority([]byte(tc.in), tc.prio)
		if err != nil || string(got) != tc.want {
			t.Errorf("%s: setPriority(%s) = %s, %v; want %s", tc.name, tc.in, got, err, tc.want)
		}
	}
	for _, bad := range []string{``, `[]`, `"x"`, `1`, `{`, `{"a":1} {}`, `{"a":1}x`, `{"a":}`, `null`} {
		if got, err := setPriority([]byte(bad), 1); err == nil {
			t.Errorf("setPriority(%q) = %s, want an error", bad, got)
		}
	}
}

// TestAPIEnginePriorityValue: the level dominates, the client's soft
// priority (higher more urgent) orders within it, soft 0 is the bare
// level.
func TestAPIEnginePriorityValue(t *testing.T) {
	if enginePriority(engineAtShare, 0) != 0 || enginePriority(engineOverShare, 0) != 1<<32 {
		t.Errorf("bare levels %d, %d", enginePriority(engineAtShare, 0), enginePriority(engineOverShare, 0))
	}
	if !(enginePriority(engineAtShare, 5) < enginePriority(engineAtShare, 0)) {
		t.Error("a more urgent soft priority must get a lower engine priority")
	}
	// The extremes of the soft priority never cross levels.
	if !(enginePriority(engineAtShare, math.MinInt32) < enginePriority(engineOverShare, math.MaxInt32)) {
		t.Error("levels overlap")
	}
}

// FuzzAPISetPriority: whenever the body is one JSON object, setPriority
// succeeds, its output is one JSON object whose "priority" is the value and
// whose other top-level members are the input's, byte for byte; when it is
// not, setPriority refuses it.
func FuzzAPISetPriority(f *testing.F) {
	for _, s := range []string{`{}`, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, `{"priority":1,"priority":2}`,
		` {"a" : {"priority": [1, {"priority":2}]} , "priority" :"x"} `, `[]`, `{"a":1}{}`, `{"priorit\u0079":null}`} {
		f.Add([]byte(s), int64(7))
	}
	f.Fuzz(func(t *testing.T, body []byte, prio int64) {
		var in map[string]json.RawMessage
		inErr := json.Unmarshal(body, &in)
		out, err := setPriority(body, prio)
		if inErr != nil || in == nil {
			if err == nil && inErr != nil {
				t.Fatalf("setPriority accepted %q, which is not a JSON object: %v", body, inErr)
			}
			return
		}
		if err != nil {
			t.Fatalf("setPriority(%q): %v", body, err)
		}
		var got map[string]json.RawMessage
		if err := json.Unmarshal(out, &got); err != nil {
			t.Fatalf("setPriority(%q) = %q: not JSON: %v", body, out, err)
		}
		if string(got["priority"]) != strconv.FormatInt(prio, 10) {
			t.Fatalf("setPriority(%q) = %q: priority %s, want %d", body, out, got["priority"], prio)
		}
		delete(got, "priority")
		delete(in, "priority")
		if len(got) != len(in) {
			t.Fatalf("setPriority(%q) = %q: members %d, want %d", body, out, len(got), len(in))
		}
		for k, v := range in {
			if !bytes.Equal(got[k], v) {
				t.Fatalf("setPriority(%q) = %q: member %q is %s, was %s", body, out, k, got[k], v)
			}
		}
	})
}

// TestAPITenantEnginePriority: with TenantConfig.EnginePriority the worker
// receives "priority" from the ledger and the client's soft hint: the
// over-share tenant's request 2³² (its own "priority" replaced), the
// under-share tenant's with agent hint 3 (within the key's cap) −3; with
// the setting off the body reaches the worker untouched.
func TestAPITenantEnginePriority(t *testing.T) {
	for _, on := range []bool{true, false} {
		rep := newFakeReplica("m", router.DefaultConfig())
		var mu sync.Mutex
		got := map[string]json.RawMessage{}
		raw := map[string]string{}
		worker := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			var m map[string]json.RawMessage
			_ = json.Unmarshal(b, &m)
			var msgs []struct{ Content string }
			_ = json.Unmarshal(m["messages"], &msgs)
			mu.Lock()
			got[msgs[0].Content], raw[msgs[0].Content] = m["priority"], string(b)
			mu.Unlock()
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprint(w, `{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":40,"completion_tokens":1}}`)
		}))
		rep.addWorker("m", "w1", worker.URL)
		l, _ := NewTenantLedger(TenantConfig{From: TenantHeader, EnginePriority: on})
		l.Charge("m", "heavy", 50_000)
		l.Begin("m", "heavy")
		l.Begin("m", "light")
		s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, MaxPriority: 5, Tenants: l}, rep)
		srv := httptest.NewServer(s.Handler())
		bodies := map[string]string{
			"heavy": `{"model":"m","priority":9,"messages":[{"role":"user","content":"heavy"}]}`,
			"light": `{"model":"m","messages":[{"role":"user","content":"light"}],"nvext":{"agent_hints":{"priority":3}}}`,
		}
		for _, tenant := range []string{"heavy", "light"} {
			req, _ := http.NewRequest("POST", srv.URL+"/v1/chat/completions", strings.NewReader(bodies[tenant]))
			req.Header.Set(DefaultTenantHeader, tenant)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("%s: answered %d", tenant, resp.StatusCode)
			}
		}
		srv.Close()
		worker.Close()
		mu.Lock()
		if on {
			if string(got["heavy"]) != "4294967296" || string(got["light"]) != "-3" {
				t.Errorf("on: the worker saw priority %s for heavy, %s for light; want 4294967296 and -3", got["heavy"], got["light"])
			}
		} else if raw["heavy"] != bodies["heavy"] || raw["light"] != bodies["light"] {
			t.Errorf("off: the worker saw %s and %s, want the bodies untouched", raw["heavy"], raw["light"])
		}
		mu.Unlock()
	}
}
