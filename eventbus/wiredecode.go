package eventbus

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"unicode/utf8"

	"github.com/kvrouter/kvrouter/internal/msgpackread"
)

// The WireEvent decoder, written against the msgpack spec over the message
// bytes: no decoder object, no buffer per key, no reflection. It is the
// ingest consumer's hot path (one call per KV event on the Raft leader);
// msgpack's Decoder cost several allocations per block (issue 31). It
// accepts exactly what the library-based decoder it replaced accepted
// (FuzzDecodeEventMatchesReference compares the two): Decode's rules.
//
// The msgpack cursor (headers, integers, bounds) is internal/msgpackread,
// shared with the ZMQ bridge's reader; what Decode accepts and how it words
// a refusal stay here.
//
// Allocations: the worker name (one string) and the Blocks or Removed
// slice, each sized from a length checked against the bytes left.

// maxKeyLength is the longest key Decode reads.
const maxKeyLength = 8

var errShort = errors.New("unexpected end of data")

// wireReader reads msgpack values with Decode's rules and wording on top of
// the shared cursor (internal/msgpackread). Decoding stops at the first
// error, so a refused value may be left half consumed.
//
// worker is a batch's previous member's worker name: a member naming the
// same worker shares its string instead of allocating one (every member of
// a valid batch names the same worker).
type wireReader struct {
	msgpackread.Reader
	worker string
}

// mapLen reads a map header; small only: fixmap alone (a block's map).
func (r *wireReader) mapLen(small bool) (int, error) {
	c, err := r.Peek()
	if err != nil {
		return 0, err
	}
	if small {
		if c < msgpackread.FixMapMin || c > msgpackread.FixMapMax {
			return 0, fmt.Errorf("not a small map (code 0x%02x)", c)
		}
		r.Seek(r.Offset() + 1)
		return int(c & 0x0f), nil
	}
	n, ok, err := r.MapHeader()
	if !ok {
		return 0, fmt.Errorf("not a map (code 0x%02x)", c)
	}
	return int(n), err
}

// str reads a msgpack str of at most max bytes of valid UTF-8, as a view
// of the message.
func (r *wireReader) str(max int) ([]byte, error) {
	n, ok, err := r.StrHeader()
	if err != nil {
		return nil, err
	}
	if !ok {
		c, _ := r.Peek()
		return nil, fmt.Errorf("not a string (code 0x%02x)", c)
	}
	if n > uint64(max) || n > uint64(r.Left()) {
		return nil, fmt.Errorf("string of %d bytes (max %d, %d left)", n, max, r.Left())
	}
	p, _ := r.Take(int(n))
	if !utf8.Valid(p) {
		return nil, errors.New("string is not UTF-8")
	}
	return p, nil
}

// arrayLen reads an array header whose elements take at least minElem
// bytes each; nil reads as an empty array.
func (r *wireReader) arrayLen(minElem int) (int, error) {
	if r.IsNil() {
		return 0, nil
	}
	n, ok, err := r.ArrayHeader()
	if err != nil {
		return 0, err
	}
	if !ok {
		c, _ := r.Peek()
		return 0, fmt.Errorf("not an array (code 0x%02x)", c)
	}
	if n > uint64(r.Left()/minElem) {
		return 0, fmt.Errorf("array of %d elements in %d bytes", n, r.Left())
	}
	return int(n), nil
}

// Key bits of WireEvent's fields, to refuse a key seen twice.
const (
	keyW uint16 = 1 << iota
	keyR
	keyI
	keyK
	keyBS
	keyHP
	keyP
	keyB
	keyX
	keyT
	keyBH // stored blocks, compact: bin of 8-byte hashes (engine = content)
	keyBP // stored blocks, compact: bin of 16-byte (engine, content) pairs
	keyXH // removed hashes, compact: bin of 8-byte hashes

	// At most one key of each group: an event's stored blocks, or its
	// removed hashes, come in one form.
	blockKeys   = keyB | keyBH | keyBP
	removedKeys = keyX | keyXH
)

func wireKeyBit(key []byte) uint16 {
	switch string(key) { // no allocation: the compiler compares in place
	case "w":
		return keyW
	case "r":
		return keyR
	case "i":
		return keyI
	case "k":
		return keyK
	case "bs":
		return keyBS
	case "hp":
		return keyHP
	case "p":
		return keyP
	case "b":
		return keyB
	case "x":
		return keyX
	case "t":
		return keyT
	case "bh":
		return keyBH
	case "bp":
		return keyBP
	case "xh":
		return keyXH
	}
	return 0
}

func decodeInto(data []byte, ev *WireEvent) error {
	r := &wireReader{Reader: msgpackread.New(data, errShort)}
	if err := r.event(ev); err != nil {
		return err
	}
	if r.Left() != 0 {
		return fmt.Errorf("%d trailing bytes", r.Left())
	}
	return nil
}

// event reads one event map (Decode's rules, without the trailing-bytes
// check: a batch's members follow each other).
func (r *wireReader) event(ev *WireEvent) error {
	n, err := r.mapLen(false)
	if err != nil {
		return err
	}
	if n > 2*r.Left() { // a key and a value take at least a byte each
		return fmt.Errorf("map of %d entries in %d bytes", n, r.Left())
	}
	var seen uint16
	for range n {
		key, err := r.str(maxKeyLength)
		if err != nil {
			return fmt.Errorf("key: %w", err)
		}
		bit := wireKeyBit(key)
		if bit == 0 {
			return fmt.Errorf("unknown key %q", key)
		}
		if seen&bit != 0 {
			return fmt.Errorf("duplicate key %q", key)
		}
		if (bit&blockKeys != 0 && seen&blockKeys != 0) || (bit&removedKeys != 0 && seen&removedKeys != 0) {
			return fmt.Errorf("key %q: the same field given in two forms", key)
		}
		seen |= bit
		if err := r.field(bit, ev); err != nil {
			return fmt.Errorf("field %q: %w", key, err)
		}
	}
	return nil
}

func (r *wireReader) field(bit uint16, ev *WireEvent) error {
	var err error
	var v uint64
	switch bit {
	case keyW:
		var p []byte
		if p, err = r.str(MaxWorkerNameLen); err == nil {
			if string(p) != r.worker {
				r.worker = string(p)
			}
			ev.Worker = r.worker
		}
	case keyR:
		v, err = r.Uint(math.MaxUint32)
		ev.DPRank = uint32(v)
	case keyI:
		ev.EventID, err = r.Uint(math.MaxUint64)
	case keyK:
		v, err = r.Uint(math.MaxUint8)
		ev.Kind = uint8(v)
	case keyBS:
		v, err = r.Uint(math.MaxInt32)
		ev.BlockSize = int(v)
	case keyHP:
		var c byte
		if c, err = r.ReadByte(); err == nil {
			if c != msgpackread.True && c != msgpackread.False {
				return fmt.Errorf("not a bool (code 0x%02x)", c)
			}
			ev.HasParent = c == msgpackread.True
		}
	case keyP:
		ev.Parent, err = r.Uint(math.MaxUint64)
	case keyT:
		v, err = r.Uint(math.MaxUint8)
		ev.Tier = uint8(v)
	case keyB:
		var n int
		if n, err = r.arrayLen(1); err != nil || n == 0 {
			return err
		}
		ev.Blocks = make([]WireBlock, n)
		for i := range ev.Blocks {
			if err = r.block(&ev.Blocks[i]); err != nil {
				return fmt.Errorf("block %d: %w", i, err)
			}
		}
	case keyX:
		var n int
		if n, err = r.arrayLen(1); err != nil || n == 0 {
			return err
		}
		ev.Removed = make([]uint64, n)
		for i := range ev.Removed {
			// The usual encoding of a hash (code 0xcf and 8 bytes) read
			// in place; any other goes through Uint.
			if p, ok := r.PeekBytes(9); ok && p[0] == msgpackread.Uint64 {
				ev.Removed[i] = binary.BigEndian.Uint64(p[1:9])
				r.Seek(r.Offset() + 9)
				continue
			}
			if ev.Removed[i], err = r.Uint(math.MaxUint64); err != nil {
				return fmt.Errorf("removed %d: %w", i, err)
			}
		}
	case keyBH:
		var p []byte
		if p, err = r.hashes(8); err != nil || len(p) == 0 {
			return err
		}
		ev.Blocks = make([]WireBlock, len(p)/8)
		for i := range ev.Blocks {
			h := binary.BigEndian.Uint64(p[8*i:])
			ev.Blocks[i] = WireBlock{Engine: h, Content: h}
		}
	case keyBP:
		var p []byte
		if p, err = r.hashes(16); err != nil || len(p) == 0 {
			return err
		}
		ev.Blocks = make([]WireBlock, len(p)/16)
		for i := range ev.Blocks {
			ev.Blocks[i] = WireBlock{Engine: binary.BigEndian.Uint64(p[16*i:]), Content: binary.BigEndian.Uint64(p[16*i+8:])}
		}
	case keyXH:
		var p []byte
		if p, err = r.hashes(8); err != nil || len(p) == 0 {
			return err
		}
		ev.Removed = make([]uint64, len(p)/8)
		for i := range ev.Removed {
			ev.Removed[i] = binary.BigEndian.Uint64(p[8*i:])
		}
	}
	return err
}

// hashes reads a compact hash array (keys "bh", "bp", "xh"): a msgpack bin
// whose length is a multiple of elem bytes, as a view of the message; nil
// reads as empty.
func (r *wireReader) hashes(elem int) ([]byte, error) {
	if r.IsNil() {
		return nil, nil
	}
	n, ok, err := r.BinHeader()
	if err != nil {
		return nil, err
	}
	if !ok {
		c, _ := r.Peek()
		return nil, fmt.Errorf("not a bin (code 0x%02x)", c)
	}
	if n > uint64(r.Left()) {
		return nil, fmt.Errorf("bin of %d bytes, %d left", n, r.Left())
	}
	if n%uint64(elem) != 0 {
		return nil, fmt.Errorf("bin of %d bytes: not a multiple of %d", n, elem)
	}
	return r.Take(int(n))
}

// blockKey reads a block's key, a string of at most one byte. Its usual
// encoding (a fixstr of one ASCII byte) is read here, without the general
// string reader: one call less per key on the ingest hot path
// (BenchmarkBusDecodeEvent); anything else goes through str, so the same
// bytes are accepted and refused.
func (r *wireReader) blockKey() ([]byte, error) {
	if p, ok := r.PeekBytes(2); ok && p[0] == msgpackread.FixStrMin|1 && p[1] < utf8.RuneSelf {
		r.Seek(r.Offset() + 2)
		return p[1:], nil
	}
	return r.str(1)
}

// blockWire is the usual encoding of a block, 23 bytes: a fixmap of two,
// fixstr "e", uint64 (code 0xcf and 8 bytes), fixstr "c", uint64. Encode
// writes every hash of 2^56 or more so, i.e. all but a few in 10^17 of
// random 64-bit hashes.
const blockWireLen = 23

// block reads a WireBlock: a fixmap with keys "e" and "c" (either may be
// absent, meaning zero). Blocks in their usual encoding (blockWireLen) are
// read by comparing seven fixed bytes and loading two big-endian words:
// the bulk of the leader's decode (32 blocks per vLLM event; issue 31 item
// 3). Anything else takes the general path, which accepts exactly these
// bytes too (FuzzDecodeEventMatchesReference holds both to the library).
func (r *wireReader) block(b *WireBlock) error {
	if p, ok := r.PeekBytes(blockWireLen); ok && p[0] == msgpackread.FixMapMin|2 &&
		p[1] == msgpackread.FixStrMin|1 && p[2] == 'e' && p[3] == msgpackread.Uint64 &&
		p[12] == msgpackread.FixStrMin|1 && p[13] == 'c' && p[14] == msgpackread.Uint64 {
		b.Engine = binary.BigEndian.Uint64(p[4:12])
		b.Content = binary.BigEndian.Uint64(p[15:23])
		r.Seek(r.Offset() + blockWireLen)
		return nil
	}
	n, err := r.mapLen(true)
	if err != nil {
		return err
	}
	var seenE, seenC bool
	for range n {
		key, err := r.blockKey()
		if err != nil {
			return err
		}
		switch {
		case string(key) == "e" && !seenE:
			seenE = true
			b.Engine, err = r.Uint(math.MaxUint64)
		case string(key) == "c" && !seenC:
			seenC = true
			b.Content, err = r.Uint(math.MaxUint64)
		default:
			return fmt.Errorf("unknown or duplicate key %q", key)
		}
		if err != nil {
			return fmt.Errorf("%q: %w", key, err)
		}
	}
	return nil
}
