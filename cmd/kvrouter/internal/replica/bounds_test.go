package replica

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// metricSum adds up the samples of a counter family in reg whose labels
// include want.
func metricSum(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			for k, v := range want {
				found := false
				for _, lp := range m.GetLabel() {
					if lp.GetName() == k && lp.GetValue() == v {
						found = true
					}
				}
				if !found {
					continue metrics
				}
			}
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

// blocksEvent stores n unchained blocks, hashes from first on.
func blocksEvent(first, n int) eventbus.WireEvent {
	ev := eventbus.WireEvent{Kind: uint8(router.EventStored), BlockSize: router.DefaultConfig().BlockSize}
	for i := range n {
		h := uint64(first + i + 1)
		ev.Blocks = append(ev.Blocks, eventbus.WireBlock{Engine: h, Content: h})
	}
	return ev
}

// TestWireEntryBytesMatchesFSM: the consumer's size of a wire event is the
// state machine's bound for the event it becomes.
func TestWireEntryBytesMatchesFSM(t *testing.T) {
	aliased := blocksEvent(0, 3)
	aliased.Blocks[1].Engine = 99
	for _, ev := range []eventbus.WireEvent{
		blocksEvent(0, 1), blocksEvent(5, 300), aliased, stored(7),
		{Worker: "a-longer-worker-name", DPRank: 3, EventID: 1 << 40, Kind: uint8(router.EventRemoved), Removed: []uint64{1, 2}},
		{Worker: "w", EventID: 2, Kind: uint8(router.EventCleared), BlockSize: 16},
	} {
		if ev.Worker == "" {
			ev.Worker, ev.EventID = "w", 9
		}
		kv := fsm.KVBatchEvent{Worker: ev.Worker, DPRank: ev.DPRank, EventID: ev.EventID, Event: ev.KVEvent()}
		if got, want := wireEntryBytes(&ev), fsm.KVBatchEventBytes(&kv); got != want {
			t.Errorf("%s: wireEntryBytes %d, fsm.KVBatchEventBytes %d", ev.MsgID(), got, want)
		}
	}
}

// TestReplicaIngestSplitsEntries: with --max-entry-bytes 1 KiB, a fetched
// batch of 45 events of 40 blocks (about 330 bytes each in an entry) is
// committed as entries of three events at most, in order, every event
// applied once on every replica; an event of 200 blocks, which no entry
// could hold, is terminated as too_large and never reaches the log.
//
// All three members are stopped while the events are published, so the
// leader that comes back finds them all in the stream and fetches them as
// one batch: the split is certain, not a matter of timing.
func TestReplicaIngestSplitsEntries(t *testing.T) {
	const (
		maxEntry = 1024
		events   = 45
		blocks   = 40 // 45 × 40 = 1800 blocks, under w's cap of 2 × 1000
	)
	tc := newTestClusterWith(t, 3, func(c *Config) { c.MaxEntryBytes = maxEntry })
	leader := tc.WaitLeader()
	registerWorker(t, tc.follower(leader), "w")
	registerWorker(t, tc.follower(leader), "big")
	tc.WaitConverged()
	for i := range tc.Members() {
		tc.Stop(i)
	}

	pub := publisher(t, tc, "w")
	for i := range events {
		if _, err := pub.PublishAsync(t.Context(), blocksEvent(i*blocks, blocks)); err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
	}
	big := publisher(t, tc, "big")
	if _, err := big.PublishAsync(t.Context(), blocksEvent(1<<20, 200)); err != nil {
		t.Fatal(err)
	}
	for _, p := range []*eventbus.Publisher{pub, big} {
		if err := p.Flush(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	for i := range tc.Members() {
		tc.Start(i)
	}
	tc.WaitLeader()

	key := fsm.RankKey{Worker: "w", DPRank: 0}
	poll.Until(t, 60*time.Second, 20*time.Millisecond, func() error {
		return tc.eachReplica(func(r *replica) error {
			if c, held := r.fsm.Cursors()[key], r.fsm.Index().Held(key.ID()); c != events || held != events*blocks {
				return fmt.Errorf("w applied up to event %d holding %d blocks, want %d and %d", c, held, events, events*blocks)
			}
			return nil
		})
	})
	// The replicas restarted with fresh state machines that replayed the
	// log: the events' entries are in it, each event once.
	if err := tc.eachReplica(func(r *replica) error {
		if s := r.fsm.Stats(); s.Applied != events || s.Rejected[fsm.RejectOverCapacity] != 0 {
			return fmt.Errorf("%d events applied (want %d), %d refused over capacity", s.Applied, events, s.Rejected[fsm.RejectOverCapacity])
		}
		if held := r.fsm.Index().Held("big"); held != 0 {
			return fmt.Errorf("big holds %d blocks: the too-large event reached the log", held)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	var entries, splits, tooLarge float64
	poll.Until(t, 20*time.Second, 20*time.Millisecond, func() error {
		entries, splits, tooLarge = 0, 0, 0
		for _, m := range tc.Running() {
			reg := tc.R(m.Index).reg
			entries += metricSum(t, reg, "kvrouter_eventbus_batches_total", nil)
			splits += metricSum(t, reg, "kvrouter_eventbus_split_batches_total", nil)
			tooLarge += metricSum(t, reg, "kvrouter_eventbus_events_rejected_total", map[string]string{"reason": "too_large"})
		}
		if tooLarge != 1 {
			return fmt.Errorf("%v events rejected as too_large, want 1", tooLarge)
		}
		return nil
	})
	// Three events fit an entry of 1 KiB (the fixed 22 bytes of overhead
	// aside), four do not: at least 15 entries.
	t.Logf("%v entries committed for %d events, %v fetched batches split", entries, events, splits)
	if entries < events/3 || splits < 1 {
		t.Fatalf("%v entries committed, %v fetched batches split: want at least %d and 1", entries, splits, events/3)
	}
	tc.WaitConverged()
}

// TestReplicaIndexCapRefuses: a worker registered with 1000 blocks per rank
// may hold 2000 in the index; its event past that is refused on every
// replica alike, counted in /cluster/status and the metric, and the rank is
// marked stale so the leader resyncs it (clearing its blocks).
func TestReplicaIndexCapRefuses(t *testing.T) {
	tc := newTestCluster(t, 3)
	leader := tc.WaitLeader()
	registerWorker(t, tc.follower(leader), "w") // total_kv_blocks 1000
	pub := publisher(t, tc, "w")
	for i, n := range []int{1000, 1000, 1} { // the third takes it to 2001
		if _, err := pub.Publish(t.Context(), blocksEvent(i*1000, n)); err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
	}
	key := fsm.RankKey{Worker: "w", DPRank: 0}
	poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error {
		return tc.eachReplica(func(r *replica) error {
			if got := r.fsm.OverCapacityRefused()["w"]; got != 1 {
				return fmt.Errorf("refused %d blocks, want 1", got)
			}
			if c := r.fsm.Cursors()[key]; c != 3 && c != 0 { // 0: resynced already
				return fmt.Errorf("cursor %d", c)
			}
			return nil
		})
	})
	if err := tc.eachReplica(func(r *replica) error {
		if got := metricSum(t, r.reg, "kvrouter_index_blocks_refused_total", map[string]string{"worker": "w", "reason": "over_capacity"}); got != 1 {
			return fmt.Errorf("kvrouter_index_blocks_refused_total = %v", got)
		}
		var entry map[string]any
		for _, w := range r.Status(false)["workers"].([]map[string]any) {
			if w["id"] == "w" {
				entry = w
			}
		}
		if entry == nil || entry["over_capacity_refused"] != uint64(1) || entry["index_block_cap"] != 2000 {
			return fmt.Errorf("status entry %v", entry)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// The leader resyncs the rank marked stale "over capacity": its blocks
	// are cleared everywhere and the mark goes.
	poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error {
		return tc.eachReplica(func(r *replica) error {
			if s, stale := r.fsm.Stale()[key]; stale {
				return errors.New("still stale: " + s.Reason)
			}
			if held := r.fsm.Index().Held(key.ID()); held != 0 {
				return fmt.Errorf("%d blocks after the resync", held)
			}
			return nil
		})
	})
	tc.WaitConverged()
}

// TestReplicaIngestBatchOfWireEvents: the leader's conversion of a batch
// (one block allocation for the batch) encodes to the same entry as the
// per-event WireEvent.KVEvent conversion, for every kind and tier, and
// leaves no event's blocks able to overwrite another's.
func TestReplicaIngestBatchOfWireEvents(t *testing.T) {
	aliased := blocksEvent(0, 3)
	aliased.Blocks[1].Engine = 99
	host := blocksEvent(2, 2)
	host.Tier = uint8(router.TierHost)
	events := []eventbus.WireEvent{
		blocksEvent(0, 1), blocksEvent(5, 300), aliased, stored(7), host,
		{Worker: "a-longer-worker-name", DPRank: 3, EventID: 1 << 40, Kind: uint8(router.EventRemoved), Removed: []uint64{1, 2}},
		{Worker: "w", EventID: 2, Kind: uint8(router.EventCleared), BlockSize: 16},
		blocksEvent(9, 4),
	}
	for i := range events {
		if events[i].Worker == "" {
			events[i].Worker, events[i].EventID = "w", uint64(10+i)
		}
	}
	want := make([]fsm.KVBatchEvent, len(events))
	for i := range events {
		ev := &events[i]
		want[i] = fsm.KVBatchEvent{Worker: ev.Worker, DPRank: ev.DPRank, EventID: ev.EventID, Event: ev.KVEvent()}
	}
	for _, r := range [][2]int{{0, len(events)}, {0, 1}, {5, 7}, {0, 0}} {
		evs := events[r[0]:r[1]]
		got := kvBatchOf(evs)
		gb, gerr := fsm.EncodeKVBatch(got)
		wb, werr := fsm.EncodeKVBatch(want[r[0]:r[1]])
		if (gerr == nil) != (werr == nil) || string(gb) != string(wb) {
			t.Fatalf("%d events: entry %x (%v), want %x (%v)", len(evs), gb, gerr, wb, werr)
		}
		for i := range got {
			if b := got[i].Event.Blocks; len(b) > 0 && cap(b) != len(b) {
				t.Fatalf("event %d: blocks of capacity %d past its %d: an append would overwrite the next event's", i, cap(b), len(b))
			}
		}
	}
}
