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
