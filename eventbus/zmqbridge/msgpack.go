package zmqbridge

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
)

// reader is a minimal msgpack cursor over one payload. It never allocates
// for what it skips, checks every declared length against the bytes that
// remain before anything is allocated, and skips nested values iteratively
// (a hostile payload of a million nested arrays cannot blow the stack).
type reader struct {
	b   []byte
	off int
}

var errTruncated = errors.New("truncated")

// msgpack type codes used below.
const (
	cNil     = 0xc0
	cFalse   = 0xc2
	cTrue    = 0xc3
	cBin8    = 0xc4
	cBin16   = 0xc5
	cBin32   = 0xc6
	cExt8    = 0xc7
	cExt16   = 0xc8
	cExt32   = 0xc9
	cFloat32 = 0xca
	cFloat64 = 0xcb
	cUint8   = 0xcc
	cUint16  = 0xcd
	cUint32  = 0xce
	cUint64  = 0xcf
	cInt8    = 0xd0
	cInt16   = 0xd1
	cInt32   = 0xd2
	cInt64   = 0xd3
	cFixExt1 = 0xd4
	cFixExt2 = 0xd5
	cFixExt4 = 0xd6
	cFixExt8 = 0xd7
	cFixExt  = 0xd8
	cStr8    = 0xd9
	cStr16   = 0xda
	cStr32   = 0xdb
	cArray16 = 0xdc
	cArray32 = 0xdd
	cMap16   = 0xde
	cMap32   = 0xdf
)

func (r *reader) left() int { return len(r.b) - r.off }

func (r *reader) peek() (byte, error) {
	if r.off >= len(r.b) {
		return 0, errTruncated
	}
	return r.b[r.off], nil
}

func (r *reader) take(n int) ([]byte, error) {
	if n < 0 || n > r.left() {
		return nil, errTruncated
	}
	p := r.b[r.off : r.off+n]
	r.off += n
	return p, nil
}

func (r *reader) uintN(n int) (uint64, error) {
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
	}
	return binary.BigEndian.Uint64(p), nil
}

// isNil consumes a nil and reports whether there was one.
func (r *reader) isNil() bool {
	if c, err := r.peek(); err == nil && c == cNil {
		r.off++
		return true
	}
	return false
}

func codeName(c byte) string {
	switch {
	case c <= 0x7f || c >= 0xe0 || (c >= cUint8 && c <= cInt64):
		return "integer"
	case c >= 0x80 && c <= 0x8f, c == cMap16, c == cMap32:
		return "map"
	case c >= 0x90 && c <= 0x9f, c == cArray16, c == cArray32:
		return "array"
	case c >= 0xa0 && c <= 0xbf, c == cStr8, c == cStr16, c == cStr32:
		return "string"
	case c == cBin8, c == cBin16, c == cBin32:
		return "binary"
	case c == cNil:
		return "nil"
	case c == cTrue, c == cFalse:
		return "bool"
	case c == cFloat32, c == cFloat64:
		return "float"
	}
	return fmt.Sprintf("code 0x%02x", c)
}

// arrayLen reads an array header; every element takes at least a byte.
func (r *reader) arrayLen() (int, error) {
	c, err := r.peek()
	if err != nil {
		return 0, err
	}
	var n uint64
	switch {
	case c >= 0x90 && c <= 0x9f:
		r.off++
		n = uint64(c & 0x0f)
	case c == cArray16:
		r.off++
		n, err = r.uintN(2)
	case c == cArray32:
		r.off++
		n, err = r.uintN(4)
	default:
		return 0, fmt.Errorf("want an array, got %s", codeName(c))
	}
	if err != nil {
		return 0, err
	}
	if n > uint64(r.left()) {
		return 0, fmt.Errorf("array of %d elements in %d bytes", n, r.left())
	}
	return int(n), nil
}

// mapLen reads a map header; every entry takes at least two bytes.
func (r *reader) mapLen() (int, error) {
	c, err := r.peek()
	if err != nil {
		return 0, err
	}
	var n uint64
	switch {
	case c >= 0x80 && c <= 0x8f:
		r.off++
		n = uint64(c & 0x0f)
	case c == cMap16:
		r.off++
		n, err = r.uintN(2)
	case c == cMap32:
		r.off++
		n, err = r.uintN(4)
	default:
		return 0, fmt.Errorf("want a map, got %s", codeName(c))
	}
	if err != nil {
		return 0, err
	}
	if n > uint64(r.left())/2 {
		return 0, fmt.Errorf("map of %d entries in %d bytes", n, r.left())
	}
	return int(n), nil
}

// str reads a msgpack str (not bin) as a subslice of the payload.
func (r *reader) str() ([]byte, error) {
	c, err := r.peek()
	if err != nil {
		return nil, err
	}
	var n uint64
	switch {
	case c >= 0xa0 && c <= 0xbf:
		r.off++
		n = uint64(c & 0x1f)
	case c == cStr8:
		r.off++
		n, err = r.uintN(1)
	case c == cStr16:
		r.off++
		n, err = r.uintN(2)
	case c == cStr32:
		r.off++
		n, err = r.uintN(4)
	default:
		return nil, fmt.Errorf("want a string, got %s", codeName(c))
	}
	if err != nil {
		return nil, err
	}
	if n > uint64(r.left()) {
		return nil, errTruncated
	}
	return r.take(int(n))
}

// bin reads a msgpack bin as a subslice of the payload.
func (r *reader) bin() ([]byte, error) {
	c, err := r.peek()
	if err != nil {
		return nil, err
	}
	var n uint64
	switch c {
	case cBin8:
		r.off++
		n, err = r.uintN(1)
	case cBin16:
		r.off++
		n, err = r.uintN(2)
	case cBin32:
		r.off++
		n, err = r.uintN(4)
	default:
		return nil, fmt.Errorf("want binary, got %s", codeName(c))
	}
	if err != nil {
		return nil, err
	}
	if n > uint64(r.left()) {
		return nil, errTruncated
	}
	return r.take(int(n))
}

// integer reads any msgpack integer. neg reports a negative value, whose
// two's complement bits are in v.
func (r *reader) integer() (v uint64, neg bool, err error) {
	c, err := r.peek()
	if err != nil {
		return 0, false, err
	}
	switch {
	case c <= 0x7f:
		r.off++
		return uint64(c), false, nil
	case c >= 0xe0:
		r.off++
		return uint64(int64(int8(c))), true, nil
	case c == cUint8, c == cUint16, c == cUint32, c == cUint64:
		r.off++
		v, err = r.uintN(1 << (c - cUint8))
		return v, false, err
	case c == cInt8, c == cInt16, c == cInt32, c == cInt64:
		r.off++
		n := 1 << (c - cInt8)
		u, err := r.uintN(n)
		if err != nil {
			return 0, false, err
		}
		var s int64
		switch n {
		case 1:
			s = int64(int8(u))
		case 2:
			s = int64(int16(u))
		case 4:
			s = int64(int32(u))
		default:
			s = int64(u)
		}
		return uint64(s), s < 0, nil
	}
	return 0, false, fmt.Errorf("want an integer, got %s", codeName(c))
}

// uint reads a non-negative integer of at most max.
func (r *reader) uint(max uint64) (uint64, error) {
	v, neg, err := r.integer()
	if err != nil {
		return 0, err
	}
	if neg {
		return 0, fmt.Errorf("negative number %d", int64(v))
	}
	if v > max {
		return 0, fmt.Errorf("number %d out of range (max %d)", v, max)
	}
	return v, nil
}

// number reads an integer or a float as float64.
func (r *reader) number() (float64, error) {
	c, err := r.peek()
	if err != nil {
		return 0, err
	}
	switch c {
	case cFloat32:
		r.off++
		u, err := r.uintN(4)
		return float64(math.Float32frombits(uint32(u))), err
	case cFloat64:
		r.off++
		u, err := r.uintN(8)
		return math.Float64frombits(u), err
	}
	v, neg, err := r.integer()
	if err != nil {
		return 0, fmt.Errorf("want a number: %w", err)
	}
	if neg {
		return float64(int64(v)), nil
	}
	return float64(v), nil
}

// skip consumes one complete value of any type without recursion: pending
// counts the values still to be consumed, and each container adds its
// elements to it.
func (r *reader) skip() error {
	for pending := uint64(1); pending > 0; pending-- {
		c, err := r.peek()
		if err != nil {
			return err
		}
		r.off++
		var n uint64 // payload bytes to drop
		switch {
		case c <= 0x7f, c >= 0xe0, c == cNil, c == cTrue, c == cFalse:
		case c >= 0x80 && c <= 0x8f:
			pending += 2 * uint64(c&0x0f)
		case c >= 0x90 && c <= 0x9f:
			pending += uint64(c & 0x0f)
		case c >= 0xa0 && c <= 0xbf:
			n = uint64(c & 0x1f)
		case c == cBin8, c == cStr8:
			n, err = r.uintN(1)
		case c == cBin16, c == cStr16:
			n, err = r.uintN(2)
		case c == cBin32, c == cStr32:
			n, err = r.uintN(4)
		case c == cExt8:
			n, err = r.uintN(1)
			n++ // the type byte
		case c == cExt16:
			n, err = r.uintN(2)
			n++
		case c == cExt32:
			n, err = r.uintN(4)
			n++
		case c == cFloat32:
			n = 4
		case c == cFloat64:
			n = 8
		case c >= cUint8 && c <= cUint64:
			n = 1 << (c - cUint8)
		case c >= cInt8 && c <= cInt64:
			n = 1 << (c - cInt8)
		case c >= cFixExt1 && c <= cFixExt:
			n = 1 + 1<<(c-cFixExt1)
		case c == cArray16, c == cArray32, c == cMap16, c == cMap32:
			var m uint64
			if c == cArray16 || c == cMap16 {
				m, err = r.uintN(2)
			} else {
				m, err = r.uintN(4)
			}
			if c == cMap16 || c == cMap32 {
				m *= 2
			}
			if err == nil && m > uint64(r.left()) {
				return fmt.Errorf("container of %d values in %d bytes", m, r.left())
			}
			pending += m
		default:
			return fmt.Errorf("invalid msgpack code 0x%02x", c)
		}
		if err != nil {
			return err
		}
		if n > uint64(r.left()) {
			return errTruncated
		}
		r.off += int(n)
		if pending > uint64(r.left())+1 {
			// every pending value needs at least one byte
			return fmt.Errorf("%d values declared in %d bytes", pending-1, r.left())
		}
	}
	return nil
}
