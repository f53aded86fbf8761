package cluster_test

import (
	"fmt"
	"strings"
	"testing"
	"time"


	"github.com/kvrouter/kvrouter/cluster/clustertest"
	"github.com/kvrouter/kvrouter/internal/poll"
)

// TestClusterTLSFormPeers: three members bootstrapped from the same peer
// set over mutual TLS elect a leader, replicate (also through a follower,
// whose forwarding presents its node certificate), and survive the
// leader's restart.
func TestClusterTLSFormPeers(t *testing.T) {
	c := clustertest.New(t, 3, clustertest.Options{TLS: true})
	l := c.WaitLeader()
	if !strings.HasPrefix(l.HTTPURL(), "https://") {
		t.Fatalf("TLS member serves %s", l.HTTPURL())
	}
	c.ApplyN("a", 10)
	f := followerOf(c, l)
	if _, err := c.ApplyVia(f.Node, []byte("via-follower")); err != nil {
		t.Fatalf("forwarded apply over TLS: %v", err)
	}
	c.WaitConverged()

	c.Restart(l.Index)
	c.WaitLeader()
	c.ApplyN("b", 10)
	c.WaitConverged()
	for _, m := range c.Running() {
		if ok, why := m.Node().Ready(); !ok {
			poll.Until(t, 10*time.Second, 20*time.Millisecond, func() error {
				if ok, why = m.Node().Ready(); !ok {
					return fmt.Errorf("%s not ready: %s", m.ID, why)
				}
				return nil
			})
		}
	}
}

// TestClusterTLSFormJoin: members 1 and 2 join member 0 over HTTPS; the
// join is checked (caller certificate, raft_addr answering as the node),
// and the joining node accepts the leader before it has a configuration.
// A wiped member rejoins the same way.
func TestClusterTLSFormJoin(t *testing.T) {
	c := clustertest.New(t, 3, clustertest.Options{TLS: true, Formation: clustertest.FormJoin})
	l := c.WaitLeader()
	if got := voters(t, l.Node()); len(got) != 3 {
		t.Fatalf("configuration %v", got)
	}
	c.ApplyN("a", 5)
	c.WaitConverged()
	c.Wipe(followerOf(c, l).Index)
	c.ApplyN("b", 5)
	c.WaitConverged()
}
