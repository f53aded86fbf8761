package eventbus

import (
	"encoding/binary"
	"errors"
	"reflect"
	"testing"
)

// wireEventWith is a stored (or, with removed set, removed) event of worker
// w1 whose block array (or removed-hash array) holds the given raw msgpack
// elements, so a test can put any encoding where the decoder's fast paths
// look.
func wireEventWith(removed bool, elems ...[]byte) []byte {
	b := []byte{0x84, 0xa1, 'w', 0xa2, 'w', '1', 0xa1, 'i', 0x01, 0xa1, 'k'}
	key := byte('b')
	if removed {
		b = append(b, byte(KindRemoved))
		key = 'x'
	} else {
		b = append(b, byte(KindStored))
	}
	b = append(b, 0xa1, key, 0x90|byte(len(elems)))
	for _, e := range elems {
		b = append(b, e...)
	}
	return b
}

func u64(code byte, v uint64) []byte {
	return binary.BigEndian.AppendUint64([]byte{code}, v)
}

func cat(parts ...[]byte) []byte {
	var out []byte
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// The fast paths for the usual block and removed-hash encodings accept and
// refuse exactly what the general reader (and the library reference) do.
func TestBusDecodeFastPaths(t *testing.T) {
	const h1, h2 = 0x9e3779b97f4a7c15, 0xfedcba9876543210
	e, c := []byte{0xa1, 'e'}, []byte{0xa1, 'c'}
	usual := cat([]byte{0x82}, e, u64(0xcf, h1), c, u64(0xcf, h2))
	if len(usual) != blockWireLen {
		t.Fatalf("usual block is %d bytes, blockWireLen %d", len(usual), blockWireLen)
	}
	cases := []struct {
		name    string
		data    []byte
		ok      bool
		blocks  []WireBlock
		removed []uint64
	}{
		{"usual block", wireEventWith(false, usual), true, []WireBlock{{h1, h2}}, nil},
		{"two usual blocks", wireEventWith(false, usual, usual), true, []WireBlock{{h1, h2}, {h1, h2}}, nil},
		{"keys c then e", wireEventWith(false, cat([]byte{0x82}, c, u64(0xcf, h2), e, u64(0xcf, h1))), true, []WireBlock{{h1, h2}}, nil},
		{"small hashes in 0xcf", wireEventWith(false, cat([]byte{0x82}, e, u64(0xcf, 1), c, u64(0xcf, 2))), true, []WireBlock{{1, 2}}, nil},
		{"content as uint32", wireEventWith(false, cat([]byte{0x82}, e, u64(0xcf, h1), c, []byte{0xce, 0, 0, 0, 7})), true, []WireBlock{{h1, 7}}, nil},
		{"engine as fixint", wireEventWith(false, cat([]byte{0x82}, e, []byte{0x05}, c, u64(0xcf, h2))), true, []WireBlock{{5, h2}}, nil},
		{"engine only", wireEventWith(false, cat([]byte{0x81}, e, u64(0xcf, h1))), true, []WireBlock{{h1, 0}}, nil},
		{"duplicate key e", wireEventWith(false, cat([]byte{0x82}, e, u64(0xcf, h1), e, u64(0xcf, h2))), false, nil, nil},
		{"unknown key", wireEventWith(false, cat([]byte{0x82}, e, u64(0xcf, h1), []byte{0xa1, 'z'}, u64(0xcf, h2))), false, nil, nil},
		{"signed int64 hash", wireEventWith(false, cat([]byte{0x82}, e, u64(0xd3, h1), c, u64(0xcf, h2))), false, nil, nil},
		{"map of three", wireEventWith(false, cat([]byte{0x83}, e, u64(0xcf, h1), c, u64(0xcf, h2))), false, nil, nil},
		{"block cut short", wireEventWith(false, usual[:blockWireLen-1]), false, nil, nil},
		{"trailing byte", append(wireEventWith(false, usual), 0x00), false, nil, nil},
		{"removed usual", wireEventWith(true, u64(0xcf, h1), u64(0xcf, h2)), true, nil, []uint64{h1, h2}},
		{"removed mixed widths", wireEventWith(true, u64(0xcf, h1), []byte{0x07}, []byte{0xcd, 1, 0}), true, nil, []uint64{h1, 7, 256}},
		{"removed negative", wireEventWith(true, u64(0xcf, h1), []byte{0xff}), false, nil, nil},
		{"removed cut short", wireEventWith(true, u64(0xcf, h1)[:8]), false, nil, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Decode(tc.data)
			want, werr := refDecode(tc.data)
			if (err == nil) != (werr == nil) {
				t.Fatalf("decode err %v, reference err %v", err, werr)
			}
			if (err == nil) != tc.ok {
				t.Fatalf("decode err %v, want ok %v", err, tc.ok)
			}
			if err != nil {
				if !errors.Is(err, ErrUndecodable) {
					t.Fatalf("error %v does not wrap ErrUndecodable", err)
				}
				return
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("got %+v, reference %+v", got, want)
			}
			if !reflect.DeepEqual(got.Blocks, tc.blocks) || !reflect.DeepEqual(got.Removed, tc.removed) {
				t.Fatalf("blocks %v removed %v, want %v %v", got.Blocks, got.Removed, tc.blocks, tc.removed)
			}
		})
	}
}
