package replica

import (
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/router"
)

// Resource bounds on what ingest puts into the replicated state (issue 16,
// item 5; fsm/DESIGN.md, "Bounds").

// Entry byte cap: the leader's consumer hands the state machine runs of
// events whose encoded KV batch stays within --max-entry-bytes, one Raft
// entry each; a single event that cannot fit is terminated (too_large).
const (
	DefaultMaxEntryBytes = 4 << 20
	// MinMaxEntryBytes keeps room for the largest event Validate accepts
	// (eventbus.DefaultMaxBlocks aliased blocks, 64 KiB) and its worker id.
	MinMaxEntryBytes = 80 << 10
	// MaxMaxEntryBytes is the most --max-entry-bytes may be: well below
	// what the state machine refuses (fsm.MaxEntryBytes).
	MaxMaxEntryBytes = fsm.MaxProposalBytes
)

// maxEntryBytes is the configured cap, or the default.
func (c Config) maxEntryBytes() int {
	if c.MaxEntryBytes > 0 {
		return c.MaxEntryBytes
	}
	return DefaultMaxEntryBytes
}

// wireEntryBytes bounds what ev adds to a KVEventBatch entry (the
// consumer's EntryBytes), without converting it.
func wireEntryBytes(ev *eventbus.WireEvent) int {
	s := fsm.KVEventShape{WorkerLen: len(ev.Worker), DPRank: ev.DPRank, EventID: ev.EventID,
		Kind: router.EventKind(ev.Kind), BlockSize: ev.BlockSize, HasParent: ev.HasParent,
		Blocks: len(ev.Blocks), Removed: len(ev.Removed), Tier: router.Tier(ev.Tier)}
	for _, b := range ev.Blocks {
		if b.Engine != b.Content {
			s.Aliased = true
			break
		}
	}
	return s.Bytes()
}

// capacityWatch follows the FSM's refusals of stored events beyond a worker
// rank's block cap: a log line at most once per worker per minute, and
// kvrouter_index_blocks_refused_total{worker,reason} from the FSM's
// counts. Every replica refuses alike (the decision is replicated state),
// so every replica reports.
type capacityWatch struct {
	log   *slog.Logger
	every time.Duration
	mu    sync.Mutex           // guards last
	last  map[string]time.Time // worker → when it was last logged
}

func newCapacityWatch(refused func() map[string]uint64, reg prometheus.Registerer, log *slog.Logger) *capacityWatch {
	w := &capacityWatch{log: log, every: time.Minute, last: map[string]time.Time{}}
	reg.MustRegister(refusedCollector{refused: refused, desc: prometheus.NewDesc("kvrouter_index_blocks_refused_total",
		"Blocks of KV events the state machine refused for a worker, by reason (over_capacity: its rank would have held more than twice its registered total_kv_blocks, or 2^20 blocks without one). Counted since this replica started or restored.",
		[]string{"worker", "reason"}, nil)})
	return w
}

// note logs ch (a fsm.ChangeOverCapacity) unless its worker was logged
// within the last minute. It runs on the FSM's apply goroutine: no blocking.
func (w *capacityWatch) note(ch fsm.Change) {
	now := time.Now()
	w.mu.Lock()
	if t, ok := w.last[ch.Worker]; ok && now.Sub(t) < w.every {
		w.mu.Unlock()
		return
	}
	w.last[ch.Worker] = now
	if len(w.last) > 4096 {
		// Workers come and go: forget those not logged within the minute.
		for id, t := range w.last {
			if now.Sub(t) >= w.every {
				delete(w.last, id)
			}
		}
	}
	w.mu.Unlock()
	w.log.Warn("KV events refused: the worker's index would exceed its block cap; the rank is resynced (logged once a minute per worker)",
		"worker", ch.Worker, "dp_rank", ch.DPRank, "detail", ch.Reason)
}

// refusedCollector exports the FSM's per-worker refused blocks at scrape
// time (the counts live in the FSM, which applies without a registry).
type refusedCollector struct {
	refused func() map[string]uint64 // per worker, blocks refused (every group owning workers)
	desc    *prometheus.Desc
}

func (c refusedCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c refusedCollector) Collect(ch chan<- prometheus.Metric) {
	for worker, n := range c.refused() {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.CounterValue, float64(n), worker, fsm.RejectOverCapacity)
	}
}
