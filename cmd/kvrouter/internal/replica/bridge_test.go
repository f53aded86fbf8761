package replica

import (
	"context"
	"encoding/binary"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/cluster/clustertest"
	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// TestBridgeInReplicaRefusesBlockSize: a bridge config whose block size is
// not the router's is refused before anything starts (the engine's hashes
// would never match the router's).
func TestBridgeInReplicaRefusesBlockSize(t *testing.T) {
	srv := busWithStream(t, "replica-bridge")
	nc, err := eventbus.Connect(srv.ClientURL(), "t", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	path := filepath.Join(t.TempDir(), "b.json")
	if err := os.WriteFile(path, []byte(`{"block_size":32,"workers":[]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = startReplicaBridge(t.Context(), path, nc, "", "", 16, nil, nil, nil)
	if err == nil {
		t.Fatal("block size 32 accepted by a router of block size 16")
	}
}

// TestBridgeInReplica: the bridge a replica runs from --bridge-config
// carries an engine's ZMQ KV events all the way into the replicated index.
// A fake engine publishes one vLLM BlockStored batch (msgpack, as vLLM
// sends it) on a PUB socket; the bridge inside the replica converts it and
// publishes it on the bus; the leader's consumer commits it through Raft;
// the FSM's index then answers a lookup of the same 16 tokens with that
// worker. When the replica's context ends, the bridge stops.
func TestBridgeInReplica(t *testing.T) {
	tc := newTestCluster(t, 1)
	leader := tc.WaitLeader()
	registerWorker(t, tc.R(leader.Index), "a")
	blockSize := router.DefaultConfig().BlockSize

	// The engine: a PUB socket for events, and the HTTP surface the bridge
	// reads (served model, cache configuration).
	zctx, zcancel := context.WithCancel(context.Background())
	t.Cleanup(zcancel)
	pub := zmq4.NewPub(zctx)
	t.Cleanup(func() { _ = pub.Close() })
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model"}]}`, model)
	})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, "vllm:cache_config_info{block_size=\"%d\",enable_prefix_caching=\"True\",num_gpu_blocks=\"1000\"} 1.0\n", blockSize)
	})
	engine := httptest.NewServer(mux)
	t.Cleanup(engine.Close)

	path := filepath.Join(t.TempDir(), "bridge.json")
	cfg := fmt.Sprintf(`{"workers":[{"id":"a","url":%q,"model":%q,"events":"tcp://%s"}]}`, engine.URL, model, pub.Addr())
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	nc, err := eventbus.Connect(tc.Bus.ClientURL(), "replica-bridge", clustertest.NewTestLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	wait, err := startReplicaBridge(ctx, path, nc, "", "", blockSize, nil, nil, clustertest.NewTestLogger(t))
	if err != nil {
		t.Fatal(err)
	}

	tokens := make([]uint32, blockSize)
	for i := range tokens {
		tokens[i] = uint32(1000 + i)
	}
	const engineHash = 0x0123456789abcdef
	// vLLM's array batch: [ts, [BlockStored(hashes, parent, tokens,
	// block_size, lora_id)]].
	payload, err := msgpack.Marshal([]any{1752000000.25, []any{
		[]any{"BlockStored", []any{uint64(engineHash)}, nil, tokens, blockSize, nil},
	}})
	if err != nil {
		t.Fatal(err)
	}
	seq := router.SequenceHashes(tokens, blockSize, "")
	key := fsm.RankKey{Worker: "a", DPRank: 0}
	idx := tc.R(leader.Index).fsm.Index()
	var n uint64
	// PUB drops what it sends before the bridge's SUB has joined, so the
	// engine keeps publishing (the same block: storing it again changes
	// nothing) until the index has it.
	poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
		var seqFrame [8]byte
		binary.BigEndian.PutUint64(seqFrame[:], n)
		n++
		if err := pub.Send(zmq4.NewMsgFrom([]byte(""), seqFrame[:], payload)); err != nil {
			return err
		}
		if held := idx.Held(key.ID()); held != 1 {
			return fmt.Errorf("worker a holds %d blocks, want 1", held)
		}
		return nil
	})
	matches := idx.FindMatches(seq, nil)
	if len(matches) != 1 || matches[0].Worker != key.ID() || matches[0].Blocks != 1 {
		t.Fatalf("lookup of the engine's 16 tokens: %+v, want worker a with 1 block", matches)
	}

	stopped := make(chan struct{})
	go func() { wait(); close(stopped) }()
	cancel()
	select {
	case <-stopped:
	case <-time.After(30 * time.Second):
		t.Fatal("the bridge did not stop when its context ended")
	}
}
