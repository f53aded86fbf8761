package replica

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/decisionlog"
)

var _ api.IndexView = (*replica)(nil)

// IndexEpoch is api.IndexView: the Raft applied index of this replica's
// FSM, so a decision names the replicated cache state it saw.
func (r *replica) IndexEpoch() uint64 { return r.indexEpoch() }

// SyncAge is api.IndexView: how long ago another replica's load last
// arrived (false without replica sync or before the first message).
func (r *replica) SyncAge(now time.Time) (time.Duration, bool) {
	if r.sync == nil {
		return 0, false
	}
	t, ok := r.sync.LastReceived()
	if !ok {
		return 0, false
	}
	return now.Sub(t), true
}

// openDecisionLog is the decision log cfg asks for (nil: off) and what
// closes it.
func openDecisionLog(cfg Config, log *slog.Logger) (*decisionlog.Log, func(), error) {
	if cfg.DecisionLogSize <= 0 {
		return nil, func() {}, nil
	}
	var sink *decisionlog.Sink
	closeSink := func() {}
	if cfg.DecisionLogFile != "" {
		var err error
		if sink, err = decisionlog.OpenSink(cfg.DecisionLogFile, cfg.DecisionLogMaxBytes, 3, log); err != nil {
			return nil, nil, fmt.Errorf("--decision-log-file: %w", err)
		}
		closeSink = func() {
			if err := sink.Close(); err != nil {
				log.Warn("decision log file not closed cleanly", "err", err)
			}
			if n := sink.Dropped(); n > 0 {
				log.Warn("decisions dropped from the log file (its queue was full)", "dropped", n)
			}
		}
	}
	return decisionlog.New(cfg.DecisionLogSize, sink), closeSink, nil
}
