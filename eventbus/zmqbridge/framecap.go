package zmqbridge

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// Why this file exists: zmq4 (v0.17) reads a frame header and then calls
// make([]byte, size) with whatever size the peer declared, in a goroutine
// of its own. One 10-byte header declaring 2^50 bytes panics there
// ("makeslice: len out of range") and a few GiB is a fatal out-of-memory;
// neither can be recovered, so one forged header on the event socket took
// the whole bridge down (and a replica running --bridge-config with it).
// zmq4 has no option to bound frames nor to supply our own net.Conn, but it
// dials through a registered transport: ours wraps the TCP connection in a
// reader that follows the ZMTP framing byte for byte and refuses a header
// over the cap before zmq4 has seen the header's last byte, so the library
// never gets a size to allocate.

// DefaultMaxMessageBytes is the default cap on one ZMQ message (all its
// frames). The engines' largest messages are KV event batches, one per
// scheduler step, whose stored blocks are bounded by the tokens scheduled
// in a step (vLLM's max_num_batched_tokens, a few thousand to tens of
// thousands). Even 128k tokens in one step, at block size 16, are ~8,000
// blocks of one hash and 16 token ids each: under 1 MiB of msgpack. 16 MiB
// leaves a wide margin while bounding what one forged header can make us
// allocate. (What a peer can keep allocated is this times the
// messages queued: zmq4's ~12 per connection plus the rank's QueueSize.)
const DefaultMaxMessageBytes = 16 << 20

// DefaultHandshakeTimeout bounds the ZMTP greeting and handshake: a peer
// that accepts the TCP connection and says nothing would otherwise keep
// zmq4's Dial (which has no deadline of its own) blocked forever.
const DefaultHandshakeTimeout = 10 * time.Second

// frameOverhead is what each frame is charged against the message cap on
// top of its bytes: zmq4 keeps a slice header per frame (and the allocator
// rounds small bodies up), so a stream of empty "more" frames would
// otherwise grow memory without ever reaching the cap in bytes.
const frameOverhead = 64

// ErrFrameTooLarge is returned by the guarded connection's Read when the
// peer declares a frame (or message) over the cap; the connection is
// closed.
var ErrFrameTooLarge = errors.New("zmq frame over the size cap")

// cappedScheme is the zmq4 transport name the bridge dials through; an
// endpoint tcp://host:port is dialled as cappedScheme://host:port.
const cappedScheme = "kvrouter-capped-tcp"

// The transport is registered once, when the package loads, because zmq4
// keeps its transports in a registry of its own and cannot unregister
// them. It holds no state: the cap, deadline and counters of each socket
// travel in the context the socket was made with (see withWireGuard), so
// bridges with different settings coexist in one process.
func init() {
	if err := zmq4.RegisterTransport(cappedScheme, cappedTransport{base: transport.New("tcp")}); err != nil {
		panic(fmt.Sprintf("zmqbridge: register the capped ZMQ transport: %v", err))
	}
}

// WireCounters count what the frame guard refused or caught; one set per
// stream (worker rank), shared by its SUB and replay sockets.
type WireCounters struct {
	Oversized atomic.Uint64 // connections dropped for a frame header over the cap
	Panics    atomic.Uint64 // panics recovered from zmq4 (dial, handshake or receive)
}

// wireGuard is one socket's settings, carried in its context.
type wireGuard struct {
	maxMessage       int64
	handshakeTimeout time.Duration
	counters         *WireCounters
}

type wireGuardKey struct{}

// withWireGuard returns ctx carrying g for the sockets made with it.
func withWireGuard(ctx context.Context, g *wireGuard) context.Context {
	return context.WithValue(ctx, wireGuardKey{}, g)
}

func guardOf(ctx context.Context) *wireGuard {
	if g, ok := ctx.Value(wireGuardKey{}).(*wireGuard); ok && g != nil {
		return g
	}
	return &wireGuard{}
}

// protect runs fn (a zmq4 call that reads from the peer) and turns a panic
// inside it into a counted *zmqPanic error. zmq4's handshake parses the
// peer's metadata with unchecked slicing (Property.Write reads
// data[n:n+4] past a short READY body), and that runs in our goroutine,
// inside Dial; Recv is guarded too, in case a future zmq4 parses there.
func (g *wireGuard) protect(what string, fn func() error) (err error) {
	defer func() {
		if p := recover(); p != nil {
			if g.counters != nil {
				g.counters.Panics.Add(1)
			}
			err = &zmqPanic{what: what, value: p, stack: debug.Stack()}
		}
	}()
	return fn()
}

// zmqPanic is a panic recovered inside zmq4; the stack is kept for a debug
// log (the place to report upstream), out of the error text.
type zmqPanic struct {
	what  string
	value any
	stack []byte
}

func (p *zmqPanic) Error() string { return fmt.Sprintf("%s: %v: %v", p.what, errZMQPanic, p.value) }
func (p *zmqPanic) Unwrap() error { return errZMQPanic }

// errZMQPanic marks an error made from a panic recovered inside zmq4.
var errZMQPanic = errors.New("zmq4 panicked")

// logGuardErr logs what the guard refused or caught, with zmq4's stack at
// debug level for a panic.
func logGuardErr(lg *slog.Logger, msg string, err error) {
	lg.Error(msg, "err", err)
	var p *zmqPanic
	if errors.As(err, &p) {
		lg.Debug("zmq4 panic stack", "stack", string(p.stack))
	}
}

// cappedEndpoint turns tcp://host:port into the capped transport's scheme;
// CheckEndpoint has already insisted on tcp.
func cappedEndpoint(endpoint string) string {
	if rest, ok := strings.CutPrefix(endpoint, "tcp://"); ok {
		return cappedScheme + "://" + rest
	}
	return endpoint
}

type cappedTransport struct{ base transport.Transport }

// Dial dials TCP and wraps the connection in the frame guard of the
// socket's context.
func (t cappedTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	conn, err := t.base.Dial(ctx, d, addr)
	if err != nil {
		return nil, err
	}
	return newCappedConn(ctx, conn, guardOf(ctx)), nil
}

// Listen is not guarded: the bridge only dials. Refusing keeps a future
// caller from believing a listener is capped.
func (t cappedTransport) Listen(context.Context, string) (net.Listener, error) {
	return nil, errors.New("zmqbridge: the capped transport only dials")
}

func (t cappedTransport) Addr(ep string) (string, error) { return t.base.Addr(ep) }

// cappedConn is a net.Conn whose reads pass through a ZMTP frame scanner.
type cappedConn struct {
	net.Conn
	g    *wireGuard
	stop func() bool // unhooks the close-on-cancel

	mu sync.Mutex // guards sc and handshook; zmq4 reads from one goroutine at a time, but the guard must not rely on it
	sc frameScanner
	// handshook is set once the peer's first whole message (its READY
	// command) arrived: the handshake deadline is then lifted.
	handshook bool
}

func newCappedConn(ctx context.Context, conn net.Conn, g *wireGuard) *cappedConn {
	limit := g.maxMessage
	if limit <= 0 {
		limit = DefaultMaxMessageBytes
	}
	c := &cappedConn{Conn: conn, g: g, sc: newFrameScanner(limit)}
	hs := g.handshakeTimeout
	if hs <= 0 {
		hs = DefaultHandshakeTimeout
	}
	_ = conn.SetReadDeadline(time.Now().Add(hs))
	// zmq4's Dial reads the handshake with no way to cancel it; closing the
	// connection when the socket's context ends unblocks it (and any read).
	c.stop = context.AfterFunc(ctx, func() { _ = conn.Close() })
	return c
}

func (c *cappedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.mu.Lock()
		serr := c.sc.scan(p[:n])
		lift := !c.handshook && c.sc.messages > 0
		if lift {
			c.handshook = true
		}
		c.mu.Unlock()
		if serr != nil {
			// Nothing of this read reaches zmq4: the header's last bytes are
			// in it, so the library never completes the header.
			if c.g.counters != nil {
				c.g.counters.Oversized.Add(1)
			}
			_ = c.Conn.Close()
			return 0, serr
		}
		if lift {
			_ = c.Conn.SetReadDeadline(time.Time{})
		}
	}
	return n, err
}

func (c *cappedConn) Close() error {
	c.stop()
	return c.Conn.Close()
}

// frameScanner follows the byte stream zmq4's Conn reads — a 64-byte
// greeting, then frames of [flags][size: 1 byte, or 8 if the long bit is
// set][body] — exactly as zmq4 cuts it (conn.go: greet, read), so the two
// can never disagree about where a header is. It is fed every byte read, in
// order, in chunks of any size.
type frameScanner struct {
	max int64 // cap on a message: its frames' bytes plus frameOverhead each

	state    scanState
	skip     uint64 // greeting or body bytes still to pass over
	flags    byte
	long     [8]byte
	longN    int
	msgBytes int64  // charged to the message being read
	messages uint64 // whole messages (commands included) seen
}

type scanState uint8

const (
	scanGreeting scanState = iota
	scanFlags
	scanShortSize
	scanLongSize
	scanBody
)

// ZMTP 3 (rfc.zeromq.org/spec/23): greeting length and frame flag bits.
const (
	zmtpGreetingLen = 64
	zmtpMore        = 0x01
	zmtpLong        = 0x02
)

func newFrameScanner(limit int64) frameScanner {
	return frameScanner{max: limit, state: scanGreeting, skip: zmtpGreetingLen}
}

// scan consumes p and returns ErrFrameTooLarge (wrapped) at the first
// header over the cap; the scanner is then spent.
func (s *frameScanner) scan(p []byte) error {
	for len(p) > 0 {
		switch s.state {
		case scanGreeting, scanBody:
			k := min(uint64(len(p)), s.skip)
			s.skip -= k
			p = p[k:]
			if s.skip == 0 {
				if s.state == scanBody {
					s.frameDone()
				} else {
					s.state = scanFlags
				}
			}
		case scanFlags:
			s.flags = p[0]
			p = p[1:]
			if s.flags&zmtpLong != 0 {
				s.state, s.longN = scanLongSize, 0
			} else {
				s.state = scanShortSize
			}
		case scanShortSize:
			size := uint64(p[0])
			p = p[1:]
			if err := s.header(size); err != nil {
				return err
			}
		case scanLongSize:
			k := copy(s.long[s.longN:], p)
			s.longN += k
			p = p[k:]
			if s.longN == len(s.long) {
				if err := s.header(binary.BigEndian.Uint64(s.long[:])); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// header checks a complete frame header's size against the cap.
func (s *frameScanner) header(size uint64) error {
	room := s.max - s.msgBytes - frameOverhead // negative: even an empty frame is over
	if room < 0 || size > uint64(room) {
		return fmt.Errorf("%w: a frame declares %d bytes, the message may hold %d more (cap %d)", ErrFrameTooLarge, size, room, s.max)
	}
	s.msgBytes += int64(size) + frameOverhead
	if size == 0 {
		s.frameDone()
		return nil
	}
	s.state, s.skip = scanBody, size
	return nil
}

func (s *frameScanner) frameDone() {
	s.state = scanFlags
	if s.flags&zmtpMore == 0 {
		s.msgBytes = 0
		s.messages++
	}
}
