package zmqbridge

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math/rand/v2"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/go-zeromq/zmq4"
)

// The ZMQ side is deliberately thin: a SUB socket that hands every message
// to a channel and reconnects when its connection dies, and a DEALER that
// makes one replay request. Everything else is the Stream's.

// Message is one message of the SUB socket, or (Reconnected, no frames)
// the news that the connection was lost and made again, sent before any
// message of the new connection.
type Message struct {
	Frames      [][]byte
	Reconnected bool
}

// Subscriber follows an engine's PUB socket.
type Subscriber struct {
	Endpoint string // tcp://host:port of the engine's PUB socket
	Topic    string // subscription prefix ("" = everything)
	Logger   *slog.Logger
	// RetryMin and RetryMax bound the wait between connection attempts
	// (defaults 100ms and 5s).
	RetryMin, RetryMax time.Duration
	// MaxMessageBytes caps one message (DefaultMaxMessageBytes when 0): a
	// frame header declaring more drops the connection before zmq4
	// allocates anything.
	MaxMessageBytes int64
	// HandshakeTimeout bounds the ZMTP handshake (DefaultHandshakeTimeout).
	HandshakeTimeout time.Duration
	// Counters, when set, count oversized frames and recovered panics.
	Counters *WireCounters
}

// quietZMQ keeps zmq4's own logging (to stderr by default) out of the way.
var quietZMQ = log.New(io.Discard, "", 0)

// Run connects, receives and sends each message to out until ctx ends,
// reconnecting with backoff whenever the connection fails.
func (s *Subscriber) Run(ctx context.Context, out chan<- Message) {
	lg := s.Logger
	if lg == nil {
		lg = slog.Default()
	}
	lg = lg.With("endpoint", s.Endpoint)
	rmin, rmax := s.RetryMin, s.RetryMax
	if rmin <= 0 {
		rmin = 100 * time.Millisecond
	}
	if rmax < rmin {
		rmax = max(5*time.Second, rmin)
	}
	backoff := rmin
	connected, lost := false, false
	var lastWarn time.Time
	guard := &wireGuard{maxMessage: s.MaxMessageBytes, handshakeTimeout: s.HandshakeTimeout, counters: s.Counters}
	for ctx.Err() == nil {
		sctx, cancel := context.WithCancel(withWireGuard(ctx, guard))
		sub := zmq4.NewSub(sctx, zmq4.WithDialerMaxRetries(0), zmq4.WithLogger(quietZMQ))
		_ = sub.SetOption(zmq4.OptionSubscribe, s.Topic)
		if err := guard.protect("dial", func() error { return sub.Dial(cappedEndpoint(s.Endpoint)) }); err != nil {
			_ = sub.Close()
			cancel()
			switch {
			case ctx.Err() != nil:
				return
			case isGuardErr(err):
				logGuardErr(lg, "refused the engine's handshake; retrying", err)
			case time.Since(lastWarn) > 30*time.Second:
				lastWarn = time.Now()
				lg.Warn("cannot reach the engine's KV event socket; retrying", "err", err)
			}
			if !sleepCtx(ctx, backoff/2+rand.N(backoff/2+1)) {
				return
			}
			backoff = min(2*backoff, rmax)
			continue
		}
		if !connected {
			lg.Info("subscribed to the engine's KV events")
		} else {
			lg.Info("resubscribed to the engine's KV events")
		}
		if connected && lost {
			select {
			case out <- Message{Reconnected: true}:
			case <-ctx.Done():
			}
		}
		connected = true
		refused := false
		for {
			var msg zmq4.Msg
			err := guard.protect("receive", func() (err error) { msg, err = sub.Recv(); return err })
			if err != nil {
				switch {
				case ctx.Err() != nil:
				case isGuardErr(err):
					// The engine's socket (or whoever answers at its
					// address) sent what no engine sends: say so loudly,
					// and back off so a hostile peer cannot keep us in a
					// tight reconnect loop.
					logGuardErr(lg, "dropped the engine's connection: it broke the ZMQ frame limits; reconnecting", err)
					refused = true
				default:
					lg.Warn("lost the engine's KV event stream; reconnecting", "err", err)
				}
				lost = true
				break
			}
			select {
			case out <- Message{Frames: msg.Frames}:
			case <-ctx.Done():
			}
			if ctx.Err() != nil {
				break
			}
		}
		_ = sub.Close()
		cancel()
		if refused {
			if !sleepCtx(ctx, backoff/2+rand.N(backoff/2+1)) {
				return
			}
			backoff = min(2*backoff, rmax)
		} else {
			backoff = rmin
		}
	}
}

// isGuardErr says whether err is the frame guard's doing (an oversized
// frame or a panic recovered from zmq4) rather than a network failure.
func isGuardErr(err error) bool {
	return errors.Is(err, ErrFrameTooLarge) || errors.Is(err, errZMQPanic)
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// ZMQReplayer makes replay requests to an engine's ROUTER replay socket,
// one DEALER connection per request.
type ZMQReplayer struct {
	Endpoint string        // tcp://host:port of the replay socket
	Timeout  time.Duration // for the whole replay (default 30s)
	// MaxMessageBytes caps one reply (DefaultMaxMessageBytes when 0).
	MaxMessageBytes int64
	// Counters, when set, count oversized frames and recovered panics.
	Counters *WireCounters
}

// Replay implements Replayer: it sends ["", seq8] and reads replies until
// the end marker (an empty last frame).
func (z *ZMQReplayer) Replay(ctx context.Context, from uint64, fn func(Frame) error) error {
	timeout := z.Timeout
	if timeout <= 0 {
		timeout = 30 * time.Second
	}
	guard := &wireGuard{maxMessage: z.MaxMessageBytes, handshakeTimeout: min(timeout, DefaultHandshakeTimeout), counters: z.Counters}
	ctx, cancel := context.WithTimeout(withWireGuard(ctx, guard), timeout)
	defer cancel()
	d := zmq4.NewDealer(ctx, zmq4.WithDialerMaxRetries(2), zmq4.WithDialerRetry(100*time.Millisecond),
		zmq4.WithDialerTimeout(5*time.Second), zmq4.WithTimeout(timeout), zmq4.WithLogger(quietZMQ))
	defer d.Close()
	if err := guard.protect("dial", func() error { return d.Dial(cappedEndpoint(z.Endpoint)) }); err != nil {
		return fmt.Errorf("replay from %d: %w", from, err)
	}
	var seq [8]byte
	binary.BigEndian.PutUint64(seq[:], from)
	if err := d.Send(zmq4.NewMsgFrom([]byte{}, seq[:])); err != nil {
		return fmt.Errorf("replay from %d: send: %w", from, err)
	}
	for {
		var msg zmq4.Msg
		err := guard.protect("receive", func() (err error) { msg, err = d.Recv(); return err })
		if err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("replay from %d: %w", from, ctx.Err())
			}
			return fmt.Errorf("replay from %d: %w", from, err)
		}
		f, end, err := ParseReplay(msg.Frames)
		if err != nil {
			return fmt.Errorf("replay from %d: %w", from, err)
		}
		if end {
			return nil
		}
		if err := fn(f); err != nil {
			return err
		}
	}
}

// OffsetEndpoint is the endpoint of data-parallel rank r: the engines bind
// rank r's sockets at the configured port plus r.
func OffsetEndpoint(endpoint string, r int) (string, error) {
	if endpoint == "" {
		return "", nil
	}
	if err := CheckEndpoint(endpoint); err != nil {
		return "", err
	}
	if r == 0 {
		return endpoint, nil
	}
	i := strings.LastIndexByte(endpoint, ':')
	port, _ := strconv.Atoi(endpoint[i+1:])
	return endpoint[:i+1] + strconv.Itoa(port+r), nil
}

// CheckEndpoint accepts tcp://host:port with a concrete host (the engine
// binds tcp://*:port; the bridge must connect to the engine's address).
func CheckEndpoint(endpoint string) error {
	u, err := url.Parse(endpoint)
	if err != nil || u.Scheme != "tcp" || u.Host == "" || u.Path != "" {
		return fmt.Errorf("endpoint %q: want tcp://host:port", endpoint)
	}
	host, port := u.Hostname(), u.Port()
	if host == "" || host == "*" || port == "" {
		return fmt.Errorf("endpoint %q: want tcp://host:port with the engine's host (the engine binds tcp://*:port; connect to its address)", endpoint)
	}
	if p, err := strconv.Atoi(port); err != nil || p <= 0 || p > 65535 {
		return fmt.Errorf("endpoint %q: bad port", endpoint)
	}
	return nil
}
