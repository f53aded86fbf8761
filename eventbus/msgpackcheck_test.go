package eventbus

import (
	"errors"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

func TestCheckMsgpack(t *testing.T) {
	valid := func(v any) []byte {
		b, err := msgpack.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	nested := []byte{}
	for range maxMsgpackDepth + 1 {
		nested = append(nested, 0x91) // fixarray of one
	}
	nested = append(nested, 0x01)
	cases := []struct {
		name string
		in   []byte
		ok   bool
	}{
		{"sync message", valid(&SyncMsg{Replica: "r1", Epoch: 3, Seq: 9, Op: SyncFull, Full: []ActiveRequest{{Request: "q", Worker: "w", Hashes: []uint64{1, 1 << 60}, ISL: 300}}}), true},
		{"every scalar", valid([]any{nil, true, -1, -200, 70000, -1 << 40, uint64(1) << 63, 1.5, float32(2), "s", []byte{1, 2}, map[string]int{"a": 1}}), true},
		{"empty", nil, false},
		{"array of 2^31-1 structs", []byte("\x81\xa1f\xdd\x7f\xff\xff\xff"), false},
		{"map16 of 65535 pairs", []byte("\xde\xff\xff\x01\x01"), false},
		{"str32 longer than the message", []byte("\xdb\x00\x00\x01\x00abc"), false},
		{"bin8 truncated", []byte("\xc4\x05ab"), false},
		{"ext8 truncated", []byte("\xc7\x02\x01a"), false},
		{"uint64 truncated", []byte("\xcf\x00\x00"), false},
		{"never-used byte", []byte{0xc1}, false},
		{"trailing bytes", []byte{0x01, 0x02}, false},
		{"nested too deep", nested, false},
		{"nested at the limit", nested[1:], true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := checkMsgpack(tc.in)
			if (err == nil) != tc.ok {
				t.Fatalf("checkMsgpack = %v, want ok=%v", err, tc.ok)
			}
			if err != nil && !errors.Is(err, errMsgpackShape) {
				t.Fatalf("error %v is not errMsgpackShape", err)
			}
		})
	}
}
