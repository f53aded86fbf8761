package figures

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
)

// capacityLabel is a fleet's capacity as the wide grid names it: the
// blocks per worker when every worker has as many, else "mixed".
func capacityLabel(kv []int) string {
	for _, b := range kv {
		if b != kv[0] {
			return "mixed"
		}
	}
	if len(kv) == 0 {
		return "?"
	}
	return fmt.Sprint(kv[0])
}

// formatWideGrid: kv against kv-pooled beyond seed 002 (3–32 workers,
// outputs 16–1,024 tokens, mixed capacities, Zipf popularity), from
// w<W>-o<O>-<capacity>-<popularity>.json. A row where kv caches more than
// kv-pooled says so after the table's last column.
func formatWideGrid(out Output) (string, error) {
	reps, err := globSynth(out.Dir, "w*-o*-*-*.json")
	if err != nil {
		return "", err
	}
	slices.SortFunc(reps, func(a, b *SimReport) int {
		sa, sb := a.Config.Synthetic, b.Config.Synthetic
		return cmp.Or(cmp.Compare(a.Config.Workers, b.Config.Workers), cmp.Compare(sa.OutputTokens, sb.OutputTokens),
			cmp.Compare(capacityLabel(a.Config.KVBlocks), capacityLabel(b.Config.KVBlocks)),
			cmp.Compare(sa.Popularity, sb.Popularity))
	})
	var b strings.Builder
	b.WriteString("| workers | output | capacity | popularity | pooled LRU | one engine | kv ÷ LRU | **kv-pooled ÷ LRU** | kv-pooled ÷ one engine | p99 TTFT kv-pooled / kv ms | preemptions kv-pooled / kv |\n")
	b.WriteString("|---:|---:|---|---|---:|---:|---:|---:|---:|---|---|\n")
	for _, r := range reps {
		kv, err := r.Policy("kv")
		if err != nil {
			return "", err
		}
		kp, err := r.Policy("kv-pooled")
		if err != nil {
			return "", err
		}
		s, ref := r.Config.Synthetic, r.Reference
		one := 0.0
		if ref.EnginePooledCachedTokenRatio > 0 {
			one = kp.CachedTokenRatio / ref.EnginePooledCachedTokenRatio
		}
		row(&b, fmt.Sprint(r.Config.Workers), fmt.Sprint(s.OutputTokens), capacityLabel(r.Config.KVBlocks), s.Popularity,
			f3(ref.PooledLRUCachedTokenRatio), f3(ref.EnginePooledCachedTokenRatio), f2(r.pooled(kv)), "**"+f3(r.pooled(kp))+"**",
			f3(one), f0(kp.TTFT.P99)+" / "+f0(kv.TTFT.P99), f0(kp.Preemptions)+" / "+f0(kv.Preemptions))
		if kp.CachedTokenRatio < kv.CachedTokenRatio {
			s := strings.TrimSuffix(b.String(), "\n")
			b.Reset()
			b.WriteString(s + " kv caches more\n")
		}
	}
	return b.String(), nil
}
