package msgpackread

import (
	"errors"
	"fmt"
	"testing"
)

func TestMsgpackReadHeaders(t *testing.T) {
	type header func(*Reader) (uint64, bool, error)
	mapH := (*Reader).MapHeader
	arrH := (*Reader).ArrayHeader
	strH := (*Reader).StrHeader
	binH := (*Reader).BinHeader
	for _, c := range []struct {
		name    string
		read    header
		in      string
		n       uint64
		ok      bool
		short   bool
		readLen int // bytes consumed
	}{
		{"fixmap", mapH, "\x83", 3, true, false, 1},
		{"map16", mapH, "\xde\x01\x02", 0x102, true, false, 3},
		{"map32", mapH, "\xdf\x00\x01\x00\x00", 0x10000, true, false, 5},
		{"map16 short", mapH, "\xde\x01", 0, true, true, 1},
		{"map not array", mapH, "\x93", 0, false, false, 0},
		{"map empty", mapH, "", 0, false, true, 0},
		{"fixarray", arrH, "\x9f", 15, true, false, 1},
		{"array16", arrH, "\xdc\x00\x10", 16, true, false, 3},
		{"array32", arrH, "\xdd\xff\xff\xff\xff", 0xffffffff, true, false, 5},
		{"array not map", arrH, "\x81", 0, false, false, 0},
		{"array not nil", arrH, "\xc0", 0, false, false, 0},
		{"fixstr", strH, "\xbf", 31, true, false, 1},
		{"str8", strH, "\xd9\xff", 255, true, false, 2},
		{"str16", strH, "\xda\x01\x00", 256, true, false, 3},
		{"str32 short", strH, "\xdb\x00\x00", 0, true, true, 1},
		{"str not bin", strH, "\xc4\x01", 0, false, false, 0},
		{"bin8", binH, "\xc4\x20", 32, true, false, 2},
		{"bin16", binH, "\xc5\x00\x20", 32, true, false, 3},
		{"bin32", binH, "\xc6\x00\x00\x00\x20", 32, true, false, 5},
		{"bin not str", binH, "\xa3", 0, false, false, 0},
		{"bin not zero", binH, "\x00", 0, false, false, 0},
	} {
		r := New([]byte(c.in), nil)
		n, ok, err := c.read(&r)
		if c.short != errors.Is(err, ErrShort) || (err != nil && !c.short) {
			t.Errorf("%s: error %v, want short %v", c.name, err, c.short)
		}
		if ok != c.ok || (err == nil && n != c.n) {
			t.Errorf("%s: got (%d, %v), want (%d, %v)", c.name, n, ok, c.n, c.ok)
		}
		if r.Offset() != c.readLen {
			t.Errorf("%s: consumed %d bytes, want %d", c.name, r.Offset(), c.readLen)
		}
	}
}

func TestMsgpackReadInt(t *testing.T) {
	for _, c := range []struct {
		name   string
		in     string
		v      uint64
		neg    bool
		ok     bool
		wantEr bool
	}{
		{"posfix", "\x7f", 127, false, true, false},
		{"negfix", "\xe0", uint64(1<<64 - 32), true, true, false},
		{"uint8", "\xcc\xff", 255, false, true, false},
		{"uint16", "\xcd\x01\x00", 256, false, true, false},
		{"uint32", "\xce\xff\xff\xff\xff", 1<<32 - 1, false, true, false},
		{"uint64", "\xcf\xff\xff\xff\xff\xff\xff\xff\xff", 1<<64 - 1, false, true, false},
		{"int8 neg", "\xd0\xfe", uint64(1<<64 - 2), true, true, false},
		{"int8 pos", "\xd0\x05", 5, false, true, false},
		{"int16 neg", "\xd1\xff\x00", uint64(1<<64 - 256), true, true, false},
		{"int32 pos", "\xd2\x7f\xff\xff\xff", 1<<31 - 1, false, true, false},
		{"int64 min", "\xd3\x80\x00\x00\x00\x00\x00\x00\x00", 1 << 63, true, true, false},
		{"uint32 short", "\xce\x00\x00", 0, false, true, true},
		{"empty", "", 0, false, false, true},
		{"nil", "\xc0", 0, false, false, false},
		{"float", "\xca\x00\x00\x00\x00", 0, false, false, false},
		{"string", "\xa1a", 0, false, false, false},
	} {
		r := New([]byte(c.in), nil)
		v, neg, ok, err := r.Int()
		if (err != nil) != c.wantEr || (err != nil && !errors.Is(err, ErrShort)) {
			t.Errorf("%s: error %v, want error %v", c.name, err, c.wantEr)
			continue
		}
		if ok != c.ok || (err == nil && (v != c.v || neg != c.neg)) {
			t.Errorf("%s: got (%d, %v, %v), want (%d, %v, %v)", c.name, v, neg, ok, c.v, c.neg, c.ok)
		}
		if !ok && r.Offset() != 0 {
			t.Errorf("%s: not an integer but %d bytes consumed", c.name, r.Offset())
		}
	}
}

func TestMsgpackReadUint(t *testing.T) {
	for _, c := range []struct {
		name string
		in   string
		max  uint64
		v    uint64
		err  string // "" for none
	}{
		{"posfix", "\x07", 10, 7, ""},
		{"uint16", "\xcd\x01\x00", 1000, 256, ""},
		{"uint64 max", "\xcf\xff\xff\xff\xff\xff\xff\xff\xff", 1<<64 - 1, 1<<64 - 1, ""},
		{"int8 positive", "\xd0\x05", 10, 5, ""},
		{"above max", "\xcc\xff", 254, 0, "number 255 out of range (max 254)"},
		{"int16 negative", "\xd1\xff\xfe", 10, 0, "negative number -2"},
		{"negative fixint", "\xff", 10, 0, "not an unsigned integer (code 0xff)"},
		{"nil", "\xc0", 10, 0, "not an unsigned integer (code 0xc0)"},
		{"short", "\xce\x00", 10, 0, "unexpected end of data"},
		{"empty", "", 10, 0, "unexpected end of data"},
	} {
		r := New([]byte(c.in), nil)
		v, err := r.Uint(c.max)
		if got := fmt.Sprint(err); (c.err == "" && err != nil) || (c.err != "" && got != c.err) {
			t.Errorf("%s: error %v, want %q", c.name, err, c.err)
			continue
		}
		if err == nil && (v != c.v || r.Left() != 0) {
			t.Errorf("%s: got %d with %d bytes left, want %d", c.name, v, r.Left(), c.v)
		}
	}
}

func TestMsgpackReadPeekBytes(t *testing.T) {
	r := New([]byte("abc"), nil)
	if p, ok := r.PeekBytes(2); !ok || string(p) != "ab" || r.Offset() != 0 {
		t.Fatalf("PeekBytes(2) = %q, %v at %d", p, ok, r.Offset())
	}
	if _, ok := r.PeekBytes(4); ok {
		t.Fatal("PeekBytes past the end succeeded")
	}
	if _, ok := r.PeekBytes(-1); ok {
		t.Fatal("PeekBytes(-1) succeeded")
	}
}

func TestMsgpackReadSkip(t *testing.T) {
	for _, c := range []struct {
		name string
		in   string
		len  int // bytes of the first value; -1: refused
	}{
		{"posfix", "\x05\x06", 1},
		{"nil", "\xc0", 1},
		{"true", "\xc3", 1},
		{"float64", "\xcb\x00\x00\x00\x00\x00\x00\x00\x00", 9},
		{"float32 short", "\xca\x00", -1},
		{"fixstr", "\xa2ab\x01", 3},
		{"str8", "\xd9\x01a", 3},
		{"bin16", "\xc5\x00\x02ab", 5},
		{"bin32 short", "\xc6\x00\x00\x00\x09ab", -1},
		{"fixext4", "\xd6\x01abcd", 6},
		{"ext8", "\xc7\x02\x01ab", 5},
		{"ext8 short", "\xc7\x02\x01a", -1},
		{"nested", "\x92\x81\xa1k\x93\x01\x02\x03\xc0\x07", 9},
		{"map16", "\xde\x00\x01\x01\x02", 5},
		{"array32 too long", "\xdd\x00\x00\x10\x00\x01", -1},
		{"fixarray too long", "\x9f\x01", -1},
		{"never used code", "\xc1", -1},
		{"empty", "", -1},
	} {
		r := New([]byte(c.in), nil)
		err := r.Skip()
		if c.len < 0 {
			if err == nil {
				t.Errorf("%s: skipped %d bytes, want an error", c.name, r.Offset())
			}
			continue
		}
		if err != nil || r.Offset() != c.len {
			t.Errorf("%s: skipped %d bytes (error %v), want %d", c.name, r.Offset(), err, c.len)
		}
	}
}

func TestMsgpackReadCursor(t *testing.T) {
	own := errors.New("own short error")
	r := New([]byte("\xc0\x01\x02\x03\x04\x05"), own)
	if !r.IsNil() || r.IsNil() {
		t.Fatal("IsNil: want one nil, then none")
	}
	if v, err := r.BigEndian(2); err != nil || v != 0x0102 {
		t.Fatalf("BigEndian(2) = %x, %v", v, err)
	}
	at := r.Offset()
	if c, err := r.ReadByte(); err != nil || c != 3 {
		t.Fatalf("ReadByte = %x, %v", c, err)
	}
	r.Seek(at)
	if p, err := r.Take(3); err != nil || string(p) != "\x03\x04\x05" || r.Left() != 0 {
		t.Fatalf("Take(3) = %q, %v; %d left", p, err, r.Left())
	}
	if _, err := r.Take(1); err != own {
		t.Fatalf("Take past the end: %v, want the reader's own error", err)
	}
	if _, err := r.Peek(); err != own {
		t.Fatalf("Peek past the end: %v, want the reader's own error", err)
	}
	if _, err := r.Take(-1); err != own {
		t.Fatalf("Take(-1): %v", err)
	}
}

func TestMsgpackReadTypeName(t *testing.T) {
	for c, want := range map[byte]string{
		0x00: "integer", 0xff: "integer", Uint64: "integer", Int8: "integer",
		0x80: "map", Map32: "map", 0x9a: "array", Array16: "array",
		0xa0: "string", Str32: "string", Bin8: "binary", Nil: "nil",
		True: "bool", Float32: "float", 0xc1: "code 0xc1", Ext8: "code 0xc7",
	} {
		if got := TypeName(c); got != want {
			t.Errorf("TypeName(0x%02x) = %q, want %q", c, got, want)
		}
	}
}

// FuzzMsgpackRead: on any bytes, Skip ends inside the payload or fails, and
// the typed readers agree with Skip on where a value ends: a string or bin
// is its header plus its length, an integer is what Int consumed (and Uint
// reads the same non-negative integers).
func FuzzMsgpackRead(f *testing.F) {
	for _, s := range []string{
		"\x05", "\xd3\xff\xff\xff\xff\xff\xff\xff\xfe", "\xa3abc", "\xd9\x02ab", "\xc4\x01\x00",
		"\x92\x81\xa1k\x93\x01\x02\x03\xc0", "\xdd\xff\xff\xff\xff", "\xc7\x01\x05a", "\xcb\x01",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		r := New(data, nil)
		err := r.Skip()
		end := r.Offset()
		if end > len(data) || end < 0 {
			t.Fatalf("Skip ended at %d of %d bytes", end, len(data))
		}
		if err != nil {
			return
		}
		r2 := New(data, nil)
		if v, neg, ok, err := r2.Int(); ok {
			if err != nil || r2.Offset() != end {
				t.Fatalf("Int ended at %d (error %v), Skip at %d", r2.Offset(), err, end)
			}
			r4 := New(data, nil)
			u, err := r4.Uint(1<<64 - 1)
			if (err == nil) != (!neg) || (err == nil && (u != v || r4.Offset() != end)) {
				t.Fatalf("Uint = %d, %v; Int = %d, negative %v", u, err, v, neg)
			}
			return
		}
		for _, h := range []func(*Reader) (uint64, bool, error){(*Reader).StrHeader, (*Reader).BinHeader} {
			r3 := New(data, nil)
			if n, ok, err := h(&r3); ok {
				if err != nil || uint64(r3.Offset())+n != uint64(end) {
					t.Fatalf("header of %d bytes at %d (error %v), Skip at %d", n, r3.Offset(), err, end)
				}
				return
			}
		}
	})
}
