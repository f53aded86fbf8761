package decisionlog

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/router"
)

func entry(i int, worker string, t0 time.Time) Entry {
	return Entry{Time: t0.Add(time.Duration(i) * time.Second), RequestID: fmt.Sprintf("req-%d", i), Model: "m", Mode: "kv",
		PromptTokens: 100, PromptBlocks: 6, Worker: worker, CachedBlocks: i % 7, IndexEpoch: uint64(1000 + i), SyncAge: -1,
		Rows: []router.WorkerCost{{Worker: router.WorkerID(worker), Overlap: i % 7, Cost: 1.5}, {Worker: "other", Cost: 9, Busy: true, BusyReason: "decode"}}}
}

// TestDecisionLogRingAndQuery: the ring keeps the newest decisions, a
// query filters by request, worker, model and time, newest first, and
// converts the cost table.
func TestDecisionLogRingAndQuery(t *testing.T) {
	l := New(4, nil)
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	for i := 1; i <= 6; i++ {
		w := "w1"
		if i%2 == 0 {
			w = "w2"
		}
		if seq := l.Add(entry(i, w, t0)); seq != uint64(i) {
			t.Fatalf("decision %d got sequence %d", i, seq)
		}
	}
	seqs := func(ds []Decision) (out []uint64) {
		for _, d := range ds {
			out = append(out, d.Seq)
		}
		return out
	}
	for _, tc := range []struct {
		name string
		f    Filter
		want []uint64
	}{
		{"all: the newest 4, newest first", Filter{}, []uint64{6, 5, 4, 3}},
		{"limit", Filter{Limit: 2}, []uint64{6, 5}},
		{"worker", Filter{Worker: "w1"}, []uint64{5, 3}},
		{"request", Filter{RequestID: "req-4"}, []uint64{4}},
		{"request pushed out", Filter{RequestID: "req-1"}, nil},
		{"model", Filter{Model: "other"}, nil},
		{"since", Filter{Since: t0.Add(5 * time.Second)}, []uint64{6, 5}},
		{"until", Filter{Until: t0.Add(4 * time.Second)}, []uint64{4, 3}},
	} {
		if got := seqs(l.Query(tc.f)); fmt.Sprint(got) != fmt.Sprint(tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
	d := l.Query(Filter{RequestID: "req-5"})[0]
	if len(d.Candidates) != 2 || d.Candidates[0].Worker != "w1" || d.Candidates[0].CachedBlocks != 5 || !d.Candidates[1].Busy ||
		d.IndexEpoch != 1005 || d.SyncAgeMs != -1 || d.Outcome != nil {
		t.Fatalf("decision %+v", d)
	}
	l.Complete(5, Outcome{Status: 200, TTFTMs: 12.5, CachedTokens: 80})
	l.Complete(1, Outcome{Status: 200}) // pushed out: ignored
	if o := l.Query(Filter{RequestID: "req-5"})[0].Outcome; o == nil || o.Status != 200 || o.CachedTokens != 80 {
		t.Fatalf("outcome %+v", o)
	}
	var off *Log = New(0, nil)
	if off != nil || off.Add(entry(1, "w", t0)) != 0 || off.Query(Filter{}) != nil {
		t.Fatal("a zero-size log records")
	}
	off.Complete(1, Outcome{})
}

// TestDecisionLogSinkRotates: completed decisions reach the file as JSON
// lines with their outcome; past MaxBytes the file rotates, keeping Keep
// old files, and no line is split or lost across a rotation.
func TestDecisionLogSinkRotates(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "decisions.jsonl")
	sink, err := OpenSink(path, 2000, 2, nil)
	if err != nil {
		t.Fatal(err)
	}
	l := New(64, sink)
	t0 := time.Now()
	const n = 40
	for i := 1; i <= n; i++ {
		seq := l.Add(entry(i, "w1", t0))
		l.Complete(seq, Outcome{Status: 200, CachedTokens: i})
	}
	if err := sink.Close(); err != nil {
		t.Fatal(err)
	}
	if sink.Dropped() != 0 || sink.Written() != n {
		t.Fatalf("written %d, dropped %d, want %d and 0", sink.Written(), sink.Dropped(), n)
	}
	var got []int
	for _, name := range []string{path + ".2", path + ".1", path} {
		f, err := os.Open(name)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		st, _ := f.Stat()
		if st.Size() > 2000 {
			t.Errorf("%s has %d bytes, over the 2000 cap", name, st.Size())
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			var d Decision
			if err := json.Unmarshal(sc.Bytes(), &d); err != nil {
				t.Fatalf("%s: line %q: %v", name, sc.Text(), err)
			}
			if d.Outcome == nil || len(d.Candidates) != 2 {
				t.Fatalf("%s: line without its outcome or table: %s", name, sc.Text())
			}
			got = append(got, d.Outcome.CachedTokens)
		}
		f.Close()
	}
	if _, err := os.Stat(path + ".3"); err == nil {
		t.Error("more rotated files than keep=2")
	}
	// The three files hold the newest decisions in order, contiguous.
	if len(got) == 0 || got[len(got)-1] != n {
		t.Fatalf("lines %v: the newest decision is missing", got)
	}
	for i := 1; i < len(got); i++ {
		if got[i] != got[i-1]+1 {
			t.Fatalf("lines %v: not contiguous across rotations", got)
		}
	}
	if len(got) == n {
		t.Fatalf("all %d lines kept: nothing rotated out (the cap did not apply)", n)
	}
}

// BenchmarkDecisionLogAdd is the router's added cost per decision (Add and
// Complete, no sink): compare with BenchmarkRoute in package router.
func BenchmarkDecisionLogAdd(b *testing.B) {
	l := New(4096, nil)
	e := entry(1, "w1", time.Now())
	b.ReportAllocs()
	for b.Loop() {
		seq := l.Add(e)
		l.Complete(seq, Outcome{Status: 200})
	}
}
