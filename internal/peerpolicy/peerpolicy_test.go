package peerpolicy

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// fakePeerEnv makes the test binary a peer: TestMain runs the fake peer
// named by its value instead of the tests, so the client is tested against
// a real child process without building anything.
const fakePeerEnv = "PEERPOLICY_FAKE_PEER"

func TestMain(m *testing.M) {
	if mode := os.Getenv(fakePeerEnv); mode != "" {
		os.Exit(fakePeer(mode))
	}
	os.Exit(m.Run())
}

// fakePeer is the child process of the tests, one behaviour per mode.
func fakePeer(mode string) int {
	switch mode {
	case "serve": // a working peer; some prompts misbehave on purpose
		err := Serve(os.Stdin, os.Stdout, "fake peer", func(in Init) (Policy, error) { return &fakePolicy{init: in}, nil })
		if err != nil {
			fmt.Fprintln(os.Stderr, "fake peer:", err)
			return 1
		}
		return 0
	case "refuse-init":
		_ = Serve(os.Stdin, os.Stdout, "fake peer", func(Init) (Policy, error) { return nil, errors.New("no pods I like") })
		return 1
	case "exit-early":
		fmt.Fprintln(os.Stderr, "cannot start: no config")
		return 2
	case "garbage-ready":
		_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
		fmt.Println("hello there")
		_, _ = io.Copy(io.Discard, os.Stdin)
		return 0
	case "old-version":
		_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
		fmt.Println(`{"ready":true,"peer":"old"}`)
		_, _ = io.Copy(io.Discard, os.Stdin)
		return 0
	case "exit-nonzero-on-close":
		_ = Serve(os.Stdin, os.Stdout, "fake peer", func(in Init) (Policy, error) { return &fakePolicy{init: in}, nil })
		return 4
	}
	fmt.Fprintln(os.Stderr, "unknown fake peer mode", mode)
	return 2
}

// fakePolicy picks the pod with the shortest waiting queue (first in name
// order on ties); a few prompts make it misbehave.
type fakePolicy struct{ init Init }

func (f *fakePolicy) Pick(req Request) (string, error) {
	switch req.Prompt {
	case "refuse":
		return "", errors.New("refused on purpose")
	case "init?":
		return "", fmt.Errorf("seed=%d block=%d pods=%v", f.init.Seed, f.init.BlockSize, f.init.Pods)
	case "die":
		fmt.Fprintln(os.Stderr, "dying on purpose")
		os.Exit(3)
	case "garbage":
		fmt.Println("this is not json")
		return "w0", nil // Serve answers too: the client has stopped listening
	case "long":
		fmt.Print(strings.Repeat("x", maxAnswerLine+10))
		return "w0", nil
	case "wrong-pod":
		return "nobody", nil
	}
	best := req.Pods[0]
	for _, p := range req.Pods[1:] {
		if p.WaitingQueue < best.WaitingQueue || p.WaitingQueue == best.WaitingQueue && p.Name < best.Name {
			best = p
		}
	}
	return best.Name, nil
}

var testInit = Init{Seed: 7, BlockSize: 16, Pods: []PodInfo{{"w0", 100}, {"w1", 200}, {"w2", 300}}}

// startFake starts the test binary as the fake peer in mode.
func startFake(t *testing.T, ctx context.Context, mode string) (*Client, error) {
	t.Helper()
	t.Setenv(fakePeerEnv, mode)
	c, err := Start(ctx, os.Args[0], testInit)
	if c != nil {
		t.Cleanup(func() { _ = c.Close() })
	}
	return c, err
}

func req(id, prompt string, waiting ...int) Request {
	r := Request{ID: id, Model: "m", Prompt: prompt}
	for i, w := range waiting {
		r.Pods = append(r.Pods, Pod{Name: fmt.Sprintf("w%d", i), WaitingQueue: w, KVCacheUsage: 0.5})
	}
	return r
}

// errKind names what a Pick's error must be.
type errKind int

const (
	noErr errKind = iota
	peerErr
	exited
	protocol
)

func checkErr(t *testing.T, err error, kind errKind, contains ...string) {
	t.Helper()
	var pe *PeerError
	switch kind {
	case noErr:
		if err != nil {
			t.Fatalf("unexpected error: %v", err)
		}
		return
	case peerErr:
		if !errors.As(err, &pe) {
			t.Fatalf("want a *PeerError, got %v", err)
		}
	case exited:
		if !errors.Is(err, ErrPeerExited) {
			t.Fatalf("want ErrPeerExited, got %v", err)
		}
	case protocol:
		if !errors.Is(err, ErrProtocol) {
			t.Fatalf("want ErrProtocol, got %v", err)
		}
	}
	for _, s := range contains {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error %q does not mention %q", err, s)
		}
	}
}

func TestClientPick(t *testing.T) {
	type step struct {
		req      Request
		pod      string
		kind     errKind
		contains []string
	}
	ok := func(r Request, pod string) step { return step{req: r, pod: pod} }
	tests := []struct {
		name      string
		mode      string
		steps     []step
		closeKind errKind
	}{
		{name: "happy path", mode: "serve", steps: []step{
			ok(req("r1", "hello", 3, 1, 2), "w1"),
			ok(req("r2", "hello", 0, 1, 2), "w0"),
			ok(req("r3", "hello", 5, 5, 2), "w2"),
			ok(req("r4", strings.Repeat("long prompt ", 100000), 1, 1, 1), "w0"), // a 1.2 MB line to the peer
		}},
		{name: "init reaches the peer", mode: "serve", steps: []step{
			{req: req("r1", "init?", 0), kind: peerErr, contains: []string{"seed=7 block=16 pods=[{w0 100} {w1 200} {w2 300}]"}},
		}},
		{name: "error answer leaves the client usable", mode: "serve", steps: []step{
			{req: req("r1", "refuse", 0, 0), kind: peerErr, contains: []string{"refused on purpose", "r1"}},
			ok(req("r2", "hello", 1, 0), "w1"),
		}},
		{name: "child death", mode: "serve", steps: []step{
			ok(req("r1", "hello", 0), "w0"),
			{req: req("r2", "die", 0), kind: exited, contains: []string{"exit status 3", "dying on purpose", "r2"}},
			{req: req("r3", "hello", 0), kind: exited, contains: []string{"exit status 3"}}, // sticky
		}},
		{name: "malformed line", mode: "serve", steps: []step{
			{req: req("r1", "garbage", 0), kind: protocol, contains: []string{`"this is not json"`, "r1"}},
			{req: req("r2", "hello", 0), kind: protocol}, // sticky: the stream is out of step
		}},
		{name: "line without end", mode: "serve", steps: []step{
			{req: req("r1", "long", 0), kind: protocol, contains: []string{"line too long"}},
		}},
		{name: "a pod that was not offered", mode: "serve", steps: []step{
			{req: req("r1", "wrong-pod", 0, 0), kind: protocol, contains: []string{`"nobody"`}},
			ok(req("r2", "hello", 1, 0), "w1"), // in step, so not sticky
		}},
		{name: "peer exits nonzero at close", mode: "exit-nonzero-on-close", steps: []step{
			ok(req("r1", "hello", 0), "w0"),
		}, closeKind: exited},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := startFake(t, context.Background(), tt.mode)
			if err != nil {
				t.Fatal(err)
			}
			if c.Peer() != "fake peer" {
				t.Errorf("Peer() = %q", c.Peer())
			}
			for i, s := range tt.steps {
				pod, err := c.Pick(s.req)
				if s.kind == noErr && pod != s.pod {
					t.Fatalf("step %d: picked %q, want %q (err %v)", i, pod, s.pod, err)
				}
				checkErr(t, err, s.kind, s.contains...)
			}
			err = c.Close()
			checkErr(t, err, tt.closeKind)
			if err2 := c.Close(); err2 != err {
				t.Errorf("second Close: %v, first %v", err2, err)
			}
			if _, err := c.Pick(req("late", "hello", 0)); err == nil {
				t.Error("Pick after Close succeeded")
			}
		})
	}
}

func TestClientStart(t *testing.T) {
	tests := []struct {
		name     string
		mode     string
		path     string
		kind     errKind
		contains []string
	}{
		{name: "refused init", mode: "refuse-init", kind: peerErr, contains: []string{"no pods I like"}},
		{name: "exits before ready", mode: "exit-early", kind: exited, contains: []string{"exit status 2", "cannot start: no config"}},
		{name: "garbage for ready", mode: "garbage-ready", kind: protocol, contains: []string{`"hello there"`}},
		{name: "other protocol version", mode: "old-version", kind: protocol, contains: []string{"version 0", "make build"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := startFake(t, context.Background(), tt.mode)
			if c != nil {
				t.Fatal("Start returned a client for a broken peer")
			}
			checkErr(t, err, tt.kind, tt.contains...)
		})
	}
}

func TestClientMissingBinary(t *testing.T) {
	for _, path := range []string{filepath.Join(t.TempDir(), "kvbench-gaie"), "kvbench-no-such-peer"} {
		_, err := Start(context.Background(), path, testInit)
		if !errors.Is(err, ErrPeerMissing) {
			t.Fatalf("%s: want ErrPeerMissing, got %v", path, err)
		}
		if !strings.Contains(err.Error(), "make build") {
			t.Errorf("%s: error %q does not say how to build it", path, err)
		}
	}
	_, err := Start(context.Background(), filepath.Join(t.TempDir(), "nope"), testInit)
	if !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a missing path is not fs.ErrNotExist: %v", err)
	}
}

func TestClientContextCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	c, err := startFake(t, ctx, "serve")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Pick(req("r1", "hello", 0)); err != nil {
		t.Fatal(err)
	}
	cancel()
	// The kill is asynchronous; a Pick either finds the pipe closed or
	// waits for an answer that never comes. Either way it ends.
	done := make(chan error, 1)
	go func() { _, err := c.Pick(req("r2", "hello", 0)); done <- err }()
	select {
	case err := <-done:
		checkErr(t, err, exited, "context canceled")
	case <-time.After(20 * time.Second):
		t.Fatal("Pick did not return after the context was cancelled")
	}
}

// TestServe drives the peer side in process: a bad init version is refused,
// a request line it cannot decode is answered with an error, and serving
// goes on.
func TestServe(t *testing.T) {
	run := func(input string) []answer {
		t.Helper()
		var out strings.Builder
		_ = Serve(strings.NewReader(input), &out, "p", func(in Init) (Policy, error) { return &fakePolicy{init: in}, nil })
		var as []answer
		for _, l := range strings.Split(strings.TrimSpace(out.String()), "\n") {
			var a answer
			if err := json.Unmarshal([]byte(l), &a); err != nil {
				t.Fatalf("Serve wrote %q: %v", l, err)
			}
			as = append(as, a)
		}
		return as
	}
	as := run(`{"version":99,"seed":1,"block_size":16,"pods":[]}` + "\n")
	if len(as) != 1 || !strings.Contains(as[0].Error, "version 99") {
		t.Errorf("version 99: answers %+v", as)
	}
	as = run(`{"version":1,"seed":1,"block_size":16,"pods":[{"name":"w0","gpu_blocks":1}]}` + "\n" +
		"not json\n" +
		`{"id":"r1","pods":[{"name":"w0"}],"extra":1}` + "\n" +
		`{"id":"r2","prompt":"x","pods":[{"name":"w0"}]}` + "\n")
	if len(as) != 4 || !as[0].Ready || as[0].Version != ProtocolVersion || as[0].Peer != "p" ||
		!strings.Contains(as[1].Error, "decode request") || !strings.Contains(as[2].Error, "extra") || as[3].Pod != "w0" {
		t.Errorf("answers %+v", as)
	}
}

func FuzzDecodeResponse(f *testing.F) {
	for _, s := range []string{
		`{"pod":"w3"}`, `{"error":"no pods"}`, `{"pod":"a","error":"b"}`, `{}`, `null`, `[]`, `"w3"`,
		`not json`, `{"ready":true,"pod":"w1"}`, `{"pod":"w\u00e9"}`, `{"pod":"w1"} {"pod":"w2"}`,
		`{"pod":1}`, `{"pod":"w1","extra":[1,2]}`, ``, `{"error":""}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, line []byte) {
		pod, err := decodeResponse(line)
		if err != nil {
			var pe *PeerError
			if !errors.Is(err, ErrProtocol) && !(errors.As(err, &pe) && pe.Msg != "") {
				t.Fatalf("error is neither a protocol error nor a peer's: %v", err)
			}
			if pod != "" {
				t.Fatalf("pod %q with error %v", pod, err)
			}
			return
		}
		if pod == "" {
			t.Fatal("no pod and no error")
		}
		// What the peer side would write for that pod decodes to it again.
		b, _ := json.Marshal(answer{Pod: pod})
		again, err := decodeResponse(b)
		if err != nil || again != pod {
			t.Fatalf("round trip of %q: %q, %v", pod, again, err)
		}
	})
}
