package figures

import (
	"cmp"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
)

// waitWeights are the wait-price table's kv-pooled columns: the weight as
// its file names spell it (ww<weight>-…) and the column's header.
var waitWeights = []struct{ file, head string }{
	{"0", "kv-pooled shipped (weight 0)"}, {"1", "weight 1"}, {"0.3", "weight 0.3"}, {"0.1", "weight 0.1"},
}

// formatWaitPrice: kv-pooled with the expected-wait price at several
// weights on the wide grid's 1,024- and 256-token cells, from
// ww<weight>-w<W>-o<O>-<capacity>.json. The reference columns and kv come
// from the weight-0 runs; each kv-pooled cell is ÷ pooled LRU (÷ one
// engine) · p99 TTFT ms. Rows: outputs longest first, then workers, then
// capacity.
func formatWaitPrice(out Output) (string, error) {
	cols, base, err := weightColumns(out.Dir, "ww", "-w*-o*-*.json", waitWeights)
	if err != nil {
		return "", err
	}
	slices.SortFunc(base, func(a, b *SimReport) int {
		return cmp.Or(-cmp.Compare(a.Config.Synthetic.OutputTokens, b.Config.Synthetic.OutputTokens),
			cmp.Compare(a.Config.Workers, b.Config.Workers),
			cmp.Compare(capacityLabel(a.Config.KVBlocks), capacityLabel(b.Config.KVBlocks)))
	})
	var b strings.Builder
	b.WriteString("| workers | output | capacity | pooled LRU | one engine | kv |")
	for _, w := range waitWeights {
		b.WriteString(" " + w.head + " |")
	}
	b.WriteString("\n|---:|---:|---|---:|---:|---|---|---|---|---|\n")
	for _, r := range base {
		kv, err := r.Policy("kv")
		if err != nil {
			return "", err
		}
		ref := r.Reference
		cells := []string{fmt.Sprint(r.Config.Workers), fmt.Sprint(r.Config.Synthetic.OutputTokens), capacityLabel(r.Config.KVBlocks),
			f3(ref.PooledLRUCachedTokenRatio), f3(ref.EnginePooledCachedTokenRatio), f3(r.pooled(kv)) + " · " + f0(kv.TTFT.P99)}
		key := strings.TrimPrefix(r.File, "ww0-")
		for i, w := range waitWeights {
			x, ok := cols[i][key]
			if !ok {
				return "", fmt.Errorf("the command wrote no %s", filepath.Join("ww"+w.file+"-"+key))
			}
			kp, err := x.Policy("kv-pooled")
			if err != nil {
				return "", err
			}
			one := 0.0
			if e := x.Reference.EnginePooledCachedTokenRatio; e > 0 {
				one = kp.CachedTokenRatio / e
			}
			cells = append(cells, f3(x.pooled(kp))+" ("+f2(one)+") · "+f0(kp.TTFT.P99))
		}
		row(&b, cells...)
	}
	return b.String(), nil
}

// waitWeightsS002 are the seed-002 wait-price table's kv-pooled columns:
// the weight as its file names spell it (sw<weight>-…) and the header.
var waitWeightsS002 = []struct{ file, head string }{
	{"0", "kv-pooled shipped"}, {"1", "weight 1"}, {"0.1", "weight 0.1"},
}

// formatWaitPriceS002: kv-pooled's expected-wait price at several weights
// on seed 002's 24-prefix cells, from sw<weight>-w<W>-c<C>.json. kv comes
// from the weight-0 runs. Cell: ÷ pooled-LRU · p99 TTFT ms. Rows: workers
// descending, then concurrency.
func formatWaitPriceS002(out Output) (string, error) {
	cols, base, err := weightColumns(out.Dir, "sw", "-w*-c*.json", waitWeightsS002)
	if err != nil {
		return "", err
	}
	sortGrid(base)
	cell := func(r *SimReport, policy string) (string, error) {
		x, err := r.Policy(policy)
		if err != nil {
			return "", err
		}
		return f3(r.pooled(x)) + " · " + f0(x.TTFT.P99), nil
	}
	var b strings.Builder
	b.WriteString("| workers | conc. | kv |")
	for _, w := range waitWeightsS002 {
		b.WriteString(" " + w.head + " |")
	}
	b.WriteString("\n|---:|---:|---|" + strings.Repeat("---|", len(waitWeightsS002)) + "\n")
	for _, r := range base {
		kv, err := cell(r, "kv")
		if err != nil {
			return "", err
		}
		cells := []string{fmt.Sprint(r.Config.Workers), fmt.Sprint(r.Config.Synthetic.Concurrency), kv}
		key := strings.TrimPrefix(r.File, "sw0-")
		for i, w := range waitWeightsS002 {
			x, ok := cols[i][key]
			if !ok {
				return "", fmt.Errorf("the command wrote no %s", "sw"+w.file+"-"+key)
			}
			c, err := cell(x, "kv-pooled")
			if err != nil {
				return "", err
			}
			cells = append(cells, c)
		}
		row(&b, cells...)
	}
	return b.String(), nil
}

// weightColumns reads one column of reports per weight, from files named
// <prefix><weight><rest>, keyed by what follows "<prefix><weight>-"; base
// is the first weight's reports (the rows), in no particular order.
func weightColumns(dir, prefix, rest string, weights []struct{ file, head string }) ([]map[string]*SimReport, []*SimReport, error) {
	cols := make([]map[string]*SimReport, len(weights))
	for i, w := range weights {
		reps, err := globSynth(dir, prefix+w.file+rest)
		if err != nil {
			return nil, nil, err
		}
		cols[i] = map[string]*SimReport{}
		for _, r := range reps {
			cols[i][strings.TrimPrefix(r.File, prefix+w.file+"-")] = r
		}
	}
	base := make([]*SimReport, 0, len(cols[0]))
	for _, r := range cols[0] {
		base = append(base, r)
	}
	return cols, base, nil
}
