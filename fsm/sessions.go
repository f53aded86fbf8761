package fsm

import (
	"container/heap"
	"encoding/binary"
	"fmt"
	"maps"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/kvrouter/kvrouter/router"
)

// Session bindings (issue 28, DESIGN.md "Sessions"): an agent session's id
// bound to the worker (rank) that serves its turns, for an idle TTL. They
// live in the control group's FSM, so every replica reads them locally and
// a binding one replica made is the one every replica uses.

// Session limits: Dynamo's (its router keeps at most 65,536 bindings and
// refuses ids over 256 bytes). Constants of the build, like every bound the
// FSM applies: replicas must decide alike on the same entry.
const (
	// MaxSessionBindings bounds the bindings the state holds: a binding
	// beyond is refused (ErrSessionLimit), the turn served unbound.
	MaxSessionBindings = 65536
	// MaxSessionIDBytes bounds a session id (and a parent session id).
	MaxSessionIDBytes = 256
	// MaxSessionTTL is the longest TTL a binding may ask for (Dynamo's
	// bound on --router-session-affinity-ttl-secs: one year); apply clamps
	// an expiry further than this past the clock, as MaxTimeAhead does
	// for leases.
	MaxSessionTTL = 31536000 * nanosPerSecond
)

// ErrSessionLimit refuses a new binding while MaxSessionBindings are held.
// It wraps ErrInvalidCommand (a domain error); the proposer serves the
// turn unbound.
var ErrSessionLimit = fmt.Errorf("session bindings full: %w", ErrInvalidCommand)

// BindSession (command 17) binds a session to a worker rank until Until
// (unix nanos, stamped by the proposer: its clock + the TTL), or refreshes
// the binding's expiry. On apply:
//   - no binding (or Replace names the one in force): bound to Worker;
//   - bound to Worker already: the expiry moves to max(old, Until) (a
//     touch never shortens a binding), Parent kept unless given;
//   - bound to another worker and Replace does not name it: nothing
//     changes; the result carries the binding in force, which the
//     proposer follows (first commit wins).
//
// ApplyResult.Session is the binding in force after the entry, whatever
// happened.
type BindSession struct {
	Session string          // 1..MaxSessionIDBytes, no control characters
	Worker  router.WorkerID // router key: router.WorkerKey(id, rank)
	Parent  string          // parent session (subagents), "" = none
	Until   int64           // unix nanos, > 0
	// Replace is the worker the proposer saw bound and found gone (dead,
	// deregistered, refused the turn): the binding moves only if it is
	// still the one in force. "" = the proposer saw none.
	Replace router.WorkerID
}

// UnbindSessions (command 18) ends bindings: the one of Session
// (X-Dynamo-Session-Final, an operator), or every binding to Worker's
// ranks (the worker left). Exactly one is set. Ending what is not bound
// succeeds with Applied 0.
type UnbindSessions struct {
	Session string
	Worker  string // a worker id (no '#'): all its ranks
}

func (BindSession) Type() CommandType    { return CmdBindSession }
func (UnbindSessions) Type() CommandType { return CmdUnbindSessions }

// SessionBinding is one binding as the state holds it. A session of a
// two-stage (disaggregated) model is bound in two stages: Worker is its
// decode worker (the one that answers, and serves the turns the plan keeps
// aggregated), Prefill its prefill worker; a one-stage binding has no
// Prefill.
type SessionBinding struct {
	Session string          `json:"session"`
	Worker  router.WorkerID `json:"worker"`
	Prefill router.WorkerID `json:"prefill,omitempty"`
	Parent  string          `json:"parent,omitempty"`
	Until   int64           `json:"until"` // unix nanos: idle expiry (the FSM's clock decides)
}

// BindSessionStages (command 21) binds a session of a two-stage model to a
// prefill worker rank and a decode worker rank in one record, until Until
// (unix nanos, the proposer's clock + the TTL), or refreshes it. On apply:
//   - bound to this very pair: the expiry moves to max(old, Until), Parent
//     kept unless given (a touch, or a concurrent first turn that chose
//     alike);
//   - not bound, or SeenDecode is set and the binding in force is exactly
//     (SeenPrefill, SeenDecode): bound to (Prefill, Decode) — a first turn,
//     a stage's worker replaced, or a one-stage binding (SeenPrefill "")
//     gaining its prefill stage;
//   - otherwise nothing changes: the result carries the binding in force,
//     which the proposer follows (first commit wins).
//
// A one-stage binding stays command 17's: BindSession touching a two-stage
// binding's decode worker keeps its prefill stage; BindSession replacing it
// makes it one-stage again.
type BindSessionStages struct {
	Session string          // 1..MaxSessionIDBytes, no control characters
	Prefill router.WorkerID // router key of the prefill stage
	Decode  router.WorkerID // router key of the decode stage; never Prefill
	Parent  string          // parent session (subagents), "" = none
	Until   int64           // unix nanos, > 0
	// SeenPrefill and SeenDecode are the binding the proposer saw and is
	// replacing; SeenDecode "" = the proposer saw none (then SeenPrefill
	// is "" too). SeenPrefill "" with SeenDecode set is a one-stage
	// binding seen.
	SeenPrefill, SeenDecode router.WorkerID
}

func (BindSessionStages) Type() CommandType { return CmdBindSessionStages }

// Validate checks the binding's own fields (the limit and the clock are
// checked on apply; FSM.CheckBindSessionStages checks all).
func (c BindSessionStages) Validate() error {
	if err := checkSessionAndParent(c.Session, c.Parent); err != nil {
		return err
	}
	if err := checkBindingWorker("bind session stages: prefill worker", c.Prefill); err != nil {
		return err
	}
	if err := checkBindingWorker("bind session stages: decode worker", c.Decode); err != nil {
		return err
	}
	if c.Prefill == c.Decode {
		return fmt.Errorf("bind session %q: prefill and decode stages both %q (a one-stage binding is BindSession): %w", c.Session, c.Decode, ErrInvalidCommand)
	}
	switch {
	case c.SeenDecode == "" && c.SeenPrefill != "":
		return fmt.Errorf("bind session %q: a seen prefill worker %q without its decode worker: %w", c.Session, c.SeenPrefill, ErrInvalidCommand)
	case c.SeenDecode != "":
		if err := checkBindingWorker("bind session stages: seen decode worker", c.SeenDecode); err != nil {
			return err
		}
		if err := checkOptionalBindingWorker("bind session stages: seen prefill worker", c.SeenPrefill); err != nil {
			return err
		}
	}
	return checkBindingUntil(c.Session, c.Until)
}

func appendBindSessionStages(b []byte, c *BindSessionStages) ([]byte, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	b = appendString(b, c.Session)
	b = appendString(b, string(c.Prefill))
	b = appendString(b, string(c.Decode))
	b = appendString(b, c.Parent)
	b = binary.AppendVarint(b, c.Until)
	b = appendString(b, string(c.SeenPrefill))
	return appendString(b, string(c.SeenDecode)), nil
}

func readBindSessionStages(r *reader) BindSessionStages {
	return BindSessionStages{Session: r.string("session id"), Prefill: router.WorkerID(r.string("prefill worker")),
		Decode: router.WorkerID(r.string("decode worker")), Parent: r.string("parent session id"), Until: r.varint(),
		SeenPrefill: router.WorkerID(r.string("seen prefill worker")), SeenDecode: router.WorkerID(r.string("seen decode worker"))}
}

// EncodeBindSessionStages refuses what Validate refuses.
func EncodeBindSessionStages(c BindSessionStages) ([]byte, error) { return Encode(c) }

func DecodeBindSessionStages(data []byte) (BindSessionStages, error) {
	return decodeAs[BindSessionStages](data)
}

// checkSessionID is the rule for session and parent ids: 1..256 bytes of
// valid UTF-8 without control characters (they travel in headers, logs and
// the status page).
func checkSessionID(what, id string) error {
	switch {
	case id == "":
		return fmt.Errorf("%s is empty: %w", what, ErrInvalidCommand)
	case len(id) > MaxSessionIDBytes:
		return fmt.Errorf("%s is %d bytes, limit %d: %w", what, len(id), MaxSessionIDBytes, ErrInvalidCommand)
	case !utf8.ValidString(id):
		return fmt.Errorf("%s is not valid UTF-8: %w", what, ErrInvalidCommand)
	case strings.ContainsFunc(id, unicode.IsControl):
		return fmt.Errorf("%s holds a control character: %w", what, ErrInvalidCommand)
	}
	return nil
}

// checkBindingWorker: a router key whose worker id is non-empty.
// checkOptionalBindingWorker is checkBindingWorker for a field that may be
// empty.
func checkOptionalBindingWorker(what string, w router.WorkerID) error {
	if w == "" {
		return nil
	}
	return checkBindingWorker(what, w)
}

// checkSessionAndParent checks a binding's session id and its optional
// parent's.
func checkSessionAndParent(session, parent string) error {
	if err := checkSessionID("session id", session); err != nil {
		return err
	}
	if parent == "" {
		return nil
	}
	return checkSessionID("parent session id", parent)
}

// checkBindingUntil checks a binding's expiry is a time at all (the clock
// is checked on apply).
func checkBindingUntil(session string, until int64) error {
	if until <= 0 {
		return fmt.Errorf("bind session %q: until %d must be a positive unix-nano time: %w", session, until, ErrInvalidCommand)
	}
	return nil
}

func checkBindingWorker(what string, w router.WorkerID) error {
	if base, _, _ := strings.Cut(string(w), "#"); base == "" {
		return fmt.Errorf("%s %q names no worker: %w", what, w, ErrInvalidCommand)
	}
	return checkString(what, string(w))
}

// Validate checks the binding's own fields (the limit and the clock are
// checked on apply; FSM.CheckBindSession checks all).
func (c BindSession) Validate() error {
	if err := checkSessionAndParent(c.Session, c.Parent); err != nil {
		return err
	}
	if err := checkBindingWorker("bind session: worker", c.Worker); err != nil {
		return err
	}
	if err := checkOptionalBindingWorker("bind session: replaced worker", c.Replace); err != nil {
		return err
	}
	return checkBindingUntil(c.Session, c.Until)
}

// Validate checks that exactly one of Session and Worker is set, and each
// by its own rule.
func (c UnbindSessions) Validate() error {
	switch {
	case (c.Session == "") == (c.Worker == ""):
		return fmt.Errorf("unbind sessions: exactly one of session %q and worker %q: %w", c.Session, c.Worker, ErrInvalidCommand)
	case c.Session != "":
		return checkSessionID("session id", c.Session)
	case strings.ContainsRune(c.Worker, '#'):
		return fmt.Errorf("unbind sessions of worker %q: '#' is reserved for dp ranks: %w", c.Worker, ErrInvalidCommand)
	}
	return checkString("worker id", c.Worker)
}

func appendBindSession(b []byte, c *BindSession) ([]byte, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	b = appendString(b, c.Session)
	b = appendString(b, string(c.Worker))
	b = appendString(b, c.Parent)
	b = binary.AppendVarint(b, c.Until)
	return appendString(b, string(c.Replace)), nil
}

func readBindSession(r *reader) BindSession {
	return BindSession{Session: r.string("session id"), Worker: router.WorkerID(r.string("worker")),
		Parent: r.string("parent session id"), Until: r.varint(), Replace: router.WorkerID(r.string("replaced worker"))}
}

func appendUnbindSessions(b []byte, c *UnbindSessions) ([]byte, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return appendString(appendString(b, c.Session), c.Worker), nil
}

func readUnbindSessions(r *reader) UnbindSessions {
	return UnbindSessions{Session: r.string("session id"), Worker: r.string("worker id")}
}

// EncodeBindSession and EncodeUnbindSessions refuse what Validate refuses.
func EncodeBindSession(c BindSession) ([]byte, error)       { return Encode(c) }
func EncodeUnbindSessions(c UnbindSessions) ([]byte, error) { return Encode(c) }

func DecodeBindSession(data []byte) (BindSession, error) { return decodeAs[BindSession](data) }
func DecodeUnbindSessions(data []byte) (UnbindSessions, error) {
	return decodeAs[UnbindSessions](data)
}

// sessionEntry is one expiry in the session heap: the binding of session
// expires at until unless it was refreshed or ended since (then the entry
// is stale and skipped). Ordered by until, then session, so pops are in one
// order on every replica.
type sessionEntry struct {
	until   int64
	session string
}

type sessionHeap []sessionEntry

func (h sessionHeap) Len() int { return len(h) }
func (h sessionHeap) Less(i, j int) bool {
	if h[i].until != h[j].until {
		return h[i].until < h[j].until
	}
	return h[i].session < h[j].session
}
func (h sessionHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *sessionHeap) Push(x any)   { *h = append(*h, x.(sessionEntry)) }
func (h *sessionHeap) Pop() any {
	s := *h
	e := s[len(s)-1]
	*h = s[:len(s)-1]
	return e
}

// live reports whether e is the expiry of the binding in force.
func (st *state) sessionEntryLive(e sessionEntry) bool {
	b, ok := st.sessions[e.session]
	return ok && b.Until == e.until
}

// earliestSessionLocked is the earliest live binding expiry (0: none),
// popping stale heap entries off the top (the heap is derived: the answer
// depends only on the bindings). f.mu held for writing.
func (st *state) earliestSessionLocked() int64 {
	for st.sessionHeap.Len() > 0 {
		if e := st.sessionHeap[0]; st.sessionEntryLive(e) {
			return e.until
		}
		heap.Pop(&st.sessionHeap)
	}
	return 0
}

// rebuildSessionHeap derives the heap from the bindings (restore).
func (st *state) rebuildSessionHeap() {
	st.sessionHeap = st.sessionHeap[:0]
	for id, b := range st.sessions {
		st.sessionHeap = append(st.sessionHeap, sessionEntry{until: b.Until, session: id})
	}
	heap.Init(&st.sessionHeap)
}

// bindLocked applies BindSession. f.mu held.
func (f *FSM) bindLocked(c BindSession, res *ApplyResult) error {
	if err := c.Validate(); err != nil {
		return err
	}
	st := f.st
	if c.Until <= st.lastTick {
		return fmt.Errorf("bind session %q: until %d is not after the clock %d: %w", c.Session, c.Until, st.lastTick, ErrInvalidCommand)
	}
	until := c.Until
	if ref := max(st.lastTick, st.earliestExpiryLocked()); ref > 0 && until > addSat(ref, MaxSessionTTL) {
		until, res.Clamped = addSat(ref, MaxSessionTTL), true
	}
	old, bound := st.sessions[c.Session]
	switch {
	case bound && old.Worker == c.Worker:
		// A touch (or a concurrent first turn that chose the same worker).
		if until > old.Until {
			old.Until = until
			heap.Push(&st.sessionHeap, sessionEntry{until: until, session: c.Session})
		}
		if c.Parent != "" {
			old.Parent = c.Parent
		}
		st.sessions[c.Session] = old
		res.Applied = 1
	case bound && old.Worker != c.Replace:
		// Another replica's binding committed first: keep it, tell the
		// proposer (Applied 0, no error: losing the race is no fault).
	default:
		if !bound && len(st.sessions) >= MaxSessionBindings {
			return fmt.Errorf("bind session %q: %d bindings held: %w", c.Session, len(st.sessions), ErrSessionLimit)
		}
		st.sessions[c.Session] = SessionBinding{Session: c.Session, Worker: c.Worker, Parent: c.Parent, Until: until}
		heap.Push(&st.sessionHeap, sessionEntry{until: until, session: c.Session})
		res.Applied = 1
	}
	b := st.sessions[c.Session]
	res.Session = &b
	return nil
}

// bindStagesLocked applies BindSessionStages. f.mu held.
func (f *FSM) bindStagesLocked(c BindSessionStages, res *ApplyResult) error {
	if err := c.Validate(); err != nil {
		return err
	}
	st := f.st
	until, err := st.sessionUntilLocked(c.Session, c.Until, res)
	if err != nil {
		return err
	}
	old, bound := st.sessions[c.Session]
	switch {
	case bound && old.Worker == c.Decode && old.Prefill == c.Prefill:
		if until > old.Until {
			old.Until = until
			heap.Push(&st.sessionHeap, sessionEntry{until: until, session: c.Session})
		}
		if c.Parent != "" {
			old.Parent = c.Parent
		}
		st.sessions[c.Session] = old
		res.Applied = 1
	case bound && (c.SeenDecode == "" || old.Worker != c.SeenDecode || old.Prefill != c.SeenPrefill):
		// Another replica's binding committed first, or moved it since
		// the proposer looked: keep it (Applied 0, no error).
	default:
		if !bound && len(st.sessions) >= MaxSessionBindings {
			return fmt.Errorf("bind session %q: %d bindings held: %w", c.Session, len(st.sessions), ErrSessionLimit)
		}
		st.sessions[c.Session] = SessionBinding{Session: c.Session, Worker: c.Decode, Prefill: c.Prefill, Parent: c.Parent, Until: until}
		if !bound || until != old.Until {
			heap.Push(&st.sessionHeap, sessionEntry{until: until, session: c.Session})
		}
		res.Applied = 1
	}
	b := st.sessions[c.Session]
	res.Session = &b
	return nil
}

// sessionUntilLocked checks a binding's expiry against the clock and clamps
// it to MaxSessionTTL past it (what BindSession's apply does).
func (st *state) sessionUntilLocked(session string, until int64, res *ApplyResult) (int64, error) {
	if until <= st.lastTick {
		return 0, fmt.Errorf("bind session %q: until %d is not after the clock %d: %w", session, until, st.lastTick, ErrInvalidCommand)
	}
	if ref := max(st.lastTick, st.earliestExpiryLocked()); ref > 0 && until > addSat(ref, MaxSessionTTL) {
		until, res.Clamped = addSat(ref, MaxSessionTTL), true
	}
	return until, nil
}

// unbindLocked applies UnbindSessions. f.mu held.
func (f *FSM) unbindLocked(c UnbindSessions, res *ApplyResult) error {
	if err := c.Validate(); err != nil {
		return err
	}
	st := f.st
	if c.Session != "" {
		if _, ok := st.sessions[c.Session]; ok {
			delete(st.sessions, c.Session) // its heap entry goes stale
			res.Applied = 1
		}
		return nil
	}
	// A binding whose decode (or only) worker left ends; one whose
	// prefill worker left keeps its decode worker, one-stage (its next
	// two-stage turn binds a prefill worker again).
	n := len(st.sessions)
	maps.DeleteFunc(st.sessions, func(_ string, b SessionBinding) bool { return workerOfKey(b.Worker) == c.Worker })
	res.Applied = n - len(st.sessions)
	for id, b := range st.sessions {
		if b.Prefill != "" && workerOfKey(b.Prefill) == c.Worker {
			b.Prefill = ""
			st.sessions[id] = b
			res.Applied++
		}
	}
	return nil
}

// workerOfKey is the worker id of a router key ("w#2" → "w").
func workerOfKey(k router.WorkerID) string {
	base, _, _ := strings.Cut(string(k), "#")
	return base
}

// expireSessionsLocked ends the bindings whose expiry is at or before now
// (a Tick). The order of removal cannot show (only the set is state).
// f.mu held.
func (f *FSM) expireSessionsLocked(now int64) int {
	st := f.st
	n := 0
	for st.sessionHeap.Len() > 0 && st.sessionHeap[0].until <= now {
		e := heap.Pop(&st.sessionHeap).(sessionEntry)
		if st.sessionEntryLive(e) {
			delete(st.sessions, e.session)
			n++
		}
	}
	return n
}

// Session returns the binding of a session (a local read: no consensus).
func (f *FSM) Session(id string) (SessionBinding, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	b, ok := f.st.sessions[id]
	return b, ok
}

// Sessions lists every binding, sorted by session id.
func (f *FSM) Sessions() []SessionBinding {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make([]SessionBinding, 0, len(f.st.sessions))
	for _, b := range f.st.sessions {
		out = append(out, b)
	}
	slices.SortFunc(out, func(a, b SessionBinding) int { return strings.Compare(a.Session, b.Session) })
	return out
}

// SessionCount is the number of bindings held.
func (f *FSM) SessionCount() int {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return len(f.st.sessions)
}

// SessionsPerWorker counts the bindings per worker id (all its ranks), a
// two-stage binding once for each stage's worker.
func (f *FSM) SessionsPerWorker() map[string]int {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make(map[string]int)
	for _, b := range f.st.sessions {
		out[workerOfKey(b.Worker)]++
		if b.Prefill != "" {
			out[workerOfKey(b.Prefill)]++
		}
	}
	return out
}

// SessionsOf lists the sessions bound to a worker id's ranks (either
// stage), sorted.
func (f *FSM) SessionsOf(worker string) []string {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var out []string
	for id, b := range f.st.sessions {
		if workerOfKey(b.Worker) == worker || (b.Prefill != "" && workerOfKey(b.Prefill) == worker) {
			out = append(out, id)
		}
	}
	slices.Sort(out)
	return out
}

// CheckBindSession returns the error apply would give c now, or nil; the
// binding it would leave is not predicted (a concurrent proposer may win).
func (f *FSM) CheckBindSession(c BindSession) error {
	if err := c.Validate(); err != nil {
		return err
	}
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.checkBindLocked(c.Session, c.Until)
}

// CheckBindSessionStages is CheckBindSession for a two-stage binding.
func (f *FSM) CheckBindSessionStages(c BindSessionStages) error {
	if err := c.Validate(); err != nil {
		return err
	}
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.checkBindLocked(c.Session, c.Until)
}

// checkBindLocked: the clock and the limit. f.mu held for reading.
func (f *FSM) checkBindLocked(session string, until int64) error {
	if until <= f.st.lastTick {
		return fmt.Errorf("bind session %q: until %d is not after the clock %d: %w", session, until, f.st.lastTick, ErrInvalidCommand)
	}
	if _, bound := f.st.sessions[session]; !bound && len(f.st.sessions) >= MaxSessionBindings {
		return fmt.Errorf("bind session %q: %d bindings held: %w", session, len(f.st.sessions), ErrSessionLimit)
	}
	return nil
}

// Snapshot side: sessions are record recSession (format 7), sorted by id;
// from format 9 (SnapshotFormatSessionStages, written exactly while a
// binding has a prefill stage) every session record ends with the prefill
// worker ("" for a one-stage binding).

func (img *image) captureSessions(st *state) {
	for _, b := range st.sessions {
		img.sessions = append(img.sessions, b)
	}
	slices.SortFunc(img.sessions, func(a, b SessionBinding) int { return strings.Compare(a.Session, b.Session) })
}

func appendSessionRecord(b []byte, s *SessionBinding, stages bool) []byte {
	b = appendString(b, s.Session)
	b = appendString(b, string(s.Worker))
	b = appendString(b, s.Parent)
	b = binary.AppendVarint(b, s.Until)
	if stages {
		b = appendString(b, string(s.Prefill))
	}
	return b
}

// readSessionRecord reads and checks one binding of a snapshot; stages:
// the record ends with the prefill stage (format 9).
func readSessionRecord(st *state, rd *reader, stages bool) error {
	s := SessionBinding{Session: rd.string("session id"), Worker: router.WorkerID(rd.string("worker")),
		Parent: rd.string("parent session id"), Until: rd.varint()}
	if stages {
		s.Prefill = router.WorkerID(rd.string("prefill worker"))
	}
	if rd.err != nil {
		return nil // reported by rd.done
	}
	var err error
	if s.Prefill != "" {
		err = BindSessionStages{Session: s.Session, Prefill: s.Prefill, Decode: s.Worker, Parent: s.Parent, Until: s.Until}.Validate()
	} else {
		err = BindSession{Session: s.Session, Worker: s.Worker, Parent: s.Parent, Until: s.Until}.Validate()
	}
	if err != nil {
		return corrupt("session: %v", err)
	}
	if _, dup := st.sessions[s.Session]; dup || s.Until <= st.lastTick || len(st.sessions) >= MaxSessionBindings {
		return corrupt("session %q repeated, expired by the clock, or beyond %d bindings", s.Session, MaxSessionBindings)
	}
	st.sessions[s.Session] = s
	return nil
}
