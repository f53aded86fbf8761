package fsm

import (
	"errors"
	"math"
	"testing"
)

// t0 is a realistic leader clock (unix nanos, July 2025).
const t0 int64 = 1_752_000_000_000_000_000

const sec = nanosPerSecond

func leasedWorker(id string, until int64) RegisterWorker {
	c := worker(id, 1)
	c.LeaseUntil = until
	return c
}

// TestFSMClockTimeTravelTick replays the probe of issue 16: a Tick with
// Now = MaxInt64 used to expire every leased worker and leave the clock in
// the future, so every later tick expired every leased worker again.
func TestFSMClockTimeTravelTick(t *testing.T) {
	h := newHarness(t)
	// Two workers leased as cmd/kvrouter leases them (120 s, renewed every
	// 30 s): a is alive (renewed at t0+70 s), b died at t0-20 s. One static
	// worker, one prediction.
	h.ok(leasedWorker("a", t0+190*sec))
	h.ok(leasedWorker("b", t0+100*sec))
	h.ok(worker("static", 1))
	h.ok(Predictions{Worker: "a", Hashes: []uint64{1}, Until: t0 + 170*sec})
	h.ok(Tick{Now: t0 + 99*sec}) // the leader's first tick: sets the clock
	if got := h.f.LastTick(); got != t0+99*sec {
		t.Fatalf("clock %d after the first tick", got)
	}

	r := h.ok(Tick{Now: math.MaxInt64})
	if !r.Clamped || r.Expired != 1 || h.f.LastTick() != t0+99*sec+MaxClockStep {
		t.Fatalf("forged tick: clamped %v expired %d clock %d", r.Clamped, r.Expired, h.f.LastTick())
	}
	// b's lease was due within the step: it expired, as it would have on
	// the leader's next honest tick. The live worker and the prediction
	// survive.
	if _, ok := h.f.Worker("a"); !ok {
		t.Fatal("live worker a expired by a forged tick")
	}
	if _, ok := h.f.Worker("b"); ok {
		t.Fatal("worker b's lease was within one step and should have expired")
	}
	if h.f.PredictionCount() != 1 {
		t.Fatal("prediction expired by a forged tick")
	}

	// Later ticks behave: an honest tick behind the pushed clock changes
	// nothing, a renewal keeps a alive, expiry resumes at honest times.
	if r := h.ok(Tick{Now: t0 + 100*sec}); r.Expired != 0 || h.f.LastTick() != t0+159*sec {
		t.Fatalf("honest tick after the forged one: expired %d clock %d", r.Expired, h.f.LastTick())
	}
	h.ok(leasedWorker("a", t0+220*sec)) // renewed at t0+100 s
	if r := h.ok(Tick{Now: t0 + 179*sec}); r.Clamped || r.Expired != 1 || h.f.LastTick() != t0+179*sec {
		// The prediction (t0+170 s) expires; a (t0+220 s) lives.
		t.Fatalf("tick t0+179s: clamped %v expired %d clock %d", r.Clamped, r.Expired, h.f.LastTick())
	}
	if _, ok := h.f.Worker("a"); !ok {
		t.Fatal("renewed worker expired")
	}
	h.ok(Predictions{Worker: "static", Hashes: []uint64{9}, Until: t0 + 300*sec})
	if h.f.PredictionCount() != 1 {
		t.Fatal("a prediction after the forged tick was not stored: the clock stayed in the future")
	}
	if r := h.ok(Tick{Now: t0 + 221*sec}); r.Expired != 1 || len(h.f.Workers()) != 1 {
		t.Fatalf("lease did not expire at its time: expired %d workers %v", r.Expired, h.f.Workers())
	}
}

// TestFSMClockFirstTick: before any Tick the FSM has no clock to judge a
// Tick by, so the first one establishes it without expiring anything; on
// an empty state it changes nothing (a forged first tick cannot poison a
// new cluster's clock).
func TestFSMClockFirstTick(t *testing.T) {
	h := newHarness(t)
	if r := h.ok(Tick{Now: math.MaxInt64}); !r.Clamped || h.f.LastTick() != 0 {
		t.Fatalf("tick on an empty state: clamped %v clock %d", r.Clamped, h.f.LastTick())
	}
	h.ok(leasedWorker("a", t0+120*sec))
	h.ok(leasedWorker("b", t0+90*sec))
	if r := h.ok(Tick{Now: math.MaxInt64}); !r.Clamped || r.Expired != 0 || h.f.LastTick() != t0+90*sec-1 {
		t.Fatalf("forged first tick: clamped %v expired %d clock %d", r.Clamped, r.Expired, h.f.LastTick())
	}
	if len(h.f.Workers()) != 2 {
		t.Fatal("a forged first tick expired workers")
	}
	// The honest tick a second later expires b, as it is due.
	if r := h.ok(Tick{Now: t0 + 91*sec}); r.Clamped || r.Expired != 1 {
		t.Fatalf("honest tick: clamped %v expired %d", r.Clamped, r.Expired)
	}
	if st := h.f.Stats(); st.ClampedTimes != 2 {
		t.Fatalf("clamped counted %d times", st.ClampedTimes)
	}
}

// TestFSMClockCatchUp: the leader ticks only when something is due, so
// after a quiet hour its honest tick is far past the FSM's clock. The
// clock goes straight to just before what is due, so a dead worker
// expires one tick late, not an hour of one-minute steps late; a live
// worker's lease is untouched.
func TestFSMClockCatchUp(t *testing.T) {
	h := newHarness(t)
	h.ok(leasedWorker("w", t0+60*sec))
	h.ok(Tick{Now: t0})
	h.ok(DeregisterWorker{ID: "w"}) // a quiet hour: nothing pending, no ticks
	later := t0 + 3600*sec
	h.ok(leasedWorker("dead", later-1*sec)) // registered at later-121 s, never renewed
	h.ok(leasedWorker("live", later+100*sec))
	if rec, _ := h.f.Worker("live"); rec.LeaseUntil != later+100*sec {
		t.Fatalf("live lease clamped to %d", rec.LeaseUntil)
	}
	r1 := h.ok(Tick{Now: later})
	r2 := h.ok(Tick{Now: later + 1*sec})
	if r1.Expired+r2.Expired != 1 || h.f.LastTick() != later+1*sec {
		t.Fatalf("expired %d+%d clock %d", r1.Expired, r2.Expired, h.f.LastTick())
	}
	if ws := h.f.Workers(); len(ws) != 1 || ws[0].ID != "live" {
		t.Fatalf("workers %v", ws)
	}
}

// TestFSMClockClampsFutureTimes: leases and predictions far past the
// reference time are clamped to MaxTimeAhead, so they expire in bounded
// time.
func TestFSMClockClampsFutureTimes(t *testing.T) {
	h := newHarness(t)
	h.ok(leasedWorker("w", t0+120*sec))
	h.ok(Tick{Now: t0})
	ref := t0 + 120*sec // the earliest expiry, later than the clock
	r := h.ok(leasedWorker("w", math.MaxInt64-1))
	if rec, _ := h.f.Worker("w"); !r.Clamped || rec.LeaseUntil != ref+MaxTimeAhead {
		t.Fatalf("lease clamped %v to %d", r.Clamped, rec.LeaseUntil)
	}
	if r := h.ok(Predictions{Worker: "w", Hashes: []uint64{1}, Until: math.MaxInt64}); !r.Clamped || r.Applied != 1 {
		t.Fatalf("prediction: %+v", r)
	}
	if r := h.ok(leasedWorker("w", t0+120*sec)); r.Clamped {
		t.Fatal("an ordinary lease was clamped")
	}
	for i := 0; h.f.PredictionCount() != 0 || len(h.f.Workers()) != 0; i++ {
		if i > 10 {
			t.Fatalf("clamped times did not expire: clock %d", h.f.LastTick())
		}
		h.ok(Tick{Now: ref + 2*MaxTimeAhead})
	}
}

// TestFSMClockDeterministic: the clamps use only times in the log, so a
// replica restored from a snapshot mid-way clamps exactly like one that
// applied everything.
func TestFSMClockDeterministic(t *testing.T) {
	cmds := []Command{
		leasedWorker("a", t0+120*sec), leasedWorker("b", t0+90*sec),
		Predictions{Worker: "a", Hashes: []uint64{1, 2}, Until: t0 + 50*sec},
		Predictions{Worker: "a", Hashes: []uint64{1}, Until: t0 + 70*sec}, // leaves a stale heap entry at t0+50 s for hash 1
		Tick{Now: math.MaxInt64},
		leasedWorker("c", math.MaxInt64),
		Tick{Now: math.MaxInt64}, Tick{Now: math.MaxInt64},
		Predictions{Worker: "c", Hashes: []uint64{3}, Until: math.MaxInt64},
		Tick{Now: t0 + 500*sec},
	}
	for cut := range cmds {
		a := newHarness(t)
		for _, c := range cmds[:cut] {
			a.ok(c)
		}
		b := &harness{t: t, f: newFSM(t), idx: a.idx}
		if err := restoreBytes(b.f, snapshotBytes(t, a.f)); err != nil {
			t.Fatal(err)
		}
		for _, c := range cmds[cut:] {
			ra, rb := a.ok(c), b.ok(c)
			if ra.Clamped != rb.Clamped || ra.Expired != rb.Expired {
				t.Fatalf("cut %d, %+v: results differ: %+v vs %+v", cut, c, ra, rb)
			}
		}
		if a.f.Digest() != b.f.Digest() || a.f.LastTick() != b.f.LastTick() {
			t.Fatalf("cut %d: digests differ", cut)
		}
	}
}

func TestFSMCheckTime(t *testing.T) {
	now := t0
	for _, c := range []struct {
		name string
		cmd  Command
		ok   bool
	}{
		{"tick now", Tick{Now: now}, true},
		{"tick slightly ahead", Tick{Now: now + 5*sec}, true},
		{"tick slightly behind", Tick{Now: now - 5*sec}, true},
		{"tick MaxInt64", Tick{Now: math.MaxInt64}, false},
		{"tick MinInt64", Tick{Now: math.MinInt64}, false},
		{"tick two minutes ahead", Tick{Now: now + 120*sec}, false},
		{"tick two minutes behind", Tick{Now: now - 120*sec}, false},
		{"lease ordinary", leasedWorker("w", now+120*sec), true},
		{"no lease", worker("w", 1), true},
		{"lease two days ahead", leasedWorker("w", now+2*86400*sec), false},
		{"lease in the past", leasedWorker("w", now-3600*sec), false},
		{"prediction ordinary", Predictions{Worker: "w", Hashes: []uint64{1}, Until: now + 120*sec}, true},
		{"prediction forever", Predictions{Worker: "w", Hashes: []uint64{1}, Until: math.MaxInt64}, false},
		{"no time", DeregisterWorker{ID: "w"}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := CheckTime(c.cmd, now)
			if (err == nil) != c.ok || (err != nil && !errors.Is(err, ErrInvalidCommand)) {
				t.Fatalf("CheckTime: %v", err)
			}
			if err2 := CheckEntryTime(mustEncode(t, c.cmd), now); (err2 == nil) != c.ok {
				t.Fatalf("CheckEntryTime: %v, CheckTime: %v", err2, err)
			}
		})
	}
	if err := CheckEntryTime([]byte{byte(CmdTick), EnvelopeVersion, 0xff}, now); !errors.Is(err, ErrUndecodable) {
		t.Fatalf("undecodable tick: %v", err)
	}
	if err := CheckEntryTime([]byte{0x7f, 1, 2}, now); err != nil {
		t.Fatalf("unknown type: %v", err)
	}
}
