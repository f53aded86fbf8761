package gaie

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/kvrouter/kvrouter/internal/peerpolicy"
)

// asPeerEnv makes the test binary the peer: TestMain runs Serve, the whole
// of cmd/kvbench-gaie, instead of the tests. KVBENCH_GAIE_BIN names a built
// binary (bin/kvbench-gaie) to use instead.
const asPeerEnv = "KVBENCH_GAIE_TEST_AS_PEER"

func TestMain(m *testing.M) {
	if os.Getenv(asPeerEnv) != "" {
		if err := Serve(os.Stdin, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "kvbench-gaie (test binary):", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func startPeer(t testing.TB, in peerpolicy.Init) *peerpolicy.Client {
	t.Helper()
	path := os.Getenv("KVBENCH_GAIE_BIN")
	if path == "" {
		path = os.Args[0]
		t.Setenv(asPeerEnv, "1")
	}
	c, err := peerpolicy.Start(context.Background(), path, in)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Error(err)
		}
	})
	return c
}

func initFor(n int) peerpolicy.Init {
	in := peerpolicy.Init{Seed: 1, BlockSize: 16}
	for i := range n {
		in.Pods = append(in.Pods, peerpolicy.PodInfo{Name: fmt.Sprintf("w%d", i), GPUBlocks: 4096})
	}
	return in
}

// TestPeerEndToEnd runs the peer as a process and checks it makes the same
// picks as the policy in process.
func TestPeerEndToEnd(t *testing.T) {
	c := startPeer(t, initFor(16))
	if c.Peer() != Name {
		t.Errorf("peer named itself %q", c.Peer())
	}
	local := newPolicy(t, 1, 16, 16)
	reqs := benchRequests(16, 200)
	for i, r := range append(reqs, reqs...) { // the second pass hits the prefix index
		got, err := c.Pick(r)
		if err != nil {
			t.Fatal(err)
		}
		if want := pick(t, local, r.ID, r.Prompt, r.Pods); got != want {
			t.Fatalf("request %d: the peer picked %s, the policy in process %s", i, got, want)
		}
	}
	_, err := c.Pick(peerpolicy.Request{ID: "bad", Pods: []peerpolicy.Pod{{Name: "w0", KVCacheUsage: 80}}})
	if err == nil {
		t.Fatal("a KV usage of 80 was accepted")
	}
	if _, err := c.Pick(reqs[0]); err != nil {
		t.Fatalf("after a refused request: %v", err)
	}
}

// BenchmarkPeerPick is one Pick round trip through the peer process:
// encode, pipe, decode, Schedule, PreRequest and its index update, answer.
func BenchmarkPeerPick(b *testing.B) {
	for _, n := range []int{16, 100} {
		b.Run(fmt.Sprintf("pods=%d", n), func(b *testing.B) {
			c := startPeer(b, initFor(n))
			reqs := benchRequests(n, 512)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := c.Pick(reqs[i%len(reqs)]); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
