package replica

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
)

// TestReplicaPprofLoopbackOnly: --pprof-addr serves Go's profiler on a
// loopback address, refuses any other before listening, and stops with its
// context.
func TestReplicaPprofLoopbackOnly(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, addr := range []string{"0.0.0.0:0", ":0", "192.0.2.1:0", "localhost"} {
		if a, err := servePprof(context.Background(), addr, log); err == nil {
			t.Fatalf("servePprof(%q) listened on %v, want a refusal", addr, a)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	a, err := servePprof(ctx, "127.0.0.1:0", log)
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + a.String() + "/debug/pprof/"
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "goroutine") {
		t.Fatalf("GET %s: HTTP %d, %.200q", url, resp.StatusCode, body)
	}
	cancel()
	// Closed with its context (on a goroutine of its own: poll).
	client := &http.Client{Timeout: time.Second}
	poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error {
		resp, err := client.Get(url)
		if err != nil {
			return nil
		}
		resp.Body.Close()
		return fmt.Errorf("GET %s still answers after cancel", url)
	})
}
