// Package fsm is kvrouter's Raft state machine: the worker registry, the
// per-model router configuration, the KV block index with its per-worker
// event cursors, replicated kv-approx predictions and cluster node metadata.
//
// It is pure: Apply never reads the clock, draws random numbers or lets map
// order reach the state, so a Raft log replays offline into the same state
// on any machine (compare with Digest). See DESIGN.md.
package fsm

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/router"
)

// WorkerRecord is a registered worker, as its last RegisterWorker set it
// (BlockSize filled in with the cluster default when the command left it 0).
type WorkerRecord struct {
	ID               string
	DPRanks          uint32
	Address          string
	Model            string
	BlockSize        int
	TotalBlocks      int
	MaxBatchedTokens int
	LeaseUntil       int64
	Role             router.Role // "" = both
}

// Keys are the router worker ids of the worker's ranks, in rank order.
func (w WorkerRecord) Keys() []router.WorkerID {
	out := make([]router.WorkerID, w.DPRanks)
	for r := range out {
		out[r] = router.WorkerKey(w.ID, uint32(r))
	}
	return out
}

// NodeRecord is one replica's addresses.
type NodeRecord struct {
	ID       string
	RaftAddr string
	HTTPAddr string
}

// RankKey names one data-parallel rank of a worker.
type RankKey struct {
	Worker string
	DPRank uint32
}

// ID is the rank's router worker id.
func (k RankKey) ID() router.WorkerID { return router.WorkerKey(k.Worker, k.DPRank) }

// StaleInfo says why a worker rank's blocks may not match its cache: a gap
// in its event ids or an event whose parent block it does not hold. It stays
// until a ResyncWorker (the first reason is kept: later ones are symptoms).
type StaleInfo struct {
	Reason  string // "gap from X to Y" (event Y followed X) or "missing parent"
	EventID uint64 // the event that revealed it (0 = unsequenced)
}

// Reasons a KV event is rejected, the keys of Stats.Rejected.
const (
	RejectUnknownWorker = "unknown_worker"
	RejectBlockSize     = "block_size_mismatch"
	RejectMissingParent = "missing_parent"
	RejectInvalid       = "invalid_event"
	// RejectOverCapacity: a stored event that would take its rank past
	// RankBlockCap blocks (refused whole; the rank is marked stale).
	RejectOverCapacity = "over_capacity"
)

// StaleOverCapacity is the stale reason of a rank whose stored event was
// refused by its block cap: the index holds more than the worker can, so
// it no longer follows the worker's cache.
const StaleOverCapacity = "over capacity"

// ApplyResult is the response of every command entry (raft's
// ApplyFuture.Response()). Domain errors are in Err; Apply never panics on
// log content.
type ApplyResult struct {
	Type       CommandType
	Applied    int // KV events applied; for other commands 1 on success (hashes recorded for Predictions)
	Duplicates int // KV events skipped: event id at or below the rank's cursor
	Gaps       int // KV events that followed a gap (applied, rank marked stale)
	Rejected   int // KV events not applied: unknown worker, block size, missing parent
	Unknown    int // of Rejected: events of unregistered worker ranks
	// OverCapacity: of Rejected, stored events refused because their rank
	// would have held more than RankBlockCap blocks.
	OverCapacity int
	Expired      int // Tick: predictions and leases expired
	// Clamped: a time the command carried (Tick.Now, a lease, a
	// prediction's Until) was beyond the FSM's bounds and was applied
	// clamped (see clock.go).
	Clamped bool

	UnknownWorkers []router.WorkerID // distinct unregistered ranks named (first 16)
	Stale          []router.WorkerID // ranks this entry marked stale

	// Session: BindSession's (or BindSessionStages') binding in force
	// after the entry (the proposer's, or the one that committed first).
	Session *SessionBinding

	Ignored  bool // unknown type or version with the ignore bit: skipped
	Replayed bool // index at or below the applied index: skipped
	Err      error
}

const maxReportedUnknown = 16

// ChangeKind says what an applied entry changed, for observers.
type ChangeKind uint8

// Change kinds.
const (
	ChangeWorkers     ChangeKind = iota + 1 // a worker registered, changed, deregistered or its lease expired
	ChangeModelConfig                       // a model's configuration changed
	ChangeNodes                             // a node registered, changed or was removed
	ChangeStale                             // a worker rank was marked stale
	ChangeResync                            // a worker rank's blocks and cursor were cleared
	ChangeRestored                          // the whole state was replaced from a snapshot
	// ChangeOverCapacity: stored events of a worker rank were refused by
	// its block cap (one per rank per entry; Reason says how full).
	ChangeOverCapacity
	// ChangePlacement: a worker was placed in a data group, moved to
	// another, or its placement removed (Removed); Reason says which.
	ChangePlacement
	// ChangeGroups: SetGroups raised the number of data groups; Reason
	// says from and to ("data groups 2 → 3").
	ChangeGroups
	// ChangeDrain: a worker was drained, undrained (Removed) or its drain
	// deadline changed; Reason says which. A completed drain is a
	// ChangeWorkers (Removed, Reason "drained").
	ChangeDrain
)

func (k ChangeKind) String() string {
	switch k {
	case ChangeWorkers:
		return "workers"
	case ChangeModelConfig:
		return "model-config"
	case ChangeNodes:
		return "nodes"
	case ChangeStale:
		return "stale"
	case ChangeResync:
		return "resync"
	case ChangeRestored:
		return "restored"
	case ChangeOverCapacity:
		return "over-capacity"
	case ChangePlacement:
		return "placement"
	case ChangeGroups:
		return "groups"
	case ChangeDrain:
		return "drain"
	}
	return fmt.Sprintf("ChangeKind(%d)", uint8(k))
}

// Change is one change observers hear about after it is applied.
type Change struct {
	Kind    ChangeKind
	Index   uint64 // log index (the snapshot's applied index for ChangeRestored)
	Worker  string
	DPRank  uint32
	Model   string
	Node    string
	Removed bool   // the worker or node (or the worker's placement) is gone
	Reason  string // "registered", "updated", "deregistered", "lease expired", a stale reason, "placed in group N"…
}

// Stats are this replica's counters since NewFSM. They are diagnostics, not
// replicated state: they are not in snapshots or the digest.
type Stats struct {
	Commands     uint64 // command entries applied (with or without a domain error)
	DomainErrors uint64 // commands refused with a domain error (state unchanged)
	Undecodable  uint64 // entries that did not decode (state unchanged)
	UnknownTypes uint64 // unknown type or version without the ignore bit (state unchanged)
	Ignored      uint64 // unknown type or version with the ignore bit
	Replayed     uint64 // entries at or below the applied index

	Events     uint64            // KV events seen
	Applied    uint64            // KV events applied
	Duplicates uint64            // KV events skipped as already applied
	Gaps       uint64            // gaps in event ids
	Rejected   map[string]uint64 // KV events rejected, by Reject* reason

	ExpiredPredictions uint64
	ExpiredLeases      uint64
	ClampedTimes       uint64 // commands whose time was clamped (ApplyResult.Clamped)
	// OversizeEntries: entries refused for exceeding MaxEntryBytes (also
	// counted in Undecodable).
	OversizeEntries uint64
	// OverCapacityBlocks: blocks of the stored events refused by their
	// rank's block cap (the events are in Rejected[RejectOverCapacity]).
	OverCapacityBlocks uint64

	HaltedEntries uint64 // entries refused because the FSM is halted (Halted)
}

type counters struct {
	commands, domainErrors, undecodable, unknownTypes, ignored, replayed atomic.Uint64
	events, applied, duplicates, gaps                                    atomic.Uint64
	unknownWorker, blockSize, missingParent, invalid, overCapacity       atomic.Uint64
	expiredPredictions, expiredLeases, clampedTimes                      atomic.Uint64
	haltedEntries, oversizeEntries, overCapacityBlocks                   atomic.Uint64
}

// FSM is the replicated state machine. Raft calls Apply, ApplyBatch,
// Snapshot and Restore from one goroutine; every read method is safe to
// call concurrently with them.
type FSM struct {
	base router.Config // validated; never mutated

	// mu guards st and the apply scratch below. Apply holds it for writing
	// for one entry at a time; readers take it for reading. The indexes have
	// their own locks, so routing (FindMatches) never waits for mu.
	mu      sync.RWMutex
	st      *state
	applied atomic.Uint64 // written with mu held
	gen     atomic.Uint64 // bumped by Restore (digest cache key)
	dec     kvDecoder     // mu held
	changes []Change      // mu held: collected during apply, sent after unlock
	one     [1]uint64     // mu held: scratch for single removals
	// mu held: applyEventsLocked's scratch, reused from entry to entry.
	plans     []eventPlan
	batch     []router.BatchEvent
	batchErrs []error

	// The current indexes, readable without mu. Restore swaps them.
	index     atomic.Pointer[router.Index]
	predicted atomic.Pointer[router.Index]

	stats counters
	// refused: per worker id, blocks its ranks' stored events had refused
	// by their block cap since NewFSM (mu held). A diagnostic like stats,
	// not replicated state: in no snapshot or digest; a worker's entry
	// goes when the worker leaves the registry.
	refused map[string]uint64

	// ckpt: the digest checkpoints (checkpoint.go).
	ckpt checkpoints

	// halt is set (under mu) by the first entry this build cannot apply,
	// and cleared by Restore; read without mu by Halted.
	halt atomic.Pointer[HaltError]

	// Tests lower these to act as an older build: the newest command type
	// and snapshot format it knows (0 = this build's).
	newestType   CommandType
	newestFormat byte
	// Tests set this to apply KV batches through the event-by-event
	// reference (the loop before router.Index.ApplyBatch), to compare.
	eventsOneByOne func(f *FSM, idx uint64, evs []KVBatchEvent, res *ApplyResult)
	// Tests lower this to exercise the refusal of oversized entries
	// without allocating MaxEntryBytes (0 = MaxEntryBytes).
	maxEntry int

	obsMu     sync.Mutex
	observers []func(Change)

	digestMu    sync.Mutex
	digestKey   [2]uint64 // applied index, generation
	digestValue string
}

// state is everything replicated: Restore builds a fresh one and swaps it in.
type state struct {
	blockSize int
	lastTick  int64 // largest Tick.Now applied: the FSM's clock

	index     *router.Index // worker events
	predicted *router.Index // kv-approx predictions

	workers map[string]*workerState
	ranks   map[router.WorkerID]*rankState
	models  map[string]*SetModelConfig // overrides of the base config (Reset always 0)
	nodes   map[string]NodeRecord

	preds map[router.WorkerID]map[uint64]int64 // rank → hash → until
	heap  predHeap                             // expiry order; stale entries skipped lazily
	live  int                                  // entries in preds

	// modelSizes: per model with registered workers, the block size they
	// all have and how many they are. Derived from workers (Restore
	// rebuilds it), so it is in no snapshot.
	modelSizes map[string]modelSize

	// The placement map (control group, issue 19): worker id → data group
	// in 1..groups. groups is fixed by the first placement (or SetGroups),
	// only ever raised (SetGroups) and never cleared (0 = neither was ever
	// applied); it outlives the placements.
	// Independent of the registry: the control group registers no worker.
	placements map[string]uint32
	groups     uint32

	// Session bindings (control group, issue 28; sessions.go): session id
	// → binding, and their expiries in a heap (derived: Restore rebuilds
	// it; refreshed or ended bindings leave stale entries, skipped).
	sessions    map[string]SessionBinding
	sessionHeap sessionHeap

	// Prefix pins (control group, issue 28; pins.go): (model, last block
	// hash) → holder → pin. pinned (each holder's distinct pinned blocks,
	// with the number of its pins covering each), pinCount and pinHeap are
	// derived: Restore rebuilds them as it reads the pins.
	pins     map[pinKey]map[router.WorkerID]*Pin
	pinned   map[pinnedKey]map[uint64]int32
	pinCount int
	pinHeap  pinHeap
	// pinFirst lists the pins by their first block (derived): a prompt
	// can start with a pinned prefix only if it starts with that block,
	// so PinLookup compares a few pins instead of hashing every block.
	pinFirst map[uint64][]*Pin
}

// modelSize is the block size a model's registered workers share.
type modelSize struct {
	blockSize int
	workers   int
}

type workerState struct {
	rec   WorkerRecord
	ranks []*rankState // len = rec.DPRanks
	// drain is set while the worker is drained (drain.go); it lives and
	// dies with the registration: a renewal keeps it, a deregistration or
	// lease expiry drops it.
	drain *drainState
}

// rankState is one worker rank's cursor and health.
type rankState struct {
	worker string
	rank   uint32
	key    router.WorkerID

	last     uint64 // last sequenced event id consumed (applied or rejected)
	resynced bool   // the next sequenced event sets the baseline
	stale    bool
	reason   string
	staleID  uint64

	restored bool // readSnapshot only: its cursor record was read
}

func newState(blockSize int) *state {
	return &state{
		blockSize: blockSize,
		index:     router.NewIndex(blockSize),
		predicted: router.NewIndex(blockSize),
		workers:   make(map[string]*workerState),
		ranks:     make(map[router.WorkerID]*rankState),
		models:    make(map[string]*SetModelConfig),
		nodes:     make(map[string]NodeRecord),
		preds:     make(map[router.WorkerID]map[uint64]int64),

		modelSizes: make(map[string]modelSize),
		placements: make(map[string]uint32),
		sessions:   make(map[string]SessionBinding),
		pins:       make(map[pinKey]map[router.WorkerID]*Pin),
		pinned:     make(map[pinnedKey]map[uint64]int32),
		pinFirst:   make(map[uint64][]*Pin),
	}
}

// NewFSM returns an empty state machine. base is the router configuration
// every model starts from (SetModelConfig overrides it per model); its
// BlockSize is the cluster default, fixed for the life of the cluster: the
// block size of every model whose workers register without their own
// (RegisterWorker.OwnBlockSize).
func NewFSM(base router.Config) (*FSM, error) {
	if err := base.Validate(); err != nil {
		return nil, fmt.Errorf("fsm base config: %w", err)
	}
	f := &FSM{base: cloneConfig(base), st: newState(base.BlockSize), refused: make(map[string]uint64)}
	f.index.Store(f.st.index)
	f.predicted.Store(f.st.predicted)
	return f, nil
}

var _ raft.BatchingFSM = (*FSM)(nil)

// Apply applies one log entry. The response is a *ApplyResult for command
// entries, nil for others.
func (f *FSM) Apply(l *raft.Log) any {
	f.mu.Lock()
	res := f.applyLocked(l)
	f.checkpointLocked(l.Index)
	changes := f.takeChangesLocked()
	f.mu.Unlock()
	f.notify(changes)
	if res == nil {
		return nil
	}
	return res
}

// ApplyBatch applies entries in order; observers hear about the changes
// after the whole batch. The lock is taken per entry, not per batch, so
// readers of the registry and configuration wait at most one entry.
func (f *FSM) ApplyBatch(logs []*raft.Log) []any {
	out := make([]any, len(logs))
	for i, l := range logs {
		f.mu.Lock()
		if res := f.applyLocked(l); res != nil {
			out[i] = res
		}
		f.checkpointLocked(l.Index)
		f.mu.Unlock()
	}
	f.mu.Lock()
	changes := f.takeChangesLocked()
	f.mu.Unlock()
	f.notify(changes)
	return out
}

// applyLocked applies one entry. f.mu must be held for writing.
func (f *FSM) applyLocked(l *raft.Log) *ApplyResult {
	if l.Index <= f.applied.Load() {
		f.stats.replayed.Add(1)
		if l.Type != raft.LogCommand {
			return nil
		}
		return &ApplyResult{Replayed: true}
	}
	if h := f.halt.Load(); h != nil {
		// Nothing after an entry this build cannot apply is applied either:
		// the state stays that of the entries before it, and the applied
		// index does not move (see DESIGN.md, Version skew).
		f.stats.haltedEntries.Add(1)
		if l.Type != raft.LogCommand {
			return nil
		}
		return &ApplyResult{Err: fmt.Errorf("apply log %d: not applied, %w since log index %d (command type %d version %d unknown to this build)",
			l.Index, ErrHalted, h.Index, uint8(h.Type), h.Version)}
	}
	if l.Type != raft.LogCommand {
		f.applied.Store(l.Index)
		return nil
	}
	if limit := cmp.Or(f.maxEntry, MaxEntryBytes); len(l.Data) > limit {
		// No proposer of any build writes this: refuse it before decoding
		// anything, like an undecodable entry (see bounds.go).
		f.applied.Store(l.Index)
		f.stats.undecodable.Add(1)
		f.stats.oversizeEntries.Add(1)
		return &ApplyResult{Err: fmt.Errorf("apply log %d: %w", l.Index, errEntryTooLarge(len(l.Data)))}
	}
	t, ignore, version, payload, err := header(l.Data)
	res := &ApplyResult{Type: t}
	if err == nil && (!f.knows(t) || version != EnvelopeVersion) && !ignore {
		// A type or version this build does not know, which the proposer
		// did not mark skippable: replicas that know it apply it. Skipping
		// it would diverge silently; halt instead.
		f.stats.unknownTypes.Add(1)
		h := &HaltError{Index: l.Index, Type: t, Version: version}
		f.halt.Store(h)
		res.Err = fmt.Errorf("apply log %d: %w", l.Index, h)
		return res
	}
	f.applied.Store(l.Index)
	if err != nil {
		f.stats.undecodable.Add(1)
		res.Err = fmt.Errorf("apply log %d: %w", l.Index, err)
		return res
	}
	if !f.knows(t) || version != EnvelopeVersion {
		f.stats.ignored.Add(1)
		res.Ignored = true
		return res
	}
	if t.isKVBatch() {
		evs, err := f.dec.decode(payload, t == CmdKVEventBatchTiered)
		if err != nil {
			f.stats.undecodable.Add(1)
			res.Err = fmt.Errorf("apply log %d: %w", l.Index, err)
			return res
		}
		f.stats.commands.Add(1)
		if f.eventsOneByOne != nil {
			f.eventsOneByOne(f, l.Index, evs, res)
			return res
		}
		f.applyEventsLocked(l.Index, evs, res)
		return res
	}
	c, err := decodePayload(t, payload)
	if err != nil {
		f.stats.undecodable.Add(1)
		res.Err = fmt.Errorf("apply log %d: %w", l.Index, err)
		return res
	}
	f.stats.commands.Add(1)
	if err := f.applyCommandLocked(l.Index, c, res); err != nil {
		f.stats.domainErrors.Add(1)
		res.Err = fmt.Errorf("apply log %d %s: %w", l.Index, t, err)
		return res
	}
	if res.Clamped {
		f.stats.clampedTimes.Add(1)
	}
	return res
}

// knows reports whether this build applies type t (tests can make it an
// older build, see newestType).
func (f *FSM) knows(t CommandType) bool {
	return t.known() && (f.newestType == 0 || t <= f.newestType)
}

// applyCommandLocked applies every command but KV batches. A returned error
// is a domain error and means the state did not change.
func (f *FSM) applyCommandLocked(idx uint64, c Command, res *ApplyResult) error {
	st := f.st
	switch c := c.(type) {
	case RegisterWorker:
		return f.registerLocked(idx, c, res)
	case DeregisterWorker:
		if st.workers[c.ID] == nil {
			return fmt.Errorf("worker %q: %w", c.ID, ErrUnknownWorker)
		}
		f.removeWorkerLocked(idx, c.ID, "deregistered")
		res.Applied = 1
	case SetModelConfig:
		next, _, err := f.mergeModelLocked(c)
		if err != nil {
			return err
		}
		st.models[c.Model] = next
		f.changes = append(f.changes, Change{Kind: ChangeModelConfig, Index: idx, Model: c.Model})
		res.Applied = 1
	case Predictions:
		return f.predictLocked(c, res)
	case Tick:
		f.tickLocked(idx, c.Now, res)
	case RegisterNode:
		if c.NodeID == "" {
			return fmt.Errorf("register node: empty id: %w", ErrInvalidCommand)
		}
		rec := NodeRecord{ID: c.NodeID, RaftAddr: c.RaftAddr, HTTPAddr: c.HTTPAddr}
		if old, ok := st.nodes[c.NodeID]; !ok || old != rec {
			st.nodes[c.NodeID] = rec
			f.changes = append(f.changes, Change{Kind: ChangeNodes, Index: idx, Node: c.NodeID})
		}
		res.Applied = 1
	case RemoveNode:
		if _, ok := st.nodes[c.NodeID]; !ok {
			return fmt.Errorf("node %q: %w", c.NodeID, ErrUnknownNode)
		}
		delete(st.nodes, c.NodeID)
		f.changes = append(f.changes, Change{Kind: ChangeNodes, Index: idx, Node: c.NodeID, Removed: true})
		res.Applied = 1
	case PlaceWorker:
		return f.placeLocked(idx, c, res)
	case SetWorkerDrain:
		return f.drainLocked(idx, c, res)
	case BindSession:
		return f.bindLocked(c, res)
	case UnbindSessions:
		return f.unbindLocked(c, res)
	case BindSessionStages:
		return f.bindStagesLocked(c, res)
	case PinPrefix:
		return f.pinLocked(c, res)
	case UnpinPrefix:
		return f.unpinLocked(c, res)
	case SetGroups:
		if err := st.checkSetGroups(c); err != nil {
			return err
		}
		res.Applied = 1
		if c.Groups == st.groups {
			return nil // already that many: nothing to report
		}
		reason := fmt.Sprintf("data groups %d → %d", st.groups, c.Groups)
		st.groups = c.Groups
		f.changes = append(f.changes, Change{Kind: ChangeGroups, Index: idx, Reason: reason})
	case ResyncWorker:
		rs := st.rank(c.Worker, c.DPRank)
		if rs == nil {
			return fmt.Errorf("resync %s: %w", router.WorkerKey(c.Worker, c.DPRank), ErrUnknownWorker)
		}
		// Every tier: the worker republishes what it holds, and a
		// publisher that knows no lower tier must not leave old ones.
		for t := router.TierDevice; t < router.NumTiers; t++ {
			if t != router.TierDevice && st.index.LowerTier(t) == nil {
				continue
			}
			if err := st.index.Apply(rs.key, router.KVEvent{Kind: router.EventCleared, Tier: t}); err != nil {
				// The registry and the index agree by construction; say so loudly if not.
				return fmt.Errorf("resync %s: index: %w", rs.key, err)
			}
		}
		rs.last, rs.resynced = 0, true
		rs.stale, rs.reason, rs.staleID = false, "", 0
		f.changes = append(f.changes, Change{Kind: ChangeResync, Index: idx, Worker: c.Worker, DPRank: c.DPRank})
		res.Applied = 1
	default:
		return fmt.Errorf("%T: %w", c, ErrUnknownCommand)
	}
	return nil
}

// checkPlace returns the domain error that refuses p, or nil: its own
// fields, and a group count other than the one the first placement fixed.
// f.mu held (read).
func (st *state) checkPlace(p PlaceWorker) error {
	if err := p.Validate(); err != nil {
		return err
	}
	if st.groups != 0 && p.Groups != st.groups {
		// The proposer runs another number of data groups than the one
		// this cluster's placements were made for: placing by it would
		// send workers to groups other replicas lack or never read.
		return fmt.Errorf("place worker %q: proposed for %d data groups, the placements are for %d: %w",
			p.Worker, p.Groups, st.groups, ErrInvalidCommand)
	}
	return nil
}

// checkSetGroups returns the domain error that refuses c, or nil: its own
// bounds, a count below the cluster's, and, when c carries the nodes its
// proposer checked, a registered node not among them. f.mu held (read).
func (st *state) checkSetGroups(c SetGroups) error {
	if err := c.Validate(); err != nil {
		return err
	}
	if c.Groups < st.groups {
		// Placements may point into the groups beyond c.Groups; no
		// replica would run them any more.
		return fmt.Errorf("set groups: cannot shrink from %d to %d: workers placed in the groups beyond would be lost: %w",
			st.groups, c.Groups, ErrInvalidCommand)
	}
	if c.Checked == nil {
		return nil // the unchecked command of older proposers (type 14)
	}
	var missing []string
	for id := range st.nodes {
		if _, ok := slices.BinarySearch(c.Checked, id); !ok {
			missing = append(missing, id)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	// Sorted, so every replica gives the same error whatever the map's
	// order.
	slices.Sort(missing)
	names := make([]string, 0, 8)
	for _, id := range missing[:min(len(missing), 8)] {
		names = append(names, fmt.Sprintf("%q", id))
	}
	if len(missing) > 8 {
		names = append(names, fmt.Sprintf("and %d more", len(missing)-8))
	}
	what := "node"
	if len(missing) > 1 {
		what = "nodes"
	}
	return fmt.Errorf("set groups to %d: %s %s registered after the check (%d checked); retry: %w",
		c.Groups, what, strings.Join(names, ", "), len(c.Checked), ErrUncheckedNode)
}

// placeLocked sets, moves or removes a worker's placement. f.mu held.
func (f *FSM) placeLocked(idx uint64, p PlaceWorker, res *ApplyResult) error {
	st := f.st
	if err := st.checkPlace(p); err != nil {
		return err
	}
	res.Applied = 1
	old, placed := st.placements[p.Worker]
	var reason string
	switch {
	case p.Remove && !placed, !p.Remove && placed && old == p.Group:
		return nil // nothing changes: no change to report
	case p.Remove:
		// A removal fixes no group count: with nothing ever placed it
		// leaves the state (and its snapshot format) as it was.
		delete(st.placements, p.Worker)
		reason = fmt.Sprintf("removed from group %d", old)
	case placed:
		st.placements[p.Worker] = p.Group
		reason = fmt.Sprintf("moved from group %d to %d", old, p.Group)
	default:
		st.groups = p.Groups
		st.placements[p.Worker] = p.Group
		reason = fmt.Sprintf("placed in group %d", p.Group)
	}
	f.changes = append(f.changes, Change{Kind: ChangePlacement, Index: idx, Worker: p.Worker, Removed: p.Remove, Reason: reason})
	return nil
}

// rank returns a registered worker rank, or nil.
func (st *state) rank(worker string, rank uint32) *rankState {
	ws := st.workers[worker]
	if ws == nil || rank >= uint32(len(ws.ranks)) {
		return nil
	}
	return ws.ranks[rank]
}

// checkRegister returns the domain error that refuses c, or nil. c's
// BlockSize is filled in (0 = the cluster default).
//
// The rule: a registration without OwnBlockSize must have the cluster
// default (as in every build before per-model block sizes, so such entries
// apply alike on all builds); and a model's workers share one block size,
// fixed by the first registered while any of them is registered. A worker
// re-registering may change its own block size when no other worker of
// its model is registered.
func (st *state) checkRegister(c RegisterWorker) error {
	if err := c.Validate(); err != nil {
		return err
	}
	if !c.OwnBlockSize && c.BlockSize != st.blockSize {
		// A worker with another block size could never match the model's
		// prompts: refuse it loudly. Builds before per-model block sizes
		// refuse this too, and know no other registration.
		return fmt.Errorf("register worker %q: block size %d, cluster default %d (another block size registers as %s): %w",
			c.ID, c.BlockSize, st.blockSize, CmdRegisterWorkerBlockSize, ErrBlockSizeMismatch)
	}
	ms, ok := st.modelSizes[c.Model]
	if !ok || ms.blockSize == c.BlockSize {
		return nil
	}
	others := ms.workers
	if ws := st.workers[c.ID]; ws != nil && ws.rec.Model == c.Model {
		others--
	}
	if others > 0 {
		// The model's prompts are hashed with one block size: a worker
		// with another would never match them.
		return fmt.Errorf("register worker %q: block size %d, model %q uses %d (the block size of its %d registered workers): %w",
			c.ID, c.BlockSize, c.Model, ms.blockSize, others, ErrBlockSizeMismatch)
	}
	return nil
}

// countWorker adds (n = 1) or removes (n = -1) rec in its model's block size.
func (st *state) countWorker(rec WorkerRecord, n int) {
	ms := st.modelSizes[rec.Model]
	ms.blockSize, ms.workers = rec.BlockSize, ms.workers+n
	if ms.workers <= 0 {
		delete(st.modelSizes, rec.Model)
		return
	}
	st.modelSizes[rec.Model] = ms
}

// registerLocked adds or updates a worker. f.mu held.
func (f *FSM) registerLocked(idx uint64, c RegisterWorker, res *ApplyResult) error {
	st := f.st
	if c.BlockSize == 0 {
		c.BlockSize = st.blockSize
	}
	if err := st.checkRegister(c); err != nil {
		return err
	}
	if c.LeaseUntil != 0 {
		c.LeaseUntil, res.Clamped = st.clampAheadLocked(c.LeaseUntil)
	}
	rec := c.record()
	ws := st.workers[c.ID]
	reason := "updated"
	if ws == nil {
		ws = &workerState{}
		st.workers[c.ID] = ws
		reason = "registered"
	} else {
		st.countWorker(ws.rec, -1)
		if ws.rec.BlockSize != rec.BlockSize {
			// Its blocks were hashed at the old size: every rank starts
			// afresh, as after a deregistration.
			for _, rs := range ws.ranks {
				st.removeRank(rs)
			}
			ws.ranks = nil
		}
	}
	st.countWorker(rec, 1)
	old := ws.rec
	ws.rec = rec
	for r := uint32(len(ws.ranks)); r < rec.DPRanks; r++ {
		ws.ranks = append(ws.ranks, st.addRank(c.ID, r, rec.BlockSize))
	}
	for r := len(ws.ranks) - 1; r >= int(rec.DPRanks); r-- {
		st.removeRank(ws.ranks[r])
		ws.ranks[r] = nil
	}
	ws.ranks = ws.ranks[:rec.DPRanks]
	old.LeaseUntil = rec.LeaseUntil
	if reason == "registered" || old != rec {
		// A lease renewal alone changes no candidate set: stay quiet.
		f.changes = append(f.changes, Change{Kind: ChangeWorkers, Index: idx, Worker: c.ID, Model: c.Model, Reason: reason})
	}
	res.Applied = 1
	return nil
}

func (st *state) addRank(worker string, r uint32, blockSize int) *rankState {
	rs := &rankState{worker: worker, rank: r, key: router.WorkerKey(worker, r)}
	st.index.AddWorkerBlockSize(rs.key, blockSize)
	st.predicted.AddWorkerBlockSize(rs.key, blockSize)
	st.ranks[rs.key] = rs
	return rs
}

func (st *state) removeRank(rs *rankState) {
	st.index.RemoveWorker(rs.key)
	st.predicted.RemoveWorker(rs.key)
	delete(st.ranks, rs.key)
	if m := st.preds[rs.key]; m != nil {
		st.live -= len(m)
		delete(st.preds, rs.key) // its heap entries are skipped when they surface
	}
}

// removeWorkerLocked drops a worker with its ranks, blocks, predictions and
// cursors: a worker that comes back starts afresh. f.mu held.
func (f *FSM) removeWorkerLocked(idx uint64, id, reason string) {
	st := f.st
	ws := st.workers[id]
	for _, rs := range ws.ranks {
		st.removeRank(rs)
	}
	st.countWorker(ws.rec, -1)
	delete(st.workers, id)
	delete(f.refused, id)
	f.changes = append(f.changes, Change{Kind: ChangeWorkers, Index: idx, Worker: id, Model: ws.rec.Model, Removed: true, Reason: reason})
}

// applyEventsLocked applies a decoded KV batch, in three passes that keep
// the event-by-event order of every effect:
//
//  1. per event: look up the rank, dedupe and gap-check by event id
//     (moving the cursors), check the block size, and plan what follows
//     (the cursors depend on nothing the index decides);
//  2. the planned events go to the index in one router.Index.ApplyBatch:
//     one lock, the table slots of the events ahead read while the earlier
//     ones apply, the counters reached once;
//  3. per event again, in order: the gap's stale mark, then the index's
//     outcome (counted; a missing parent or a cap marks the rank stale, a
//     cleared device cache clears the mark).
//
// Stale marks keep their first reason and are reported in order, so pass 3
// makes them exactly where the event-by-event loop did (pass 1 reads no
// stale flag). Nothing here fails the entry: each event's outcome is
// counted. f.mu held.
func (f *FSM) applyEventsLocked(idx uint64, evs []KVBatchEvent, res *ApplyResult) {
	st := f.st
	var applied, dups, gaps, rejUnknown, rejSize, rejParent, rejInvalid, rejOver, overBlocks int
	plans := f.plans[:0]
	batch := f.batch[:0]
	for i := range evs {
		e := &evs[i]
		p := eventPlan{to: planUnknown}
		ws := st.workers[e.Worker]
		if ws == nil || e.DPRank >= uint32(len(ws.ranks)) {
			rejUnknown++
			if len(res.UnknownWorkers) < maxReportedUnknown {
				if k := router.WorkerKey(e.Worker, e.DPRank); !slices.Contains(res.UnknownWorkers, k) {
					res.UnknownWorkers = append(res.UnknownWorkers, k)
				}
			}
			plans = append(plans, p)
			continue
		}
		rs := ws.ranks[e.DPRank]
		p.ws, p.rs = ws, rs
		if id := e.EventID; id != 0 {
			switch {
			case rs.resynced:
				rs.resynced = false // a new baseline after a resync: no gap
			case id <= rs.last:
				p.to = planDuplicate
				plans = append(plans, p)
				dups++
				continue
			case id > rs.last+1:
				p.gap, p.gapFrom = true, rs.last
				gaps++
			}
			// The cursor moves for every event consumed, applied or rejected:
			// a rejected event would be rejected again, and it is no gap.
			rs.last = id
		}
		if bs := e.Event.BlockSize; bs != 0 && bs != ws.rec.BlockSize {
			p.to = planSizeMismatch
			plans = append(plans, p)
			continue
		}
		limit := RankBlockCap(ws.rec.TotalBlocks)
		if e.Event.Tier != router.TierDevice {
			limit = LowerTierBlockCap
		}
		p.to = planIndex
		plans = append(plans, p)
		batch = append(batch, router.BatchEvent{Worker: rs.key, Event: &e.Event, MaxHeld: limit})
	}
	if cap(f.batchErrs) < len(batch) {
		f.batchErrs = make([]error, len(batch))
	}
	errs := f.batchErrs[:len(batch)]
	st.index.ApplyBatch(batch, errs)

	var over []*rankState // ranks refused by their cap in this entry (few)
	next := 0             // the next event's place in batch and errs
	for i := range evs {
		e, p := &evs[i], &plans[i]
		if p.gap {
			f.markStaleLocked(idx, p.rs, fmt.Sprintf("gap from %d to %d", p.gapFrom, e.EventID), e.EventID, res)
		}
		switch p.to {
		case planSizeMismatch:
			rejSize++
			continue
		case planIndex:
		default:
			continue
		}
		err := errs[next]
		next++
		rs, ws := p.rs, p.ws
		if err == nil {
			applied++
			if e.Event.Kind == router.EventCleared && e.Event.Tier == router.TierDevice && rs.stale {
				// The worker says its cache is empty: index and worker agree
				// again, and what follows chains from nothing.
				rs.stale, rs.reason, rs.staleID = false, "", 0
			}
			continue
		}
		var mp *router.MissingParentError
		var ce *router.CapacityError
		switch {
		case errors.As(err, &mp):
			rejParent++
			f.markStaleLocked(idx, rs, "missing parent", e.EventID, res)
		case errors.As(err, &ce):
			// The index would hold more of this rank than twice what the
			// worker can: refuse, deterministically (held counts are
			// replicated state, the cap comes from the registry), and have
			// the rank resynced.
			rejOver++
			overBlocks += ce.Adding
			f.refused[ws.rec.ID] += uint64(ce.Adding)
			f.markStaleLocked(idx, rs, StaleOverCapacity, e.EventID, res)
			if !slices.Contains(over, rs) {
				over = append(over, rs)
				f.changes = append(f.changes, Change{Kind: ChangeOverCapacity, Index: idx, Worker: rs.worker, DPRank: rs.rank,
					Reason: fmt.Sprintf("holds %d blocks, cap %d (registered capacity %d)", ce.Held, ce.Limit, ws.rec.TotalBlocks)})
			}
		case errors.Is(err, router.ErrBlockSizeMismatch):
			rejSize++
		case errors.Is(err, router.ErrUnknownWorker):
			rejUnknown++ // registry and index disagree: cannot happen, count it anyway
		default:
			rejInvalid++
		}
	}
	// The scratch keeps no pointers into this entry past it (the decoder's
	// buffers hold the events), and no error values.
	clear(plans)
	clear(batch)
	clear(errs)
	f.plans, f.batch = plans[:0], batch[:0]

	rejected := rejUnknown + rejSize + rejParent + rejInvalid + rejOver
	res.Applied, res.Duplicates, res.Gaps, res.Rejected, res.Unknown = applied, dups, gaps, rejected, rejUnknown
	res.OverCapacity = rejOver
	slices.Sort(res.UnknownWorkers)
	s := &f.stats
	s.events.Add(uint64(len(evs)))
	s.applied.Add(uint64(applied))
	s.duplicates.Add(uint64(dups))
	s.gaps.Add(uint64(gaps))
	s.unknownWorker.Add(uint64(rejUnknown))
	s.blockSize.Add(uint64(rejSize))
	s.missingParent.Add(uint64(rejParent))
	s.invalid.Add(uint64(rejInvalid))
	if rejOver > 0 {
		s.overCapacity.Add(uint64(rejOver))
		s.overCapacityBlocks.Add(uint64(overBlocks))
	}
}

// eventPlan is what pass 1 of applyEventsLocked decided for one event.
type eventPlan struct {
	to      planTo
	gap     bool   // the event's id skipped past the cursor: mark the rank stale
	gapFrom uint64 // the cursor it skipped from
	ws      *workerState
	rs      *rankState
}

type planTo uint8

const (
	planUnknown      planTo = iota // no such worker or rank: counted in pass 1
	planDuplicate                  // id at or below the cursor: counted in pass 1
	planSizeMismatch               // block size other than the worker's
	planIndex                      // to the index
)

// markStaleLocked records the first reason a rank went stale. f.mu held.
func (f *FSM) markStaleLocked(idx uint64, rs *rankState, reason string, eventID uint64, res *ApplyResult) {
	if rs.stale {
		return
	}
	rs.stale, rs.reason, rs.staleID = true, reason, eventID
	res.Stale = append(res.Stale, rs.key)
	f.changes = append(f.changes, Change{Kind: ChangeStale, Index: idx, Worker: rs.worker, DPRank: rs.rank, Reason: reason})
}

// predictLocked records predicted blocks. f.mu held.
func (f *FSM) predictLocked(c Predictions, res *ApplyResult) error {
	if err := c.Validate(); err != nil {
		return err
	}
	st := f.st
	rs := st.ranks[c.Worker]
	if rs == nil {
		return fmt.Errorf("predictions for %s: %w", c.Worker, ErrUnknownWorker)
	}
	if c.Until <= st.lastTick || len(c.Hashes) == 0 {
		return nil // already expired by the FSM's clock: nothing to keep
	}
	c.Until, res.Clamped = st.clampAheadLocked(c.Until)
	m := st.preds[rs.key]
	if m == nil {
		m = make(map[uint64]int64, len(c.Hashes))
		st.preds[rs.key] = m
	}
	var fresh []router.StoredBlock
	for _, h := range c.Hashes {
		old, ok := m[h]
		if ok && old >= c.Until {
			continue // a prediction never shortens another
		}
		if !ok {
			fresh = append(fresh, router.StoredBlock{EngineHash: h, ContentHash: h})
			st.live++
		}
		m[h] = c.Until
		st.heap.push(predEntry{until: c.Until, key: rs.key, hash: h})
		res.Applied++
	}
	if len(fresh) > 0 {
		// Predictions need no parent: the router placed the whole chain.
		if err := st.predicted.Apply(rs.key, router.KVEvent{Kind: router.EventStored, Blocks: fresh}); err != nil {
			return fmt.Errorf("predictions for %s: index: %w", c.Worker, err)
		}
	}
	st.compactHeap()
	return nil
}

// tickLocked advances the FSM's clock and expires leases and predictions at
// or before it. f.mu held.
func (f *FSM) tickLocked(idx uint64, now int64, res *ApplyResult) {
	st := f.st
	now, res.Clamped = st.tickTargetLocked(now)
	st.lastTick = now
	var expired []string
	for id, ws := range st.workers {
		if l := ws.rec.LeaseUntil; l != 0 && l <= now {
			expired = append(expired, id)
		}
	}
	slices.Sort(expired) // map order must not reach the change stream
	for _, id := range expired {
		f.removeWorkerLocked(idx, id, "lease expired")
	}
	f.stats.expiredLeases.Add(uint64(len(expired)))
	n := 0
	for len(st.heap) > 0 && st.heap[0].until <= now {
		e := st.heap.pop()
		m := st.preds[e.key]
		if until, ok := m[e.hash]; !ok || until != e.until {
			continue // refreshed or removed since: a stale heap entry
		}
		delete(m, e.hash)
		if len(m) == 0 {
			delete(st.preds, e.key)
		}
		st.live--
		n++
		f.one[0] = e.hash
		_ = st.predicted.Apply(e.key, router.KVEvent{Kind: router.EventRemoved, Removed: f.one[:]})
	}
	f.stats.expiredPredictions.Add(uint64(n))
	sessions := f.expireSessionsLocked(now)
	pins := f.expirePinsLocked(now)
	res.Expired = len(expired) + n + sessions + pins
	res.Applied = 1
}

// mergeModelLocked computes the overrides and configuration c would leave
// for its model, or the domain error that refuses it. f.mu held (read).
func (f *FSM) mergeModelLocked(c SetModelConfig) (*SetModelConfig, router.Config, error) {
	if err := c.Validate(); err != nil {
		return nil, router.Config{}, err
	}
	next := &SetModelConfig{Model: c.Model}
	if cur := f.st.models[c.Model]; cur != nil {
		*next = *cur
	}
	next.clear(c.Reset)
	next.set(&c)
	next.Reset = 0
	cfg := overlay(f.base, next)
	cfg.BlockSize = f.st.modelBlockSize(c.Model)
	if err := cfg.Validate(); err != nil {
		return nil, router.Config{}, fmt.Errorf("model %q: %w", c.Model, err)
	}
	return next, cfg, nil
}

// clear drops the overrides in mask.
func (o *SetModelConfig) clear(mask ModelField) {
	t := &o.Thresholds
	if mask&FieldActiveDecodeBlocks != 0 {
		t.ActiveDecodeBlocks = nil
	}
	if mask&FieldActivePrefillTokens != 0 {
		t.ActivePrefillTokens = nil
	}
	if mask&FieldActivePrefillTokensFrac != 0 {
		t.ActivePrefillTokensFrac = nil
	}
	if mask&FieldOverlapCredit != 0 {
		o.OverlapCredit = nil
	}
	if mask&FieldPrefillLoadScale != 0 {
		o.PrefillLoadScale = nil
	}
	if mask&FieldTemperature != 0 {
		o.Temperature = nil
	}
	if mask&FieldTrackPrefillTokens != 0 {
		o.TrackPrefillTokens = nil
	}
	if mask&FieldQueueThreshold != 0 {
		o.QueueThreshold = nil
	}
	if mask&FieldQueuePolicy != 0 {
		o.QueuePolicy = nil
	}
}

// set copies u's present fields (fresh pointers: nothing aliases the caller).
func (o *SetModelConfig) set(u *SetModelConfig) {
	t, ut := &o.Thresholds, &u.Thresholds
	setPtr(&t.ActiveDecodeBlocks, ut.ActiveDecodeBlocks)
	setPtr(&t.ActivePrefillTokens, ut.ActivePrefillTokens)
	setPtr(&t.ActivePrefillTokensFrac, ut.ActivePrefillTokensFrac)
	setPtr(&o.OverlapCredit, u.OverlapCredit)
	setPtr(&o.PrefillLoadScale, u.PrefillLoadScale)
	setPtr(&o.Temperature, u.Temperature)
	setPtr(&o.TrackPrefillTokens, u.TrackPrefillTokens)
	setPtr(&o.QueueThreshold, u.QueueThreshold)
	setPtr(&o.QueuePolicy, u.QueuePolicy)
}

func setPtr[T any](dst **T, src *T) {
	if src != nil {
		v := *src
		*dst = &v
	}
}

func clonePtr[T any](p *T) *T {
	if p == nil {
		return nil
	}
	v := *p
	return &v
}

// cloneConfig deep-copies the pointer fields so callers cannot reach ours.
func cloneConfig(c router.Config) router.Config {
	c.Thresholds.ActiveDecodeBlocks = clonePtr(c.Thresholds.ActiveDecodeBlocks)
	c.Thresholds.ActivePrefillTokens = clonePtr(c.Thresholds.ActivePrefillTokens)
	c.Thresholds.ActivePrefillTokensFrac = clonePtr(c.Thresholds.ActivePrefillTokensFrac)
	c.QueueThreshold = clonePtr(c.QueueThreshold)
	return c
}

// overlay returns base with o's overrides applied (o may be nil).
func overlay(base router.Config, o *SetModelConfig) router.Config {
	c := cloneConfig(base)
	if o == nil {
		return c
	}
	t := &c.Thresholds
	setPtr(&t.ActiveDecodeBlocks, o.Thresholds.ActiveDecodeBlocks)
	setPtr(&t.ActivePrefillTokens, o.Thresholds.ActivePrefillTokens)
	setPtr(&t.ActivePrefillTokensFrac, o.Thresholds.ActivePrefillTokensFrac)
	if o.OverlapCredit != nil {
		c.OverlapCredit = *o.OverlapCredit
	}
	if o.PrefillLoadScale != nil {
		c.PrefillLoadScale = *o.PrefillLoadScale
	}
	if o.Temperature != nil {
		c.Temperature = *o.Temperature
	}
	if o.TrackPrefillTokens != nil {
		c.TrackPrefillTokens = *o.TrackPrefillTokens
	}
	setPtr(&c.QueueThreshold, o.QueueThreshold)
	if o.QueuePolicy != nil {
		c.QueuePolicy = *o.QueuePolicy
	}
	return c
}

func (o *SetModelConfig) clone() SetModelConfig {
	var c SetModelConfig
	c.Model = o.Model
	c.set(o)
	c.Reset = o.Reset
	return c
}

// takeChangesLocked hands over the collected changes. f.mu held.
func (f *FSM) takeChangesLocked() []Change {
	c := f.changes
	f.changes = nil
	return c
}

// OnChange registers an observer, called (in registration order, on the
// applying goroutine, with no lock held) after each entry or batch that
// changed the registry, configuration, nodes, staleness, or after a Restore.
// Observers must not block: raft waits for them.
func (f *FSM) OnChange(fn func(Change)) {
	f.obsMu.Lock()
	defer f.obsMu.Unlock()
	f.observers = append(f.observers, fn)
}

func (f *FSM) notify(changes []Change) {
	if len(changes) == 0 {
		return
	}
	f.obsMu.Lock()
	obs := slices.Clone(f.observers)
	f.obsMu.Unlock()
	for _, c := range changes {
		for _, fn := range obs {
			fn(c)
		}
	}
}

// indexView reads whichever index is current, so holders survive a Restore.
type indexView struct{ p *atomic.Pointer[router.Index] }

func (v indexView) FindMatches(seq []uint64, dst []router.Overlap) []router.Overlap {
	return v.p.Load().FindMatches(seq, dst)
}

// FindTieredMatches makes the view a router.TieredOverlapSource: the
// router's lower-tier credit reads the current index's tiers.
func (v indexView) FindTieredMatches(seq []uint64, device []router.Overlap, dst []router.TierOverlap) []router.TierOverlap {
	return v.p.Load().FindTieredMatches(seq, device, dst)
}

// CacheCounts forwards to the index: kv-pooled weighs eviction by how many
// of a worker's blocks no other worker holds.
func (v indexView) CacheCounts(w router.WorkerID) (held, unique int) {
	return v.p.Load().CacheCounts(w)
}

// Index is the current block index, fed by worker events. Restore replaces
// it: hold Overlaps() instead of this pointer across restores, or re-read it
// on ChangeRestored.
func (f *FSM) Index() *router.Index { return f.index.Load() }

// Predicted is the current index of kv-approx predictions (see Index).
func (f *FSM) Predicted() *router.Index { return f.predicted.Load() }

// Overlaps is a router.OverlapSource over the current event-fed index that
// follows restores.
func (f *FSM) Overlaps() router.OverlapSource { return indexView{&f.index} }

// PredictedOverlaps is a router.OverlapSource over the current predictions.
func (f *FSM) PredictedOverlaps() router.OverlapSource { return indexView{&f.predicted} }

// BlockSize is the cluster default block size (the base configuration's):
// the block size of every model whose workers registered without their own.
// A model's own is ModelBlockSize.
func (f *FSM) BlockSize() int { return f.base.BlockSize }

// ModelBlockSize is the block size of model's prompts: the one its
// registered workers share, or the cluster default while it has none.
func (f *FSM) ModelBlockSize(model string) int {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.st.modelBlockSize(model)
}

// modelBlockSize: f.mu held (read).
func (st *state) modelBlockSize(model string) int {
	if ms, ok := st.modelSizes[model]; ok {
		return ms.blockSize
	}
	return st.blockSize
}

// CheckRegisterWorker returns c as it must be proposed, OwnBlockSize set
// exactly when its block size differs from the cluster default (so a
// registration with the default keeps its old encoding), or the domain
// error Apply would return now (invalid fields; a block size other than
// the model's while another worker of the model is registered), without
// changing anything. Proposers call it, then Encode.
func (f *FSM) CheckRegisterWorker(c RegisterWorker) (RegisterWorker, error) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	c.OwnBlockSize = c.BlockSize != 0 && c.BlockSize != f.st.blockSize
	filled := c
	if filled.BlockSize == 0 {
		filled.BlockSize = f.st.blockSize
	}
	if err := f.st.checkRegister(filled); err != nil {
		return RegisterWorker{}, err
	}
	return c, nil
}

// AppliedIndex is the index of the last log entry applied (or restored).
func (f *FSM) AppliedIndex() uint64 { return f.applied.Load() }

// LastTick is the FSM's clock: the largest Tick.Now applied (unix nanos).
func (f *FSM) LastTick() int64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.st.lastTick
}

// Workers lists the registered workers sorted by id.
func (f *FSM) Workers() []WorkerRecord {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make([]WorkerRecord, 0, len(f.st.workers))
	for _, ws := range f.st.workers {
		out = append(out, ws.rec)
	}
	slices.SortFunc(out, func(a, b WorkerRecord) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// Worker returns one registered worker.
func (f *FSM) Worker(id string) (WorkerRecord, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if ws := f.st.workers[id]; ws != nil {
		return ws.rec, true
	}
	return WorkerRecord{}, false
}

// WorkerInfos is RoleWorkers without the roles.
func (f *FSM) WorkerInfos(model string) []router.WorkerInfo {
	rws := f.RoleWorkers(model)
	out := make([]router.WorkerInfo, len(rws))
	for i, w := range rws {
		out[i] = w.WorkerInfo
	}
	return out
}

// RoleWorkers is the router candidate set for model ("" = every model)
// with each worker's disaggregation role ("" is reported as both): one
// entry per rank, sorted by router worker id.
func (f *FSM) RoleWorkers(model string) []router.RoleWorker {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var out []router.RoleWorker
	for _, ws := range f.st.workers {
		if model != "" && ws.rec.Model != model {
			continue
		}
		role := ws.rec.Role
		if role == "" {
			role = router.RoleBoth
		}
		for _, rs := range ws.ranks {
			out = append(out, router.RoleWorker{WorkerInfo: router.WorkerInfo{ID: rs.key, TotalBlocks: ws.rec.TotalBlocks,
				MaxBatchedTokens: ws.rec.MaxBatchedTokens}, Role: role})
		}
	}
	slices.SortFunc(out, func(a, b router.RoleWorker) int { return strings.Compare(string(a.ID), string(b.ID)) })
	return out
}

// Models lists, sorted, every model that has a configuration or a
// registered worker.
func (f *FSM) Models() []string {
	f.mu.RLock()
	defer f.mu.RUnlock()
	seen := make(map[string]bool, len(f.st.models))
	var out []string
	add := func(m string) {
		if m != "" && !seen[m] {
			seen[m] = true
			out = append(out, m)
		}
	}
	for m := range f.st.models {
		add(m)
	}
	for _, ws := range f.st.workers {
		add(ws.rec.Model)
	}
	slices.Sort(out)
	return out
}

// ModelConfig is the router configuration of model: the base configuration
// with the model's overrides applied and its block size (ModelBlockSize).
// Unknown models get the base.
func (f *FSM) ModelConfig(model string) router.Config {
	f.mu.RLock()
	defer f.mu.RUnlock()
	c := overlay(f.base, f.st.models[model])
	c.BlockSize = f.st.modelBlockSize(model)
	return c
}

// ModelOverrides returns the fields SetModelConfig has set for model.
func (f *FSM) ModelOverrides(model string) (SetModelConfig, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	o := f.st.models[model]
	if o == nil {
		return SetModelConfig{}, false
	}
	return o.clone(), true
}

// CheckModelConfig returns the configuration u would produce, or the domain
// error Apply would return, without changing anything: proposers validate
// with it before proposing.
func (f *FSM) CheckModelConfig(u SetModelConfig) (router.Config, error) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	_, cfg, err := f.mergeModelLocked(u)
	return cfg, err
}

// Nodes lists the registered replicas sorted by id.
func (f *FSM) Nodes() []NodeRecord {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make([]NodeRecord, 0, len(f.st.nodes))
	for _, n := range f.st.nodes {
		out = append(out, n)
	}
	slices.SortFunc(out, func(a, b NodeRecord) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// Node returns one replica's addresses.
func (f *FSM) Node(id string) (NodeRecord, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	n, ok := f.st.nodes[id]
	return n, ok
}

// Stale returns the worker ranks marked stale and why.
func (f *FSM) Stale() map[RankKey]StaleInfo {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make(map[RankKey]StaleInfo)
	for _, rs := range f.st.ranks {
		if rs.stale {
			out[RankKey{rs.worker, rs.rank}] = StaleInfo{Reason: rs.reason, EventID: rs.staleID}
		}
	}
	return out
}

// Cursors returns every registered rank's last consumed event id (0 = none
// yet, or cleared by a resync).
func (f *FSM) Cursors() map[RankKey]uint64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make(map[RankKey]uint64, len(f.st.ranks))
	for _, rs := range f.st.ranks {
		out[RankKey{rs.worker, rs.rank}] = rs.last
	}
	return out
}

// OverCapacityRefused returns, per worker id, the blocks of its ranks'
// stored events this replica refused by their block cap (RankBlockCap)
// since it started, for workers still registered. Not replicated state:
// a replica restored from a snapshot counts from there.
func (f *FSM) OverCapacityRefused() map[string]uint64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return maps.Clone(f.refused)
}

// Placement is the data group worker is placed in (control group state).
func (f *FSM) Placement(worker string) (group uint32, ok bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	group, ok = f.st.placements[worker]
	return group, ok
}

// Placements is a copy of the placement map: worker id → data group.
func (f *FSM) Placements() map[string]uint32 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return maps.Clone(f.st.placements)
}

// PlacementGroups is the number of data groups the placements are for:
// fixed by the first placement or SetGroups, raised by SetGroups; 0 when
// neither was ever applied.
func (f *FSM) PlacementGroups() uint32 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.st.groups
}

// CheckPlaceWorker returns the domain error Apply would return for p now
// (invalid fields, or a group count other than the placements'), without
// changing anything. Proposers call it before proposing.
func (f *FSM) CheckPlaceWorker(p PlaceWorker) error {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.st.checkPlace(p)
}

// CheckSetGroups returns the domain error Apply would return for c now
// (a count outside [2,MaxDataGroups], or below the cluster's; with a
// Checked list, a malformed list or a registered node the list lacks,
// ErrUncheckedNode), without changing anything. Proposers call it before
// proposing.
func (f *FSM) CheckSetGroups(c SetGroups) error {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.st.checkSetGroups(c)
}

// PredictionCount is the number of live (worker, hash) predictions.
func (f *FSM) PredictionCount() int {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.st.live
}

// Stats returns the counters.
func (f *FSM) Stats() Stats {
	s := &f.stats
	return Stats{
		Commands: s.commands.Load(), DomainErrors: s.domainErrors.Load(), Undecodable: s.undecodable.Load(),
		UnknownTypes: s.unknownTypes.Load(), Ignored: s.ignored.Load(), Replayed: s.replayed.Load(),
		Events: s.events.Load(), Applied: s.applied.Load(), Duplicates: s.duplicates.Load(), Gaps: s.gaps.Load(),
		Rejected: map[string]uint64{
			RejectUnknownWorker: s.unknownWorker.Load(),
			RejectBlockSize:     s.blockSize.Load(),
			RejectMissingParent: s.missingParent.Load(),
			RejectInvalid:       s.invalid.Load(),
			RejectOverCapacity:  s.overCapacity.Load(),
		},
		ExpiredPredictions: s.expiredPredictions.Load(),
		ExpiredLeases:      s.expiredLeases.Load(),
		ClampedTimes:       s.clampedTimes.Load(),
		HaltedEntries:      s.haltedEntries.Load(),
		OversizeEntries:    s.oversizeEntries.Load(),
		OverCapacityBlocks: s.overCapacityBlocks.Load(),
	}
}

// NextExpiry is the earliest time (unix nanos) at which a Tick would expire
// something — a prediction or a worker lease — or 0 when nothing can expire.
// The leader ticks only when it is due, so an idle cluster's log (and its
// digest) stays still; stale heap entries may make it early, never late.
func (f *FSM) NextExpiry() int64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var next int64
	if len(f.st.heap) > 0 {
		next = f.st.heap[0].until
	}
	for _, ws := range f.st.workers {
		if l := ws.rec.LeaseUntil; l != 0 && (next == 0 || l < next) {
			next = l
		}
	}
	// Stale heap entries may make it early, never late (as predictions).
	if len(f.st.sessionHeap) > 0 && (next == 0 || f.st.sessionHeap[0].until < next) {
		next = f.st.sessionHeap[0].until
	}
	if len(f.st.pinHeap) > 0 && (next == 0 || f.st.pinHeap[0].until < next) {
		next = f.st.pinHeap[0].until
	}
	return next
}

// ResponseError extracts the domain error an Apply response carries (the
// cluster layer turns it into a rejected write).
func ResponseError(resp any) error {
	if r, ok := resp.(*ApplyResult); ok && r != nil {
		return r.Err
	}
	return nil
}

// DecodeResult turns a forwarded Apply response (the JSON the leader
// encoded) back into an *ApplyResult.
func DecodeResult(_ []byte, raw []byte) (any, error) {
	var r ApplyResult
	if err := json.Unmarshal(raw, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// ForwardErrors are the sentinel errors an Apply response may carry, so a
// follower's forwarded write still satisfies errors.Is.
func ForwardErrors() []error {
	return []error{ErrUnknownWorker, ErrInvalidCommand, ErrInvalidConfig, ErrUnknownNode}
}
