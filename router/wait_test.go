package router

import (
	"cmp"
	"fmt"
	"math"
	"testing"
	"time"
)

func TestRatioMean(t *testing.T) {
	for _, c := range []struct {
		name   string
		obs    [][2]float64 // num, den
		window int
		want   float64
		ok     bool
	}{
		{name: "none", window: 4},
		{name: "one", obs: [][2]float64{{3, 2}}, window: 4, want: 1.5, ok: true},
		// A ratio of means: (1+9)/(1+3), not the mean of 1 and 3.
		{name: "weighted by the denominator", obs: [][2]float64{{1, 1}, {9, 3}}, window: 4, want: 2.5, ok: true},
		// Window 1: only the last observation counts.
		{name: "window", obs: [][2]float64{{1, 1}, {9, 3}}, window: 1, want: 3, ok: true},
		// Zero or negative denominators, negative or NaN numerators are not observations.
		{name: "invalid ignored", obs: [][2]float64{{1, 0}, {-1, 2}, {math.NaN(), 1}, {4, 2}, {1, math.Inf(1)}}, window: 4, want: 2, ok: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			var m ratioMean
			for _, o := range c.obs {
				m.observe(o[0], o[1], c.window)
			}
			got, ok := m.ratio()
			if ok != c.ok || math.Abs(got-c.want) > 1e-12 {
				t.Errorf("ratio = %v, %v; want %v, %v", got, ok, c.want, c.ok)
			}
		})
	}
}

// The rates come from the times the caller passes: booking to first token
// over the prefill blocks (admitted requests only), first token to finish
// over the output tokens.
func TestPooledRatesObserved(t *testing.T) {
	ms := time.Millisecond
	type req struct {
		worker            WorkerID
		prefill           float64
		admitted          bool
		ttft, decode      time.Duration
		outTokens         int
		noFirst, freeOnly bool
	}
	for _, c := range []struct {
		name           string
		reqs           []req
		spbA, sptA     float64 // worker a's estimates (0: none)
		spbB, sptB     float64 // worker b's (the fleet's when b saw nothing)
		okB, okT       bool    // a's estimates exist
		fleetPrefillOK bool
	}{
		{name: "nothing observed"},
		{name: "one request", reqs: []req{{worker: "a", prefill: 100, admitted: true, ttft: 50 * ms, decode: 2000 * ms, outTokens: 100}},
			spbA: 0.0005, sptA: 0.02, spbB: 0.0005, sptB: 0.02, okB: true, okT: true, fleetPrefillOK: true},
		{name: "a wait for admission is not prefill time", reqs: []req{
			{worker: "a", prefill: 100, admitted: true, ttft: 50 * ms, decode: 1000 * ms, outTokens: 100},
			{worker: "a", prefill: 100, admitted: false, ttft: 5000 * ms, decode: 1000 * ms, outTokens: 100}},
			spbA: 0.0005, sptA: 0.01, spbB: 0.0005, sptB: 0.01, okB: true, okT: true, fleetPrefillOK: true},
		{name: "per worker, ratio of sums", reqs: []req{
			{worker: "a", prefill: 100, admitted: true, ttft: 50 * ms, decode: 1000 * ms, outTokens: 100},
			{worker: "a", prefill: 20, admitted: true, ttft: 70 * ms, decode: 3000 * ms, outTokens: 100},
			{worker: "b", prefill: 100, admitted: true, ttft: 200 * ms, decode: 500 * ms, outTokens: 100}},
			spbA: 0.12 / 120, sptA: 0.02, spbB: 0.002, sptB: 0.005, okB: true, okT: true, fleetPrefillOK: true},
		{name: "freed without a count teaches no decode rate", reqs: []req{
			{worker: "a", prefill: 100, admitted: true, ttft: 50 * ms, decode: 1000 * ms, freeOnly: true}},
			spbA: 0.0005, spbB: 0.0005, okB: true, fleetPrefillOK: true},
		{name: "no first token: no rates", reqs: []req{
			{worker: "a", prefill: 100, admitted: true, decode: 1000 * ms, outTokens: 100, noFirst: true}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			var s pooledWaitState
			for k, q := range c.reqs {
				id := fmt.Sprint(k)
				s.book(id, q.worker, t0, q.prefill, q.admitted)
				if !q.noFirst {
					s.firstToken(id, t0.Add(q.ttft))
				}
				if q.freeOnly {
					s.forget(id)
				} else {
					s.finished(id, q.outTokens, t0.Add(q.ttft+q.decode))
				}
			}
			if len(s.own) != 0 {
				t.Errorf("%d bookings left after every request ended", len(s.own))
			}
			spb, okB := s.secondsPerBlock("a")
			spt, okT := s.secondsPerToken("a")
			if okB != c.okB || okT != c.okT || math.Abs(spb-c.spbA) > 1e-12 || math.Abs(spt-c.sptA) > 1e-12 {
				t.Errorf("a: %v s/block (%v), %v s/token (%v); want %v (%v), %v (%v)", spb, okB, spt, okT, c.spbA, c.okB, c.sptA, c.okT)
			}
			spb, _ = s.secondsPerBlock("b")
			spt, _ = s.secondsPerToken("b")
			if math.Abs(spb-c.spbB) > 1e-12 || math.Abs(spt-c.sptB) > 1e-12 {
				t.Errorf("b: %v s/block, %v s/token; want %v, %v", spb, spt, c.spbB, c.sptB)
			}
			if _, ok := s.fleet.prefill.ratio(); ok != c.fleetPrefillOK {
				t.Errorf("fleet prefill rate known %v, want %v", ok, c.fleetPrefillOK)
			}
		})
	}
}

func TestExpectedWait(t *testing.T) {
	at := func(secs float64) time.Time { return t0.Add(time.Duration(secs * float64(time.Second))) }
	now := at(10)
	for _, c := range []struct {
		name   string
		frees  []pendingFree
		over   float64
		decode float64
		want   float64
	}{
		{name: "fits now", frees: []pendingFree{{id: "x", start: at(9), freed: 50}}, over: 0, decode: 4, want: 0},
		// Started 1 s ago, 4 s of decode: 3 s left.
		{name: "one running", frees: []pendingFree{{id: "x", start: at(9), freed: 50}}, over: 20, decode: 4, want: 3},
		// The earliest end frees enough, whatever the order given.
		{name: "earliest first", frees: []pendingFree{{id: "x", start: at(9), freed: 50}, {id: "y", start: at(7), freed: 50}}, over: 20, decode: 4, want: 1},
		// The earliest frees too little: the wait runs to the second end.
		{name: "two ends needed", frees: []pendingFree{{id: "x", start: at(9), freed: 50}, {id: "y", start: at(7), freed: 10}}, over: 20, decode: 4, want: 3},
		// Past the expected end: expected to end now.
		{name: "overdue", frees: []pendingFree{{id: "x", start: at(2), freed: 50}}, over: 20, decode: 4, want: 0},
		// Not enough even when all end: one more whole decode.
		{name: "not enough", frees: []pendingFree{{id: "x", start: at(9), freed: 5}}, over: 20, decode: 4, want: 7},
		{name: "nothing running", over: 20, decode: 4, want: 4},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := expectedWait(c.frees, c.over, c.decode, now); math.Abs(got-c.want) > 1e-9 {
				t.Errorf("expectedWait = %v, want %v", got, c.want)
			}
		})
	}
}

func TestWaitPrice(t *testing.T) {
	for _, c := range []struct {
		wait, spb, scale, weight, want float64
	}{
		{wait: 0.5, spb: 0.001, scale: 1, weight: 1, want: 500}, // half a second is 500 blocks of prefill
		{wait: 0.5, spb: 0.001, scale: 2, weight: 1, want: 1000},
		{wait: 0.5, spb: 0.001, scale: 1, weight: 0.1, want: 50},
		{wait: 0, spb: 0.001, scale: 1, weight: 1, want: 0},
		{wait: 1, spb: 0, scale: 1, weight: 1, want: 0}, // no rate: no price (the caller falls back)
	} {
		if got := waitPrice(c.wait, c.spb, c.scale, c.weight); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("waitPrice(%v, %v, %v, %v) = %v, want %v", c.wait, c.spb, c.scale, c.weight, got, c.want)
		}
	}
}

// A holder over the admission line keeps the request when its running
// requests free room soon enough that the wait costs less than the miss
// elsewhere (prefill and copy), and loses it otherwise. With the weight 0
// it keeps it only when the request's first token is expected no later
// there than at the fastest worker that starts it now (TTFT parity);
// without rates it is excluded.
func TestPooledWaitPriceDecision(t *testing.T) {
	prompt := tokens(7, 16*12) // 12 blocks
	hashes := SequenceHashes(prompt, 16, "")
	out, zero, one := 152.5, 0.0, 1.0 // reserve 10 blocks
	for _, c := range []struct {
		name   string
		weight *float64
		rates  bool
		spb    float64 // seconds per prefill block observed (0: 1 ms)
		// unobserved: no request has ended yet (the output length is only
		// the configured one).
		unobserved bool
		// waitingElsewhere: a request booked over the line (admission said
		// wait) has no first token yet.
		waitingElsewhere bool
		left             time.Duration // the first running request's expected time left
		want             WorkerID
		busyA            bool
		priceA           float64 // a's wait price (its pooled extra), when priced
		excluded         bool
	}{
		// a: 2 running × 40 blocks + 12 new + 2 × 5 + 10 − 100 = 12 over;
		// the first to end frees 40 + 5. 10 ms at 1 ms a block: 10.
		// a costs 0 prefill + 92 decode + 10; b 12 + 12 + 8·12 copy.
		{name: "ends soon: wait at the holder", weight: &one, rates: true, left: 10 * time.Millisecond, want: "a", priceA: 10},
		{name: "ends late: miss elsewhere", weight: &one, rates: true, left: time.Second, want: "b", priceA: 1000},
		// Weight 0 (the default): no price, TTFT parity, at 5 ms a prefill
		// block. a's first token comes after the 30 ms wait, two 10 ms
		// steps and 0 blocks of prefill (50 ms), b's after 12 blocks (60
		// ms): waiting at a is no slower, so a stays.
		{name: "weight 0, no slower: wait at the holder", weight: &zero, rates: true, spb: 0.005, left: 30 * time.Millisecond, want: "a"},
		// 41 ms of wait (61 ms) is slower than b's 60 ms: a is excluded,
		// whatever the copy it saves is worth (that is WaitWeight's trade).
		{name: "weight 0, slower: excluded", weight: &zero, rates: true, spb: 0.005, left: 41 * time.Millisecond, want: "b", busyA: true},
		{name: "weight 0, no rates yet: excluded", weight: &zero, left: 10 * time.Millisecond, want: "b", busyA: true},
		// One wait at a time: another request this router sent over the
		// line has not started, so the no-slower case is excluded too.
		{name: "weight 0, another request waiting: excluded", weight: &zero, rates: true, spb: 0.005, waitingElsewhere: true,
			left: 30 * time.Millisecond, want: "b", busyA: true},
		{name: "weight 0, no output observed yet: excluded", weight: &zero, rates: true, unobserved: true, spb: 0.005,
			left: 30 * time.Millisecond, want: "b", busyA: true},
		{name: "no rates yet: excluded", weight: &one, left: 10 * time.Millisecond, want: "b", busyA: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			ix := NewIndex(16)
			cfg := pooledConfig()
			cfg.Pooled.OutputTokens = &out
			cfg.Pooled.HomeWeight = &zero
			cfg.Pooled.WaitWeight = c.weight
			r := newTestRouter(t, cfg, ix, WorkerInfo{ID: "a", TotalBlocks: 100}, WorkerInfo{ID: "b", TotalBlocks: 100})
			store(t, ix, "a", prompt)
			decode := 1.525 // 152.5 tokens at 10 ms
			now := t0.Add(10 * time.Second)
			for k, started := range []time.Time{
				now.Add(c.left - time.Duration(decode*float64(time.Second))), now,
			} {
				id := fmt.Sprint("run", k)
				h := SequenceHashes(tokens(100_000+10_000*k, 16*40), 16, "")
				r.Load().Add(Booking{ID: id, Worker: "a", Hashes: h, Added: t0})
				r.Load().PrefillDoneAt(id, started)
			}
			if c.rates {
				r.mu.Lock()
				spb := cmp.Or(c.spb, 0.001)
				r.wait.fleet.prefill.observe(100*spb, 100, pooledRateWindow) // 1 ms a block unless the case says
				r.wait.fleet.decode.observe(1, 100, pooledRateWindow)        // 10 ms a token
				if !c.unobserved {
					// The parity rule times running requests by the observed
					// mean output, not the configured one.
					r.outputs = pooledOutputs{n: 1, mean: out}
				}
				r.mu.Unlock()
			}
			if c.waitingElsewhere {
				r.mu.Lock()
				r.wait.book("queued", "b", now.Add(-time.Second), 10, false)
				r.mu.Unlock()
			}
			d, err := r.Decide(Request{ID: "q", Tokens: len(prompt), Hashes: hashes}, now)
			if err != nil {
				t.Fatal(err)
			}
			a := d.Rows[0]
			if d.Worker != c.want || a.Busy != c.busyA {
				t.Fatalf("chose %s (a busy %v), want %s (%v)\n%s", d.Worker, a.Busy, c.want, c.busyA, d.Explain())
			}
			if c.priceA != 0 && math.Abs(a.Pooled-c.priceA) > 1e-3 {
				t.Errorf("a's pooled extra %.6f, want the wait price %v\n%s", a.Pooled, c.priceA, d.Explain())
			}
		})
	}
}

// waiting counts the bookings sent to wait for KV admission that have not
// started, through every way a booking ends or is replaced.
func TestPooledWaitingCount(t *testing.T) {
	var s pooledWaitState
	recount := func() int {
		n := 0
		for _, b := range s.own {
			if b.waitingForAdmission() {
				n++
			}
		}
		return n
	}
	now := t0
	steps := []struct {
		name string
		do   func()
		want int
	}{
		{"admitted booking", func() { s.book("a", "w", now, 10, true) }, 0},
		{"waiting booking", func() { s.book("b", "w", now, 10, false) }, 1},
		{"second waiting", func() { s.book("c", "w", now, 10, false) }, 2},
		{"rebooked as admitted", func() { s.book("c", "w", now, 10, true) }, 1},
		{"first token of a waiting one", func() { s.firstToken("b", now.Add(time.Second)) }, 0},
		{"its second first token changes nothing", func() { s.firstToken("b", now.Add(2*time.Second)) }, 0},
		{"waiting again", func() { s.book("d", "w", now, 10, false) }, 1},
		{"a first token before the booking is ignored", func() { s.firstToken("d", now.Add(-time.Second)) }, 1},
		{"finished while waiting", func() { s.finished("d", 10, now.Add(time.Second)) }, 0},
		{"waiting, then forgotten", func() { s.book("e", "w", now, 10, false); s.forget("e") }, 0},
		{"finished after its first token", func() { s.finished("b", 10, now.Add(3*time.Second)) }, 0},
		{"unknown ids", func() { s.forget("zz"); s.finished("zz", 1, now); s.firstToken("zz", now) }, 0},
	}
	for _, st := range steps {
		st.do()
		if s.waiting != st.want || recount() != st.want {
			t.Fatalf("after %s: waiting %d, recount %d, want %d", st.name, s.waiting, recount(), st.want)
		}
	}
}
