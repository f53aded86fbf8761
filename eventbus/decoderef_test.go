package eventbus

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"reflect"
	"testing"
	"unicode/utf8"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// The decoder Decode used before issue 31 (vmihailenco/msgpack's Decoder,
// reading field by field), kept as the reference the hand-written one in
// wiredecode.go must agree with: FuzzDecodeEventMatchesReference, and
// BenchmarkBusDecodeEvent side by side.

func refDecode(data []byte) (WireEvent, error) {
	var ev WireEvent
	if err := refDecodeInto(data, &ev); err != nil {
		return WireEvent{}, fmt.Errorf("%w: %v", ErrUndecodable, err)
	}
	return ev, nil
}

func refDecodeInto(data []byte, ev *WireEvent) error {
	r := bytes.NewReader(data)
	d := msgpack.NewDecoder(r) // bytes.Reader is a ByteScanner: no extra buffering, r.Len() stays exact
	c, err := d.PeekCode()
	if err != nil {
		return err
	}
	if !msgpcode.IsFixedMap(c) && c != msgpcode.Map16 && c != msgpcode.Map32 {
		return fmt.Errorf("not a map (code 0x%02x)", c)
	}
	n, err := d.DecodeMapLen()
	if err != nil {
		return err
	}
	if n > 2*r.Len() { // a key and a value take at least a byte each
		return fmt.Errorf("map of %d entries in %d bytes", n, r.Len())
	}
	var seen uint16
	for range n {
		key, err := refReadString(d, r, 8)
		if err != nil {
			return fmt.Errorf("key: %w", err)
		}
		bit, ok := refKeyBits[key]
		if !ok {
			return fmt.Errorf("unknown key %q", key)
		}
		if seen&bit != 0 {
			return fmt.Errorf("duplicate key %q", key)
		}
		for _, group := range refKeyGroups {
			if bit&group != 0 && seen&group != 0 {
				return fmt.Errorf("key %q: the same field given in two forms", key)
			}
		}
		seen |= bit
		if err := refDecodeField(d, r, key, ev); err != nil {
			return fmt.Errorf("field %q: %w", key, err)
		}
	}
	if r.Len() != 0 {
		return fmt.Errorf("%d trailing bytes", r.Len())
	}
	return nil
}

var refKeyBits = map[string]uint16{"w": 1, "r": 2, "i": 4, "k": 8, "bs": 16, "hp": 32, "p": 64, "b": 128, "x": 256, "t": 512,
	"bh": 1024, "bp": 2048, "xh": 4096}

// refKeyGroups: keys of one field in its two forms (map and compact,
// compactwire.go), at most one of each group.
var refKeyGroups = []uint16{128 | 1024 | 2048, 256 | 4096}

func refDecodeField(d *msgpack.Decoder, r *bytes.Reader, key string, ev *WireEvent) error {
	var err error
	switch key {
	case "w":
		ev.Worker, err = refReadString(d, r, MaxWorkerNameLen)
	case "r":
		var v uint64
		v, err = refReadUint(d, math.MaxUint32)
		ev.DPRank = uint32(v)
	case "i":
		ev.EventID, err = refReadUint(d, math.MaxUint64)
	case "k":
		var v uint64
		v, err = refReadUint(d, math.MaxUint8)
		ev.Kind = uint8(v)
	case "bs":
		var v uint64
		v, err = refReadUint(d, math.MaxInt32)
		ev.BlockSize = int(v)
	case "hp":
		var c byte
		if c, err = d.PeekCode(); err == nil {
			if c != msgpcode.True && c != msgpcode.False {
				return fmt.Errorf("not a bool (code 0x%02x)", c)
			}
			ev.HasParent, err = d.DecodeBool()
		}
	case "p":
		ev.Parent, err = refReadUint(d, math.MaxUint64)
	case "t":
		var v uint64
		v, err = refReadUint(d, math.MaxUint8)
		ev.Tier = uint8(v)
	case "b":
		var n int
		if n, err = refReadArrayLen(d, r, 1); err != nil || n == 0 {
			return err
		}
		ev.Blocks = make([]WireBlock, n)
		for i := range ev.Blocks {
			if err = refReadBlock(d, r, &ev.Blocks[i]); err != nil {
				return fmt.Errorf("block %d: %w", i, err)
			}
		}
	case "x":
		var n int
		if n, err = refReadArrayLen(d, r, 1); err != nil || n == 0 {
			return err
		}
		ev.Removed = make([]uint64, n)
		for i := range ev.Removed {
			if ev.Removed[i], err = refReadUint(d, math.MaxUint64); err != nil {
				return fmt.Errorf("removed %d: %w", i, err)
			}
		}
	case "bh", "bp", "xh":
		elem := 8
		if key == "bp" {
			elem = 16
		}
		var p []byte
		if p, err = refReadBin(d, r); err != nil || len(p) == 0 {
			return err
		}
		if len(p)%elem != 0 {
			return fmt.Errorf("bin of %d bytes: not a multiple of %d", len(p), elem)
		}
		for i := 0; i < len(p); i += elem {
			h := binary.BigEndian.Uint64(p[i:])
			switch key {
			case "bh":
				ev.Blocks = append(ev.Blocks, WireBlock{Engine: h, Content: h})
			case "bp":
				ev.Blocks = append(ev.Blocks, WireBlock{Engine: h, Content: binary.BigEndian.Uint64(p[i+8:])})
			default:
				ev.Removed = append(ev.Removed, h)
			}
		}
	}
	return err
}

// refReadBin reads a msgpack bin (or nil, as empty) of at most the bytes left.
func refReadBin(d *msgpack.Decoder, r *bytes.Reader) ([]byte, error) {
	c, err := d.PeekCode()
	if err != nil {
		return nil, err
	}
	if c == msgpcode.Nil {
		return nil, d.DecodeNil()
	}
	if c != msgpcode.Bin8 && c != msgpcode.Bin16 && c != msgpcode.Bin32 {
		return nil, fmt.Errorf("not a bin (code 0x%02x)", c)
	}
	n, err := d.DecodeBytesLen()
	if err != nil {
		return nil, err
	}
	if n > r.Len() {
		return nil, fmt.Errorf("bin of %d bytes, %d left", n, r.Len())
	}
	buf := make([]byte, n)
	if _, err := r.Read(buf); err != nil && n > 0 {
		return nil, err
	}
	return buf, nil
}

// refReadBlock reads a WireBlock: a map with keys "e" and "c" (either may be
// absent, meaning zero).
func refReadBlock(d *msgpack.Decoder, r *bytes.Reader, b *WireBlock) error {
	c, err := d.PeekCode()
	if err != nil {
		return err
	}
	if !msgpcode.IsFixedMap(c) {
		return fmt.Errorf("not a small map (code 0x%02x)", c)
	}
	n, err := d.DecodeMapLen()
	if err != nil {
		return err
	}
	var seenE, seenC bool
	for range n {
		key, err := refReadString(d, r, 1)
		if err != nil {
			return err
		}
		switch {
		case key == "e" && !seenE:
			seenE = true
			b.Engine, err = refReadUint(d, math.MaxUint64)
		case key == "c" && !seenC:
			seenC = true
			b.Content, err = refReadUint(d, math.MaxUint64)
		default:
			return fmt.Errorf("unknown or duplicate key %q", key)
		}
		if err != nil {
			return fmt.Errorf("%q: %w", key, err)
		}
	}
	return nil
}

// refReadString reads a msgpack str of at most max bytes of valid UTF-8.
func refReadString(d *msgpack.Decoder, r *bytes.Reader, max int) (string, error) {
	c, err := d.PeekCode()
	if err != nil {
		return "", err
	}
	if !msgpcode.IsFixedString(c) && c != msgpcode.Str8 && c != msgpcode.Str16 && c != msgpcode.Str32 {
		return "", fmt.Errorf("not a string (code 0x%02x)", c)
	}
	n, err := d.DecodeBytesLen()
	if err != nil {
		return "", err
	}
	if n > max || n > r.Len() {
		return "", fmt.Errorf("string of %d bytes (max %d, %d left)", n, max, r.Len())
	}
	buf := make([]byte, n)
	if _, err := r.Read(buf); err != nil && n > 0 {
		return "", err
	}
	if !utf8.Valid(buf) {
		return "", errors.New("string is not UTF-8")
	}
	return string(buf), nil
}

// refReadUint reads a non-negative integer of any msgpack width, up to max.
// nil and negative numbers are rejected.
func refReadUint(d *msgpack.Decoder, max uint64) (uint64, error) {
	c, err := d.PeekCode()
	if err != nil {
		return 0, err
	}
	var v uint64
	switch {
	case msgpcode.IsFixedNum(c) && c <= msgpcode.PosFixedNumHigh,
		c == msgpcode.Uint8, c == msgpcode.Uint16, c == msgpcode.Uint32, c == msgpcode.Uint64:
		v, err = d.DecodeUint64()
	case c == msgpcode.Int8, c == msgpcode.Int16, c == msgpcode.Int32, c == msgpcode.Int64:
		var s int64
		if s, err = d.DecodeInt64(); err == nil {
			if s < 0 {
				return 0, fmt.Errorf("negative number %d", s)
			}
			v = uint64(s)
		}
	default:
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

// refReadArrayLen reads an array header whose elements take at least minElem
// bytes each; nil reads as an empty array.
func refReadArrayLen(d *msgpack.Decoder, r *bytes.Reader, minElem int) (int, error) {
	c, err := d.PeekCode()
	if err != nil {
		return 0, err
	}
	if c == msgpcode.Nil {
		_, err := d.DecodeArrayLen()
		return 0, err
	}
	if !msgpcode.IsFixedArray(c) && c != msgpcode.Array16 && c != msgpcode.Array32 {
		return 0, fmt.Errorf("not an array (code 0x%02x)", c)
	}
	n, err := d.DecodeArrayLen()
	if err != nil {
		return 0, err
	}
	if n < 0 || n > r.Len()/minElem {
		return 0, fmt.Errorf("array of %d elements in %d bytes", n, r.Len())
	}
	return n, nil
}

// FuzzDecodeEventMatchesReference: the hand-written decoder accepts exactly
// what the msgpack-library decoder accepted, with equal results.
func FuzzDecodeEventMatchesReference(f *testing.F) {
	for _, ev := range sampleEvents() {
		for _, encode := range []func(*WireEvent) ([]byte, error){Encode, EncodeCompact} {
			b, err := encode(&ev)
			if err != nil {
				f.Fatal(err)
			}
			f.Add(b)
			for _, cut := range []int{1, len(b) / 2, len(b) - 1} {
				f.Add(b[:cut])
			}
		}
	}
	f.Add([]byte{0x81, 0xa1, 'i', 0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}) // negative int64
	f.Add([]byte{0x81, 0xa1, 'i', 0xd0, 0x05})                                           // positive int8
	f.Add([]byte{0x81, 0xa1, 'x', 0xdd, 0xff, 0xff, 0xff, 0xff})                         // huge array
	f.Add([]byte{0xdf, 0x00, 0x00, 0x00, 0x01, 0xa1, 'b', 0xc0})                         // map32, nil array
	// Around the fast paths for the usual block and removed-hash encodings.
	usual := cat([]byte{0x82, 0xa1, 'e'}, u64(0xcf, 1<<63), []byte{0xa1, 'c'}, u64(0xcf, 3))
	f.Add(wireEventWith(false, usual, usual))
	f.Add(wireEventWith(false, usual[:blockWireLen-1]))
	f.Add(wireEventWith(false, cat([]byte{0x82, 0xa1, 'e'}, u64(0xcf, 1), []byte{0xa1, 'e'}, u64(0xcf, 2))))
	f.Add(wireEventWith(true, u64(0xcf, 1<<63), []byte{0x07}, u64(0xd3, 1)))
	f.Fuzz(func(t *testing.T, data []byte) {
		got, err := Decode(data)
		want, werr := refDecode(data)
		if (err == nil) != (werr == nil) {
			t.Fatalf("%x: decode err %v, reference err %v", data, err, werr)
		}
		if err != nil {
			if !errors.Is(err, ErrUndecodable) {
				t.Fatalf("error %v does not wrap ErrUndecodable", err)
			}
			return
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%x:\n got %+v\nwant %+v", data, got, want)
		}
	})
}

// BenchmarkBusDecodeEvent: a 32-block stored event (vLLM's 512-token
// prefill chunk) and a 1,024-block removed event, decoded by Decode and by
// the reference (the library decoder Decode used before issue 31).
func BenchmarkBusDecodeEvent(b *testing.B) {
	stored := WireEvent{Worker: "ingest-0a1b2c3d-7", EventID: 123456, Kind: KindStored, BlockSize: 16, HasParent: true, Parent: 1 << 60}
	for i := range 32 {
		h := uint64(i+1) * 0x9e3779b97f4a7c15
		stored.Blocks = append(stored.Blocks, WireBlock{Engine: h, Content: h})
	}
	removed := WireEvent{Worker: "ingest-0a1b2c3d-7", EventID: 123457, Kind: KindRemoved}
	for i := range 1024 {
		removed.Removed = append(removed.Removed, uint64(i+1)*0x9e3779b97f4a7c15)
	}
	for _, c := range []struct {
		name string
		ev   WireEvent
	}{{"stored32", stored}, {"removed1024", removed}} {
		data, err := Encode(&c.ev)
		if err != nil {
			b.Fatal(err)
		}
		for _, d := range []struct {
			name string
			fn   func([]byte) (WireEvent, error)
		}{{"decoder=wire", Decode}, {"decoder=reference", refDecode}} {
			b.Run(c.name+"/"+d.name, func(b *testing.B) {
				b.ReportAllocs()
				b.SetBytes(int64(len(data)))
				for b.Loop() {
					if _, err := d.fn(data); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
