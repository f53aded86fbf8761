package router

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

// Each capacity-relative setting, with the worker's capacity present and
// missing: present, the setting acts on the loaded worker "a"; missing, it
// does not (capacity.go's rule) and CapacityGaps names exactly that
// setting for "a" and nothing for "b", which registered everything.
func TestCapacityRelativeSettings(t *testing.T) {
	full := WorkerInfo{ID: "b", TotalBlocks: 100, MaxBatchedTokens: 100}
	blocks := func(n int) []uint64 { return SequenceHashes(tokens(50_000, 16*n), 16, "") }
	// rowA is a's row of a decision for a 12-block prompt.
	rowA := func(t *testing.T, r *Router) WorkerCost {
		t.Helper()
		p := tokens(7, 16*12)
		d, err := r.Decide(Request{ID: "q", Tokens: len(p), Hashes: SequenceHashes(p, 16, "")}, t0)
		if err != nil && !errors.Is(err, ErrAllBusy) {
			t.Fatal(err)
		}
		return d.Rows[0]
	}
	queued := func(t *testing.T, r *Router) bool { return r.ShouldQueue() }
	busy := func(t *testing.T, r *Router) bool { return rowA(t, r).Busy }
	admissionBusy := func(t *testing.T, r *Router) bool {
		return strings.Contains(rowA(t, r).Reason(), "KV admission")
	}
	cases := []struct {
		name    string
		cfg     func(c *Config)
		a       WorkerInfo
		others  []WorkerInfo
		load    func(r *Router)
		acts    func(t *testing.T, r *Router) bool
		want    bool
		gapsFor []string // settings CapacityGaps names for a
	}{
		{
			name: "queue threshold, capacity present: 60 of 100 batched tokens is over 0.5",
			cfg:  func(c *Config) { c.QueueThreshold = ptr(0.5) },
			a:    WorkerInfo{ID: "a", MaxBatchedTokens: 100},
			load: func(r *Router) { r.Load().Add(Booking{ID: "1", Worker: "a", PrefillTokens: 60, Added: t0}) },
			acts: queued, want: true,
		},
		{
			name: "queue threshold, capacity present: 40 of 100 is under",
			cfg:  func(c *Config) { c.QueueThreshold = ptr(0.5) },
			a:    WorkerInfo{ID: "a", MaxBatchedTokens: 100},
			load: func(r *Router) { r.Load().Add(Booking{ID: "1", Worker: "a", PrefillTokens: 40, Added: t0}) },
			acts: queued, want: false,
		},
		{
			// The old rule took the capacity as 1 token: one waiting
			// prompt token was over 0.5 and everything queued.
			name: "queue threshold, capacity missing: never over it, reported",
			cfg:  func(c *Config) { c.QueueThreshold = ptr(0.5) },
			a:    WorkerInfo{ID: "a", TotalBlocks: 100},
			load: func(r *Router) { r.Load().Add(Booking{ID: "1", Worker: "a", PrefillTokens: 1, Added: t0}) },
			acts: queued, want: false, gapsFor: []string{SettingQueueThreshold},
		},
		{
			name:   "decode blocks threshold, capacity present: 60 of 100 blocks is over 0.5",
			cfg:    func(c *Config) { c.Thresholds.ActiveDecodeBlocks = ptr(0.5) },
			a:      WorkerInfo{ID: "a", TotalBlocks: 100, MaxBatchedTokens: 100},
			others: []WorkerInfo{full},
			load:   func(r *Router) { r.Load().Add(Booking{ID: "1", Worker: "a", Hashes: blocks(60), Added: t0}) },
			acts:   busy, want: true,
		},
		{
			name:   "decode blocks threshold, capacity missing: never busy by it, reported",
			cfg:    func(c *Config) { c.Thresholds.ActiveDecodeBlocks = ptr(0.5) },
			a:      WorkerInfo{ID: "a", MaxBatchedTokens: 100},
			others: []WorkerInfo{full},
			load:   func(r *Router) { r.Load().Add(Booking{ID: "1", Worker: "a", Hashes: blocks(60), Added: t0}) },
			acts:   busy, want: false, gapsFor: []string{SettingDecodeBlocksFrac},
		},
		{
			name:   "prefill fraction threshold, capacity present: 60 of 100 batched tokens is over 0.5",
			cfg:    func(c *Config) { c.Thresholds.ActivePrefillTokensFrac = ptr(0.5) },
			a:      WorkerInfo{ID: "a", TotalBlocks: 100, MaxBatchedTokens: 100},
			others: []WorkerInfo{full},
			load:   func(r *Router) { r.Load().Add(Booking{ID: "1", Worker: "a", PrefillTokens: 60, Added: t0}) },
			acts:   busy, want: true,
		},
		{
			name:   "prefill fraction threshold, capacity missing: never busy by it, reported",
			cfg:    func(c *Config) { c.Thresholds.ActivePrefillTokensFrac = ptr(0.5) },
			a:      WorkerInfo{ID: "a", TotalBlocks: 100},
			others: []WorkerInfo{full},
			load:   func(r *Router) { r.Load().Add(Booking{ID: "1", Worker: "a", PrefillTokens: 60, Added: t0}) },
			acts:   busy, want: false, gapsFor: []string{SettingPrefillTokensFrac},
		},
		{
			name:   "kv-pooled admission, capacity present: 95 of 100 blocks in flight leaves no room for 12",
			cfg:    func(c *Config) { c.Mode = ModeKVPooled },
			a:      WorkerInfo{ID: "a", TotalBlocks: 100, MaxBatchedTokens: 100},
			others: []WorkerInfo{full, {ID: "c", TotalBlocks: 100, MaxBatchedTokens: 100}},
			load:   func(r *Router) { r.Load().Add(Booking{ID: "1", Worker: "a", Hashes: blocks(95), Added: t0}) },
			acts:   admissionBusy, want: true,
		},
		{
			name:   "kv-pooled admission, capacity missing: no admission rule, reported",
			cfg:    func(c *Config) { c.Mode = ModeKVPooled },
			a:      WorkerInfo{ID: "a", MaxBatchedTokens: 100},
			others: []WorkerInfo{full, {ID: "c", TotalBlocks: 100, MaxBatchedTokens: 100}},
			load:   func(r *Router) { r.Load().Add(Booking{ID: "1", Worker: "a", Hashes: blocks(95), Added: t0}) },
			acts:   admissionBusy, want: false, gapsFor: []string{SettingPooledAdmission},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := DefaultConfig()
			c.cfg(&cfg)
			r := newTestRouter(t, cfg, NewIndex(16), append([]WorkerInfo{c.a}, c.others...)...)
			c.load(r)
			if got := c.acts(t, r); got != c.want {
				t.Errorf("setting acts on a: %v, want %v", got, c.want)
			}
			gaps := r.CapacityGaps()
			var settings []string
			for _, g := range gaps["a"] {
				settings = append(settings, g.Setting)
				if g.Fallback == "" || !strings.Contains(g.String(), g.Missing) {
					t.Errorf("gap %+v: no fallback or the message does not name the capacity", g)
				}
			}
			if !slices.Equal(settings, c.gapsFor) {
				t.Errorf("gaps for a: %v, want %v", settings, c.gapsFor)
			}
			for id, gs := range gaps {
				if id != "a" {
					t.Errorf("worker %s registered every capacity but has gaps %v", id, gs)
				}
			}
		})
	}
}

// A gap is reported only for a setting in use: capacity missing with no
// capacity-relative setting is a status fact (MissingCapacity), not a
// warning; every setting on at once names each one that lost its meaning.
func TestCapacityGapsOnlyForSettingsInUse(t *testing.T) {
	bare := WorkerInfo{ID: "s"}
	if gs := CapacityGaps(DefaultConfig(), bare); len(gs) != 0 {
		t.Errorf("default config, no capacity: gaps %v, want none", gs)
	}
	if got, want := MissingCapacity(bare), []string{CapacityTotalBlocks, CapacityMaxBatchedTokens}; !slices.Equal(got, want) {
		t.Errorf("missing %v, want %v", got, want)
	}
	if got := MissingCapacity(WorkerInfo{ID: "k", TotalBlocks: 1, MaxBatchedTokens: 1}); len(got) != 0 {
		t.Errorf("missing %v for a worker with both capacities", got)
	}
	cfg := DefaultConfig()
	cfg.Mode = ModeKVPooled
	cfg.QueueThreshold = ptr(0.5)
	cfg.Thresholds.ActiveDecodeBlocks = ptr(0.85)
	cfg.Thresholds.ActivePrefillTokensFrac = ptr(1.0)
	cfg.Thresholds.ActivePrefillTokens = ptr(int64(10_000)) // absolute: needs no capacity
	var got []string
	for _, g := range CapacityGaps(cfg, bare) {
		got = append(got, g.Setting+"/"+g.Missing)
	}
	want := []string{
		SettingQueueThreshold + "/" + CapacityMaxBatchedTokens,
		SettingDecodeBlocksFrac + "/" + CapacityTotalBlocks,
		SettingPrefillTokensFrac + "/" + CapacityMaxBatchedTokens,
		SettingPooledAdmission + "/" + CapacityTotalBlocks,
	}
	if !slices.Equal(got, want) {
		t.Errorf("gaps %v, want %v", got, want)
	}
}
