package eventbus

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Names on the bus. They are contracts with workers, engine bridges and
// operators: change them only on purpose.
const (
	StreamName          = "KV_EVENTS"
	EventSubjectPrefix  = "kv.events."  // + SubjectToken(worker)
	EventSubjects       = "kv.events.>" // the stream's subject filter
	SyncSubjectPrefix   = "kv.sync."    // + SubjectToken(model), "all" for every model
	ResyncSubjectPrefix = "kv.resync."  // + SubjectToken(worker)
	DefaultDurable      = "kv-apply"    // the leader's durable consumer
)

// SubjectToken turns any name into one NATS subject token. Letters, digits,
// '-' and '_' pass unchanged; every other byte becomes "~XX" (hex), so the
// mapping is injective and "a.b" and "a_b" never share a subject. The empty
// name maps to "~".
func SubjectToken(name string) string {
	if name == "" {
		return "~"
	}
	plain := true
	for i := 0; i < len(name); i++ {
		if !tokenSafe(name[i]) {
			plain = false
			break
		}
	}
	if plain {
		return name
	}
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	b.Grow(len(name) + 8)
	for i := 0; i < len(name); i++ {
		c := name[i]
		if tokenSafe(c) {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('~')
		b.WriteByte(hex[c>>4])
		b.WriteByte(hex[c&0xf])
	}
	return b.String()
}

func tokenSafe(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_'
}

// EventSubject is the subject a worker publishes its KV events on.
func EventSubject(worker string) string { return EventSubjectPrefix + SubjectToken(worker) }

// SyncSubject is the replica-sync subject of a model ("" = "all").
func SyncSubject(model string) string {
	if model == "" {
		model = "all"
	}
	return SyncSubjectPrefix + SubjectToken(model)
}

// ResyncSubject is where a worker (or its bridge) serves resync requests.
func ResyncSubject(worker string) string { return ResyncSubjectPrefix + SubjectToken(worker) }

// MsgID is the JetStream deduplication id of an event: worker:dp_rank:event_id.
func MsgID(worker string, dpRank uint32, eventID uint64) string {
	return worker + ":" + strconv.FormatUint(uint64(dpRank), 10) + ":" + strconv.FormatUint(eventID, 10)
}

// isEventSubject reports whether subj == EventSubject(worker), without
// building the subject for a worker name that needs no escaping (the
// consumer checks every event: issue 31).
func isEventSubject(subj, worker string) bool {
	rest, ok := strings.CutPrefix(subj, EventSubjectPrefix)
	if !ok {
		return false
	}
	if rest == worker && worker != "" {
		// Equal to a plain name only if the name needs no escaping.
		for i := 0; i < len(worker); i++ {
			if !tokenSafe(worker[i]) {
				return rest == SubjectToken(worker)
			}
		}
		return true
	}
	return rest == SubjectToken(worker)
}

// isMsgID reports whether id == MsgID(worker, dpRank, eventID), without
// building it.
func isMsgID(id, worker string, dpRank uint32, eventID uint64) bool {
	rest, ok := strings.CutPrefix(id, worker)
	if !ok {
		return false
	}
	var buf [2 + 10 + 20]byte // ':' rank ':' id
	b := append(buf[:0], ':')
	b = strconv.AppendUint(b, uint64(dpRank), 10)
	b = append(b, ':')
	b = strconv.AppendUint(b, eventID, 10)
	return rest == string(b)
}

// StreamOptions configures an event stream: KV_EVENTS, or one data
// group's stream (Name and Subjects from GroupStreamName and
// GroupStreamSubjects). Zero fields take the defaults.
type StreamOptions struct {
	// Name is the stream's name (default StreamName).
	Name string
	// Subjects are the subjects the stream stores (default
	// []string{EventSubjects}: every worker). They must not overlap another
	// stream's subjects: NATS refuses that (ErrSubjectsOverlap).
	Subjects []string
	// Replicas: 3 in a three-replica cluster, 1 single-node (default 1).
	Replicas int
	// Duplicates is the deduplication window: a retry with the same
	// Nats-Msg-Id inside it is stored once (default 2m).
	Duplicates time.Duration
	// MaxAge bounds how long an event waits for the consumer (default 24h).
	// An event older than that is dropped unapplied; its worker sees a gap.
	MaxAge time.Duration
	// MaxBytes bounds the unapplied backlog (default 1 GiB). When full the
	// stream refuses new events (discard new), which the publishers see as
	// backpressure, instead of silently dropping old unapplied ones.
	MaxBytes int64
	// MaxMsgSize bounds one event (default 1 MiB).
	MaxMsgSize int32
}

func (o StreamOptions) withDefaults() StreamOptions {
	if o.Name == "" {
		o.Name = StreamName
	}
	if len(o.Subjects) == 0 {
		o.Subjects = []string{EventSubjects}
	} else {
		o.Subjects = slices.Clone(o.Subjects) // the config must not alias the caller's slice
	}
	if o.Replicas <= 0 {
		o.Replicas = 1
	}
	if o.Duplicates <= 0 {
		o.Duplicates = 2 * time.Minute
	}
	if o.MaxAge <= 0 {
		o.MaxAge = 24 * time.Hour
	}
	if o.Duplicates > o.MaxAge {
		o.Duplicates = o.MaxAge
	}
	if o.MaxBytes <= 0 {
		o.MaxBytes = 1 << 30
	}
	if o.MaxMsgSize <= 0 {
		o.MaxMsgSize = 1 << 20
	}
	return o
}

// GroupStreamName is the event stream of Raft data group group (1..G):
// "KV_EVENTS_G<group>". With one group the stream stays StreamName.
func GroupStreamName(group int) string { return StreamName + "_G" + strconv.Itoa(group) }

// unplacedSubjectPrefix + group is the subject of a group stream without
// workers.
const unplacedSubjectPrefix = "kv.unplaced.g"

// GroupStreamSubjects is the subject list of group's stream when workers
// are placed on it: the EventSubject of each worker, sorted and without
// duplicates (so the same placement always gives the same configuration and
// re-applying it changes nothing).
//
// With no workers it is the one placeholder subject "kv.unplaced.g<group>".
// A stream needs a subject: given none, NATS would take the stream's name
// as its subject, outside the kv. namespace. The placeholder is outside
// kv.events.> (no worker can publish there, and the consumer's filter
// ignores it), and it names the group, so two empty groups' streams do not
// overlap each other (NATS refuses overlapping subjects).
func GroupStreamSubjects(group int, workers []string) []string {
	if len(workers) == 0 {
		return []string{unplacedSubjectPrefix + strconv.Itoa(group)}
	}
	subjects := make([]string, len(workers))
	for i, w := range workers {
		subjects[i] = EventSubject(w)
	}
	slices.Sort(subjects)
	return slices.Compact(subjects)
}

// StreamConfig is the configuration EnsureStream applies (KV_EVENTS, or a
// group's stream with o.Name and o.Subjects).
//
// Work-queue retention: an event leaves the stream when the leader acks it,
// which happens only after its Raft commit, so the stream holds exactly the
// events not yet in the Raft log. File storage; with the embedded server
// every write is fsynced (SyncAlways).
func StreamConfig(o StreamOptions) jetstream.StreamConfig {
	o = o.withDefaults()
	return jetstream.StreamConfig{
		Name:              o.Name,
		Description:       "KV cache events from workers, waiting for the Raft commit",
		Subjects:          o.Subjects,
		Retention:         jetstream.WorkQueuePolicy,
		Discard:           jetstream.DiscardNew,
		Storage:           jetstream.FileStorage,
		Replicas:          o.Replicas,
		Duplicates:        o.Duplicates,
		MaxAge:            o.MaxAge,
		MaxBytes:          o.MaxBytes,
		MaxMsgSize:        o.MaxMsgSize,
		MaxMsgs:           -1,
		MaxConsumers:      -1,
		MaxMsgsPerSubject: -1,
		DenyDelete:        true,
	}
}

// ErrSubjectsOverlap: the stream's subjects overlap another stream's, which
// NATS refuses. Moving a worker between group streams must therefore remove
// its subject from the old stream before adding it to the new one.
var ErrSubjectsOverlap = errors.New("stream subjects overlap another stream's")

// EnsureStream creates the stream (o.Name, default KV_EVENTS) or updates it
// to the current configuration; calling it again is harmless. An update
// that changes only the subjects is applied online: stored events stay (and
// are consumed from this stream), publishers keep publishing. A JetStream
// that is not ready yet (a cluster still electing its meta leader) is
// retried until ctx ends. Subjects overlapping another stream's fail with
// an error wrapping ErrSubjectsOverlap.
func EnsureStream(ctx context.Context, js jetstream.JetStream, o StreamOptions) (jetstream.Stream, error) {
	cfg := StreamConfig(o)
	backoff := 50 * time.Millisecond
	for {
		actx, cancel := context.WithTimeout(ctx, 5*time.Second)
		s, err := js.CreateOrUpdateStream(actx, cfg)
		cancel()
		if err == nil {
			return s, nil
		}
		if isJSErrorCode(err, errCodeStreamSubjectOverlap) {
			return nil, fmt.Errorf("ensure stream %s (subjects %v): %w: %w", cfg.Name, cfg.Subjects, ErrSubjectsOverlap, err)
		}
		if !transientJSError(err) || ctx.Err() != nil {
			return nil, fmt.Errorf("ensure stream %s (replicas %d): %w", cfg.Name, cfg.Replicas, err)
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("ensure stream %s: %w (last error: %v)", cfg.Name, ctx.Err(), err)
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}

// transientJSError: worth retrying (no responders, timeouts, JetStream
// temporarily unavailable or without quorum).
func transientJSError(err error) bool {
	switch {
	case errors.Is(err, context.DeadlineExceeded),
		errors.Is(err, nats.ErrTimeout),
		errors.Is(err, nats.ErrNoResponders),
		errors.Is(err, jetstream.ErrNoStreamResponse),
		errors.Is(err, jetstream.ErrJetStreamNotEnabled),
		errors.Is(err, jetstream.ErrAsyncPublishTimeout),
		errors.Is(err, jetstream.ErrTooManyStalledMsgs),
		errors.Is(err, nats.ErrConnectionReconnecting),
		errors.Is(err, nats.ErrDisconnected),
		errors.Is(err, nats.ErrReconnectBufExceeded):
		return true
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		// 10158 "duplicate message id is in process": the first send of this
		// Nats-Msg-Id is still being stored (typical of a re-send during a
		// partition). Retrying with the same id resolves to its ack.
		return apiErr.Code == 503 || apiErr.Code == 500 || apiErr.Code == 408 ||
			apiErr.ErrorCode == errCodeDuplicateInProcess
	}
	return false
}

// isJSErrorCode reports whether err is a JetStream API error with code.
func isJSErrorCode(err error, code jetstream.ErrorCode) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == code
}

// errCodeStreamSubjectOverlap is JetStream's error code for a stream whose
// subjects overlap another stream's.
const errCodeStreamSubjectOverlap jetstream.ErrorCode = 10065

// errCodeDuplicateInProcess is JetStream's error code for a publish whose
// message id is a duplicate of one still in process.
const errCodeDuplicateInProcess jetstream.ErrorCode = 10158

// SubjectBacklog reports whether stream still captures subject and how
// many of its messages wait there. Moving a worker between group streams
// (the replica's hand-over) waits for "not captured, none waiting": then
// every event the old stream acknowledged was acked by its consumer, so
// committed in the old group's log (work-queue retention), and no new one
// can arrive there.
func SubjectBacklog(ctx context.Context, js jetstream.JetStream, stream, subject string) (captured bool, waiting uint64, err error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return false, 0, fmt.Errorf("stream %s: %w", stream, err)
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(subject))
	if err != nil {
		return false, 0, fmt.Errorf("stream %s info for %s: %w", stream, subject, err)
	}
	return slices.Contains(info.Config.Subjects, subject), info.State.Subjects[subject], nil
}
