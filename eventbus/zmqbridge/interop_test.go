package zmqbridge

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/internal/reftest"
	"github.com/kvrouter/kvrouter/router"
)

// libzmqEngine is a publisher on real libzmq (pyzmq) that behaves like the
// engines' ZmqEventPublisher: PUB [topic, seq8, payload], a ROUTER replay
// socket answering ["", seq8] with every buffered batch from there on and
// an end marker. Commands on stdin: "pub FILE" / "drop FILE" (buffered,
// not sent).
const libzmqEngine = `
import sys, threading, zmq
ctx = zmq.Context.instance()
pub = ctx.socket(zmq.PUB)
pp = pub.bind_to_random_port("tcp://127.0.0.1")
rtr = ctx.socket(zmq.ROUTER)
rp = rtr.bind_to_random_port("tcp://127.0.0.1")
topic = sys.argv[1].encode()
newfmt = sys.argv[2] == "new"
end = (-1).to_bytes(8, "big", signed=True)
buf, lock = [], threading.Lock()
def serve():
    while True:
        frames = rtr.recv_multipart()
        if len(frames) != 3:
            continue
        ident, start = frames[0], int.from_bytes(frames[2], "big")
        with lock:
            items = list(buf)
        for seq, payload in items:
            if seq >= start:
                head = [ident, b"", topic] if newfmt else [ident, b""]
                rtr.send_multipart(head + [seq.to_bytes(8, "big"), payload])
        rtr.send_multipart([ident, b"", b"", end, b""] if newfmt else [ident, b"", end, b""])
threading.Thread(target=serve, daemon=True).start()
print(pp, rp, flush=True)
seq = 0
for line in sys.stdin:
    parts = line.split()
    if not parts or parts[0] == "quit":
        break
    payload = open(parts[1], "rb").read()
    with lock:
        buf.append((seq, payload))
    if parts[0] == "pub":
        pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
    seq += 1
    print("ok", seq, flush=True)
`

// TestBridgeLibzmqInterop runs the bridge against libzmq (pyzmq) sockets,
// both replay reply formats. Skipped where python3 with pyzmq is missing,
// except in CI (KVROUTER_REQUIRE_REFERENCE=1), which installs it: there a
// missing libzmq is a failure, not a silent pass.
func TestBridgeLibzmqInterop(t *testing.T) {
	py := "/usr/bin/python3"
	if err := exec.Command(py, "-c", "import zmq").Run(); err != nil {
		reftest.Missing(t, "python3 with pyzmq (Debian python3-zmq): %v", err)
	}
	for _, format := range []string{"new", "old"} {
		t.Run(format, func(t *testing.T) {
			dir := t.TempDir()
			cmd := exec.Command(py, "-c", libzmqEngine, "kv", format)
			stdin, _ := cmd.StdinPipe()
			stdout, _ := cmd.StdoutPipe()
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
			out := bufio.NewReader(stdout)
			line, err := out.ReadString('\n')
			if err != nil {
				t.Fatal(err)
			}
			var pport, rport int
			if _, err := fmt.Sscan(line, &pport, &rport); err != nil {
				t.Fatal(err)
			}
			n := 0
			send := func(verb string, payload []byte) {
				t.Helper()
				n++
				p := filepath.Join(dir, fmt.Sprintf("b%d", n))
				if err := os.WriteFile(p, payload, 0o644); err != nil {
					t.Fatal(err)
				}
				if _, err := io.WriteString(stdin, verb+" "+p+"\n"); err != nil {
					t.Fatal(err)
				}
				if l, err := out.ReadString('\n'); err != nil || !strings.HasPrefix(l, "ok") {
					t.Fatalf("engine: %q %v", l, err)
				}
			}
			// History before the bridge starts: the worked example.
			send("pub", mp(t, batchArr(1, []any{storedMap([]any{hash32(exampleHash, 1)}, nil, exampleTokens, "GPU")}, 0)))
			cluster := newFakeCluster()
			b, err := New(Config{BlockSize: 16, Publishers: cluster.factory, Logger: testLogger(t), ReplayTimeout: 5 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan struct{})
			go func() {
				defer close(done)
				_ = b.Run(ctx, []WorkerSpec{{ID: "py", URL: "http://127.0.0.1:1", Model: "m", TotalBlocks: 1,
					Events: fmt.Sprintf("tcp://127.0.0.1:%d", pport), Replay: fmt.Sprintf("tcp://127.0.0.1:%d", rport), Topic: "kv"}})
			}()
			id := router.WorkerKey("py", 0)
			want := map[uint64]bool{exampleContent: true}
			poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error { return sameSet(cluster.contents(id), want) })
			// A child (lost on the way: the replay brings it), then a
			// grandchild sent live, SGLang-style int64 hashes.
			child, grand := tokens(3000, 1), tokens(4000, 1)
			send("drop", mp(t, batchArr(2, []any{[]any{"BlockStored", []any{int64Code(-7)}, int64Code(int64(exampleHash)), child, 16, nil, "GPU"}}, 0)))
			send("pub", mp(t, batchArr(3, []any{[]any{"BlockStored", []any{int64Code(-8)}, int64Code(-7), grand, 16, nil, "GPU"}}, 0)))
			all := router.SequenceHashes(append(append(append([]uint32{}, exampleTokens...), child...), grand...), 16, "")
			want = map[uint64]bool{all[0]: true, all[1]: true, all[2]: true}
			// The PUB drops what it sends before the subscription arrives
			// (slow joiner): empty batches until the live path shows up.
			deadline := time.Now().Add(15 * time.Second)
			for sameSet(cluster.contents(id), want) != nil {
				if time.Now().After(deadline) {
					t.Fatalf("not converged: %v; status %+v", sameSet(cluster.contents(id), want), b.Status())
				}
				send("pub", mp(t, batchArr(4, []any{}, 0)))
				time.Sleep(50 * time.Millisecond)
			}
			st := b.Status()[0].Ranks[0]
			if st.Replays < 1 || st.MalformedFrames != 0 || st.MalformedBatches != 0 {
				t.Fatalf("stats %+v", st)
			}
			cancel()
			<-done
		})
	}
}
