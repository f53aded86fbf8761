package fsm

import (
	"encoding/json"
	"errors"

	"github.com/kvrouter/kvrouter/router"
)

// resultJSON is ApplyResult on the wire (a follower forwarding a write gets
// the leader's result back as JSON). Err travels as its message plus the
// name of the sentinel it wraps, so errors.Is still works on the far side.
type resultJSON struct {
	Type           CommandType       `json:"type"`
	Applied        int               `json:"applied"`
	Duplicates     int               `json:"duplicates,omitempty"`
	Gaps           int               `json:"gaps,omitempty"`
	Rejected       int               `json:"rejected,omitempty"`
	Unknown        int               `json:"unknown,omitempty"`
	Expired        int               `json:"expired,omitempty"`
	UnknownWorkers []router.WorkerID `json:"unknown_workers,omitempty"`
	Stale          []router.WorkerID `json:"stale,omitempty"`
	Session        *SessionBinding   `json:"session,omitempty"`
	Ignored        bool              `json:"ignored,omitempty"`
	Replayed       bool              `json:"replayed,omitempty"`
	Error          string            `json:"error,omitempty"`
	ErrorKind      string            `json:"error_kind,omitempty"`
}

// errorKinds name the sentinels an ApplyResult.Err may wrap (most specific
// first: ErrBlockSizeMismatch before the generic ones).
var errorKinds = []struct {
	name string
	err  error
}{
	{"block_size_mismatch", ErrBlockSizeMismatch},
	{"unknown_worker", ErrUnknownWorker},
	{"unknown_node", ErrUnknownNode},
	{"unchecked_node", ErrUncheckedNode}, // before invalid_command, which it wraps
	{"not_drained", ErrNotDrained},       // likewise
	{"session_limit", ErrSessionLimit},   // likewise
	{"pin_limit", ErrPinLimit},           // likewise
	{"invalid_config", ErrInvalidConfig},
	{"invalid_command", ErrInvalidCommand},
	{"unknown_command", ErrUnknownCommand}, // also the HaltError of the entry that halted
	{"halted", ErrHalted},
	{"undecodable", ErrUndecodable},
}

// remoteError is an Err that crossed the wire: the original message, and
// the sentinel it wrapped.
type remoteError struct {
	msg  string
	kind error
}

func (e *remoteError) Error() string { return e.msg }
func (e *remoteError) Unwrap() error { return e.kind }

// MarshalJSON encodes the result with Err as a message and a sentinel name.
func (r ApplyResult) MarshalJSON() ([]byte, error) {
	j := resultJSON{Type: r.Type, Applied: r.Applied, Duplicates: r.Duplicates, Gaps: r.Gaps, Rejected: r.Rejected,
		Unknown: r.Unknown, Expired: r.Expired, UnknownWorkers: r.UnknownWorkers, Stale: r.Stale, Session: r.Session,
		Ignored: r.Ignored, Replayed: r.Replayed}
	if r.Err != nil {
		j.Error = r.Err.Error()
		for _, k := range errorKinds {
			if errors.Is(r.Err, k.err) {
				j.ErrorKind = k.name
				break
			}
		}
	}
	return json.Marshal(j)
}

// UnmarshalJSON decodes what MarshalJSON wrote.
func (r *ApplyResult) UnmarshalJSON(b []byte) error {
	var j resultJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return err
	}
	*r = ApplyResult{Type: j.Type, Applied: j.Applied, Duplicates: j.Duplicates, Gaps: j.Gaps, Rejected: j.Rejected,
		Unknown: j.Unknown, Expired: j.Expired, UnknownWorkers: j.UnknownWorkers, Stale: j.Stale, Session: j.Session,
		Ignored: j.Ignored, Replayed: j.Replayed}
	if j.Error != "" || j.ErrorKind != "" {
		e := &remoteError{msg: j.Error}
		for _, k := range errorKinds {
			if k.name == j.ErrorKind {
				e.kind = k.err
			}
		}
		r.Err = e
	}
	return nil
}
