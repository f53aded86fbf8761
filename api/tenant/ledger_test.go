package tenant

import (
	"math"
	"strings"
	"testing"
	"time"
)

// TestAPITenantWindow: with headroom, a tenant over its share while others
// are active gets its share of the admission window; the least served
// tenant, one within the slack, or one alone gets all of it; without
// headroom everyone gets all of it.
func TestAPITenantWindow(t *testing.T) {
	for _, tc := range []struct {
		name     string
		headroom bool
		setup    func(l *Ledger)
		tenant   string
		want     float64
	}{
		{"alone", true, func(l *Ledger) { l.Charge("m", "a", 10_000); l.Begin("m", "a") }, "a", 1},
		{"over its share", true, func(l *Ledger) {
			l.Charge("m", "a", 10_000)
			l.Begin("m", "a")
			l.Begin("m", "b")
		}, "a", 0.5},
		{"under its share", true, func(l *Ledger) {
			l.Charge("m", "a", 10_000)
			l.Begin("m", "a")
			l.Begin("m", "b")
		}, "b", 1},
		{"within the slack", true, func(l *Ledger) {
			l.Charge("m", "a", 10_000)
			l.Charge("m", "b", 9_900)
			l.Begin("m", "a")
			l.Begin("m", "b")
		}, "a", 1},
		{"the other is idle", true, func(l *Ledger) {
			l.Charge("m", "a", 10_000)
			l.Begin("m", "a")
			l.Begin("m", "b")
			l.End("m", "b")
		}, "a", 1},
		{"three active", true, func(l *Ledger) {
			l.Charge("m", "a", 10_000)
			l.Begin("m", "a")
			l.Begin("m", "b")
			l.Remote("r2", []Usage{{Model: "m", Tenant: "c", Tokens: 10, Inflight: 1}})
		}, "a", 1.0 / 3},
		{"headroom off", false, func(l *Ledger) {
			l.Charge("m", "a", 10_000)
			l.Begin("m", "a")
			l.Begin("m", "b")
		}, "a", 1},
	} {
		l, err := New(Config{From: SourceHeader, Slack: 512, Burst: 4096, Headroom: tc.headroom})
		if err != nil {
			t.Fatal(err)
		}
		tc.setup(l)
		if got := l.Window("m", tc.tenant); got != tc.want {
			t.Errorf("%s: window %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestAPITenantHold: a head holds back while another replica reports a
// lower tenant waiting, at most MaxYield from its first hold, then goes
// (expired once).
func TestAPITenantHold(t *testing.T) {
	now := time.Unix(1000, 0)
	l, _ := New(Config{From: SourceHeader, MaxYield: 100 * time.Millisecond, Now: func() time.Time { return now }})
	l.Charge("m", "heavy", 10_000)
	var since time.Time
	if hold, _ := l.Hold("m", "heavy", 0, &since); hold || !since.IsZero() {
		t.Fatal("held with nobody waiting elsewhere")
	}
	l.Remote("r2", []Usage{{Model: "m", Tenant: "light", Tokens: 10, Waiting: 1}})
	if hold, exp := l.Hold("m", "heavy", 0, &since); !hold || exp || !since.Equal(now) {
		t.Fatalf("hold %v expired %v since %v", hold, exp, since)
	}
	now = now.Add(100 * time.Millisecond)
	if hold, _ := l.Hold("m", "heavy", 0, &since); !hold {
		t.Fatal("released before MaxYield")
	}
	now = now.Add(time.Millisecond)
	if hold, exp := l.Hold("m", "heavy", 0, &since); hold || !exp {
		t.Fatalf("past MaxYield: hold %v expired %v", hold, exp)
	}
}

// TestAPITenantEnginePriority: the level a request carries to the worker:
// over its share while another tenant is active (by more than the slack,
// counting the other replicas' reports) is EngineOverShare; alone, under
// its share, within the slack, or beside an idle tenant, EngineAtShare.
// Independent of Headroom.
func TestAPITenantEnginePriority(t *testing.T) {
	for _, tc := range []struct {
		name   string
		setup  func(l *Ledger)
		tenant string
		want   int
	}{
		{"alone", func(l *Ledger) { l.Charge("m", "a", 10_000); l.Begin("m", "a") }, "a", EngineAtShare},
		{"over its share", func(l *Ledger) {
			l.Charge("m", "a", 10_000)
			l.Begin("m", "a")
			l.Begin("m", "b")
		}, "a", EngineOverShare},
		{"under its share", func(l *Ledger) {
			l.Charge("m", "a", 10_000)
			l.Begin("m", "a")
			l.Begin("m", "b")
		}, "b", EngineAtShare},
		{"within the slack", func(l *Ledger) {
			l.Charge("m", "a", 10_000)
			l.Charge("m", "b", 9_900)
			l.Begin("m", "a")
			l.Begin("m", "b")
		}, "a", EngineAtShare},
		{"the other is idle", func(l *Ledger) {
			l.Charge("m", "a", 10_000)
			l.Begin("m", "a")
			l.Begin("m", "b")
			l.End("m", "b")
		}, "a", EngineAtShare},
		{"over a tenant on another replica", func(l *Ledger) {
			l.Charge("m", "a", 10_000)
			l.Remote("r2", []Usage{{Model: "m", Tenant: "c", Tokens: 10, Inflight: 1}})
		}, "a", EngineOverShare},
		{"under through the others' charges", func(l *Ledger) {
			l.Charge("m", "a", 1_000)
			l.Begin("m", "a")
			l.Remote("r2", []Usage{{Model: "m", Tenant: "c", Tokens: 50_000, Inflight: 1}})
		}, "a", EngineAtShare},
	} {
		l, err := New(Config{From: SourceHeader, Slack: 512, Burst: 4096})
		if err != nil {
			t.Fatal(err)
		}
		tc.setup(l)
		if got := l.EnginePriority("m", tc.tenant); got != tc.want {
			t.Errorf("%s: engine priority %d, want %d", tc.name, got, tc.want)
		}
	}
}

// TestAPITenantGuard: the latency guard's factor applies to a tenant over
// its share while another tenant is active, never to one at or under its
// share, one alone, or one within the slack; 0 is off; bad factors are
// refused with an error naming the guard.
func TestAPITenantGuard(t *testing.T) {
	overShare := func(l *Ledger) {
		l.Charge("m", "a", 10_000)
		l.Begin("m", "a")
		l.Begin("m", "b")
	}
	for _, tc := range []struct {
		name   string
		guard  float64
		setup  func(l *Ledger)
		tenant string
		want   float64
	}{
		{"over its share", 1.5, overShare, "a", 1.5},
		{"under its share", 1.5, overShare, "b", 0},
		{"alone", 1.5, func(l *Ledger) { l.Charge("m", "a", 10_000); l.Begin("m", "a") }, "a", 0},
		{"the other is idle", 1.5, func(l *Ledger) {
			overShare(l)
			l.End("m", "b")
		}, "a", 0},
		{"within the slack", 1.5, func(l *Ledger) {
			l.Charge("m", "a", 10_000)
			l.Charge("m", "b", 9_900)
			l.Begin("m", "a")
			l.Begin("m", "b")
		}, "a", 0},
		{"the other active on another replica", 2, func(l *Ledger) {
			l.Charge("m", "a", 10_000)
			l.Begin("m", "a")
			l.Remote("r2", []Usage{{Model: "m", Tenant: "c", Tokens: 10, Waiting: 1}})
		}, "a", 2},
		{"guard off", 0, overShare, "a", 0},
	} {
		l, err := New(Config{From: SourceHeader, Slack: 512, Burst: 4096, LatencyGuard: tc.guard})
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		tc.setup(l)
		if got := l.Guard("m", tc.tenant); got != tc.want {
			t.Errorf("%s: guard %v, want %v", tc.name, got, tc.want)
		}
	}
	for _, bad := range []float64{0.5, -1, math.NaN(), math.Inf(1), math.Inf(-1)} {
		_, err := New(Config{From: SourceHeader, LatencyGuard: bad})
		if err == nil || !strings.Contains(err.Error(), "latency guard") {
			t.Errorf("guard %v: error %v, want one naming the latency guard", bad, err)
		}
	}
}
