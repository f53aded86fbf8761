package sim

import (
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/router"
)

// stored is a stored event of a chain of content-addressed blocks.
func stored(hs ...uint64) router.KVEvent {
	ev := router.KVEvent{Kind: router.EventStored, BlockSize: 16}
	for _, h := range hs {
		ev.Blocks = append(ev.Blocks, router.StoredBlock{EngineHash: h, ContentHash: h})
	}
	return ev
}

func TestSimRankByUniqueHits(t *testing.T) {
	for _, tc := range []struct {
		name string
		held map[router.WorkerID][]uint64
		hits map[uint64]int
		want []router.WorkerID
	}{
		{
			// w0's unique block 2 was hit 10 times, w1's block 3 once,
			// w2's block 4 never; block 1 (w0 and w2) survives either.
			name: "recent hits of unique blocks",
			held: map[router.WorkerID][]uint64{"w0": {1, 2}, "w1": {3}, "w2": {1, 4}},
			hits: map[uint64]int{1: 100, 2: 10, 3: 1},
			want: []router.WorkerID{"w2", "w1", "w0"},
		},
		{
			name: "no hits: fewer unique blocks first, then id",
			held: map[router.WorkerID][]uint64{"w0": {1, 2, 3}, "w1": {4}, "w2": {5}},
			hits: map[uint64]int{},
			want: []router.WorkerID{"w1", "w2", "w0"},
		},
		{
			name: "duplicated blocks cost nothing",
			held: map[router.WorkerID][]uint64{"w0": {1, 2}, "w1": {1, 2}, "w2": {7}},
			hits: map[uint64]int{1: 50, 2: 50, 7: 1},
			want: []router.WorkerID{"w0", "w1", "w2"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ix := router.NewIndex(16)
			var ws []router.WorkerID
			for w := range tc.held {
				ws = append(ws, w)
			}
			slices.Sort(ws)
			for _, w := range ws {
				ix.AddWorker(w)
				if err := ix.Apply(w, stored(tc.held[w]...)); err != nil {
					t.Fatal(err)
				}
			}
			if got := RankByUniqueHits(FleetView{Index: ix, Workers: ws, Hits: tc.hits}); !slices.Equal(got, tc.want) {
				t.Fatalf("ranked %v, want %v", got, tc.want)
			}
		})
	}
}

func fleetWorkload(t *testing.T) *workload.Workload {
	return synthetic(t, workload.SyntheticSpec{
		Prefixes: 6, PrefixTokens: 512, TailTokens: 64, OutputTokens: 32,
		Requests: 400, Concurrency: 8, Seed: 4,
	})
}

// runEvents runs w with one event at 2 s on 4 workers.
func runEvents(t *testing.T, w *workload.Workload, mode router.Mode, ev FleetEvent, ranker RemovalRanker) (*Result, Summary) {
	t.Helper()
	cfg := config(mode, 4, 1024)
	cfg.Events, cfg.Ranker = []FleetEvent{ev}, ranker
	return run(t, w, cfg)
}

// The choosers: the plan takes its ranker's first worker (the interface
// the router's own ranking will plug into), random is a function of the
// seed, least-loaded the worker with the fewest requests.
func TestSimChoosers(t *testing.T) {
	w := fleetWorkload(t)
	at := 2 * time.Second
	last := func(f FleetView) []router.WorkerID { return []router.WorkerID{f.Workers[len(f.Workers)-1]} }
	res, _ := runEvents(t, w, router.ModeKV, FleetEvent{At: at, Kind: EventRemove, Chooser: ChooserPlan}, last)
	if res.Events[0].Worker != 3 {
		t.Fatalf("plan with a ranker naming w3 removed %d", res.Events[0].Worker)
	}
	named, _ := runEvents(t, w, router.ModeKV, FleetEvent{At: at, Kind: EventRemove, Chooser: "id:w2"}, nil)
	if named.Events[0].Worker != 2 {
		t.Fatalf("id:w2 removed %d", named.Events[0].Worker)
	}
	a, _ := runEvents(t, w, router.ModeKV, FleetEvent{At: at, Kind: EventRemove, Chooser: ChooserRandom}, nil)
	b, _ := runEvents(t, w, router.ModeKV, FleetEvent{At: at, Kind: EventRemove, Chooser: ChooserRandom}, nil)
	if a.Events[0].Worker != b.Events[0].Worker || a.Events[0].Worker < 0 {
		t.Fatalf("random chose %d then %d with one seed", a.Events[0].Worker, b.Events[0].Worker)
	}
	// Round-robin with one request on w0 alone at the event: the others
	// are idle, least-loaded takes w1 (the lowest idle one).
	one := synthetic(t, workload.SyntheticSpec{Prefixes: 1, PrefixTokens: 64, TailTokens: 16, OutputTokens: 2000, Requests: 1, Concurrency: 1, Seed: 1})
	cfg := config(router.ModeRoundRobin, 3, 1024)
	cfg.Events = []FleetEvent{{At: time.Millisecond, Kind: EventRemove, Chooser: ChooserLeastLoaded}}
	r, _ := run(t, one, cfg)
	if r.Requests[0].Worker != 0 || r.Events[0].Worker != 1 {
		t.Fatalf("request on %d, least-loaded removed %d", r.Requests[0].Worker, r.Events[0].Worker)
	}
}

// Removal re-sends what ran there; drain lets it finish and leaves idle;
// an added worker takes requests only after it joined.
func TestSimFleetEvents(t *testing.T) {
	w := fleetWorkload(t)
	at := 2 * time.Second
	for _, tc := range []struct {
		kind EventKind
	}{{EventRemove}, {EventDrain}, {EventAdd}} {
		t.Run(string(tc.kind), func(t *testing.T) {
			ev := FleetEvent{At: at, Kind: tc.kind, Chooser: ChooserRandom}
			res, sum := runEvents(t, w, router.ModeKV, ev, nil)
			if sum.Errors != 0 {
				t.Fatalf("%d errors", sum.Errors)
			}
			rec := res.Events[0]
			wi := rec.Worker
			if wi < 0 {
				t.Fatal("no worker taken")
			}
			after, before, runAfter := 0, 0, 0
			for _, rr := range res.Requests {
				if rr.Worker != wi {
					continue
				}
				if rr.Sent >= at {
					after++
				} else {
					before++
				}
				if rr.Finished > at {
					runAfter++
				}
			}
			switch tc.kind {
			case EventRemove:
				// Requests sent before the event and re-sent keep their
				// send time but run elsewhere.
				if rec.Resent == 0 || after != 0 || runAfter != 0 {
					t.Fatalf("resent %d; on the removed worker: %d sent after, %d finished after", rec.Resent, after, runAfter)
				}
			case EventDrain:
				if rec.Resent != 0 || after != 0 || before == 0 || rec.Left < at {
					t.Fatalf("resent %d, %d after, %d before, left at %v", rec.Resent, after, before, rec.Left)
				}
				for _, rr := range res.Requests {
					if rr.Worker == wi && rr.Finished > rec.Left {
						t.Fatalf("a request finished on the drained worker at %v, after it left at %v", rr.Finished, rec.Left)
					}
				}
			case EventAdd:
				if wi != 4 || len(res.Workers) != 5 || after == 0 || before != 0 {
					t.Fatalf("added %d of %d ids; %d requests after, %d before", wi, len(res.Workers), after, before)
				}
			}
		})
	}
}

func TestSimFleetConfigErrors(t *testing.T) {
	w := fleetWorkload(t)
	for _, evs := range [][]FleetEvent{
		{{At: -time.Second, Kind: EventAdd}},
		{{At: 2 * time.Second, Kind: EventAdd}, {At: time.Second, Kind: EventAdd}},
		{{At: time.Second, Kind: EventRemove, Chooser: "cheapest"}},
		{{At: time.Second, Kind: "resize"}},
	} {
		cfg := config(router.ModeKV, 2, 512)
		cfg.Events = evs
		if _, err := Run(w, cfg); err == nil {
			t.Errorf("%+v: accepted", evs)
		}
	}
}

// The dip, on a hand-made run: a window before the event at 20 s, a dip
// of two windows, recovery; losses paired with the run without the event.
func TestSimMeasureDip(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{Prefixes: 1, PrefixTokens: 96, TailTokens: 4, OutputTokens: 2, Requests: 8, Concurrency: 1, Seed: 1})
	// Prompts of 100 tokens; one request per 10 s window from 10 s.
	type req struct {
		sent, ttft time.Duration
		cached     int
		worker     int
	}
	mk := func(rs []req) *Result {
		res := &Result{Workers: []router.WorkerID{"w0", "w1", "w2"}}
		for _, r := range rs {
			res.Requests = append(res.Requests, RequestResult{Worker: r.worker, Sent: r.sent, FirstToken: r.sent + r.ttft,
				Finished: r.sent + r.ttft + time.Millisecond, CachedTokens: r.cached, Done: true})
		}
		return res
	}
	s := func(x int) time.Duration { return time.Duration(x) * time.Second }
	ms := time.Millisecond
	base := mk([]req{{s(10), 10 * ms, 80, 0}, {s(15), 10 * ms, 80, 0}, {s(20), 10 * ms, 80, 0}, {s(30), 10 * ms, 80, 0},
		{s(40), 10 * ms, 80, 0}, {s(50), 10 * ms, 80, 0}, {s(60), 10 * ms, 80, 0}, {s(70), 10 * ms, 80, 0}})
	got := mk([]req{{s(10), 10 * ms, 80, 0}, {s(15), 10 * ms, 80, 0}, {s(20), 50 * ms, 0, 2}, {s(30), 30 * ms, 40, 2},
		{s(40), 10 * ms, 79, 2}, {s(50), 10 * ms, 80, 0}, {s(60), 10 * ms, 80, 2}, {s(70), 10 * ms, 80, 0}})
	o := DipOptions{Window: s(10), Horizon: s(40), Tolerance: 0.02, TTFTFactor: 1.2, Timeout: time.Minute}
	for _, tc := range []struct {
		name string
		ev   EventRecord
		want func(f EventFigures) bool
	}{
		{"remove", EventRecord{FleetEvent: FleetEvent{At: s(20), Kind: EventRemove, Chooser: ChooserPlan}, Worker: 1, Resent: 3, Sessions: nil}, func(f EventFigures) bool {
			return f.Worker == "w1" && f.Steady.Requests == 2 && f.Steady.CachedTokenRatio == 0.8 &&
				f.MinCachedTokenRatio == 0 && f.MaxTTFTP99Ms == 50 &&
				// windows 20-30 and 30-40 are out: back at 40 s, 20 s after.
				f.RecoveredS.Valid && f.RecoveredS.Value == 20 && f.TTFTRecoveredS.Valid && f.TTFTRecoveredS.Value == 20 &&
				// lost within [20 s, 60 s): 80 + 40 + 1 + 0 tokens of 320.
				f.LostCachedTokens == 121 && f.BaselineCachedTokens == 320 && f.Resent == 3 && !f.WarmS.Valid
		}},
		{"add", EventRecord{FleetEvent: FleetEvent{At: s(20), Kind: EventAdd}, Worker: 2}, func(f EventFigures) bool {
			// w2's ratio: 0 (window 20), 0.4 (30), 0.79 (40: within 0.02 of the steady 0.8).
			return f.WarmS.Valid && f.WarmS.Value == 30 && f.NewWorkerShare.Valid && f.NewWorkerShare.Value == 0.75 && f.Chooser == ""
		}},
		{"not recovered", EventRecord{FleetEvent: FleetEvent{At: s(20), Kind: EventDrain, Chooser: ChooserRandom}, Worker: 1, Left: s(25)}, func(f EventFigures) bool {
			f2 := f
			return f2.LeftS.Valid && f2.LeftS.Value == 5 && f2.RecoveredS.Valid
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := measureEvent(w, got, base, tc.ev, o)
			if !tc.want(f) {
				t.Fatalf("%+v", f)
			}
		})
	}
	// A request sent at 15 s and re-sent at 20 s counts after the event:
	// its TTFT from its first send, its lost cache too; the steady state
	// is the run without the event's.
	resent := mk([]req{{s(10), 10 * ms, 80, 0}, {s(15), 5010 * ms, 0, 0}, {s(20), 10 * ms, 80, 0}})
	resent.Requests[1].ResentAt = s(20)
	f := measureEvent(w, resent, mk([]req{{s(10), 10 * ms, 80, 0}, {s(15), 10 * ms, 80, 0}, {s(20), 10 * ms, 80, 0}}),
		EventRecord{FleetEvent: FleetEvent{At: s(20), Kind: EventRemove}, Worker: 1}, o)
	if f.Steady.Requests != 2 || f.Steady.TTFT.P99 != 10 || f.After.Requests != 2 || f.LostCachedTokens != 80 || f.MaxTTFTP99Ms < 4900 {
		t.Fatalf("with a re-sent request: %+v", f)
	}
	// A horizon ending inside the dip: not recovered.
	o.Horizon = s(20)
	if f := measureEvent(w, got, base, EventRecord{FleetEvent: FleetEvent{At: s(20), Kind: EventRemove}, Worker: 1}, o); f.RecoveredS.Valid {
		t.Fatalf("recovered within a horizon that ends in the dip: %+v", f.RecoveredS)
	}
}

// A drained worker's sessions keep their cache: their later turns move to
// the worker holding most of their prefix, not to a random one.
func TestSimDrainRebindsSessions(t *testing.T) {
	w := synthetic(t, workload.SyntheticSpec{
		Prefixes: 4, PrefixTokens: 512, TailTokens: 64, OutputTokens: 32, Requests: 480, Concurrency: 12, Seed: 9,
		Agent: workload.AgentSpec{Turns: 8, Think: 100 * time.Millisecond},
	})
	cfg := config(router.ModeRoundRobin, 4, 2048)
	cfg.Affinity = Affinity{Mode: AffinityHard}
	base, _ := run(t, w, cfg)
	cfg.Events = []FleetEvent{{At: 2 * time.Second, Kind: EventDrain, Chooser: ChooserRandom}}
	res, _ := run(t, w, cfg)
	o := DipOptions{Window: time.Second, Horizon: time.Minute, Tolerance: 0.02, TTFTFactor: 1.2, Timeout: time.Minute}
	f := MeasureEvents(w, res, base, o)
	if len(res.Events[0].Sessions) == 0 || !f[0].SessionsKept.Valid || f[0].SessionsKept.Value < 0.5 {
		t.Fatalf("sessions %v kept %+v", res.Events[0].Sessions, f[0].SessionsKept)
	}
	// Keeping the sessions there until they end keeps all their cache;
	// nothing else is sent there after the drain; it leaves later.
	cfg.Events[0].Kind = EventDrainSessions
	keep, sum := run(t, w, cfg)
	fk := MeasureEvents(w, keep, base, o)
	rec := keep.Events[0]
	if sum.Errors != 0 || rec.Worker != res.Events[0].Worker || rec.Left < 0 || rec.Left <= res.Events[0].Left ||
		!fk[0].SessionsKept.Valid || fk[0].SessionsKept.Value < 0.99 {
		t.Fatalf("drain-sessions: %d errors, worker %d, left %v (drain: %v), kept %+v", sum.Errors, rec.Worker, rec.Left, res.Events[0].Left, fk[0].SessionsKept)
	}
	bound := map[int]bool{}
	for _, sess := range rec.Sessions {
		bound[sess] = true
	}
	for i, rr := range keep.Requests {
		if rr.Worker == rec.Worker && rr.Sent >= rec.At && !bound[w.Requests[i].Session] {
			t.Fatalf("request %d of session %d (not bound there) sent to the draining worker", i, w.Requests[i].Session)
		}
	}
}
