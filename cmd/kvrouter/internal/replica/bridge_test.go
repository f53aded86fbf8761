package replica

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvrouter/kvrouter/eventbus"
)

// TestBridgeInReplica: the in-replica bridge refuses a block size other
// than the router's, and one that runs stops when its context ends.
func TestBridgeInReplica(t *testing.T) {
	srv := busWithStream(t, "replica-bridge")
	nc, err := eventbus.Connect(srv.ClientURL(), "t", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	dir := t.TempDir()
	path := filepath.Join(dir, "b.json")
	_ = os.WriteFile(path, []byte(`{"block_size":32,"workers":[]}`), 0o644)
	if _, err := startReplicaBridge(t.Context(), path, nc, "", "", 16, nil, nil, nil); err == nil {
		t.Fatal("block size mismatch accepted")
	}
	_ = os.WriteFile(path, []byte(`{"workers":[{"id":"a","url":"http://127.0.0.1:1","model":"m","events":"tcp://127.0.0.1:1"}]}`), 0o644)
	ctx, cancel := context.WithCancel(context.Background())
	wait, err := startReplicaBridge(ctx, path, nc, "", "", 16, nil, nil, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	cancel() // the bridge stops whether or not its worker ever connected
	wait()
}
