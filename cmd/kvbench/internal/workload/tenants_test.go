package workload

import (
	"errors"
	"slices"
	"testing"
)

// TestWorkloadTenantRequests: the requests split by weight, largest
// remainder, summing to the total.
func TestWorkloadTenantRequests(t *testing.T) {
	cases := []struct {
		n       int
		weights []float64
		want    []int
	}{
		{6600, []float64{10, 1}, []int{6000, 600}},
		{6000, []float64{10, 1}, []int{5455, 545}},
		{600, []float64{1}, []int{600}},
		{10, []float64{1, 1, 1}, []int{4, 3, 3}},
		{1, []float64{1, 3}, []int{0, 1}},
	}
	for _, c := range cases {
		var ts []TenantStream
		for _, w := range c.weights {
			ts = append(ts, TenantStream{Name: "t", Weight: w})
		}
		if got := TenantRequests(c.n, ts); !slices.Equal(got, c.want) {
			t.Errorf("%d requests by %v: %v, want %v", c.n, c.weights, got, c.want)
		}
	}
}

// TestWorkloadTenantStreams: each tenant's stream is its own (the same
// tokens and times beside another tenant), the prefix pool the spec's, and
// impossible specs refused.
func TestWorkloadTenantStreams(t *testing.T) {
	base := SyntheticSpec{Prefixes: 3, PrefixTokens: 32, TailTokens: 16, OutputTokens: 4, Requests: 20, Concurrency: 1,
		BlockSize: 16, Seed: 7, ArrivalRate: 10}
	alone := base
	alone.Tenants = []TenantStream{{"steady", 1}}
	both := base
	both.Requests, both.ArrivalRate = 220, 110
	both.Tenants = []TenantStream{{"flood", 10}, {"steady", 1}}
	wa, err := NewSynthetic(alone)
	if err != nil {
		t.Fatal(err)
	}
	wb, err := NewSynthetic(both)
	if err != nil {
		t.Fatal(err)
	}
	plain, err := NewSynthetic(base)
	if err != nil {
		t.Fatal(err)
	}
	if plain.TenantOf != nil || wb.Tenants[1] != "steady" || len(wb.Requests) != 220 {
		t.Fatalf("tenants: plain %v, both %v (%d requests)", plain.TenantOf, wb.Tenants, len(wb.Requests))
	}
	var steady []int
	for i, k := range wb.TenantOf {
		if k == 1 {
			steady = append(steady, i)
		}
		if i > 0 && wb.Requests[i].At < wb.Requests[i-1].At {
			t.Fatalf("request %d at %v before request %d at %v", i, wb.Requests[i].At, i-1, wb.Requests[i-1].At)
		}
	}
	if len(steady) != len(wa.Requests) {
		t.Fatalf("steady: %d requests beside the flood, %d alone", len(steady), len(wa.Requests))
	}
	var ta, tb []uint32
	for j, i := range steady {
		ra, rb := wa.Requests[j], wb.Requests[i]
		ta, tb = wa.Tokens(j, ta), wb.Tokens(i, tb)
		if ra.ID != rb.ID || ra.At != rb.At || ra.Prefix != rb.Prefix || !slices.Equal(ta, tb) {
			t.Fatalf("steady request %d: alone %s at %v, beside the flood %s at %v", j, ra.ID, ra.At, rb.ID, rb.At)
		}
		// The pool is the spec's: prefix k is plain's prefix k.
		if !slices.Equal(ta[:32], plain.prefixes[ra.Prefix]) {
			t.Fatalf("steady request %d: prefix %d is not the shared pool's", j, ra.Prefix)
		}
	}
	bad := map[string]SyntheticSpec{}
	closed := alone
	closed.ArrivalRate = 0
	bad["closed loop"] = closed
	agent := alone
	agent.Agent = AgentSpec{Turns: 2}
	bad["agent sessions"] = agent
	twice := both
	twice.Tenants = []TenantStream{{"a", 1}, {"a", 2}}
	bad["a name twice"] = twice
	zero := both
	zero.Tenants = []TenantStream{{"a", 0}}
	bad["zero weight"] = zero
	for name, s := range bad {
		if _, err := NewSynthetic(s); !errors.Is(err, ErrSpec) {
			t.Errorf("%s: %v, want ErrSpec", name, err)
		}
	}
}

// TestWorkloadTenantOwnPrefixes: with TenantPrefixesOwn each tenant's
// prompts come from a pool of its own (the same size and shape as the
// shared one): no block hash is common to two tenants, a tenant's stream
// is the same alone and beside another, and "shared" is the default's
// workload, request for request.
func TestWorkloadTenantOwnPrefixes(t *testing.T) {
	base := SyntheticSpec{Prefixes: 3, PrefixTokens: 32, TailTokens: 16, OutputTokens: 4, Requests: 220, Concurrency: 1,
		BlockSize: 16, Seed: 7, ArrivalRate: 110, Tenants: []TenantStream{{"flood", 10}, {"steady", 1}}}
	build := func(s SyntheticSpec) *Workload {
		t.Helper()
		w, err := NewSynthetic(s)
		if err != nil {
			t.Fatal(err)
		}
		return w
	}
	// blocks is, per tenant, the set of its requests' block hashes.
	blocks := func(w *Workload) []map[uint64]bool {
		out := make([]map[uint64]bool, len(w.Tenants))
		for k := range out {
			out[k] = map[uint64]bool{}
		}
		for i, r := range w.Requests {
			for _, h := range r.Hashes {
				out[w.TenantOf[i]][h] = true
			}
		}
		return out
	}
	commonBlocks := func(w *Workload) int {
		b, n := blocks(w), 0
		for h := range b[1] {
			if b[0][h] {
				n++
			}
		}
		return n
	}
	def, shared := build(base), base
	shared.TenantPrefixes = TenantPrefixesShared
	ws := build(shared)
	var ta, tb []uint32
	for i := range def.Requests {
		ta, tb = def.Tokens(i, ta), ws.Tokens(i, tb)
		if def.Requests[i].ID != ws.Requests[i].ID || !slices.Equal(ta, tb) || !slices.Equal(def.Requests[i].Hashes, ws.Requests[i].Hashes) {
			t.Fatalf("request %d: %q differs from the default", i, TenantPrefixesShared)
		}
	}
	if commonBlocks(ws) == 0 {
		t.Fatal("shared pool: no block common to the two tenants (the check below could not fail)")
	}
	own := base
	own.TenantPrefixes = TenantPrefixesOwn
	wo := build(own)
	if n := commonBlocks(wo); n != 0 {
		t.Fatalf("own pools: %d blocks common to the two tenants", n)
	}
	if len(wo.prefixes) != 2*base.Prefixes || wo.Name == def.Name {
		t.Fatalf("own pools: %d prefixes, name %q", len(wo.prefixes), wo.Name)
	}
	// The steady tenant alone (its share of the requests and the rate),
	// own prefixes too: the same requests as beside the flood.
	alone := own
	alone.Requests, alone.ArrivalRate, alone.Tenants = 20, 10, []TenantStream{{"steady", 1}}
	wa := build(alone)
	j := 0
	for i, r := range wo.Requests {
		if wo.TenantOf[i] != 1 {
			continue
		}
		ra := wa.Requests[j]
		ta, tb = wa.Tokens(j, ta), wo.Tokens(i, tb)
		if ra.ID != r.ID || ra.At != r.At || !slices.Equal(ta, tb) || !slices.Equal(ra.Hashes, r.Hashes) {
			t.Fatalf("steady request %d: alone %s at %v, beside the flood %s at %v", j, ra.ID, ra.At, r.ID, r.At)
		}
		// Its pool is its own, not the shared one.
		if slices.Equal(ta[:32], def.prefixes[r.Prefix%base.Prefixes]) {
			t.Fatalf("steady request %d: prefix from the shared pool", j)
		}
		j++
	}
	if j != len(wa.Requests) {
		t.Fatalf("steady: %d requests beside the flood, %d alone", j, len(wa.Requests))
	}
	bad := map[string]SyntheticSpec{}
	noTenants := own
	noTenants.Tenants = nil
	bad["own without tenants"] = noTenants
	unknown := base
	unknown.TenantPrefixes = "salted"
	bad["unknown"] = unknown
	for name, s := range bad {
		if _, err := NewSynthetic(s); !errors.Is(err, ErrSpec) {
			t.Errorf("%s: %v, want ErrSpec", name, err)
		}
	}
}
