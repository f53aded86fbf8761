package replica

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/fsm"
)

// vLLM lists loaded adapters in /v1/models with the base model as parent.
func TestLoRAParseAdapters(t *testing.T) {
	cases := []struct {
		name, body string
		want       []string
		wantErr    bool
	}{
		{"vllm with two adapters", `{"object":"list","data":[{"id":"base","parent":null},{"id":"sql","parent":"base"},{"id":"chat","parent":"base"}]}`, []string{"sql", "chat"}, false},
		{"adapter of another base", `{"data":[{"id":"x","parent":"other"}]}`, nil, false},
		{"no parent field (kvmock, SGLang without adapters)", `{"data":[{"id":"base"}]}`, nil, false},
		{"the base listing itself as parent", `{"data":[{"id":"base","parent":"base"}]}`, nil, false},
		{"not JSON", `<html>`, nil, true},
	}
	for _, c := range cases {
		got, err := parseAdapters(strings.NewReader(c.body), "base")
		if (err != nil) != c.wantErr || !slices.Equal(got, c.want) {
			t.Errorf("%s: %v %v, want %v", c.name, got, err, c.want)
		}
	}
}

// TestLoRAWorkerKey: a worker started with --api-key lists its adapters
// only to a caller with its key; with the proxy's access the directory
// learns them, without it it learns nothing.
func TestLoRAWorkerKey(t *testing.T) {
	worker := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer wk" {
			http.Error(w, `{"error":"Unauthorized"}`, http.StatusUnauthorized)
			return
		}
		io.WriteString(w, `{"data":[{"id":"base"},{"id":"sql","parent":"base"}]}`)
	}))
	defer worker.Close()
	workers := []fsm.WorkerRecord{{ID: "w1", Model: "base", Address: worker.URL, DPRanks: 1}}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))

	d := newLoRADirectory(log)
	d.refresh(context.Background(), workers)
	if _, _, ok := d.Adapter("sql"); ok {
		t.Fatal("adapter learned without the key")
	}
	d.useWorkerAccess(http.DefaultTransport.(*http.Transport).Clone(), func(id string) string {
		if id == "w1" {
			return "wk"
		}
		return ""
	})
	d.refresh(context.Background(), workers)
	if base, ws, ok := d.Adapter("sql"); !ok || base != "base" || len(ws) != 1 {
		t.Fatalf("with the key: %q %v %v", base, ws, ok)
	}
}
