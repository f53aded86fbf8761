package cluster_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"runtime/metrics"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/cluster/clustertest"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// BenchmarkCatchUpBySnapshot: issue 19 item 4 end to end. Three members
// with the real FSM and production snapshot settings (threshold and
// trailing logs 2048, checked every 30 s) index N blocks, built through the
// leader in KV batch entries of up to 4 MiB (64 workers, vLLM-like engine
// names, 32 blocks per event). A steady ingest of small KV batches
// (200 entries/s, 8 events of 4 blocks, open loop) runs throughout; once
// the leader's log holds more than TrailingLogs entries every member takes
// a snapshot (so the leader's log no longer starts at index 1), then one
// follower is wiped (stopped, data dir deleted, restarted empty with the
// same id and address: it joins, is already a voter, and the leader must
// send it its snapshot).
//
// Reported (use -benchtime 1x): the leader's forced snapshot (capture,
// persist, fsync: leader_snap_ms) and its size (snapshot_MB); from the
// wiped member's restart (restart = after its node is up again): the
// leader starting InstallSnapshot (to_install_ms), the stream written to
// the follower's snapshot store (transfer_ms, from the leader's
// "installing snapshot on" to the follower's "copied to local snapshot"),
// the FSM Restore (restore_ms, timed around fsm.FSM.Restore), "Installed
// remote snapshot" (installed_ms) and the wiped FSM's applied index
// reaching the leader's (caught_up_ms, the goal is ≤ 30 s at 10M); the
// process's peak heap during the catch-up (three members in one process)
// against its live heap before the wipe; and the steady ingest's commit
// latency (scheduled send → committed and applied on the leader) before
// the snapshots and during the catch-up. After the catch-up the ingest
// stops and the three digests must be equal.
func BenchmarkCatchUpBySnapshot(b *testing.B) {
	for _, blocks := range []int{1 << 20, 10 << 20} {
		b.Run(fmt.Sprintf("blocks=%dM", blocks>>20), func(b *testing.B) {
			for range b.N {
				benchCatchUp(b, blocks)
			}
		})
	}
}

const (
	cuWorkers        = 64
	cuBlocksPerEvent = 32
	cuMaxEntryBytes  = 4 << 20 // kvrouter serve --max-entry-bytes default
	cuRate           = 200     // steady ingest entries per second
	cuLiveEvents     = 8       // events per steady entry
	cuLiveBlocks     = 4       // blocks per steady event
	cuLiveWorker     = "vllm-live"
	// cuBeforeEntries steady entries are scheduled before the snapshots:
	// more than TrailingLogs, so the snapshot compacts the leader's log
	// past index 1 and the wiped member cannot be caught up by replay.
	cuBeforeEntries = 2300
)

// timedFSM is the real FSM with its Restore timed (the install's restore,
// separated from the transfer).
type timedFSM struct {
	*fsm.FSM
	restoreStart, restoreEnd atomic.Int64 // unix ns; 0 until a restore
}

func (f *timedFSM) Restore(rc io.ReadCloser) error {
	f.restoreStart.Store(time.Now().UnixNano())
	err := f.FSM.Restore(rc)
	f.restoreEnd.Store(time.Now().UnixNano())
	return err
}

// raftEvent is one log line of interest from one member.
type raftEvent struct {
	at     time.Time
	member int
	msg    string
	attrs  map[string]string
}

// eventLog records the raft log lines the benchmark times (and counts the
// warnings and errors) instead of printing them: b.Log output of a
// benchmark is always shown.
type eventLog struct {
	mu     sync.Mutex
	events []raftEvent
	warns  map[string]int // message → count, level ≥ Warn
}

var cuInteresting = map[string]bool{
	"installing snapshot on":    true, // leader, InstallSnapshot starts
	"copied to local snapshot":  true, // follower, stream on disk
	"Installed remote snapshot": true, // follower, restored
	"starting snapshot up to":   true,
	"snapshot complete up to":   true,
	"compacting logs":           true,
}

func (l *eventLog) find(member int, msg string, after time.Time) (raftEvent, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, e := range l.events {
		if e.member == member && e.msg == msg && !e.at.Before(after) {
			return e, true
		}
	}
	return raftEvent{}, false
}

func (l *eventLog) count(member int, msg string, from, to time.Time) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, e := range l.events {
		if (member < 0 || e.member == member) && e.msg == msg && !e.at.Before(from) && e.at.Before(to) {
			n++
		}
	}
	return n
}

type eventHandler struct {
	log    *eventLog
	member int
}

func (h eventHandler) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelInfo }
func (h eventHandler) WithAttrs([]slog.Attr) slog.Handler           { return h }
func (h eventHandler) WithGroup(string) slog.Handler                { return h }

func (h eventHandler) Handle(_ context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn {
		h.log.mu.Lock()
		h.log.warns[r.Message]++
		h.log.mu.Unlock()
	}
	if !cuInteresting[r.Message] {
		return nil
	}
	e := raftEvent{at: r.Time, member: h.member, msg: r.Message, attrs: map[string]string{}}
	r.Attrs(func(a slog.Attr) bool {
		e.attrs[a.Key] = a.Value.String()
		return true
	})
	h.log.mu.Lock()
	h.log.events = append(h.log.events, e)
	h.log.mu.Unlock()
	return nil
}

// sample is one steady-ingest entry: when it was due, how long until it
// was committed and applied on the leader.
type sample struct {
	due time.Time
	lat time.Duration
	err error
}

func benchCatchUp(b *testing.B, blocks int) {
	b.StopTimer()
	events := &eventLog{warns: map[string]int{}}
	var fsmMu sync.Mutex
	fsms := map[int]*timedFSM{} // member → its state machine of the current start
	prod := cluster.DefaultConfig()
	opts := clustertest.Options{
		Quiet:             true,
		SnapshotThreshold: prod.SnapshotThreshold,
		SnapshotInterval:  prod.SnapshotInterval,
		TrailingLogs:      prod.TrailingLogs,
		FormTimeout:       time.Minute,
		NewFSM: func(i int) cluster.StateMachine {
			f, err := fsm.NewFSM(router.DefaultConfig())
			if err != nil {
				b.Fatalf("fsm.NewFSM: %v", err)
			}
			t := &timedFSM{FSM: f}
			fsmMu.Lock()
			fsms[i] = t
			fsmMu.Unlock()
			return t
		},
		Configure: func(i int, c *cluster.Config, _ cluster.StateMachine) {
			c.Logger = slog.New(eventHandler{log: events, member: i})
			c.ResponseError = fsm.ResponseError
			c.DecodeResult = fsm.DecodeResult
			c.ForwardErrors = fsm.ForwardErrors()
		},
	}
	c := clustertest.New(b, 3, opts)
	lm := c.WaitLeader()
	leader := lm.Node()
	fsmOf := func(i int) *timedFSM {
		fsmMu.Lock()
		defer fsmMu.Unlock()
		return fsms[i]
	}

	// 1. Register the workers and build the index through the leader.
	t0 := time.Now()
	for w := range cuWorkers + 1 {
		id := benchWorkerName(w)
		if w == cuWorkers {
			id = cuLiveWorker
		}
		cmd, err := fsm.EncodeRegisterWorker(fsm.RegisterWorker{ID: id, DPRanks: 1, Model: "m", TotalBlocks: 1 << 30})
		if err != nil {
			b.Fatal(err)
		}
		cuApply(b, leader, cmd, 1<<30)
	}
	entries := cuBuild(b, leader, blocks)
	cuWaitApplied(b, c, fsmOf)
	build := time.Since(t0)
	b.Logf("built %d blocks in %d entries in %v", blocks, entries, build.Round(time.Millisecond))

	// 2. The steady ingest, open loop: entry k is due at start + k/rate,
	// proposed by one goroutine in order (event ids must arrive in order),
	// each waited for on its own goroutine.
	var (
		smu     sync.Mutex
		samples []sample
		wg      sync.WaitGroup
		stop    = make(chan struct{})
		sent    atomic.Int64
	)
	ingestDone := make(chan struct{})
	go func() {
		defer close(ingestDone)
		rng := rand.New(rand.NewPCG(3, 4))
		start := time.Now()
		var eventID uint64
		for k := 0; ; k++ {
			due := start.Add(time.Duration(k) * time.Second / cuRate)
			select {
			case <-stop:
				return
			case <-time.After(time.Until(due)):
			}
			evs := make([]fsm.KVBatchEvent, cuLiveEvents)
			for i := range evs {
				eventID++
				ev := router.KVEvent{Kind: router.EventStored, BlockSize: 16, Blocks: make([]router.StoredBlock, cuLiveBlocks)}
				for j := range ev.Blocks {
					x := rng.Uint64()
					ev.Blocks[j] = router.StoredBlock{EngineHash: x ^ 0x5bd1e995, ContentHash: x}
				}
				evs[i] = fsm.KVBatchEvent{Worker: cuLiveWorker, EventID: eventID, Event: ev}
			}
			cmd, err := fsm.EncodeKVBatch(evs)
			if err != nil {
				b.Error(err)
				return
			}
			fut := leader.ApplyLocal(cmd, 30*time.Second)
			sent.Add(1)
			wg.Add(1)
			go func() {
				defer wg.Done()
				err := fut.Error()
				if err == nil {
					err = fsm.ResponseError(fut.Response())
				}
				lat := time.Since(due)
				smu.Lock()
				samples = append(samples, sample{due: due, lat: lat, err: err})
				smu.Unlock()
			}()
		}
	}()
	poll.Until(b, 2*time.Minute, 20*time.Millisecond, func() error {
		if n := sent.Load(); n < cuBeforeEntries {
			return fmt.Errorf("%d of %d steady entries sent", n, cuBeforeEntries)
		}
		return nil
	})

	// 3. Snapshot every member, the leader first.
	snapStart := time.Now()
	var leaderSnap time.Duration
	for _, m := range c.Running() {
		t := time.Now()
		if err := m.Node().Snapshot(); err != nil {
			b.Fatalf("snapshot %s: %v", m.ID, err)
		}
		if m == lm {
			leaderSnap = time.Since(t)
		}
	}
	if _, ok := events.find(lm.Index, "compacting logs", snapStart); !ok {
		b.Fatalf("the leader's snapshot compacted no logs: the wiped member would catch up by replay")
	}
	var fi int
	for _, m := range c.Running() {
		if m != lm {
			fi = m.Index
			break
		}
	}
	runtime.GC()
	heapBefore := heapObjects()

	// 4. Wipe the follower, watch it catch up.
	var peak atomic.Uint64
	sampling := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			if h := heapObjects(); h > peak.Load() {
				peak.Store(h)
			}
			select {
			case <-sampling:
				return
			case <-tick.C:
			}
		}
	}()
	b.StartTimer()
	wipeStart := time.Now()
	c.Wipe(fi)
	restart := time.Now()
	wiped := c.M(fi)
	var caughtUp time.Time
	poll.Until(b, 5*time.Minute, 5*time.Millisecond, func() error {
		want := leader.StateMachine().AppliedIndex()
		got := fsmOf(fi).AppliedIndex()
		if got < want {
			return fmt.Errorf("wiped member applied %d, leader %d", got, want)
		}
		caughtUp = time.Now()
		return nil
	})
	b.StopTimer()
	close(sampling)
	<-sampled

	// Keep the ingest running a little longer (the "after" window), then
	// stop it and compare the digests.
	afterEnd := caughtUp.Add(3 * time.Second)
	time.Sleep(time.Until(afterEnd))
	close(stop)
	<-ingestDone
	wg.Wait()
	cuWaitApplied(b, c, fsmOf)
	want := fsmOf(lm.Index).Digest()
	for _, m := range c.Running() {
		if got := fsmOf(m.Index).Digest(); got != want {
			b.Fatalf("%s digest %s, leader %s", m.ID, got, want)
		}
	}

	// Timings from the log lines and the wrapped Restore.
	inst, ok := events.find(lm.Index, "installing snapshot on", restart)
	if !ok {
		b.Fatalf("the leader never installed a snapshot on the wiped member")
	}
	copied, ok1 := events.find(fi, "copied to local snapshot", restart)
	installed, ok2 := events.find(fi, "Installed remote snapshot", restart)
	if !ok1 || !ok2 {
		b.Fatalf("the wiped member logged no snapshot install")
	}
	tf := fsmOf(fi)
	rs, re := time.Unix(0, tf.restoreStart.Load()), time.Unix(0, tf.restoreEnd.Load())
	size, _ := strconv.ParseInt(inst.attrs["size"], 10, 64)
	if size == 0 {
		size = snapshotFileSize(b, lm.DataDir)
	}
	installs := events.count(lm.Index, "installing snapshot on", restart, caughtUp)
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

	var before, during, after []time.Duration
	var ingestErrs int
	for _, s := range samples {
		if s.err != nil {
			ingestErrs++
			continue
		}
		switch {
		case s.due.Before(snapStart):
			before = append(before, s.lat)
		case !s.due.Before(wipeStart) && s.due.Before(caughtUp):
			during = append(during, s.lat)
		case !s.due.Before(caughtUp) && s.due.Before(afterEnd):
			after = append(after, s.lat)
		}
	}
	pct := func(l []time.Duration, p float64) float64 {
		if len(l) == 0 {
			return 0
		}
		l = slices.Clone(l)
		slices.Sort(l)
		return ms(l[int(p*float64(len(l)-1))])
	}

	b.ReportMetric(ms(build)/1000, "build_s")
	b.ReportMetric(ms(leaderSnap), "leader_snap_ms")
	b.ReportMetric(float64(size)/(1<<20), "snapshot_MB")
	b.ReportMetric(ms(restart.Sub(wipeStart)), "wipe_ms")
	b.ReportMetric(ms(inst.at.Sub(restart)), "to_install_ms")
	b.ReportMetric(ms(copied.at.Sub(inst.at)), "transfer_ms")
	b.ReportMetric(ms(re.Sub(rs)), "restore_ms")
	b.ReportMetric(ms(installed.at.Sub(restart)), "installed_ms")
	b.ReportMetric(ms(caughtUp.Sub(restart)), "caught_up_ms")
	b.ReportMetric(float64(installs), "installs")
	b.ReportMetric(float64(heapBefore)/(1<<20), "heap_before_MB")
	b.ReportMetric(float64(peak.Load())/(1<<20), "peak_heap_MB")
	for _, w := range []struct {
		name string
		l    []time.Duration
	}{{"before", before}, {"during", during}, {"after", after}} {
		b.ReportMetric(pct(w.l, 0.50), "p50_"+w.name+"_ms")
		b.ReportMetric(pct(w.l, 0.99), "p99_"+w.name+"_ms")
		b.ReportMetric(pct(w.l, 1), "max_"+w.name+"_ms")
	}
	b.ReportMetric(float64(ingestErrs), "ingest_errors")

	events.mu.Lock()
	b.Logf("wiped %s (leader %s): restart %v after the wipe began; install started +%v, on disk +%v, restore %v–%v, installed +%v, caught up +%v; %d/%d/%d steady entries before/during/after; snapshots started: %d during the catch-up; warnings: %v",
		wiped.ID, lm.ID, restart.Sub(wipeStart).Round(time.Millisecond), inst.at.Sub(restart).Round(time.Millisecond),
		copied.at.Sub(restart).Round(time.Millisecond), rs.Sub(restart).Round(time.Millisecond), re.Sub(restart).Round(time.Millisecond),
		installed.at.Sub(restart).Round(time.Millisecond), caughtUp.Sub(restart).Round(time.Millisecond),
		len(before), len(during), len(after), cuCountLocked(events, "starting snapshot up to", wipeStart, caughtUp), events.warns)
	events.mu.Unlock()
	runtime.KeepAlive(wiped)
}

func cuCountLocked(l *eventLog, msg string, from, to time.Time) int {
	n := 0
	for _, e := range l.events {
		if e.msg == msg && !e.at.Before(from) && e.at.Before(to) {
			n++
		}
	}
	return n
}

func benchWorkerName(w int) string { return fmt.Sprintf("vllm-%d", w) }

// cuApply applies cmd on the leader and checks that want events applied
// (1<<30: a command without events).
func cuApply(b *testing.B, n *cluster.Node, cmd []byte, want int) {
	b.Helper()
	fut := n.ApplyLocal(cmd, time.Minute)
	if err := fut.Error(); err != nil {
		b.Fatalf("apply: %v", err)
	}
	if err := fsm.ResponseError(fut.Response()); err != nil {
		b.Fatalf("apply: %v", err)
	}
	if r, ok := fut.Response().(*fsm.ApplyResult); ok && want != 1<<30 && r.Applied != want {
		b.Fatalf("applied %d of %d events: %+v", r.Applied, want, r)
	}
}

// cuBuild stores blocks fresh blocks (cuBlocksPerEvent per event, workers
// round-robin) in entries of at most cuMaxEntryBytes, encoded on one
// goroutine while the previous entry commits; it returns the entry count.
func cuBuild(b *testing.B, leader *cluster.Node, blocks int) int {
	type entry struct {
		cmd    []byte
		events int
	}
	ch := make(chan entry, 2)
	go func() {
		defer close(ch)
		rng := rand.New(rand.NewPCG(7, 8))
		next := make([]uint64, cuWorkers)
		var evs []fsm.KVBatchEvent
		size := 0
		flush := func() {
			cmd, err := fsm.EncodeKVBatch(evs)
			if err != nil {
				panic(err)
			}
			ch <- entry{cmd, len(evs)}
			evs, size = nil, 0
		}
		for e := 0; e < blocks/cuBlocksPerEvent; e++ {
			w := e % cuWorkers
			ev := router.KVEvent{Kind: router.EventStored, BlockSize: 16, Blocks: make([]router.StoredBlock, cuBlocksPerEvent)}
			for j := range ev.Blocks {
				x := rng.Uint64()
				ev.Blocks[j] = router.StoredBlock{EngineHash: x ^ 0x5bd1e995, ContentHash: x}
			}
			next[w]++
			kv := fsm.KVBatchEvent{Worker: benchWorkerName(w), EventID: next[w], Event: ev}
			n := fsm.KVBatchEventBytes(&kv)
			if size+n > cuMaxEntryBytes-(64<<10) && len(evs) > 0 {
				flush()
			}
			evs = append(evs, kv)
			size += n
		}
		if len(evs) > 0 {
			flush()
		}
	}()
	n := 0
	for e := range ch {
		cuApply(b, leader, e.cmd, e.events)
		n++
	}
	return n
}

// cuWaitApplied waits until every running member's FSM has applied the
// leader's applied index.
func cuWaitApplied(b *testing.B, c *clustertest.Cluster, fsmOf func(int) *timedFSM) {
	b.Helper()
	poll.Until(b, 5*time.Minute, 20*time.Millisecond, func() error {
		want := c.WaitLeader().Node().StateMachine().AppliedIndex()
		for _, m := range c.Running() {
			if got := fsmOf(m.Index).AppliedIndex(); got < want {
				return fmt.Errorf("%s applied %d < %d", m.ID, got, want)
			}
		}
		return nil
	})
}

// heapObjects is the heap's object bytes now (live and not yet swept),
// read without stopping the world.
func heapObjects() uint64 {
	s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// snapshotFileSize is the size of the newest state.bin under dir/snapshots.
func snapshotFileSize(b *testing.B, dir string) int64 {
	b.Helper()
	files, _ := filepath.Glob(filepath.Join(dir, "snapshots", "*", "state.bin"))
	slices.Sort(files)
	if len(files) == 0 {
		return 0
	}
	st, err := os.Stat(files[len(files)-1])
	if err != nil {
		return 0
	}
	return st.Size()
}
