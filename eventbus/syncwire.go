package eventbus

import (
	"encoding/binary"
	"math"
)

// The replica-sync messages a replica sends per request — add (one per
// booking, with the prompt's block hashes), prefill done / output, free —
// are written here by hand instead of with msgpack's reflection (issue 31
// item 4: the add's encoding ran on the second core while the request went
// to its worker, and made that hop ≈ 30 µs longer on a 2-core machine).
//
// The bytes are exactly what msgpack.Marshal(&m) writes for the same
// SyncMsg, so every decoder that reads the library's encoding — this
// build's decodeSync and any older replica's — reads these unchanged
// (TestSyncWireMatchesLibrary, FuzzSyncAddEncodeMatchesReflect). The
// library's rules being matched (vmihailenco/msgpack v5, default encoder):
//   - a struct is a map of its fields in declaration order, keys as
//     strings, omitempty fields left out when zero (slices: when empty);
//   - a map header is fixmap / map16 / map32 by count;
//   - strings are fixstr / str8 / str16 / str32 by length;
//   - uint64 (Epoch, Seq, each hash) always 0xcf + 8 bytes big-endian;
//   - a uint8 type (SyncOp, TenantsVersion) always 0xcc + 1 byte;
//   - int the smallest form: positive fixint, uint8..uint64 for
//     non-negative values, negative fixint, int8..int64 below.
//
// A snapshot (Full) and tenant usage (Tenants) are sent at most every
// TenantInterval / FullInterval, not per request: they stay with the
// library (appendSyncMsg reports false).

// appendSyncMsg appends m's msgpack encoding to b and returns it, or
// returns b and false when m has a snapshot or tenant usage (encode those
// with the library).
func appendSyncMsg(b []byte, m *SyncMsg) ([]byte, bool) {
	if len(m.Full) > 0 || len(m.Tenants) > 0 {
		return b, false
	}
	n := 4 // r, e, s, op: never omitted
	for _, set := range [...]bool{m.Request != "", m.Worker != "", len(m.Hashes) > 0, m.ISL != 0, m.Overlap != 0,
		m.Sequences != 0, m.OutputBlocks != 0, m.Generated != 0, m.ExpectedOutput != 0, m.TenantsVersion != 0} {
		if set {
			n++
		}
	}
	b = appendMapLen(b, n)
	b = appendStr(appendStr(b, "r"), m.Replica)
	b = appendUint64(appendStr(b, "e"), m.Epoch)
	b = appendUint64(appendStr(b, "s"), m.Seq)
	b = append(appendStr(b, "op"), 0xcc, byte(m.Op))
	if m.Request != "" {
		b = appendStr(appendStr(b, "q"), m.Request)
	}
	if m.Worker != "" {
		b = appendStr(appendStr(b, "w"), string(m.Worker))
	}
	if len(m.Hashes) > 0 {
		b = appendArrayLen(appendStr(b, "h"), len(m.Hashes))
		for _, h := range m.Hashes {
			b = appendUint64(b, h)
		}
	}
	if m.ISL != 0 {
		b = appendInt(appendStr(b, "n"), int64(m.ISL))
	}
	if m.Overlap != 0 {
		b = appendInt(appendStr(b, "o"), int64(m.Overlap))
	}
	// f (Full) is empty here.
	if m.Sequences != 0 {
		b = appendInt(appendStr(b, "k"), int64(m.Sequences))
	}
	if m.OutputBlocks != 0 {
		b = appendInt(appendStr(b, "ob"), int64(m.OutputBlocks))
	}
	if m.Generated != 0 {
		b = appendInt(appendStr(b, "g"), int64(m.Generated))
	}
	if m.ExpectedOutput != 0 {
		b = appendInt(appendStr(b, "x"), int64(m.ExpectedOutput))
	}
	// tu (Tenants) is empty here.
	if m.TenantsVersion != 0 {
		b = append(appendStr(b, "tv"), 0xcc, m.TenantsVersion)
	}
	return b, true
}

func appendMapLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x80|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xde), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdf), uint32(n))
}

func appendArrayLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x90|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xdc), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdd), uint32(n))
}

func appendStr(b []byte, s string) []byte {
	switch n := len(s); {
	case n < 32:
		b = append(b, 0xa0|byte(n))
	case n < 256:
		b = append(b, 0xd9, byte(n))
	case n <= math.MaxUint16:
		b = binary.BigEndian.AppendUint16(append(b, 0xda), uint16(n))
	default:
		b = binary.BigEndian.AppendUint32(append(b, 0xdb), uint32(n))
	}
	return append(b, s...)
}

// appendUint64 writes the library's form for a uint64: always 9 bytes.
func appendUint64(b []byte, v uint64) []byte {
	return binary.BigEndian.AppendUint64(append(b, 0xcf), v)
}

// appendInt writes the library's form for an int: the smallest.
func appendInt(b []byte, v int64) []byte {
	if v >= 0 {
		switch {
		case v <= math.MaxInt8:
			return append(b, byte(v))
		case v <= math.MaxUint8:
			return append(b, 0xcc, byte(v))
		case v <= math.MaxUint16:
			return binary.BigEndian.AppendUint16(append(b, 0xcd), uint16(v))
		case v <= math.MaxUint32:
			return binary.BigEndian.AppendUint32(append(b, 0xce), uint32(v))
		}
		return appendUint64(b, uint64(v))
	}
	switch {
	case v >= -32:
		return append(b, byte(v))
	case v >= math.MinInt8:
		return append(b, 0xd0, byte(v))
	case v >= math.MinInt16:
		return binary.BigEndian.AppendUint16(append(b, 0xd1), uint16(v))
	case v >= math.MinInt32:
		return binary.BigEndian.AppendUint32(append(b, 0xd2), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xd3), uint64(v))
}
