package workload

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/router"
)

func synth(t *testing.T, seed uint64, order string) *Workload {
	t.Helper()
	w, err := NewSynthetic(SyntheticSpec{
		Prefixes: 5, PrefixTokens: 100, TailTokens: 37, OutputTokens: 4,
		Requests: 60, Concurrency: 3, BlockSize: 16, Seed: seed, Order: order,
	})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func TestSimWorkloadDeterminism(t *testing.T) {
	a, b := synth(t, 42, PrefixRandom), synth(t, 42, PrefixRandom)
	var ta, tb []uint32
	for i := range a.Requests {
		ra, rb := a.Requests[i], b.Requests[i]
		if ra.ID != rb.ID || ra.Prefix != rb.Prefix || ra.PromptTokens != rb.PromptTokens || !slices.Equal(ra.Hashes, rb.Hashes) {
			t.Fatalf("request %d differs between two generations with the same seed", i)
		}
		ta, tb = a.Tokens(i, ta), b.Tokens(i, tb)
		if !slices.Equal(ta, tb) {
			t.Fatalf("request %d: tokens differ", i)
		}
		// The hashes are the router's, computed from the tokens.
		if want := router.SequenceHashes(ta, 16, ""); !slices.Equal(ra.Hashes, want) {
			t.Fatalf("request %d: hashes are not router.SequenceHashes of its tokens", i)
		}
		if len(ta) != 137 || ra.HitTokens != 50 || ra.SharedTokens != 100 {
			t.Fatalf("request %d: %d tokens, hit at %d, shared %d", i, len(ta), ra.HitTokens, ra.SharedTokens)
		}
	}
	// Requests with the same prefix share exactly the prefix's full blocks.
	for i := range a.Requests {
		for j := i + 1; j < len(a.Requests); j++ {
			ri, rj := a.Requests[i], a.Requests[j]
			common := 0
			for common < len(ri.Hashes) && ri.Hashes[common] == rj.Hashes[common] {
				common++
			}
			want := 0
			if ri.Prefix == rj.Prefix {
				want = 100 / 16
			}
			if common != want {
				t.Fatalf("requests %d and %d (prefixes %d, %d) share %d blocks, want %d", i, j, ri.Prefix, rj.Prefix, common, want)
			}
		}
	}
	c := synth(t, 43, PrefixRandom)
	if slices.Equal(a.Requests[0].Hashes, c.Requests[0].Hashes) {
		t.Fatal("another seed gave the same first request")
	}
}

func TestSimWorkloadShuffledOrder(t *testing.T) {
	w := synth(t, 1, PrefixShuffled)
	counts := make([]int, 5)
	for _, r := range w.Requests {
		counts[r.Prefix]++
	}
	for k, n := range counts {
		if n != 12 {
			t.Fatalf("prefix %d drawn %d times, want 12 (counts %v)", k, n, counts)
		}
	}
	// Still shuffled: not simply 0,1,2,3,4,0,…
	inOrder := true
	for i, r := range w.Requests {
		inOrder = inOrder && r.Prefix == i%5
	}
	if inOrder {
		t.Fatal("shuffled order is not shuffled")
	}
}

func TestSimWorkloadSpecErrors(t *testing.T) {
	base := SyntheticSpec{Prefixes: 1, PrefixTokens: 10, TailTokens: 1, OutputTokens: 1, Requests: 1, Concurrency: 1, BlockSize: 16}
	for name, mut := range map[string]func(*SyntheticSpec){
		"no prefixes":   func(s *SyntheticSpec) { s.Prefixes = 0 },
		"empty prompt":  func(s *SyntheticSpec) { s.PrefixTokens, s.TailTokens = 0, 0 },
		"no output":     func(s *SyntheticSpec) { s.OutputTokens = 0 },
		"no requests":   func(s *SyntheticSpec) { s.Requests = 0 },
		"no clients":    func(s *SyntheticSpec) { s.Concurrency = 0 },
		"no block size": func(s *SyntheticSpec) { s.BlockSize = 0 },
		"bad order":     func(s *SyntheticSpec) { s.Order = "sorted" },
	} {
		s := base
		mut(&s)
		if _, err := NewSynthetic(s); !errors.Is(err, ErrSpec) {
			t.Errorf("%s: err %v, want ErrSpec", name, err)
		}
	}
}

func TestSimTraceParseLine(t *testing.T) {
	row, err := ParseTraceLine([]byte(`{"timestamp": 27, "input_length": 1100, "output_length": 5, "hash_ids": [0, 7, 9], "extra": 1}`))
	if err != nil {
		t.Fatal(err)
	}
	if row.TimestampMs != 27 || row.InputLength != 1100 || row.OutputLength != 5 || !slices.Equal(row.HashIDs, []uint64{0, 7, 9}) || row.HasSession {
		t.Fatalf("parsed %+v", row)
	}
	for line, id := range map[string]string{
		`{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [3], "session_id": "chat-9"}`: "chat-9",
		`{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [3], "session_id": 12}`:       "12",
	} {
		row, err := ParseTraceLine([]byte(line))
		if err != nil || !row.HasSession || row.SessionID != id {
			t.Errorf("%s: %+v, %v; want session %q", line, row, err, id)
		}
	}
	for _, bad := range []string{
		`not json`,
		`{"timestamp": 0, "input_length": 10, "output_length": 1}`,
		`{"input_length": 10, "output_length": 1, "hash_ids": [1]}`,
		`{"timestamp": 0, "output_length": 1, "hash_ids": [1]}`,
		`{"timestamp": 0, "input_length": 10, "hash_ids": [1]}`,
		`{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}`,
		`{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}`,
		`{"timestamp": 0, "input_length": 10, "output_length": -2, "hash_ids": [1]}`,
		`{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}`,
		`{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}`,
		`{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}`,
		`{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1.5]}`,
		`{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], "session_id": [1]}`,
		`{"timestamp": 1e300, "input_length": 10, "output_length": 1, "hash_ids": [1]}`,
		`{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], "session_id": "s", "think_ms": -5}`,
		`{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], "session_id": "s", "think_ms": "1s"}`,
	} {
		if _, err := ParseTraceLine([]byte(bad)); !errors.Is(err, ErrTraceLine) {
			t.Errorf("%s: err %v, want ErrTraceLine", bad, err)
		}
	}
}

func writeTrace(t *testing.T, lines ...string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "trace.jsonl")
	if err := os.WriteFile(p, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestSimTraceMalformedLineNamesFileAndLine(t *testing.T) {
	p := writeTrace(t,
		`{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}`,
		``,
		`{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}`,
	)
	_, err := LoadTrace(TraceSpec{Path: p, Speedup: 1, BlockSize: 16})
	if !errors.Is(err, ErrTraceLine) {
		t.Fatalf("err %v, want ErrTraceLine", err)
	}
	if want := p + ":3:"; !strings.Contains(err.Error(), want) {
		t.Fatalf("error %q does not name %s", err, want)
	}
}

func TestSimTraceLoad(t *testing.T) {
	p := writeTrace(t,
		`{"timestamp": 2000, "input_length": 1100, "output_length": 0, "hash_ids": [0, 1, 2], "session_id": "a"}`,
		`{"timestamp": 1000, "input_length": 700, "output_length": 8, "hash_ids": [0, 1], "session_id": "a"}`,
		`{"timestamp": 1000, "input_length": 600, "output_length": 8, "hash_ids": [0, 3]}`,
		`{"timestamp": 3000, "input_length": 100, "output_length": 8, "hash_ids": [5]}`,
	)
	w, err := LoadTrace(TraceSpec{Path: p, Speedup: 2, BlockSize: 16, MaxRequests: 3})
	if err != nil {
		t.Fatal(err)
	}
	if w.Kind != Trace || len(w.Requests) != 3 {
		t.Fatalf("kind %v, %d requests; want trace, 3 (max requests)", w.Kind, len(w.Requests))
	}
	// Sorted by arrival, file order among ties; times divided by the speedup.
	r := w.Requests
	if r[0].PromptTokens != 700 || r[1].PromptTokens != 600 || r[2].PromptTokens != 1100 {
		t.Fatalf("order: %d %d %d", r[0].PromptTokens, r[1].PromptTokens, r[2].PromptTokens)
	}
	if r[0].At.Milliseconds() != 500 || r[2].At.Milliseconds() != 1000 {
		t.Fatalf("arrivals %v %v, want 500ms and 1s", r[0].At, r[2].At)
	}
	if r[2].OutputTokens != 1 {
		t.Fatalf("output_length 0 became %d tokens, want 1", r[2].OutputTokens)
	}
	if len(w.Sessions) != 1 || !slices.Equal(w.Sessions[0], []int{0, 2}) || r[0].NextTurn != 2 || r[2].NextTurn != -1 || r[1].Session != NoSession {
		t.Fatalf("sessions %v, next turns %d %d", w.Sessions, r[0].NextTurn, r[2].NextTurn)
	}
	// The same hash id at the same position gives the same tokens: request 0
	// (ids 0,1; 700 tokens) is a prefix of request 2 (ids 0,1,2): all of its
	// 43 full blocks hit, even those of its partial last id.
	if n := len(r[0].Hashes); n != 700/16 || !slices.Equal(r[0].Hashes, r[2].Hashes[:n]) {
		t.Fatalf("request 0's %d blocks are not a prefix of request 2's", n)
	}
	// Request 1 shares only hash id 0 (512 tokens = 32 blocks).
	common := 0
	for r[1].Hashes[common] == r[2].Hashes[common] {
		common++
	}
	if common != 32 {
		t.Fatalf("requests sharing one 512-token id share %d blocks, want 32", common)
	}
	if r[0].HitTokens != 16 {
		t.Fatalf("trace hit threshold %d tokens, want one block", r[0].HitTokens)
	}
	var tok []uint32
	tok = w.Tokens(2, tok)
	if len(tok) != 1100 || !slices.Equal(router.SequenceHashes(tok, 16, ""), r[2].Hashes) {
		t.Fatalf("tokens of request 2: %d, hashes mismatch", len(tok))
	}
}

func TestSimTraceBlockTokensDistinct(t *testing.T) {
	// Neighbouring ids must not give shifted copies of one stream.
	a := blockTokens(7, 512, nil)
	b := blockTokens(8, 512, nil)
	for shift := -3; shift <= 3; shift++ {
		same := 0
		for i := range a {
			if j := i + shift; j >= 0 && j < len(b) && a[i] == b[j] {
				same++
			}
		}
		if same > 8 {
			t.Fatalf("ids 7 and 8 agree on %d tokens at shift %d", same, shift)
		}
	}
}

// Zipf popularity skews the draws toward a few prefixes; a hot shift moves
// the hot prefix; uniform draws stay what they were before these options.
func TestSimWorkloadPopularityAndHotShift(t *testing.T) {
	gen := func(pop string, shift int) *Workload {
		t.Helper()
		w, err := NewSynthetic(SyntheticSpec{
			Prefixes: 20, PrefixTokens: 32, TailTokens: 16, OutputTokens: 4,
			Requests: 4000, Concurrency: 2, BlockSize: 16, Seed: 3, Popularity: pop, HotShift: shift,
		})
		if err != nil {
			t.Fatal(err)
		}
		return w
	}
	counts := func(w *Workload, from, to int) map[int]int {
		c := map[int]int{}
		for _, r := range w.Requests[from:to] {
			c[r.Prefix]++
		}
		return c
	}
	top := func(c map[int]int) (int, int) {
		best, n := -1, 0
		for k, v := range c {
			if v > n || (v == n && k < best) {
				best, n = k, v
			}
		}
		return best, n
	}
	// Uniform: same requests as the default spec.
	u, d := gen("uniform", 0), gen("", 0)
	for i := range u.Requests {
		if u.Requests[i].Prefix != d.Requests[i].Prefix {
			t.Fatal("uniform popularity changed the draws")
		}
	}
	if _, n := top(counts(u, 0, 4000)); n > 300 {
		t.Errorf("uniform: top prefix drawn %d of 4000", n)
	}
	// zipf:1.1 over 20 prefixes: the top rank has p = 1/H(20, 1.1) ≈ 0.313.
	z := gen("zipf:1.1", 0)
	if _, n := top(counts(z, 0, 4000)); n < 1130 || n > 1380 {
		t.Errorf("zipf:1.1: top prefix drawn %d of 4000, want about 1253", n)
	}
	// A hot shift every 1000 requests: the hottest prefix changes.
	s := gen("zipf:1.1", 1000)
	hot := map[int]bool{}
	for e := range 4 {
		k, _ := top(counts(s, 1000*e, 1000*(e+1)))
		hot[k] = true
	}
	if len(hot) < 3 {
		t.Errorf("hot shift: hottest prefixes per epoch %v", hot)
	}
	for _, bad := range []SyntheticSpec{
		{Popularity: "zipf:0"}, {Popularity: "zipf:x"}, {Popularity: "pareto"}, {HotShift: -1},
		{Popularity: "zipf:1", Order: PrefixShuffled},
	} {
		bad.Prefixes, bad.PrefixTokens, bad.OutputTokens, bad.Requests, bad.Concurrency, bad.BlockSize = 3, 16, 1, 5, 1, 16
		if _, err := NewSynthetic(bad); !errors.Is(err, ErrSpec) {
			t.Errorf("%+v: err %v, want ErrSpec", bad, err)
		}
	}
}

// Open-loop arrivals: the gaps have the mean and coefficient of variation
// asked for, the first request goes at 0, and one seed at two rates is one
// pattern scaled (so a goodput search compares rates, not random draws).
func TestSimArrivals(t *testing.T) {
	for _, tc := range []struct {
		rate, cv float64
	}{{1, 1}, {4, 1}, {2, 0.5}, {2, 3}} {
		const n = 20000
		at := Arrivals(n, tc.rate, tc.cv, 7)
		if at[0] != 0 {
			t.Fatalf("rate %v: first arrival at %v", tc.rate, at[0])
		}
		var sum, sq float64
		for i := 1; i < n; i++ {
			g := (at[i] - at[i-1]).Seconds()
			if g < 0 {
				t.Fatalf("rate %v: arrivals out of order at %d", tc.rate, i)
			}
			sum += g
			sq += g * g
		}
		mean := sum / (n - 1)
		cv := math.Sqrt(sq/(n-1)-mean*mean) / mean
		if math.Abs(mean*tc.rate-1) > 0.05 || math.Abs(cv-tc.cv)/tc.cv > 0.08 {
			t.Errorf("rate %v cv %v: mean gap %.4f s (want %.4f), cv %.3f", tc.rate, tc.cv, mean, 1/tc.rate, cv)
		}
	}
	a, b := Arrivals(100, 1, 2, 3), Arrivals(100, 4, 2, 3)
	for i := range a {
		if d := a[i] - 4*b[i]; d < -4 || d > 4 { // rounding to nanoseconds
			t.Fatalf("arrival %d: %v at rate 1, %v at rate 4: not one pattern scaled", i, a[i], b[i])
		}
	}
}

// An arrival rate changes when requests are sent, never what they are.
func TestSimWorkloadOpenLoopSameRequests(t *testing.T) {
	spec := SyntheticSpec{Prefixes: 3, PrefixTokens: 64, TailTokens: 16, OutputTokens: 4, Requests: 50, Concurrency: 2, BlockSize: 16, Seed: 5}
	closed, err := NewSynthetic(spec)
	if err != nil {
		t.Fatal(err)
	}
	spec.ArrivalRate, spec.ArrivalCV = 3, 2
	open, err := NewSynthetic(spec)
	if err != nil {
		t.Fatal(err)
	}
	if closed.OpenLoop || !open.OpenLoop || open.ArrivalRate != 3 {
		t.Fatalf("open loop flags: closed %v, open %v at %v", closed.OpenLoop, open.OpenLoop, open.ArrivalRate)
	}
	for i := range closed.Requests {
		c, o := closed.Requests[i], open.Requests[i]
		if c.At != 0 || (i > 0 && o.At <= 0) || !slices.Equal(c.Hashes, o.Hashes) || c.Prefix != o.Prefix {
			t.Fatalf("request %d: closed %+v, open %+v", i, c, o)
		}
	}
	for _, bad := range []SyntheticSpec{{ArrivalRate: -1}, {ArrivalRate: math.Inf(1)}, {ArrivalRate: 1, ArrivalCV: -1}} {
		b := spec
		b.ArrivalRate, b.ArrivalCV = bad.ArrivalRate, bad.ArrivalCV
		if _, err := NewSynthetic(b); !errors.Is(err, ErrSpec) {
			t.Errorf("rate %v cv %v: err %v, want ErrSpec", bad.ArrivalRate, bad.ArrivalCV, err)
		}
	}
}
