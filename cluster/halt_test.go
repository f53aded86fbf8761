package cluster_test

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/cluster/clustertest"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// newType is a command type the real FSM does not know. newerBuild stands
// in for a build that does: it applies such entries as RegisterWorkerRole.
const newType = 126

// newerBuild is the real FSM plus one command type (newType).
type newerBuild struct{ *fsm.FSM }

func (b *newerBuild) translate(l *raft.Log) *raft.Log {
	if l.Type != raft.LogCommand || len(l.Data) == 0 || l.Data[0] != newType {
		return l
	}
	c := *l // raft's log cache shares l.Data: never write into it
	c.Data = append([]byte{byte(fsm.CmdRegisterWorkerRole)}, l.Data[1:]...)
	return &c
}

func (b *newerBuild) Apply(l *raft.Log) any { return b.FSM.Apply(b.translate(l)) }

func (b *newerBuild) ApplyBatch(logs []*raft.Log) []any {
	out := make([]*raft.Log, len(logs))
	for i, l := range logs {
		out[i] = b.translate(l)
	}
	return b.FSM.ApplyBatch(out)
}

func realFSMOf(sm cluster.StateMachine) *fsm.FSM {
	if b, ok := sm.(*newerBuild); ok {
		return b.FSM
	}
	return sm.(*fsm.FSM)
}

// metricValue is the value of an unlabelled counter or gauge.
func metricValue(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mf, ok := gather(t, reg)[name]
	if !ok {
		t.Fatalf("metric %s missing", name)
	}
	if m := mf.GetMetric()[0]; m.GetCounter() != nil {
		return m.GetCounter().GetValue()
	}
	return mf.GetMetric()[0].GetGauge().GetValue()
}

// TestClusterHaltOnUnknownCommand: members 0 and 1 run a build that knows a
// command type member 2's build does not. An entry of that type commits:
// 0 and 1 apply it and go on; 2 halts at its index (state of the entry
// before, not ready with a reason naming type and index, metrics, status),
// refuses snapshots while the others compact their logs, and once
// restarted with the newer build replays its log and converges.
func TestClusterHaltOnUnknownCommand(t *testing.T) {
	var upgraded atomic.Bool
	opts := realFSMOptions(t)
	build := opts.NewFSM
	opts.NewFSM = func(i int) cluster.StateMachine {
		f := build(i).(*fsm.FSM)
		if i == 2 && !upgraded.Load() {
			return f // the previous build
		}
		return &newerBuild{FSM: f}
	}
	configure := opts.Configure
	opts.Configure = func(i int, c *cluster.Config, sm cluster.StateMachine) { configure(i, c, realFSMOf(sm)) }
	c := clustertest.New(t, 3, opts)
	c.WaitLeader()
	registerAll(t, c)
	// A ready leader: never the halted member (it is not ready, and hands
	// leadership away if it held it).
	leader := func() *cluster.Node { return c.WaitLeader().Node() }

	reg, err := fsm.EncodeRegisterWorker(fsm.RegisterWorker{ID: "w1", DPRanks: 1, Address: "http://w1", Model: "m", TotalBlocks: 1000})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.ApplyVia(leader, reg); err != nil {
		t.Fatal(err)
	}
	before := c.WaitConverged()
	old := c.M(2)
	oldFSM := realFSMOf(old.FSM())
	haltAt := oldFSM.AppliedIndex() + 1

	cmd, err := fsm.EncodeRegisterWorker(fsm.RegisterWorker{ID: "p1", DPRanks: 1, Address: "http://p1", Model: "m", Role: router.RolePrefill})
	if err != nil {
		t.Fatal(err)
	}
	cmd[0] = newType
	if _, err := c.ApplyVia(leader, cmd); err != nil {
		// Committed all the same when the old member led and halted on it.
		if !errors.Is(err, fsm.ErrUnknownCommand) {
			t.Fatalf("the newer build's command: %v", err)
		}
		t.Logf("the old member led: %v", err)
	}

	// The newer members applied it; the old one halted at it, loudly.
	poll.Until(t, 20*time.Second, 20*time.Millisecond, func() error {
		for _, i := range []int{0, 1} {
			if w, ok := realFSMOf(c.M(i).FSM()).Worker("p1"); !ok || w.Role != router.RolePrefill {
				return fmt.Errorf("n%d: worker p1 %+v %v", i, w, ok)
			}
		}
		return nil
	})
	poll.Until(t, 20*time.Second, 20*time.Millisecond, func() error {
		var he *fsm.HaltError
		if !errors.As(oldFSM.Halted(), &he) {
			return errors.New("old build not halted")
		}
		if he.Type != newType || he.Index < haltAt {
			t.Fatalf("halt %+v, want type %d at %d or later", he, newType, haltAt)
		}
		haltAt = he.Index
		return nil
	})
	ok, reason := old.Node().Ready()
	want := fmt.Sprintf("halted at log index %d: command type %d", haltAt, newType)
	if ok || !strings.Contains(reason, want) {
		t.Fatalf("old build ready=%v %q, want a reason naming %q", ok, reason, want)
	}
	if st := old.Node().Status(); !strings.Contains(st.Halted, want) || st.Ready {
		t.Fatalf("status halted %q ready %v", st.Halted, st.Ready)
	}
	if v := metricValue(t, old.Registry(), "kvrouter_fsm_halted"); v != 1 {
		t.Fatalf("kvrouter_fsm_halted %v", v)
	}
	if v := metricValue(t, old.Registry(), "kvrouter_fsm_unknown_types_total"); v != 1 {
		t.Fatalf("kvrouter_fsm_unknown_types_total %v", v)
	}
	if v := metricValue(t, c.M(0).Registry(), "kvrouter_fsm_unknown_types_total"); v != 0 {
		t.Fatalf("newer build counted an unknown type: %v", v)
	}

	// Writes go on (the halted member still replicates and votes); the
	// newer members snapshot and compact, the halted one keeps its log.
	var next uint64 = 1
	for i := range 100 {
		if _, err := c.ApplyVia(leader, kvBatch(t, "w1", next, 2, 1)); err != nil {
			t.Fatalf("batch %d: %v", i, err)
		}
		next += 2
	}
	c.WaitConverged(0, 1)
	// (raft flattens the FSM's error into its message.)
	if err := old.Node().Snapshot(); err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("snapshot of the halted member: %v", err)
	}
	if d := oldFSM.Digest(); d != before || oldFSM.AppliedIndex() != haltAt-1 {
		t.Fatalf("halted member moved: applied %d (halted at %d), digest %s, before %s", oldFSM.AppliedIndex(), haltAt, d, before)
	}
	if v := counterValue(t, c.M(0).Registry(), "kvrouter_raft_snapshots_total", "persisted"); v == 0 {
		t.Log("no snapshot persisted on n0 yet")
	}

	// Rolling upgrade of the old member: it replays the entries it kept.
	upgraded.Store(true)
	c.Restart(2)
	d := c.WaitConverged()
	if realFSMOf(c.M(2).FSM()).Halted() != nil {
		t.Fatal("upgraded member still halted")
	}
	if w, ok := realFSMOf(c.M(2).FSM()).Worker("p1"); !ok || w.Role != router.RolePrefill {
		t.Fatalf("upgraded member: worker p1 %+v %v", w, ok)
	}
	poll.Until(t, 20*time.Second, 20*time.Millisecond, func() error {
		if ok, reason := c.M(2).Node().Ready(); !ok {
			return errors.New(reason)
		}
		return nil
	})
	if _, err := c.ApplyVia(leader, kvBatch(t, "w1", next, 2, 1)); err != nil {
		t.Fatal(err)
	}
	if c.WaitConverged() == d {
		t.Fatal("the last batch changed nothing")
	}
}
