package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/eventbus"
)

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// Against a real (embedded) NATS JetStream that comes up only after kvmock:
// the events wait, then reach the KV_EVENTS stream in order with the
// Nats-Msg-Id dedupe ids, and a resync request over NATS is served. One
// event per message, and with --events-per-msg 8 (batch messages, however
// the events happen to be cut); and both with --compact-hashes.
func TestMockNATS(t *testing.T) {
	if testing.Short() {
		t.Skip("embedded NATS")
	}
	for _, compact := range []bool{false, true} {
		for _, n := range []int{1, 8} {
			t.Run(fmt.Sprintf("events-per-msg=%d/compact-hashes=%v", n, compact), func(t *testing.T) { testMockNATS(t, n, compact) })
		}
	}
}

func testMockNATS(t *testing.T, eventsPerMsg int, compactHashes bool) {
	port := freePort(t)
	url := fmt.Sprintf("nats://127.0.0.1:%d", port)
	log := testLog(t)

	cfg := testConfig(t)
	cfg.NATS = url
	cfg.EventsPerMsg = eventsPerMsg
	cfg.CompactHashes = compactHashes
	m, err := newMock(cfg, log, natsConnect(url, log))
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Serve(ctx, ln) }()
	base := "http://" + ln.Addr().String()
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Serve: %v", err)
			}
		}
	}
	defer stop()

	// NATS is down: requests are served, events wait in the queue.
	for i := range 2 {
		if status, body := post(t, base+"/v1/completions", map[string]any{"prompt": words(fmt.Sprintf("n%d-", i), 50), "max_tokens": 2}); status != 200 {
			t.Fatalf("HTTP %d: %s", status, body)
		}
	}
	if q := m.q.len(); q != 3 {
		t.Fatalf("%d events queued while NATS is down, want 3", q)
	}

	srv, err := eventbus.StartServer(eventbus.ServerConfig{Name: "t", Port: port, StoreDir: t.TempDir(), Logger: log, Security: eventbus.Security{Insecure: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	nc, err := eventbus.Connect(url, "test", log)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	sctx, scancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer scancel()
	stream, err := eventbus.EnsureStream(sctx, js, eventbus.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}

	// read returns the first n events in the stream, from single-event
	// and batch messages alike, each message checked against its subject
	// and Nats-Msg-Id.
	read := func(n int) []eventbus.WireEvent {
		t.Helper()
		var evs []eventbus.WireEvent
		checkFor(t, 20*time.Second, 20*time.Millisecond, func() error {
			info, err := stream.Info(sctx)
			if err != nil {
				return err
			}
			evs = evs[:0]
			for seq := uint64(1); seq <= info.State.LastSeq; seq++ {
				msg, err := stream.GetMsg(sctx, seq)
				if err != nil {
					return err
				}
				var got []eventbus.WireEvent
				wantID := ""
				if eventbus.IsBatch(msg.Data) {
					if eventsPerMsg == 1 {
						t.Fatalf("message %d is a batch without --events-per-msg", seq)
					}
					if got, err = eventbus.DecodeBatch(msg.Data); err == nil {
						err = eventbus.CheckBatch(got)
					}
					if err == nil {
						wantID = eventbus.BatchMsgID("mock-1", 0, got[0].EventID, got[len(got)-1].EventID)
					}
				} else {
					var ev eventbus.WireEvent
					ev, err = eventbus.Decode(msg.Data)
					got, wantID = []eventbus.WireEvent{ev}, ev.MsgID()
				}
				if err != nil {
					t.Fatalf("message %d: %v", seq, err)
				}
				// kvmock names blocks by their content hash: its stored
				// events take the compact key "bh" exactly with the flag.
				for _, ev := range got {
					if ev.Kind == eventbus.KindStored && len(ev.Blocks) > 0 &&
						bytes.Contains(msg.Data, []byte{0xa2, 'b', 'h'}) != compactHashes {
						t.Fatalf("message %d: compact form %v, --compact-hashes %v", seq, !compactHashes, compactHashes)
					}
				}
				if msg.Subject != eventbus.EventSubject("mock-1") || msg.Header.Get(jetstream.MsgIDHeader) != wantID {
					t.Fatalf("message %d: subject %q msg id %q, want %q", seq, msg.Subject, msg.Header.Get(jetstream.MsgIDHeader), wantID)
				}
				evs = append(evs, got...)
			}
			if len(evs) < n {
				return fmt.Errorf("%d events in the stream, want %d", len(evs), n)
			}
			return nil
		})
		return evs[:n]
	}
	evs := read(3)
	checkContiguous(t, evs)
	if evs[0].Kind != eventbus.KindCleared || evs[1].Kind != eventbus.KindStored || evs[2].Kind != eventbus.KindStored {
		t.Fatalf("kinds %d %d %d", evs[0].Kind, evs[1].Kind, evs[2].Kind)
	}

	var rep eventbus.ResyncReply
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error { // the subscription may lag the connection
		var err error
		rep, err = eventbus.RequestResync(sctx, nc, eventbus.ResyncRequest{Worker: "mock-1", LastEventID: 3, Reason: "test"})
		return err
	})
	if !rep.Accepted || rep.NextEventID != evs[2].EventID+1 {
		t.Fatalf("resync reply %+v", rep)
	}
	evs = read(5)
	checkContiguous(t, evs)
	if evs[3].Kind != eventbus.KindCleared || evs[4].Kind != eventbus.KindStored || len(evs[4].Blocks) != len(evs[1].Blocks)+len(evs[2].Blocks) {
		t.Fatalf("resync events: %+v %+v", evs[3], evs[4])
	}
	stop()
	if st := m.publisher().Stats(); st.Acked != 5 || st.Failed != 0 {
		t.Fatalf("publisher %+v", st)
	}
}
