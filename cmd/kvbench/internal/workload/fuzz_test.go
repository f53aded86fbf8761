package workload

import (
	"testing"
)

// FuzzParseTraceLine: the parser never panics, and whatever it accepts
// satisfies the row invariants the simulator relies on. The seed corpus is in
// testdata/fuzz/FuzzParseTraceLine.
func FuzzParseTraceLine(f *testing.F) {
	f.Add([]byte(`{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}`))
	f.Add([]byte(`{"timestamp": 3.5, "input_length": 1, "output_length": 0, "hash_ids": [9], "session_id": "s"}`))
	f.Add([]byte(`{"timestamp": 3.5, "input_length": 1, "output_length": 0, "hash_ids": [9], "session_id": "s", "think_ms": 2000}`))
	f.Add([]byte(`{"timestamp": 1.5, "unix_ms": 1795000000000, "input_length": 40, "output_length": 7, "hash_ids": [18446744073709551615, 2, 3], "block_tokens": 16, "model": "m"}`))
	f.Fuzz(func(t *testing.T, line []byte) {
		row, err := ParseTraceLine(line)
		if err != nil {
			return
		}
		if row.InputLength < 1 || row.InputLength > MaxTraceTokens || row.OutputLength < 0 || row.OutputLength > MaxTraceTokens {
			t.Fatalf("accepted lengths %d/%d", row.InputLength, row.OutputLength)
		}
		if !(row.TimestampMs >= 0 && row.TimestampMs <= MaxTraceTimestampMs) {
			t.Fatalf("accepted timestamp %v", row.TimestampMs)
		}
		if row.BlockTokens < 1 || row.BlockTokens > MaxTraceTokens || row.UnixMs < 0 {
			t.Fatalf("accepted block_tokens %d, unix_ms %d", row.BlockTokens, row.UnixMs)
		}
		if want := (row.InputLength + row.BlockTokens - 1) / row.BlockTokens; len(row.HashIDs) != want {
			t.Fatalf("accepted %d hash ids for %d tokens", len(row.HashIDs), row.InputLength)
		}
		if row.InputLength <= 4096 {
			toks := traceTokens(row.HashIDs, row.BlockTokens, row.InputLength, nil)
			if len(toks) != row.InputLength {
				t.Fatalf("%d tokens for input_length %d", len(toks), row.InputLength)
			}
			for _, tok := range toks {
				if tok >= Vocab {
					t.Fatalf("token %d outside the vocabulary", tok)
				}
			}
		}
	})
}
