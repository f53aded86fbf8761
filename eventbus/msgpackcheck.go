package eventbus

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// maxMsgpackDepth bounds container nesting in a message checked by
// checkMsgpack; replica-sync messages nest three deep.
const maxMsgpackDepth = 16

var errMsgpackShape = errors.New("malformed msgpack")

// checkMsgpack walks one msgpack value that must fill b exactly, without
// decoding it, and refuses lengths the bytes cannot hold and nesting deeper
// than maxMsgpackDepth. The msgpack library trusts a container's declared
// length when it allocates: an 8-byte message declaring an array of 2^31
// structs makes it ask for ~170 GB and the process dies (found by
// FuzzSyncHandle). Every element takes at least one byte, so a container
// may declare no more elements than bytes remain.
func checkMsgpack(b []byte) error {
	// pending[i] is how many values the i-th open container still holds;
	// the bottom entry is the one top-level value.
	pending := []int{1}
	i := 0
	need := func(n int) ([]byte, error) {
		if n < 0 || n > len(b)-i {
			return nil, fmt.Errorf("%w: %d bytes declared at offset %d, %d left", errMsgpackShape, n, i, len(b)-i)
		}
		p := b[i : i+n]
		i += n
		return p, nil
	}
	size := func(width int) (int, error) {
		p, err := need(width)
		if err != nil {
			return 0, err
		}
		switch width {
		case 1:
			return int(p[0]), nil
		case 2:
			return int(binary.BigEndian.Uint16(p)), nil
		}
		v := binary.BigEndian.Uint32(p)
		if uint64(v) > uint64(len(b)) {
			return 0, fmt.Errorf("%w: length %d in a %d-byte message", errMsgpackShape, v, len(b))
		}
		return int(v), nil
	}
	for len(pending) > 0 {
		if pending[len(pending)-1] == 0 {
			pending = pending[:len(pending)-1]
			continue
		}
		pending[len(pending)-1]--
		if i >= len(b) {
			return fmt.Errorf("%w: truncated at offset %d", errMsgpackShape, i)
		}
		c := b[i]
		i++
		var skip, elems int // bytes to skip; values a container holds
		var err error
		container := false
		switch {
		case c <= 0x7f || c >= 0xe0, c == 0xc0, c == 0xc2, c == 0xc3: // fixints, nil, bools
		case c >= 0x80 && c <= 0x8f:
			elems, container = 2*int(c&0x0f), true
		case c >= 0x90 && c <= 0x9f:
			elems, container = int(c&0x0f), true
		case c >= 0xa0 && c <= 0xbf:
			skip = int(c & 0x1f)
		case c == 0xc4 || c == 0xd9: // bin8, str8
			skip, err = size(1)
		case c == 0xc5 || c == 0xda:
			skip, err = size(2)
		case c == 0xc6 || c == 0xdb:
			skip, err = size(4)
		case c == 0xc7: // ext8/16/32: length, type byte, data
			skip, err = size(1)
			skip++
		case c == 0xc8:
			skip, err = size(2)
			skip++
		case c == 0xc9:
			skip, err = size(4)
			skip++
		case c == 0xca:
			skip = 4
		case c == 0xcb:
			skip = 8
		case c >= 0xcc && c <= 0xcf: // uint8..64
			skip = 1 << (c - 0xcc)
		case c >= 0xd0 && c <= 0xd3: // int8..64
			skip = 1 << (c - 0xd0)
		case c >= 0xd4 && c <= 0xd8: // fixext1..16: type byte + data
			skip = 1 + 1<<(c-0xd4)
		case c == 0xdc:
			elems, err = size(2)
			container = true
		case c == 0xdd:
			elems, err = size(4)
			container = true
		case c == 0xde:
			elems, err = size(2)
			elems, container = 2*elems, true
		case c == 0xdf:
			elems, err = size(4)
			elems, container = 2*elems, true
		default: // 0xc1: never used
			return fmt.Errorf("%w: byte %#x at offset %d", errMsgpackShape, c, i-1)
		}
		if err != nil {
			return err
		}
		if _, err := need(skip); err != nil {
			return err
		}
		if container {
			if elems > len(b)-i {
				return fmt.Errorf("%w: %d values declared at offset %d, %d bytes left", errMsgpackShape, elems, i, len(b)-i)
			}
			if len(pending) > maxMsgpackDepth {
				return fmt.Errorf("%w: nested deeper than %d", errMsgpackShape, maxMsgpackDepth)
			}
			pending = append(pending, elems)
		}
	}
	if i != len(b) {
		return fmt.Errorf("%w: %d trailing bytes", errMsgpackShape, len(b)-i)
	}
	return nil
}
