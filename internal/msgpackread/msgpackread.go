// Package msgpackread is the msgpack reading cursor kvrouter's hand-written
// decoders share: eventbus's KV event decoder (the ingest hot path) and the
// ZMQ bridge's reader of vLLM/SGLang event batches. It reads values in place
// (strings and binaries are views of the payload, never copies), checks
// every declared length against the bytes that remain before a caller
// allocates from it, and skips nested values without recursion.
//
// It holds only the primitives: headers, integers, nil, skip. Each decoder
// keeps its own rules (which types and ranges it accepts) and its own error
// wording, so the header readers report "not this type" as ok == false
// without consuming anything, and leave the message to the caller.
package msgpackread

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// ErrShort is returned when the payload ends inside a value, unless the
// Reader was given its own error for that (New).
var ErrShort = errors.New("unexpected end of data")

// msgpack type codes.
const (
	PosFixIntMax = 0x7f
	FixMapMin    = 0x80
	FixMapMax    = 0x8f
	FixArrayMin  = 0x90
	FixArrayMax  = 0x9f
	FixStrMin    = 0xa0
	FixStrMax    = 0xbf
	Nil          = 0xc0
	False        = 0xc2
	True         = 0xc3
	Bin8         = 0xc4
	Bin16        = 0xc5
	Bin32        = 0xc6
	Ext8         = 0xc7
	Ext16        = 0xc8
	Ext32        = 0xc9
	Float32      = 0xca
	Float64      = 0xcb
	Uint8        = 0xcc
	Uint16       = 0xcd
	Uint32       = 0xce
	Uint64       = 0xcf
	Int8         = 0xd0
	Int16        = 0xd1
	Int32        = 0xd2
	Int64        = 0xd3
	FixExt1      = 0xd4
	FixExt16     = 0xd8
	Str8         = 0xd9
	Str16        = 0xda
	Str32        = 0xdb
	Array16      = 0xdc
	Array32      = 0xdd
	Map16        = 0xde
	Map32        = 0xdf
	NegFixIntMin = 0xe0
)

// IsMap reports whether c starts a map.
func IsMap(c byte) bool { return (c >= FixMapMin && c <= FixMapMax) || c == Map16 || c == Map32 }

// IsArray reports whether c starts an array.
func IsArray(c byte) bool {
	return (c >= FixArrayMin && c <= FixArrayMax) || c == Array16 || c == Array32
}

// IsBin reports whether c starts a bin.
func IsBin(c byte) bool { return c == Bin8 || c == Bin16 || c == Bin32 }

// TypeName names the msgpack type that code c starts, for error messages.
func TypeName(c byte) string {
	switch {
	case c <= PosFixIntMax || c >= NegFixIntMin || (c >= Uint8 && c <= Int64):
		return "integer"
	case IsMap(c):
		return "map"
	case IsArray(c):
		return "array"
	case c >= FixStrMin && c <= FixStrMax, c == Str8, c == Str16, c == Str32:
		return "string"
	case IsBin(c):
		return "binary"
	case c == Nil:
		return "nil"
	case c == True, c == False:
		return "bool"
	case c == Float32, c == Float64:
		return "float"
	}
	return fmt.Sprintf("code 0x%02x", c)
}

// Reader is a cursor over one msgpack payload. The zero value reads an
// empty payload; use New.
type Reader struct {
	b     []byte
	off   int
	short error // returned when the payload ends early; nil means ErrShort
}

// New returns a Reader at the start of b. short is the error it returns when
// b ends inside a value (a decoder's own sentinel or wording); nil means
// ErrShort.
func New(b []byte, short error) Reader { return Reader{b: b, short: short} }

func (r *Reader) errShort() error {
	if r.short != nil {
		return r.short
	}
	return ErrShort
}

// Left is the number of bytes not read yet.
func (r *Reader) Left() int { return len(r.b) - r.off }

// Offset is the position of the next byte to read.
func (r *Reader) Offset() int { return r.off }

// Seek moves the cursor back to an offset Offset returned earlier (to
// re-read or skip a value a decoder gave up on).
func (r *Reader) Seek(off int) { r.off = off }

// Peek returns the next byte without consuming it.
func (r *Reader) Peek() (byte, error) {
	if r.off >= len(r.b) {
		return 0, r.errShort()
	}
	return r.b[r.off], nil
}

// ReadByte consumes and returns the next byte.
func (r *Reader) ReadByte() (byte, error) {
	if r.off >= len(r.b) {
		return 0, r.errShort()
	}
	r.off++
	return r.b[r.off-1], nil
}

// Take consumes the next n bytes and returns them as a view of the payload
// (not a copy).
func (r *Reader) Take(n int) ([]byte, error) {
	if n < 0 || n > r.Left() {
		return nil, r.errShort()
	}
	p := r.b[r.off : r.off+n]
	r.off += n
	return p, nil
}

// PeekBytes returns the next n bytes without consuming them (a view of the
// payload); ok is false when fewer remain.
func (r *Reader) PeekBytes(n int) (p []byte, ok bool) {
	if n < 0 || n > r.Left() {
		return nil, false
	}
	return r.b[r.off : r.off+n], true
}

// BigEndian reads an n-byte big-endian unsigned integer (n = 1, 2, 4, 8).
func (r *Reader) BigEndian(n int) (uint64, error) {
	p, err := r.Take(n)
	if err != nil {
		return 0, err
	}
	return bigEndian(p), nil
}

// bigEndian decodes 1, 2, 4 or 8 bytes.
func bigEndian(p []byte) uint64 {
	switch len(p) {
	case 1:
		return uint64(p[0])
	case 2:
		return uint64(binary.BigEndian.Uint16(p))
	case 4:
		return uint64(binary.BigEndian.Uint32(p))
	}
	return binary.BigEndian.Uint64(p)
}

// IsNil consumes a nil and reports whether there was one.
func (r *Reader) IsNil() bool {
	if r.off < len(r.b) && r.b[r.off] == Nil {
		r.off++
		return true
	}
	return false
}

// header consumes a header of the given family: fix (a code in [fixMin,
// fixMax] carrying its length in the bits of fixMask) or one of the codes
// c8, c16, c32 (0 for none) followed by a 1-, 2- or 4-byte length. Any
// other code: ok false, nothing consumed. The length is not checked
// against the bytes left: that rule belongs to the caller.
func (r *Reader) header(fixMin, fixMax, fixMask, c8, c16, c32 byte) (n uint64, ok bool, err error) {
	c, err := r.Peek()
	if err != nil {
		return 0, false, err
	}
	var w int // bytes of the length
	switch {
	case c >= fixMin && c <= fixMax && fixMax != 0:
		r.off++
		return uint64(c & fixMask), true, nil
	case c == c8 && c8 != 0:
		w = 1
	case c == c16:
		w = 2
	case c == c32:
		w = 4
	default:
		return 0, false, nil
	}
	p, err := r.take1(w)
	if err != nil {
		return 0, true, err
	}
	return bigEndian(p), true, nil
}

// MapHeader reads a map header (fixmap, map 16, map 32): its entry count.
func (r *Reader) MapHeader() (n uint64, ok bool, err error) {
	return r.header(FixMapMin, FixMapMax, 0x0f, 0, Map16, Map32)
}

// ArrayHeader reads an array header (fixarray, array 16, array 32): its
// element count.
func (r *Reader) ArrayHeader() (n uint64, ok bool, err error) {
	return r.header(FixArrayMin, FixArrayMax, 0x0f, 0, Array16, Array32)
}

// StrHeader reads a str header (fixstr, str 8, 16, 32): its byte length.
func (r *Reader) StrHeader() (n uint64, ok bool, err error) {
	return r.header(FixStrMin, FixStrMax, 0x1f, Str8, Str16, Str32)
}

// BinHeader reads a bin header (bin 8, 16, 32): its byte length.
func (r *Reader) BinHeader() (n uint64, ok bool, err error) {
	return r.header(0, 0, 0, Bin8, Bin16, Bin32)
}

// Int reads an integer of any msgpack width. neg reports a negative value,
// whose two's complement bits are in v. Any other type: ok false, nothing
// consumed.
func (r *Reader) Int() (v uint64, neg, ok bool, err error) {
	c, err := r.Peek()
	if err != nil {
		return 0, false, false, err
	}
	switch {
	case c <= PosFixIntMax:
		r.off++
		return uint64(c), false, true, nil
	case c >= NegFixIntMin:
		r.off++
		return uint64(int64(int8(c))), true, true, nil
	case c >= Uint8 && c <= Uint64:
		p, err := r.take1(1 << (c - Uint8))
		if err != nil {
			return 0, false, true, err
		}
		return bigEndian(p), false, true, nil
	case c >= Int8 && c <= Int64:
		n := 1 << (c - Int8)
		p, err := r.take1(n)
		if err != nil {
			return 0, false, true, err
		}
		s := int64(bigEndian(p)<<(64-8*n)) >> (64 - 8*n) // sign-extend from n bytes
		return uint64(s), s < 0, true, nil
	}
	return 0, false, false, nil
}

// Uint reads a non-negative integer of any msgpack width, at most max.
// Refused, with these words: another type or a negative fixint ("not an
// unsigned integer (code 0x..)"), a negative signed integer ("negative
// number -n"), a number above max ("number n out of range (max m)").
// It is Int with the checks in the same call: on eventbus's hot path one
// call per number matters (BenchmarkBusDecodeEvent).
func (r *Reader) Uint(max uint64) (uint64, error) {
	c, err := r.Peek()
	if err != nil {
		return 0, err
	}
	var v uint64
	switch {
	case c <= PosFixIntMax:
		r.off++
		v = uint64(c)
	case c >= Uint8 && c <= Uint64:
		p, err := r.take1(1 << (c - Uint8))
		if err != nil {
			return 0, err
		}
		v = bigEndian(p)
	case c >= Int8 && c <= Int64:
		n := 1 << (c - Int8)
		p, err := r.take1(n)
		if err != nil {
			return 0, err
		}
		s := int64(bigEndian(p)<<(64-8*n)) >> (64 - 8*n) // sign-extend from n bytes
		if s < 0 {
			return 0, fmt.Errorf("negative number %d", s)
		}
		v = uint64(s)
	default:
		return 0, fmt.Errorf("not an unsigned integer (code 0x%02x)", c)
	}
	if v > max {
		return 0, fmt.Errorf("number %d out of range (max %d)", v, max)
	}
	return v, nil
}

// take1 consumes a code byte (already peeked) and the n bytes after it.
func (r *Reader) take1(n int) ([]byte, error) {
	r.off++
	return r.Take(n)
}

// Skip consumes one complete value of any type without recursion: pending
// counts the values still to be consumed, and each container adds its
// elements to it. A container declaring more values than bytes remain is
// refused at once.
func (r *Reader) Skip() error {
	for pending := uint64(1); pending > 0; pending-- {
		c, err := r.ReadByte()
		if err != nil {
			return err
		}
		var n uint64 // payload bytes to drop
		switch {
		case c <= PosFixIntMax, c >= NegFixIntMin, c == Nil, c == True, c == False:
		case c >= FixMapMin && c <= FixMapMax:
			pending += 2 * uint64(c&0x0f)
		case c >= FixArrayMin && c <= FixArrayMax:
			pending += uint64(c & 0x0f)
		case c >= FixStrMin && c <= FixStrMax:
			n = uint64(c & 0x1f)
		case c == Bin8, c == Str8:
			n, err = r.BigEndian(1)
		case c == Bin16, c == Str16:
			n, err = r.BigEndian(2)
		case c == Bin32, c == Str32:
			n, err = r.BigEndian(4)
		case c == Ext8:
			n, err = r.BigEndian(1)
			n++ // the type byte
		case c == Ext16:
			n, err = r.BigEndian(2)
			n++
		case c == Ext32:
			n, err = r.BigEndian(4)
			n++
		case c == Float32:
			n = 4
		case c == Float64:
			n = 8
		case c >= Uint8 && c <= Uint64:
			n = 1 << (c - Uint8)
		case c >= Int8 && c <= Int64:
			n = 1 << (c - Int8)
		case c >= FixExt1 && c <= FixExt16:
			n = 1 + 1<<(c-FixExt1)
		case c == Array16, c == Array32, c == Map16, c == Map32:
			var m uint64
			if c == Array16 || c == Map16 {
				m, err = r.BigEndian(2)
			} else {
				m, err = r.BigEndian(4)
			}
			if c == Map16 || c == Map32 {
				m *= 2
			}
			if err == nil && m > uint64(r.Left()) {
				return fmt.Errorf("container of %d values in %d bytes", m, r.Left())
			}
			pending += m
		default:
			return fmt.Errorf("invalid msgpack code 0x%02x", c)
		}
		if err != nil {
			return err
		}
		if n > uint64(r.Left()) {
			return r.errShort()
		}
		r.off += int(n)
		if pending > uint64(r.Left())+1 {
			// every pending value needs at least one byte
			return fmt.Errorf("%d values declared in %d bytes", pending-1, r.Left())
		}
	}
	return nil
}
