package figures

import (
	"cmp"
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// sensitivityColumns name the cells of the sensitivity table: file
// v<variant>-<column>.json is column <column> (1-based).
var sensitivityColumns = []string{"sessions 8×4096", "sessions 4×6144+4×2048", "s002 24p 3w c16", "s002 24p 3w c8",
	"zipf1.2 64p 3w c8 shift300", "s002 24p 6w c16", "s002 24p 6w c4", "hetero 24p 6w c16"}

var reSensitivityFile = regexp.MustCompile(`^v(\d+)-(\d+)\.json$`)

// variantLabel names a run's kv-pooled setting from its --pooled-* flags.
func variantLabel(p map[string]float64) (string, error) {
	if len(p) == 0 {
		return "shipped", nil
	}
	if len(p) > 1 {
		return "", fmt.Errorf("more than one kv-pooled setting changed: %v", p)
	}
	for k, v := range p {
		switch {
		case k == "copy_weight" && v == 0:
			return "copy weight 0 (no copy price)", nil
		case k == "output_tokens" && v == 0:
			return "output tokens 0 (reserve: the partial block only)", nil
		case k == "overloaded":
			return fmt.Sprintf("overloaded at %g", v), nil
		}
		return fmt.Sprintf("%s %g", strings.ReplaceAll(k, "_", " "), v), nil
	}
	return "", nil
}

// formatSensitivity: kv-pooled's constants changed one at a time, one row
// per variant (the loop's order), one column per cell. Cell: kv-pooled ÷
// pooled-LRU (its p99 TTFT ÷ kv's).
func formatSensitivity(out Output) (string, error) {
	reps, err := globSim(out.Dir, "v*-*.json")
	if err != nil {
		return "", err
	}
	type key struct{ v, c int }
	byKey := map[key]*SimReport{}
	var vs []int
	for _, r := range reps {
		m := reSensitivityFile.FindStringSubmatch(filepath.Base(r.File))
		if m == nil {
			return "", fmt.Errorf("%s: not v<variant>-<column>.json", r.File)
		}
		v, _ := strconv.Atoi(m[1])
		c, _ := strconv.Atoi(m[2])
		if c < 1 || c > len(sensitivityColumns) {
			return "", fmt.Errorf("%s: column %d of %d", r.File, c, len(sensitivityColumns))
		}
		byKey[key{v, c}] = r
		if !slices.Contains(vs, v) {
			vs = append(vs, v)
		}
	}
	slices.SortFunc(vs, cmp.Compare)
	var b strings.Builder
	row(&b, append([]string{"variant"}, sensitivityColumns...)...)
	b.WriteString("|---" + strings.Repeat("|---", len(sensitivityColumns)) + "|\n")
	for _, v := range vs {
		var label string
		var cells []string
		for c := 1; c <= len(sensitivityColumns); c++ {
			r, ok := byKey[key{v, c}]
			if !ok {
				return "", fmt.Errorf("no v%d-%d.json", v, c)
			}
			l, err := variantLabel(r.Config.Pooled)
			if err != nil {
				return "", fmt.Errorf("%s: %w", r.File, err)
			}
			if c == 1 {
				label = l
			} else if l != label {
				return "", fmt.Errorf("%s: variant %q, its row is %q", r.File, l, label)
			}
			kv, err := r.Policy("kv")
			if err != nil {
				return "", err
			}
			kp, err := r.Policy("kv-pooled")
			if err != nil {
				return "", err
			}
			cells = append(cells, fmt.Sprintf("%s (%s)", f3(r.pooled(kp)), f2(kp.TTFT.P99/kv.TTFT.P99)))
		}
		row(&b, append([]string{label}, cells...)...)
	}
	return b.String(), nil
}
