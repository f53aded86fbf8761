package eventbus

import (
	"encoding/binary"
	"fmt"
	"math"
	"unicode/utf8"

	"github.com/kvrouter/kvrouter/internal/msgpackread"
)

// The compact form of an event's hashes (issue 31 item 3). In the map form
// Encode writes, a stored block is a map of two keyed uint64s, 23 bytes for
// 8 or 16 bytes of hashes, and a removed hash 9 bytes; hashes are
// uniformly random, so the tags are all there is to save. Every byte of a
// KV event message is paid for several times over before it reaches the
// Raft log: the R3 stream writes and fsyncs it on every replica (its file
// store and its NATS Raft WAL), sends it over TLS on every route, and
// delivers it over TLS to the consumer, which decodes it. The compact keys
// carry the same hashes as one msgpack bin each:
//
//	"bh"  bin, 8 bytes a block:  the hash of a block whose engine hash is
//	      its content hash (kvmock, kvbench: engines that name blocks by
//	      our hash)
//	"bp"  bin, 16 bytes a block: engine hash, content hash
//	"xh"  bin, 8 bytes a hash:   removed engine hashes
//
// all big endian, as msgpack's integers. An event gives its stored blocks
// under one of "b", "bh", "bp" and its removed hashes under one of "x",
// "xh"; Decode refuses two forms of one field, a bin whose length is not a
// multiple of its element, and reads nil or an empty bin as no hashes. The
// decoded WireEvent is the same whatever the form, so everything after
// Decode (Validate, the Raft entry, the FSM) is unchanged.
//
// A consumer of a build before the compact keys refuses such an event as
// undecodable (unknown key): publishers use the form only when asked
// (WithCompactHashes), once every replica runs a build that knows it.

// EncodeCompact returns the msgpack encoding of ev with its hashes in the
// compact form: stored blocks under "bh" when every block's engine hash is
// its content hash, else under "bp"; removed hashes under "xh". The other
// fields are encoded as Encode encodes them (integers in their shortest
// form, zero-valued optional fields left out). It refuses a worker name
// Decode would refuse (longer than MaxWorkerNameLen or not UTF-8), so what
// it writes always decodes.
func EncodeCompact(ev *WireEvent) ([]byte, error) {
	return AppendCompact(make([]byte, 0, compactSize(ev)), ev)
}

// AppendCompact appends EncodeCompact's encoding of ev to b.
func AppendCompact(b []byte, ev *WireEvent) ([]byte, error) {
	if len(ev.Worker) > MaxWorkerNameLen || !utf8.ValidString(ev.Worker) {
		return b, fmt.Errorf("encode event %s: worker name of %d bytes is not UTF-8 of at most %d", ev.MsgID(), len(ev.Worker), MaxWorkerNameLen)
	}
	aliased := true
	for _, bl := range ev.Blocks {
		if bl.Engine != bl.Content {
			aliased = false
			break
		}
	}
	n := 3 // w, i, k
	for _, set := range []bool{ev.DPRank != 0, ev.BlockSize != 0, ev.HasParent, ev.Parent != 0,
		len(ev.Blocks) > 0, len(ev.Removed) > 0, ev.Tier != 0} {
		if set {
			n++
		}
	}
	b = append(b, msgpackread.FixMapMin|byte(n))
	b = appendStr(b, "w")
	b = appendStr(b, ev.Worker)
	if ev.DPRank != 0 {
		b = appendUint(appendStr(b, "r"), uint64(ev.DPRank))
	}
	b = appendUint(appendStr(b, "i"), ev.EventID)
	b = appendUint(appendStr(b, "k"), uint64(ev.Kind))
	if ev.BlockSize != 0 {
		if ev.BlockSize < 0 || ev.BlockSize > math.MaxInt32 {
			return b, fmt.Errorf("encode event %s: block size %d", ev.MsgID(), ev.BlockSize)
		}
		b = appendUint(appendStr(b, "bs"), uint64(ev.BlockSize))
	}
	if ev.HasParent {
		b = append(appendStr(b, "hp"), msgpackread.True)
	}
	if ev.Parent != 0 {
		b = appendUint(appendStr(b, "p"), ev.Parent)
	}
	if len(ev.Blocks) > 0 {
		if aliased {
			b = appendBinHeader(appendStr(b, "bh"), 8*len(ev.Blocks))
			for _, bl := range ev.Blocks {
				b = binary.BigEndian.AppendUint64(b, bl.Engine)
			}
		} else {
			b = appendBinHeader(appendStr(b, "bp"), 16*len(ev.Blocks))
			for _, bl := range ev.Blocks {
				b = binary.BigEndian.AppendUint64(b, bl.Engine)
				b = binary.BigEndian.AppendUint64(b, bl.Content)
			}
		}
	}
	if len(ev.Removed) > 0 {
		b = appendBinHeader(appendStr(b, "xh"), 8*len(ev.Removed))
		for _, h := range ev.Removed {
			b = binary.BigEndian.AppendUint64(b, h)
		}
	}
	if ev.Tier != 0 {
		b = appendUint(appendStr(b, "t"), uint64(ev.Tier))
	}
	return b, nil
}

// compactSize bounds the bytes of ev's compact encoding.
func compactSize(ev *WireEvent) int {
	return 64 + len(ev.Worker) + 16*len(ev.Blocks) + 8*len(ev.Removed)
}

// appendUint appends v in msgpack's shortest unsigned form.
func appendUint(b []byte, v uint64) []byte {
	switch {
	case v <= 0x7f:
		return append(b, byte(v))
	case v <= math.MaxUint8:
		return append(b, msgpackread.Uint8, byte(v))
	case v <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, msgpackread.Uint16), uint16(v))
	case v <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(b, msgpackread.Uint32), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(b, msgpackread.Uint64), v)
}

// appendBinHeader appends a msgpack bin header for n bytes.
func appendBinHeader(b []byte, n int) []byte {
	switch {
	case n <= math.MaxUint8:
		return append(b, msgpackread.Bin8, byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, msgpackread.Bin16), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, msgpackread.Bin32), uint32(n))
}
