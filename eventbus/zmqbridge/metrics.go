package zmqbridge

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// The bridge's Prometheus metrics, read from the streams' counters at
// scrape time. Labels: worker, dp_rank (and reason for skipped events).
var counterMetrics = []struct {
	name, help string
	get        func(*StreamStats) uint64
}{
	{"batches_total", "Event batches applied (live and replayed).", func(s *StreamStats) uint64 { return s.Batches }},
	{"events_total", "Engine KV events decoded.", func(s *StreamStats) uint64 { return s.Events }},
	{"malformed_frames_total", "ZMQ messages not of the engines' wire format (dropped).", func(s *StreamStats) uint64 { return s.MalformedFrames }},
	{"malformed_batches_total", "Payloads that did not decode (the batch is lost).", func(s *StreamStats) uint64 { return s.MalformedBatches }},
	{"malformed_events_total", "Single events that did not decode (skipped).", func(s *StreamStats) uint64 { return s.MalformedEvents }},
	{"duplicates_total", "Live batches already applied through a replay.", func(s *StreamStats) uint64 { return s.Duplicates }},
	{"gaps_total", "Sequence gaps in the engine's stream.", func(s *StreamStats) uint64 { return s.Gaps }},
	{"replays_total", "Replay requests made to the engine.", func(s *StreamStats) uint64 { return s.Replays }},
	{"replayed_batches_total", "Batches applied from replays.", func(s *StreamStats) uint64 { return s.ReplayedBatches }},
	{"replay_failures_total", "Replay requests that failed.", func(s *StreamStats) uint64 { return s.ReplayFailures }},
	{"replay_mismatches_total", "Replays that did not start at the batch asked for.", func(s *StreamStats) uint64 { return s.ReplayMismatches }},
	{"engine_restarts_total", "Sequence numbers that went backwards (engine restarts).", func(s *StreamStats) uint64 { return s.Restarts }},
	{"resyncs_total", "Times the rank's blocks were cleared and rebuilt from the engine's history.", func(s *StreamStats) uint64 { return s.Resyncs }},
	{"history_lost_total", "Resyncs that could not replay the engine's whole history.", func(s *StreamStats) uint64 { return s.HistoryLost }},
	{"reconnects_total", "Lost and remade SUB connections.", func(s *StreamStats) uint64 { return s.Reconnects }},
	{"dp_rank_mismatches_total", "Batches naming another data-parallel rank than their endpoint's.", func(s *StreamStats) uint64 { return s.DPRankMismatches }},
	{"publish_rejected_total", "Converted events the publisher refused (a bug: full state republished).", func(s *StreamStats) uint64 { return s.PublishRejected }},
	{"republished_total", "Full-state republications (resync requests, rejections).", func(s *StreamStats) uint64 { return s.Republished }},
	{"oversized_frames_total", "ZMQ connections dropped because a frame header declared more than the message cap.", func(s *StreamStats) uint64 { return s.OversizedFrames }},
	{"zmq_panics_total", "Panics recovered from the ZMQ library while dialling or receiving.", func(s *StreamStats) uint64 { return s.ZMQPanics }},
	{"published_total", "Router events handed to the publisher.", func(s *StreamStats) uint64 { return s.Published }},
	{"stored_blocks_total", "Blocks published as stored.", func(s *StreamStats) uint64 { return s.Converter.StoredBlocks }},
	{"removed_blocks_total", "Blocks published as removed.", func(s *StreamStats) uint64 { return s.Converter.RemovedBlocks }},
	{"clears_total", "Cleared events published.", func(s *StreamStats) uint64 { return s.Converter.Clears }},
	{"unknown_removals_total", "Removed hashes the bridge did not hold (ignored).", func(s *StreamStats) uint64 { return s.Converter.UnknownRemovals }},
	{"mapping_overflows_total", "Resets because the engine→content mapping outgrew its bound.", func(s *StreamStats) uint64 { return s.Converter.Overflows }},
}

const metricPrefix = "kvrouter_bridge_"

// Collector exposes the bridge's counters to Prometheus.
type Collector struct {
	b        *Bridge
	counters []*prometheus.Desc
	skipped  *prometheus.Desc
	blocks   *prometheus.Desc
	seq      *prometheus.Desc
	running  *prometheus.Desc
	reg      *prometheus.Desc
}

// Collector returns a prometheus.Collector of the bridge's metrics.
func (b *Bridge) Collector() *Collector {
	c := &Collector{b: b}
	labels := []string{"worker", "dp_rank"}
	for _, m := range counterMetrics {
		c.counters = append(c.counters, prometheus.NewDesc(metricPrefix+m.name, m.help, labels, nil))
	}
	c.skipped = prometheus.NewDesc(metricPrefix+"events_skipped_total",
		"Engine events not applied, by reason (block_size_mismatch means no block of the worker can match).",
		[]string{"worker", "dp_rank", "reason"}, nil)
	c.blocks = prometheus.NewDesc(metricPrefix+"blocks", "Engine blocks the bridge holds for the rank.", labels, nil)
	c.seq = prometheus.NewDesc(metricPrefix+"last_sequence", "Last engine sequence number applied.", labels, nil)
	c.running = prometheus.NewDesc(metricPrefix+"worker_running", "1 when the worker's streams are running.", []string{"worker", "state"}, nil)
	c.reg = prometheus.NewDesc(metricPrefix+"worker_registered", "1 when the last registration with the replicas succeeded.", []string{"worker"}, nil)
	return c
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.counters {
		ch <- d
	}
	ch <- c.skipped
	ch <- c.blocks
	ch <- c.seq
	ch <- c.running
	ch <- c.reg
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	for _, w := range c.b.Status() {
		running := 0.0
		if w.State == "running" {
			running = 1
		}
		ch <- prometheus.MustNewConstMetric(c.running, prometheus.GaugeValue, running, w.Spec.ID, w.State)
		reg := 0.0
		if w.Registered {
			reg = 1
		}
		ch <- prometheus.MustNewConstMetric(c.reg, prometheus.GaugeValue, reg, w.Spec.ID)
		for i := range w.Ranks {
			s := &w.Ranks[i]
			rk := strconv.FormatUint(uint64(s.DPRank), 10)
			for j, m := range counterMetrics {
				ch <- prometheus.MustNewConstMetric(c.counters[j], prometheus.CounterValue, float64(m.get(s)), s.Worker, rk)
			}
			for _, r := range AllSkipReasons {
				ch <- prometheus.MustNewConstMetric(c.skipped, prometheus.CounterValue, float64(s.Converter.Skipped[r]), s.Worker, rk, string(r))
			}
			ch <- prometheus.MustNewConstMetric(c.blocks, prometheus.GaugeValue, float64(s.Blocks), s.Worker, rk)
			ch <- prometheus.MustNewConstMetric(c.seq, prometheus.GaugeValue, float64(s.LastSeq), s.Worker, rk)
		}
	}
}
