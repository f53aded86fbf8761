package zmqbridge

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// zmtpGreeting is a ZMTP 3.0 greeting for the NULL mechanism, as a PUB
// socket (not as-server) sends it: signature, version, mechanism, filler.
func zmtpGreeting() []byte {
	g := make([]byte, zmtpGreetingLen)
	g[0], g[9] = 0xFF, 0x7F
	g[10], g[11] = 3, 0
	copy(g[12:32], "NULL")
	return g
}

// zmtpFrame encodes one frame with the given flags (more, command),
// choosing the short or long size form as zmq4 does.
func zmtpFrame(flags byte, body []byte) []byte {
	if len(body) > 255 {
		return append(binary.BigEndian.AppendUint64([]byte{flags | zmtpLong}, uint64(len(body))), body...)
	}
	return append([]byte{flags, byte(len(body))}, body...)
}

// zmtpReady is the NULL handshake's READY command carrying metadata (as
// raw property bytes).
func zmtpReady(meta []byte) []byte {
	return zmtpFrame(0x04, append([]byte("\x05READY"), meta...))
}

// pubMeta is the metadata of a PUB socket: Socket-Type=PUB.
func pubMeta() []byte {
	m := append([]byte{11}, "Socket-Type"...)
	m = binary.BigEndian.AppendUint32(m, 3)
	return append(m, "PUB"...)
}

// hugeHeader is the 9-byte long-frame header of issue 16's probe: a frame
// declaring 2^50 bytes (zmq4 tried to make([]byte, 1<<50) from it).
func hugeHeader() []byte {
	return binary.BigEndian.AppendUint64([]byte{zmtpLong}, 1<<50)
}

// hostilePeer is a raw TCP server in the place of an engine's PUB socket:
// on every connection it writes script (usually a greeting, a READY and
// then something no engine sends) and reads whatever the bridge sends
// until the bridge hangs up.
type hostilePeer struct {
	ln       net.Listener
	accepted atomic.Int64
	hungUp   atomic.Int64 // connections the bridge closed
}

func startHostilePeer(t *testing.T, script []byte) *hostilePeer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &hostilePeer{ln: ln}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.accepted.Add(1)
			go func() {
				defer c.Close()
				_, _ = c.Write(script)
				// The bridge's greeting and READY, then nothing until it
				// closes (EOF) or resets the connection.
				_, _ = io.Copy(io.Discard, c)
				p.hungUp.Add(1)
			}()
		}
	}()
	return p
}

func (p *hostilePeer) endpoint() string { return "tcp://" + p.ln.Addr().String() }

// TestZMQGuardSubscriber: a peer that completes the handshake and then
// declares a 2^50-byte frame, or declares it in place of its READY, or
// sends metadata that makes zmq4's handshake panic: the subscriber
// survives, drops the connection, counts it and dials again.
func TestZMQGuardSubscriber(t *testing.T) {
	shortMeta := []byte{2, 'a', 'b'} // a 2-byte key, then no room for the value's length: zmq4 slices past the end
	for name, tc := range map[string]struct {
		script              []byte
		oversized, panicked bool
	}{
		"after handshake": {script: concat(zmtpGreeting(), zmtpReady(pubMeta()), hugeHeader()), oversized: true},
		"as the READY":    {script: concat(zmtpGreeting(), hugeHeader()), oversized: true},
		"second frame":    {script: concat(zmtpGreeting(), zmtpReady(pubMeta()), zmtpFrame(zmtpMore, []byte("topic")), hugeHeader()), oversized: true},
		"bad metadata":    {script: concat(zmtpGreeting(), zmtpReady(shortMeta)), panicked: true},
	} {
		t.Run(name, func(t *testing.T) {
			peer := startHostilePeer(t, tc.script)
			var wc WireCounters
			sub := &Subscriber{Endpoint: peer.endpoint(), Logger: testLogger(t), RetryMin: 5 * time.Millisecond,
				RetryMax: 20 * time.Millisecond, Counters: &wc}
			ctx, cancel := context.WithCancel(context.Background())
			out := make(chan Message, 16)
			done := make(chan struct{})
			go func() { defer close(done); sub.Run(ctx, out) }()
			poll.Until(t, 10*time.Second, 5*time.Millisecond, func() error {
				if peer.accepted.Load() < 3 || peer.hungUp.Load() < 2 {
					return fmt.Errorf("%d connections, %d hung up: want the bridge to drop and redial", peer.accepted.Load(), peer.hungUp.Load())
				}
				return nil
			})
			cancel()
			<-done
			if got := wc.Oversized.Load(); tc.oversized != (got > 0) {
				t.Errorf("oversized count %d", got)
			}
			if got := wc.Panics.Load(); tc.panicked != (got > 0) {
				t.Errorf("panic count %d", got)
			}
			for len(out) > 0 {
				if m := <-out; len(m.Frames) > 0 {
					t.Errorf("a message got through: %q", m.Frames)
				}
			}
		})
	}
}

func concat(parts ...[]byte) []byte { return bytes.Join(parts, nil) }

// TestZMQGuardReplayer: the replay socket is dialled through the same
// guard; a reply declaring 2^50 bytes fails the replay, counted.
func TestZMQGuardReplayer(t *testing.T) {
	peer := startHostilePeer(t, concat(zmtpGreeting(), zmtpReady(routerMeta()), hugeHeader()))
	var wc WireCounters
	z := &ZMQReplayer{Endpoint: peer.endpoint(), Timeout: 5 * time.Second, Counters: &wc}
	// zmq4 reads the reply while the request is being sent, so the
	// failure shows as the refused read or as the write on the connection
	// the guard closed: either way the replay fails and the drop is counted.
	if err := z.Replay(context.Background(), 0, func(Frame) error { return nil }); err == nil {
		t.Fatal("replay succeeded")
	}
	poll.Until(t, 5*time.Second, 5*time.Millisecond, func() error {
		if n := wc.Oversized.Load(); n != 1 {
			return fmt.Errorf("oversized %d", n)
		}
		return nil
	})
}

func routerMeta() []byte {
	m := append([]byte{11}, "Socket-Type"...)
	m = binary.BigEndian.AppendUint32(m, 6)
	return append(m, "ROUTER"...)
}

// TestZMQGuardHandshakeTimeout: a peer that accepts and never speaks does
// not hold the subscriber (or its shutdown) forever.
func TestZMQGuardHandshakeTimeout(t *testing.T) {
	peer := startHostilePeer(t, nil)
	sub := &Subscriber{Endpoint: peer.endpoint(), Logger: testLogger(t), RetryMin: 5 * time.Millisecond,
		RetryMax: 10 * time.Millisecond, HandshakeTimeout: 50 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); sub.Run(ctx, make(chan Message)) }()
	poll.Until(t, 10*time.Second, 5*time.Millisecond, func() error {
		if peer.accepted.Load() < 2 {
			return errors.New("the silent peer still holds the first dial")
		}
		return nil
	})
	// Shutdown during a handshake: the context closes the connection.
	sub2 := &Subscriber{Endpoint: peer.endpoint(), Logger: testLogger(t), HandshakeTimeout: time.Hour}
	ctx2, cancel2 := context.WithCancel(context.Background())
	done2 := make(chan struct{})
	before := peer.accepted.Load()
	go func() { defer close(done2); sub2.Run(ctx2, make(chan Message)) }()
	poll.Until(t, 10*time.Second, 5*time.Millisecond, func() error {
		if peer.accepted.Load() <= before {
			return errors.New("not dialled yet")
		}
		return nil
	})
	cancel2()
	select {
	case <-done2:
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return while zmq4 waited for a handshake")
	}
	cancel()
	<-done
}

// TestZMQGuardScanner: the scanner cuts the stream as zmq4 does, whatever
// the read sizes: the cap is exact (a frame of cap-overhead bytes passes,
// one more is refused), frames of one message share the cap, a new
// message starts afresh, and empty "more" frames cannot grow a message
// forever.
func TestZMQGuardScanner(t *testing.T) {
	const limit = 1000
	body := func(n int) []byte { return bytes.Repeat([]byte{'x'}, n) }
	msg := func(frames ...[]byte) []byte {
		var b []byte
		for i, f := range frames {
			var fl byte
			if i < len(frames)-1 {
				fl = zmtpMore
			}
			b = append(b, zmtpFrame(fl, f)...)
		}
		return b
	}
	for name, tc := range map[string]struct {
		stream   []byte
		refused  bool
		messages uint64
	}{
		"at the cap":          {stream: msg(body(limit - frameOverhead)), messages: 1},
		"one over":            {stream: msg(body(limit - frameOverhead + 1)), refused: true},
		"shared by frames":    {stream: msg(body(300), body(limit-2*frameOverhead-300+1)), refused: true},
		"frames within":       {stream: msg(body(300), body(limit-2*frameOverhead-300)), messages: 1},
		"fresh per message":   {stream: concat(msg(body(900)), msg(body(900)), msg(nil)), messages: 3},
		"empty more frames":   {stream: msg(make([][]byte, limit/frameOverhead+1)...), refused: true},
		"2^50":                {stream: hugeHeader(), refused: true},
		"command frames too":  {stream: zmtpReady(body(limit)), refused: true},
		"handshake then data": {stream: concat(zmtpReady(pubMeta()), msg([]byte("t"), seqBytes(1), body(500))), messages: 2},
	} {
		t.Run(name, func(t *testing.T) {
			stream := concat(zmtpGreeting(), tc.stream)
			for _, chunk := range []int{len(stream), 1, 2, 7, 9, 64} {
				s := newFrameScanner(limit)
				var err error
				for p := stream; len(p) > 0 && err == nil; {
					k := min(chunk, len(p))
					err = s.scan(p[:k])
					p = p[k:]
				}
				if tc.refused != (err != nil) || (err != nil && !errors.Is(err, ErrFrameTooLarge)) {
					t.Fatalf("chunks of %d: err %v, want refused=%v", chunk, err, tc.refused)
				}
				if !tc.refused && s.messages != tc.messages {
					t.Fatalf("chunks of %d: %d messages, want %d", chunk, s.messages, tc.messages)
				}
			}
		})
	}
}

// TestBridgeSurvivesOversizedFrame is issue 16's probe against a running
// bridge: one worker's event endpoint is a hostile peer declaring a
// 2^50-byte frame after the handshake, another worker is a well-behaved
// engine. The bridge keeps running, drops and counts the hostile
// connections (also in /metrics), and the good engine's events still flow.
func TestBridgeSurvivesOversizedFrame(t *testing.T) {
	log := testLogger(t)
	good := startFakeEngine(t, engineOpts{topic: "kv@good", newReplay: true, model: "qwen3", blocks: 1000})
	evilHTTP := startFakeEngine(t, engineOpts{model: "qwen3", blocks: 1000}) // its HTTP only: models and metrics
	peer := startHostilePeer(t, concat(zmtpGreeting(), zmtpReady(pubMeta()), hugeHeader()))
	cluster := newFakeCluster()
	b, err := New(Config{BlockSize: 16, Publishers: cluster.factory, ReplayTimeout: 5 * time.Second, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(b.Collector())
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	runDone := make(chan error, 1)
	go func() {
		runDone <- b.Run(ctx, []WorkerSpec{
			{ID: "good", URL: good.url(), Events: good.pubAddr, Replay: good.rtrAddr, Topic: "kv@good"},
			{ID: "evil", URL: evilHTTP.url(), Events: peer.endpoint()},
		})
	}()

	m := newCacheModel(t, "vllm", 1)
	id := router.WorkerKey("good", 0)
	converge := func(what string) {
		t.Helper()
		poll.Until(t, 15*time.Second, 10*time.Millisecond, func() error {
			if err := sameSet(cluster.contents(id), m.contents()); err != nil {
				return fmt.Errorf("%s: %w", what, err)
			}
			return nil
		})
	}
	good.waitSubscribed(t)
	good.publish(m.batch(false), false)
	converge("before the probe")

	poll.Until(t, 15*time.Second, 10*time.Millisecond, func() error {
		if peer.hungUp.Load() < 2 {
			return fmt.Errorf("hostile connections dropped: %d", peer.hungUp.Load())
		}
		for _, w := range b.Status() {
			if w.Spec.ID == "evil" && len(w.Ranks) == 1 && w.Ranks[0].OversizedFrames >= 2 && w.State == "running" {
				return nil
			}
		}
		return fmt.Errorf("status %+v", b.Status())
	})
	for i := range 4 {
		good.publish(m.batch(i%2 == 1), false)
	}
	converge("after the probe")

	got := map[string]float64{}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != metricPrefix+"oversized_frames_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "worker" {
					got[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	if len(got) != 2 || got["evil"] < 2 || got["good"] != 0 {
		t.Fatalf("oversized_frames_total by worker: %v", got)
	}
	cancel()
	select {
	case err := <-runDone:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the bridge did not stop")
	}
}

// TestAPIRegisterNeedsTokenOffLoopback: without a token the register and
// deregister endpoints answer only loopback clients, unless InsecureAPI.
func TestAPIRegisterNeedsTokenOffLoopback(t *testing.T) {
	spec := `{"id":"gpu0","url":"http://gpu0:8000","events":"tcp://gpu0:5557"}`
	for name, tc := range map[string]struct {
		remote   string
		insecure bool
		want     int
	}{
		"remote, no token":   {remote: "192.0.2.7:4000", want: http.StatusForbidden},
		"remote v6":          {remote: "[2001:db8::1]:4000", want: http.StatusForbidden},
		"loopback":           {remote: "127.0.0.1:4000", want: http.StatusBadRequest}, // reaches Add: the bridge is not running
		"loopback v6":        {remote: "[::1]:4000", want: http.StatusBadRequest},
		"remote, insecure":   {remote: "192.0.2.7:4000", insecure: true, want: http.StatusBadRequest},
		"garbage remote":     {remote: "nonsense", want: http.StatusForbidden},
		"deregister, remote": {remote: "192.0.2.7:4000", want: http.StatusForbidden},
	} {
		t.Run(name, func(t *testing.T) {
			b, err := New(Config{BlockSize: 16, InsecureAPI: tc.insecure, Logger: testLogger(t),
				Publishers: func(string, uint32) (Publisher, error) { return nil, errors.New("none") }})
			if err != nil {
				t.Fatal(err)
			}
			path, body := "/workers/register", spec
			if strings.HasPrefix(name, "deregister") {
				path, body = "/workers/deregister", `{"id":"gpu0"}`
			}
			req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
			req.RemoteAddr = tc.remote
			rec := httptest.NewRecorder()
			b.Handler(nil, "").ServeHTTP(rec, req)
			if rec.Code != tc.want {
				t.Fatalf("status %d (%s), want %d", rec.Code, rec.Body, tc.want)
			}
			if len(b.Status()) != 0 {
				t.Fatal("a worker was added")
			}
		})
	}
}

func TestAPICheckListen(t *testing.T) {
	for _, tc := range []struct {
		addr, token string
		insecure    bool
		ok          bool
	}{
		{"127.0.0.1:8090", "", false, true},
		{"[::1]:8090", "", false, true},
		{"localhost:8090", "", false, true},
		{"", "", false, true}, // no API at all
		{"0.0.0.0:8090", "", false, false},
		{":8090", "", false, false},
		{"[::]:8090", "", false, false},
		{"10.0.0.5:8090", "", false, false},
		{"bridge.internal:8090", "", false, false},
		{"0.0.0.0:8090", "tok", false, true},
		{"0.0.0.0:8090", "", true, true},
	} {
		err := CheckAPIListen(tc.addr, tc.token, tc.insecure)
		if (err == nil) != tc.ok {
			t.Errorf("CheckAPIListen(%q, %q, %v) = %v", tc.addr, tc.token, tc.insecure, err)
		}
	}
}
