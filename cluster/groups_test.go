package cluster_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/cluster/clustertest"
	"github.com/kvrouter/kvrouter/internal/pki"
)

// groupFollower is a running member whose group-g node is not leading, so
// an Apply through it is forwarded (nil when every running node leads —
// never with three members).
func groupFollower(c *clustertest.Cluster, g int) *cluster.Node {
	for _, m := range c.Running() {
		if n := m.GroupNode(g); n != nil && !n.IsLeader() {
			return n
		}
	}
	return nil
}

// TestClusterGroupsTwoPerReplica runs three replicas of two Raft groups
// each, as a sharded replica does: per replica both nodes share one HTTP
// server (prefixes /cluster and /cluster/g1) and one registry. Writes
// proposed on a follower reach their own group's leader, a fourth replica
// joins both groups (through a follower, so the join is forwarded), and
// stopping a replica unregisters both groups' metrics.
func TestClusterGroupsTwoPerReplica(t *testing.T) {
	c := clustertest.New(t, 3, clustertest.Options{Groups: 2})

	// Different write counts per group: a write forwarded to the wrong
	// group's endpoint would show in the other group's count.
	writes := []int{3, 5}
	for g, n := range writes {
		c.WaitGroupLeader(g)
		for i := range n {
			cmd := []byte(fmt.Sprintf("g%d-%d", g, i))
			res, err := c.ApplyVia(func() *cluster.Node { return groupFollower(c, g) }, cmd)
			if err != nil {
				t.Fatalf("group %d: apply %s through a follower: %v", g, cmd, err)
			}
			if res != uint64(i+1) {
				t.Fatalf("group %d: apply %s: response %v, want %d", g, cmd, res, i+1)
			}
		}
	}
	for g, n := range writes {
		if d := c.WaitGroupConverged(g); !strings.HasSuffix(d, fmt.Sprintf("/%d", n)) {
			t.Errorf("group %d digest %s, want %d commands", g, d, n)
		}
	}

	for _, m := range c.Running() {
		if got := groupsOf(t, m.Registry(), "kvrouter_raft_state"); !slices.Equal(got, []string{"0", "1"}) {
			t.Errorf("%s: kvrouter_raft_state for groups %q, want [0 1]", m.ID, got)
		}
	}

	// The fourth replica joins both groups through a follower of group 1.
	via := -1
	for _, m := range c.Running() {
		if !m.GroupNode(1).IsLeader() {
			via = m.Index
		}
	}
	m4 := c.AddNodeVia(via)
	for g, n := range writes {
		l := c.WaitGroupLeader(g)
		if got := voters(t, l.GroupNode(g)); len(got) != 4 || !slices.Contains(got, m4.ID+"@"+m4.GroupRaftAddr(g)+"/voter") {
			t.Errorf("group %d configuration %v, want 4 voters with %s at %s", g, got, m4.ID, m4.GroupRaftAddr(g))
		}
		if d := c.WaitGroupConverged(g); !strings.HasSuffix(d, fmt.Sprintf("/%d", n)) {
			t.Errorf("group %d digest %s after the join, want %d commands", g, d, n)
		}
	}

	reg := m4.Registry()
	if got := groupsOf(t, reg, "kvrouter_raft_applied_index"); !slices.Equal(got, []string{"0", "1"}) {
		t.Fatalf("%s: kvrouter_raft_applied_index for groups %q, want [0 1]", m4.ID, got)
	}
	c.Stop(m4.Index)
	if left := kvrouterFamilies(t, reg); len(left) != 0 {
		t.Errorf("after Stop %s's registry still has %v", m4.ID, left)
	}
}

// groupsOf lists the group label of every series of metric name ("" for
// a series without one), sorted.
func groupsOf(t *testing.T, g prometheus.Gatherer, name string) []string {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	var out []string
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			out = append(out, labelOf(m, "group"))
		}
	}
	slices.Sort(out)
	return out
}

func labelOf(m *dto.Metric, name string) string {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == name {
			return lp.GetValue()
		}
	}
	return ""
}

// kvrouterFamilies names the kvrouter_ metric families g gathers.
func kvrouterFamilies(t *testing.T, g prometheus.Gatherer) []string {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	var out []string
	for _, mf := range mfs {
		if strings.HasPrefix(mf.GetName(), "kvrouter_") {
			out = append(out, mf.GetName())
		}
	}
	return out
}

// todayLabels are the label names of a node's metrics without a Group,
// as dashboards know them; Group must leave them exactly so.
var todayLabels = map[string][]string{
	"kvrouter_raft_apply_seconds":          nil,
	"kvrouter_raft_snapshots_total":        {"op"},
	"kvrouter_raft_leader_changes_total":   nil,
	"kvrouter_raft_state":                  nil,
	"kvrouter_raft_term":                   nil,
	"kvrouter_raft_applied_index":          nil,
	"kvrouter_raft_commit_index":           nil,
	"kvrouter_fsm_halted":                  nil,
	"kvrouter_cluster_peer_refusals_total": {"port"},
	"kvrouter_fsm_unknown_types_total":     nil,
	"kvrouter_fsm_undecodable_total":       nil,
	"kvrouter_fsm_domain_errors_total":     nil,
}

// soloNode opens (not forms) a one-node cluster member on a free port.
func soloNode(t *testing.T, group string, reg prometheus.Registerer) (*cluster.Node, error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	n, err := cluster.New(cluster.Config{
		NodeID:   "solo",
		RaftAddr: addr,
		DataDir:  t.TempDir(),
		Group:    group,
		Registry: reg,
		Logger:   clustertest.NewTestLogger(t),
	}, clustertest.NewFSM())
	if err == nil {
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = n.Shutdown(ctx) // again after the test's own: a no-op
		})
	}
	return n, err
}

// TestClusterGroupsMetrics: with Group set every metric carries
// group=<Group>, so the nodes of several groups register on one registry;
// without it the metrics are exactly as before groups. A registry fixes a
// metric's label names for good, so a node without Group and one with a
// Group cannot share one (the second New says so); on separate registries
// they gather together. Shutdown unregisters every metric.
func TestClusterGroupsMetrics(t *testing.T) {
	for _, tc := range []struct {
		name    string
		groups  [2]string
		shared  bool   // one registry for both nodes
		wantErr string // the second New's error; "" when it succeeds
	}{
		{"labelled groups share a registry", [2]string{"0", "1"}, true, ""},
		{"unlabelled and labelled on two registries", [2]string{"", "1"}, false, ""},
		{"unlabelled and labelled cannot share one", [2]string{"", "1"}, true, "Config.Group"},
		{"labelled and unlabelled cannot share one", [2]string{"1", ""}, true, "Config.Group"},
		{"one group twice", [2]string{"1", "1"}, true, "already registered"},
		{"no group twice", [2]string{"", ""}, true, "already registered"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			regs := []*prometheus.Registry{prometheus.NewRegistry(), prometheus.NewRegistry()}
			if tc.shared {
				regs[1] = regs[0]
			}
			a, err := soloNode(t, tc.groups[0], regs[0])
			if err != nil {
				t.Fatalf("first node: %v", err)
			}
			b, err := soloNode(t, tc.groups[1], regs[1])
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("second node: error %v, want one mentioning %q", err, tc.wantErr)
				}
				b = nil
			} else if err != nil {
				t.Fatalf("second node: %v", err)
			}

			var all prometheus.Gatherers
			for i, reg := range regs {
				if i == 0 || !tc.shared {
					all = append(all, reg)
				}
			}
			mfs, err := all.Gather()
			if err != nil {
				t.Fatalf("gather: %v", err)
			}
			want := []string{tc.groups[0]}
			if b != nil {
				want = append(want, tc.groups[1])
				slices.Sort(want)
			}
			seen := 0
			for _, mf := range mfs {
				base, ok := todayLabels[mf.GetName()]
				if !ok {
					if strings.HasPrefix(mf.GetName(), "kvrouter_") {
						t.Errorf("unexpected metric %s", mf.GetName())
					}
					continue
				}
				seen++
				var groups []string
				for _, m := range mf.GetMetric() {
					g := labelOf(m, "group")
					wantNames := slices.Clone(base)
					if g != "" {
						wantNames = append(wantNames, "group")
					}
					var names []string
					for _, lp := range m.GetLabel() {
						names = append(names, lp.GetName())
					}
					slices.Sort(names)
					slices.Sort(wantNames)
					if !slices.Equal(names, wantNames) {
						t.Errorf("%s{group=%q}: labels %v, want %v", mf.GetName(), g, names, wantNames)
					}
					if !slices.Contains(groups, g) {
						groups = append(groups, g)
					}
				}
				slices.Sort(groups)
				if !slices.Equal(groups, want) {
					t.Errorf("%s: groups %q, want %q", mf.GetName(), groups, want)
				}
			}
			if seen != len(todayLabels) {
				t.Errorf("gathered %d of the %d metric families", seen, len(todayLabels))
			}

			for _, n := range []*cluster.Node{a, b} {
				if n != nil {
					if err := n.Shutdown(ctxT(t, 5*time.Second)); err != nil {
						t.Errorf("shutdown group %q: %v", n.Group(), err)
					}
				}
			}
			if left := kvrouterFamilies(t, all); len(left) != 0 {
				t.Errorf("after Shutdown: %v still registered", left)
			}
		})
	}
}

// TestClusterGroupsEndpoints: each group answers under its own prefix on
// the shared HTTP server, and with TLS the join exception (a non-member
// may call join for itself) follows the prefix while the other endpoints
// still want a member.
func TestClusterGroupsEndpoints(t *testing.T) {
	c := clustertest.New(t, 1, clustertest.Options{TLS: true, Groups: 2})
	m := c.M(0)
	for g := range 2 {
		c.WaitGroupLeader(g)
	}
	member := c.HTTPClient(m.Bundle())
	stranger := c.HTTPClient(c.Issue(pki.Node("n9")))
	worker := c.HTTPClient(c.Issue(pki.Worker("n9")))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	nobody := ln.Addr().String() // where no Raft answers
	ln.Close()
	join := `{"node_id":"n9","raft_addr":"` + nobody + `"}`

	for _, p := range []struct {
		name   string
		client *http.Client
		path   string
		body   string
		status int
		code   string
	}{
		{"g1 join, non-member for itself: past the certificate check", stranger, "/cluster/g1/join", join, 400, "unverified_peer"},
		{"g0 join, non-member for itself: past the certificate check", stranger, "/cluster/join", join, 400, "unverified_peer"},
		{"g1 join, worker", worker, "/cluster/g1/join", join, 403, "forbidden"},
		{"g1 apply, non-member", stranger, "/cluster/g1/apply", "x", 403, "forbidden"},
		{"g1 remove, non-member", stranger, "/cluster/g1/remove", `{"node_id":"n0"}`, 403, "forbidden"},
		{"g1 apply, member", member, "/cluster/g1/apply", "g1-write", 200, ""},
		{"g2 apply: no such group", member, "/cluster/g2/apply", "x", 404, ""},
	} {
		status, out := postJSON(t, p.client, m.HTTPURL()+p.path, []byte(p.body), nil)
		if status != p.status || (p.code != "" && out["code"] != p.code) {
			t.Errorf("%s: HTTP %d %v, want %d %s", p.name, status, out, p.status, p.code)
		}
	}
	if got := m.GroupFSM(1).(*clustertest.FSM).Count(); got != 1 {
		t.Errorf("group 1 applied %d commands, want 1", got)
	}
	if got := m.GroupFSM(0).(*clustertest.FSM).Count(); got != 0 {
		t.Errorf("group 0 applied %d commands, want 0", got)
	}

	// Each prefix's status is its own group's node.
	for g, path := range []string{"/cluster/status", "/cluster/g1/status"} {
		resp, err := member.Get(m.HTTPURL() + path)
		if err != nil {
			t.Fatal(err)
		}
		var st cluster.Status
		err = json.NewDecoder(resp.Body).Decode(&st)
		resp.Body.Close()
		if err != nil || st.RaftAddr != m.GroupRaftAddr(g) {
			t.Errorf("GET %s: raft_addr %q (%v), want group %d's %s", path, st.RaftAddr, err, g, m.GroupRaftAddr(g))
		}
	}
}
