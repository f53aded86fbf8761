package main

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/kvrouter/kvrouter/eventbus"
)

// busHooks are kvmock's settings and callbacks for the bus connection.
type busHooks struct {
	firstEventID uint64 // the publisher's first event id
	// onError: the publisher gave up on an event (see eventbus.WithOnError).
	onError func(eventID uint64, err error)
	// onAck: the stream acknowledged an event (see eventbus.WithOnAck).
	onAck func(eventbus.PublishAck)
	// resync answers a resync request; pub is the connection's publisher.
	resync func(req eventbus.ResyncRequest, pub Publisher) eventbus.ResyncReply
	// eventsPerMsg > 1: batch messages (config.EventsPerMsg).
	eventsPerMsg int
	// compactHashes: events' hashes in the compact form (config.CompactHashes).
	compactHashes bool
}

// connectFunc opens the bus once: a publisher for the worker's events and
// whatever else the connection serves; closeFn releases the rest after the
// publisher is closed. It fails if the bus is not reachable (the caller
// retries).
type connectFunc func(ctx context.Context, worker string, dpRank uint32, hooks busHooks) (pub Publisher, closeFn func(), err error)

// natsConnect returns the real connectFunc: a NATS client connection to
// urls (comma list) with opts (the worker certificate on a secure bus), an
// eventbus.Publisher for rank dpRank of worker, and (rank 0 only: the
// subject is the worker's, the request names the rank) the worker's resync
// subject served.
func natsConnect(urls string, log *slog.Logger, opts ...eventbus.ConnectOption) connectFunc {
	return func(ctx context.Context, worker string, dpRank uint32, hooks busHooks) (Publisher, func(), error) {
		nc, err := eventbus.Connect(urls, fmt.Sprintf("kvmock-%s-%d", worker, dpRank), log, opts...)
		if err != nil {
			return nil, nil, err
		}
		popts := []eventbus.PublisherOption{
			eventbus.WithNextEventID(hooks.firstEventID),
			eventbus.WithOnError(hooks.onError),
			eventbus.WithOnAck(hooks.onAck),
			eventbus.WithBatching(hooks.eventsPerMsg, 0, time.Millisecond),
			eventbus.WithPublisherLogger(log),
		}
		if hooks.compactHashes {
			popts = append(popts, eventbus.WithCompactHashes())
		}
		pub, err := eventbus.NewPublisher(nc, worker, dpRank, popts...)
		if err != nil {
			nc.Close()
			return nil, nil, err
		}
		if dpRank != 0 {
			log.Info("connected to NATS", "url", nc.ConnectedUrlRedacted(), "events_subject", eventbus.EventSubject(worker), "dp_rank", dpRank)
			return pub, nc.Close, nil
		}
		sub, err := eventbus.ServeResync(nc, worker, log, func(req eventbus.ResyncRequest) eventbus.ResyncReply {
			return hooks.resync(req, pub)
		})
		if err != nil {
			pub.Close()
			nc.Close()
			return nil, nil, fmt.Errorf("serve resync: %w", err)
		}
		log.Info("connected to NATS", "url", nc.ConnectedUrlRedacted(), "events_subject", eventbus.EventSubject(worker),
			"resync_subject", eventbus.ResyncSubject(worker))
		return pub, func() {
			_ = sub.Unsubscribe()
			nc.Close()
		}, nil
	}
}
