//go:build chaos

package chaos

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"
)

type network struct {
	log         func(format string, args ...any)
	created     map[int]bool
	forwardRule []string // root FORWARD rule we added, to delete
}

func run(ctx context.Context, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if err != nil {
		return out.String(), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return out.String(), nil
}

func newNetwork(log func(string, ...any)) *network {
	return &network{log: log, created: map[int]bool{}}
}

// cleanupLeftovers removes namespaces and the bridge of an earlier run that
// did not clean up (killed harness).
func cleanupLeftovers(ctx context.Context) {
	for i := 1; i <= maxNodes; i++ {
		_, _ = run(ctx, "ip", "netns", "del", nsName(i))
		_, _ = run(ctx, "ip", "link", "del", vethHost(i))
	}
	_, _ = run(ctx, "ip", "link", "del", bridgeName)
}

func (n *network) setup(ctx context.Context, nodes int) error {
	cleanupLeftovers(ctx)
	steps := [][]string{
		{"ip", "link", "add", bridgeName, "type", "bridge"},
		{"ip", "addr", "add", hostIP + "/24", "dev", bridgeName},
		{"ip", "link", "set", bridgeName, "up"},
	}
	for _, s := range steps {
		if _, err := run(ctx, s[0], s[1:]...); err != nil {
			return err
		}
	}
	for i := 1; i <= nodes; i++ {
		if err := n.addNode(ctx, i); err != nil {
			return err
		}
	}
	return n.allowForward(ctx)
}

func (n *network) addNode(ctx context.Context, i int) error {
	if n.created[i] {
		return nil
	}
	ns := nsName(i)
	steps := [][]string{
		{"ip", "netns", "add", ns},
		{"ip", "link", "add", vethHost(i), "type", "veth", "peer", "name", vethNS(i)},
		{"ip", "link", "set", vethNS(i), "netns", ns},
		{"ip", "link", "set", vethHost(i), "master", bridgeName},
		{"ip", "link", "set", vethHost(i), "up"},
		{"ip", "-n", ns, "addr", "add", nodeIP(i) + "/24", "dev", vethNS(i)},
		{"ip", "-n", ns, "link", "set", vethNS(i), "up"},
		{"ip", "-n", ns, "link", "set", "lo", "up"},
	}
	n.created[i] = true
	for _, s := range steps {
		if _, err := run(ctx, s[0], s[1:]...); err != nil {
			return err
		}
	}
	return nil
}

// allowForward makes sure bridged traffic between the namespaces is not
// dropped by the host's FORWARD chain (br_netfilter passes bridged frames
// through it).
func (n *network) allowForward(ctx context.Context) error {
	data, err := os.ReadFile("/proc/sys/net/bridge/bridge-nf-call-iptables")
	if err != nil || strings.TrimSpace(string(data)) != "1" {
		return nil
	}
	if _, err := exec.LookPath("iptables"); err != nil {
		return nil // no iptables in the root namespace: nothing filters
	}
	rule := []string{"FORWARD", "-i", bridgeName, "-o", bridgeName, "-j", "ACCEPT"}
	if _, err := run(ctx, "iptables", append([]string{"-C"}, rule...)...); err == nil {
		return nil
	}
	if _, err := run(ctx, "iptables", append([]string{"-I"}, rule...)...); err != nil {
		return err
	}
	n.forwardRule = rule
	return nil
}

// teardown deletes what setup created; it never fails (best effort, logged).
func (n *network) teardown(ctx context.Context) {
	if n.forwardRule != nil {
		if _, err := run(ctx, "iptables", append([]string{"-D"}, n.forwardRule...)...); err != nil {
			n.log("network teardown: %v", err)
		}
		n.forwardRule = nil
	}
	for i := range n.created {
		if _, err := run(ctx, "ip", "netns", "del", nsName(i)); err != nil {
			n.log("network teardown: %v", err)
		}
		_, _ = run(ctx, "ip", "link", "del", vethHost(i))
	}
	n.created = map[int]bool{}
	if _, err := run(ctx, "ip", "link", "del", bridgeName); err != nil {
		n.log("network teardown: %v", err)
	}
}

// ipt runs iptables inside node i's namespace.
func ipt(ctx context.Context, i int, args ...string) error {
	_, err := run(ctx, "ip", append([]string{"netns", "exec", nsName(i), "iptables", "-w"}, args...)...)
	return err
}

// isolate drops all traffic between node i and the other nodes (Raft, NATS
// routes, forwarding), in both directions. The root namespace (workers,
// HAProxy, the harness) still reaches it: the partition is between the
// replicas, as when a replica's peer links fail.
func isolate(ctx context.Context, i int, others []int) error {
	for _, o := range others {
		if err := ipt(ctx, i, "-A", "INPUT", "-s", nodeIP(o), "-j", "DROP"); err != nil {
			return err
		}
		if err := ipt(ctx, i, "-A", "OUTPUT", "-d", nodeIP(o), "-j", "DROP"); err != nil {
			return err
		}
	}
	return nil
}

// cutPort drops TCP traffic of node i to and from the other nodes on port
// (both as server and client), e.g. the NATS route port.
func cutPort(ctx context.Context, i int, others []int, port int) error {
	p := fmt.Sprint(port)
	for _, o := range others {
		rules := [][]string{
			{"-A", "INPUT", "-s", nodeIP(o), "-p", "tcp", "--dport", p, "-j", "DROP"},
			{"-A", "INPUT", "-s", nodeIP(o), "-p", "tcp", "--sport", p, "-j", "DROP"},
			{"-A", "OUTPUT", "-d", nodeIP(o), "-p", "tcp", "--dport", p, "-j", "DROP"},
			{"-A", "OUTPUT", "-d", nodeIP(o), "-p", "tcp", "--sport", p, "-j", "DROP"},
		}
		for _, r := range rules {
			if err := ipt(ctx, i, r...); err != nil {
				return err
			}
		}
	}
	return nil
}

// heal removes every rule from node i's namespace.
func heal(ctx context.Context, i int) error {
	if err := ipt(ctx, i, "-F", "INPUT"); err != nil {
		return err
	}
	return ipt(ctx, i, "-F", "OUTPUT")
}
