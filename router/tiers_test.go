package router

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"
)

// tierStore is a stored event of blocks named by their content hashes in
// tier t.
func tierStore(t Tier, hashes ...uint64) KVEvent {
	ev := KVEvent{Kind: EventStored, Tier: t}
	for _, h := range hashes {
		ev.Blocks = append(ev.Blocks, StoredBlock{EngineHash: h, ContentHash: h})
	}
	return ev
}

func TestTierOfMedium(t *testing.T) {
	cases := []struct {
		medium string
		want   Tier
		ok     bool
	}{
		{"", TierDevice, true}, {"GPU", TierDevice, true}, {"gpu", TierDevice, true},
		{"CPU", TierHost, true}, {"CPU_PINNED", TierHost, true}, {"CPU_TIER1", TierHost, true},
		{"DISK", TierDisk, true}, {"CPU_TIER2", TierDisk, true}, {"NVME", TierDisk, true}, {"STORAGE", TierDisk, true},
		{"EXTERNAL", TierExternal, true}, {"REMOTE", TierExternal, true},
		{"TAPE", 0, false}, {"GPU ", 0, false},
	}
	for _, c := range cases {
		got, ok := TierOfMedium(c.medium)
		if got != c.want || ok != c.ok {
			t.Errorf("TierOfMedium(%q) = %v, %v; want %v, %v", c.medium, got, ok, c.want, c.ok)
		}
	}
}

// The continuation walk by hand, prompt blocks 1…8:
//
//	a: device 1 2, host 3 4, disk 5         → device 2, host 2, disk 1
//	b: device 1, host 3 4 (not 2: no continuation), disk 2 3 → host 0; disk continues at 1: 2 3 → disk 2
//	c: nothing on device, host 1 2 3, disk 4 → enters host at 0: host 3, disk 1
//	d: nothing on device or host, disk 1 2 → enters disk at 0: disk 2
//	e: host 5 6 only (not the first block, no device prefix) → nothing
//	f: device 1 2 3, host 1 2 (behind its device prefix) → nothing past it
func TestIndexFindTieredMatches(t *testing.T) {
	ix := NewIndex(16)
	for _, w := range []WorkerID{"a", "b", "c", "d", "e", "f"} {
		ix.AddWorker(w)
	}
	apply := []struct {
		w  WorkerID
		ev KVEvent
	}{
		{"a", tierStore(TierDevice, 1, 2)}, {"a", tierStore(TierHost, 3, 4)}, {"a", tierStore(TierDisk, 5)},
		{"b", tierStore(TierDevice, 1)}, {"b", tierStore(TierHost, 3, 4)}, {"b", tierStore(TierDisk, 2, 3)},
		{"c", tierStore(TierHost, 1, 2, 3)}, {"c", tierStore(TierExternal, 4)},
		{"d", tierStore(TierDisk, 1, 2)},
		{"e", tierStore(TierHost, 5, 6)},
		{"f", tierStore(TierDevice, 1, 2, 3)}, {"f", tierStore(TierHost, 1, 2)},
	}
	for _, a := range apply {
		if err := ix.Apply(a.w, a.ev); err != nil {
			t.Fatalf("%s %v: %v", a.w, a.ev.Tier, err)
		}
	}
	seq := []uint64{1, 2, 3, 4, 5, 6, 7, 8}
	device := ix.FindMatches(seq, nil)
	got := ix.FindTieredMatches(seq, device, nil)
	slices.SortFunc(got, func(x, y TierOverlap) int { return strings.Compare(string(x.Worker), string(y.Worker)) })
	want := []TierOverlap{{"a", 2, 1}, {"b", 0, 2}, {"c", 3, 1}, {"d", 0, 2}}
	if !slices.Equal(got, want) {
		t.Fatalf("tiered matches %v, want %v", got, want)
	}
	// The device tier is untouched by lower-tier blocks.
	if ix.Held("c") != 0 || ix.TierHeld("c", TierHost) != 3 || ix.Len() != 3 {
		t.Fatalf("device held c %d, host held c %d, device len %d", ix.Held("c"), ix.TierHeld("c", TierHost), ix.Len())
	}

	// A cleared event of a tier clears that tier only; removing a worker
	// removes all its tiers.
	if err := ix.Apply("a", KVEvent{Kind: EventCleared, Tier: TierHost}); err != nil {
		t.Fatal(err)
	}
	if ix.Held("a") != 2 || ix.TierHeld("a", TierHost) != 0 || ix.TierHeld("a", TierDisk) != 1 {
		t.Fatalf("after host clear: device %d host %d disk %d", ix.Held("a"), ix.TierHeld("a", TierHost), ix.TierHeld("a", TierDisk))
	}
	ix.RemoveWorker("c")
	if ix.TierHeld("c", TierHost) != 0 || ix.LowerTier(TierExternal).HasWorker("c") {
		t.Fatal("removed worker still in a lower tier")
	}
}

func TestIndexLowerTierRules(t *testing.T) {
	ix := NewIndex(16)
	ix.AddWorker("a")
	// No parent check in a lower tier: the parent sits on the GPU.
	ev := tierStore(TierHost, 9)
	ev.HasParent, ev.Parent = true, 12345
	if err := ix.Apply("a", ev); err != nil {
		t.Fatalf("host store with a parent elsewhere: %v", err)
	}
	// The block size is checked.
	ev = tierStore(TierHost, 10)
	ev.BlockSize = 32
	if err := ix.Apply("a", ev); !errors.Is(err, ErrBlockSizeMismatch) {
		t.Fatalf("block size: %v", err)
	}
	// The cap applies per tier.
	if err := ix.ApplyCapped("a", tierStore(TierDisk, 1, 2, 3), 2); !errors.Is(err, ErrOverCapacity) {
		t.Fatalf("cap: %v", err)
	}
	if err := ix.Apply("a", tierStore(Tier(NumTiers), 1)); !errors.Is(err, ErrInvalidEvent) {
		t.Fatalf("unknown tier: %v", err)
	}
	if err := ix.Apply("nobody", tierStore(TierHost, 1)); !errors.Is(err, ErrUnknownWorker) {
		t.Fatalf("unknown worker: %v", err)
	}
}

// Dynamo's credit with lower tiers, by hand (block size 16, credit 1):
//
//	prefill = (active + isl)/16 − (credit·decay·device + H·host + D·disk), ≥ 0
func TestCostTierCredit(t *testing.T) {
	cases := []struct {
		name string
		h, d float64
		in   costInput
		want costTerms
	}{
		{name: "defaults: 2 device, 4 host, 2 disk of 8",
			h: 0.75, d: 0.25, in: costInput{isl: 128, overlap: 2, host: 4, disk: 2},
			// 8 − (2 + 3 + 0.5) = 2.5
			want: costTerms{prefill: 2.5, decay: 1, tierCredit: 3.5, cost: 2.5}},
		{name: "weights 0: today's cost",
			h: 0, d: 0, in: costInput{isl: 128, overlap: 2, host: 4, disk: 2},
			want: costTerms{prefill: 6, decay: 1, cost: 6}},
		{name: "host only, no device prefix",
			h: 0.5, d: 0.25, in: costInput{isl: 64, host: 4},
			// 4 − 2 = 2
			want: costTerms{prefill: 2, decay: 1, tierCredit: 2, cost: 2}},
		{name: "floored at zero",
			h: 1, d: 1, in: costInput{isl: 32, overlap: 2, host: 3},
			want: costTerms{prefill: 0, decay: 1, tierCredit: 3, cost: 0}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.HostCacheHitWeight, cfg.DiskCacheHitWeight = c.h, c.d
			if err := cfg.Validate(); err != nil {
				t.Fatal(err)
			}
			got := computeTerms(&cfg, c.in)
			if !close(got.prefill, c.want.prefill) || !close(got.tierCredit, c.want.tierCredit) || !close(got.cost, c.want.cost) || !close(got.decay, c.want.decay) {
				t.Fatalf("got %+v, want %+v", got, c.want)
			}
		})
	}
}

// A decision the host tier changes. 8-block prompt, both workers idle:
// A holds nothing, B holds the prompt's first 6 blocks in its host tier
// (evicted from its GPU) and nothing on the device.
//
//	A: 8 prefill + 8 new blocks                         = 16
//	B, host 0.75: 8 − 4.5 = 3.5 prefill + 8             = 11.5 → B
//	B, weights 0: 8 + 8                                 = 16, a tie
func TestRouterHostTierDecision(t *testing.T) {
	seq := []uint64{1, 2, 3, 4, 5, 6, 7, 8}
	for _, c := range []struct {
		name   string
		weight float64
		want   WorkerID
		cost   float64
	}{
		{"host weight 0.75", 0.75, "B", 11.5},
		{"host weight 0", 0, "", 16},
	} {
		t.Run(c.name, func(t *testing.T) {
			ix := NewIndex(16)
			ix.AddWorker("A")
			ix.AddWorker("B")
			if err := ix.Apply("B", tierStore(TierHost, seq[:6]...)); err != nil {
				t.Fatal(err)
			}
			cfg := DefaultConfig()
			cfg.HostCacheHitWeight = c.weight
			if c.weight == 0 {
				cfg.DiskCacheHitWeight = 0
			}
			r, err := New(cfg, ix, 1)
			if err != nil {
				t.Fatal(err)
			}
			r.SetWorkers([]WorkerInfo{{ID: "A"}, {ID: "B"}})
			d, err := r.Decide(Request{ID: "q", Hashes: seq, Tokens: 128}, time.Unix(0, 0))
			if err != nil {
				t.Fatal(err)
			}
			b := d.Rows[1]
			if b.Worker != "B" || !close(b.Cost, c.cost) || !close(d.Rows[0].Cost, 16) {
				t.Fatalf("rows %+v", d.Rows)
			}
			if c.want != "" && d.Worker != c.want {
				t.Fatalf("chose %s, want %s", d.Worker, c.want)
			}
			wantHost := 6
			if c.weight == 0 {
				wantHost = 0 // not read without a weight for any tier
			}
			if b.HostOverlap != wantHost || b.Overlap != 0 {
				t.Fatalf("B overlap %d host %d", b.Overlap, b.HostOverlap)
			}
			if wantHost > 0 && !strings.Contains(b.Formula(1), "(host 6, disk 0 blocks: credit 4.500)") {
				t.Fatalf("formula %q", b.Formula(1))
			}
		})
	}
}
