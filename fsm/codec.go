package fsm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
)

// Structural limits shared by the command codec and the snapshot format.
// Decoders enforce them before allocating; encoders enforce them so that a
// proposer can never put an entry into the log that replicas cannot decode.
const (
	// MaxStringLen bounds every string in a command or snapshot record
	// (ids, addresses, model names, reasons).
	MaxStringLen = 4096
	// maxInt bounds the non-negative integers of commands (block sizes,
	// capacities): far above any real value, and portable to 32-bit ints.
	maxInt = math.MaxInt32
)

// ErrUndecodable marks bytes that are not a valid command or record. In the
// log this is a programming error of the proposer (or corruption): Apply
// reports it in the ApplyResult and counts it; it never panics.
var ErrUndecodable = errors.New("undecodable")

// appendString appends a uvarint length and the bytes of s.
func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

func appendU64(b []byte, v uint64) []byte { return binary.LittleEndian.AppendUint64(b, v) }

func appendF64(b []byte, v float64) []byte { return appendU64(b, math.Float64bits(v)) }

// appendBool writes 1 or 0; reader.bool refuses any other byte, so a
// boolean has one encoding.
func appendBool(b []byte, v bool) []byte {
	if v {
		return append(b, 1)
	}
	return append(b, 0)
}

// checkString is the encoder's side of MaxStringLen.
func checkString(what, s string) error {
	if len(s) > MaxStringLen {
		return fmt.Errorf("%s is %d bytes, limit %d: %w", what, len(s), MaxStringLen, ErrInvalidCommand)
	}
	return nil
}

// checkInt is the encoder's side of maxInt.
func checkInt(what string, v int) error {
	if v < 0 || v > maxInt {
		return fmt.Errorf("%s %d outside [0,%d]: %w", what, v, maxInt, ErrInvalidCommand)
	}
	return nil
}

// reader decodes a byte slice with a sticky error: after the first failure
// every read returns a zero value, so decoders check once at the end. No
// read allocates from a length it has not checked against the bytes left.
type reader struct {
	b   []byte
	err error
}

func (r *reader) fail(format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("%s: %w", fmt.Sprintf(format, args...), ErrUndecodable)
	}
}

func (r *reader) uvarint() uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail("bad uvarint")
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) varint() int64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Varint(r.b)
	if n <= 0 {
		r.fail("bad varint")
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) u64() uint64 {
	if r.err != nil {
		return 0
	}
	if len(r.b) < 8 {
		r.fail("short u64")
		return 0
	}
	v := binary.LittleEndian.Uint64(r.b)
	r.b = r.b[8:]
	return v
}

func (r *reader) f64() float64 { return math.Float64frombits(r.u64()) }

func (r *reader) byte() byte {
	if r.err != nil {
		return 0
	}
	if len(r.b) < 1 {
		r.fail("short byte")
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

// bool reads appendBool's byte: 0 or 1, anything else is undecodable.
func (r *reader) bool() bool {
	switch r.byte() {
	case 0:
		return false
	case 1:
		return true
	}
	r.fail("bad bool")
	return false
}

// int reads a uvarint that must fit maxInt.
func (r *reader) int(what string) int {
	v := r.uvarint()
	if v > maxInt {
		r.fail("%s %d too large", what, v)
		return 0
	}
	return int(v)
}

func (r *reader) u32(what string) uint32 {
	v := r.uvarint()
	if v > math.MaxUint32 {
		r.fail("%s %d overflows uint32", what, v)
		return 0
	}
	return uint32(v)
}

// bytes reads a length-prefixed byte string without copying.
func (r *reader) bytes(what string) []byte {
	n := r.uvarint()
	if r.err != nil {
		return nil
	}
	if n > MaxStringLen || n > uint64(len(r.b)) {
		r.fail("%s length %d exceeds limit or %d bytes left", what, n, len(r.b))
		return nil
	}
	s := r.b[:n]
	r.b = r.b[n:]
	return s
}

func (r *reader) string(what string) string { return string(r.bytes(what)) }

// count reads an element count and bounds it by the bytes left, given that
// every element takes at least minSize bytes: the caller may then allocate
// count elements without trusting the input.
func (r *reader) count(what string, minSize int) int {
	n := r.uvarint()
	if r.err != nil {
		return 0
	}
	if n > uint64(len(r.b)/minSize) {
		r.fail("%s count %d exceeds the %d bytes left", what, n, len(r.b))
		return 0
	}
	return int(n)
}

// done returns the first error, or an error when bytes are left over: every
// payload has exactly one encoding length.
func (r *reader) done() error {
	if r.err == nil && len(r.b) != 0 {
		r.fail("%d trailing bytes", len(r.b))
	}
	return r.err
}
