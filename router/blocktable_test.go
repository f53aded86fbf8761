package router

import (
	"maps"
	"testing"
)

// TestIndexBlockTableAgainstMap runs random inserts, updates and removals
// on a blockTable and a Go map side by side, with keys drawn from a small
// range (long runs, wrap-around, shifts on removal) and the key 0.
func TestIndexBlockTableAgainstMap(t *testing.T) {
	for _, keys := range []uint64{4, 64, 5000} {
		rng := newRand(keys)
		var tab blockTable
		ref := map[uint64]uint64{}
		for step := range 50_000 {
			k := rng.Uint64N(keys)
			if keys == 5000 {
				k *= 0x9e3779b97f4a7c15 // spread, and sometimes 0
			}
			switch op := rng.IntN(10); {
			case op < 5:
				v := rng.Uint64()
				tab.set(k, v)
				ref[k] = v
			case op < 8:
				got, ok := tab.remove(k)
				want, wok := ref[k]
				delete(ref, k)
				if ok != wok || got != want {
					t.Fatalf("keys %d step %d: remove %x = %x %v, want %x %v", keys, step, k, got, ok, want, wok)
				}
			default:
				got, ok := tab.get(k)
				want, wok := ref[k]
				if ok != wok || got != want {
					t.Fatalf("keys %d step %d: get %x = %x %v, want %x %v", keys, step, k, got, ok, want, wok)
				}
			}
			if tab.Len() != len(ref) {
				t.Fatalf("keys %d step %d: len %d, want %d", keys, step, tab.Len(), len(ref))
			}
		}
		if got := maps.Collect(tab.all()); !maps.Equal(got, ref) {
			t.Fatalf("keys %d: walk %d keys, want %d", keys, len(got), len(ref))
		}
		for k, v := range ref {
			if got, ok := tab.get(k); !ok || got != v {
				t.Fatalf("keys %d: %x = %x %v, want %x", keys, k, got, ok, v)
			}
		}
	}
}
