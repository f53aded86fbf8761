package router

import "testing"

// Dynamo's published vectors (DESIGN.md §3), block size 4.
func TestHashDynamoVectors(t *testing.T) {
	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
	local, seq := BlockHashes(tokens, 4, "")
	tests := []struct {
		name      string
		got, want uint64
	}{
		{"local[0]", local[0], 14643705804678351452},
		{"seq[0]", seq[0], 14643705804678351452},
		{"local[1]", local[1], 16777012769546811212},
		{"seq[1]", seq[1], 4945711292740353085},
		{"local[2]", local[2], 483935686894639516},
		{"seq[2]", seq[2], 12583592247330656132},
	}
	for _, tc := range tests {
		if tc.got != tc.want {
			t.Errorf("%s = %d, want %d", tc.name, tc.got, tc.want)
		}
	}
	loraLocal, _ := BlockHashes(tokens[:4], 4, "my-lora")
	if loraLocal[0] != 15671544057904749233 {
		t.Errorf("lora local = %d, want 15671544057904749233", loraLocal[0])
	}
}

func TestHashPartialAndEmpty(t *testing.T) {
	tests := []struct {
		name      string
		tokens    []uint32
		blockSize int
		want      int
	}{
		{"empty", nil, 16, 0},
		{"shorter than a block", []uint32{1, 2, 3}, 16, 0},
		{"one full plus partial", make([]uint32, 20), 16, 1},
		{"zero block size", []uint32{1, 2}, 0, 0},
		{"negative block size", []uint32{1, 2}, -4, 0},
	}
	for _, tc := range tests {
		if got := len(SequenceHashes(tc.tokens, tc.blockSize, "")); got != tc.want {
			t.Errorf("%s: %d blocks, want %d", tc.name, got, tc.want)
		}
	}
}
