package eventbus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Spreading the ingest leaderships (issue 31 item 3). Three leaderships do
// the ingest work: the Raft group's (the consumer runs there: decode,
// propose, replicate to two followers, fsync, apply), the stream's NATS
// Raft group (every publish: quorum write, fsync, replication, the delete
// after each ack) and the durable consumer's (deliveries, acks, its own
// replicated state). NATS elects its leaders without knowing ours, so one
// replica often held all three and spent about 1.8 µs of CPU per block
// event where the others spent 1.0 (BENCHMARKS.md). The replica leading the
// Raft group therefore asks NATS to move the stream's and the consumer's
// leadership to the other servers, one each when it can — a stepdown with a
// preferred server, an operation NATS does on its own after failures, with
// the same effects (publishers retry, the consumer sees a delivery gap and
// rewinds). Nothing of the ack chain changes.

// Leaders is where a stream's and its durable consumer's NATS Raft groups
// have their leaders, by server name, and the servers holding the stream.
type Leaders struct {
	Stream   string
	Consumer string
	Servers  []string // the stream's servers (leader and replicas), sorted
}

// spreadPlan decides the moves that keep the stream's and the consumer's
// leadership off self (the server of the replica leading the Raft group)
// and, when there are enough servers, off each other (the consumer's
// moves when it shares a server with the stream's). It returns the server
// each should move to ("" = stay). It never proposes self or a server not
// holding the stream; with a single server there is nowhere to go.
func spreadPlan(self string, l Leaders) (streamTo, consumerTo string) {
	others := make([]string, 0, len(l.Servers))
	for _, s := range l.Servers {
		if s != self && s != "" {
			others = append(others, s)
		}
	}
	if self == "" || len(others) == 0 {
		return "", ""
	}
	// pick prefers a server other than avoid, else any other one.
	pick := func(avoid string) string {
		for _, s := range others {
			if s != avoid {
				return s
			}
		}
		return others[0]
	}
	stream, consumer := l.Stream, l.Consumer
	if stream == self {
		streamTo = pick(consumer)
		stream = streamTo
	}
	if consumer == self {
		consumerTo = pick(stream)
	} else if consumer != "" && consumer == stream && len(others) > 1 {
		// Both on one other server while a third is free: split them.
		consumerTo = pick(stream)
	}
	return streamTo, consumerTo
}

// leaders reads where the stream's and the consumer's leaders are.
func (c *Consumer) leaders(ctx context.Context) (Leaders, error) {
	s, err := c.js.Stream(ctx, c.cfg.Stream)
	if err != nil {
		return Leaders{}, fmt.Errorf("stream %s info: %w", c.cfg.Stream, err)
	}
	si := s.CachedInfo()
	cons, err := c.js.Consumer(ctx, c.cfg.Stream, c.cfg.Durable)
	if err != nil {
		return Leaders{}, fmt.Errorf("consumer %s info: %w", c.cfg.Durable, err)
	}
	ci := cons.CachedInfo()
	var l Leaders
	if si != nil && si.Cluster != nil {
		l.Stream = si.Cluster.Leader
		if l.Stream != "" {
			l.Servers = append(l.Servers, l.Stream)
		}
		for _, p := range si.Cluster.Replicas {
			if p != nil && p.Current && !p.Offline {
				l.Servers = append(l.Servers, p.Name)
			}
		}
	}
	if ci != nil && ci.Cluster != nil {
		l.Consumer = ci.Cluster.Leader
	}
	slices.Sort(l.Servers)
	l.Servers = slices.Compact(l.Servers)
	return l, nil
}

// spreadLeaders moves the stream's and the consumer's leadership off
// ConsumerConfig.SpreadFrom (see spreadPlan); it reports whether the
// placement is still unsettled: a move was asked for, or a leader is not
// known (an election is running, after a move of ours or NATS's own), so
// the caller looks again soon. Failures are returned; the caller logs them
// and tries again later: nothing depends on the move.
func (c *Consumer) spreadLeaders(ctx context.Context) (bool, error) {
	self := c.cfg.SpreadFrom
	if self == "" {
		return false, nil
	}
	ictx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	l, err := c.leaders(ictx)
	if err != nil {
		return false, err
	}
	streamTo, consumerTo := spreadPlan(self, l)
	prefix := c.js.Options().APIPrefix
	if prefix == "" {
		prefix = "$JS.API."
	} else if !strings.HasSuffix(prefix, ".") {
		prefix += "."
	}
	var errs []error
	if streamTo != "" {
		subj := prefix + "STREAM.LEADER.STEPDOWN." + c.cfg.Stream
		if err := c.stepDown(ictx, subj, streamTo); err != nil {
			errs = append(errs, fmt.Errorf("stream %s leader %s to %s: %w", c.cfg.Stream, l.Stream, streamTo, err))
		} else {
			c.log.Info("moved the stream's leadership off the Raft leader", "from", l.Stream, "to", streamTo)
		}
	}
	if consumerTo != "" {
		subj := prefix + "CONSUMER.LEADER.STEPDOWN." + c.cfg.Stream + "." + c.cfg.Durable
		if err := c.stepDown(ictx, subj, consumerTo); err != nil {
			errs = append(errs, fmt.Errorf("consumer %s leader %s to %s: %w", c.cfg.Durable, l.Consumer, consumerTo, err))
		} else {
			c.log.Info("moved the consumer's leadership off the Raft leader", "from", l.Consumer, "to", consumerTo)
		}
	}
	unsettled := streamTo != "" || consumerTo != "" || l.Stream == "" || l.Consumer == ""
	return unsettled, errors.Join(errs...)
}

// stepDown sends one JetStream leader stepdown request with a preferred
// server and checks its answer.
func (c *Consumer) stepDown(ctx context.Context, subj, to string) error {
	body, err := json.Marshal(map[string]any{"placement": map[string]string{"preferred": to}})
	if err != nil {
		return err
	}
	msg, err := c.js.Conn().RequestWithContext(ctx, subj, body)
	if err != nil {
		return err
	}
	var resp struct {
		Success bool `json:"success"`
		Error   *struct {
			Code        int    `json:"code"`
			Description string `json:"description"`
		} `json:"error"`
	}
	if err := json.Unmarshal(msg.Data, &resp); err != nil {
		return fmt.Errorf("stepdown answer: %w", err)
	}
	if resp.Error != nil {
		return fmt.Errorf("stepdown refused: %d %s", resp.Error.Code, resp.Error.Description)
	}
	if !resp.Success {
		return errors.New("stepdown not confirmed")
	}
	return nil
}

// spreadRetry is the first pause before checking again after a move was
// asked for or failed: NATS accepts a stepdown before its election, which
// the old leader can win again (seen right after a cluster formed), so a
// move is checked soon, then less often (doubling up to SpreadEvery).
const spreadRetry = time.Second

// maybeSpread runs spreadLeaders when its time has come: SpreadEvery after
// a check that found both leaders known and nothing to move, sooner after
// a move, an unknown leader or a failure (spreadRetry, doubling). A failure is logged at most every 10 s.
func (c *Consumer) maybeSpread(ctx context.Context) {
	if c.cfg.SpreadFrom == "" || time.Now().Before(c.spreadNext) {
		return
	}
	unsettled, err := c.spreadLeaders(ctx)
	wait := c.cfg.SpreadEvery
	if unsettled || err != nil {
		c.spreadTries++
		wait = min(spreadRetry<<min(c.spreadTries-1, 10), c.cfg.SpreadEvery)
	} else {
		c.spreadTries = 0
	}
	c.spreadNext = time.Now().Add(wait)
	if err != nil && ctx.Err() == nil {
		if ok, n := c.limiter.allow("spread"); ok {
			c.log.Warn("could not move the stream's or consumer's leadership off the Raft leader", "err", err, "suppressed", n)
		}
	}
}
