package eventbus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"

	"github.com/nats-io/nats.go"
)

// ErrNoResync means no one serves resync requests for the worker: the
// engine cannot republish its state, so the caller must drop that worker's
// blocks instead (see DESIGN.md).
var ErrNoResync = errors.New("worker does not serve resync requests")

// ResyncRequest asks a worker rank to republish its whole cache state. It is
// sent as JSON on ResyncSubject(worker) with NATS core request/reply.
type ResyncRequest struct {
	Worker string `json:"worker"`
	DPRank uint32 `json:"dp_rank"`
	// LastEventID is the last event of this rank the index applied.
	LastEventID uint64 `json:"last_event_id"`
	Reason      string `json:"reason,omitempty"`
}

// ResyncReply is the worker's answer. Accepted means: the worker will
// publish, through its ordinary Publisher, a Cleared event with an id of at
// least NextEventID followed by Stored events for every block it holds; the
// index treats that Cleared event as the end of the worker's staleness.
type ResyncReply struct {
	Accepted    bool   `json:"accepted"`
	NextEventID uint64 `json:"next_event_id,omitempty"`
	Error       string `json:"error,omitempty"`
}

// RequestResync asks a worker rank to republish its state and returns its
// reply. ErrNoResync: nobody serves the worker's resync subject.
func RequestResync(ctx context.Context, nc *nats.Conn, req ResyncRequest) (ResyncReply, error) {
	data, err := json.Marshal(req)
	if err != nil {
		return ResyncReply{}, err
	}
	msg, err := nc.RequestWithContext(ctx, ResyncSubject(req.Worker), data)
	if err != nil {
		if errors.Is(err, nats.ErrNoResponders) {
			return ResyncReply{}, fmt.Errorf("resync %s#%d: %w", req.Worker, req.DPRank, ErrNoResync)
		}
		return ResyncReply{}, fmt.Errorf("resync %s#%d: %w", req.Worker, req.DPRank, err)
	}
	var rep ResyncReply
	if err := json.Unmarshal(msg.Data, &rep); err != nil {
		return ResyncReply{}, fmt.Errorf("resync %s#%d: bad reply: %w", req.Worker, req.DPRank, err)
	}
	return rep, nil
}

// ResyncHandler answers one resync request. It runs on the subscription's
// goroutine: start the republishing (e.g. in a goroutine) and reply at once.
type ResyncHandler func(req ResyncRequest) ResyncReply

// ServeResync serves resync requests for worker (all its ranks) until the
// returned subscription is unsubscribed. Requests for another worker or
// that do not parse are answered with an error and not passed on.
func ServeResync(nc *nats.Conn, worker string, logger *slog.Logger, h ResyncHandler) (*nats.Subscription, error) {
	if logger == nil {
		logger = slog.Default()
	}
	log := logger.With("component", "resync", "worker", worker)
	sub, err := nc.Subscribe(ResyncSubject(worker), func(m *nats.Msg) {
		var req ResyncRequest
		var rep ResyncReply
		if err := json.Unmarshal(m.Data, &req); err != nil {
			rep.Error = "bad request: " + err.Error()
		} else if req.Worker != worker {
			rep.Error = fmt.Sprintf("request for worker %q served by %q", req.Worker, worker)
		} else {
			log.Info("resync requested", "dp_rank", req.DPRank, "last_event_id", req.LastEventID, "reason", req.Reason)
			rep = h(req)
		}
		data, _ := json.Marshal(rep)
		if m.Reply != "" {
			if err := m.Respond(data); err != nil {
				log.Warn("resync reply failed", "err", err)
			}
		}
	})
	if err != nil {
		return nil, fmt.Errorf("serve resync %s: %w", worker, err)
	}
	return sub, nil
}
