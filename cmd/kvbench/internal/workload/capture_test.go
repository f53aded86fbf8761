package workload

import (
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api/capture"
)

// A kvrouter capture replays: the rows a replica's capture.Recorder writes
// load as a trace, the captures of two replicas merge onto one time line
// by unix_ms, and requests that shared a prefix live share exactly that
// many block hashes in the replay (at the capture's block size).
func TestTraceReplaysCaptures(t *testing.T) {
	dir := t.TempDir()
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	open := func(name string, origin time.Time) *capture.Recorder {
		rec, err := capture.Open(capture.Config{Path: filepath.Join(dir, name), Sample: 1, Replica: name}, origin, nil)
		if err != nil {
			t.Fatal(err)
		}
		return rec
	}
	// r2 started capturing 10 s after r1: its timestamps count from then.
	r1, r2 := open("r1", t0), open("r2", t0.Add(10*time.Second))
	// Three requests of 16-token blocks: A = [1 2 3] + 5 tokens, B shares
	// A's first two blocks, C shares nothing.
	r1.Record(capture.Request{Start: t0.Add(12 * time.Second), Hashes: []uint64{1, 2, 3}, BlockTokens: 16, InputTokens: 53, OutputTokens: 4, OutputKnown: true, CachedTokens: 32})
	r2.Record(capture.Request{Start: t0.Add(11 * time.Second), Hashes: []uint64{1, 2, 9}, BlockTokens: 16, InputTokens: 48, OutputTokens: 6, OutputKnown: true})
	r1.Record(capture.Request{Start: t0.Add(13 * time.Second), Hashes: []uint64{7}, BlockTokens: 16, InputTokens: 16, OutputTokens: 0})
	for _, r := range []*capture.Recorder{r1, r2} {
		if err := r.Close(); err != nil {
			t.Fatal(err)
		}
	}
	w, err := LoadTrace(TraceSpec{Path: filepath.Join(dir, "r1") + "," + filepath.Join(dir, "r2"), Speedup: 1, BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Requests) != 3 {
		t.Fatalf("%d requests", len(w.Requests))
	}
	// Arrival order across both files: r2's (11 s), then r1's two.
	want := []struct {
		at     time.Duration
		tokens int
		out    int
	}{{0, 48, 6}, {time.Second, 53, 4}, {2 * time.Second, 16, 1}}
	for i, r := range w.Requests {
		if r.At != want[i].at || r.PromptTokens != want[i].tokens || r.OutputTokens != want[i].out {
			t.Errorf("request %d: at %v, %d tokens, %d out; want %+v", i, r.At, r.PromptTokens, r.OutputTokens, want[i])
		}
	}
	b, a, c := w.Requests[0].Hashes, w.Requests[1].Hashes, w.Requests[2].Hashes
	if len(a) != 3 || len(b) != 3 || len(c) != 1 {
		t.Fatalf("blocks: %d %d %d", len(a), len(b), len(c))
	}
	if !slices.Equal(a[:2], b[:2]) || a[2] == b[2] || slices.Contains(a, c[0]) {
		t.Fatalf("shared prefix not replayed: A %x, B %x, C %x", a, b, c)
	}
	// The live figures come from the rows' cached_tokens: one hit of
	// three requests, 32 cached of 117 prompt tokens.
	if l := w.Live; l == nil || l.Requests != 3 || l.RequestHitRate != 1.0/3 || l.CachedTokenRatio != 32.0/117 {
		t.Fatalf("live figures %+v", l)
	}
}
