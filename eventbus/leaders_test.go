package eventbus

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
)

func TestBusSpreadPlan(t *testing.T) {
	three := []string{"r1", "r2", "r3"}
	cases := []struct {
		name               string
		self               string
		l                  Leaders
		streamTo, consumer string
	}{
		{"all on self: one to each other server", "r1", Leaders{Stream: "r1", Consumer: "r1", Servers: three}, "r2", "r3"},
		{"stream on self, consumer elsewhere: stream to the free one", "r1", Leaders{Stream: "r1", Consumer: "r2", Servers: three}, "r3", ""},
		{"consumer on self, stream elsewhere: consumer to the free one", "r1", Leaders{Stream: "r3", Consumer: "r1", Servers: three}, "", "r2"},
		{"already spread: nothing", "r1", Leaders{Stream: "r2", Consumer: "r3", Servers: three}, "", ""},
		{"both on one other server: consumer to the third", "r1", Leaders{Stream: "r2", Consumer: "r2", Servers: three}, "", "r3"},
		{"two servers, all on self: both to the other", "r1", Leaders{Stream: "r1", Consumer: "r1", Servers: []string{"r1", "r2"}}, "r2", "r2"},
		{"two servers, both on the other: nothing", "r1", Leaders{Stream: "r2", Consumer: "r2", Servers: []string{"r1", "r2"}}, "", ""},
		{"single server: nowhere to go", "r1", Leaders{Stream: "r1", Consumer: "r1", Servers: []string{"r1"}}, "", ""},
		{"no self name: nothing", "", Leaders{Stream: "r1", Consumer: "r1", Servers: three}, "", ""},
		{"no leader known: only the self rule applies", "r1", Leaders{Servers: three}, "", ""},
		{"self not among the stream's servers, leaders apart", "r4", Leaders{Stream: "r1", Consumer: "r2", Servers: three}, "", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, c := spreadPlan(tc.self, tc.l)
			if s != tc.streamTo || c != tc.consumer {
				t.Fatalf("spreadPlan(%q, %+v) = (%q, %q), want (%q, %q)", tc.self, tc.l, s, c, tc.streamTo, tc.consumer)
			}
			for _, to := range []string{s, c} {
				if to == tc.self && to != "" {
					t.Fatalf("proposed self %q", to)
				}
			}
		})
	}
}

// The replica leading the Raft group holds both NATS leaderships; its
// consumer moves them to the two other servers, one each, and every event
// published is still applied exactly as without the move.
func TestBusSpreadLeadersCluster3(t *testing.T) {
	servers := startCluster(t, 3)
	log := testLogger(t)
	_, js0 := connect(t, servers[0].ClientURL(), "setup", log)
	ensureStream(t, js0, 3)
	var leader *Server
	poll.Until(t, 15*time.Second, 20*time.Millisecond, func() error {
		st, err := js0.Stream(context.Background(), StreamName)
		if err != nil {
			return err
		}
		if ci := st.CachedInfo().Cluster; ci != nil {
			for _, s := range servers {
				if s.Name() == ci.Leader {
					leader = s
					return nil
				}
			}
		}
		return errors.New("no stream leader yet")
	})
	nc, js := connect(t, leader.ClientURL(), "raft-leader", log)
	// Without SpreadFrom the consumer leaves the leaders alone; put the
	// consumer's leadership on the stream leader's server too.
	still, err := NewConsumer(context.Background(), js, ConsumerConfig{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 15*time.Second, 100*time.Millisecond, func() error {
		l, err := still.leaders(context.Background())
		if err != nil {
			return err
		}
		if l.Consumer == leader.Name() {
			return nil
		}
		if l.Consumer != "" {
			if err := still.stepDown(context.Background(), "$JS.API.CONSUMER.LEADER.STEPDOWN."+StreamName+"."+DefaultDurable, leader.Name()); err != nil {
				return err
			}
		}
		return fmt.Errorf("consumer leader %q, want %q", l.Consumer, leader.Name())
	})

	c, err := NewConsumer(context.Background(), js, ConsumerConfig{Logger: log, SpreadFrom: leader.Name(), SpreadEvery: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	a := newFakeApplier()
	runConsumer(t, c, a)
	poll.Until(t, 20*time.Second, 50*time.Millisecond, func() error {
		l, err := c.leaders(context.Background())
		if err != nil {
			return err
		}
		if l.Stream == "" || l.Consumer == "" || l.Stream == leader.Name() || l.Consumer == leader.Name() || l.Stream == l.Consumer {
			return fmt.Errorf("leaders %+v, self %s", l, leader.Name())
		}
		return nil
	})
	ids := publishN(t, nc, []string{"w1", "w2"}, 100)
	waitApplied(t, a, len(ids))
	waitStreamEmpty(t, js)
	a.check(t, ids, true) // the moves may have cost acks: redelivered, skipped
}
