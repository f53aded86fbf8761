package api

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"net/http/httptest"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api/capture"
	"github.com/kvrouter/kvrouter/router"
)

// TestAPICapture: every answered request, streamed or not, becomes one
// capture row with its router block hashes, lengths, the worker and the
// engine's cached tokens; a request the router refuses leaves none.
func TestAPICapture(t *testing.T) {
	rep := newFakeReplica("m", router.DefaultConfig())
	var hits atomic.Int64
	rep.addWorker("m", "w1", fakeWorker(t, &hits).URL)
	path := filepath.Join(t.TempDir(), "capture.jsonl")
	rec, err := capture.Open(capture.Config{Path: path, Sample: 1, Replica: "r1"}, time.Now(), nil)
	if err != nil {
		t.Fatal(err)
	}
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, Capture: rec}, rep)
	for i, body := range []string{fmt.Sprintf(chatBody, ""), fmt.Sprintf(chatBody, `,"stream":true`), `{"model":"nope","messages":[]}`} {
		req := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		w := httptest.NewRecorder()
		s.Handler().ServeHTTP(w, req)
		if (w.Code == 200) != (i < 2) {
			t.Fatalf("request %d: %d %s", i, w.Code, w.Body)
		}
	}
	if err := rec.Close(); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var rows []capture.Row
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var r capture.Row
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatal(err)
		}
		rows = append(rows, r)
	}
	if len(rows) != 2 {
		t.Fatalf("%d rows, want 2 (the refused request leaves none)", len(rows))
	}
	for i, r := range rows {
		want := (r.InputLength + r.BlockTokens - 1) / r.BlockTokens
		if r.Worker != "w1" || r.Model != "m" || r.Replica != "r1" || r.BlockTokens != 16 || r.InputLength == 0 || len(r.HashIDs) != want || r.UnixMs == 0 {
			t.Errorf("row %d: %+v", i, r)
		}
	}
	// The streamed answer's usage says 16 cached of 40 prompt tokens.
	if rows[1].CachedTokens != 16 || !rows[1].OutputKnown || rows[1].OutputLength == 0 {
		t.Errorf("streamed row: %+v", rows[1])
	}
	if rows[0].HashIDs[0] != rows[1].HashIDs[0] {
		t.Errorf("one prompt, two first-block hashes: %d %d", rows[0].HashIDs[0], rows[1].HashIDs[0])
	}
}
