package fsm

import (
	"fmt"
	"math"
)

// Bounds on how far the replicated state and its log entries may grow
// (issue 16, item 5; DESIGN.md, "Bounds"). They are constants of the build,
// not configuration: every replica must make the same decision on the same
// entry, and a flag could differ from one replica to the next.
const (
	// MaxEntryBytes is the largest command entry Apply accepts; a larger
	// one is refused like an undecodable entry (state unchanged). Proposers
	// stay far below it (kvrouter serve --max-entry-bytes, default 4 MiB,
	// at most MaxProposalBytes). It sits above anything any build ever
	// proposed, so no committed entry of an older leader is refused: before
	// the byte cap a 1024-event batch of 4096 aliased blocks each encoded
	// to about 64.3 MiB.
	MaxEntryBytes = 128 << 20
	// MaxProposalBytes is the most a proposer may be configured to put in
	// one entry: half of MaxEntryBytes, so a proposer's estimate can never
	// reach what Apply refuses.
	MaxProposalBytes = MaxEntryBytes / 2

	// IndexCapMultiple: a worker rank's blocks in the index are capped at
	// this multiple of the capacity it registered (TotalBlocks, per rank).
	// A truthful worker never holds more than its capacity; the index
	// trails it by the events in flight (a store can land a batch before
	// the removal that made room for it), so one full cache of slack
	// refuses nothing honest, while a worker (or a forger) can make every
	// replica hold at most twice what it declared.
	IndexCapMultiple = 2
	// DefaultRankBlockCap caps the ranks of workers that registered no
	// capacity (TotalBlocks 0): 2^20 blocks, 16 M tokens at block size 16,
	// above any single GPU's prefix cache today, so nothing is unbounded.
	DefaultRankBlockCap = 1 << 20
	// LowerTierBlockCap caps each lower storage tier (host, disk,
	// external) of a rank: workers register no capacity for their offload
	// tiers, and a host tier is commonly several times the GPU's, so 2^22
	// blocks (64 M tokens at block size 16) per tier, four of the default
	// GPU cap.
	LowerTierBlockCap = 4 * DefaultRankBlockCap
)

// ErrEntryTooLarge marks an entry larger than MaxEntryBytes. It wraps
// ErrUndecodable: such an entry is refused and counted like one.
var ErrEntryTooLarge = fmt.Errorf("entry larger than %d bytes: %w", MaxEntryBytes, ErrUndecodable)

// RankBlockCap is the most blocks one rank of a worker registered with
// totalBlocks (per rank; 0 = not reported) may hold in the index: stored
// events beyond it are refused (RejectOverCapacity).
func RankBlockCap(totalBlocks int) int {
	if totalBlocks <= 0 {
		return DefaultRankBlockCap
	}
	if totalBlocks > math.MaxInt/IndexCapMultiple {
		return math.MaxInt
	}
	return IndexCapMultiple * totalBlocks
}

// errEntryTooLarge is Apply's refusal of an entry of n bytes.
func errEntryTooLarge(n int) error {
	return fmt.Errorf("entry of %d bytes: %w", n, ErrEntryTooLarge)
}
