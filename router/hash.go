package router

import (
	"encoding/binary"

	"github.com/zeebo/xxh3"
)

// HashSeed is Dynamo's seed for block hashes. Matching it bit for bit is what
// lets operators compare our hashes with Dynamo's (`kvrouter hash`).
const HashSeed uint64 = 1337

// LoRASeed returns the hash seed for blocks computed under a LoRA adapter:
// the base seed plus XXH3-64 of the adapter name (seed 0), wrapping.
// An empty name is the base model.
func LoRASeed(lora string) uint64 { return CacheSeed(lora, "") }

// CacheSeed returns the hash seed for blocks computed under a LoRA adapter
// and a cache salt (vLLM's `cache_salt`), by Dynamo's rule
// (compute_salt_hash, lib/kv-hashing/src/salt.rs):
//
//	seed = 1337 + XXH3-64(lora, seed 0) + XXH3-64(salt, seed 1)   (wrapping)
//
// where an empty lora or salt adds nothing. The seed is that of every block's
// local hash; the chain hash keeps seed 1337. A salted request thus never
// matches unsalted blocks (nor another salt's), and matches its own salt's.
func CacheSeed(lora, salt string) uint64 {
	seed := HashSeed
	if lora != "" {
		seed += xxh3.HashSeed([]byte(lora), 0)
	}
	if salt != "" {
		seed += xxh3.HashSeed([]byte(salt), 1)
	}
	return seed
}

// LocalBlockHash hashes one block's token ids (little-endian u32) with seed.
func LocalBlockHash(tokens []uint32, seed uint64) uint64 {
	var stack [64 * 4]byte
	buf := stack[:0]
	if len(tokens)*4 > len(stack) {
		buf = make([]byte, 0, len(tokens)*4)
	}
	for _, t := range tokens {
		buf = binary.LittleEndian.AppendUint32(buf, t)
	}
	return xxh3.HashSeed(buf, seed)
}

// ChainHash links a block to its parent's sequence hash:
// seq = XXH3-64(LE64(parent) ‖ LE64(local), seed 1337).
func ChainHash(parentSeq, local uint64) uint64 {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], parentSeq)
	binary.LittleEndian.PutUint64(b[8:], local)
	return xxh3.HashSeed(b[:], HashSeed)
}

// BlockHashes computes the local and sequence hashes of every full block of
// tokens. A trailing partial block is not hashed: engines cache full blocks
// only. The sequence hash is the content hash the prefix index is keyed by.
func BlockHashes(tokens []uint32, blockSize int, lora string) (local, seq []uint64) {
	return SeededBlockHashes(tokens, blockSize, LoRASeed(lora))
}

// SeededBlockHashes is BlockHashes with the local hashes' seed given
// (CacheSeed).
func SeededBlockHashes(tokens []uint32, blockSize int, seed uint64) (local, seq []uint64) {
	if blockSize <= 0 {
		return nil, nil
	}
	n := len(tokens) / blockSize
	if n == 0 {
		return nil, nil
	}
	local = make([]uint64, n)
	seq = make([]uint64, n)
	for i := 0; i < n; i++ {
		local[i] = LocalBlockHash(tokens[i*blockSize:(i+1)*blockSize], seed)
		if i == 0 {
			seq[i] = local[i]
		} else {
			seq[i] = ChainHash(seq[i-1], local[i])
		}
	}
	return local, seq
}

// SequenceHashes is BlockHashes without the local hashes.
func SequenceHashes(tokens []uint32, blockSize int, lora string) []uint64 {
	_, seq := BlockHashes(tokens, blockSize, lora)
	return seq
}

// SaltedSequenceHashes is SequenceHashes under a LoRA adapter and a cache salt
// (CacheSeed); an empty salt gives SequenceHashes.
func SaltedSequenceHashes(tokens []uint32, blockSize int, lora, salt string) []uint64 {
	_, seq := SeededBlockHashes(tokens, blockSize, CacheSeed(lora, salt))
	return seq
}
