package capture

import (
	"bufio"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/splitmix"
)

func readRows(t *testing.T, path string) []Row {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var rows []Row
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var r Row
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("line %q: %v", sc.Text(), err)
		}
		rows = append(rows, r)
	}
	return rows
}

func TestCaptureRows(t *testing.T) {
	path := filepath.Join(t.TempDir(), "trace.jsonl")
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	rec, err := Open(Config{Path: path, Sample: 1, Replica: "r1"}, t0, nil)
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		req  Request
		want Row
	}{
		{"whole blocks", Request{Start: t0.Add(1500 * time.Microsecond), Model: "m", Hashes: []uint64{11, 12}, BlockTokens: 16, InputTokens: 32,
			OutputTokens: 7, OutputKnown: true, Worker: "w1", CachedTokens: 16},
			Row{Timestamp: 1.5, InputLength: 32, OutputLength: 7, HashIDs: []uint64{11, 12}, BlockTokens: 16, OutputKnown: true, Model: "m", Worker: "w1", CachedTokens: 16, Replica: "r1"}},
		{"a partial last block gets an id of its own", Request{Start: t0.Add(2 * time.Second), Hashes: []uint64{11}, BlockTokens: 16, InputTokens: 20, Sequences: 3},
			Row{Timestamp: 2000, InputLength: 20, HashIDs: []uint64{11, 0 /* checked below */}, BlockTokens: 16, Sequences: 3, Replica: "r1"}},
		{"shorter than a block", Request{Start: t0.Add(-time.Second), BlockTokens: 16, InputTokens: 5, Sequences: 1},
			Row{Timestamp: 0, InputLength: 5, HashIDs: []uint64{0}, BlockTokens: 16, Replica: "r1"}},
	}
	for _, c := range cases {
		rec.Record(c.req)
	}
	if err := rec.Close(); err != nil {
		t.Fatal(err)
	}
	rows := readRows(t, path)
	if len(rows) != len(cases) || rec.Written() != uint64(len(cases)) || rec.Dropped() != 0 {
		t.Fatalf("%d rows, written %d, dropped %d; want %d", len(rows), rec.Written(), rec.Dropped(), len(cases))
	}
	for i, c := range cases {
		got, want := rows[i], c.want
		want.UnixMs = c.req.Start.UnixMilli()
		if len(got.HashIDs) != len(want.HashIDs) {
			t.Errorf("%s: hash_ids %v, want %d", c.name, got.HashIDs, len(want.HashIDs))
			continue
		}
		for j := range want.HashIDs {
			if want.HashIDs[j] == 0 {
				if got.HashIDs[j] == 0 || got.HashIDs[j] == 11 {
					t.Errorf("%s: partial block id %d", c.name, got.HashIDs[j])
				}
				want.HashIDs[j] = got.HashIDs[j]
			}
		}
		g, _ := json.Marshal(got)
		w, _ := json.Marshal(want)
		if string(g) != string(w) {
			t.Errorf("%s:\n got %s\nwant %s", c.name, g, w)
		}
	}
	// Two requests with one prompt length but different full blocks get
	// different partial ids; the same prompt gets the same.
	a := Request{Hashes: []uint64{1}, BlockTokens: 16, InputTokens: 20}
	if partialBlockID(a) == partialBlockID(Request{Hashes: []uint64{2}, BlockTokens: 16, InputTokens: 20}) || partialBlockID(a) != partialBlockID(a) {
		t.Error("partial ids do not follow the prefix")
	}
}

// Sampling keeps or drops every request of a first block together, and
// keeps about the asked fraction of first blocks.
func TestCaptureSampleByPrefix(t *testing.T) {
	path := filepath.Join(t.TempDir(), "trace.jsonl")
	rec, err := Open(Config{Path: path, Sample: 0.25}, time.Now(), nil)
	if err != nil {
		t.Fatal(err)
	}
	const prefixes = 4000
	kept := 0
	for p := range uint64(prefixes) {
		first := splitmix.Mix(p + 1) // any hash
		k := rec.Keep(first, true)
		if k {
			kept++
		}
		for turn := range uint64(2) {
			rec.Record(Request{Hashes: []uint64{first, first ^ (turn + 1)}, BlockTokens: 16, InputTokens: 32})
		}
	}
	if !rec.Keep(0, false) {
		t.Error("a prompt without a full block must always be kept")
	}
	rec.Close()
	rows := readRows(t, path)
	if len(rows) != 2*kept {
		t.Fatalf("%d rows for %d kept prefixes: a prefix's requests were split", len(rows), kept)
	}
	if f := float64(kept) / prefixes; f < 0.22 || f > 0.28 {
		t.Fatalf("kept %.3f of prefixes, want about 0.25", f)
	}
	for _, bad := range []float64{0, -1, 1.5} {
		if _, err := Open(Config{Path: path, Sample: bad}, time.Now(), nil); err == nil {
			t.Errorf("sample %v accepted", bad)
		}
	}
	if _, err := Open(Config{Path: filepath.Join(t.TempDir(), "no", "such", "dir", "f"), Sample: 1}, time.Now(), nil); err == nil {
		t.Error("a capture file in a missing directory opened")
	}
}
