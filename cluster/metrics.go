package cluster

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are per node; nothing is registered globally.
type metrics struct {
	reg           prometheus.Registerer
	collectors    []prometheus.Collector
	applySeconds  prometheus.Histogram
	snapshots     *prometheus.CounterVec
	leaderChanges prometheus.Counter
}

// newMetrics builds the collectors; the gauges read n.raft and n.sm at
// scrape time, so register only once n.raft is set.
//
// With Config.Group set every collector carries the constant label
// group=<Group>: the nodes of several groups then register on one registry
// (same names, distinct label values), and dashboards split by group.
// Without it the label is absent, so a single-group process exports exactly
// what it always did.
func newMetrics(n *Node) *metrics {
	m := &metrics{}
	labels := func(extra prometheus.Labels) prometheus.Labels {
		if n.cfg.Group == "" {
			return extra // nil for most: no constant labels, as before groups
		}
		l := prometheus.Labels{"group": n.cfg.Group}
		for k, v := range extra {
			l[k] = v
		}
		return l
	}
	m.applySeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:        "kvrouter_raft_apply_seconds",
		Help:        "Time from raft.Apply on the leader to the entry being committed and applied locally.",
		Buckets:     prometheus.ExponentialBuckets(0.0005, 2, 16), // 0.5 ms .. ~16 s
		ConstLabels: labels(nil),
	})
	m.snapshots = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name:        "kvrouter_raft_snapshots_total",
		Help:        "FSM snapshots persisted by this node (op=persisted) and restored into its FSM (op=restored: on start or by install from the leader).",
		ConstLabels: labels(nil),
	}, []string{"op"})
	m.snapshots.WithLabelValues("persisted")
	m.snapshots.WithLabelValues("restored")
	m.leaderChanges = prometheus.NewCounter(prometheus.CounterOpts{
		Name:        "kvrouter_raft_leader_changes_total",
		Help:        "Times this node observed a new leader.",
		ConstLabels: labels(nil),
	})
	gauge := func(name, help string, f func() float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels(nil)}, f)
	}
	counter := func(name, help string, f func() float64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels(nil)}, f)
	}
	refusals := func(port string, v *atomic.Uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "kvrouter_cluster_peer_refusals_total",
			Help:        "Connections (port=raft: TLS handshakes, or shed when too many were pending) and /cluster/ requests (port=http) refused for want of a member node's certificate.",
			ConstLabels: labels(prometheus.Labels{"port": port}),
		}, func() float64 { return float64(v.Load()) })
	}
	m.collectors = []prometheus.Collector{
		m.applySeconds, m.snapshots, m.leaderChanges,
		gauge("kvrouter_raft_state", "Raft state: 0 follower, 1 candidate, 2 leader, 3 shutdown.",
			func() float64 { return float64(n.raft.State()) }),
		gauge("kvrouter_raft_term", "Current Raft term.",
			func() float64 { return float64(n.raft.CurrentTerm()) }),
		gauge("kvrouter_raft_applied_index", "Index of the last command the state machine applied.",
			func() float64 { return float64(n.sm.AppliedIndex()) }),
		gauge("kvrouter_raft_commit_index", "Raft commit index known to this node.",
			func() float64 { return float64(n.raft.CommitIndex()) }),
		gauge("kvrouter_fsm_halted", "1 while the state machine is halted on a log entry it cannot apply (a command type this build does not know): the replica serves nothing until upgraded.",
			func() float64 {
				if n.sm.Halted() != nil {
					return 1
				}
				return 0
			}),
		refusals("raft", &n.refusedRaft),
		refusals("http", &n.refusedHTTP),
		counter("kvrouter_fsm_unknown_types_total", "Log entries of a command type or envelope version this build does not know, without the ignore bit (each halts the state machine).",
			func() float64 { u, _, _ := n.sm.Refused(); return float64(u) }),
		counter("kvrouter_fsm_undecodable_total", "Log entries that did not decode (a proposer bug or corruption; skipped on every replica alike).",
			func() float64 { _, u, _ := n.sm.Refused(); return float64(u) }),
		counter("kvrouter_fsm_domain_errors_total", "Commands refused by the state machine with a domain error (unknown worker, invalid config…; state unchanged on every replica).",
			func() float64 { _, _, d := n.sm.Refused(); return float64(d) }),
	}
	return m
}

func (m *metrics) register(reg prometheus.Registerer) error {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	m.reg = reg
	for i, c := range m.collectors {
		if err := reg.Register(c); err != nil {
			for _, done := range m.collectors[:i] {
				reg.Unregister(done)
			}
			var are prometheus.AlreadyRegisteredError
			if errors.As(err, &are) {
				return errors.New("register metrics: already registered (one node per registry and Config.Group, or Shutdown the previous node first)")
			}
			// The registry fixes each metric name's label names for good
			// (even across Unregister): a node with Group "" and one with
			// a Group cannot share it.
			return fmt.Errorf("register metrics (on a registry shared by several groups every node needs a Config.Group): %w", err)
		}
	}
	return nil
}

func (m *metrics) unregister() {
	for _, c := range m.collectors {
		m.reg.Unregister(c)
	}
}
