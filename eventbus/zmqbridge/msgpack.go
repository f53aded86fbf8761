package zmqbridge

import (
	"errors"
	"fmt"
	"math"

	"github.com/kvrouter/kvrouter/internal/msgpackread"
)

// reader reads the engines' msgpack with the bridge's rules and wording on
// top of the shared cursor (internal/msgpackread): it never allocates for
// what it skips, checks every declared length against the bytes that remain
// before anything is allocated, and skips nested values iteratively (a
// hostile payload of a million nested arrays cannot blow the stack).
type reader struct{ msgpackread.Reader }

var errTruncated = errors.New("truncated")

func newReader(payload []byte) *reader { return &reader{msgpackread.New(payload, errTruncated)} }

// wrongType is the error for a value of another type than want.
func (r *reader) wrongType(want string) error {
	c, _ := r.Peek()
	return fmt.Errorf("want %s, got %s", want, msgpackread.TypeName(c))
}

// arrayLen reads an array header; every element takes at least a byte.
func (r *reader) arrayLen() (int, error) {
	n, ok, err := r.ArrayHeader()
	if err != nil {
		return 0, err
	}
	if !ok {
		return 0, r.wrongType("an array")
	}
	if n > uint64(r.Left()) {
		return 0, fmt.Errorf("array of %d elements in %d bytes", n, r.Left())
	}
	return int(n), nil
}

// mapLen reads a map header; every entry takes at least two bytes.
func (r *reader) mapLen() (int, error) {
	n, ok, err := r.MapHeader()
	if err != nil {
		return 0, err
	}
	if !ok {
		return 0, r.wrongType("a map")
	}
	if n > uint64(r.Left())/2 {
		return 0, fmt.Errorf("map of %d entries in %d bytes", n, r.Left())
	}
	return int(n), nil
}

// str reads a msgpack str (not bin) as a subslice of the payload.
func (r *reader) str() ([]byte, error) {
	n, ok, err := r.StrHeader()
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, r.wrongType("a string")
	}
	if n > uint64(r.Left()) {
		return nil, errTruncated
	}
	return r.Take(int(n))
}

// bin reads a msgpack bin as a subslice of the payload.
func (r *reader) bin() ([]byte, error) {
	n, ok, err := r.BinHeader()
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, r.wrongType("binary")
	}
	if n > uint64(r.Left()) {
		return nil, errTruncated
	}
	return r.Take(int(n))
}

// integer reads any msgpack integer. neg reports a negative value, whose
// two's complement bits are in v.
func (r *reader) integer() (v uint64, neg bool, err error) {
	v, neg, ok, err := r.Int()
	if err != nil {
		return 0, false, err
	}
	if !ok {
		return 0, false, r.wrongType("an integer")
	}
	return v, neg, nil
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
	c, err := r.Peek()
	if err != nil {
		return 0, err
	}
	switch c {
	case msgpackread.Float32:
		r.ReadByte()
		u, err := r.BigEndian(4)
		return float64(math.Float32frombits(uint32(u))), err
	case msgpackread.Float64:
		r.ReadByte()
		u, err := r.BigEndian(8)
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
