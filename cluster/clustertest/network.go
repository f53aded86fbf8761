package clustertest

import (
	"context"
	"errors"
	"net"
	"sync"
)

// errCut is returned for dials across a cut link.
var errCut = errors.New("clustertest: link cut")

// Network controls links between members. Every outgoing connection of a
// member (Raft and HTTP) goes through its Dialer; cutting a link refuses new
// dials in both directions and closes the connections already open between
// the two members. Because each Raft RPC travels on a connection dialed by
// its sender, closing both members' dialed connections severs the link
// completely.
type Network struct {
	// mu guards the maps below: dials and closes run on every member's
	// goroutines while the test cuts and heals links.
	mu    sync.Mutex
	owner map[string]int                       // "host:port" → member index
	cut   map[[2]int]bool                      // directed
	conns map[[2]int]map[*trackedConn]struct{} // open connections from→to
}

func NewNetwork() *Network {
	return &Network{
		owner: map[string]int{},
		cut:   map[[2]int]bool{},
		conns: map[[2]int]map[*trackedConn]struct{}{},
	}
}

// Register tells the network that addr belongs to member i.
func (nw *Network) Register(addr string, i int) {
	nw.mu.Lock()
	defer nw.mu.Unlock()
	nw.owner[addr] = i
}

// Dialer returns member from's dial function (for cluster.Config.Dial).
func (nw *Network) Dialer(from int) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		nw.mu.Lock()
		to, known := nw.owner[addr]
		blocked := known && nw.cut[[2]int{from, to}]
		nw.mu.Unlock()
		if blocked {
			return nil, &net.OpError{Op: "dial", Net: network, Err: errCut}
		}
		var d net.Dialer
		c, err := d.DialContext(ctx, network, addr)
		if err != nil || !known {
			return c, err
		}
		key := [2]int{from, to}
		nw.mu.Lock()
		defer nw.mu.Unlock()
		if nw.cut[key] { // cut while dialing
			c.Close()
			return nil, &net.OpError{Op: "dial", Net: network, Err: errCut}
		}
		tc := &trackedConn{Conn: c, nw: nw, key: key}
		if nw.conns[key] == nil {
			nw.conns[key] = map[*trackedConn]struct{}{}
		}
		nw.conns[key][tc] = struct{}{}
		return tc, nil
	}
}

// SetLink cuts (up=false) or restores the link between a and b.
func (nw *Network) SetLink(a, b int, up bool) {
	nw.mu.Lock()
	var doomed []*trackedConn
	for _, k := range [][2]int{{a, b}, {b, a}} {
		if up {
			delete(nw.cut, k)
			continue
		}
		nw.cut[k] = true
		for c := range nw.conns[k] {
			doomed = append(doomed, c)
		}
	}
	nw.mu.Unlock()
	for _, c := range doomed {
		c.Close()
	}
}

// HealAll restores every link.
func (nw *Network) HealAll() {
	nw.mu.Lock()
	defer nw.mu.Unlock()
	clear(nw.cut)
}

type trackedConn struct {
	net.Conn
	nw   *Network
	key  [2]int
	once sync.Once
}

func (c *trackedConn) Close() error {
	c.once.Do(func() {
		c.nw.mu.Lock()
		delete(c.nw.conns[c.key], c)
		c.nw.mu.Unlock()
	})
	return c.Conn.Close()
}
