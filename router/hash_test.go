package router

import "testing"

// Dynamo's published vectors (DESIGN.md §3), block size 4.
func TestHashDynamoVectors(t *testing.T) {
	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
	local, seq := BlockHashes(tokens, 4, "")
	tests := []struct {
		name      string
		got, want uint64
	}{
		{"local[0]", local[0], 14643705804678351452},
		{"seq[0]", seq[0], 14643705804678351452},
		{"local[1]", local[1], 16777012769546811212},
		{"seq[1]", seq[1], 4945711292740353085},
		{"local[2]", local[2], 483935686894639516},
		{"seq[2]", seq[2], 12583592247330656132},
	}
	for _, tc := range tests {
		if tc.got != tc.want {
			t.Errorf("%s = %d, want %d", tc.name, tc.got, tc.want)
		}
	}
	loraLocal, _ := BlockHashes(tokens[:4], 4, "my-lora")
	if loraLocal[0] != 15671544057904749233 {
		t.Errorf("lora local = %d, want 15671544057904749233", loraLocal[0])
	}
}

func TestHashPartialAndEmpty(t *testing.T) {
	tests := []struct {
		name      string
		tokens    []uint32
		blockSize int
		want      int
	}{
		{"empty", nil, 16, 0},
		{"shorter than a block", []uint32{1, 2, 3}, 16, 0},
		{"one full plus partial", make([]uint32, 20), 16, 1},
		{"zero block size", []uint32{1, 2}, 0, 0},
		{"negative block size", []uint32{1, 2}, -4, 0},
	}
	for _, tc := range tests {
		if got := len(SequenceHashes(tc.tokens, tc.blockSize, "")); got != tc.want {
			t.Errorf("%s: %d blocks, want %d", tc.name, got, tc.want)
		}
	}
}

// Dynamo's cache-salt rule (compute_salt_hash, ai-dynamo/dynamo
// lib/kv-hashing/src/salt.rs): seed = 1337 + XXH3(lora, 0) + XXH3(salt, 1),
// wrapping. The arithmetic, with XXH3-64("tenant-a", seed 1) =
// 1948188790972762749 and XXH3-64("my-lora", seed 0) = 12827409268353071524:
//
//	salt only:   1337 + 1948188790972762749 = 1948188790972764086
//	lora + salt: 1337 + 12827409268353071524 + 1948188790972762749
//	           = 14775598059325835610 (below 2^64: no wrap)
func TestHashCacheSaltVectors(t *testing.T) {
	tests := []struct {
		name      string
		got, want uint64
	}{
		{"seed none", CacheSeed("", ""), HashSeed},
		{"seed lora only = LoRASeed", CacheSeed("my-lora", ""), LoRASeed("my-lora")},
		{"seed salt", CacheSeed("", "tenant-a"), 1948188790972764086},
		{"seed lora+salt", CacheSeed("my-lora", "tenant-a"), 14775598059325835610},
	}
	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	local, seq := SeededBlockHashes(tokens, 4, CacheSeed("", "tenant-a"))
	ls, _ := SeededBlockHashes(tokens[:4], 4, CacheSeed("my-lora", "tenant-a"))
	tests = append(tests, []struct {
		name      string
		got, want uint64
	}{
		{"salted local[0]", local[0], 5738685477468498325},
		{"salted seq[0]", seq[0], 5738685477468498325},
		{"salted local[1]", local[1], 11202231085456067787},
		{"salted seq[1] (chain seed stays 1337)", seq[1], ChainHash(seq[0], local[1])},
		{"salted seq[1]", seq[1], 1076233986426276607},
		{"lora+salt local[0]", ls[0], 6157910915076630503},
	}...)
	for _, tc := range tests {
		if tc.got != tc.want {
			t.Errorf("%s = %d, want %d", tc.name, tc.got, tc.want)
		}
	}
}

func TestHashCacheSaltIsolates(t *testing.T) {
	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	plain := SequenceHashes(tokens, 4, "")
	a1 := SaltedSequenceHashes(tokens, 4, "", "a")
	a2 := SaltedSequenceHashes(tokens, 4, "", "a")
	b := SaltedSequenceHashes(tokens, 4, "", "b")
	for i := range plain {
		if a1[i] == plain[i] || a1[i] == b[i] {
			t.Errorf("block %d: salted hash collides with another namespace", i)
		}
		if a1[i] != a2[i] {
			t.Errorf("block %d: same salt, different hash", i)
		}
	}
	if got := SaltedSequenceHashes(tokens, 4, "", ""); got[1] != plain[1] {
		t.Errorf("empty salt must be no salt")
	}
}
