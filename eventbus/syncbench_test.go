package eventbus

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"

	"github.com/kvrouter/kvrouter/internal/proccpu"
)

// BenchmarkSyncAdd is what a replica announces for each request of
// kvbench's prompt (148 blocks): its add, prefill-done and free, from a
// Syncer on its own no-echo connection
// to an embedded server, as the replica does it, with its subscription
// live. cpu-µs/op is the whole process's CPU per add (the publishing
// goroutine, the connection's flusher and the server's handling), which on
// a replica's machine competes with the request it announces. The file
// builds against the base commit too (only exported API and the test
// helpers), for side-by-side runs.
func BenchmarkSyncAdd(b *testing.B) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	srv := startSingle(b, log)
	nc, _ := connectWith(b, srv.ClientURL(), "sync", log, WithNoEcho())
	s, err := NewSyncer(nc, SyncConfig{Replica: "r1", Model: "llama", Logger: log}, newRecSink())
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(ctx) }()
	b.Cleanup(func() { cancel(); <-done })
	h := make([]uint64, 148)
	for i := range h {
		h[i] = uint64(i+1) * 0x9e3779b97f4a7c15
	}
	ids := make([]string, 64)
	for i := range ids {
		ids[i] = fmt.Sprintf("chatcmpl-%016x", i)
	}
	b.ReportAllocs()
	cpu0 := proccpu.Self()
	i := 0
	for b.Loop() {
		id := ids[i%len(ids)]
		i++
		if err := s.Add(ActiveRequest{Request: id, Worker: "http://127.0.0.1:8001#0", Hashes: h, ISL: 2371, Overlap: 140, Sequences: 1}); err != nil {
			b.Fatal(err)
		}
		if err := s.PrefillDone(id); err != nil {
			b.Fatal(err)
		}
		if err := s.Free(id); err != nil {
			b.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(proccpu.Self()-cpu0)/1e3/float64(b.N), "cpu-µs/op")
}
