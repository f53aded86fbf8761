package eventbus

// Fuzz targets for the resync request/reply JSON (resync.go). Both sides
// decode inline in NATS callbacks, so each target drives them through one
// embedded single-node server started once per target: a request/reply
// round trip costs well under a millisecond on loopback.

import (
	"context"
	"encoding/json"
	"log/slog"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// resyncConn starts the embedded server and a connection for one fuzz
// target, both closed by tb's cleanup. Logs are dropped: fuzzing runs many
// thousands of inputs and the invariants carry the diagnosis.
func resyncConn(tb testing.TB) *nats.Conn {
	log := slog.New(slog.DiscardHandler)
	srv := startSingle(tb, log)
	nc, _ := connect(tb, srv.ClientURL(), "fuzz", log)
	return nc
}

// resyncRequestSeeds: requests as RequestResync sends them (the worker name
// needs subject escaping), a request for another worker, JSON of the wrong
// shape, and not JSON at all.
func resyncRequestSeeds(tb testing.TB) [][]byte {
	var seeds [][]byte
	for _, r := range []ResyncRequest{
		{Worker: "w.1", DPRank: 1, LastEventID: 17, Reason: "gap"},
		{Worker: "w.1", LastEventID: FreshEventIDBase(time.Unix(1752000000, 0))},
		{Worker: "other"},
	} {
		b, err := json.Marshal(r)
		if err != nil {
			tb.Fatal(err)
		}
		seeds = append(seeds, b)
	}
	for _, s := range []string{
		`{"worker":"w.1","dp_rank":4294967296}`,
		`{"worker":"w.1","last_event_id":-1}`,
		`{"WORKER":"w.1","dp_rank":2}`,
		`{"worker":"w.1"} trailing`,
		`{"worker":null}`,
		`[]`, `null`, ``, "\xff",
	} {
		seeds = append(seeds, []byte(s))
	}
	return seeds
}

// FuzzResyncServe publishes any bytes as a resync request to a worker
// served by ServeResync. Invariants: no panic; every request is answered
// with a ResyncReply; a request that is not JSON of a ResyncRequest, or
// names another worker, is refused with an error and never reaches the
// handler; any other reaches the handler exactly once, decoded as
// encoding/json decodes it, and its reply is the handler's, unchanged.
func FuzzResyncServe(f *testing.F) {
	for _, s := range resyncRequestSeeds(f) {
		f.Add(s)
	}
	const worker = "w.1"
	nc := resyncConn(f)
	served := make(chan ResyncRequest, 1)
	sub, err := ServeResync(nc, worker, slog.New(slog.DiscardHandler), func(req ResyncRequest) ResyncReply {
		select {
		case served <- req:
		default: // a second call for one request: the check below sees it missing
		}
		return ResyncReply{Accepted: req.DPRank%2 == 0, NextEventID: req.LastEventID + 1, Error: req.Reason}
	})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = sub.Unsubscribe() })

	f.Fuzz(func(t *testing.T, data []byte) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		msg, err := nc.RequestWithContext(ctx, ResyncSubject(worker), data)
		if err != nil {
			t.Fatalf("request %q: %v", data, err)
		}
		var rep ResyncReply
		if err := json.Unmarshal(msg.Data, &rep); err != nil {
			t.Fatalf("reply %q is not a ResyncReply: %v", msg.Data, err)
		}
		var got *ResyncRequest
		select {
		case r := <-served:
			got = &r
		default:
		}

		var want ResyncRequest
		if err := json.Unmarshal(data, &want); err != nil || want.Worker != worker {
			if got != nil {
				t.Fatalf("request %q reached the handler as %+v", data, *got)
			}
			if rep.Error == "" || rep.Accepted || rep.NextEventID != 0 {
				t.Fatalf("request %q answered %+v, want a refusal", data, rep)
			}
			return
		}
		if got == nil || !reflect.DeepEqual(*got, want) {
			t.Fatalf("request %q reached the handler as %v, want %+v", data, got, want)
		}
		if wantRep := (ResyncReply{Accepted: want.DPRank%2 == 0, NextEventID: want.LastEventID + 1, Error: want.Reason}); rep != wantRep {
			t.Fatalf("reply %+v, want the handler's %+v", rep, wantRep)
		}
	})
}

// FuzzResyncReply makes a worker answer RequestResync with any bytes.
// Invariants: no panic; the caller gets the reply exactly as encoding/json
// decodes it, or, when it does not decode, a "bad reply" error and a zero
// reply; never ErrNoResync (the worker did answer).
func FuzzResyncReply(f *testing.F) {
	for _, r := range []ResyncReply{
		{Accepted: true, NextEventID: 42},
		{Accepted: true, NextEventID: FreshEventIDBase(time.Unix(1752000000, 0))},
		{Error: "busy"},
		{},
	} {
		b, err := json.Marshal(r)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	for _, s := range []string{
		`{"accepted":"yes"}`,
		`{"accepted":true,"next_event_id":-1}`,
		`{"accepted":true,"next_event_id":18446744073709551616}`,
		`{"accepted":true} {"accepted":false}`,
		`[]`, `null`, ``, "\xff",
	} {
		f.Add([]byte(s))
	}
	const worker = "w.2"
	nc := resyncConn(f)
	var answer atomic.Pointer[[]byte]
	sub, err := nc.Subscribe(ResyncSubject(worker), func(m *nats.Msg) {
		_ = m.Respond(*answer.Load())
	})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = sub.Unsubscribe() })

	f.Fuzz(func(t *testing.T, data []byte) {
		answer.Store(&data)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		rep, err := RequestResync(ctx, nc, ResyncRequest{Worker: worker, DPRank: 1, LastEventID: 17})

		var want ResyncReply
		if uerr := json.Unmarshal(data, &want); uerr != nil {
			if err == nil || !strings.Contains(err.Error(), "bad reply") || rep != (ResyncReply{}) {
				t.Fatalf("reply %q: got %+v, %v; want a bad-reply error", data, rep, err)
			}
			return
		}
		if err != nil || rep != want {
			t.Fatalf("reply %q: got %+v, %v; want %+v", data, rep, err, want)
		}
	})
}
