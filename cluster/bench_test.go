package cluster_test

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/cluster/clustertest"
	"github.com/kvrouter/kvrouter/fsm"
)

// BenchmarkClusterCommit measures committed batch entries on a 3-node
// in-process cluster (raft-boltdb with fsync, TCP on loopback): each op is
// one ApplyLocal of a batch command of B events on the leader, waited for
// until committed by a quorum and applied by the leader's FSM. inflight is
// how many batches the proposer keeps outstanding (the ingest consumer can
// pipeline). Reported: commits/s, events/s, commit latency p50/p99 (ms).
//
// payload=opaque uses the test FSM with B×60 random bytes per entry
// (realistic size, no index work); fsm=real applies real KV store events
// (one block each) into the real FSM.
func BenchmarkClusterCommit(b *testing.B) {
	for _, kind := range []string{"opaque", "real"} {
		for _, inflight := range []int{1, 4} {
			b.Run(fmt.Sprintf("fsm=%s/events=1024/inflight=%d", kind, inflight), func(b *testing.B) {
				benchCommit(b, kind, 1024, inflight)
			})
		}
	}
}

func benchCommit(b *testing.B, kind string, events, inflight int) {
	opts := clustertest.Options{Quiet: true, HeartbeatTimeout: time.Second, ElectionTimeout: time.Second, LeaderLeaseTimeout: 500 * time.Millisecond,
		SnapshotThreshold: 1 << 20, TrailingLogs: 1 << 20, SnapshotInterval: time.Hour}
	var payload func(i int) []byte
	switch kind {
	case "opaque":
		rng := rand.New(rand.NewPCG(1, 2))
		base := make([]byte, events*60)
		for i := range base {
			base[i] = byte(rng.Uint32())
		}
		payload = func(i int) []byte {
			p := slices.Clone(base)
			binary.LittleEndian.PutUint64(p, uint64(i)) // distinct entries: the test FSM dedupes
			return p
		}
	case "real":
		opts.NewFSM = func(int) cluster.StateMachine {
			f, err := fsm.NewFSM(routerDefault())
			if err != nil {
				b.Fatal(err)
			}
			return f
		}
		payload = func(i int) []byte { return kvBatchB(b, "w1", uint64(i*events)+1, events, 1) }
	}
	c := clustertest.New(b, 3, opts)
	l := c.WaitLeader().Node()
	if kind == "real" {
		reg, _ := fsm.EncodeRegisterWorker(fsm.RegisterWorker{ID: "w1", DPRanks: 1, Model: "m", TotalBlocks: 1 << 30})
		if err := l.ApplyLocal(reg, 5*time.Second).Error(); err != nil {
			b.Fatal(err)
		}
	}
	// Pre-build the commands outside the timed region.
	cmds := make([][]byte, b.N)
	for i := range cmds {
		cmds[i] = payload(i)
	}
	lat := make([]time.Duration, b.N)
	var next int
	var mu sync.Mutex
	take := func() int {
		mu.Lock()
		defer mu.Unlock()
		next++
		return next - 1
	}
	b.SetBytes(int64(len(cmds[0])))
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for w := 0; w < inflight; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := take(); i < b.N; i = take() {
				t0 := time.Now()
				if err := l.ApplyLocal(cmds[i], 10*time.Second).Error(); err != nil {
					b.Error(err)
					return
				}
				lat[i] = time.Since(t0)
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	slices.Sort(lat)
	pct := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))]) / 1e6 }
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "commits/s")
	b.ReportMetric(float64(b.N*events)/elapsed.Seconds(), "events/s")
	b.ReportMetric(pct(0.50), "p50_ms")
	b.ReportMetric(pct(0.99), "p99_ms")
}
