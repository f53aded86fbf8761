package workload

import (
	"cmp"
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"slices"

	"github.com/kvrouter/kvrouter/internal/splitmix"
)

// TenantStream is one tenant of a synthetic open-loop workload (the
// simulator's --tenants): its name and its weight, its share of the
// arrival rate and of the requests.
type TenantStream struct {
	Name   string
	Weight float64
}

// Per-tenant streams (SyntheticSpec.Tenants). Each tenant's requests are
// an arrival process of their own at its share of the arrival rate, with
// their own prefix draws, tails and ids, all from a seed derived from
// (the spec's seed, the tenant's name): a tenant's requests are the same
// whichever other tenants run beside it, so "the steady tenant with and
// without the flood" compares the same requests, not two random streams.
// By default (TenantPrefixesShared) the prefix pool is the spec's, shared
// by every tenant as before (the prefixes come from the spec's seed alone);
// only the draws from it are per tenant. With TenantPrefixesOwn each
// tenant draws from a pool of its own, of the same size and shape,
// generated from its seed: tenant k's prefix j is w.prefixes[k×Prefixes+j]
// (Request.Prefix is that index), and its prompts are still the same
// whichever other tenants run.

// Tenant prefix pools (SyntheticSpec.TenantPrefixes).
const (
	TenantPrefixesShared = "shared"
	TenantPrefixesOwn    = "own"
)

// tenantSeed is the seed of tenant name's stream in a workload of seed.
func tenantSeed(seed uint64, name string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(name))
	return splitmix.Mix(seed ^ splitmix.Mix(h.Sum64()+splitmix.Gamma))
}

// TenantRequests splits n requests between tenants by weight (largest
// remainder, ties to the earlier tenant): tenant k's count depends only on
// n and the weights' shares, so a tenant alone at its share of the rate and
// of the requests sends exactly the requests it sends beside the others.
func TenantRequests(n int, tenants []TenantStream) []int {
	sum := weightSum(tenants)
	out := make([]int, len(tenants))
	rem := make([]float64, len(tenants))
	left := n
	for k, t := range tenants {
		exact := float64(n) * t.Weight / sum
		out[k] = int(math.Floor(exact + 1e-9))
		rem[k] = exact - float64(out[k])
		left -= out[k]
	}
	order := make([]int, len(tenants))
	for k := range order {
		order[k] = k
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(rem[b], rem[a]) })
	for i := 0; left > 0 && len(order) > 0; i, left = i+1, left-1 {
		out[order[i%len(order)]]++
	}
	return out
}

// weightSum is the tenants' weights summed.
func weightSum(tenants []TenantStream) float64 {
	sum := 0.0
	for _, t := range tenants {
		sum += t.Weight
	}
	return sum
}

func checkTenantStreams(s SyntheticSpec) error {
	switch s.TenantPrefixes {
	case "", TenantPrefixesShared:
	case TenantPrefixesOwn:
		if len(s.Tenants) == 0 {
			return fmt.Errorf("tenant prefixes %q: need per-tenant streams: %w", s.TenantPrefixes, ErrSpec)
		}
	default:
		return fmt.Errorf("tenant prefixes %q: want %s or %s: %w", s.TenantPrefixes, TenantPrefixesShared, TenantPrefixesOwn, ErrSpec)
	}
	if len(s.Tenants) == 0 {
		return nil
	}
	if s.ArrivalRate <= 0 || s.Agent.Turns > 0 {
		return fmt.Errorf("per-tenant streams need an open loop (an arrival rate) of independent requests: %w", ErrSpec)
	}
	seen := map[string]bool{}
	for _, t := range s.Tenants {
		if t.Name == "" || seen[t.Name] || !(t.Weight > 0) || math.IsInf(t.Weight, 0) {
			return fmt.Errorf("tenant %+v: want a new name and a positive finite weight: %w", t, ErrSpec)
		}
		seen[t.Name] = true
	}
	return nil
}

// newTenantStreams fills w's requests with each tenant's stream, merged by
// arrival time (w's prefixes are the shared pool, which TenantPrefixesOwn
// replaces by every tenant's own).
func newTenantStreams(w *Workload, s SyntheticSpec, zipf float64) *Workload {
	type tagged struct {
		req    Request
		tail   []uint32
		tenant int
	}
	var all []tagged
	counts := TenantRequests(s.Requests, s.Tenants)
	sum := weightSum(s.Tenants)
	own := s.TenantPrefixes == TenantPrefixesOwn
	if own {
		w.prefixes = make([][]uint32, 0, len(s.Tenants)*s.Prefixes)
		for _, t := range s.Tenants {
			w.prefixes = append(w.prefixes, prefixPool(tenantSeed(s.Seed, t.Name), s.Prefixes, s.PrefixTokens)...)
		}
	}
	for k, t := range s.Tenants {
		n := counts[k]
		if n == 0 {
			continue
		}
		ts := s
		ts.Seed, ts.Requests = tenantSeed(s.Seed, t.Name), n
		base := 0 // tenant k's first prefix in w.prefixes
		if own {
			base = k * s.Prefixes
		}
		ts.ArrivalRate = s.ArrivalRate * t.Weight / sum
		order := prefixOrder(ts, zipf, n)
		tailRng := rand.New(rand.NewPCG(ts.Seed, 0x7461696c73))
		at := Arrivals(n, ts.ArrivalRate, s.ArrivalCV, ts.Seed)
		for i := range n {
			req := independentRequest(s, fmt.Sprintf("%s.r%d", t.Name, i), base+order[i])
			req.At = at[i]
			all = append(all, tagged{tenant: k, tail: randomTokens(tailRng, s.TailTokens), req: req})
		}
	}
	// Merge by arrival time; a tie goes to the earlier tenant, then the
	// earlier request (each stream is already in time order).
	slices.SortStableFunc(all, func(a, b tagged) int {
		return cmp.Or(cmp.Compare(a.req.At, b.req.At), cmp.Compare(a.tenant, b.tenant))
	})
	w.Requests, w.tails = make([]Request, len(all)), make([][]uint32, len(all))
	w.TenantOf = make([]int, len(all))
	for i, t := range all {
		w.Requests[i], w.tails[i], w.TenantOf[i] = t.req, t.tail, t.tenant
	}
	for _, t := range s.Tenants {
		w.Tenants = append(w.Tenants, t.Name)
	}
	w.OpenLoop, w.ArrivalRate = true, s.ArrivalRate
	w.hashAll()
	return w
}
