package router

import (
	"errors"
	"fmt"
	"strings"
)

// WorkerID names one routable worker (one engine, or one data-parallel rank
// of an engine: callers fold the dp rank into the id, see WorkerKey).
type WorkerID string

// WorkerKey returns the router's id for rank dpRank of worker id. Rank 0 is
// the worker itself, so single-rank engines keep their plain id.
func WorkerKey(id string, dpRank uint32) WorkerID {
	if dpRank == 0 {
		return WorkerID(id)
	}
	return WorkerID(fmt.Sprintf("%s#%d", id, dpRank))
}

// EventKind says what a KV event did to a worker's cache.
type EventKind uint8

// Event kinds. The numbers travel in the Raft log and on the wire: append only.
const (
	EventStored  EventKind = 1
	EventRemoved EventKind = 2
	EventCleared EventKind = 3
)

func (k EventKind) String() string {
	switch k {
	case EventStored:
		return "stored"
	case EventRemoved:
		return "removed"
	case EventCleared:
		return "cleared"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Tier is the storage tier an event's blocks sit in. The device tier (the
// engine's GPU prefix cache) is the one every build indexes; the lower
// tiers are offload caches the engine can load a block back from, cheaper
// than recomputing it but not free, so the cost function credits them at
// Config.HostCacheHitWeight and Config.DiskCacheHitWeight (Dynamo's
// StorageTier). The numbers travel in the Raft log (fsm command 12) and on
// the bus: append only.
type Tier uint8

// Tiers, walked in this order when a match is extended (FindTieredMatches).
const (
	TierDevice   Tier = 0 // GPU HBM; the zero value, what an event without a tier means
	TierHost     Tier = 1 // host (CPU) memory
	TierDisk     Tier = 2 // local disk / NVMe
	TierExternal Tier = 3 // a remote or shared pool; credited as disk, as Dynamo does
	// NumTiers bounds the tier numbers this build knows.
	NumTiers = 4
)

func (t Tier) String() string {
	switch t {
	case TierDevice:
		return "device"
	case TierHost:
		return "host"
	case TierDisk:
		return "disk"
	case TierExternal:
		return "external"
	}
	return fmt.Sprintf("tier(%d)", uint8(t))
}

// Valid reports whether this build knows t.
func (t Tier) Valid() bool { return t < NumTiers }

// TierOfMedium maps an engine's KV event medium to its tier, with Dynamo's
// spellings (StorageTier::from_kv_medium): vLLM says GPU and CPU, its KV
// offloading and KVBM CPU_PINNED/CPU_TIER1 (host) and CPU_TIER2/DISK
// (disk), SGLang's HiCache STORAGE for its disk layer. "" is the device
// tier (engines that predate the field). false: a medium this build does
// not know, which callers skip rather than guess a tier for.
func TierOfMedium(medium string) (Tier, bool) {
	switch strings.ToUpper(medium) {
	case "", "GPU", "DEVICE":
		return TierDevice, true
	case "CPU", "CPU_PINNED", "CPU_TIER1", "HOST", "HOST_PINNED":
		return TierHost, true
	case "CPU_TIER2", "DISK", "NVME", "STORAGE":
		return TierDisk, true
	case "EXTERNAL", "NETWORK", "REMOTE", "SHARED":
		return TierExternal, true
	}
	return 0, false
}

// StoredBlock is one block a worker stored: the engine's opaque name for it
// and our content (sequence) hash, which the index is keyed by.
type StoredBlock struct {
	EngineHash  uint64
	ContentHash uint64
}

// KVEvent is one change to one worker's cache, already translated into our
// hashes. Stored blocks form a chain under Parent (an engine hash of a block
// this worker already holds) or start a sequence when HasParent is false.
type KVEvent struct {
	Kind      EventKind
	HasParent bool
	Parent    uint64        // engine hash of the parent block (stored)
	Blocks    []StoredBlock // stored, in chain order
	Removed   []uint64      // engine hashes (removed)
	BlockSize int           // tokens per block as the engine reported it; 0 = not reported
	// Tier is the storage tier of the event's blocks (TierDevice, the zero
	// value, for every engine event before tiers). A cleared event of a
	// tier clears that tier only.
	Tier Tier
}

// Errors the index reports. Callers use errors.Is; the typed errors below
// carry the details.
var (
	ErrUnknownWorker     = errors.New("unknown worker")
	ErrMissingParent     = errors.New("stored event's parent block is not held by the worker")
	ErrBlockSizeMismatch = errors.New("block size mismatch")
	ErrInvalidEvent      = errors.New("invalid event")
	ErrOverCapacity      = errors.New("worker's blocks would exceed its cap")
)

// MissingParentError says a stored event named a parent block the worker does
// not hold: the index and the worker disagree, so the worker needs a resync.
// The blocks of that event were not applied.
type MissingParentError struct {
	Worker WorkerID
	Parent uint64
}

func (e *MissingParentError) Error() string {
	return fmt.Sprintf("worker %s: parent block %d not held: %v", e.Worker, e.Parent, ErrMissingParent)
}

func (e *MissingParentError) Unwrap() error { return ErrMissingParent }

// BlockSizeError says an event's block size differs from the configured one.
// Applying it would give zero overlap forever, so it is rejected.
type BlockSizeError struct {
	Worker    WorkerID
	Got, Want int
}

func (e *BlockSizeError) Error() string {
	return fmt.Sprintf("worker %s: event block size %d, configured %d: %v", e.Worker, e.Got, e.Want, ErrBlockSizeMismatch)
}

func (e *BlockSizeError) Unwrap() error { return ErrBlockSizeMismatch }

// CapacityError says a stored event would have taken a worker past the
// most blocks its caller lets it hold (Index.ApplyCapped). Nothing of the
// event was applied.
type CapacityError struct {
	Worker WorkerID
	Held   int // blocks the worker holds
	Adding int // blocks of the event it does not hold yet
	Limit  int
}

func (e *CapacityError) Error() string {
	return fmt.Sprintf("worker %s: holds %d blocks, the event adds %d, cap %d: %v", e.Worker, e.Held, e.Adding, e.Limit, ErrOverCapacity)
}

func (e *CapacityError) Unwrap() error { return ErrOverCapacity }
