package fsm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strings"

	"github.com/kvrouter/kvrouter/router"
)

// CommandType is the first byte of every Raft log entry the FSM applies.
// The numbers are in the log forever: only add to the end, never renumber or
// reuse one (TestFSMCommandTypesPinned pins them).
type CommandType uint8

// Command types.
const (
	CmdRegisterWorker   CommandType = 1
	CmdDeregisterWorker CommandType = 2
	CmdKVEventBatch     CommandType = 3
	CmdSetModelConfig   CommandType = 4
	CmdPredictions      CommandType = 5
	CmdTick             CommandType = 6
	CmdRegisterNode     CommandType = 7
	CmdResyncWorker     CommandType = 8
	CmdRemoveNode       CommandType = 9
	// CmdRegisterWorkerRole is RegisterWorker with a role (decodes to a
	// RegisterWorker).
	CmdRegisterWorkerRole CommandType = 10
	// CmdRegisterWorkerBlockSize is RegisterWorker with a block size that
	// may differ from the cluster default (the model's own), and with an
	// optional role (decodes to a RegisterWorker with OwnBlockSize set).
	CmdRegisterWorkerBlockSize CommandType = 11
	// CmdKVEventBatchTiered is a KVEventBatch some of whose events are of
	// a lower storage tier (router.Tier): the same payload with a tier
	// byte for those events (kvbatch.go). Batches of device-tier events
	// alone keep type 3, byte for byte, so a cluster whose engines
	// report no offload tier runs mixed builds; a build without tiers
	// halts on this type instead of reading host blocks as GPU blocks.
	CmdKVEventBatchTiered CommandType = 12
	// CmdPlaceWorker sets or removes a worker's placement: which Raft
	// data group (1..Groups) owns its registration, lease and KV events.
	// Applied by the control group (group 0); see DESIGN.md, Placement.
	CmdPlaceWorker CommandType = 13
	// CmdSetGroups raises the number of data groups placements are made
	// for (the control group's G), once every replica runs that many;
	// see DESIGN.md, Placement.
	CmdSetGroups CommandType = 14
	// CmdSetGroupsChecked is SetGroups carrying the node ids whose group
	// count the proposer checked (decodes to a SetGroups with Checked
	// set): apply refuses it while the node registry holds a node not in
	// the list, one registered between the check and the commit.
	CmdSetGroupsChecked CommandType = 15
	// CmdSetWorkerDrain drains a worker (no new requests; deregistered by
	// the leader once idle or past its deadline), undrains it, or
	// completes the drain by deregistering it while it is still drained
	// (drain.go; DESIGN.md, Draining workers).
	CmdSetWorkerDrain CommandType = 16
	// CmdBindSession binds an agent session to a worker rank for an idle
	// TTL, or refreshes the binding (sessions.go; DESIGN.md, Sessions).
	CmdBindSession CommandType = 17
	// CmdUnbindSessions ends one session's binding, or every binding to a
	// worker's ranks.
	CmdUnbindSessions CommandType = 18
	// CmdPinPrefix pins a prompt prefix on a worker rank for a TTL, or
	// refreshes the pin (pins.go; DESIGN.md, Prefix pins).
	CmdPinPrefix CommandType = 19
	// CmdUnpinPrefix ends a prefix's pins, or every pin of a worker.
	CmdUnpinPrefix CommandType = 20
	// CmdBindSessionStages binds a session of a two-stage (disaggregated)
	// model to a prefill worker and a decode worker in one record, or
	// moves or refreshes it (sessions.go; DESIGN.md, Sessions).
	CmdBindSessionStages CommandType = 21
	// Add new types here, with the next number.
)

// IgnoreIfUnknown is or-ed into the type byte of a command that replicas
// which do not know the type (or its envelope version) may skip safely.
const IgnoreIfUnknown byte = 0x80

// EnvelopeVersion is the payload version this package writes and reads.
const EnvelopeVersion byte = 1

func (t CommandType) String() string {
	switch t {
	case CmdRegisterWorker:
		return "RegisterWorker"
	case CmdDeregisterWorker:
		return "DeregisterWorker"
	case CmdKVEventBatch:
		return "KVEventBatch"
	case CmdSetModelConfig:
		return "SetModelConfig"
	case CmdPredictions:
		return "Predictions"
	case CmdTick:
		return "Tick"
	case CmdRegisterNode:
		return "RegisterNode"
	case CmdResyncWorker:
		return "ResyncWorker"
	case CmdRemoveNode:
		return "RemoveNode"
	case CmdRegisterWorkerRole:
		return "RegisterWorkerRole"
	case CmdRegisterWorkerBlockSize:
		return "RegisterWorkerBlockSize"
	case CmdKVEventBatchTiered:
		return "KVEventBatchTiered"
	case CmdPlaceWorker:
		return "PlaceWorker"
	case CmdSetGroups:
		return "SetGroups"
	case CmdSetGroupsChecked:
		return "SetGroupsChecked"
	case CmdSetWorkerDrain:
		return "SetWorkerDrain"
	case CmdBindSession:
		return "BindSession"
	case CmdUnbindSessions:
		return "UnbindSessions"
	case CmdPinPrefix:
		return "PinPrefix"
	case CmdUnpinPrefix:
		return "UnpinPrefix"
	case CmdBindSessionStages:
		return "BindSessionStages"
	}
	return fmt.Sprintf("CommandType(%d)", uint8(t))
}

func (t CommandType) known() bool { return t >= CmdRegisterWorker && t <= CmdBindSessionStages }

// isKVBatch: both KV batch types share one payload layout (kvbatch.go).
func (t CommandType) isKVBatch() bool { return t == CmdKVEventBatch || t == CmdKVEventBatchTiered }

// Errors of commands. The router's sentinels are aliased so errors.Is works
// across layers.
var (
	// ErrUnknownCommand: a type byte this build does not know, without the
	// ignore bit (or an envelope version it does not know).
	ErrUnknownCommand = errors.New("unknown command type")
	// ErrInvalidCommand: a command that decodes but breaks a domain rule
	// (empty id, zero ranks, '#' in a worker id…), or one an encoder refuses.
	ErrInvalidCommand = errors.New("invalid command")
	// ErrUnknownWorker: a command names a worker (rank) that is not registered.
	ErrUnknownWorker = router.ErrUnknownWorker
	// ErrUnknownNode: RemoveNode of a node that is not registered.
	ErrUnknownNode = errors.New("unknown node")
	// ErrBlockSizeMismatch: a worker's block size differs from its model's
	// (or, registered without OwnBlockSize, from the cluster default), or an
	// event's from its worker's.
	ErrBlockSizeMismatch = router.ErrBlockSizeMismatch
	// ErrInvalidConfig: a model configuration the router would reject.
	ErrInvalidConfig = router.ErrInvalidConfig
	// ErrUncheckedNode: a SetGroups with a Checked list while the node
	// registry holds a node the list lacks (registered after the
	// proposer's check). It wraps ErrInvalidCommand (a domain error);
	// retrying checks the new node too.
	ErrUncheckedNode = fmt.Errorf("node not checked: %w", ErrInvalidCommand)
)

// MaxDPRanks bounds a worker's data-parallel ranks: each rank is one router
// worker, and the bound keeps a hostile or mistaken command from creating
// millions of them.
const MaxDPRanks = 1024

// Command is any of the command structs below; Encode writes one, Decode
// reads one.
type Command interface {
	Type() CommandType
}

// RegisterWorker adds a worker with DPRanks ranks, or updates and renews a
// registered one (same ID): changed fields are replaced, ranks beyond a
// lower DPRanks are removed with their blocks, new ranks are added empty.
type RegisterWorker struct {
	ID               string // no '#': rank ids are "id#rank" (router.WorkerKey)
	DPRanks          uint32 // >= 1
	Address          string
	Model            string
	BlockSize        int   // 0 = the cluster default; see OwnBlockSize
	TotalBlocks      int   // KV capacity in blocks (decode threshold)
	MaxBatchedTokens int   // prefill fraction threshold
	LeaseUntil       int64 // unix nanos stamped by the proposer; 0 = no lease
	// Role is the worker's part in disaggregated serving: "" (= both),
	// prefill, decode or both. A registration with a role travels as
	// CmdRegisterWorkerRole (the same fields plus the role), so one without
	// keeps the encoding it always had and a build that predates roles
	// refuses the entry loudly instead of registering a prefill-only worker
	// as aggregated.
	Role router.Role
	// OwnBlockSize says BlockSize is the worker's model's own, which may
	// differ from the cluster default (router.Config.BlockSize of NewFSM).
	// Such a registration travels as CmdRegisterWorkerBlockSize, which
	// builds before per-model block sizes do not know: they halt on it
	// instead of refusing it (a domain error) while newer builds accept it.
	// Without it a block size other than the default is refused, as by
	// every older build, so CmdRegisterWorker and CmdRegisterWorkerRole
	// keep their meaning. FSM.CheckRegisterWorker sets it exactly when the
	// block size differs from the default; it is not part of the record.
	//
	// Either way, a model's workers share one block size: the first
	// registered fixes it while any of them is registered.
	OwnBlockSize bool
}

// record is the registry entry c leaves (before defaults and clamping).
func (c RegisterWorker) record() WorkerRecord {
	return WorkerRecord{ID: c.ID, DPRanks: c.DPRanks, Address: c.Address, Model: c.Model, BlockSize: c.BlockSize,
		TotalBlocks: c.TotalBlocks, MaxBatchedTokens: c.MaxBatchedTokens, LeaseUntil: c.LeaseUntil, Role: c.Role}
}

// command is the registration that leaves w (OwnBlockSize unset: the
// snapshot's worker records carry no command type).
func (w WorkerRecord) command() RegisterWorker {
	return RegisterWorker{ID: w.ID, DPRanks: w.DPRanks, Address: w.Address, Model: w.Model, BlockSize: w.BlockSize,
		TotalBlocks: w.TotalBlocks, MaxBatchedTokens: w.MaxBatchedTokens, LeaseUntil: w.LeaseUntil, Role: w.Role}
}

// DeregisterWorker removes a worker, all its ranks, blocks, predictions and
// cursors.
type DeregisterWorker struct {
	ID string
}

// KVBatchEvent is one worker event in a KVEventBatch. EventID is the
// worker rank's sequence number (1, 2, 3…) used for dedupe and gap
// detection; 0 means unsequenced: always applied, never deduplicated.
type KVBatchEvent struct {
	Worker  string
	DPRank  uint32
	EventID uint64
	Event   router.KVEvent
}

// KVEventBatch carries many worker events in one log entry (the hot path).
type KVEventBatch struct {
	Events []KVBatchEvent
}

// ModelField names one optional knob of a model configuration (a bit set).
// The bits travel in the log: append only.
type ModelField uint32

// Model configuration fields.
const (
	FieldActiveDecodeBlocks ModelField = 1 << iota
	FieldActivePrefillTokens
	FieldActivePrefillTokensFrac
	FieldOverlapCredit
	FieldPrefillLoadScale
	FieldTemperature
	FieldTrackPrefillTokens
	FieldQueueThreshold
	FieldQueuePolicy

	allModelFields = FieldQueuePolicy<<1 - 1
)

// SetModelConfig is a partial update of one model's router configuration:
// fields in Reset return to the base configuration, then every non-nil field
// is set; everything else keeps its value. The result must pass
// router.Config.Validate, or the update is refused (domain error).
type SetModelConfig struct {
	Model      string
	Thresholds router.Thresholds // nil members = unchanged

	OverlapCredit      *float64
	PrefillLoadScale   *float64
	Temperature        *float64
	TrackPrefillTokens *bool
	QueueThreshold     *float64
	QueuePolicy        *router.QueuePolicy

	Reset ModelField
}

// Predictions records blocks a router placed on Worker in kv-approx mode;
// they expire at Until (unix nanos, stamped by the leader) on a Tick.
type Predictions struct {
	Worker router.WorkerID // router key: router.WorkerKey(id, rank)
	Hashes []uint64
	Until  int64
}

// Tick carries the leader's clock into the log: predictions with
// Until <= Now and worker leases with LeaseUntil <= Now expire. The FSM's
// clock never runs backwards and moves at most MaxClockStep per Tick (the
// first Tick only up to just before the earliest expiry): a Tick from a
// clock far in the future cannot expire every worker (clock.go).
type Tick struct {
	Now int64
}

// RegisterNode records (or updates) a replica's addresses so followers can
// forward writes to the leader's HTTP address.
type RegisterNode struct {
	NodeID   string
	RaftAddr string
	HTTPAddr string
}

// RemoveNode forgets a replica's addresses (it left the cluster).
type RemoveNode struct {
	NodeID string
}

// ResyncWorker clears one worker rank's blocks, cursor and stale flag; the
// rank's next sequenced event is taken as its new baseline (no gap), so the
// worker can republish its cache from scratch.
type ResyncWorker struct {
	Worker string
	DPRank uint32
}

// PlaceWorker assigns a worker to one of the cluster's Raft data groups
// (issue 19), or with Remove forgets its placement. It is applied by the
// control group's FSM, whose placement map every replica reads to route a
// worker's registration and events to its group's FSM.
//
// Groups is the number of data groups the proposer runs: every placement
// carries it, so a proposer configured with another count is refused
// (loudly, naming both) instead of scattering workers over groups that
// other replicas do not have. The first placement fixes it for the life
// of the cluster.
type PlaceWorker struct {
	Worker string // a worker id (no '#'), not a rank: all ranks share a group
	Group  uint32 // 1..Groups (0 is the control group, which owns no worker)
	Groups uint32 // >= 2: with one data group there is nothing to place
	// Remove drops the worker's placement (whatever its group: Group must
	// still be valid, as it is checked like any other).
	Remove bool
}

// MaxDataGroups bounds SetGroups: each data group is a Raft group every
// replica runs (its own log, snapshots and goroutines), so the count is
// small; 64 is far beyond what one cluster needs to spread its index.
const MaxDataGroups = 64

// MaxCheckedNodes bounds SetGroups.Checked: far above any replica count
// (every replica is a voter of every Raft group), and it keeps the entry
// small (at most MaxCheckedNodes × MaxStringLen bytes of ids).
const MaxCheckedNodes = 1024

// SetGroups raises the number of data groups the cluster places workers
// in (the control group's G) to Groups. An operator proposes it once every
// replica was restarted with that many groups (--raft-groups); from then
// on PlaceWorker must carry the new count. It never lowers G: workers
// placed in the groups beyond would be lost. Before anything was placed it
// fixes G as the first placement would.
type SetGroups struct {
	Groups uint32 // 2..MaxDataGroups
	// Checked are the ids of the replicas the proposer checked run Groups
	// data groups (itself included): sorted, unique, non-empty, at most
	// MaxCheckedNodes. Apply refuses the command (ErrUncheckedNode, state
	// unchanged) while the node registry holds a node not in the list:
	// one registered after the check was never asked. Nil is the
	// unchecked command of older proposers, CmdSetGroups, byte for byte as
	// before; a non-nil list travels as CmdSetGroupsChecked, which builds
	// without it halt on rather than raise the count unchecked.
	Checked []string
}

// Type is CmdRegisterWorkerBlockSize when the registration has its own
// block size, else CmdRegisterWorkerRole when it carries a role.
func (c RegisterWorker) Type() CommandType {
	switch {
	case c.OwnBlockSize:
		return CmdRegisterWorkerBlockSize
	case c.Role != "":
		return CmdRegisterWorkerRole
	}
	return CmdRegisterWorker
}
func (DeregisterWorker) Type() CommandType { return CmdDeregisterWorker }

// Type is CmdKVEventBatchTiered when an event is of a lower tier.
func (c KVEventBatch) Type() CommandType {
	if kvBatchTiered(c.Events) {
		return CmdKVEventBatchTiered
	}
	return CmdKVEventBatch
}
func (SetModelConfig) Type() CommandType { return CmdSetModelConfig }
func (Predictions) Type() CommandType    { return CmdPredictions }
func (Tick) Type() CommandType           { return CmdTick }
func (RegisterNode) Type() CommandType   { return CmdRegisterNode }
func (ResyncWorker) Type() CommandType   { return CmdResyncWorker }
func (RemoveNode) Type() CommandType     { return CmdRemoveNode }
func (PlaceWorker) Type() CommandType    { return CmdPlaceWorker }

// Type is CmdSetGroupsChecked when the command carries a Checked list.
func (c SetGroups) Type() CommandType {
	if c.Checked != nil {
		return CmdSetGroupsChecked
	}
	return CmdSetGroups
}

// Validate checks the count's own bounds and the Checked list's shape;
// that it does not shrink the cluster's, and that every registered node
// was checked, is checked on apply (FSM.CheckSetGroups checks all).
func (c SetGroups) Validate() error {
	if c.Groups < 2 || c.Groups > MaxDataGroups {
		return fmt.Errorf("set groups: %d data groups outside [2,%d]: %w", c.Groups, MaxDataGroups, ErrInvalidCommand)
	}
	if c.Checked != nil {
		return checkCheckedNodes(c.Checked)
	}
	return nil
}

// checkCheckedNodes is the shape of a SetGroups.Checked list: 1 to
// MaxCheckedNodes ids, each non-empty and at most MaxStringLen bytes,
// strictly increasing (sorted and unique, so the list has one encoding).
// Encode refuses what the decoder refuses.
func checkCheckedNodes(ids []string) error {
	if len(ids) == 0 || len(ids) > MaxCheckedNodes {
		return fmt.Errorf("set groups: %d checked nodes outside [1,%d]: %w", len(ids), MaxCheckedNodes, ErrInvalidCommand)
	}
	for i, id := range ids {
		if id == "" {
			return fmt.Errorf("set groups: empty checked node id: %w", ErrInvalidCommand)
		}
		if err := checkString("checked node id", id); err != nil {
			return err
		}
		if i > 0 && ids[i-1] >= id {
			return fmt.Errorf("set groups: checked node ids not sorted and unique (%q before %q): %w", ids[i-1], id, ErrInvalidCommand)
		}
	}
	return nil
}

// Validate checks the placement's own fields; whether Groups matches the
// cluster's is checked on apply (FSM.CheckPlaceWorker checks both).
func (p PlaceWorker) Validate() error {
	switch {
	case p.Worker == "":
		return fmt.Errorf("place worker: empty id: %w", ErrInvalidCommand)
	case strings.ContainsRune(p.Worker, '#'):
		return fmt.Errorf("place worker %q: '#' is reserved for dp ranks: %w", p.Worker, ErrInvalidCommand)
	case p.Groups < 2:
		return fmt.Errorf("place worker %q: %d data groups, placement needs at least 2: %w", p.Worker, p.Groups, ErrInvalidCommand)
	case p.Group < 1 || p.Group > p.Groups:
		return fmt.Errorf("place worker %q: group %d outside [1,%d]: %w", p.Worker, p.Group, p.Groups, ErrInvalidCommand)
	}
	return nil
}

// Validate checks the domain rules Apply enforces (except the block size,
// which needs the registry: FSM.CheckRegisterWorker checks everything).
func (c RegisterWorker) Validate() error {
	switch {
	case c.ID == "":
		return fmt.Errorf("register worker: empty id: %w", ErrInvalidCommand)
	case strings.ContainsRune(c.ID, '#'):
		return fmt.Errorf("register worker %q: '#' is reserved for dp ranks: %w", c.ID, ErrInvalidCommand)
	case c.DPRanks < 1 || c.DPRanks > MaxDPRanks:
		return fmt.Errorf("register worker %q: dp ranks %d outside [1,%d]: %w", c.ID, c.DPRanks, MaxDPRanks, ErrInvalidCommand)
	case c.BlockSize < 0 || c.TotalBlocks < 0 || c.MaxBatchedTokens < 0:
		return fmt.Errorf("register worker %q: negative size: %w", c.ID, ErrInvalidCommand)
	case c.LeaseUntil < 0:
		return fmt.Errorf("register worker %q: negative lease: %w", c.ID, ErrInvalidCommand)
	case c.Role != "" && c.Role != router.RolePrefill && c.Role != router.RoleDecode && c.Role != router.RoleBoth:
		return fmt.Errorf("register worker %q: role %q is not prefill, decode or both: %w", c.ID, c.Role, ErrInvalidCommand)
	}
	return nil
}

// Validate checks the update's own fields; the merged configuration is
// checked by FSM.CheckModelConfig and on apply.
func (c SetModelConfig) Validate() error {
	if c.Model == "" {
		return fmt.Errorf("set model config: empty model: %w", ErrInvalidCommand)
	}
	if c.Reset&^allModelFields != 0 {
		return fmt.Errorf("set model config %q: unknown reset fields %#x: %w", c.Model, uint32(c.Reset), ErrInvalidCommand)
	}
	return nil
}

// Fields is the set of fields the update sets (non-nil).
func (c SetModelConfig) Fields() ModelField {
	var m ModelField
	t := &c.Thresholds
	for _, f := range []struct {
		on  bool
		bit ModelField
	}{
		{t.ActiveDecodeBlocks != nil, FieldActiveDecodeBlocks},
		{t.ActivePrefillTokens != nil, FieldActivePrefillTokens},
		{t.ActivePrefillTokensFrac != nil, FieldActivePrefillTokensFrac},
		{c.OverlapCredit != nil, FieldOverlapCredit},
		{c.PrefillLoadScale != nil, FieldPrefillLoadScale},
		{c.Temperature != nil, FieldTemperature},
		{c.TrackPrefillTokens != nil, FieldTrackPrefillTokens},
		{c.QueueThreshold != nil, FieldQueueThreshold},
		{c.QueuePolicy != nil, FieldQueuePolicy},
	} {
		if f.on {
			m |= f.bit
		}
	}
	return m
}

// Validate checks the prediction's own fields.
func (c Predictions) Validate() error {
	if c.Worker == "" {
		return fmt.Errorf("predictions: empty worker: %w", ErrInvalidCommand)
	}
	if c.Until <= 0 {
		return fmt.Errorf("predictions for %s: until %d must be a positive unix-nano time: %w", c.Worker, c.Until, ErrInvalidCommand)
	}
	return nil
}

// Encode writes c as a complete log entry: type byte, envelope version,
// payload. It refuses what replicas could not decode (over-long strings,
// unknown event kinds, negative sizes).
func Encode(c Command) ([]byte, error) {
	b := []byte{byte(c.Type()), EnvelopeVersion}
	switch c := c.(type) {
	case RegisterWorker:
		if c.Role == "" && !c.OwnBlockSize {
			return appendRegisterWorker(b, &c)
		}
		b, err := appendRegisterWorker(b, &c)
		if err != nil {
			return nil, err
		}
		if c.OwnBlockSize && c.Role == "" {
			return appendString(b, ""), nil // no role
		}
		return appendRole(b, &c)
	case DeregisterWorker:
		if err := checkString("worker id", c.ID); err != nil {
			return nil, err
		}
		return appendString(b, c.ID), nil
	case KVEventBatch:
		return AppendKVBatch(b[:0], c.Events)
	case SetModelConfig:
		return appendSetModelConfig(b, &c)
	case Predictions:
		if err := checkString("worker", string(c.Worker)); err != nil {
			return nil, err
		}
		b = appendString(b, string(c.Worker))
		b = binary.AppendVarint(b, c.Until)
		b = binary.AppendUvarint(b, uint64(len(c.Hashes)))
		for _, h := range c.Hashes {
			b = appendU64(b, h)
		}
		return b, nil
	case Tick:
		return binary.AppendVarint(b, c.Now), nil
	case RegisterNode:
		for _, s := range []string{c.NodeID, c.RaftAddr, c.HTTPAddr} {
			if err := checkString("node field", s); err != nil {
				return nil, err
			}
			b = appendString(b, s)
		}
		return b, nil
	case ResyncWorker:
		if err := checkString("worker id", c.Worker); err != nil {
			return nil, err
		}
		b = appendString(b, c.Worker)
		return binary.AppendUvarint(b, uint64(c.DPRank)), nil
	case RemoveNode:
		if err := checkString("node id", c.NodeID); err != nil {
			return nil, err
		}
		return appendString(b, c.NodeID), nil
	case PlaceWorker:
		if err := checkString("worker id", c.Worker); err != nil {
			return nil, err
		}
		b = appendString(b, c.Worker)
		b = binary.AppendUvarint(b, uint64(c.Group))
		b = binary.AppendUvarint(b, uint64(c.Groups))
		return appendBool(b, c.Remove), nil
	case SetGroups:
		b = binary.AppendUvarint(b, uint64(c.Groups))
		if c.Checked == nil {
			return b, nil
		}
		if err := checkCheckedNodes(c.Checked); err != nil {
			return nil, err
		}
		b = binary.AppendUvarint(b, uint64(len(c.Checked)))
		for _, id := range c.Checked {
			b = appendString(b, id)
		}
		return b, nil
	case SetWorkerDrain:
		return appendSetWorkerDrain(b, c)
	case BindSession:
		return appendBindSession(b, &c)
	case UnbindSessions:
		return appendUnbindSessions(b, &c)
	case PinPrefix:
		return appendPinPrefix(b, &c)
	case UnpinPrefix:
		return appendUnpinPrefix(b, &c)
	case BindSessionStages:
		return appendBindSessionStages(b, &c)
	}
	return nil, fmt.Errorf("encode %T: %w", c, ErrInvalidCommand)
}

// Typed encoders, for callers that prefer them to Encode.

func EncodeRegisterWorker(c RegisterWorker) ([]byte, error)     { return Encode(c) }
func EncodeDeregisterWorker(c DeregisterWorker) ([]byte, error) { return Encode(c) }
func EncodeKVBatch(events []KVBatchEvent) ([]byte, error)       { return AppendKVBatch(nil, events) }
func EncodeSetModelConfig(c SetModelConfig) ([]byte, error)     { return Encode(c) }
func EncodePredictions(c Predictions) ([]byte, error)           { return Encode(c) }
func EncodeTick(c Tick) ([]byte, error)                         { return Encode(c) }
func EncodeRegisterNode(c RegisterNode) ([]byte, error)         { return Encode(c) }
func EncodeResyncWorker(c ResyncWorker) ([]byte, error)         { return Encode(c) }
func EncodeRemoveNode(c RemoveNode) ([]byte, error)             { return Encode(c) }
func EncodePlaceWorker(p PlaceWorker) ([]byte, error)           { return Encode(p) }
func EncodeSetGroups(c SetGroups) ([]byte, error)               { return Encode(c) }
func EncodeSetWorkerDrain(c SetWorkerDrain) ([]byte, error)     { return Encode(c) }

func appendRegisterWorker(b []byte, c *RegisterWorker) ([]byte, error) {
	for _, s := range []struct{ what, v string }{{"worker id", c.ID}, {"address", c.Address}, {"model", c.Model}} {
		if err := checkString(s.what, s.v); err != nil {
			return nil, err
		}
	}
	for _, v := range []struct {
		what string
		v    int
	}{{"block size", c.BlockSize}, {"total blocks", c.TotalBlocks}, {"max batched tokens", c.MaxBatchedTokens}} {
		if err := checkInt(v.what, v.v); err != nil {
			return nil, err
		}
	}
	b = appendString(b, c.ID)
	b = binary.AppendUvarint(b, uint64(c.DPRanks))
	b = appendString(b, c.Address)
	b = appendString(b, c.Model)
	b = binary.AppendUvarint(b, uint64(c.BlockSize))
	b = binary.AppendUvarint(b, uint64(c.TotalBlocks))
	b = binary.AppendUvarint(b, uint64(c.MaxBatchedTokens))
	return binary.AppendVarint(b, c.LeaseUntil), nil
}

// appendRole is the role field of CmdRegisterWorkerRole and of a snapshot's
// worker record.
func appendRole(b []byte, c *RegisterWorker) ([]byte, error) {
	switch c.Role {
	case router.RolePrefill, router.RoleDecode, router.RoleBoth:
		return appendString(b, string(c.Role)), nil
	}
	return nil, fmt.Errorf("register worker %q: role %q is not prefill, decode or both: %w", c.ID, c.Role, ErrInvalidCommand)
}

// readRole reads appendRole's field: present, and one of the three roles.
func readRole(r *reader) router.Role {
	role := router.Role(r.string("role"))
	switch role {
	case router.RolePrefill, router.RoleDecode, router.RoleBoth:
		return role
	}
	r.fail("worker role %q", role)
	return ""
}

// readRoleOrNone reads CmdRegisterWorkerBlockSize's role: the empty string
// (no role) or one of the three roles.
func readRoleOrNone(r *reader) router.Role {
	role := router.Role(r.string("role"))
	switch role {
	case "", router.RolePrefill, router.RoleDecode, router.RoleBoth:
		return role
	}
	r.fail("worker role %q", role)
	return ""
}

func appendSetModelConfig(b []byte, c *SetModelConfig) ([]byte, error) {
	if err := checkString("model", c.Model); err != nil {
		return nil, err
	}
	if c.Reset&^allModelFields != 0 {
		return nil, fmt.Errorf("reset fields %#x: %w", uint32(c.Reset), ErrInvalidCommand)
	}
	if p := c.QueuePolicy; p != nil {
		if err := checkString("queue policy", string(*p)); err != nil {
			return nil, err
		}
	}
	b = appendString(b, c.Model)
	b = binary.AppendUvarint(b, uint64(c.Reset))
	return appendModelValues(b, c), nil
}

// appendModelValues writes the set mask and the values of the set fields in
// bit order. Shared by the command and the snapshot's model records.
func appendModelValues(b []byte, c *SetModelConfig) []byte {
	b = binary.AppendUvarint(b, uint64(c.Fields()))
	t := &c.Thresholds
	if t.ActiveDecodeBlocks != nil {
		b = appendF64(b, *t.ActiveDecodeBlocks)
	}
	if t.ActivePrefillTokens != nil {
		b = binary.AppendVarint(b, *t.ActivePrefillTokens)
	}
	if t.ActivePrefillTokensFrac != nil {
		b = appendF64(b, *t.ActivePrefillTokensFrac)
	}
	for _, p := range []*float64{c.OverlapCredit, c.PrefillLoadScale, c.Temperature} {
		if p != nil {
			b = appendF64(b, *p)
		}
	}
	if c.TrackPrefillTokens != nil {
		v := byte(0)
		if *c.TrackPrefillTokens {
			v = 1
		}
		b = append(b, v)
	}
	if c.QueueThreshold != nil {
		b = appendF64(b, *c.QueueThreshold)
	}
	if c.QueuePolicy != nil {
		b = appendString(b, string(*c.QueuePolicy))
	}
	return b
}

func readModelValues(r *reader, c *SetModelConfig) {
	mask := ModelField(r.uvarint())
	if mask&^allModelFields != 0 {
		r.fail("unknown model fields %#x", uint32(mask))
		return
	}
	f64 := func() *float64 { v := r.f64(); return &v }
	t := &c.Thresholds
	if mask&FieldActiveDecodeBlocks != 0 {
		t.ActiveDecodeBlocks = f64()
	}
	if mask&FieldActivePrefillTokens != 0 {
		v := r.varint()
		t.ActivePrefillTokens = &v
	}
	if mask&FieldActivePrefillTokensFrac != 0 {
		t.ActivePrefillTokensFrac = f64()
	}
	if mask&FieldOverlapCredit != 0 {
		c.OverlapCredit = f64()
	}
	if mask&FieldPrefillLoadScale != 0 {
		c.PrefillLoadScale = f64()
	}
	if mask&FieldTemperature != 0 {
		c.Temperature = f64()
	}
	if mask&FieldTrackPrefillTokens != 0 {
		switch r.byte() {
		case 0:
			v := false
			c.TrackPrefillTokens = &v
		case 1:
			v := true
			c.TrackPrefillTokens = &v
		default:
			r.fail("bad bool")
		}
	}
	if mask&FieldQueueThreshold != 0 {
		c.QueueThreshold = f64()
	}
	if mask&FieldQueuePolicy != 0 {
		p := router.QueuePolicy(r.string("queue policy"))
		c.QueuePolicy = &p
	}
}

// header splits an entry into its type, ignore bit, version and payload.
func header(data []byte) (t CommandType, ignore bool, version byte, payload []byte, err error) {
	if len(data) < 2 {
		return 0, false, 0, nil, fmt.Errorf("entry of %d bytes has no envelope: %w", len(data), ErrUndecodable)
	}
	return CommandType(data[0] &^ IgnoreIfUnknown), data[0]&IgnoreIfUnknown != 0, data[1], data[2:], nil
}

// Decode reads a complete log entry written by Encode. Unknown types and
// versions give ErrUnknownCommand (whatever the ignore bit: skipping is the
// FSM's decision), malformed bytes ErrUndecodable.
func Decode(data []byte) (Command, error) {
	t, _, v, p, err := header(data)
	if err != nil {
		return nil, err
	}
	if !t.known() || v != EnvelopeVersion {
		return nil, fmt.Errorf("type %d version %d: %w", uint8(t), v, ErrUnknownCommand)
	}
	return decodePayload(t, p)
}

func decodePayload(t CommandType, p []byte) (Command, error) {
	if t.isKVBatch() {
		evs, err := decodeKVBatchPayload(p, t == CmdKVEventBatchTiered)
		if err != nil {
			return nil, err
		}
		return KVEventBatch{Events: evs}, nil
	}
	r := &reader{b: p}
	var c Command
	switch t {
	case CmdRegisterWorker:
		c = readRegisterWorker(r)
	case CmdRegisterWorkerRole:
		rw := readRegisterWorker(r)
		rw.Role = readRole(r)
		c = rw
	case CmdRegisterWorkerBlockSize:
		rw := readRegisterWorker(r)
		rw.OwnBlockSize = true
		rw.Role = readRoleOrNone(r)
		c = rw
	case CmdDeregisterWorker:
		c = DeregisterWorker{ID: r.string("worker id")}
	case CmdSetModelConfig:
		m := SetModelConfig{Model: r.string("model")}
		m.Reset = ModelField(r.uvarint())
		if m.Reset&^allModelFields != 0 {
			r.fail("unknown reset fields %#x", uint32(m.Reset))
		}
		readModelValues(r, &m)
		c = m
	case CmdPredictions:
		pr := Predictions{Worker: router.WorkerID(r.string("worker")), Until: r.varint()}
		if n := r.count("hashes", 8); n > 0 {
			pr.Hashes = make([]uint64, n)
			for i := range pr.Hashes {
				pr.Hashes[i] = r.u64()
			}
		}
		c = pr
	case CmdTick:
		c = Tick{Now: r.varint()}
	case CmdRegisterNode:
		c = RegisterNode{NodeID: r.string("node id"), RaftAddr: r.string("raft addr"), HTTPAddr: r.string("http addr")}
	case CmdResyncWorker:
		c = ResyncWorker{Worker: r.string("worker id"), DPRank: r.u32("dp rank")}
	case CmdRemoveNode:
		c = RemoveNode{NodeID: r.string("node id")}
	case CmdPlaceWorker:
		c = PlaceWorker{Worker: r.string("worker id"), Group: r.u32("group"), Groups: r.u32("groups"), Remove: r.bool()}
	case CmdSetGroups:
		c = SetGroups{Groups: r.u32("groups")}
	case CmdSetGroupsChecked:
		c = readSetGroupsChecked(r)
	case CmdSetWorkerDrain:
		c = readSetWorkerDrain(r)
	case CmdBindSession:
		c = readBindSession(r)
	case CmdUnbindSessions:
		c = readUnbindSessions(r)
	case CmdPinPrefix:
		c = readPinPrefix(r)
	case CmdUnpinPrefix:
		c = readUnpinPrefix(r)
	case CmdBindSessionStages:
		c = readBindSessionStages(r)
	default:
		return nil, fmt.Errorf("type %d: %w", uint8(t), ErrUnknownCommand)
	}
	if err := r.done(); err != nil {
		return nil, fmt.Errorf("decode %s: %w", t, err)
	}
	return c, nil
}

// readSetGroupsChecked reads CmdSetGroupsChecked's payload: the count,
// then the checked node ids, shaped as checkCheckedNodes wants (anything
// else is undecodable: the list has one encoding).
func readSetGroupsChecked(r *reader) SetGroups {
	c := SetGroups{Groups: r.u32("groups")}
	n := r.count("checked nodes", 1)
	if r.err != nil {
		return c
	}
	if n < 1 || n > MaxCheckedNodes {
		r.fail("%d checked nodes outside [1,%d]", n, MaxCheckedNodes)
		return c
	}
	c.Checked = make([]string, n)
	for i := range c.Checked {
		id := r.string("checked node id")
		if r.err != nil {
			return c
		}
		if id == "" || (i > 0 && c.Checked[i-1] >= id) {
			r.fail("checked node id %q empty, or not after %q", id, c.Checked[max(i-1, 0)])
			return c
		}
		c.Checked[i] = id
	}
	return c
}

// decodeAs decodes an entry that must be of type T.
func decodeAs[T Command](data []byte) (T, error) {
	var zero T
	c, err := Decode(data)
	if err != nil {
		return zero, err
	}
	v, ok := c.(T)
	if !ok {
		return zero, fmt.Errorf("entry is %s, not %s: %w", c.Type(), zero.Type(), ErrUndecodable)
	}
	return v, nil
}

// Typed decoders of complete entries.

func DecodeRegisterWorker(data []byte) (RegisterWorker, error) { return decodeAs[RegisterWorker](data) }
func DecodeDeregisterWorker(data []byte) (DeregisterWorker, error) {
	return decodeAs[DeregisterWorker](data)
}
func DecodeSetModelConfig(data []byte) (SetModelConfig, error) { return decodeAs[SetModelConfig](data) }
func DecodePredictions(data []byte) (Predictions, error)       { return decodeAs[Predictions](data) }
func DecodeTick(data []byte) (Tick, error)                     { return decodeAs[Tick](data) }
func DecodeRegisterNode(data []byte) (RegisterNode, error)     { return decodeAs[RegisterNode](data) }
func DecodeResyncWorker(data []byte) (ResyncWorker, error)     { return decodeAs[ResyncWorker](data) }
func DecodeRemoveNode(data []byte) (RemoveNode, error)         { return decodeAs[RemoveNode](data) }
func DecodePlaceWorker(data []byte) (PlaceWorker, error)       { return decodeAs[PlaceWorker](data) }
func DecodeSetGroups(data []byte) (SetGroups, error)           { return decodeAs[SetGroups](data) }
func DecodeSetWorkerDrain(data []byte) (SetWorkerDrain, error) { return decodeAs[SetWorkerDrain](data) }

// DecodeKVBatch reads a complete KVEventBatch entry (type 3 or 12). The events' block
// slices share one backing array (capacity-limited, so appending copies).
func DecodeKVBatch(data []byte) ([]KVBatchEvent, error) {
	t, _, v, p, err := header(data)
	if err != nil {
		return nil, err
	}
	if !t.isKVBatch() || v != EnvelopeVersion {
		return nil, fmt.Errorf("entry type %d version %d is not a KVEventBatch v%d: %w", uint8(t), v, EnvelopeVersion, ErrUndecodable)
	}
	return decodeKVBatchPayload(p, t == CmdKVEventBatchTiered)
}
