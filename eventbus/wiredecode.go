package eventbus

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"unicode/utf8"
)

// The WireEvent decoder, written against the msgpack spec over the message
// bytes: no decoder object, no buffer per key, no reflection. It is the
// ingest consumer's hot path (one call per KV event on the Raft leader);
// msgpack's Decoder cost several allocations per block (issue 31). It
// accepts exactly what the library-based decoder it replaced accepted
// (FuzzDecodeEventMatchesReference compares the two): Decode's rules.
//
// Allocations: the worker name (one string) and the Blocks or Removed
// slice, each sized from a length checked against the bytes left.

// msgpack codes the event format uses.
const (
	mpPosFixMax  = 0x7f
	mpFixMapMin  = 0x80
	mpFixMapMax  = 0x8f
	mpFixArrMin  = 0x90
	mpFixArrMax  = 0x9f
	mpFixStrMin  = 0xa0
	mpFixStrMax  = 0xbf
	mpNil        = 0xc0
	mpFalse      = 0xc2
	mpTrue       = 0xc3
	mpUint8      = 0xcc
	mpUint16     = 0xcd
	mpUint32     = 0xce
	mpUint64     = 0xcf
	mpInt8       = 0xd0
	mpInt16      = 0xd1
	mpInt32      = 0xd2
	mpInt64      = 0xd3
	mpStr8       = 0xd9
	mpStr16      = 0xda
	mpStr32      = 0xdb
	mpArray16    = 0xdc
	mpArray32    = 0xdd
	mpMap16      = 0xde
	mpMap32      = 0xdf
	mpNegFixMin  = 0xe0
	maxKeyLength = 8 // the longest key Decode reads
)

var errShort = errors.New("unexpected end of data")

// wireReader reads msgpack values from b[off:].
type wireReader struct {
	b   []byte
	off int
}

func (r *wireReader) left() int { return len(r.b) - r.off }

func (r *wireReader) peek() (byte, error) {
	if r.off >= len(r.b) {
		return 0, errShort
	}
	return r.b[r.off], nil
}

// take returns the next n bytes (a view of the message, not a copy).
func (r *wireReader) take(n int) ([]byte, error) {
	if n < 0 || n > r.left() {
		return nil, errShort
	}
	p := r.b[r.off : r.off+n]
	r.off += n
	return p, nil
}

// beUint reads an n-byte big-endian unsigned integer (n = 1, 2, 4, 8).
func (r *wireReader) beUint(n int) (uint64, error) {
	p, err := r.take(n)
	if err != nil {
		return 0, err
	}
	switch n {
	case 1:
		return uint64(p[0]), nil
	case 2:
		return uint64(binary.BigEndian.Uint16(p)), nil
	case 4:
		return uint64(binary.BigEndian.Uint32(p)), nil
	default:
		return binary.BigEndian.Uint64(p), nil
	}
}

// mapLen reads a map header; small only: fixmap alone (a block's map).
func (r *wireReader) mapLen(small bool) (int, error) {
	c, err := r.peek()
	if err != nil {
		return 0, err
	}
	r.off++
	switch {
	case c >= mpFixMapMin && c <= mpFixMapMax:
		return int(c & 0x0f), nil
	case small:
	case c == mpMap16:
		n, err := r.beUint(2)
		return int(n), err
	case c == mpMap32:
		n, err := r.beUint(4)
		return int(n), err
	}
	r.off--
	if small {
		return 0, fmt.Errorf("not a small map (code 0x%02x)", c)
	}
	return 0, fmt.Errorf("not a map (code 0x%02x)", c)
}

// str reads a msgpack str of at most max bytes of valid UTF-8, as a view
// of the message.
func (r *wireReader) str(max int) ([]byte, error) {
	c, err := r.peek()
	if err != nil {
		return nil, err
	}
	r.off++
	var n uint64
	switch {
	case c >= mpFixStrMin && c <= mpFixStrMax:
		n = uint64(c & 0x1f)
	case c == mpStr8:
		n, err = r.beUint(1)
	case c == mpStr16:
		n, err = r.beUint(2)
	case c == mpStr32:
		n, err = r.beUint(4)
	default:
		r.off--
		return nil, fmt.Errorf("not a string (code 0x%02x)", c)
	}
	if err != nil {
		return nil, err
	}
	if n > uint64(max) || n > uint64(r.left()) {
		return nil, fmt.Errorf("string of %d bytes (max %d, %d left)", n, max, r.left())
	}
	p, _ := r.take(int(n))
	if !utf8.Valid(p) {
		return nil, errors.New("string is not UTF-8")
	}
	return p, nil
}

// uint reads a non-negative integer of any msgpack width, up to max; nil
// and negative numbers are refused.
func (r *wireReader) uint(max uint64) (uint64, error) {
	c, err := r.peek()
	if err != nil {
		return 0, err
	}
	r.off++
	var v uint64
	switch {
	case c <= mpPosFixMax:
		v = uint64(c)
	case c >= mpUint8 && c <= mpUint64:
		v, err = r.beUint(1 << (c - mpUint8))
	case c >= mpInt8 && c <= mpInt64:
		n := 1 << (c - mpInt8)
		var u uint64
		if u, err = r.beUint(n); err != nil {
			break
		}
		// Sign-extend from n bytes.
		s := int64(u<<(64-8*n)) >> (64 - 8*n)
		if s < 0 {
			return 0, fmt.Errorf("negative number %d", s)
		}
		v = uint64(s)
	case c >= mpNegFixMin:
		r.off--
		return 0, fmt.Errorf("not an unsigned integer (code 0x%02x)", c)
	default:
		r.off--
		return 0, fmt.Errorf("not an unsigned integer (code 0x%02x)", c)
	}
	if err != nil {
		return 0, err
	}
	if v > max {
		return 0, fmt.Errorf("number %d out of range (max %d)", v, max)
	}
	return v, nil
}

// arrayLen reads an array header whose elements take at least minElem
// bytes each; nil reads as an empty array.
func (r *wireReader) arrayLen(minElem int) (int, error) {
	c, err := r.peek()
	if err != nil {
		return 0, err
	}
	r.off++
	var n uint64
	switch {
	case c == mpNil:
		return 0, nil
	case c >= mpFixArrMin && c <= mpFixArrMax:
		n = uint64(c & 0x0f)
	case c == mpArray16:
		n, err = r.beUint(2)
	case c == mpArray32:
		n, err = r.beUint(4)
	default:
		r.off--
		return 0, fmt.Errorf("not an array (code 0x%02x)", c)
	}
	if err != nil {
		return 0, err
	}
	if n > uint64(r.left()/minElem) {
		return 0, fmt.Errorf("array of %d elements in %d bytes", n, r.left())
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
	}
	return 0
}

func decodeInto(data []byte, ev *WireEvent) error {
	r := &wireReader{b: data}
	n, err := r.mapLen(false)
	if err != nil {
		return err
	}
	if n > 2*r.left() { // a key and a value take at least a byte each
		return fmt.Errorf("map of %d entries in %d bytes", n, r.left())
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
		seen |= bit
		if err := r.field(bit, ev); err != nil {
			return fmt.Errorf("field %q: %w", key, err)
		}
	}
	if r.left() != 0 {
		return fmt.Errorf("%d trailing bytes", r.left())
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
			ev.Worker = string(p)
		}
	case keyR:
		v, err = r.uint(math.MaxUint32)
		ev.DPRank = uint32(v)
	case keyI:
		ev.EventID, err = r.uint(math.MaxUint64)
	case keyK:
		v, err = r.uint(math.MaxUint8)
		ev.Kind = uint8(v)
	case keyBS:
		v, err = r.uint(math.MaxInt32)
		ev.BlockSize = int(v)
	case keyHP:
		var c byte
		if c, err = r.peek(); err == nil {
			if c != mpTrue && c != mpFalse {
				return fmt.Errorf("not a bool (code 0x%02x)", c)
			}
			r.off++
			ev.HasParent = c == mpTrue
		}
	case keyP:
		ev.Parent, err = r.uint(math.MaxUint64)
	case keyT:
		v, err = r.uint(math.MaxUint8)
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
			if ev.Removed[i], err = r.uint(math.MaxUint64); err != nil {
				return fmt.Errorf("removed %d: %w", i, err)
			}
		}
	}
	return err
}

// block reads a WireBlock: a fixmap with keys "e" and "c" (either may be
// absent, meaning zero).
func (r *wireReader) block(b *WireBlock) error {
	n, err := r.mapLen(true)
	if err != nil {
		return err
	}
	var seenE, seenC bool
	for range n {
		key, err := r.str(1)
		if err != nil {
			return err
		}
		switch {
		case string(key) == "e" && !seenE:
			seenE = true
			b.Engine, err = r.uint(math.MaxUint64)
		case string(key) == "c" && !seenC:
			seenC = true
			b.Content, err = r.uint(math.MaxUint64)
		default:
			return fmt.Errorf("unknown or duplicate key %q", key)
		}
		if err != nil {
			return fmt.Errorf("%q: %w", key, err)
		}
	}
	return nil
}
